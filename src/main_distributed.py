"""DPO, SFT, KTO, reward models, GRPO and on-policy rounds on TRL, under torchrun or as a plain process.

    ./run_distributed.sh [NUM_PROCS] [ARGS...]               # torchrun underneath; see README
    python -m src.main_distributed [--config R.yaml] [ARGS]  # one process
    torchrun --nproc_per_node 4 -m src.main_distributed ...  # what run_distributed.sh runs

The pipeline, top to bottom, each step a call into the module that owns it (src/pipeline/: the steps): parse the
config → plan the stages (batch, learning rate, precision, backend) → hold the run directory (a finished run is
finished, not retrained) → the checks → the data (tokenized once per machine, before any process group) → start
the process group → for each stage: its model, answers to held-out prompts (a reward model scores held-out pairs),
its trainer, training, the final model, answers again, judged → its report → copies (--final_model_dir,
--push_to_hub).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: `accelerate launch src/main_distributed.py`, SageMaker's entry point
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from src import library_warnings  # noqa: E402
from src.audit import run as data_audit
from src.config_parse import parse_config
from src.data import PreparedData, prompts_only
from src.distributed import barrier, finish, init, print0
from src.models import save_final_model
from src.objectives import SEQUENCES, objective
from src.pipeline import exits, preflight
from src.pipeline.held_out import judge_held_out, measure_after, measure_before
from src.pipeline.publishing import make_copies, publish_end
from src.pipeline.run_directory import check_earlier_run, finish_finished_run, hold_run_directory
from src.pipeline.stage_record import announce_sft_forward, close_stage_record, open_stage
from src.pipeline.stages import Stage, plan_stages, stage_status, stage_title
from src.pipeline.stopping import watch_job
from src.pipeline.training import (build_stage_trainer, fsdp_loads_whole, load_stage_model, merge_wanted,
                                   stage_adapters, train)
from src.rounds import start_round
from src.run_safety import hang_board
from src.run_safety.disk_space import write_failures_noted, write_failures_reported
from src.run_safety.finished_run import end_step_done
from src.run_safety.parent_watch import watch_launcher
from src.run_safety.stops import Status, install_signal_handlers
from src.world import Devices, World


def run(argv: list[str] | None = None) -> int:
    library_warnings.install()  # the libraries' known-harmless lines kept off the console, any other warning once
    install_signal_handlers()
    if "TORCHELASTIC_RUN_ID" in os.environ or "PREFKIT_EXIT_DIR" in os.environ:  # started by a launcher
        watch_launcher()  # its end (a kill -9 of its process group) stops this process too, as SIGTERM does
    config = parse_config(argv)
    world = World.from_environment()
    devices = Devices.detect()
    preflight.check_launch(config, world, devices)
    # Prompts alone (no chosen/rejected) with --rounds: the rounds start from the model, no offline DPO stage.
    stages = plan_stages(config, world, devices, from_prompts=bool(config.dpo.rounds) and prompts_only(config.data))
    hold = hold_run_directory(stages[-1].run_dir, config.training.dry_run, world)
    # torchrun restarts failed workers with the same flags: --overwrite applies to the launch, not to its restarts.
    overwrite = config.training.overwrite and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if hold is not None and world.is_main:  # what a killed launch's hang watch left (src/run_safety/hang_board.py)
        hang_board.clear_earlier_boards(stages[-1].run_dir)
    finished = check_earlier_run(stages, overwrite)
    if finished:
        return finish_finished_run(stages, config, world, finished)
    if hold is not None and hold.took_over:  # said only for a run that goes on: a finished one says one line
        print0(f"  {stages[-1].run_dir}: took over the hold of a job that is gone ({hold.took_over})")
    if not config.training.dry_run:  # from the start: a restarted job waits in init for every node, even a lost one
        watch_job(stages, world, config, hold)
    preflight.check_sources(config, stages, world)
    ready = preflight.prepare(config, stages)
    if ready is None:  # a --dry_run: it ended with each stage's plan and data
        return 0

    init(stages[0].plan, world)
    if world.is_main and overwrite and stages[-1].run_dir.exists():
        shutil.rmtree(stages[-1].run_dir)
    barrier()
    run_stages(stages, ready, world)
    finish()
    if world.is_main:
        make_copies(stages[-1], config)
    return 0


def run_stages(stages: list[Stage], ready: preflight.Prepared, world: World) -> None:
    """Each stage from the model the one before it saved; a stage an earlier launch finished is reused."""
    model_path, previous, dpo_start = ready.model_path, None, None
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
                previous = run_stage_or_round(stage, model_path, ready.tokenizer, ready.data, world, previous,
                                              dpo_start)
        model_path = previous["model_path"]  # the next stage starts from this one's model


def run_stage_or_round(stage: Stage, model_path: str, tokenizer, prepared: dict, world: World, previous: dict | None,
                       dpo_start: str | None) -> dict:
    """A stage on its prepared data; a round first makes its pairs with the model it starts from (src/rounds.py)."""
    if not stage.round:
        return run_stage(stage, model_path, tokenizer, prepared[stage.name], world, previous)
    model, pairs, stage.round_record = start_round(stage, model_path, tokenizer, prepared[stage.data_stage], world,
                                                   stage_adapters(stage), fsdp_loads_whole(stage))
    reference = dpo_start if stage.config.dpo.round_reference == "start" else None
    return run_stage(stage, model_path, tokenizer, pairs, world, previous, model=model, reference_path=reference)


def run_stage(stage: Stage, model_path: str, tokenizer, prepared: PreparedData, world: World,
              previous: dict | None, model=None, reference_path: str | None = None) -> dict:
    """Train one stage; returns what the next stage needs (its model path and judged results). `model`: the stage's
    starting model when already loaded (a round's, which answered its prompts); `reference_path`: a DPO reference
    other than the starting model (--round_reference start)."""
    started = time.monotonic()
    start = open_stage(stage, model_path, prepared, world, previous)  # its record, the checkpoint it resumes from
    reward = not objective(stage.name).causal_lm  # a sequence classifier: a reward model
    model = load_stage_model(stage, model_path, tokenizer, world, reward, start, model)
    sft_forward = announce_sft_forward(stage.config, model, start.info_path, start.warnings, world) \
        if objective(stage.name).data_shape == SEQUENCES else None
    held_out = measure_before(stage, model, tokenizer, prepared, world, reward)
    if data_audit.judged(stage):
        data_audit.judge_training_pairs(prepared, stage, world, tokenizer)
    os.environ.update(stage.environment)  # read by the tracker integrations when the trainer creates them
    trainer, trackers = build_stage_trainer(stage, model, tokenizer, prepared, start, held_out, sft_forward,
                                            reference_path, world, reward)
    merge = merge_wanted(stage, reward)
    train(trainer, stage, start, merge, world)

    trained = trainer.accelerator.unwrap_model(trainer.model)
    after, pairs_after = measure_after(held_out, stage, trained, tokenizer, prepared, world, reward)
    saved = save_final_model(trainer, tokenizer, stage.output_dir, merge, world.is_main)
    end_step_done("final_model")

    outcome = {"stage": stage.label, "run_dir": str(stage.run_dir), "model_path": saved.get("merged_model",
                                                                                              saved["final_model"])}
    if world.is_main:  # rank 0's files: a failed write stops every rank at the barrier below
        with write_failures_noted(stage.run_dir):
            judged = judge_held_out(stage, held_out, after, pairs_after)
            end_step_done("samples")
            outcome.update(close_stage_record(stage, trainer, trackers, judged, saved, started))
    barrier()
    return outcome


def main(argv: list[str] | None = None) -> int:
    return exits.process_exit(run, argv)


if __name__ == "__main__":
    sys.exit(main())
