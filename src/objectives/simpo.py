"""SimPO: preference pairs, no reference model: length-normalised log-probabilities with a target margin gamma
(Meng et al. 2024, arXiv 2405.14734), through TRL's CPOTrainer with loss_type "simpo" and cpo_alpha 0
(trl.experimental.cpo; src/trainers/simpo.py). `--stage simpo`, `--stage sft_then_simpo`; docs/simpo.md."""

from __future__ import annotations

from src.config_error import ConfigError
from src.objectives.spec import (REFERENCE_FREE_MEMORY, REFERENCE_FREE_PAIRS, REFERENCE_FREE_REPORT,
                                 REFERENCE_FREE_TRAINING, REWARD_ACCURACY_CHART, Advice, Chart, Curve, MemoryPlan,
                                 Metric, Objective, Panel, Report, SummaryNumber, Training, refuse_batch_rebalance,
                                 refuse_reference_flags)
from src.reporting.formatting import format_number

# The SimPO paper's searched ranges (its section 3 and appendix B): beta 2.0-10.0, gamma / beta 0.3-0.8 (it also
# tried 0 and 1.6 and reports both worse). Its tuned settings sit inside: Llama-3-8B-Instruct beta 2.5, gamma 1.375.
BETA_RANGE = (2.0, 10.0)
GAMMA_RATIO_RANGE = (0.3, 0.8)
DEFAULT_BETA = 2.0  # the row's default_beta: TRL's CPOConfig default (0.1) is CPO's, DPO's 0.1 barely separates
DEFAULT_GAMMA_RATIO = 0.5  # gamma = beta / 2 unless --simpo_gamma is given (TRL's 0.5 with beta 2 is 0.25: outside)


def beta_of(config) -> float:
    return config.dpo.beta  # the row's default_beta unless given (src/config_parse.py)


def gamma_of(config) -> float:
    return float(config.trl_overrides.get("simpo_gamma", DEFAULT_GAMMA_RATIO * beta_of(config)))


def trl_settings(config, overrides: dict, extras: dict) -> tuple[dict, dict]:
    specific = dict(loss_type="simpo", cpo_alpha=0.0, beta=beta_of(config), simpo_gamma=gamma_of(config),
                    label_smoothing=config.dpo.label_smoothing)
    return specific, overrides  # --cpo_alpha > 0 is CPO-SimPO: the user's choice, passed through


def validate(config) -> None:
    refuse_reference_flags("SimPO", config)
    loss = config.dpo.loss_type
    if config.sources.get("loss_type", "").startswith("--") and loss != ["simpo"]:
        raise ConfigError(f"--loss_type {' '.join(loss)}: SimPO's loss is fixed (simpo); --beta and --simpo_gamma "
                          "shape it, --cpo_alpha adds CPO's NLL term")


def warnings(config) -> list[str]:
    beta, gamma = beta_of(config), gamma_of(config)
    found = []
    if not BETA_RANGE[0] <= beta <= BETA_RANGE[1]:
        found.append(f"--beta {format_number(beta)} is outside SimPO's range {BETA_RANGE[0]:g}-{BETA_RANGE[1]:g} (the "
                     "paper's search): SimPO's reward is beta x the average log-probability per token, a scale much "
                     "smaller than DPO's summed log-ratio, so a DPO-sized beta barely separates the answers")
    if beta > 0 and not GAMMA_RATIO_RANGE[0] <= gamma / beta <= GAMMA_RATIO_RANGE[1]:
        found.append(f"--simpo_gamma {format_number(gamma)} is {gamma / beta:.2f} x beta, outside SimPO's range "
                     f"{GAMMA_RATIO_RANGE[0]:g}-{GAMMA_RATIO_RANGE[1]:g} x beta: the target margin is what the loss "
                     "pushes the reward margin past; near 0 it stops early, far above it the loss never saturates and "
                     "drags the chosen answers' likelihood down with the rejected")
    return found


def run_info(config, data_settings: dict) -> dict:
    return {"beta": beta_of(config), "loss_type": "simpo", "simpo_gamma": gamma_of(config),
            "cpo_alpha": float(config.trl_overrides.get("cpo_alpha", 0.0))}


