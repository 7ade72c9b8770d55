"""Experiment trackers: `--report_to tensorboard wandb trackio` (any of them, or none).

transformers' own integration callbacks (TensorBoardCallback, WandbCallback, TrackioCallback, chosen by TRL's
`report_to`) log the training curves. What the toolkit adds:

- a preflight, before any process group or model: each requested tracker's package imports (else one line naming
  the package to install), and W&B without credentials logs offline instead of prompting or failing;
- where they write: TensorBoard event files in `<run dir>/tensorboard/`, W&B's (offline) run in `<run dir>/wandb/`,
  unless TENSORBOARD_LOGGING_DIR / WANDB_DIR say otherwise; trackio keeps its local database (TRACKIO_DIR, default
  `$HF_HOME/trackio`) so `trackio show` compares every run;
- `TrackerRecord`: the run's `training_info.json` (resolved plan and configuration, secrets already redacted) logged
  to each tracker when training starts, and the final numbers (summary and judged before/after) when the stage ends.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import MutableMapping
from pathlib import Path

from src import run_files
from src.config import TRACKERS
from src.config_error import ConfigError
from src.hub_access import reachable
from src.reporting.report import final_numbers_table, setup_table
from src.run_safety.disk_space import fail_write_if_injected

WANDB_QUIET_MODES = ("offline", "disabled", "dryrun")


def requested(report_to: list[str]) -> list[str]:
    return [name for name in report_to if name in TRACKERS]


def check_trackers(report_to: list[str], environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Every requested tracker can be used; returns notes for the console. W&B is settled in seconds, before any
    model loads: no API key (WANDB_API_KEY, `wandb login`, a settings file) or a server that a 3-second probe cannot
    reach (WANDB_BASE_URL, default api.wandb.ai) logs offline (WANDB_MODE=offline) instead of prompting, or retrying
    for minutes and failing mid-run; WANDB_MODE=online (online only, asked for) stops in one line instead; a
    malformed key is one line."""
    environ = os.environ if environ is None else environ
    notes = []
    for name in requested(report_to):
        try:
            importlib.import_module(name)
        except ImportError:
            raise ConfigError(f"--report_to {name}: the {name} package is not installed: pip install {name}") from None
    if "wandb" in report_to and environ.get("WANDB_MODE", "").lower() not in WANDB_QUIET_MODES:
        notes += _settle_wandb(environ)
    return notes


def _settle_wandb(environ: MutableMapping[str, str]) -> list[str]:
    import wandb

    sync = "upload it later with `wandb sync <run dir>/wandb/offline-run-*`"
    # Silent, the login only reads the key and checks its format. Not silent, it asks the server for the user's name
    # through wandb's service process: seconds when the server answers, minutes when the network drops packets.
    silent = os.environ.get("WANDB_SILENT")
    os.environ["WANDB_SILENT"] = "true"
    try:
        logged_in = wandb.login(prompt=False, verify=False)
    except wandb.errors.Error as error:  # a malformed key: AuthenticationError
        raise ConfigError(f"--report_to wandb: {error}: fix WANDB_API_KEY (or run `wandb login --relogin`), or set "
                          "WANDB_MODE=offline") from None
    finally:
        if silent is None:
            del os.environ["WANDB_SILENT"]
        else:
            os.environ["WANDB_SILENT"] = silent
        wandb.teardown()  # the login loaded wandb's settings: let wandb.init read WANDB_MODE and WANDB_DIR afresh
    if not logged_in:
        environ["WANDB_MODE"] = "offline"
        return [f"W&B: no API key (WANDB_API_KEY or `wandb login`), so logging offline (WANDB_MODE=offline); {sync}"]
    server = environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    if reachable(server):
        return []
    if environ.get("WANDB_MODE", "").lower() == "online":
        raise ConfigError(f"--report_to wandb: the W&B server {server} cannot be reached and WANDB_MODE=online asks "
                          "for online logging only: check the network (or WANDB_BASE_URL), or unset WANDB_MODE to log "
                          "offline and sync later")
    environ["WANDB_MODE"] = "offline"
    return [f"W&B: {server} cannot be reached, so logging offline (WANDB_MODE=offline); {sync}"]


def tracker_environment(report_to: list[str], run_dir: Path, environ: MutableMapping[str, str] | None = None
                        ) -> dict[str, str]:
    """The variables that put one stage's tracker files inside its run directory (the user's own settings win)."""
    environ = os.environ if environ is None else environ
    wanted = {}
    if "tensorboard" in report_to:
        wanted["TENSORBOARD_LOGGING_DIR"] = environ.get("TENSORBOARD_LOGGING_DIR") or str(run_dir / "tensorboard")
    if "wandb" in report_to:
        wanted["WANDB_DIR"] = environ.get("WANDB_DIR") or str(run_dir)
    return wanted


