"""DPO, SFT and reward models on TRL, under torchrun or as a plain process.

    ./run_distributed.sh [NUM_PROCS] [ARGS...]               # torchrun underneath; see README
    python -m src.main_distributed [--config R.yaml] [ARGS]  # one process
    torchrun --nproc_per_node 4 -m src.main_distributed ...  # what run_distributed.sh runs

The pipeline, top to bottom: parse config → resolve the plan (batch, learning rate, precision, backend) → prepare the
data (tokenized once per machine, before any process group) → start the process group → for each stage: load the
model, answer held-out prompts (a reward model scores held-out pairs instead), train, answer (score) them again,
judge, save, report, model card → push to the Hub.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):  # run as a script: `accelerate launch src/main_distributed.py`, SageMaker's entry point
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from src import packed_dpo_support, run_files  # noqa: E402
from src.audit import run as data_audit  # noqa: E402
from src.config import EMBEDDED, PROJECT_ROOT, Config
from src.config_error import ConfigError
from src.config_parse import HelpRequested, format_help, parse_config
from src.plan import BatchSplitError, Plan, batch_split_command, format_plan, stage_plans
from src.world import Devices, World, sagemaker_process_hint
from src.data import (PROMPTS, DataError, PreparedData, check_source, format_summary, mixture_sources, prepare_data,
                      prompts_only, source_location, source_names)
from src.distributed import barrier, check_shared_storage, check_world_size, finish, gather_objects, init, print0
from src.engines import check_engine, engine_record, requested as requested_engine
from src.run_safety.build_once import cache_root
from src.generation import generate_answers, stop_ids
from src.hub_access import needs_hub, use_local_cache_if_hub_unreachable, use_local_files_only
from src.input_checks import check_judge, check_model_inputs
from src.judges import JudgeError, judge_for, names_a_reward_model, pair_accuracy, score_pairs
from src.objectives import SEQUENCES, objective
from src.models import (ModelError, apply_chat_template_path, apply_chat_template_to_model, load_model, load_tokenizer,
                        peft_config, resolve_model_path, save_final_model)
from src.preflight_record import record, record_key, recorded
from src.private_api import attention_implementation
from src.publish import PublishError, damaged_model, model_dirs, push_problem, push_to_hub, write_model_cards
from src.reporting.alerts import format_alerts
from src.reporting.index import write_index
from src.reporting.report import ReportError, build_report, headline_judge, health_alerts, report_verdict
from src.reporting.summary import summarize
from src.rounds import round_stage_config, rounds_summary, start_round
from src.tool_calls import ToolsError
from src.tools import check_template, session_for
from src.run_safety import hang_watch, launcher_exit
from src.resource_limits import usable_cores
from src.run_safety.checkpoint_manifest import Damaged
from src.run_safety.checkpoints import (checkpoint_step, newest_complete_checkpoint, newest_intact_checkpoint,
                                        remove_incomplete_checkpoints, trim_metrics)
from src.run_safety.disk_space import (WriteFailed, check_space, estimate_writes, noticed_write_failure, stop_message,
                                       write_failures_noted, write_failures_reported)
from src.run_safety.exit_status import ExitStatus
from src.run_safety.finished_run import data_fingerprint, differences, end_step_done, finished_line, refusal
from src.run_safety.node_watch import watch
from src.run_safety.parent_watch import exit_without_teardown, launcher_gone, watch_launcher
from src.run_safety.run_lock import acquire, check_free
from src.run_safety.stops import SIGNAL_EXIT_CODES, Status, TrainingDiverged, install_signal_handlers
from src.trackers import check_trackers, tracker_environment
from src.trainers.judged_eval import JudgedEval, judge_rows
from src.trainers.stage_plan import planned_steps, resolve_sft_forward, silent_no_op_warnings, starting_model
from src.unneeded_libraries import skip_imports, unneeded_libraries

USER_ERRORS = (ConfigError, DataError, ModelError, JudgeError)
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes")


@dataclass
class Stage:
    """One stage of the run as planned before anything heavy starts."""

    name: str
    config: Config
    plan: Plan
    run_dir: Path
    output_dir: Path
    environment: dict[str, str]  # tracker variables for this stage (where TensorBoard and W&B write)
    round: int = 0  # an on-policy DPO round (src/rounds.py): 1..--rounds; 0 for the stages of the pipeline
    round_record: dict | None = None  # a round's pairs: counts, seconds, where (set when the round starts)
    # What the preflight's model checks found runs but silently worse (src/input_checks.py): said at the stage's start
    model_warnings: list[str] = field(default_factory=list)
    from_prompts: bool = False  # a round of a run from prompts alone: no offline DPO stage before it
    feeds_next: bool = False  # a later stage (of a pipeline, or a round) starts from this stage's model

    @property
    def label(self) -> str:
        return stage_label_of(self.name, self.round)

    @property
    def data_stage(self) -> str:
        """What the stage's data is prepared as: its name, or the prompts the rounds of a run from prompts ask."""
        return PROMPTS if self.from_prompts else self.name


def stage_label_of(name: str, round_index: int) -> str:
    """A stage's name in directories and records: sft, dpo, reward, round1, round2, ..."""
    return f"round{round_index}" if round_index else name


def run_name_for(config: Config) -> str:
    if config.training.run_name:
        return config.training.run_name
    if config.recipe:  # another stage than the recipe's (`--stage dpo` on the default's SFT then DPO): its own run
        name = Path(config.recipe).stem
        return name if config.training.stage == config.recipe_stage else f"{name}-{config.training.stage}"
    model = Path(config.model.model_name_or_path.rstrip("/")).name
    return f"{config.training.stage}-{model}"


