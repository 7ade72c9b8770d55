"""A stage's model, trainer and training: the starting model loaded (a reward model's score head seeded alike on
every rank), TRL's trainer built with the toolkit's callbacks and trackers, the space and one-job checks before the
first step, training (resumed from a checkpoint when there is one), and a stop or divergence raised after it."""

from __future__ import annotations

from src import packed_dpo_support, run_files, vision
from src.audit import run as data_audit
from src.config_error import ConfigError
from src.data import PreparedData
from src.distributed import barrier, check_world_size, gather_objects, print0
from src.engines import (FSDP, engine_record, load_warning, loads_sharded, partitioned, requested,
                         resharded_after_forward)
from src.models import apply_chat_template_to_model, load_model, peft_config, resized_vocabulary
from src.objectives import objective
from src.pipeline.held_out import HeldOut, judged_eval_of
from src.pipeline.stage_record import StageStart
from src.pipeline.stages import Stage
from src.pipeline.stopping import stop_if_interrupted
from src.run_safety import launcher_exit, resharding
from src.run_safety.checkpoint_split import change_line, saved_split
from src.run_safety.checkpoints import checkpoint_step
from src.run_safety.disk_space import check_space, estimate_writes, format_bytes, write_failures_noted
from src.run_safety.finished_run import end_step_done
from src.world import World


def load_stage_model(stage: Stage, model_path: str, tokenizer, world: World, reward: bool, start: StageStart,
                     model=None):
    """The stage's starting model: `model` when already loaded (a round's, which answered its prompts), else loaded
    with the stage's chat template; how its weights loaded under ZeRO-3 recorded."""
    config = stage.config
    if reward:  # the score head starts random: one seed gives every rank the same head to score "before" with
        from transformers import set_seed

        set_seed(config.training.seed)
    if model is None:
        model = with_chat_template(stage, model_path, tokenizer, world, adapters=stage_adapters(stage, reward),
                                   reward_pad_token_id=tokenizer.pad_token_id if reward else None)
    record_weights_at_load(model, start, world)
    return model


def with_chat_template(stage: Stage, model_path: str, tokenizer, world: World, **options):
    """A model the stage starts from, or its reference, loaded (src/models.py `load_model`, with `options`) with the
    stage's chat template: a resize to its vocabulary done as it loads where the model is sharded as it loads, after
    the load elsewhere, the rows it adds the same on every engine (drawn from the run's seed)."""
    config = stage.config
    model = load_model(model_path, config.model, stage.plan, world, resize=stage_resize(stage, tokenizer), **options)
    return apply_chat_template_to_model(model, tokenizer, config.model.chat_template_path, stage.plan.precision,
                                        config.training.seed)


def stage_adapters(stage: Stage, reward: bool = False):
    """(the stage's LoRA config, its seed) for a load that adds the adapters as it shards the model (FSDP2,
    src/models.py `load_model`), or None without --use_lora."""
    lora = peft_config(stage.config.model, reward)
    return (lora, stage.config.training.seed) if lora is not None else None


def stage_resize(stage: Stage, tokenizer):
    """(the embeddings' rows the stage's --chat_template_path gives the model, the seed the rows it adds are drawn
    from), or None: what a model that is sharded as it loads is built with (src/models.py `load_model`), the resize
    done as it loads."""
    rows = resized_vocabulary(tokenizer, stage.config.model.chat_template_path)
    return (rows, stage.config.training.seed) if rows else None


def record_weights_at_load(model, start: StageStart, world: World) -> None:
    """Under ZeRO-3, whether the starting model loaded partitioned (each rank its share) or whole on every rank (said
    in one line, with its fix, and kept with the stage's warnings): `weights_at_load` in training_info.json."""
    engine = requested()
    if engine is None or engine.zero_stage != 3:
        return
    loaded_partitioned = partitioned(model.parameters())
    warning = load_warning(engine, loaded_partitioned)
    if warning:
        print0(f"  warning: {warning}")
        start.warnings.append(warning)
    if world.is_main:
        with write_failures_noted(start.info_path.parent):
            run_files.update_json(start.info_path, weights_at_load="partitioned" if loaded_partitioned else "whole",
                                  warnings=start.warnings)


