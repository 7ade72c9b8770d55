"""What rank 0 publishes once a stage ends: its pages, each rewritten whole from the run directory (report and plots,
results/index.md, the model cards), so a relaunch redoes whatever a kill interrupted; and the run's copies after it
(--final_model_dir, --push_to_hub), each made once, never of a damaged model."""

from __future__ import annotations

import shutil
from pathlib import Path

from src import run_files
from src.config import Config
from src.distributed import print0
from src.pipeline.stages import Stage, stage_status
from src.publish import PublishError, damaged_model, model_dirs, push_to_hub, write_model_cards
from src.reporting.alerts import format_alerts
from src.reporting.index import write_index
from src.reporting.report import ReportError, build_report, health_alerts
from src.run_safety.checkpoint_manifest import Damaged
from src.run_safety.finished_run import end_step_done


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
