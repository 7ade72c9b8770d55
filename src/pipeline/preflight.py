"""The checks before any process group or model exists, then the data: the engine a launch asked for, trackers, the
sources each stage reads, --judge, the Hub (reachable, needed, pushable), the model-side checks and the DPO forward
from the model's files, every stage's data prepared once (tokenized before any process group); a --dry_run ends
here with each stage's plan, data and warnings (a preflight that passed with the same inputs is not redone)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from src import packed_dpo_support
from src.config import Config
from src.data import PreparedData, check_source, format_summary, prepare_data
from src.distributed import print0
from src.engines import check_engine, requested as requested_engine
from src.hub_access import needs_hub, use_local_cache_if_hub_unreachable, use_local_files_only
from src.library_warnings import launch_environment
from src.input_checks import check_judge, check_model_inputs
from src.models import apply_chat_template_path, load_processing, load_tokenizer, resolve_model_path
from src.objectives import objective
from src.pipeline.stages import Stage, hub_sources, reward_model_judge
from src.plan import format_plan
from src.preflight_record import record, record_key, recorded
from src.publish import push_problem
from src.run_safety import launcher_exit
from src.run_safety.build_once import cache_root
from src.run_safety.disk_space import write_failures_reported
from src.trackers import check_trackers
from src.trainers.stage_plan import silent_no_op_warnings
from src.unneeded_libraries import skip_imports, unneeded_engines, unneeded_libraries
from src.world import Devices, World, sagemaker_process_hint


@dataclass
class Prepared:
    """What the stages train from: the model path they start from, its tokenizer, each stage's prepared data (by
    `Stage.data_stage`)."""

    model_path: str
    tokenizer: object
    data: dict[str, PreparedData]


def check_launch(config: Config, world: World, devices: Devices) -> None:
    """What the launch itself asks for: the engine (src/engines.py), SageMaker's idle GPUs, the trackers."""
    check_engine(requested_engine(), devices.kind, config.training.ddp_comm_hook,  # src/engines.py
                 config.model.load_in_4bit)
    idle_gpus = sagemaker_process_hint(world)
    if idle_gpus:
        print0(f"  warning: {idle_gpus}")
    for note in check_trackers(config.training.report_to):
        print0(f"  {note}")
    launcher_exit.record_environment(launch_environment())  # for accelerate launch's own process (DeepSpeed's)


def check_sources(config: Config, stages: list[Stage], world: World) -> None:
    """Each stage's data source and --judge before anything loads; the Hub only where a name needs it (offline
    otherwise, or when it is unreachable) and a push that cannot happen said before training."""
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


def prepare(config: Config, stages: list[Stage]) -> Prepared | None:
    """The model-side checks and every stage's data, tokenized now, before any process group or model exists. None:
    a --dry_run, ended here with its plan and data (`end_dry_run`)."""
    engine = requested_engine()
    skip_imports(unneeded_engines(config, engine.name if engine else None))  # before transformers imports it
    model_path = resolve_model_path(config.model, config.data.embedded_reasoning)
    # A preflight that passed with these very inputs is not redone (src/preflight_record.py): ~4 s of imports.
    preflight_key = record_key(config, stages, model_path) if config.training.dry_run else None
    passed = recorded(cache_root(), preflight_key)
    if passed is not None:
        if passed["padded_reason"]:
            packed_dpo_support.announce_padded(passed["padded_reason"])
        return end_dry_run(stages, passed["model_warnings"], passed["summaries"])
    quiet_libraries()
    processing = load_processing(model_path, config.model)  # a vision-language model's processor, else None
    tokenizer = processing.tokenizer if processing else apply_chat_template_path(
        load_tokenizer(model_path, config.model.trust_remote_code), config.model.chat_template_path)
    model_warnings = check_model_inputs(model_path, config, tokenizer, stages)
    for stage in stages:
        stage.model_warnings = model_warnings.get(stage.name, [])
    padded_reason = check_dpo_forward(stages, model_path)
    # Every stage's data is checked and tokenized now, before any process group or model exists.
    with write_failures_reported(stages[-1].output_dir):  # the prepared-data cache: one process, no peers yet
        prepared = {stage.data_stage: prepare_data(stage.config.data, stage.config.sft, stage.data_stage,
                                                   stage.config.training.seed, tokenizer, cache_root() / "datasets",
                                                   processing)
                    for stage in stages}
    if config.training.dry_run:
        record(cache_root(), preflight_key, prepared, model_warnings, padded_reason)
        return end_dry_run(stages, model_warnings, {name: data.summary for name, data in prepared.items()})
    skip_imports(unneeded_libraries(config, [model_path] + reward_model_judge(config),  # ~3 s of every start
                                    engine.name if engine else None))
    return Prepared(model_path, tokenizer, prepared)


def check_dpo_forward(stages: list[Stage], model_path: str) -> str | None:
    """Which DPO forward will run, from the model's config alone, before any data is prepared: one warning line when
    the packed forward is refused (src/packed_dpo_support.py), and its reason returned; a model no DPO forward can run
    stops the launch."""
    stage = next((stage for stage in stages if objective(stage.name).training.packed_forward), None)  # rounds train as it does
    if stage is None:
        return None
    reason = packed_dpo_support.preflight(model_path, stage.config.model, stage.config.trl_overrides,
                                          objective(stage.name).display_name)
    if reason:
        packed_dpo_support.announce_padded(reason)
    return reason


def end_dry_run(stages: list[Stage], model_warnings: dict[str, list[str]], summaries: dict[str, dict]) -> None:
    """A --dry_run's end: each stage's plan, data and model warnings (run_distributed.sh's preflight prints nothing
    here: its workers print the plan)."""
    if os.environ.get("PREFKIT_QUIET_DRY_RUN") == "1":
        return None
    for stage in stages:
        print0(f"\n== {stage.name.upper()} → {stage.run_dir} (dry run: nothing trained)\n{format_plan(stage.plan)}"
               f"\n{format_summary(summaries[stage.data_stage])}")
        # the stage's own warnings too (a silent no-op, a setting outside its objective's paper's range)
        for warning in silent_no_op_warnings(stage.name, stage.config, stage.plan) + model_warnings.get(stage.name, []):
            print0(f"  warning: {warning}")
    return None


def quiet_libraries() -> None:
    """Progress bars from datasets and transformers drown the plan and the metrics on the console."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
