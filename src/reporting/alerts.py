"""Health alerts read from a run's metric history: what went wrong, the numbers that show it, and what to do.

    alerts = detect_alerts(read_jsonl(run_dir / "metrics.jsonl"), stage="dpo")
    print(format_alerts(alerts))

The training job prints them at the end of every run; `report.md` lists them (`python -m src.reporting RUN_DIR`).
Every check reads only the logged metrics (TRL's names, see NOTES.md), so it works on a crashed or copied run.
Trend checks compare the *start* window (first 10% of train records) with the *end* window (last 20%): averaging
over windows keeps per-step noise of small batches from firing an alert, and needs at least `MIN_RECORDS` records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from src.objectives import objective
from src.objectives.spec import JUDGED_CURVE
from src.reporting.formatting import format_judged, metric_name
from src.reporting.summary import finite, series

LN2 = math.log(2)

# Fewer train records than this and a trend is noise: only the NaN/inf check runs.
MIN_RECORDS = 5
START_FRACTION = 0.10
END_FRACTION = 0.20

# Policy identical to the reference. For the sigmoid DPO loss, loss = softplus(-margin) ≈ ln 2 - margin / 2 near
# zero, and rewards are β·(log π - log π_ref) summed over the answer. A margin below 0.01 for the whole second
# half of training (β = 0.1: 0.1 nats over a whole answer) means the policy has not moved; a healthy run leaves
# this band within its first few dozen steps.
STUCK_TOLERANCE = 0.01

# Likelihood displacement (Razin et al. 2024): the chosen answer's reward falls too. When it falls by at least
# half as much as the rejected one, most probability mass taken from rejected answers goes to answers in neither
# column rather than to the chosen ones. Chosen rewards dipping a little while rejected ones fall fast is normal DPO.
DISPLACEMENT_RATIO = 0.5
# The rejected reward must have fallen clearly beyond the "not moving" band for the comparison to mean anything.
DISPLACEMENT_MIN_FALL = 5 * STUCK_TOLERANCE

# Reward accuracy saturated early. A logged accuracy is the mean over every pair in the logging window, so 0.99+
# means essentially every pair is already ranked right; reaching it within the first 5% of steps and staying
# there (mean ≥ 0.95 afterwards) means there is little left to learn from these pairs.
SATURATED_ACCURACY = 0.99
SATURATED_MEAN_AFTER = 0.95
EARLY_FRACTION = 0.05

# Margins growing without bound. The sigmoid loss is softplus(-margin): at margin 5 it is 0.0067, so the pairs are
# fit and further growth buys nothing but distance from the reference (β-independent: the loss sees the margin
# only). "Still growing" = over the last third of training the fitted slope adds more than 15% of the final
# margin; a curve that is levelling off (1 - e^(-t/τ) shape) adds under 10%.
MARGIN_LARGE = 5.0
MARGIN_STILL_GROWING = 0.15

# SFT loss should fall: less than a 5% drop from start window to end window is "not decreasing" (a useful SFT
# run drops by tens of percent; 5% stays clear of the noise of window means on a flat curve).
SFT_MIN_RELATIVE_DROP = 0.05

# Overfitting: the final eval loss is more than 5% and more than 0.01 nats above the best one (needs 3 eval points).
# The absolute floor matters when the loss is near zero (a fit DPO run), where 5% is within evaluation noise.
# KTO: a KL estimate (nats, on mismatched answers) this large at the end, grown by half of it since the start and
# still rising, is running away.
KTO_KL_LARGE = 2.0
# GRPO: the policy's entropy on its own answers fell below a fifth of where it started (end window against start
# window): sampling has all but become greedy, every prompt's answers alike, and the groups stop teaching.
ENTROPY_COLLAPSE_RATIO = 0.2
# GRPO: over the end window, more than 80% of the prompts got answers that all scored the same (no advantage, no
# gradient from them): a judge with more levels, more answers per prompt, or harder/easier prompts.
TIED_GROUPS_SHARE = 0.8
# GRPO: the answers grew to half again their starting length and a fifth or more of them now hit the length limit:
# length running away (a judge that rewards longer answers, or the loss's length bias), not a reasoning habit forming
# within the limit.
LENGTH_GROWTH = 1.5
# GRPO: the train reward's end window above its start window while the judge's held-out score fell by 3 points or more
# from before training to after (200 judged prompts have a standard error of about 3 points near 50%): the policy
# learned what the reward pays for, not what the held-out judge measures (reward hacking, or overfitting the prompts).
# The score is the measure GRPO's row leads with (training_info.json's `judge`): the judge's held-out mean reward where
# it records one, where the same 0.03 is 3 points of correctness for the embedded checker's reward (1 per right answer).
HACKING_FALL = 0.03
LENGTH_CUT_SHARE = 0.2
EVAL_RISE = 0.05
EVAL_RISE_MIN = 0.01
MIN_EVAL_POINTS = 3


@dataclass
class Alert:
    severity: str  # "warning" | "error"
    title: str
    evidence: str  # numbers from the history
    advice: str  # what to do
    code: str = ""  # stable identifier, e.g. "dpo_stuck"


# What each alert says besides its evidence: (severity, title, what to do). A {field} in the advice is filled in
# by the check that raises it.
ALERTS = {
    "non_finite": (
        "error", "NaN/inf in the logged metrics",
        "Training diverged or hit a numerical fault at the first step named. Lower the learning rate or add "
        "warmup, keep gradient clipping on (max_grad_norm), prefer bf16 over fp16 (fp16 overflows), and look at "
        "the batch at that step for empty or fully masked completions (a division by zero tokens).",
    ),
    "dpo_stuck": (
        "error", "DPO loss stuck at ln 2 with zero margins: the policy is not moving away from the reference",
        "The policy still scores chosen and rejected exactly like the reference. Either the learning rate is too "
        "low for this setup (check the scaled learning rate in the setup table; DPO commonly uses 5e-7..5e-6 for "
        "full fine-tuning, 1e-5..1e-4 for LoRA) or the reference is the policy itself (the same model object, or "
        "LoRA adapters that were never enabled). Also check that chosen and rejected actually differ.",
    ),
    "dpo_displacement": (
        "warning", "Chosen and rejected rewards both falling (likelihood displacement)",
        "The margin grows by pushing both answers down, so probability moves to answers in neither column; the "
        "trained model may get worse at producing the chosen answers. Lower the learning rate or train fewer steps, "
        "raise beta, make chosen and rejected less similar (displacement is worst for near-identical pairs), or add "
        "an SFT term on the chosen answers (loss_type=[\"sigmoid\", \"sft\"] with loss_weights).",
    ),
    "dpo_saturated": (
        "warning", "Reward accuracy saturated at 1.0 early in training",
        "The pairs are too easy to tell apart, so training has little to learn from them and mostly grows margins. "
        "Check that chosen and rejected do not differ in a trivial way (length, a fixed phrase, formatting); use "
        "harder pairs (e.g. rejected answers sampled from the model itself); or raise beta if it is very small.",
    ),
    "dpo_unbounded_margins": (
        "warning", "Reward margins growing without bound",
        "The pairs are already fit; more steps only move the policy further from the reference, which usually "
        "means over-optimisation (degenerate, repetitive or very long outputs). Stop earlier (use the checkpoint "
        "at the best eval loss), raise beta, lower the learning rate, or use a bounded loss such as "
        "loss_type=[\"ipo\"].",
    ),
    "kto_kl_runaway": (
        "warning", "KTO's KL estimate running away",
        "The policy moves ever further from the reference on answers to other prompts: KTO's KL term, meant as the "
        "reference point, no longer holds it. Lower the learning rate or train fewer steps, raise beta, or check that "
        "the undesirable rows are not pushed down so hard that probability floods elsewhere (undesirable_weight).",
    ),
    "kto_not_separating": (
        "warning", "KTO rewards of desirable and undesirable answers not separating",
        "The desirable and undesirable rows get the same implicit reward: nothing is learned from the labels. Raise "
        "the learning rate (check the scaled rate in the setup table), check the labels (--label_column and its "
        "values: a column that is mostly one class, or labels unrelated to the answers), and the weights line.",
    ),
    "grpo_entropy_collapse": (
        "warning", "GRPO: the policy's entropy collapsed",
        "The policy samples nearly the same answer every time, so a prompt's answers stop differing and GRPO's "
        "groups stop teaching. Lower the learning rate, raise the sampling temperature, add the KL term (--beta, e.g. "
        "0.04) or an entropy bonus (--entropy_coef), or clip higher (--epsilon_high, DAPO's clip-higher).",
    ),
    "grpo_groups_tied": (
        "warning", "GRPO: most prompts' answers all score the same",
        "A prompt whose answers all get the same reward has no advantage and teaches nothing. If they all fail, the "
        "prompts are too hard for the model (SFT first, or easier prompts); if they all pass, too easy. A 0/1 judge "
        "ties more than one with partial credit: give the judge more levels, or raise --num_generations.",
    ),
    "grpo_length_runaway": (
        "warning", "GRPO: answer length running away",
        "The answers keep growing and more of them are cut at the length limit, where they end without a final "
        "answer. Check that no judge rewards length itself; use a loss normalised per token (dapo, dr_grpo), mask the "
        "cut answers (--mask_truncated_completions true), or raise --max_new_tokens if the task needs longer answers.",
    ),
    "grpo_reward_hacking": (
        "warning", "GRPO: the reward rose while the judged held-out score fell",
        "The policy gets more reward on its training prompts and does worse on the held-out ones by --judge: it "
        "learned something the rewards pay for that the judge does not (a loophole in a reward function, a reward "
        "model's blind spot), or it overfits the train prompts. Read the samples' answers before and after; check "
        "the rewards against --judge; lower the learning rate or stop earlier; add the KL term (--beta).",
    ),
    "sft_not_decreasing": (
        "warning", "SFT loss not decreasing",
        "Too low a learning rate leaves the loss flat (check the scaled learning rate in the setup table); too high "
        "a one makes it rise. Also check that the completion tokens are not all masked out and that the data has "
        "something the model does not already know.",
    ),
    "eval_loss_rising": (
        "warning", "Eval loss rising after its best point (overfitting)",
        "The model is fitting the training set at the expense of held-out data. Use the checkpoint nearest step "
        "{best_step}, train fewer steps/epochs, lower the learning rate, or add data.",
    ),
}


def build_alert(table: dict, key: str, evidence: str, **fields) -> Alert:
    """The alert `key` of a table of alerts (key → (severity, title, what to do[, code])): a {field} in its title or
    advice filled in from `fields`; its code the entry's, else the key. ALERTS here; the audit's FINDINGS
    (src/audit/findings.py)."""
    severity, title, advice, *code = table[key]
    return Alert(severity, title.format(**fields), evidence, advice.format(**fields), code=code[0] if code else key)


def _alert(code: str, evidence: str, **fields) -> Alert:
    return build_alert(ALERTS, code, evidence, **fields)


def _windows(values: list[float]) -> tuple[float, float]:
    """Mean of the start window and of the end window of a series (finite values only)."""
    values = finite(values)
    count = len(values)
    start = values[: max(1, round(count * START_FRACTION))]
    end = values[-max(1, round(count * END_FRACTION)):]
    return sum(start) / len(start), sum(end) / len(end)


def _finite_series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of `key` where the value is finite (the NaN/inf check reports the others)."""
    steps, values = series(metrics, key)
    points = [(step, value) for step, value in zip(steps, values) if math.isfinite(value)]
    return [step for step, _ in points], [value for _, value in points]


