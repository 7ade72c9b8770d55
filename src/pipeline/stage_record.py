"""A stage's training_info.json from its start to its end: opened (or resumed: the newest intact checkpoint, the
metrics cut back to it) before the first step, with what the stage starts from, its plan, data, warnings and
provenance; the SFT forward chosen; closed with its summary, forward, judged results and files once it finished."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from src import run_files
from src.audit import run as data_audit
from src.config import EMBEDDED, Config
from src.data import PreparedData, format_summary
from src.distributed import barrier, check_shared_storage, gather_objects, print0
from src.objectives import objective
from src.pipeline.publishing import publish_end
from src.pipeline.stages import Stage, data_locations, stage_title
from src.plan import format_plan
from src.private_api import attention_implementation
from src.provenance import git_commit, versions
from src.reporting.report import headline_judge
from src.reporting.summary import summarize
from src.resource_limits import usable_cores
from src.rounds import rounds_summary
from src.run_safety.checkpoint_manifest import Damaged
from src.run_safety.checkpoint_split import change_line, saved_split
from src.run_safety.checkpoints import (checkpoint_step, newest_complete_checkpoint, newest_intact_checkpoint,
                                        remove_incomplete_checkpoints, trim_metrics)
from src.run_safety.disk_space import write_failures_noted
from src.run_safety.finished_run import data_fingerprint, end_step_done
from src.run_safety.stops import Status
from src.trainers.stage_plan import (examples_per_epoch, planned_steps, resolve_sft_forward, silent_no_op_warnings,
                                     starting_model)
from src.world import World


@dataclass
class StageStart:
    """What a stage knows once its record is open: its planned steps, what it starts from, its warnings (said and
    recorded), its objective's data settings (KTO's weights) and the checkpoint it resumes from (None: from step 0)."""

    total_steps: int
    starts_from: str
    warnings: list[str]
    data_settings: dict
    resume_from: Path | None
    info_path: Path


def open_stage(stage: Stage, model_path: str, prepared: PreparedData, world: World,
               previous: dict | None) -> StageStart:
    """Every rank: the stage's record opened on rank 0 (a stage with checkpoints and none intact stops every rank
    together: Damaged), the checkpoint it resumes from, and its opening lines: where it writes, what it starts from, the
    plan, the data and its audit, its warnings."""
    config, plan = stage.config, stage.plan
    info_path = stage.run_dir / run_files.TRAINING_INFO
    total_steps = planned_steps(len(prepared.train), plan, config, stage.name)
    starts_from, start_warning = starting_model(stage.name, config, model_path, previous and previous["stage"])
    warnings = silent_no_op_warnings(stage.name, config, plan) + stage.model_warnings + \
        ([start_warning] if start_warning else [])
    row = objective(stage.name)
    data_settings, data_line = {}, None
    if row.training.data_settings:  # KTO's desirable / undesirable weights: the flags', or set from the data's counts
        data_settings, data_line, warning = row.training.data_settings(config, prepared.summary["splits"]["train"])
        warnings += [warning] if warning else []
    no_intact_checkpoint = None
    if world.is_main:
        with write_failures_noted(stage.run_dir):  # rank 0's files: a failed write stops every rank at the barrier
            try:
                open_stage_record(stage, model_path, prepared, world, previous, total_steps, warnings, starts_from)
            except Damaged as error:  # said by every rank together, below
                no_intact_checkpoint = str(error)
    barrier()  # rank 0 has removed half-written checkpoints: every rank now sees the same newest complete one
    no_intact_checkpoint = gather_objects([no_intact_checkpoint])[0][0]
    if no_intact_checkpoint:
        raise Damaged(no_intact_checkpoint)
    check_shared_storage(info_path, world)
    resume_from = newest_complete_checkpoint(stage.output_dir) if _resuming(info_path) else None
    print_opening(stage, prepared, starts_from, total_steps, warnings, data_line)
    barrier()
    return StageStart(total_steps, starts_from, warnings, data_settings, resume_from, info_path)


def print_opening(stage: Stage, prepared: PreparedData, starts_from: str, total_steps: int, warnings: list[str],
                  data_line: str | None) -> None:
    print0(f"\n== {stage_title(stage)} → {stage.run_dir}\n  starts from  {starts_from}\n{format_plan(stage.plan)}\n"
           f"  steps      {total_steps}\n"
           f"{format_summary(prepared.summary)}")
    audit_lines = data_audit.format_data_audit(prepared.summary.get("audit") or {}, stage.name)
    if audit_lines:
        print0(audit_lines)
    if data_line:
        print0(data_line)
    remainder_line = untrained_remainder(stage, len(prepared.train))
    if remainder_line:
        print0(remainder_line)
    for warning in warnings:
        print0(f"  warning: {warning}")


def untrained_remainder(stage: Stage, train_rows: int) -> str | None:
    """The console's line when an epoch trains other than its examples once each, to train whole global batches only:
    it leaves the last ones out, or (fewer than one global batch) it repeats some."""
    trained = examples_per_epoch(stage.name, stage.config, stage.plan, train_rows)
    if trained == train_rows:
        return None
    word = objective(stage.name).example_word
    if trained > train_rows:
        return (f"  per epoch  {train_rows} {word} fill less than a global batch of {trained}: its step trains "
                f"{trained - train_rows} of them twice (chosen by the epoch's shuffle), so that any split of processes "
                "gives the same numbers")
    return (f"  per epoch  {trained} of {train_rows} {word}: the last {train_rows - trained} (a partial global batch of "
            f"{stage.plan.global_batch_size}) are not trained, so that any split of processes gives the same numbers; "
            "each epoch leaves out other ones (its own shuffle)")


def training_info(stage: Stage, model_path: str, prepared: PreparedData, world: World) -> dict:
    config, plan = stage.config, stage.plan
    info = {
        "stage": stage.name,
        "run_name": config.training.run_name,
        "model_name_or_path": model_path if config.model.model_name_or_path != EMBEDDED else
        f"{EMBEDDED} ({model_path})",
        "dataset_name": config.data.dataset_name,
        **plan.as_dict(),
        "local_world_size": world.local_world_size,
        "gradient_checkpointing": config.training.gradient_checkpointing,
        "use_lora": config.model.use_peft,
        "load_in_4bit": config.model.load_in_4bit,
        "max_steps": config.training.max_steps,
        "num_epochs": config.training.num_epochs,
        "seed": config.training.seed,
        "max_length": config.data.max_length,
        "trained_per_epoch": examples_per_epoch(stage.name, config, plan, len(prepared.train)),
        "data": {key: value for key, value in prepared.summary.items() if key != "audit"},
        "data_audit": data_audit.opening(prepared.summary, stage.name),
        "versions": versions(),
        "git_commit": git_commit(),
        "data_fingerprint": data_fingerprint(data_locations(stage)),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "recipe": config.recipe,
        "config": config.flat(),
    }
    row = objective(stage.name)
    if row.report.run_info:
        settings = row.training.data_settings(config, prepared.summary["splits"]["train"])[0] if row.training.data_settings else {}
        info.update(row.report.run_info(config, settings))
    if stage.round:
        info["round"] = {"round": stage.round, "of": config.dpo.rounds, "reference": config.dpo.round_reference,
                         "from_prompts": stage.from_prompts, **(stage.round_record or {})}
    return info


def open_stage_record(stage: Stage, model_path: str, prepared: PreparedData, world: World, previous: dict | None,
                      total_steps: int, warnings: list[str], starts_from: str) -> None:
    """Rank 0: training_info.json for a stage that starts (or resumes) now, half-written checkpoints removed."""
    info_path = stage.run_dir / run_files.TRAINING_INFO
    stage.run_dir.mkdir(parents=True, exist_ok=True)
    info = training_info(stage, model_path, prepared, world) | {
        "starts_from": starts_from, "planned_steps": total_steps, "warnings": warnings, "status": Status.RUNNING}
    if previous:  # its judged result in the measure this stage leads with (GRPO after SFT: the mean reward)
        judge = headline_judge(previous["judges"], stage.name) if previous.get("judges") else previous.get("judge")
        info["previous_stage"] = {"stage": previous["stage"], "judge": judge,
                                  "run_dir": os.path.relpath(previous["run_dir"], stage.run_dir)}
    info["resumes"] = prepare_resume(stage, info_path, stage.run_dir / run_files.METRICS)
    run_files.write_json(info_path, info)


def _resuming(info_path: Path) -> bool:
    return run_files.read_json(info_path).get("resumes", []) != [] if info_path.exists() else False


def prepare_resume(stage: Stage, info_path: Path, metrics_path: Path) -> list[dict]:
    """On rank 0, before a stage starts: a stage that ran before and did not finish resumes from its newest intact
    checkpoint (half-written ones are deleted, newer damaged ones set aside, each said in one line) and its metric
    history is cut back to that step; otherwise the stage starts afresh. Returns the resume history to keep in
    training_info.json. Damaged when it has checkpoints and none is intact (nothing changed then)."""
    earlier = run_files.read_json(info_path) if info_path.exists() else {}
    if earlier.get("status") not in (Status.RUNNING, Status.STOPPED):
        metrics_path.unlink(missing_ok=True)
        return []
    checkpoint, lines = newest_intact_checkpoint(stage.output_dir, usable_cores())  # the other ranks wait: all cores
    removed = remove_incomplete_checkpoints(stage.output_dir)  # after it: with none intact, nothing is changed
    for line in lines:
        print0(f"  {line}")
    step = checkpoint_step(checkpoint) if checkpoint else 0
    kept = trim_metrics(run_files.read_jsonl(metrics_path), step)
    metrics_path.unlink(missing_ok=True)
    for record in kept:
        run_files.append_jsonl(metrics_path, record)
    saved = saved_split(checkpoint) if checkpoint else None
    return earlier.get("resumes", []) + [{
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "from_checkpoint": str(checkpoint) if checkpoint else None,
        "from_step": step,
        "saved_by": saved,  # the split that saved the checkpoint, and this launch's processes
        "world_size": stage.plan.world_size,
        "split_change": change_line(saved, stage.plan) if saved else None,
        "previous_status": earlier.get("status"),
        "removed_incomplete_checkpoints": [str(path) for path in removed],
        "damaged_checkpoints_set_aside": [line for line in lines if line.startswith("warning:")],
    }]


def announce_sft_forward(config: Config, model, info_path: Path, warnings: list[str], world: World) -> dict:
    """Which SFT forward runs (packed, padding-free or padded), printed and recorded."""
    sft_forward = resolve_sft_forward(config, attention_implementation(model.config))
    print0(f"  SFT forward: {sft_forward['forward']} ({sft_forward['reason']})")
    if sft_forward["warning"]:
        print0(f"  warning: {sft_forward['warning']}")
    if world.is_main:
        with write_failures_noted(info_path.parent):
            run_files.update_json(info_path, sft_forward=sft_forward,
                                  warnings=warnings + ([sft_forward["warning"]] if sft_forward["warning"] else []))
    return sft_forward


def close_stage_record(stage: Stage, trainer, trackers, judged: dict, saved: dict, started: float) -> dict:
    """Rank 0: the finished stage's summary, forward, judged results and files into training_info.json, then the
    report, the index and the model cards. Returns the judge result the next stage carries ({} without one)."""
    info_path = stage.run_dir / run_files.TRAINING_INFO
    fields = finished_fields(stage, trainer, saved, started)
    carried = {}
    if judged:
        fields["judge"] = headline_judge(judged, stage.name)  # the measure the stage's objective leads with
        fields["judges"] = judged
        carried.update(judge=fields["judge"], judges=judged)
    fields["answers"] = data_audit.answers_of(stage.run_dir)
    data_audit.print_answers(fields["answers"])
    if stage.round and stage.round == stage.config.dpo.rounds:  # the last round: every round, for the report (this
        fields["rounds"] = rounds_summary(stage.run_dir, stage.round, last=fields,  # one's record is being written)
                                          from_prompts=stage.from_prompts)
    trackers.finish(run_files.update_json(info_path, **fields))
    end_step_done("completed")
    publish_end(stage)
    return carried


def finished_fields(stage: Stage, trainer, saved: dict, started: float) -> dict:
    """A finished stage's fields of training_info.json from its trainer: the summary of its metrics, time, memory and
    throughput, the one-job check, the forward that ran, gradient compression (each said on the console as well)."""
    from src.throughput import peak_memory_mb  # transformers' Trainer (~4 s): loaded by now, not for the preflight
    from src.trainers.callbacks import callback  # the training stack (~4 s): loaded by now, not for the preflight

    plan = stage.plan
    meter = callback(trainer, "ThroughputMeter")
    measured = {"wall_time_s": round(time.monotonic() - started, 1), "peak_memory_mb": round(peak_memory_mb(plan.device), 1)}
    summary = summarize(run_files.read_jsonl(stage.run_dir / run_files.METRICS), stage.name)
    summary.update({key: value for key, value in measured.items() if summary.get(key) is None})
    summary["throughput"] = meter.summary()
    one_job = callback(trainer, "OneJobCheck").result
    compression = callback(trainer, "GradientCompression").summary() if plan.ddp_comm_hook != "none" else None
    summary.update(best_checkpoint=trainer.state.best_model_checkpoint, completed_steps=trainer.state.global_step)
    fields = {"summary": summary, "status": Status.COMPLETED, "one_job": one_job, **saved,
              "live_report": callback(trainer, "LiveReport").summary(),
              "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if getattr(trainer, "packed_forward", None) is not None:  # which forward ran, and the tokens it computed
        fields[run_files.FORWARD] = trainer.packed_forward.summary()
    if compression:
        fields["gradient_all_reduce"] = compression
        print0(f"  gradient all-reduce in {compression['name']}: {compression['bytes_per_step']:,} bytes per step "
               f"per rank instead of {compression['uncompressed_bytes_per_step']:,}" if compression["applied"] else
               f"  warning: --ddp_comm_hook {compression['name']} was not applied: {compression['reason']}")
    if one_job and not (one_job["identical_weights"] and one_job["disjoint_rows_per_step"]):
        print0(f"  warning: the ranks did not train as one job: {one_job}")
    return fields