def plan_stages(config: Config, world: World, devices: Devices, from_prompts: bool = False) -> list[Stage]:
    """Every stage's config, plan and directories: all validated before the first one starts. --rounds adds DPO
    stages after the DPO stage, one per on-policy round; `from_prompts` (the DPO data is prompts alone): the rounds
    replace the DPO stage, round 1 starting from the model the DPO stage would have started from."""
    run_dir = Path(config.training.results_dir) / run_name_for(config)
    planned = [(name, staged, plan, 0) for name, staged, plan in stage_plans(config, world, devices)]
    if config.dpo.rounds:
        name, staged, plan, _ = planned.pop() if from_prompts else planned[-1]
        planned += [(name, round_stage_config(staged, index), plan, index) for index in range(1, config.dpo.rounds + 1)]
    labels = [stage_label_of(name, index) for name, _staged, _plan, index in planned]
    stages = []
    for label, (name, staged, plan, index) in zip(labels, planned):
        # In a pipeline the final stage's results are the run's; earlier stages get a subdirectory.
        stage_dir = run_dir if label == labels[-1] else run_dir / label
        staged.training.run_name = str(stage_dir.relative_to(config.training.results_dir))
        output_dir = Path(staged.training.output_dir) if staged.training.output_dir else stage_dir / "model"
        if len(labels) > 1 and label != labels[-1] and staged.training.output_dir:
            output_dir = output_dir / label
        preflight = objective(name).preflight
        refusal = preflight(name, staged, plan, world.world_size) if preflight else None
        if refusal:
            raise ConfigError(refusal)
        stages.append(Stage(name, staged, plan, stage_dir, output_dir,
                            tracker_environment(staged.training.report_to, stage_dir), index,
                            from_prompts=from_prompts and index > 0, feeds_next=label != labels[-1]))
    return stages


def check_dpo_forward(stages: list[Stage], model_path: str) -> str | None:
    """Which DPO forward will run, from the model's config alone, before any data is prepared: one warning line when
    the packed forward is refused (src/packed_dpo_support.py), and its reason returned; a model no DPO forward can run
    stops the launch."""
    stage = next((stage for stage in stages if objective(stage.name).packed_forward), None)  # rounds train as it does
    if stage is None:
        return None
    reason = packed_dpo_support.preflight(model_path, stage.config.model, stage.config.trl_overrides,
                                          objective(stage.name).display_name)
    if reason:
        packed_dpo_support.announce_padded(reason)
    return reason


def end_dry_run(stages: list[Stage], model_warnings: dict[str, list[str]], summaries: dict[str, dict]) -> int:
    """A --dry_run's end: each stage's plan, data and model warnings (run_distributed.sh's preflight prints nothing
    here: its workers print the plan)."""
    if os.environ.get("PREFKIT_QUIET_DRY_RUN") == "1":
        return 0
    for stage in stages:
        print0(f"\n== {stage.name.upper()} → {stage.run_dir} (dry run: nothing trained)\n{format_plan(stage.plan)}"
               f"\n{format_summary(summaries[stage.data_stage])}")
        # the stage's own warnings too (a silent no-op, a setting outside its objective's paper's range)
        for warning in silent_no_op_warnings(stage.name, stage.config, stage.plan) + model_warnings.get(stage.name, []):
            print0(f"  warning: {warning}")
    return 0


def stage_status(run_dir: Path) -> dict:
    path = run_dir / run_files.TRAINING_INFO
    return run_files.read_json(path) if path.exists() else {}


def data_locations(stage: Stage) -> list[str]:
    """Where a stage's data comes from: each source of a mixture, or --dataset_name (the embedded default: its
    directory)."""
    data = stage.config.data
    return ([source_location(source, stage.data_stage) for source, _ in mixture_sources(data)] or
            [source_location(data, stage.data_stage)])


def check_earlier_run(stages: list[Stage], overwrite: bool) -> dict | None:
    """A finished or diverged run's results are never replaced unless asked; an unfinished one is resumed. A finished
    run relaunched by the same command (src/run_safety/finished_run.py) is returned, to be finished and not trained;
    another command is refused with what differs."""
    run_dir = stages[-1].run_dir
    earlier = stage_status(run_dir)
    if overwrite or not earlier:
        return None
    if earlier.get("status") == Status.DIVERGED:
        raise TrainingDiverged(earlier.get("stop_reason", f"{run_dir}: the run diverged"))
    if earlier.get("status") != Status.COMPLETED:
        return None
    commit, found = git_commit(), []
    for stage in reversed(stages):  # the run's own keys first; an earlier stage adds only what differs there alone
        label = "" if stage is stages[-1] else stage.label
        for line in differences(stage_status(stage.run_dir), stage.config.flat(), stage.plan.as_dict(),
                                data_locations(stage), commit):
            if line not in found:
                found.append(f"{label} stage: {line}" if label else line)
    if found:
        raise ConfigError(refusal(run_dir, found))
    return earlier


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0]}
    for library in LIBRARIES:
        try:
            found[library] = version(library)
        except PackageNotFoundError:
            found[library] = "not installed"
    return found


def git_commit() -> str | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}{'-dirty' if dirty else ''}" if commit else None


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
    if row.run_info:
        settings = row.data_settings(config, prepared.summary["splits"]["train"])[0] if row.data_settings else {}
        info.update(row.run_info(config, settings))
    if stage.round:
        info["round"] = {"round": stage.round, "of": config.dpo.rounds, "reference": config.dpo.round_reference,
                         "from_prompts": stage.from_prompts, **(stage.round_record or {})}
    return info