def _trend_series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    """_finite_series, or nothing when it has fewer than MIN_RECORDS values: a trend over so few is noise."""
    steps, values = _finite_series(metrics, key)
    return (steps, values) if len(values) >= MIN_RECORDS else ([], [])


@dataclass
class _Trend:
    """A logged key's trend: its finite values (and their steps), the start window's mean and the end window's."""
    steps: list[int]
    values: list[float]
    start: float
    end: float


def _trend(metrics: list[dict], key: str) -> _Trend | None:
    """`key`'s trend, or None when it has fewer than MIN_RECORDS finite values (a trend over so few is noise)."""
    steps, values = _trend_series(metrics, key)
    return _Trend(steps, values, *_windows(values)) if values else None


def _non_finite(metrics: list[dict]) -> Alert | None:
    first_step: dict[str, int] = {}
    kinds: dict[str, set] = {}
    bad_records = 0
    for record in metrics:
        bad = [key for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)]
        bad_records += bool(bad)
        for key in bad:
            first_step.setdefault(key, record.get("step"))
            kinds.setdefault(key, set()).add("NaN" if math.isnan(record[key]) else "inf")
    if not bad_records:
        return None
    first = min(first_step.values(), key=lambda step: (step is None, step))
    # The training signals first (loss, gradient norm), then other train metrics, then eval metrics.
    priority = {"loss": 0, "grad_norm": 1}
    keys = sorted((key for key in first_step if first_step[key] == first),
                  key=lambda key: (priority.get(key, 2), key.startswith("eval_"), key))
    named = ", ".join(f"{key} {'/'.join(sorted(kinds[key]))}" for key in keys[:5])
    evidence = f"first at step {first}: {named}" + (f" and {len(keys) - 5} more metric(s)" if len(keys) > 5 else "")
    later = len(first_step) - len(keys)
    evidence += (f"; {later} more metric(s) later" if later else "") + \
        f"; {bad_records} of {len(metrics)} logged records hold a non-finite value"
    return _alert("non_finite", evidence)


