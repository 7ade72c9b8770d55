"""The audit's numbers → alerts: each with the evidence, what it means for DPO, and the flag that answers it.

    alerts = audit_alerts(info)       # info: training_info.json (data_audit, answers, stage, loss_type)

Thresholds and where they come from (docs/data-audit.md has the table):
- length bias: chosen longer (or shorter) in 60% of pairs or more. With no length preference the share sits near 50%;
  human and AI preference labels favour the longer answer (Hu et al. 2024, "Rethinking LLM-based Preference
  Evaluation", arXiv 2407.01085, 14 datasets) and DPO turns it into longer answers (Park et al. 2024, arXiv 2403.19159).
- inverted labels: a judge ranks 5% or more of the pairs the other way (re-judgings found ~16% in Intel/orca_dpo_pairs).
- ties: 25% or more of the judged pairs tie (~31% in Intel/orca_dpo_pairs: pairs that teach noise).
- truncation: 5% or more of the pairs lose part of an answer to --max_length.
- near-identical pairs: 20% or more share over 80% of the shorter answer's tokens from the start (DPO-Positive).
- duplicates: 5% or more of the rows repeat an earlier row; a held-out split with 5% or more of its prompts in train.
- chosen == rejected: 5% or more of the rows (dropped; usually a broken export upstream).
- reasoning: --max_length cuts into the reasoning of 5% or more of the answers (the truncation threshold); 20% or more
  of the pairs differ only in their reasoning, or only in their final answer (the near-identical threshold).
- the reference already ranks 90% or more of the pairs the labels' way, by summed and by per-token log-probs: little
  left for DPO to teach
  (reference ranking accuracy is mostly below 60%, arXiv 2405.19534).
- answers: 1.5 times longer after the stage; 5% or more degenerate (repetition) and more than before; 10% or more cut
  at --max_new_tokens and 5 points more than before; 5% or more cut inside their reasoning (no final answer), or
  ending without closing it.
"""

from __future__ import annotations

from src.objectives import DEFAULT_STAGE, PAIRED_SHAPES, objective
from src.reporting.alerts import Alert, build_alert
from src.reporting.formatting import format_percent

LENGTH_BIAS = 0.60
INVERTED = 0.05
TIES = 0.25
TRUNCATED = 0.05
NEAR_IDENTICAL = 0.20
DUPLICATES = 0.05
HELD_OUT_IN_TRAIN = 0.05
IDENTICAL = 0.05
REFERENCE_AGREES = 0.90
ANSWERS_LONGER = 1.5
REPETITION = 0.05
CUT = 0.10
CUT_RISE = 0.05
REASONING_CUT = 0.05



