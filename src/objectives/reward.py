"""A reward model: a one-output sequence classifier trained on preference pairs (TRL's RewardTrainer:
src/trainers/reward.py). `--stage reward`; its model judges on-policy rounds (--judge)."""

from __future__ import annotations

import math

from src.objectives.spec import (SCORED_PAIRS, Advice, Chart, Curve, MemoryPlan, Metric, Objective, Panel, Report,
                                 SummaryNumber, Training)


def trl_settings(config, overrides: dict, extras: dict) -> tuple[dict, dict]:
    return {}, overrides


OBJECTIVE = Objective(
    name="reward",
    help="a reward model (a sequence classifier) on the same pairs",
    data_shape=SCORED_PAIRS,
    example_word="pairs",
    causal_lm=False,
    ends_pipeline=False,
    training=Training(
        trl_config="trl:RewardConfig",
        trainer="src.trainers.reward:ToolkitRewardTrainer",
        default_learning_rate=1e-4,
        needs_reference=False,
        trl_settings=trl_settings,
    ),
    memory=MemoryPlan(
        sequences_per_example=2,
        sequences_with_grad=2,
        scores_tokens=False,
    ),
    report=Report(
        charts=(
            Chart("loss.png", "Reward-model loss", (
                Panel("Reward-model loss (−log σ(chosen − rejected))", "loss", (Curve("loss", "loss"),),
                      reference_lines=((math.log(2), "ln 2 = 0.693 (no preference)"),), min_y_span=0.2),)),
            Chart("reward_accuracy.png", "Pair accuracy", (
                Panel("Pair accuracy (chosen scored above rejected)", "accuracy (fraction of pairs)",
                      (Curve("accuracy", "pair accuracy"),), reference_lines=((0.5, "chance"),), ylim=(-0.02, 1.04)),)),
            Chart("margins.png", "Reward margin", (
                Panel("Reward margin (chosen − rejected score)", "margin", (Curve("margin", "margin", "#9467bd"),),
                      reference_lines=((0.0, "no preference"),), min_y_span=0.5),)),
            Chart("rewards.png", "Reward range", (
                Panel("Rewards in the batch: min, mean, max", "reward",
                      (Curve("min_reward", "min", "#d62728"), Curve("mean_reward", "mean", "#1f77b4"),
                       Curve("max_reward", "max", "#2ca02c")), min_y_span=0.5),)),
        ),
        compare_metrics=(
            Metric("loss", "Reward-model loss", "loss", reference=(math.log(2), "ln 2 (no preference)")),
            Metric("margin", "Reward margin", "margin", reference=(0.0, "none")),
            Metric("accuracy", "Pair accuracy", "fraction of pairs", reference=(0.5, "chance")),
        ),
        # TRL's RewardTrainer names them accuracy and margin: how often the chosen answer outscores the rejected one
        summary_numbers=(SummaryNumber("reward_accuracy", "accuracy", "final reward accuracy", percent=True,
                                       headline="reward accuracy"),
                         SummaryNumber("reward_margin", "margin", "final reward margin", headline="margin")),
        alerts=(),
        audit_parts=("reference", "judged"),
        hub_pipeline_tag="text-classification",
        auto_class="SequenceClassification",
    ),
    advice=Advice(
        console_keys=("margin", "accuracy", "eval_accuracy"),
    ),
)