def _dpo_stuck(metrics: list[dict]) -> Alert | None:
    steps, margins = _trend_series(metrics, "rewards/margins")
    if not margins:
        return None
    half = steps[-1] - (steps[-1] - steps[0]) / 2
    late_margins = [value for step, value in zip(steps, margins) if step >= half]
    if max(abs(value) for value in late_margins) >= STUCK_TOLERANCE:
        return None
    loss_steps, losses = _finite_series(metrics, "loss")
    late_losses = [value for step, value in zip(loss_steps, losses) if step >= half]
    rewards = [abs(value) for key in ("rewards/chosen", "rewards/rejected")
               for step, value in zip(*_finite_series(metrics, key)) if step >= half]
    loss_at_ln2 = bool(late_losses) and max(abs(value - LN2) for value in late_losses) < STUCK_TOLERANCE
    rewards_zero = bool(rewards) and max(rewards) < STUCK_TOLERANCE
    if not (loss_at_ln2 or rewards_zero):
        return None
    evidence = f"from step {int(half)} to {steps[-1]}: |rewards/margins| ≤ {max(map(abs, late_margins)):.2g}"
    if late_losses:
        evidence += f", loss {min(late_losses):.4f}..{max(late_losses):.4f} (ln 2 = {LN2:.4f})"
    if rewards:
        evidence += f", |rewards/chosen|, |rewards/rejected| ≤ {max(rewards):.2g}"
    return _alert("dpo_stuck", evidence)