def held_out_rows(prepared: PreparedData, split: str, count: int) -> list[dict]:
    """The first `count` rows of a held-out split that have a prompt to answer (a KTO split made from pairs holds each
    pair's prompt once, on its desirable row: the same prompts as the DPO stage's split)."""
    dataset = prepared.splits[split] if split in prepared.splits else None
    if dataset is None or count == 0:
        return []
    rows = dataset.select(range(min(2 * count, len(dataset)))).to_list()  # a KTO pair's rows: one with a sample
    return [row for row in rows if row["sample_prompt_ids"]][:count]


def answer_held_out(model, tokenizer, rows_by_split: dict[str, list[dict]], config: Config,
                    plan: Plan, world: World, tools=None) -> dict[str, list[str]]:
    return {
        split: generate_answers(model, tokenizer, [row["sample_prompt_ids"] for row in rows],
                                config.training.max_new_tokens, max(8, plan.per_device_batch_size * 4), world, tools)
        for split, rows in rows_by_split.items()
    }


def score_held_out_pairs(model, tokenizer, prepared: PreparedData, plan: Plan, world: World) -> dict[str, list]:
    """A reward model's (chosen, rejected) rewards for every pair of the validation and test splits."""
    splits = {"val": prepared.validation, "test": prepared.test}
    return {split: score_pairs(model, list(zip(dataset["chosen_ids"], dataset["rejected_ids"])),
                               tokenizer.pad_token_id, max(8, plan.per_device_batch_size * 4), world)
            for split, dataset in splits.items() if dataset is not None}


def record_samples(run_dir: Path, rows_by_split, before, after, judge) -> dict:
    """samples_<split>.jsonl on rank 0, and the judged results per split. `before` / `after`: per split, each answer as
    generate_answers gives it (its text and the answer audit's numbers, src/generation.py) or as plain text."""
    results = {}
    for split, rows in rows_by_split.items():
        answers = {side: [answer if isinstance(answer, dict) else {"text": answer} for answer in given[split]]
                   for side, given in (("reference", before), ("trained", after))}
        judged = None
        if judge is not None and rows:
            judged = judge.judge(judge_rows(rows), *([answer["text"] for answer in answers[side]]
                                                     for side in ("reference", "trained")))
            results[split] = judged.to_dict()
        path = run_dir / run_files.samples_file(split)
        path.unlink(missing_ok=True)
        for index, row in enumerate(rows):
            stats = {side: {key: value for key, value in answers[side][index].items() if key != "text"}
                     for side in answers}
            run_files.append_jsonl(path, {
                "index": index,
                "split": split,
                "prompt": row["sample_prompt"],
                "reference_answer": answers["reference"][index]["text"],
                "trained_answer": answers["trained"][index]["text"],
                "chosen": row["sample_chosen"],
                "rejected": row["sample_rejected"],
                "meta": row.get("meta") or {},
                "verdict": judged.verdicts[index] if judged else None,
                **({"answer_stats": stats} if all(stats.values()) else {}),
            })
    return results


def tool_session(config: Config, tokenizer, model):
    """The stage's tools (--tools: src/tools.py), checked against the chat template and the model's end tokens before
    anything is sampled; None without --tools."""
    session = session_for(config)
    if session is not None:
        try:
            check_template(tokenizer, stop_ids(model, tokenizer), config.data.chat_template_kwargs)
        except ToolsError as error:
            session.close()
            raise ConfigError(str(error)) from None
    return session


def judged_eval_of(stage: Stage, prepared: PreparedData, rows: dict, before: dict, tokenizer, world: World,
                   tools=None):
    """The held-out prompts an objective whose row sets `judged_eval` (GRPO) judges at the start and each evaluation
    (src/trainers/judged_eval.py): the first --judged_eval_prompts validation prompts, scored by --judge; None without
    them or a judge. Its start reuses the answers judged before training when they are to the same prompts."""
    config = stage.config
    count = config.training.judged_eval_prompts if objective(stage.name).judged_eval else 0
    curve_rows = held_out_rows(prepared, "validation", count)
    judge = judge_for(config.training.judge, config.data.dataset_name) if curve_rows else None
    if judge is None:
        return None
    ids = [row["sample_prompt_ids"] for row in curve_rows]
    start = [answer["text"] for answer in before.get("val", [])][:len(ids)]
    same = [row["sample_prompt_ids"] for row in rows.get("val", [])][:len(ids)] == ids and len(start) == len(ids)
    return JudgedEval(curve_rows, judge, tokenizer, config.training.max_new_tokens,
                      max(8, stage.plan.per_device_batch_size * 4), world, start if same else None, tools)


def run_stage_or_round(stage: Stage, model_path: str, tokenizer, prepared: dict, world: World, previous: dict | None,
                       dpo_start: str | None) -> dict:
    """A stage on its prepared data; a round first makes its pairs with the model it starts from (src/rounds.py)."""
    if not stage.round:
        return run_stage(stage, model_path, tokenizer, prepared[stage.name], world, previous)
    model, pairs, stage.round_record = start_round(stage, model_path, tokenizer, prepared[stage.data_stage], world)
    reference = dpo_start if stage.config.dpo.round_reference == "start" else None
    return run_stage(stage, model_path, tokenizer, pairs, world, previous, model=model, reference_path=reference)


def stage_title(stage: Stage) -> str:
    return f"DPO ROUND {stage.round} of {stage.config.dpo.rounds}" if stage.round else stage.name.upper()


