"""ORPO: SFT and preference in one stage, no reference model (Hong et al. 2024, arXiv 2403.07691): the chosen
answers' NLL plus lambda x an odds-ratio term that favours the chosen answer over the rejected one, through TRL's
ORPOTrainer (trl.experimental.orpo; src/trainers/orpo.py). `--stage orpo`, from the model SFT would start from
(it replaces SFT); docs/orpo.md."""

from __future__ import annotations

from src.config_error import ConfigError
from src.objectives.spec import (REFERENCE_FREE_MEMORY, REFERENCE_FREE_PAIRS, REFERENCE_FREE_REPORT,
                                 REFERENCE_FREE_TRAINING, REWARD_ACCURACY_CHART, Advice, Chart, Curve, MemoryPlan,
                                 Metric, Objective, Panel, Report, SummaryNumber, Training, refuse_batch_rebalance,
                                 refuse_reference_flags)
from src.reporting.formatting import format_number

DEFAULT_BETA = 0.1  # TRL's ORPOConfig default and the paper's lambda (its Mistral and Llama-2 runs)


def beta_of(config) -> float:
    return config.dpo.beta  # the row's default_beta unless given (src/config_parse.py)


def trl_settings(config, overrides: dict, extras: dict) -> tuple[dict, dict]:
    return {"beta": beta_of(config)}, overrides


def validate(config) -> None:
    refuse_reference_flags("ORPO", config)
    if config.sources.get("loss_type", "").startswith("--"):
        raise ConfigError(f"--loss_type {' '.join(config.dpo.loss_type)}: ORPO's loss is fixed (the chosen answers' "
                          "NLL + beta x the odds-ratio term); --beta weighs the odds-ratio term")


def run_info(config, data_settings: dict) -> dict:
    return {"beta": beta_of(config), "loss_type": "orpo"}


def loss_rows(info: dict) -> list[tuple[str, str]]:
    return [("loss type", "orpo: NLL + beta x odds-ratio term (no reference model)"),
            ("beta (lambda)", format_number(info.get("beta")))]


def setup_line(info: dict) -> str:
    return f"beta (lambda) {format_number(info.get('beta'))}: NLL + beta x odds-ratio term; no reference model"


OBJECTIVE = Objective(
    name="orpo",
    help="ORPO on preference pairs: SFT and preference in one stage, no reference model (docs/orpo.md)",
    **REFERENCE_FREE_PAIRS,
    ends_pipeline=False,  # it replaces SFT: it starts from the model SFT would start from
    training=Training(
        trl_config="trl.experimental.orpo:ORPOConfig",
        trainer="src.trainers.orpo:PreparedORPOTrainer",
        **REFERENCE_FREE_TRAINING,
        default_beta=DEFAULT_BETA,
        trl_settings=trl_settings,
        validate=validate,
        preflight=refuse_batch_rebalance,
    ),
    memory=MemoryPlan(**REFERENCE_FREE_MEMORY),
    report=Report(
        **REFERENCE_FREE_REPORT,
        charts=(
            Chart("loss.png", "ORPO loss", (
                Panel("ORPO loss (NLL of chosen − β·log σ(log odds ratio))", "ORPO loss", (Curve("loss", "loss"),),
                      min_y_span=0.2),)),
            Chart("nll.png", "NLL of the chosen answers", (
                Panel("NLL of the chosen answers (the SFT term)", "nats / token", (Curve("nll_loss", "NLL"),),
                      min_y_span=0.2),)),
            Chart("odds_ratio.png", "Odds-ratio term", (
                Panel("Log odds ratio, chosen vs rejected (the preference term: β·log σ of it)", "log odds ratio",
                      (Curve("log_odds_ratio", "log σ(log odds ratio)", "#9467bd"),
                       Curve("log_odds_chosen", "log odds ratio", "#2ca02c")),
                      reference_lines=((0.0, "0 = no preference"),), min_y_span=0.5),)),
            REWARD_ACCURACY_CHART,
        ),
        compare_metrics=(
            Metric("loss", "ORPO loss", "loss"),
            Metric("nll_loss", "NLL of the chosen answers", "nats / token"),
            Metric("log_odds_chosen", "Log odds ratio (chosen vs rejected)", "log odds ratio", reference=(0.0, "none")),
            Metric("rewards/accuracies", "Reward accuracy", "fraction of pairs", reference=(0.5, "chance")),
        ),
        summary_numbers=(SummaryNumber("nll", "nll_loss", "final NLL of the chosen answers", headline="NLL"),
                         SummaryNumber("log_odds", "log_odds_chosen", "final log odds ratio",
                                       headline="log odds ratio"),
                         SummaryNumber("reward_accuracy", "rewards/accuracies", "final reward accuracy", percent=True,
                                       headline="reward accuracy")),
        run_info=run_info,
        loss_rows=loss_rows,
        setup_line=setup_line,
    ),
    advice=Advice(
        console_keys=("nll_loss", "log_odds_chosen", "rewards/accuracies", "eval_rewards/accuracies"),
        length_remedy="ORPO's odds ratio already compares average log-probabilities per token (length-normalised): if "
                      "the answers still drift, balance the chosen and rejected answers' lengths in the data, or a "
                      "lower --beta (a weaker odds-ratio term)",
        # its loss already holds the NLL term on the chosen answers: a lower --beta weighs it more against the odds
        # ratio
        drift_remedy="a lower --learning_rate or fewer steps, or a lower --beta (its NLL term on the chosen answers "
                     "then weighs more against the odds-ratio term)",
    ),
)