def build_stage_trainer(stage: Stage, model, tokenizer, prepared: PreparedData, start: StageStart, held_out: HeldOut,
                        sft_forward: dict | None, reference_path: str | None, world: World, reward: bool):
    """TRL's trainer for the stage (its config from the plan and the objective's row) with the toolkit's callbacks,
    the trackers' record, the judged evaluation and the tools; returns (trainer, trackers)."""
    # The training stack (TRL, transformers' Trainer, peft, bitsandbytes: ~5 s): not imported for the preflight.
    from src.trainers.build import build_trainer
    from src.trainers.trl_config import build_trl_config

    config, plan = stage.config, stage.plan
    row = objective(stage.name)
    # Held-out prompts without answers (a run from prompts alone) are judged before and after, not evaluated on a
    # loss; an objective whose evaluation is judged (GRPO) judges some of them at each evaluation as well.
    held_out.judged_eval = judged_eval_of(stage, prepared, held_out, tokenizer, world)
    evaluated = held_out.judged_eval is not None or (prepared.validation is not None and not {
        "chosen_ids", "completion_ids", "input_ids"}.isdisjoint(prepared.validation.column_names))
    trl_config = build_trl_config(stage.name, config, plan, stage.output_dir, evaluated, start.total_steps,
                                  sft_forward, start.data_settings)
    lora = vision.lora_for(peft_config(config.model, reward), model, config.model.train_vision_tower)
    if config.model.train_vision_tower and vision.is_vision_config(model.config):
        # A tower's weights past the layer the model reads (LLaVA's post-layernorm, its last layer when it reads the
        # one before) get no gradient: DDP must look for them each step (TRL's default for vision models).
        trl_config.ddp_find_unused_parameters = True
    peft = None if hasattr(model, "peft_config") else lora  # adapters added as it loaded (FSDP2): not again
    trainer = build_trainer(stage.name, model, tokenizer, trl_config, prepared, peft,
                            stage.run_dir / run_files.METRICS, plan, truncate_to=config.data.max_length
                            if getattr(trl_config, "max_length", None) is None else None,
                            packed_dpo=packed_dpo_support.padding_free_requested(config.trl_overrides),
                            packed_attention=plan.packed_attention,
                            ref_model=reference_model(stage, model, reference_path, trl_config, lora, tokenizer, world),
                            trainer_inputs=row.training.trainer_inputs(config) if row.training.trainer_inputs else None)
    from src.trackers import TrackerRecord  # built on transformers' TrainerCallback (~4 s): not for the preflight

    trackers = TrackerRecord(config.training.report_to, start.info_path,
                             stage.environment.get("TENSORBOARD_LOGGING_DIR"))
    trainer.add_callback(trackers)
    if held_out.judged_eval is not None:
        trainer.judged_eval = held_out.judged_eval
    if held_out.tools is not None and hasattr(trainer, "use_tools"):
        trainer.use_tools(held_out.tools)
        trainer.turn_credit = config.training.turn_credit
    if world.is_main and row.training.needs_reference and "reference" in row.report.audit_parts:
        data_audit.reference_part(trainer.train_dataset, stage, trainer.args.max_length)
    if world.is_main and getattr(trainer, "reference_cache", None):
        announce_reference_cache(trainer.reference_cache, stage, start.info_path)
    return trainer, trackers


def reference_model(stage: Stage, model, reference_path: str | None, trl_config, peft, tokenizer, world: World):
    """The reference the trainer is given, with the stage's chat template as its policy has it: --round_reference
    start's model; under FSDP2 and ZeRO-3, where TRL would load the starting model again itself, whole on every rank
    (DPO, KTO: under FSDP for the precompute pass too, under ZeRO-3 a live reference; GRPO's KL term, --beta > 0), the
    toolkit loads it, each rank reading its share; elsewhere, where TRL would load it from the starting model's files
    and the chat template resizes the embeddings (TRL's copy would lack the template's tokens: "IndexError: index out
    of range in self" at the first step, measured), the toolkit loads it whole; None: TRL's own (the policy, adapters
    off, or none)."""
    if reference_path:
        return with_chat_template(stage, reference_path, tokenizer, world)
    engine = loads_sharded(world.world_size)
    if peft is not None or not keeps_reference(stage):
        return None
    precomputed = getattr(trl_config, "precompute_ref_log_probs", False)
    if engine is None:  # TRL's pass runs on the policy itself; a live reference TRL loads from the files
        resized = stage_resize(stage, tokenizer) is not None
        return with_chat_template(stage, model.name_or_path, tokenizer, world) if resized and not precomputed else None
    if engine.name != FSDP and precomputed:  # ZeRO-3 runs the pass on the policy itself
        return None
    return resharded_after_forward(with_chat_template(stage, model.name_or_path, tokenizer, world))