def run_stage(stage: Stage, model_path: str, tokenizer, prepared: PreparedData, world: World,
              previous: dict | None, model=None, reference_path: str | None = None) -> dict:
    """Train one stage; returns what the next stage needs (its model path and judged results). `model`: the stage's
    starting model when already loaded (a round's, which answered its prompts); `reference_path`: a DPO reference
    other than the starting model (--round_reference start)."""
    # The training stack (TRL, transformers' Trainer, peft, bitsandbytes: ~5 s): not imported for the preflight.
    from src.trainers.build import build_trainer
    from src.trainers.trl_config import build_trl_config

    config, plan = stage.config, stage.plan
    started = time.monotonic()
    metrics_path = stage.run_dir / run_files.METRICS
    info_path = stage.run_dir / run_files.TRAINING_INFO
    total_steps = planned_steps(len(prepared.train), plan, config)
    starts_from, start_warning = starting_model(stage.name, config, model_path, previous and previous["stage"])
    warnings = silent_no_op_warnings(stage.name, config, plan) + stage.model_warnings + \
        ([start_warning] if start_warning else [])
    row = objective(stage.name)
    data_settings, data_line = {}, None
    if row.data_settings:  # KTO's desirable / undesirable weights: the flags', or set from the data's counts
        data_settings, data_line, warning = row.data_settings(config, prepared.summary["splits"]["train"])
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
    print0(f"\n== {stage_title(stage)} → {stage.run_dir}\n  starts from  {starts_from}\n{format_plan(plan)}\n"
           f"  steps      {total_steps}\n"
           f"{format_summary(prepared.summary)}")
    audit_lines = data_audit.format_data_audit(prepared.summary.get("audit") or {}, stage.name)
    if audit_lines:
        print0(audit_lines)
    if data_line:
        print0(data_line)
    for warning in warnings:
        print0(f"  warning: {warning}")
    barrier()

    reward = not row.causal_lm  # a sequence classifier: a reward model
    if reward:  # the score head starts random: one seed gives every rank the same head to score "before" with
        from transformers import set_seed

        set_seed(config.training.seed)
    if model is None:
        model = load_model(model_path, config.model, plan, world,
                           reward_pad_token_id=tokenizer.pad_token_id if reward else None)
        model = apply_chat_template_to_model(model, tokenizer, config.model.chat_template_path)
    sft_forward = announce_sft_forward(config, model, info_path, warnings, world) \
        if row.data_shape == SEQUENCES else None
    # A reward model answers no prompts: it is measured by how it ranks the held-out pairs instead.
    rows = {} if reward else {split: held_out_rows(prepared, split, config.training.num_samples)
                              for split in ("validation", "test")}
    rows = {("val" if split == "validation" else split): value for split, value in rows.items() if value}
    tools = tool_session(config, tokenizer, model)
    before = answer_held_out(model, tokenizer, rows, config, plan, world, tools)
    pairs_before = score_held_out_pairs(model, tokenizer, prepared, plan, world) if reward else {}
    if data_audit.judged(stage):
        data_audit.judge_training_pairs(prepared, stage, world)

    os.environ.update(stage.environment)  # read by the tracker integrations when the trainer creates them
    # Held-out prompts without answers (a run from prompts alone) are judged before and after, not evaluated on a
    # loss; an objective whose evaluation is judged (GRPO) judges some of them at each evaluation as well.
    judged_eval = judged_eval_of(stage, prepared, rows, before, tokenizer, world, tools)
    evaluated = judged_eval is not None or (prepared.validation is not None and not {
        "chosen_ids", "completion_ids", "input_ids"}.isdisjoint(prepared.validation.column_names))
    trl_config = build_trl_config(stage.name, config, plan, stage.output_dir, evaluated, total_steps, sft_forward,
                                  data_settings)
    trainer = build_trainer(stage.name, model, tokenizer, trl_config, prepared, peft_config(config.model, reward),
                            metrics_path, plan, truncate_to=config.data.max_length
                            if getattr(trl_config, "max_length", None) is None else None,
                            packed_dpo=packed_dpo_support.padding_free_requested(config.trl_overrides),
                            packed_attention=plan.packed_attention,
                            ref_model=load_model(reference_path, config.model, plan, world) if reference_path else None,
                            trainer_inputs=row.trainer_inputs(config) if row.trainer_inputs else None)
    from src.trackers import TrackerRecord  # built on transformers' TrainerCallback (~4 s): not for the preflight

    trackers = TrackerRecord(config.training.report_to, info_path, stage.environment.get("TENSORBOARD_LOGGING_DIR"))
    trainer.add_callback(trackers)
    if judged_eval is not None:
        trainer.judged_eval = judged_eval
    if tools is not None and hasattr(trainer, "use_tools"):
        trainer.use_tools(tools)
        trainer.turn_credit = config.training.turn_credit
    if world.is_main and row.needs_reference and "reference" in row.audit_parts:
        data_audit.reference_part(trainer.train_dataset, stage, trainer.args.max_length)
    if world.is_main and getattr(trainer, "reference_cache", None):
        with write_failures_noted(stage.run_dir):
            run_files.update_json(info_path, reference_log_probs=trainer.reference_cache)
        for split, outcome in trainer.reference_cache.items():
            print0(f"  reference log-probs ({split}): {outcome['cache']} in {outcome['seconds']} s"
                   f"{'' if outcome['cache'] == 'reused' else ' and cached for later runs'}")
    # Merged copies that are needed, not just asked for: the next stage of a pipeline (or the next round) starts from
    # this stage's model, and a LoRA reward model loads as a judge only merged (its adapter's base config knows nothing
    # of the score head).
    merge = config.model.merge_adapter or (config.model.use_peft and (
        stage.feeds_next or (reward and not config.model.load_in_4bit)))
    check_disk_space(trainer, total_steps, merge, stage, world)
    check_world_size(trainer.args.world_size, world)
    if world.is_main:  # what accelerate actually runs (DDP, FSDP, DeepSpeed), which a launcher config decides
        with write_failures_noted(stage.run_dir):
            run_files.update_json(info_path, distributed_type=str(trainer.accelerator.distributed_type.value),
                                  **engine_record(trainer.accelerator))
    if resume_from:
        print0(f"  resuming from {resume_from} (step {checkpoint_step(resume_from)} of {total_steps})")
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    barrier()  # a write that failed after the last step's check (the last metrics line, the live report) stops here
    stop_if_interrupted(trainer, stage, info_path, world)
    end_step_done("trained")  # from here on a kill is resumed from the final checkpoint: nothing trains again

    trained = trainer.accelerator.unwrap_model(trainer.model)
    after = answer_held_out(trained, tokenizer, rows, config, plan, world, tools)
    if tools is not None:
        tools.close()
    pairs_after = score_held_out_pairs(trained, tokenizer, prepared, plan, world) if reward else {}
    saved = save_final_model(trainer, tokenizer, stage.output_dir, merge, world.is_main)
    end_step_done("final_model")

    outcome = {"stage": stage.label, "run_dir": str(stage.run_dir), "model_path": saved.get("merged_model",
                                                                                              saved["final_model"])}
    if world.is_main:  # rank 0's files: a failed write stops every rank at the barrier below
        with write_failures_noted(stage.run_dir):
            judge = judged_eval.judge if judged_eval else judge_for(config.training.judge, config.data.dataset_name)
            judged = record_samples(stage.run_dir, rows, before, after, judge if rows else None)
            judged.update({split: pair_accuracy(pairs_before[split], scores).to_dict()
                           for split, scores in pairs_after.items()})
            end_step_done("samples")
            outcome.update(close_stage_record(stage, trainer, trackers, judged, saved, started))
    barrier()
    return outcome


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
    from src.throughput import peak_memory_mb  # transformers' Trainer (~4 s): loaded by now, not for the preflight
    from src.trainers.callbacks import callback  # the training stack (~4 s): loaded by now, not for the preflight

    plan, info_path = stage.plan, stage.run_dir / run_files.TRAINING_INFO
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