# What each audit alert says besides its evidence: (severity, title, what to do[, code when the key is a variant]); a
# {field} is filled in by the check that raises it (src/reporting/alerts.py build_alert, as its own ALERTS are). The
# remedies that differ by objective come from its row (src/objectives/): length_remedy, label_noise_flags, sft_term,
# drift_remedy, display_name.
FINDINGS = {
    "data_length_bias": (
        "warning", "Length bias: the chosen answer is the {way} one in {share} of pairs",
        "Preference training learns length before quality: expect {way} answers whether or not they are better. If "
        "that is the intent (the embedded default prefers the short, direct answer), nothing to do; otherwise "
        "{remedy}, and watch the Answers section's length ratio."),
    "data_inverted_labels": (
        "warning", "The judge ranks {share} of the pairs the other way (swapped labels?)",
        "Read a few of them: if the labels are swapped, fix or drop those rows{remedy}"),
    "data_judge_ties": (
        "warning", "The judge cannot tell {share} of the pairs apart",
        "Tied pairs teach the labeller's noise: drop them (cleaned preference sets do){remedy}"),
    "data_near_identical": (
        "warning", "{share} of pairs are near-identical",
        "On near-identical pairs DPO tends to push the chosen answer's log-prob down with the rejected one "
        "(rewards/chosen falls): add the SFT term, --loss_type sigmoid sft --loss_weights 1 0.4."),
    "data_truncation": (
        "warning", "{share} of training {unit} are cut by --max_length",
        "A cut answer teaches a cut answer (and its end is what a pair's preference is often about): --max_length "
        "{suggested} keeps 99% of them whole."),
    "data_reasoning_cut": (
        "warning", "--max_length cuts into the reasoning of {share} of the answers",
        "--max_length {suggested} keeps 99% of the pairs whole; or train on the final answers alone (--reasoning "
        "drop)."),
    "data_only_reasoning_differs": (
        "warning", "{share} of pairs differ only in their reasoning",
        "Those pairs teach which reasoning to prefer, not which answer: intended for process preferences; with "
        "--reasoning drop they are identical and dropped."),
    "data_only_answer_differs": (
        "warning", "{share} of pairs share their reasoning and differ only in the final answer",
        "The preference rests on the few tokens after the reasoning, and the shared reasoning is pushed up and down "
        "at once (as in near-identical pairs): {remedy} on the final answers alone (--reasoning drop)."),
    "data_duplicates": (
        "warning", "{share} of training rows are exact copies",
        "Copies weigh those pairs more and may sit in the held-out splits too: drop the repeats from the file."),
    "data_identical_by_reasoning_drop": (  # the user's --reasoning drop made them identical, not the export
        "warning", "{share} of rows have chosen == rejected once their reasoning is dropped (dropped)",
        "Those pairs prefer one reasoning over another, not one answer: keep the reasoning (--reasoning keep) to "
        "learn from them.", "data_identical"),
    "data_identical": (
        "warning", "{share} of rows have chosen == rejected (dropped)",
        "Nothing trains on them, but that many usually means a broken export (a column mapped twice): check "
        "--chosen_column / --rejected_column and the file."),
    "data_held_out_in_train": (
        "warning", "{share} of {kind} prompts are also training prompts",
        "Held-out results overstate what the model learned: remove repeated prompts before the split, or give a "
        "held-out split of your own (a validation/test file or split)."),
    "data_reference_agrees": (
        "warning", "The reference already prefers the chosen answer in {share} of pairs",
        "Little is left for {name} to teach: margins will saturate early. Use harder pairs (rejected answers the "
        "model itself gives: --rounds), or fewer steps."),
    "answers_longer": (
        "warning", "Answers grew {ratio:.2f} times longer",
        "Check the Answers section: if the judge did not reward the longer answers, the data taught length — "
        "{remedy}."),
    "answers_repetition": (
        "warning", "{share} of answers repeat themselves",
        "The policy drifted too far from {start}: {remedy}."),
    "answers_cut": (
        "warning", "{share} of answers are cut at --max_new_tokens",
        "The model stopped ending its answers (or writes longer ones): raise --max_new_tokens to see them whole; if "
        "they loop, see the repetition advice."),
    "answers_cut_in_reasoning": (
        "warning", "{share} of answers run out of --max_new_tokens inside their reasoning",
        "Raise --max_new_tokens past the reasoning lengths (the judges score the final answer, so these count as "
        "wrong), or shorten the reasoning the model learns (shorter reasoning in the SFT data, or --reasoning "
        "drop)."),
    "answers_unclosed_reasoning": (
        "warning", "{share} of answers end without closing their reasoning",
        "The model learned to stop inside its reasoning: check that the training answers close it (the data audit's "
        "reasoning line), and that the chat template renders it (--chat_template_path)."),
}


def _percent(value) -> str:
    return format_percent(value)


def _finding(key: str, evidence: str, **fields) -> Alert:
    return build_alert(FINDINGS, key, evidence, **fields)


def data_alerts(audit: dict, stage: str, loss_type=None) -> list[Alert]:
    """Alerts from the data audit's training split (and a held-out split's overlap with it)."""
    train = (audit or {}).get("train") or {}
    if not train:
        return []
    row = objective(stage)
    paired = row.data_shape in PAIRED_SHAPES
    alerts = _pair_alerts(train, row, loss_type) if paired else []
    alerts += _truncation_alerts(train, paired)
    alerts += reasoning_alerts(train, row)
    alerts += _repeated_row_alerts(train, paired)
    for kind in ("validation", "test"):
        leaked = ((audit or {}).get(kind) or {}).get("prompts_in_train_share") or 0
        if leaked >= HELD_OUT_IN_TRAIN:
            alerts.append(_finding(
                "data_held_out_in_train", f"{_percent(leaked)} of the {kind} pairs' prompts appear in the training "
                "split", share=_percent(leaked), kind=kind))
    agreement = train.get("reference_agreement")
    per_token = train.get("reference_agreement_per_token")
    # Both ways: summed log-probs alone favour the shorter answer (the embedded default's reference "agrees" on 100%
    # of pairs by sum, on none per token: that is length, not an easy pair)
    if agreement is not None and min(agreement, per_token) >= REFERENCE_AGREES:
        alerts.append(_finding(
            "data_reference_agrees", f"summed log-probs rank {_percent(agreement)} of "
            f"{train.get('reference_pairs'):,} training pairs the labels' way "
            f"({_percent(train.get('reference_agreement_per_token'))} per token)",
            share=_percent(agreement), name=row.display_name))
    return alerts