def keeps_reference(stage: Stage) -> bool:
    """Whether the stage's trainer runs a reference model: the objective's row says so (DPO, KTO), or its memory
    setup does, as check_gpu reads it (GRPO: only with its KL term, --beta > 0)."""
    row = objective(stage.name)
    setup = row.memory.memory_setup(stage.config) if row.memory.memory_setup else {}
    return setup.get("reference_kept", row.training.needs_reference)


def announce_reference_cache(reference_cache: dict, stage: Stage, info_path) -> None:
    """Rank 0: the reference log-probs' cache (reused or computed and cached), recorded and said per split."""
    with write_failures_noted(stage.run_dir):
        run_files.update_json(info_path, reference_log_probs=reference_cache)
    for split, outcome in reference_cache.items():
        print0(f"  reference log-probs ({split}): {outcome['cache']} in {outcome['seconds']} s"
               f"{'' if outcome['cache'] == 'reused' else ' and cached for later runs'}")


def merge_wanted(stage: Stage, reward: bool) -> bool:
    """Merged copies that are needed, not just asked for: the next stage of a pipeline (or the next round) starts from
    this stage's model, and a LoRA reward model loads as a judge only merged (its adapter's base config knows nothing
    of the score head)."""
    model = stage.config.model
    return model.merge_adapter or (model.use_peft and (stage.feeds_next or (reward and not model.load_in_4bit)))


def train(trainer, stage: Stage, start: StageStart, merge: bool, world: World) -> None:
    """Every rank: the space and one-job checks, the engine accelerate runs recorded, training from the checkpoint it
    resumes from; a stop or divergence is recorded and raised (nothing after training runs on such a model)."""
    check_disk_space(trainer, start.total_steps, merge, stage, world)
    check_world_size(trainer.args.world_size, world)
    if world.is_main:  # what accelerate actually runs (DDP, FSDP, DeepSpeed), which a launcher config decides
        with write_failures_noted(stage.run_dir):
            run_files.update_json(start.info_path, distributed_type=str(trainer.accelerator.distributed_type.value),
                                  **engine_record(trainer.accelerator))
    resume_from = start.resume_from
    if resume_from:
        resume_on_this_split(trainer, resume_from, stage, start, world)
    launcher_exit.raise_if_injected("training", world.rank)
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    barrier()  # a write that failed after the last step's check (the last metrics line, the live report) stops here
    stop_if_interrupted(trainer, stage, start.info_path, world)
    end_step_done("trained")  # from here on a kill is resumed from the final checkpoint: nothing trains again


def resume_on_this_split(trainer, checkpoint, stage: Stage, start: StageStart, world: World) -> None:
    """Every rank, before training goes on from `checkpoint`: what changed since it was saved said (another number
    of processes, the global batch kept), and the checkpoint made loadable here where its engine needs it
    (src/run_safety/resharding.py: DeepSpeed's universal checkpoint, converted once); the conversion recorded in the
    stage's resume record."""
    saved = saved_split(checkpoint)
    change = change_line(saved, stage.plan)
    conversion = resharding.for_resume(trainer, checkpoint, saved, world)
    print0(f"  resuming from {checkpoint} (step {checkpoint_step(checkpoint)} of {start.total_steps}"
           f"{f'; {change}' if change else ''})")
    if conversion and world.is_main:
        print0(f"  {checkpoint.name} converted to DeepSpeed's universal checkpoint for {world.world_size} "
               f"process{'es' if world.world_size > 1 else ''} in {conversion['seconds']} s "
               f"({format_bytes(conversion['bytes'])} written, {conversion['workers']} worker(s)); later resumes reuse it")
        with write_failures_noted(stage.run_dir):
            resumes = run_files.read_json(start.info_path).get("resumes", [])
            if resumes:
                resumes[-1]["universal_checkpoint"] = conversion
                run_files.update_json(start.info_path, resumes=resumes)


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
