"""Health alerts fire on synthetic histories made to show each failure, and stay silent on healthy ones."""

import math

import pytest

from src.reporting.alerts import LN2, Alert, detect_alerts, format_alerts
from tests.report_fixtures import dpo_history, sft_history

DPO_FAILURES = [("stuck", "dpo_stuck"), ("displacement", "dpo_displacement"), ("saturated", "dpo_saturated"),
                ("unbounded", "dpo_unbounded_margins"), ("nan", "non_finite")]


def codes(alerts: list[Alert]) -> list[str]:
    return sorted(alert.code for alert in alerts)


def every(history: list[dict], interval: int) -> list[dict]:
    """The history as logged with logging_steps=interval (eval and end-of-training records kept)."""
    return [record for record in history if "loss" not in record or record["step"] % interval == 0]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_healthy_dpo_is_silent(seed):
    assert detect_alerts(dpo_history("healthy", seed=seed), "dpo") == []


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind, code", DPO_FAILURES)
def test_each_dpo_failure_fires_exactly_its_alert(kind, code, seed):
    assert codes(detect_alerts(dpo_history(kind, seed=seed), "dpo")) == [code]


@pytest.mark.parametrize("kind, code", DPO_FAILURES + [("healthy", None)])
def test_alerts_do_not_depend_on_the_logging_interval(kind, code):
    history = every(dpo_history(kind, steps=400, seed=5), interval=10)
    assert codes(detect_alerts(history, "dpo")) == ([code] if code else [])


def test_alerts_carry_numbers_from_the_history_and_advice():
    (stuck,) = detect_alerts(dpo_history("stuck"), "dpo")
    assert stuck.severity == "error" and f"{LN2:.4f}" in stuck.evidence and "learning rate" in stuck.advice
    (nan,) = detect_alerts(dpo_history("nan"), "dpo")
    assert nan.severity == "error" and "first at step 150: loss NaN, grad_norm inf" in nan.evidence
    (displacement,) = detect_alerts(dpo_history("displacement"), "dpo")
    assert displacement.severity == "warning" and "rewards/chosen" in displacement.evidence
    (saturated,) = detect_alerts(dpo_history("saturated"), "dpo")
    assert "at step 1 of 200" in saturated.evidence and "beta" in saturated.advice
    (unbounded,) = detect_alerts(dpo_history("unbounded"), "dpo")
    assert "rewards/margins ends at 1" in unbounded.evidence


def test_accuracy_reaching_one_late_is_not_early_saturation():
    history = dpo_history("healthy")
    for record in history:
        if "rewards/accuracies" in record and record["step"] > 60:
            record["rewards/accuracies"] = 1.0
    assert detect_alerts(history, "dpo") == []


def test_chosen_dipping_while_rejected_falls_fast_is_not_displacement():
    history = dpo_history("healthy")
    for record in history:
        if "rewards/chosen" in record:
            record["rewards/chosen"] -= 0.2 * record["step"] / 200  # ends at about +0.05
            record["rewards/rejected"] -= 0.2 * record["step"] / 200 + 1.0 * record["step"] / 200
    assert detect_alerts(history, "dpo") == []


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_short_histories_raise_no_trend_alert(steps):
    assert detect_alerts(dpo_history("stuck", steps=steps, eval_every=None), "dpo") == []
    assert detect_alerts(sft_history("flat", steps=steps, eval_every=None), "sft") == []


def test_empty_history_is_silent():
    assert detect_alerts([], "dpo") == [] and detect_alerts([], "sft") == []


def test_a_single_non_finite_value_fires():
    history = dpo_history("healthy")
    history[10]["grad_norm"] = -math.inf
    (alert,) = detect_alerts(history, "dpo")
    assert alert.code == "non_finite" and f"step {history[10]['step']}" in alert.evidence


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_sft_is_silent(seed):
    assert detect_alerts(sft_history("healthy", seed=seed), "sft") == []
    assert detect_alerts(sft_history("healthy", seed=seed, finished=False), "sft") == []


@pytest.mark.parametrize("kind, code", [("flat", "sft_not_decreasing"), ("nan", "non_finite"),
                                        ("overfit", "eval_loss_rising")])
def test_each_sft_failure_fires_exactly_its_alert(kind, code):
    assert codes(detect_alerts(sft_history(kind), "sft")) == [code]


def test_rising_sft_loss_is_an_error():
    history = sft_history("healthy", eval_every=None)
    for record in history:
        if "loss" in record:
            record["loss"] = 1.0 + record["step"] / 100
    (alert,) = detect_alerts(history, "sft")
    assert alert.code == "sft_not_decreasing" and alert.severity == "error" and "rising" in alert.title


def test_errors_come_first_and_format_for_the_console():
    history = sft_history("overfit")
    history[5]["loss"] = math.nan
    alerts = detect_alerts(history, "sft")
    assert [alert.severity for alert in alerts] == ["error", "warning"]
    text = format_alerts(alerts)
    assert text.splitlines()[0] == "Health checks: 2 alert(s)"
    assert "[ERROR] NaN/inf" in text and "[WARNING] Eval loss rising" in text and "what to do:" in text
    assert format_alerts([]) == "Health checks: no alerts."


LENGTH_BIASED = {"train": {"pairs": 200, "chosen_longer_share": 0.9, "chosen_shorter_share": 0.1,
                           "chosen_tokens": {"mean": 40.0}, "rejected_tokens": {"mean": 12.0}}}