def _pair_alerts(train: dict, row, loss_type=None) -> list[Alert]:
    """What a training split of pairs teaches besides the preference: length, labels a judge ranks the other way or
    cannot tell apart, near-identical answers."""
    alerts = []
    pairs = train.get("pairs") or 0
    longer, shorter = train.get("chosen_longer_share") or 0, train.get("chosen_shorter_share") or 0
    if max(longer, shorter) >= LENGTH_BIAS:
        way = "longer" if longer >= shorter else "shorter"
        alerts.append(_finding(
            "data_length_bias", f"{_percent(max(longer, shorter))} of {pairs:,} training pairs have the {way} "
            f"answer chosen (mean {train['chosen_tokens']['mean']} vs {train['rejected_tokens']['mean']} tokens)",
            way=way, share=_percent(max(longer, shorter)), remedy=row.advice.length_remedy))
    inverted = train.get("judge_inverted_share")
    if inverted is not None and inverted >= INVERTED:
        flags = row.advice.label_noise_flags.format(smoothing=min(0.4, round(inverted, 2)))
        alerts.append(_finding(
            "data_inverted_labels", f"{train.get('judge')} scored the rejected answer above the chosen one in "
            f"{_percent(inverted)} of {train.get('judged_pairs'):,} training pairs; they are listed in "
            f"{train.get('inverted_pairs_file')}", share=_percent(inverted),
            remedy=f"; or train through them with {flags} (assumes that share of labels is flipped)." if flags
            else "."))
    ties = train.get("judge_tie_share")
    if ties is not None and ties >= TIES:
        flags = row.advice.label_noise_flags.format(smoothing=0.1)
        alerts.append(_finding(
            "data_judge_ties", f"{train.get('judge')} gave the chosen and the rejected answer the same score in "
            f"{_percent(ties)} of {train.get('judged_pairs'):,} training pairs", share=_percent(ties),
            remedy=f", or soften the loss with {flags}." if flags else "."))
    near = train.get("near_identical_share") or 0
    if "data_near_identical" in row.report.alerts and near >= NEAR_IDENTICAL and "sft" not in (loss_type or []):
        alerts.append(_finding(
            "data_near_identical", f"in {_percent(near)} of training pairs the answers share over 80% of the "
            f"shorter one's tokens from the start (median overlap {_percent(train.get('overlap_median'))})",
            share=_percent(near)))
    return alerts


def _truncation_alerts(train: dict, paired: bool) -> list[Alert]:
    """Pairs with either answer cut by --max_length (SFT: sequences longer than it)."""
    truncated = train.get("truncated_share") or 0
    if truncated < TRUNCATED:
        return []
    return [_finding(
        "data_truncation",
        (f"chosen cut in {_percent(train.get('chosen_truncated_share'))}, rejected in "
         f"{_percent(train.get('rejected_truncated_share'))} of pairs" if paired else
         f"{_percent(truncated)} of sequences are longer than --max_length"),
        share=_percent(truncated), unit="pairs" if paired else "rows", suggested=train.get("suggested_max_length"))]


def _repeated_row_alerts(train: dict, paired: bool) -> list[Alert]:
    """Rows that repeat an earlier row, and pairs dropped for chosen == rejected (as exported, or made so by
    --reasoning drop)."""
    alerts = []
    duplicates = train.get("duplicate_share") or 0
    if duplicates >= DUPLICATES:
        alerts.append(_finding(
            "data_duplicates", f"{train.get('duplicate_pairs'):,} of {train.get('rows'):,} rows repeat an earlier row "
            f"(first: rows {train.get('first_duplicate_rows')})", share=_percent(duplicates)))
    identical = train.get("identical_share") or 0
    by_drop = train.get("identical_by_reasoning_drop") or 0
    if paired and identical >= IDENTICAL and by_drop * 2 >= (train.get("identical_pairs") or 0):
        alerts.append(_finding(
            "data_identical_by_reasoning_drop", f"{train.get('identical_pairs'):,} of {train.get('rows'):,} training "
            f"rows were dropped: {by_drop:,} of them differ only in their reasoning, which --reasoning drop removes",
            share=_percent(identical)))
    elif paired and identical >= IDENTICAL:
        alerts.append(_finding(
            "data_identical", f"{train.get('identical_pairs'):,} of {train.get('rows'):,} training rows were dropped: "
            "the same answer on both sides", share=_percent(identical)))
    return alerts


