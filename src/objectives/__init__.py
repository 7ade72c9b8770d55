"""The table of objectives: one module per objective (sft, dpo, reward, kto, ...), each one row (`OBJECTIVE`, an
`Objective` from spec.py) declaring what the rest of the toolkit needs from it.

    from src.objectives import objective
    objective("kto").example_word        # "rows"
    objective("sft_then_kto").name       # a pipeline reads as its final stage: "kto"

Adding an objective is a module here (its row), its trainer module in src/trainers/ if TRL's needs the toolkit's
additions, a recipe in configs/, tests and a docs page; the launcher, data preparation, check_gpu, reporting and the
audit read the row. `--stage sft_then_<name>` exists for every row with `ends_pipeline`, and
`sft_then_<before>_then_<name>` for each objective its `pipeline_after` names. Light: no torch, no TRL.
"""

from __future__ import annotations

import importlib
import warnings

from src.objectives import dpo, grpo, kto, orpo, reward, sft, simpo
from src.objectives.spec import (PAIRED_SHAPES, PAIRS, PROMPTS, SCORED_PAIRS, SEQUENCES, UNPAIRED, Chart, Curve, Metric,
                                 Objective, Panel, SummaryNumber)

OBJECTIVES: dict[str, Objective] = {row.name: row for row in (dpo.OBJECTIVE, sft.OBJECTIVE, reward.OBJECTIVE,
                                                              kto.OBJECTIVE, simpo.OBJECTIVE,
                                                              orpo.OBJECTIVE, grpo.OBJECTIVE)}
DEFAULT_STAGE = next(iter(OBJECTIVES))  # the table's first row: --stage's default
# The objective whose on-policy rounds --rounds runs (the row with on_policy_rounds: DPO)
ROUNDS_STAGE = next(name for name, row in OBJECTIVES.items() if row.on_policy_rounds)
PIPELINE_FIRST = "sft"  # every pipeline starts with SFT, then the objective from the SFT model
# A pipeline's stages, in order, each from the model of the one before: SFT, then the objective (sft_then_dpo), or SFT,
# an objective its row's `pipeline_after` names, then the objective (sft_then_dpo_then_grpo). Every stage but the last
# reads the recipe's block of its name (`sft:`, `dpo:`) and --<stage>.KEY flags (src/config.py).
PIPELINES = {"_then_".join(stages): stages for name, row in OBJECTIVES.items() if row.ends_pipeline
             for stages in [(PIPELINE_FIRST, name)] + [(PIPELINE_FIRST, before, name) for before in row.pipeline_after]}
# The stages whose recipe blocks (and --<stage>.KEY flags) exist: every pipeline stage but a final one
PIPELINE_BLOCKS = tuple(dict.fromkeys(stage for stages in PIPELINES.values() for stage in stages[:-1]))
# --stage's choices, in the order the help lists them: the objectives in the table's order, each pipeline once both
# of its stages are listed (dpo, sft, sft_then_dpo, reward, kto, sft_then_kto).
STAGES = tuple(name for index, row in enumerate(OBJECTIVES.values())
               for name in (row.name, *(pipeline for pipeline, stages in PIPELINES.items()
                                        if max(list(OBJECTIVES).index(stage) for stage in stages) == index)))


def final_stage(stage: str) -> str:
    """The stage a run ends with: a pipeline's last (sft_then_dpo → dpo), else the stage itself."""
    return PIPELINES[stage][-1] if stage in PIPELINES else stage


def objective(stage: str) -> Objective:
    """The row of a stage (a pipeline: its final stage's)."""
    return OBJECTIVES[final_stage(stage)]


def display_name(stage: str) -> str:
    """A stage as a user reads it: its row's title (SimPO), a pipeline's stages in order (SFT → SimPO); a name the
    table does not know (an older run's, "previous") in capitals."""
    if stage in PIPELINES:
        return " → ".join(display_name(name) for name in PIPELINES[stage])
    return OBJECTIVES[stage].display_name if stage in OBJECTIVES else stage.upper()


def infer_stage(metrics: list[dict]) -> str:
    """The stage of a run whose training_info.json does not say (a run from before it did): the objective most of
    whose own curves (its compare metrics but the loss) are logged, the table's order breaking ties; none logged:
    the one that trains on sequences."""
    def logged(key: str) -> bool:
        return any(key in record or f"eval_{key}" in record for record in metrics)

    scores = {name: sum(logged(metric.key) for metric in row.report.compare_metrics if metric.key != "loss")
              for name, row in OBJECTIVES.items()}
    best = max(scores, key=scores.get)  # the first of the highest
    return best if scores[best] else next(name for name, row in OBJECTIVES.items() if row.data_shape == SEQUENCES)


def shape_of(stage: str) -> str:
    """The data shape a preparation makes: the objective's, or PROMPTS (prompts alone, for on-policy rounds)."""
    return PROMPTS if stage == PROMPTS else objective(stage).data_shape


def load(path: str):
    """The class a row names as "module:Class" (imported on first use: TRL and the trainers cost seconds). TRL's
    warning that trl.experimental is experimental is left out: the objective's docs page says which rows use it."""
    module, _, name = path.partition(":")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*trl.experimental")
        return getattr(importlib.import_module(module), name)


def trl_config_paths(stage: str) -> list[str]:
    """Where the TRL config class(es) a stage builds live ("module:Class"): a pipeline's final stage's and then SFT's."""
    return [OBJECTIVES[name].training.trl_config for name in reversed(PIPELINES.get(stage, (stage,)))]


def trl_config_classes(stage: str) -> list[type]:
    """The TRL config class(es) a stage builds (imported: seconds)."""
    return [load(path) for path in trl_config_paths(stage)]


__all__ = ["DEFAULT_STAGE", "OBJECTIVES", "PIPELINE_BLOCKS", "PIPELINE_FIRST", "ROUNDS_STAGE", "PIPELINES", "STAGES", "PAIRED_SHAPES", "PAIRS", "PROMPTS", "SCORED_PAIRS", "SEQUENCES", "UNPAIRED",
           "Chart", "Curve", "Metric", "Objective", "Panel", "SummaryNumber", "display_name", "final_stage", "infer_stage", "objective", "shape_of", "load",
           "trl_config_classes", "trl_config_paths"]