def loss_rows(info: dict) -> list[tuple[str, str]]:
    return [("loss type", "simpo (no reference model)"), ("beta", format_number(info.get("beta"))),
            ("gamma (target margin)", format_number(info.get("simpo_gamma")))]


def setup_line(info: dict) -> str:
    return (f"beta {format_number(info.get('beta'))}, gamma {format_number(info.get('simpo_gamma'))} (target margin), "
            f"cpo_alpha {format_number(info.get('cpo_alpha'))}; no reference model")


OBJECTIVE = Objective(
    name="simpo",
    help="SimPO on preference pairs, no reference model (docs/simpo.md)",
    **REFERENCE_FREE_PAIRS,
    ends_pipeline=True,
    title="SimPO",
    training=Training(
        trl_config="trl.experimental.cpo:CPOConfig",
        trainer="src.trainers.simpo:PreparedSimPOTrainer",
        **REFERENCE_FREE_TRAINING,
        default_beta=DEFAULT_BETA,
        loss_types=("simpo",),  # TRL's CPO loss, fixed: SimPO is CPOConfig(loss_type="simpo", cpo_alpha=0)
        trl_settings=trl_settings,
        validate=validate,
        preflight=refuse_batch_rebalance,
    ),
    memory=MemoryPlan(**REFERENCE_FREE_MEMORY),
    report=Report(
        **REFERENCE_FREE_REPORT,
        charts=(
            Chart("loss.png", "SimPO loss", (
                Panel("SimPO loss (−log σ(β·(avg log p chosen − avg log p rejected) − γ))", "SimPO loss",
                      (Curve("loss", "loss"),), min_y_span=0.2),)),
            Chart("rewards.png", "Rewards of chosen and rejected answers", (
                Panel("Rewards: β × average log-probability per token", "reward (β·nats/token)",
                      (Curve("rewards/chosen", "chosen", "#2ca02c"), Curve("rewards/rejected", "rejected", "#d62728")),
                      min_y_span=0.5),)),
            Chart("margins.png", "Reward margin against the target gamma", (
                Panel("Reward margin (chosen − rejected) and its target γ", "margin (β·nats/token)",
                      (Curve("rewards/margins", "margin", "#9467bd"),), reference_lines=((0.0, "no preference"),),
                      info_lines=(("simpo_gamma", "γ = target margin"),), min_y_span=0.5),)),
            REWARD_ACCURACY_CHART,
        ),
        compare_metrics=(
            Metric("loss", "SimPO loss", "loss"),
            Metric("rewards/chosen", "Rewards: chosen (solid) and rejected (dashed)", "reward (β·nats/token)",
                   second=("rewards/rejected", "rejected"), first_label="chosen"),
            Metric("rewards/margins", "Reward margin (chosen − rejected)", "margin (β·nats/token)",
                   reference=(0.0, "none")),
            Metric("rewards/accuracies", "Reward accuracy", "fraction of pairs", reference=(0.5, "chance")),
        ),
        summary_numbers=(SummaryNumber("reward_accuracy", "rewards/accuracies", "final reward accuracy", percent=True,
                                       headline="reward accuracy"),
                         SummaryNumber("reward_margin", "rewards/margins", "final reward margin", headline="margin")),
        run_info=run_info,
        loss_rows=loss_rows,
        setup_line=setup_line,
    ),
    advice=Advice(
        console_keys=("rewards/margins", "rewards/accuracies", "eval_rewards/accuracies"),
        warnings=warnings,
        length_remedy="SimPO's reward is already length-normalised (the average log-probability per token, which its "
                      "paper found curbs length exploitation): if the answers still drift, balance the chosen and "
                      "rejected answers' lengths in the data",
        # TRL's SimPO loss takes label smoothing (conservative, as cDPO's); CPO's NLL term is its SFT term (CPO-SimPO)
        label_noise_flags="--label_smoothing {smoothing}",
        sft_term="add CPO's NLL term on the chosen answers (--cpo_alpha > 0: CPO-SimPO)",
        drift_remedy="a lower --learning_rate or fewer steps, or CPO's NLL term on the chosen answers (--cpo_alpha > "
                     "0)",
    ),
)
