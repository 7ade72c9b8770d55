"""DPO: preference pairs against a reference model (TRL's DPOTrainer, with the toolkit's packed forward:
src/trainers/dpo.py). `--stage dpo`, `--stage sft_then_dpo`."""

from __future__ import annotations

import math

from src.objectives.spec import (PAIRS, REWARD_ACCURACY_CHART, Advice, Chart, Curve, MemoryPlan, Metric, Objective,
                                 Panel, Report, SummaryNumber, TRL_CHOICES, Training, refuse_batch_rebalance)
from src.reporting.formatting import format_number


# A DPO loss as configured, described: report.md, the plots and the comparison pages read it from the row.
def dpo_loss_terms(loss_type, loss_weights=None) -> list[tuple[str, float]]:
    """(loss type, weight) of each term of a DPO loss as configured: TRL takes one type or a list, with weights."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type or ["sigmoid"])
    return list(zip(types, list(loss_weights or [1.0] * len(types))))


def dpo_loss_config(info: dict) -> tuple:
    """(loss_type, loss_weights) of a run, from its training_info.json (the resolved config holds both)."""
    config = info.get("config") or {}
    return config.get("loss_type", info.get("loss_type")), config.get("loss_weights")


def describe_dpo_loss(loss_type, loss_weights=None) -> str:
    """'sigmoid', or 'sigmoid + 0.4 × sft' for a weighted combination."""
    return " + ".join(name if weight == 1 else f"{weight:g} × {name}"
                      for name, weight in dpo_loss_terms(loss_type, loss_weights))


def trl_settings(config, overrides: dict, extras: dict) -> tuple[dict, dict]:
    dpo = config.dpo
    specific = dict(beta=dpo.beta, loss_type=dpo.loss_type, loss_weights=dpo.loss_weights,
                    label_smoothing=dpo.label_smoothing, precompute_ref_log_probs=extras["precompute"])
    # TRL 1.16's DPOTrainer ignores padding_free (it pads): build_trainer's packed forward answers to it
    return specific, {key: value for key, value in overrides.items() if key != "padding_free"}


def run_info(config, data_settings: dict) -> dict:
    return {"beta": config.dpo.beta, "loss_type": config.dpo.loss_type}


def warnings(config) -> list[str]:
    if config.dpo.label_smoothing and set(config.dpo.loss_type) <= {"sigmoid", "ipo", "hinge"}:
        return [f"label_smoothing {config.dpo.label_smoothing} has no effect with loss_type {config.dpo.loss_type}: "
                "it applies to robust and exo_pair"]
    return []


def loss_rows(info: dict) -> list[tuple[str, str]]:
    config = info.get("config") or {}
    loss_type = info.get("loss_type") or config.get("loss_type")
    loss = " + ".join(loss_type) if isinstance(loss_type, list) else str(loss_type)
    if config.get("loss_weights"):
        loss += f" (weights {', '.join(format_number(weight) for weight in config['loss_weights'])})"
    rows = [("loss type", loss), ("beta", format_number(info.get("beta", config.get("beta"))))]
    if config.get("label_smoothing"):
        rows.append(("label smoothing", format_number(config["label_smoothing"])))
    return rows


def setup_line(info: dict) -> str:
    return f"beta {format_number(info.get('beta'))}, loss {describe_dpo_loss(*dpo_loss_config(info))}"


LOSS_CHART = Chart("loss.png", "DPO loss", (
    Panel("DPO loss", "DPO loss", (Curve("loss", "loss"),),
          reference_lines=((math.log(2), "ln 2 = 0.693 (policy = reference)"),), min_y_span=0.2),))

OBJECTIVE = Objective(
    name="dpo",
    help="DPO on preference pairs (prompt, chosen, rejected) against a reference model",
    data_shape=PAIRS,
    example_word="pairs",
    causal_lm=True,
    ends_pipeline=True,
    on_policy_rounds=True,
    training=Training(
        trl_config="trl:DPOConfig",
        trainer="src.trainers.dpo:PreparedDPOTrainer",
        default_learning_rate=1e-6,
        default_beta=0.1,  # TRL's DPOConfig default
        loss_types=TRL_CHOICES,
        needs_reference=True,
        truncates_to_max_length=True,
        trl_settings=trl_settings,
        preflight=refuse_batch_rebalance,
        packed_forward=True,
        takes_images=True,
    ),
    memory=MemoryPlan(
        sequences_per_example=2,
        sequences_with_grad=2,
    ),
    report=Report(
        charts=(
            LOSS_CHART,
            Chart("rewards.png", "Implicit rewards of chosen and rejected answers", (
                Panel("Implicit rewards: chosen vs rejected", "reward (β·log-ratio, nats)",
                      (Curve("rewards/chosen", "chosen", "#2ca02c"), Curve("rewards/rejected", "rejected", "#d62728")),
                      reference_lines=((0.0, "0 = same as the reference model"),), min_y_span=0.5),)),
            Chart("margins.png", "Reward margin", (
                Panel("Reward margin (chosen − rejected)", "margin (β·log-ratio, nats)",
                      (Curve("rewards/margins", "margin", "#9467bd"),), reference_lines=((0.0, "no preference"),),
                      min_y_span=0.5),)),
            REWARD_ACCURACY_CHART,
        ),
        compare_metrics=(
            Metric("loss", "DPO loss", "loss", reference=(math.log(2), "ln 2 (policy = reference)")),
            Metric("rewards/chosen", "Implicit rewards: chosen (solid) and rejected (dashed)", "reward (nats)",
                   second=("rewards/rejected", "rejected"), first_label="chosen", reference=(0.0, "reference model")),
            Metric("rewards/margins", "Reward margin (chosen − rejected)", "margin (nats)", reference=(0.0, "none")),
            Metric("rewards/accuracies", "Reward accuracy", "fraction of pairs", reference=(0.5, "chance")),
        ),
        summary_numbers=(SummaryNumber("reward_accuracy", "rewards/accuracies", "final reward accuracy", percent=True,
                                       headline="reward accuracy"),
                         SummaryNumber("reward_margin", "rewards/margins", "final reward margin", headline="margin")),
        alerts=("dpo_stuck", "dpo_displacement", "dpo_saturated", "dpo_unbounded_margins", "data_near_identical"),
        audit_parts=("reference", "judged"),
        combined_loss=True,
        run_info=run_info,
        loss_rows=loss_rows,
        setup_line=setup_line,
        reference_unmeasured="not measured (a DPO run measures it from the reference log-probs it precomputes; "
                             "`python -m src.audit` with --model_name_or_path, on a sample).",
    ),
    advice=Advice(
        console_keys=("rewards/margins", "rewards/accuracies", "eval_rewards/accuracies"),
        warnings=warnings,
        length_remedy="--ld_alpha 0.5 (LD-DPO: the tokens past the shorter answer count half) or --loss_type "
                      "sigmoid_norm (length-normalised), or a higher --beta (stay closer to the start)",
        label_noise_flags="--loss_type robust --label_smoothing {smoothing}",
        sft_term="add the SFT term (--loss_type sigmoid sft --loss_weights 1 0.4)",
        drift_remedy="a higher --beta, a lower --learning_rate or fewer steps, or the SFT term (--loss_type sigmoid "
                     "sft --loss_weights 1 0.4)",
    ),
)