def _dpo_displacement(metrics: list[dict]) -> Alert | None:
    chosen, rejected = _trend(metrics, "rewards/chosen"), _trend(metrics, "rewards/rejected")
    if not (chosen and rejected):
        return None
    chosen_fall, rejected_fall = chosen.start - chosen.end, rejected.start - rejected.end
    displaced = chosen.end < 0 and chosen_fall >= DISPLACEMENT_RATIO * rejected_fall
    if not (rejected_fall > DISPLACEMENT_MIN_FALL and displaced):
        return None
    return _alert("dpo_displacement", f"rewards/chosen {chosen.start:+.3f} → {chosen.end:+.3f}, rewards/rejected "
                  f"{rejected.start:+.3f} → {rejected.end:+.3f} (start vs end of training): the chosen answers lost "
                  f"{chosen_fall / rejected_fall:.0%} as much as the rejected ones")


def _dpo_saturated(metrics: list[dict]) -> Alert | None:
    steps, accuracies = _trend_series(metrics, "rewards/accuracies")
    if not accuracies:
        return None
    last_step = max(record.get("step", 0) for record in metrics)
    first_saturated = next((index for index, value in enumerate(accuracies) if value >= SATURATED_ACCURACY), None)
    if first_saturated is None:
        return None
    # With a coarse logging interval the first record may lie beyond 5% of training: it still counts as "early".
    early_limit = max(EARLY_FRACTION * last_step, steps[0])
    after = accuracies[first_saturated:]
    mean_after = sum(after) / len(after)
    if steps[first_saturated] > early_limit or mean_after < SATURATED_MEAN_AFTER:
        return None
    return _alert("dpo_saturated", f"rewards/accuracies reached {accuracies[first_saturated]:.2f} at step "
                  f"{steps[first_saturated]} of {last_step} ({steps[first_saturated] / max(last_step, 1):.0%} of "
                  f"training) and averaged {mean_after:.3f} afterwards")