LONGER_ANSWERS = {"test": {"length_ratio": 2.0, "length_before": {"mean": 10.0}, "length_after": {"mean": 20.0}}}


@pytest.mark.parametrize("stage", ["dpo", "simpo", "orpo", "reward"])
def test_the_length_alerts_advise_the_objectives_own_remedies(stage):
    """The length alerts' advice is the objective's (its row's length_remedy): DPO's flags (--ld_alpha,
    sigmoid_norm) on DPO runs only; SimPO's and ORPO's say their reward is already length-normalised."""
    from src.audit.findings import answer_alerts, data_alerts
    from src.objectives import objective

    (bias,) = [alert for alert in data_alerts(LENGTH_BIASED, stage) if alert.code == "data_length_bias"]
    (longer,) = [alert for alert in answer_alerts(LONGER_ANSWERS, stage) if alert.code == "answers_longer"]
    for alert in (bias, longer):
        assert objective(stage).advice.length_remedy in alert.advice
        assert ("--ld_alpha" in alert.advice) == (stage == "dpo") and ("sigmoid_norm" in alert.advice) == (stage == "dpo")
        assert "DPO learns" not in alert.advice  # the old wording on every objective
    if stage in ("simpo", "orpo"):
        assert "length-normalised" in bias.advice


@pytest.mark.parametrize("stage", ["dpo", "simpo", "orpo"])
def test_the_reference_line_of_the_data_section_is_the_objectives(stage, tmp_path):
    """report.md's Data section on a run whose reference ranking was not measured: a DPO run says where it measures
    it; a reference-free run says it has no reference (not 'a DPO run ...')."""
    from src.reporting.audit import data_section

    text = "\n".join(data_section(LENGTH_BIASED, stage, None, tmp_path))
    (line,) = [line for line in text.splitlines() if line.startswith("**Reference model:**")]
    assert ("a DPO run" in line) == (stage == "dpo")
    assert ("reference-free" in line) == (stage != "dpo")


NOISY_PAIRS = {"train": {"pairs": 200, "judge": "embedded", "judged_pairs": 200, "judge_inverted_share": 0.12,
                         "judge_tie_share": 0.3, "inverted_pairs_file": "inverted.jsonl",
                         "only_answer_differs_share": 0.5, "reference_agreement": 0.95,
                         "reference_agreement_per_token": 0.95, "reference_pairs": 200}}
REPEATING_ANSWERS = {"test": {"repetition_share_before": 0.0, "repetition_share_after": 0.2}}


@pytest.mark.parametrize("stage", ["dpo", "simpo", "orpo", "kto"])
def test_the_audit_advises_the_objectives_own_flags(stage):
    """Noisy labels, pairs that share their reasoning, degenerate answers and an easy reference: each advice comes from
    the objective's row (label_noise_flags, sft_term, drift_remedy, display_name). DPO's --loss_type robust and its
    sft loss term on DPO runs only; SimPO's label smoothing and CPO's NLL term; ORPO, whose loss has neither knob,
    gets none; no alert names DPO on another objective's run."""
    from src.audit.findings import answer_alerts, data_alerts

    alerts = {alert.code: alert for alert in data_alerts(NOISY_PAIRS, stage) + answer_alerts(REPEATING_ANSWERS, stage)}
    advice = " ".join(alert.advice for alert in alerts.values())
    assert ("--loss_type robust" in advice) == (stage == "dpo")
    assert ("--loss_type sigmoid sft" in advice) == (stage == "dpo")
    assert ("--cpo_alpha" in advice) == (stage == "simpo")
    assert ("DPO" in advice) == (stage == "dpo")
    repetition = alerts["answers_repetition"].advice
    assert ("from the reference" in repetition) == (stage in ("dpo", "kto"))
    assert ("--beta" in repetition) == (stage != "simpo")  # ORPO: a lower beta weighs its NLL term more
    if stage == "kto":  # unpaired rows: the label checks of pairs do not apply
        assert not {"data_inverted_labels", "data_judge_ties"} & set(alerts)
    else:
        inverted = alerts["data_inverted_labels"].advice
        assert ("--label_smoothing 0.12" in inverted) == (stage in ("dpo", "simpo"))
        assert inverted.endswith(".") and "with ." not in inverted
        assert ("soften the loss" in alerts["data_judge_ties"].advice) == (stage != "orpo")
    only_answer = alerts["data_only_answer_differs"].advice
    assert only_answer.endswith("train on the final answers alone (--reasoning drop).")
    assert f"Little is left for {'SimPO' if stage == 'simpo' else stage.upper()} to teach" in \
        alerts["data_reference_agrees"].advice


@pytest.mark.parametrize("key", ["forward", "dpo_forward"])
def test_the_report_names_the_objectives_forward_from_either_key(key):
    """report.md's setup table names the run's own objective's forward (its row's display name), from
    training_info.json's `forward` or, for a run made before the objectives' table, `dpo_forward`."""
    from src.reporting.report import setup_table

    lines = "\n".join(setup_table({"stage": "simpo", "beta": 2.0, "simpo_gamma": 1.0, key: {
        "forward": "packed (prefix-shared)", "tokens": {"policy": {"padding_share": 0.1, "repeated_prompt_share": 0.0}}}}))
    assert "| SimPO forward | packed (prefix-shared); policy: 10.0% padding, 0.0% repeated prompt |" in lines
    assert "| SimPO | beta 2" in lines and "DPO" not in lines