def publish_end(stage: Stage, announce: bool = True) -> None:
    """Rank 0, once a stage is completed: its pages, each rewritten whole from the run directory, so a relaunch
    redoes whatever a kill interrupted (src/run_safety/finished_run.py): report and plots, results/index.md, the model
    cards. `announce`: print where they are (and the health alerts)."""
    publish_report(stage.run_dir, stage.name, announce)
    end_step_done("report")
    publish_index(stage)
    end_step_done("index")
    for directory in write_model_cards(stage.run_dir).values():
        if announce:
            print0(f"  model card: {directory / 'README.md'}")
    end_step_done("model_card")


def check_disk_space(trainer, total_steps: int, merge: bool, stage: Stage, world: World) -> None:
    """Rank 0 estimates what the stage will write (src/run_safety/disk_space.py) against the free space and records
    it in training_info.json; every rank stops with rank 0's space check, before the first step."""
    space_check = (None, None)  # (error, warning)
    if world.is_main:
        estimate = estimate_writes(trainer.model, trainer.args, total_steps, merge, stage.output_dir)
        space_check = check_space(estimate, stage.output_dir, trainer.args.save_total_limit)
        with write_failures_noted(stage.run_dir):
            run_files.update_json(stage.run_dir / run_files.TRAINING_INFO,
                                  disk_estimate={"bytes": estimate.total, "breakdown": estimate.breakdown()})
    error, warning = gather_objects([space_check])[0][0]
    if warning:
        print0(f"  warning: {warning}")
    if error:
        raise ConfigError(error)


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
    return earlier.get("resumes", []) + [{
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "from_checkpoint": str(checkpoint) if checkpoint else None,
        "from_step": step,
        "previous_status": earlier.get("status"),
        "removed_incomplete_checkpoints": [str(path) for path in removed],
        "damaged_checkpoints_set_aside": [line for line in lines if line.startswith("warning:")],
    }]


class StoppedBySignal(Exception):
    """SIGTERM/SIGINT: the job saved a checkpoint and exits; the same command resumes it."""

    def __init__(self, signal_name: str, message: str):
        super().__init__(message)
        self.exit_code = SIGNAL_EXIT_CODES.get(signal_name, ExitStatus.SIGTERM)


def stop_if_interrupted(trainer, stage: Stage, info_path: Path, world: World) -> None:
    """After trainer.train(): record and raise a stop by signal or a divergence, so nothing after training (final
    save, sample answers) runs on a model that is not finished or not finite."""
    from src.trainers.callbacks import callback  # the training stack (~4 s): loaded by now, not for the preflight

    conditions = callback(trainer, "StopConditions")
    if conditions.diverged_at is not None:
        good = newest_complete_checkpoint(stage.output_dir)
        message = (f"{stage.run_dir}: training diverged at step {conditions.diverged_at} ({conditions.non_finite}); "
                   f"nothing was saved from that step; the last good checkpoint is {good or 'none (none saved yet)'}. "
                   "Lower the learning rate (or raise warmup), then relaunch with --overwrite or a new --run_name")
        record_stop(stage, info_path, world, Status.DIVERGED, message)
        raise TrainingDiverged(message)
    if conditions.stopped_at is not None:
        message = (f"stopped by {conditions.stopped_by} at step {conditions.stopped_at}: checkpoint "
                   f"{newest_complete_checkpoint(stage.output_dir)} saved; run the same command (without --overwrite) "
                   "to resume")
        record_stop(stage, info_path, world, Status.STOPPED, message)
        raise StoppedBySignal(conditions.stopped_by, message)