def reasoning_alerts(train: dict, row) -> list[Alert]:
    """The data audit's reasoning numbers (src/data/pair_audit.py reasoning_audit): reasoning cut by --max_length, and
    pairs that differ only in their reasoning or only in their final answer."""
    alerts = []
    cut = {side: train.get(f"{side}_reasoning_cut_share") for side in ("chosen", "rejected", "completion")}
    cut = {side: share for side, share in cut.items() if share is not None}
    if cut and max(cut.values()) >= TRUNCATED:
        which = ", ".join(f"{_percent(share)} of {side} answers" for side, share in cut.items())
        alerts.append(_finding(
            "data_reasoning_cut", f"prompt + reasoning reach --max_length in {which}: those answers train without "
            "reaching their final answer (or the end of their reasoning)", share=_percent(max(cut.values())),
            suggested=train.get("suggested_max_length")))
    # the objective's SFT term where it has one to add (src/objectives/: "" where its loss holds one already)
    sft_term = f"{row.advice.sft_term}, or train" if row.advice.sft_term else "train"
    differ_only = (("only_reasoning_differs_share", "reach the same final answer by different reasoning",
                    "data_only_reasoning_differs"),
                   ("only_answer_differs_share", "reason the same way, then answer differently",
                    "data_only_answer_differs"))
    for key, evidence, code in differ_only:
        share = train.get(key) or 0
        if share >= NEAR_IDENTICAL:
            alerts.append(_finding(code, f"in {_percent(share)} of training pairs chosen and rejected {evidence}",
                                   share=_percent(share), remedy=sft_term))
    return alerts


def answer_alerts(answers: dict, stage: str = DEFAULT_STAGE) -> list[Alert]:
    """Alerts from the held-out answers before → after (the test split where there is one); the remedies `stage`'s."""
    split = "test" if (answers or {}).get("test") else next(iter(answers or {}), None)
    audit = (answers or {}).get(split) if split else None
    if not audit:
        return []
    row = objective(stage)
    alerts = []
    ratio = audit.get("length_ratio")
    if ratio is not None and ratio >= ANSWERS_LONGER:
        alerts.append(_finding(
            "answers_longer", f"{split} answers: mean {audit['length_before']['mean']} → "
            f"{audit['length_after']['mean']} tokens", ratio=ratio, remedy=row.advice.length_remedy))
    before, after = audit.get("repetition_share_before") or 0, audit.get("repetition_share_after") or 0
    if after >= REPETITION and after > before:
        alerts.append(_finding(
            "answers_repetition", f"{split}: degenerate (a phrase repeated over and over) in {_percent(after)} after, "
            f"{_percent(before)} before", share=_percent(after),
            start="the reference" if row.training.needs_reference else "where it started", remedy=row.advice.drift_remedy))
    before, after = audit.get("cut_share_before") or 0, audit.get("cut_share_after") or 0
    if after >= CUT and after >= before + CUT_RISE:
        alerts.append(_finding(
            "answers_cut", f"{split}: {_percent(before)} before → {_percent(after)} after did not end within "
            "--max_new_tokens", share=_percent(after)))
    cut = audit.get("cut_in_reasoning_share_after") or 0
    if cut >= REASONING_CUT:
        alerts.append(_finding(
            "answers_cut_in_reasoning", f"{split}: {_percent(cut)} of the trained model's answers were cut before "
            f"their reasoning closed (no final answer to judge); reasoning runs "
            f"{audit['reasoning_length_after']['median']} tokens (median)", share=_percent(cut)))
    unclosed = (audit.get("unclosed_share_after") or 0) - cut  # ended without closing its reasoning
    if unclosed >= REASONING_CUT:
        alerts.append(_finding(
            "answers_unclosed_reasoning", f"{split}: {_percent(unclosed)} of the trained model's answers stop (end of "
            "sequence) inside their reasoning, with no </think> and no final answer", share=_percent(unclosed)))
    return alerts


def audit_alerts(info: dict) -> list[Alert]:
    """Every alert of the data and answer audits a run's training_info.json holds."""
    return (data_alerts(info.get("data_audit") or {}, info.get("stage") or DEFAULT_STAGE, info.get("loss_type"))
            + answer_alerts(info.get("answers") or {}, info.get("stage") or DEFAULT_STAGE))