def _dpo_unbounded_margins(metrics: list[dict]) -> Alert | None:
    trend = _trend(metrics, "rewards/margins")
    if not trend:
        return None
    steps, margins, margin_end = trend.steps, trend.values, trend.end
    two_thirds = steps[0] + (steps[-1] - steps[0]) * 2 / 3
    last_third = [(step, value) for step, value in zip(steps, margins) if step >= two_thirds]
    if margin_end <= MARGIN_LARGE or len(last_third) < 3:
        return None
    xs, ys = zip(*last_third)
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    variance = sum((x - x_mean) ** 2 for x in xs)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / variance if variance else 0.0
    growth = slope * (xs[-1] - xs[0])
    if growth <= MARGIN_STILL_GROWING * margin_end:
        return None
    return _alert("dpo_unbounded_margins", f"rewards/margins ends at {margin_end:.2f} (the sigmoid loss is "
                  f"{math.log1p(math.exp(-margin_end)):.1e} there) and still grew by {growth:.2f} over the last third "
                  f"of training (steps {xs[0]}..{xs[-1]})")


def _kto_kl_runaway(metrics: list[dict]) -> Alert | None:
    kl = _trend(metrics, "kl")
    if not kl or kl.end < KTO_KL_LARGE or kl.end < kl.start + KTO_KL_LARGE / 2 or kl.values[-1] < kl.end:
        return None
    return _alert("kto_kl_runaway", f"KL estimate {kl.start:.3g} at the start, {kl.end:.3g} at the end and still "
                  f"rising (last {kl.values[-1]:.3g} nats)")


def _kto_not_separating(metrics: list[dict]) -> Alert | None:
    steps, margins = _trend_series(metrics, "rewards/margins")
    if not margins:
        return None
    half = steps[-1] - (steps[-1] - steps[0]) / 2
    late = [value for step, value in zip(steps, margins) if step >= half]
    if max(late) >= STUCK_TOLERANCE:
        return None
    return _alert("kto_not_separating", f"from step {int(half)} to {steps[-1]}: rewards/margins (desirable − "
                  f"undesirable) at most {max(late):.2g}")


def _sft_not_decreasing(metrics: list[dict]) -> Alert | None:
    loss = _trend(metrics, "loss")
    if not loss or loss.end < loss.start * (1 - SFT_MIN_RELATIVE_DROP):
        return None
    loss_start, loss_end = loss.start, loss.end
    rose = loss_end > loss_start
    alert = _alert("sft_not_decreasing", f"train loss {loss_start:.4f} at the start vs {loss_end:.4f} at the end "
                   f"({(loss_end - loss_start) / loss_start:+.1%})")
    if rose:
        alert.severity, alert.title = "error", "SFT loss rising"
    return alert


def _eval_loss_rising(metrics: list[dict]) -> Alert | None:
    steps, losses = _finite_series(metrics, "eval_loss")
    if len(losses) < MIN_EVAL_POINTS:
        return None
    best = min(losses)
    best_step = steps[losses.index(best)]
    if losses[-1] <= best + max(EVAL_RISE * abs(best), EVAL_RISE_MIN):
        return None
    return _alert("eval_loss_rising", f"eval_loss best {best:.4f} at step {best_step}, final {losses[-1]:.4f} at step "
                  f"{steps[-1]}", best_step=best_step)


def _grpo_entropy_collapse(metrics: list[dict]) -> Alert | None:
    entropy = _trend(metrics, "entropy")
    if not entropy or entropy.start <= 0 or entropy.end >= ENTROPY_COLLAPSE_RATIO * entropy.start:
        return None
    return _alert("grpo_entropy_collapse", f"entropy {entropy.start:.3g} nats/token at the start, {entropy.end:.3g} at "
                  f"the end ({entropy.end / entropy.start:.0%} of it)")


def _grpo_groups_tied(metrics: list[dict]) -> Alert | None:
    tied = _trend(metrics, "frac_reward_zero_std")
    if not tied or tied.end <= TIED_GROUPS_SHARE:
        return None
    return _alert("grpo_groups_tied", f"{tied.end:.0%} of the prompts had answers that all scored the same over the "
                  f"last {END_FRACTION:.0%} of training (steps up to {tied.steps[-1]})")


def _grpo_length_runaway(metrics: list[dict]) -> Alert | None:
    length, cut = _trend(metrics, "completions/mean_length"), _trend(metrics, "completions/clipped_ratio")
    if not (length and cut) or length.start <= 0 or length.end < LENGTH_GROWTH * length.start or \
            cut.end < LENGTH_CUT_SHARE:
        return None
    return _alert("grpo_length_runaway", f"answers {length.start:.3g} tokens long at the start, {length.end:.3g} at "
                  f"the end (x{length.end / length.start:.2f}); {cut.end:.0%} cut at the length limit at the end")