def record_stop(stage: Stage, info_path: Path, world: World, status: str, message: str) -> None:
    """Rank 0: the stop and its reason into training_info.json, then the report and index as the run stopped. A job
    whose launcher is gone frees its devices first: its pages wait for the relaunch (or `python -m src.reporting`)."""
    if world.is_main:
        run_files.update_json(info_path, status=status, stop_reason=message)
        if not launcher_gone():
            publish_pages_after_stop(stage)


def record_hang(stages: list[Stage], world: World, reason: str) -> None:
    """Rank 0, from the hang watch as it stops the job (src/run_safety/hang_watch.py): the stop in the stage that was
    running, its report and the index."""
    running = [stage for stage in stages if stage_status(stage.run_dir).get("status") == Status.RUNNING]
    if running:
        record_stop(running[0], running[0].run_dir / run_files.TRAINING_INFO, world, Status.STOPPED, reason)


def publish_report(run_dir: Path, stage: str, announce: bool = True) -> None:
    """Plots, sample text files and report.md from the run directory alone; health alerts on the console."""
    report = build_report(run_dir)
    if not announce:
        return
    alerts = health_alerts(run_files.read_jsonl(run_dir / run_files.METRICS), stage_status(run_dir), stage)
    if alerts:
        print0(format_alerts(alerts))
    print0(f"  report: {report}")


def publish_pages_after_stop(stage: Stage) -> None:
    """The report as the run stopped (the status line says stopped or diverged) and the index."""
    try:
        publish_report(stage.run_dir, stage.name)
    except ReportError as error:  # stopped before its first log: nothing to report, the exit says why
        print0(f"  no report: {error}")
    publish_index(stage)


def publish_index(stage: Stage) -> None:
    """results/index.md, every run in the results folder, rewritten when a stage ends (finished, stopped, diverged)."""
    write_index(stage.config.training.results_dir)


def export_final_model(stage: Stage, target: Path) -> None:
    """--final_model_dir (SageMaker's SM_MODEL_DIR): the final model with its card at the top, the merged copy in
    merged/, so `from_pretrained(target)` loads it."""
    dirs = model_dirs(stage.run_dir, stage_status(stage.run_dir))
    shutil.copytree(dirs["final"], target, dirs_exist_ok=True)
    if "merged" in dirs:
        shutil.copytree(dirs["merged"], target / "merged", dirs_exist_ok=True)
    run_files.update_json(stage.run_dir / run_files.TRAINING_INFO, final_model_dir=str(target.resolve()))
    print0(f"  final model copied to {target}")


def make_copies(stage: Stage, config: Config) -> None:
    """Rank 0, after the run: --final_model_dir and --push_to_hub, each unless training_info.json records it done
    (a relaunch of a finished run makes what a kill left unmade)."""
    info = stage_status(stage.run_dir)
    target = config.training.final_model_dir
    export = target and info.get("final_model_dir") != str(Path(target).resolve())
    push = config.hub.push_to_hub and not (info.get("hub") or {}).get("pushed")
    damaged = damaged_model(stage.run_dir) if export or push else None  # one read of the model, checked once
    if damaged:
        asked = " and ".join(flag for flag, wanted in (("--final_model_dir", export), ("--push_to_hub", push)) if wanted)
        raise Damaged(f"{asked} refused: {damaged}")
    if export:
        export_final_model(stage, Path(target))
    if push:
        push_final_model(stage, config)


def push_final_model(stage: Stage, config: Config) -> None:
    """--push_to_hub, on rank 0 once everything is saved. A failed push is a message and a record in
    training_info.json, never a lost run: the model stays in the run directory and can be pushed later."""
    hub, info_path = config.hub, stage.run_dir / run_files.TRAINING_INFO
    try:
        pushed = push_to_hub(stage.run_dir, hub.hub_model_id, hub.hub_private_repo)
    except PublishError as error:
        run_files.update_json(info_path, hub={"repo_id": hub.hub_model_id, "pushed": False, "error": str(error)})
        print0(f"  warning: not pushed to the Hub: {error}. The model is saved in {stage.output_dir / 'final'}; push "
               f"it later with: python -m src.publish {stage.run_dir} --hub_model_id {hub.hub_model_id}")
        return
    run_files.update_json(info_path, hub={"repo_id": hub.hub_model_id, "pushed": True, "repositories": pushed})
    for url in pushed.values():
        print0(f"  pushed to the Hub: {url}")


def hub_sources(config: Config, stages: list[Stage]) -> list[str]:
    """The model, data and judge names that may need the Hub: the embedded default and local paths never do."""
    names = [config.model.model_name_or_path] + [name for stage in stages for name in source_names(stage.config.data)]
    return [name for name in names + reward_model_judge(config) if name != EMBEDDED]


def reward_model_judge(config: Config) -> list[str]:
    """--judge when it names a reward model (a path or Hub id), else nothing."""
    judge = config.training.judge
    return [judge] if names_a_reward_model(judge) else []


