"""KTO: unpaired thumbs-up / thumbs-down rows against a reference model, with a KL estimate on mismatched answers
(TRL's KTOTrainer, made world-size invariant: src/trainers/kto.py; weights: src/kto_weights.py). `--stage kto`,
`--stage sft_then_kto`; docs/kto.md."""

from __future__ import annotations

from src.config_error import ConfigError
from src.kto_weights import resolve_kto_weights
from src.objectives.spec import (TRL_CHOICES, UNPAIRED, Advice, Chart, Curve, MemoryPlan, Metric, Objective, Panel,
                                 Report, SummaryNumber, Training, refuse_batch_rebalance)
from src.reporting.formatting import format_number


def kto_loss_type(config) -> str:
    """KTOConfig's loss_type: --loss_type (a list for DPO) as the config was parsed, one of KTOConfig's declared
    choices or its default (src/config_parse.py `resolve_loss_type`: a recipe's DPO loss does not apply to KTO)."""
    return config.dpo.loss_type[0]


def validate(config) -> None:
    for name in ("desirable_weight", "undesirable_weight"):
        if name in config.trl_overrides and not config.trl_overrides[name] > 0:
            raise ConfigError(f"--{name} weighs the KTO loss of its rows: a positive number, got "
                              f"{config.trl_overrides[name]}")


def loss_rows(info: dict) -> list[tuple[str, str]]:
    weights = info.get("kto_weights") or {}
    return [("loss type", str(info.get("loss_type"))), ("beta", format_number(info.get("beta"))),
            ("desirable / undesirable weight", f"{format_number(weights.get('desirable_weight'))} / "
                                               f"{format_number(weights.get('undesirable_weight'))}")]


def setup_line(info: dict) -> str:
    weights = info.get("kto_weights") or {}
    return (f"beta {format_number(info.get('beta'))}, loss {info.get('loss_type')}, desirable weight "
            f"{format_number(weights.get('desirable_weight'))}, undesirable weight "
            f"{format_number(weights.get('undesirable_weight'))}")


def trl_settings(config, overrides: dict, extras: dict) -> tuple[dict, dict]:
    weights = extras.get("kto_weights") or {}  # data_settings' (src/kto_weights.py)
    # The rows' KL completions are fixed in the data (src/data/), so KTO samples like the other stages (TRL's
    # KTOConfig defaults to sequential for its in-batch pairing: src/trainers/kto.py).
    specific = dict(beta=config.dpo.beta, loss_type=kto_loss_type(config), precompute_ref_log_probs=extras["precompute"],
                    train_sampling_strategy="random", **weights)
    return specific, {key: value for key, value in overrides.items() if key not in weights}


def data_settings(config, train_counts: dict) -> tuple[dict, str, str | None]:
    weights, line, warning = resolve_kto_weights(config, train_counts)
    return {"kto_weights": weights}, line, warning


def run_info(config, data_settings: dict) -> dict:
    return {"beta": config.dpo.beta, "loss_type": kto_loss_type(config), **data_settings}


def preflight(name: str, staged, plan, world_size: int) -> str | None:
    refusal = refuse_batch_rebalance(name, staged, plan, world_size)
    if refusal:
        return refusal
    if plan.per_device_batch_size < 2 and staged.dpo.loss_type != ["apo_zero_unpaired"]:
        return (f"KTO needs at least 2 rows per device micro-batch (TRL's KTOTrainer refuses 1), and this plan gives "
                f"{plan.per_device_batch_size}: raise --micro_batch_size or --per_device_batch_size, or use fewer "
                "processes")
    return None


OBJECTIVE = Objective(
    name="kto",
    help="KTO on unpaired rows (prompt, completion, label; docs/kto.md)",
    data_shape=UNPAIRED,
    example_word="rows",
    causal_lm=True,
    ends_pipeline=True,
    training=Training(
        trl_config="trl:KTOConfig",
        trainer="src.trainers.kto:PreparedKTOTrainer",
        default_learning_rate=1e-6,
        default_beta=0.1,  # TRL's KTOConfig default
        loss_types=TRL_CHOICES,
        needs_reference=True,
        truncates_to_max_length=True,
        trl_settings=trl_settings,
        validate=validate,
        data_settings=data_settings,
        preflight=preflight,
        packed_forward=True,  # its reference pass prefix-shared, its step's KL and completion passes padding-free
    ),
    memory=MemoryPlan(
        sequences_per_example=2,  # the completion and its KL partner
        sequences_with_grad=1,  # the KL sequence runs without gradients before the step (src/trainers/kto.py)
    ),
    report=Report(
        charts=(
            Chart("loss.png", "KTO loss", (
                Panel("KTO loss (1 − σ(β·(log-ratio − KL)), weighted)", "KTO loss", (Curve("loss", "loss"),),
                      reference_lines=((0.5, "0.5 = policy = reference (weights 1)"),), min_y_span=0.2),)),
            Chart("rewards.png", "Implicit rewards of desirable and undesirable answers", (
                Panel("Implicit rewards: desirable vs undesirable", "reward (β·log-ratio, nats)",
                      (Curve("rewards/chosen", "desirable", "#2ca02c"),
                       Curve("rewards/rejected", "undesirable", "#d62728")),
                      reference_lines=((0.0, "0 = same as the reference model"),), min_y_span=0.5),)),
            Chart("margins.png", "Reward margin", (
                Panel("Reward margin (desirable − undesirable)", "margin (β·log-ratio, nats)",
                      (Curve("rewards/margins", "margin", "#9467bd"),), reference_lines=((0.0, "no separation"),),
                      min_y_span=0.5),)),
            Chart("kl.png", "KL estimate", (
                Panel("KL estimate (mismatched answers)", "KL (nats)",
                      (Curve("kl", "KL"),), reference_lines=((0.0, "0 = the reference"),), y_from_zero=True,
                      min_y_span=0.5),)),
        ),
        compare_metrics=(
            Metric("loss", "KTO loss", "loss", reference=(0.5, "0.5 (policy = reference, weights 1)")),
            Metric("rewards/chosen", "Implicit rewards: desirable (solid) and undesirable (dashed)", "reward (nats)",
                   second=("rewards/rejected", "undesirable"), first_label="desirable",
                   reference=(0.0, "reference model")),
            Metric("rewards/margins", "Reward margin (desirable − undesirable)", "margin (nats)",
                   reference=(0.0, "none")),
            Metric("kl", "KL estimate (mismatched answers)", "KL (nats)", reference=(0.0, "the reference")),
        ),
        # unpaired rows: no accuracy; the margin between the two classes' mean rewards, and the KL
        summary_numbers=(SummaryNumber("reward_margin", "rewards/margins",
                                       "final reward margin, desirable − undesirable",
                                       headline="reward margin (desirable − undesirable)"),
                         SummaryNumber("kl", "kl", "final KL estimate", headline="KL")),
        alerts=("kto_kl_runaway", "kto_not_separating"),
        loss_rows=loss_rows,
        setup_line=setup_line,
        run_info=run_info,
    ),
    advice=Advice(
        console_keys=("rewards/margins", "kl", "eval_kl"),
        length_remedy="a higher --beta (stay closer to the reference), or balance the desirable and undesirable "
                      "completions' lengths in the data",
        drift_remedy="a higher --beta, a lower --learning_rate or fewer steps",
    ),
)