def _grpo_reward_hacking(metrics: list[dict], info: dict) -> Alert | None:
    """The train reward rising while --judge's score of held-out answers falls: over the run, on the curve of the
    held-out prompts judged at each evaluation (its start window against its end window, the start being the starting
    model) where it has two points or more; else from before training to after (training_info.json's judged result)."""
    reward = _trend(metrics, "reward")
    if not reward or reward.end <= reward.start:
        return None
    rewards = f"train reward {reward.start:.3g} at the start, {reward.end:.3g} at the end"
    steps, curve = _finite_series(metrics, JUDGED_CURVE)
    if len(curve) >= 2:
        start, end = _windows(curve)
        # its noise: the two windows' standard errors (over the prompts), as of independent samples (the same prompts
        # make the true interval narrower: a fall past this one is not the judge's noise)
        errors = [record.get(f"{JUDGED_CURVE}_sem") for record in metrics if JUDGED_CURVE in record]
        errors = [error if isinstance(error, (int, float)) and math.isfinite(error) else 0.0 for error in errors]
        noise = 1.96 * math.hypot(*_windows(errors)) if len(errors) == len(curve) else 0.0
        if start - end < max(HACKING_FALL, noise):
            return None
        return _alert("grpo_reward_hacking", f"{rewards}; held-out prompts judged during training ({JUDGED_CURVE}, "
                      f"{len(curve)} evaluations, steps {steps[0]}-{steps[-1]}): {start:.3g} at the start, {end:.3g} "
                      f"at the end (a fall past its noise, ±{noise:.2g})")
    judged = info.get("judge") or {}
    before, after = judged.get("before"), judged.get("after")
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)) or before - after < HACKING_FALL:
        return None
    measure = str(judged.get("metric"))
    return _alert("grpo_reward_hacking", f"{rewards}; judged {metric_name(measure)} on {judged.get('n')} held-out "
                  f"{judged.get('split')} prompts {format_judged(measure, before)} before, "
                  f"{format_judged(measure, after)} after")


# The curve checks an objective's row may name (its `alerts`); every stage gets EVERY_STAGE's.
CHECKS = {"dpo_stuck": _dpo_stuck, "dpo_displacement": _dpo_displacement, "dpo_saturated": _dpo_saturated,
          "dpo_unbounded_margins": _dpo_unbounded_margins, "kto_kl_runaway": _kto_kl_runaway,
          "kto_not_separating": _kto_not_separating, "sft_not_decreasing": _sft_not_decreasing,
          "grpo_entropy_collapse": _grpo_entropy_collapse, "grpo_groups_tied": _grpo_groups_tied,
          "grpo_length_runaway": _grpo_length_runaway, "grpo_reward_hacking": _grpo_reward_hacking}
# The checks that read the run's training_info.json too (its judged results before and after), when it is given
READS_INFO = {_grpo_reward_hacking}
EVERY_STAGE = (_non_finite, _eval_loss_rising)


def detect_alerts(metrics: list[dict], stage: str, info: dict | None = None) -> list[Alert]:
    """All health alerts for a metric history of `stage`: every stage's checks and the ones its objective's row names
    (src/objectives/), errors first. `info`: the run's training_info.json, for the checks that also read it (none run
    without it)."""
    checks = list(EVERY_STAGE) + [CHECKS[name] for name in objective(stage).report.alerts if name in CHECKS]
    checks = [check for check in checks if check not in READS_INFO or info is not None]
    alerts = [alert for check in checks
              if (alert := check(metrics, info) if check in READS_INFO else check(metrics)) is not None]
    return sorted(alerts, key=lambda alert: alert.severity != "error")


def format_alerts(alerts: list[Alert]) -> str:
    """The alerts as console text (several lines per alert)."""
    if not alerts:
        return "Health checks: no alerts."
    lines = [f"Health checks: {len(alerts)} alert(s)"]
    for alert in alerts:
        lines += [f"[{alert.severity.upper()}] {alert.title}",
                  f"    evidence:   {alert.evidence}",
                  f"    what to do: {alert.advice}"]
    return "\n".join(lines)
