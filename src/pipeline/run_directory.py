"""A run directory before anything trains in it: one job holds it (src/run_safety/run_lock.py), and what an earlier
launch left there decides what this one does: a finished or diverged run is never replaced unless asked, an unfinished
one is resumed, and the same command on a finished run finishes its end instead of training
(src/run_safety/finished_run.py: what "the same command" is)."""

from __future__ import annotations

import os
from pathlib import Path

from src import run_files
from src.config import Config
from src.config_error import ConfigError
from src.distributed import print0
from src.pipeline.publishing import make_copies, publish_end
from src.pipeline.stages import Stage, data_locations, stage_status
from src.provenance import git_commit
from src.reporting.report import report_verdict
from src.engines import requested
from src.run_safety import launcher_exit
from src.run_safety.checkpoint_split import refusal as resume_refusal, saved_split
from src.run_safety.checkpoints import newest_complete_checkpoint
from src.run_safety.finished_run import differences, finished_line, refusal
from src.run_safety.run_lock import acquire, check_free
from src.run_safety.stops import Status, TrainingDiverged
from src.world import World


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


def check_earlier_run(stages: list[Stage], overwrite: bool) -> dict | None:
    """A finished or diverged run's results are never replaced unless asked; an unfinished one is resumed. A finished
    run relaunched by the same command (src/run_safety/finished_run.py) is returned, to be finished and not trained;
    another command is refused with what differs."""
    run_dir = stages[-1].run_dir
    earlier = stage_status(run_dir)
    if overwrite:
        return None
    check_resumable(stages)
    if not earlier:
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


def check_resumable(stages: list[Stage]) -> None:
    """An unfinished stage goes on from its newest complete checkpoint on any number of processes, with the numbers of
    the run it continues; what cannot (another global batch or engine, a checkpoint its engine cannot reshard:
    src/run_safety/checkpoint_split.py) is refused in one line naming what would make it work, before any process
    group, and nothing of the run is changed."""
    for stage in stages:
        if stage_status(stage.run_dir).get("status") not in (Status.RUNNING, Status.STOPPED):
            continue
        checkpoint = newest_complete_checkpoint(stage.output_dir)
        problem = checkpoint and resume_refusal(checkpoint, saved_split(checkpoint), stage.plan, requested())
        if problem:
            raise ConfigError(problem)


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