def quiet_libraries() -> None:
    """Progress bars from datasets and transformers drown the plan and the metrics on the console."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    # TRL 1.16 still calls a transformers method that transformers 5 renamed; the warning is theirs, once per rank.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated", category=FutureWarning)


def hold_run_directory(run_dir: Path, dry_run: bool, world: World):
    """One job per run directory (src/run_safety/run_lock.py): rank 0 takes the hold before anything is written (and
    returns it); a dry run (run_distributed.sh's preflight among them) only checks that no live job holds it."""
    if dry_run:
        check_free(run_dir)
    elif world.is_main:
        return take_hold(run_dir)
    return None


def take_hold(run_dir: Path):
    """Hold `run_dir` for this process's job (released when it ends) and remove what a killed job left half-written."""
    hold = acquire(run_dir)
    run_files.remove_temporary_files(run_dir)  # half-written files of a killed job: nobody else writes here
    return hold


def finish_finished_run(stages: list[Stage], config: Config, world: World, record: dict) -> int:
    """The same command relaunched on a finished run (src/run_safety/finished_run.py): rank 0 redoes the pages of the
    run's end (report and plots, index, model cards: a kill may have interrupted them), makes the copies asked for
    that the run does not record (--final_model_dir, --push_to_hub), and releases the hold; one line says the run is
    finished; nothing trains, no process group starts. A --dry_run writes nothing; run_distributed.sh's preflight does
    it all, then tells the launcher that no worker needs to start."""
    stage = stages[-1]
    launcher_preflight = config.training.dry_run and os.environ.get("PREFKIT_QUIET_DRY_RUN") == "1"
    if world.is_main and (launcher_preflight or not config.training.dry_run):
        hold = take_hold(stage.run_dir) if launcher_preflight else None
        try:
            publish_end(stage, announce=False)
            make_copies(stage, config)  # a damaged final model stops here (Damaged): the hold is released all the same
        finally:
            if hold is not None:
                hold.release()
    print0(f"  {finished_line(stage.run_dir, record, report_verdict(stage.run_dir))}")
    if launcher_preflight:
        launcher_exit.record_finished()
    return 0


def run(argv: list[str] | None = None) -> int:
    install_signal_handlers()
    if "TORCHELASTIC_RUN_ID" in os.environ or "PREFKIT_EXIT_DIR" in os.environ:  # started by a launcher
        watch_launcher()  # its end (a kill -9 of its process group) stops this process too, as SIGTERM does
    config = parse_config(argv)
    world = World.from_environment()
    devices = Devices.detect()
    check_engine(requested_engine(), devices.kind, config.training.ddp_comm_hook,  # src/engines.py
                 config.model.load_in_4bit)
    idle_gpus = sagemaker_process_hint(world)
    if idle_gpus:
        print0(f"  warning: {idle_gpus}")
    for note in check_trackers(config.training.report_to):
        print0(f"  {note}")
    # Prompts alone (no chosen/rejected) with --rounds: the rounds start from the model, no offline DPO stage.
    stages = plan_stages(config, world, devices, from_prompts=bool(config.dpo.rounds) and prompts_only(config.data))
    hold = hold_run_directory(stages[-1].run_dir, config.training.dry_run, world)
    # torchrun restarts failed workers with the same flags: --overwrite applies to the launch, not to its restarts.
    overwrite = config.training.overwrite and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if hold is not None and world.is_main:  # what a killed launch's hang watch left (src/run_safety/hang_watch.py)
        hang_watch.clear_earlier_boards(stages[-1].run_dir)
    finished = check_earlier_run(stages, overwrite)
    if finished:
        return finish_finished_run(stages, config, world, finished)
    if hold is not None and hold.took_over:  # said only for a run that goes on: a finished one says one line
        print0(f"  {stages[-1].run_dir}: took over the hold of a job that is gone ({hold.took_over})")
    if not config.training.dry_run:  # from the start: a restarted job waits in init for every node, even a lost one
        newest = lambda: next(filter(None, (  # noqa: E731
            newest_complete_checkpoint(stage.output_dir) for stage in reversed(stages))), None)
        watch(world, config.training.node_timeout, newest)
        hang_watch.start(stages[-1].run_dir, world.rank, world.world_size, config.training.hang_timeout, newest, hold,
                         on_stop=lambda reason, verdict: record_hang(stages, world, reason))
    for stage in stages:
        check_source(stage.config.data, stage.data_stage)
    check_judge(config.training.judge)
    hub_names = hub_sources(config, stages)
    if not needs_hub(hub_names) and not config.hub.push_to_hub:
        use_local_files_only()  # nothing to fetch or push: no probe, no message, no network calls
    elif use_local_cache_if_hub_unreachable(hub_names) and os.environ.get("PREFKIT_PREFLIGHT_DONE") != "1":
        print0("  the Hugging Face Hub is unreachable: using the local cache only (HF_HUB_OFFLINE=1)")
    push_blocked = push_problem() if config.hub.push_to_hub and world.is_main else None  # rank 0 pushes
    if push_blocked:
        print0(f"  warning: --push_to_hub: {push_blocked}; training goes ahead and the model will be saved locally")
    model_path = resolve_model_path(config.model, config.data.embedded_reasoning)
    # A preflight that passed with these very inputs is not redone (src/preflight_record.py): ~4 s of imports.
    preflight_key = record_key(config, stages, model_path) if config.training.dry_run else None
    passed = recorded(cache_root(), preflight_key)
    if passed is not None:
        if passed["padded_reason"]:
            packed_dpo_support.announce_padded(passed["padded_reason"])
        return end_dry_run(stages, passed["model_warnings"], passed["summaries"])
    quiet_libraries()
    tokenizer = apply_chat_template_path(load_tokenizer(model_path, config.model.trust_remote_code),
                                         config.model.chat_template_path)
    model_warnings = check_model_inputs(model_path, config, tokenizer, stages)
    for stage in stages:
        stage.model_warnings = model_warnings.get(stage.name, [])
    padded_reason = check_dpo_forward(stages, model_path)
    # Every stage's data is checked and tokenized now, before any process group or model exists.
    with write_failures_reported(stages[-1].output_dir):  # the prepared-data cache: one process, no peers yet
        prepared = {stage.data_stage: prepare_data(stage.config.data, stage.config.sft, stage.data_stage,
                                                   stage.config.training.seed, tokenizer, cache_root() / "datasets")
                    for stage in stages}
    if config.training.dry_run:
        record(cache_root(), preflight_key, prepared, model_warnings, padded_reason)
        return end_dry_run(stages, model_warnings, {name: data.summary for name, data in prepared.items()})
    skip_imports(unneeded_libraries(config, [model_path] + reward_model_judge(config)))  # ~2.6 s of every start

    init(stages[0].plan, world)
    if world.is_main and overwrite and stages[-1].run_dir.exists():
        shutil.rmtree(stages[-1].run_dir)
    barrier()
    previous, dpo_start = None, None
    for stage in stages:
        earlier = stage_status(stage.run_dir)
        if objective(stage.name).on_policy_rounds and dpo_start is None:
            dpo_start = model_path  # --round_reference start: every round's reference (the first DPO stage's start)
        if stage is not stages[-1] and earlier.get("status") == Status.COMPLETED:
            print0(f"\n== {stage_title(stage)} → {stage.run_dir}: finished in an earlier launch, reused")
            if world.is_main:  # its pages, which a kill after it finished may have left unwritten
                publish_end(stage, announce=False)
            previous = {"stage": stage.label, "run_dir": str(stage.run_dir), "judge": earlier.get("judge"),
                        "judges": earlier.get("judges"),
                        "model_path": earlier.get("merged_model", earlier["final_model"])}
        else:
            with write_failures_reported(stage.output_dir):
                previous = run_stage_or_round(stage, model_path, tokenizer, prepared, world, previous, dpo_start)
        model_path = previous["model_path"]  # the next stage starts from this one's model
    finish()
    if world.is_main:
        make_copies(stages[-1], config)
    return 0


def main(argv: list[str] | None = None) -> int:
    if launcher_exit.recorded() is not None:  # torchrun restarted this worker after the job chose to stop
        return 0
    try:
        code = launcher_exit.settle(exit_status(argv))
    except BaseException:
        if not launcher_gone():
            raise
        # a peer gone from a collective: its launcher is gone too, and its watch ended it (run_safety/parent_watch.py)
        print(f"error: rank {World.from_environment().rank}: stopped, its launcher is gone", file=sys.stderr)
        code = ExitStatus.SIGTERM
    # A worker under torchrun (or whose launcher is gone) exits once its exit handlers ran, without the interpreter's
    # teardown: its devices are freed at once, and no daemon thread still inside a C++ call (a store or gloo wait, a
    # library's own) is unwound mid-call by the teardown, which aborts the process ("terminate called without an
    # active exception", exit -6) after a job that finished: seen once in a GRPO 2-process test in CI.
    if launcher_gone() or "TORCHELASTIC_RUN_ID" in os.environ:
        exit_without_teardown(code)
    return code


def exit_status(argv: list[str] | None = None) -> int:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    arguments = [arg for arg in (argv if argv is not None else sys.argv[1:]) if arg != "--debug"]
    try:
        return run(arguments)
    except HelpRequested:
        print(format_help())
        return 0
    except USER_ERRORS as error:
        if debug:
            raise
        world = World.from_environment()
        if world.is_main:
            # A batch the processes cannot share: the command that runs, with the nearest batch that splits.
            command = f"; run: {batch_split_command(error, arguments, world.local_world_size)}" if isinstance(
                error, BatchSplitError) else ""
            print(f"error: {error}{command}", file=sys.stderr, flush=True)
        return ExitStatus.USER_ERROR
    except TrainingDiverged as error:
        if World.from_environment().is_main:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return ExitStatus.DIVERGED
    except StoppedBySignal as stop:
        print0(f"  {stop}")
        return stop.exit_code
    except Damaged as error:  # every rank raises it together (train_stage), or rank 0 alone after the run (make_copies)
        if debug:
            raise
        if World.from_environment().is_main:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return ExitStatus.DAMAGED
    except WriteFailed as error:  # every rank raises it together (src/distributed.py barrier); rank 0 says it
        if debug:
            raise
        if error.alone or World.from_environment().is_main:  # alone: no other rank knows of it
            print(f"error: {error}", file=sys.stderr, flush=True)
        return ExitStatus.WRITE_FAILED
    except Exception:
        # A stop already chosen (a write that failed here, or another rank's recorded exit status): this error is its
        # echo (a peer gone from a collective: gloo's "Connection closed by peer"), not news. One line, no traceback.
        hang_watch.wait_if_stopping()  # a hang's stop: the watch ends this process (src/run_safety/hang_watch.py)
        chosen, failure = launcher_exit.recorded(), noticed_write_failure()
        if debug or (chosen is None and failure is None):
            raise
        if failure is not None:
            print(f"error: {stop_message([failure])}", file=sys.stderr, flush=True)
            return ExitStatus.WRITE_FAILED
        return chosen


if __name__ == "__main__":
    sys.exit(main())
