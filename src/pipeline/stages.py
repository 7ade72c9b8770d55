"""The run's stages, planned before anything heavy starts: each stage's config, plan, run and output directories and
tracker settings (`Stage`), all validated before the first one trains; where each stage's data and models come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from src import run_files
from src.config import EMBEDDED, Config
from src.config_error import ConfigError
from src.data import PROMPTS, mixture_sources, source_location, source_names
from src.judges import names_a_reward_model
from src.objectives import objective
from src.plan import BatchSplitError, Plan, stage_plans
from src.rounds import round_stage_config
from src.run_safety.checkpoint_split import unsplit_resume
from src.trackers import tracker_environment
from src.world import Devices, World


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


def stage_title(stage: Stage) -> str:
    return f"DPO ROUND {stage.round} of {stage.config.dpo.rounds}" if stage.round else stage.name.upper()


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
    try:
        planned = [(name, staged, plan, 0) for name, staged, plan in stage_plans(config, world, devices)]
    except BatchSplitError as error:  # an unfinished run keeps its batch: the processes that split it, not a new batch
        raise unsplit_resume(run_dir, config, world) or error
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
        preflight = objective(name).training.preflight
        refusal = preflight(name, staged, plan, world.world_size) if preflight else None
        if refusal:
            raise ConfigError(refusal)
        stages.append(Stage(name, staged, plan, stage_dir, output_dir,
                            tracker_environment(staged.training.report_to, stage_dir), index,
                            from_prompts=from_prompts and index > 0, feeds_next=label != labels[-1]))
    return stages


def stage_status(run_dir: Path) -> dict:
    path = run_dir / run_files.TRAINING_INFO
    return run_files.read_json(path) if path.exists() else {}


def data_locations(stage: Stage) -> list[str]:
    """Where a stage's data comes from: each source of a mixture, or --dataset_name (the embedded default: its
    directory)."""
    data = stage.config.data
    return ([source_location(source, stage.data_stage) for source, _ in mixture_sources(data)] or
            [source_location(data, stage.data_stage)])


def hub_sources(config: Config, stages: list[Stage]) -> list[str]:
    """The model, data and judge names that may need the Hub: the embedded default and local paths never do."""
    names = [config.model.model_name_or_path] + [name for stage in stages for name in source_names(stage.config.data)]
    return [name for name in names + reward_model_judge(config) if name != EMBEDDED]


def reward_model_judge(config: Config) -> list[str]:
    """--judge when it names a reward model (a path or Hub id), else nothing."""
    judge = config.training.judge
    return [judge] if names_a_reward_model(judge) else []
