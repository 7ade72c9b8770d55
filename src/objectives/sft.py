"""SFT: supervised fine-tuning on answers to imitate (TRL's SFTTrainer: src/trainers/sft.py). `--stage sft`, and
the first stage of every `sft_then_<name>` pipeline."""

from __future__ import annotations

from src.objectives.spec import (SEQUENCES, Advice, Chart, Curve, MemoryPlan, Metric, Objective, Panel, Report,
                                 SummaryNumber, Training)


def trl_settings(config, overrides: dict, extras: dict) -> tuple[dict, dict]:
    sft = config.sft
    specific = dict(assistant_only_loss=sft.assistant_only_loss, completion_only_loss=sft.completion_only_loss,
                    packing=sft.packing)
    sft_forward = extras.get("sft_forward")
    if sft_forward is not None:  # resolve_sft_forward decides packing and padding-free, whatever was passed
        overrides = overrides | {"packing": sft_forward["forward"] == "packed",
                                 "padding_free": sft_forward["padding_free"]}
        if sft_forward["forward"] == "padding_free":
            overrides["max_length"] = None  # TRL's rule without packing: the trainer truncates (ToolkitSFTTrainer)
    return specific, overrides


OBJECTIVE = Objective(
    name="sft",
    help="supervised fine-tuning on answers to imitate",
    data_shape=SEQUENCES,
    example_word="sequences",
    causal_lm=True,
    ends_pipeline=False,
    embedded_data="sft",
    training=Training(
        trl_config="trl:SFTConfig",
        trainer="src.trainers.sft:ToolkitSFTTrainer",
        default_learning_rate=2e-5,
        needs_reference=False,
        takes_images=True,
        trl_settings=trl_settings,
    ),
    memory=MemoryPlan(
        sequences_per_example=1,
        sequences_with_grad=1,
    ),
    report=Report(
        charts=(
            Chart("loss.png", "SFT loss", (
                Panel("SFT loss (cross-entropy on completion tokens)", "loss (nats/token)", (Curve("loss", "loss"),),
                      min_y_span=0.2),)),
            Chart("token_accuracy.png", "Next-token accuracy", (
                Panel("Next-token accuracy on completion tokens", "accuracy (fraction of tokens)",
                      (Curve("mean_token_accuracy", "token accuracy"),), ylim=(-0.02, 1.04)),)),
        ),
        compare_metrics=(
            Metric("loss", "SFT loss", "loss (nats/token)"),
            Metric("mean_token_accuracy", "Next-token accuracy", "fraction of tokens"),
        ),
        summary_numbers=(SummaryNumber("token_accuracy", "mean_token_accuracy", "final token accuracy", percent=True),),
        alerts=("sft_not_decreasing",),
    ),
    advice=Advice(
        console_keys=("mean_token_accuracy", "eval_mean_token_accuracy"),
    ),
)