def final_numbers(info: dict) -> dict[str, float]:
    """training_info's summary and judged before/after as flat finite numbers: `final/<name>`, `judge/<metric>_...`."""
    numbers = {}

    def add(name: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                add(f"{name}/{key}", item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            numbers[name] = float(value)

    add("final", info.get("summary") or {})
    judge = info.get("judge") or {}
    for side in ("before", "after"):
        add(f"judge/{judge.get('metric', 'score')}_{side}", judge.get(side))
    return numbers


def hyperparameters(info: dict) -> dict[str, float | int | str | bool]:
    """The resolved plan and method as TensorBoard HParams values (scalars and strings only)."""
    keys = ("stage", "model_name_or_path", "dataset_name", "world_size", "per_device_batch_size",
            "gradient_accumulation_steps", "global_batch_size", "base_learning_rate", "learning_rate", "lr_scaling",
            "precision", "use_lora", "load_in_4bit", "max_steps", "seed", "beta", "loss_type")
    values = {}
    for key in keys:
        value = info.get(key)
        if isinstance(value, list):
            value = "+".join(map(str, value))
        if value is not None:
            values[key] = value
    return values


def _markdown_json(value) -> str:
    # TensorBoard renders text as markdown: indented lines are a code block, so the JSON keeps its layout.
    return "\n".join("    " + line for line in json.dumps(value, indent=2, default=str).splitlines())


def __getattr__(name: str):
    # TrackerRecord subclasses transformers' TrainerCallback, whose import pulls in peft and bitsandbytes (8 s of CPU
    # here): the class is built on first use, so the preflight (check_trackers, tracker_environment) does not wait.
    if name == "TrackerRecord":
        globals()[name] = record = _tracker_record_class()
        return record
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _tracker_record_class() -> type:
    from transformers import TrainerCallback

    class TrackerRecord(TrainerCallback):
        """Logs the stage's training_info.json to each requested tracker when training starts (after the integrations
        have opened their runs, before their first log: trackio stores a run's config with its first record), and the
        final numbers when `finish` is called at the end of the stage. Rank 0 only."""

        def __init__(self, report_to: list[str], info_path: Path, tensorboard_dir: str | None = None):
            self.report_to = requested(report_to)
            self.info_path = Path(info_path)
            self.tensorboard_dir = tensorboard_dir
            self.trackio_run: dict | None = None  # project, name, config: to reopen the run trackio closed at train end

        def on_train_begin(self, args, state, control, **kwargs):
            if not state.is_world_process_zero or not self.report_to:
                return
            info = run_files.read_json(self.info_path)
            if "tensorboard" in self.report_to:
                _tensorboard_log_info(self.tensorboard_dir, info)
            if "wandb" in self.report_to:
                _wandb_log_info(info)
            if "trackio" in self.report_to:
                self.trackio_run = _trackio_log_info(args, info)

        def finish(self, info: dict) -> None:
            """The final numbers (training_info.json's summary and judge) to each tracker; closes the W&B run so a next
            stage starts its own, in its own directory."""
            if not self.report_to:
                return
            numbers = final_numbers(info)
            if "tensorboard" in self.report_to:
                _tensorboard_log_final(self.tensorboard_dir, info, numbers)
            if "wandb" in self.report_to:
                _wandb_log_final(numbers)
            if "trackio" in self.report_to and self.trackio_run:
                _trackio_log_final(self.trackio_run, numbers)

    return TrackerRecord


def _tensorboard_writer(tensorboard_dir: str | None):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=tensorboard_dir)


def _tensorboard_log_info(tensorboard_dir: str | None, info: dict) -> None:
    """The setup table and the whole training_info.json as TensorBoard text."""
    fail_write_if_injected(Path(tensorboard_dir or ".") / "events.out.tfevents")
    with _tensorboard_writer(tensorboard_dir) as writer:
        writer.add_text("prefkit/setup", "\n".join(setup_table(info)))
        writer.add_text("prefkit/training_info", _markdown_json(info))


def _tensorboard_log_final(tensorboard_dir: str | None, info: dict, numbers: dict[str, float]) -> None:
    """The final numbers as TensorBoard text, and the plan next to its outcome as an HParams row."""
    with _tensorboard_writer(tensorboard_dir) as writer:
        writer.add_text("prefkit/final_numbers", "\n".join(final_numbers_table(info.get("summary") or {}, info)))
        # One HParams row per run directory: the plan next to its outcome, comparable across runs.
        writer.add_hparams(hyperparameters(info), numbers, run_name=".",
                           global_step=(info.get("summary") or {}).get("completed_steps"))


def _wandb_log_info(info: dict) -> None:
    """training_info.json into the W&B run's config (the run WandbCallback opened, if any)."""
    import wandb

    if wandb.run is not None:
        wandb.config.update({"prefkit": info}, allow_val_change=True)


def _wandb_log_final(numbers: dict[str, float]) -> None:
    """The final numbers into the W&B run's summary; the run closed."""
    import wandb

    if wandb.run is not None:
        wandb.run.summary.update(numbers)
        wandb.finish()
    # A next stage's run then reads its own WANDB_DIR (wandb reads settings once per session).
    wandb.teardown()


def _trackio_log_info(args, info: dict) -> dict:
    """training_info.json into trackio's config; returns what reopens the run at the end (project, name, config)."""
    import trackio

    trackio.config.update({"prefkit": info})
    # Keys starting with "_" are trackio's own.
    config = {key: value for key, value in trackio.config.items() if not key.startswith("_")}
    return {"project": args.project, "name": args.run_name, "config": config}


def _trackio_log_final(trackio_run: dict, numbers: dict[str, float]) -> None:
    """The final numbers logged to the trackio run, reopened."""
    import trackio

    # TrackioCallback finished the run at train end; a resumed run writes its config again with its first
    # record, so the same config is passed back.
    trackio.init(project=trackio_run["project"], name=trackio_run["name"], resume="must", config=trackio_run["config"])
    trackio.log(numbers)
    trackio.finish()
