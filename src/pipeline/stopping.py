"""A stage that stops before its end: a stop by signal (SIGTERM/SIGINT: a checkpoint saved, the same command resumes)
or a divergence found after trainer.train(), and the watches that stop a job for a lost node or a hang; each stop
recorded in the stage's training_info.json, with its report and the index as the run stopped."""

from __future__ import annotations

import sys
from pathlib import Path

from src import run_files
from src.config import Config
from src.pipeline.publishing import publish_pages_after_stop
from src.pipeline.stages import Stage, stage_status
from src.plan import largest_split, launch_command
from src.run_safety import hang_watch
from src.run_safety.checkpoints import newest_complete_checkpoint
from src.run_safety.exit_status import ExitStatus
from src.run_safety.node_watch import watch
from src.run_safety.parent_watch import launcher_gone
from src.run_safety.stops import SIGNAL_EXIT_CODES, Status, TrainingDiverged
from src.world import World


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


def without_lost_node(config: Config, world: World, arguments: list[str]) -> str | None:
    """The launch that goes on without one lost node: the nodes that remain, each with as many of its processes as
    the global batch splits over (the same numbers on any split); None when no split of them does."""
    best = largest_split(config, world.num_nodes - 1, world.local_world_size)
    if best is None:
        return None
    nodes, per_node = best
    where = "on each of them" if nodes > 1 else "on it"
    return f"{launch_command(arguments, per_node, nodes)} {where} ({nodes * per_node} processes)"


def record_hang(stages: list[Stage], world: World, reason: str) -> None:
    """Rank 0, from the hang watch as it stops the job (src/run_safety/hang_watch.py): the stop in the stage that was
    running, its report and the index."""
    running = [stage for stage in stages if stage_status(stage.run_dir).get("status") == Status.RUNNING]
    if running:
        record_stop(running[0], running[0].run_dir / run_files.TRAINING_INFO, world, Status.STOPPED, reason)


def watch_job(stages: list[Stage], world: World, config: Config, hold) -> None:
    """The watches that stop a job no step will finish: a lost node (--node_timeout, exit 6: its line names the command
    that goes on with the nodes that remain) and a stuck rank (--hang_timeout, exit 7, its stop recorded in the stage
    that was running). Started before the process group: a restarted job waits in init for every node, even a lost
    one."""
    newest = lambda: next(filter(None, (  # noqa: E731
        newest_complete_checkpoint(stage.output_dir) for stage in reversed(stages))), None)
    watch(world, config.training.node_timeout, newest,
          without_lost_node(config, world, sys.argv[1:]) if world.num_nodes > 1 else None)
    hang_watch.start(stages[-1].run_dir, world.rank, world.world_size, config.training.hang_timeout, newest, hold,
                     on_stop=lambda reason, verdict: record_hang(stages, world, reason))
