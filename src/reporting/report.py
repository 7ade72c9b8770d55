"""Build a run's report from its run directory alone: plots, readable sample files and a one-page report.md.

    python -m src.reporting results/<run_name>

Reads only `metrics.jsonl`, `training_info.json` and `samples_<split>.jsonl` (see src/run_files.py), so it works on
a run that crashed and on a run directory copied off a cluster. Writes, inside the run directory:
`plots/*.png`, `distributed_output_<split>.txt` (one per samples file) and `report.md`, each atomically (a reader
sees the previous version or the new one, never half a file). The training job calls `build_report` on rank 0 while
it trains (src/reporting/live.py) and at the end of every run; report.md's first line says where the run stands
(src/reporting/status.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path

from src.audit.answers import verdict_score
from src.audit.findings import audit_alerts
from src.objectives import display_name, infer_stage, objective
from src.objectives.dpo import dpo_loss_config
from src.reporting.alerts import Alert, detect_alerts, format_alerts
from src.reporting.audit import DATA_PLOT, answers_section, data_section, plot_data
from src.reporting.formatting import (ci95, duration, format_judged, format_number, format_percent, metric_name,
                                      metric_points, table_lines)
from src.reporting.plots import plot_history
from src.reporting.rounds import ROUNDS_PLOT, plot_rounds, rounds_section
from src.reporting.status import RUNNING, Live, RunState, run_state, status_line
from src.reporting.summary import summarize
from src.run_files import (FORWARD, METRICS, OLD_FORWARD, PLOTS_DIR, TRAINING_INFO, read_json, read_jsonl, samples_file,
                           write_text)

SPLITS = ("val", "test")
REPORT = "report.md"
EXAMPLES_IN_REPORT = 3
# Longer answers are cut in report.md (the .txt files always hold the full text).
REPORT_TEXT_LIMIT = 700


class ReportError(Exception):
    """The run directory cannot be reported on (missing, or no metrics); the message says why in one line."""


def samples_text_file(split: str) -> str:
    return f"distributed_output_{split}.txt"


def _fenced(text, limit: int | None = None) -> list[str]:
    """A fenced code block holding `text` verbatim (cut at `limit` characters)."""
    text = "" if text is None else (text if isinstance(text, str) else json.dumps(text, ensure_ascii=False))
    if limit and len(text) > limit:
        text = text[:limit] + f"\n… ({len(text) - limit} more characters; full text in the .txt file)"
    fence = "````" if "```" in text else "```"
    return [fence + "text", text.rstrip("\n") or "(empty)", fence]


def _format_verdict(verdict: dict | None) -> str:
    if not verdict:
        return "no verdict"
    return ", ".join(f"{key} {format_number(value)}" for key, value in verdict.items())


def _change(sample: dict) -> tuple[str, float | None]:
    verdict = sample.get("verdict") or {}
    before, after = verdict_score(verdict.get("reference")), verdict_score(verdict.get("trained"))
    delta = None if before is None or after is None else after - before
    if delta:
        return ("improved" if delta > 0 else "regressed"), delta
    if sample.get("trained_answer") == sample.get("reference_answer"):
        return "same answer", delta
    return ("answer changed" if delta is None else "answer changed, same verdict"), delta


# ------------------------------------------------------------------------------------------------------ samples


def render_samples_text(samples: list[dict], split: str, run_name: str = "", judge: dict | None = None) -> str:
    """The human-readable sample file: every prompt with the reference, trained and dataset answers and verdicts."""
    lines = [f"prefkit held-out samples: split {split}, {len(samples)} prompts"
             + (f", run {run_name}" if run_name else "")]
    if judge:
        lines.append(f"judge: {judge.get('judge') or 'n/a'}; {judge.get('metric')}: before {format_percent(judge.get('before'))}"
                     f" -> after {format_percent(judge.get('after'))} (n={judge.get('n')})")
    lines.append("REFERENCE = the model this stage started from; TRAINED = the model after this stage; "
                 "CHOSEN / REJECTED = the dataset's answers.")
    rule = "=" * 100
    for position, sample in enumerate(samples, start=1):
        verdict = sample.get("verdict") or {}
        label, _ = _change(sample)
        title = f"[{position}/{len(samples)}] {sample.get('split', split)} #{sample.get('index')}  ->  {label}"
        lines += ["", rule, title]
        if verdict:
            lines += [f"  verdict reference: {_format_verdict(verdict.get('reference'))}",
                      f"  verdict trained:   {_format_verdict(verdict.get('trained'))}"]
        lines.append(rule)
        for title, text in (("PROMPT", sample.get("prompt")),
                            ("REFERENCE answer (starting model)", sample.get("reference_answer")),
                            ("TRAINED answer", sample.get("trained_answer")),
                            ("CHOSEN (dataset)", sample.get("chosen")),
                            ("REJECTED (dataset)", sample.get("rejected"))):
            if text is None:
                continue
            if not isinstance(text, str):
                text = json.dumps(text, ensure_ascii=False, indent=1)
            lines += [f"--- {title} ---", text.rstrip("\n") or "(empty)"]
        if sample.get("images"):
            lines += ["--- images ---", ", ".join(sample["images"])]
        if sample.get("meta"):
            lines += ["--- meta ---", json.dumps(sample["meta"], ensure_ascii=False, sort_keys=True)]
    return "\n".join(lines) + "\n"


def pick_examples(samples: list[dict], count: int = EXAMPLES_IN_REPORT) -> list[dict]:
    """Informative samples first: the biggest improvement, the worst regression, then other changed answers."""
    changes = [(_change(sample), position) for position, sample in enumerate(samples)]
    improved = sorted((item for item in changes if item[0][1] is not None and item[0][1] > 0), key=lambda i: -i[0][1])
    regressed = sorted((item for item in changes if item[0][1] is not None and item[0][1] < 0), key=lambda i: i[0][1])
    differing = [item for item in changes
                 if samples[item[1]].get("trained_answer") != samples[item[1]].get("reference_answer")]
    order = improved[:1] + regressed[:1] + improved[1:] + regressed[1:] + differing + changes
    picked: list[int] = []
    for _, position in order:
        if position not in picked:
            picked.append(position)
    return [samples[position] for position in picked[:count]]


# ------------------------------------------------------------------------------------------------------- report


def judge_results(info: dict) -> dict[str, dict]:
    """Judged results per split: `judges` when the job wrote them, else the single headline `judge`."""
    judges = dict(info.get("judges") or {})
    if not judges and info.get("judge"):
        judges[info["judge"].get("split", "test")] = info["judge"]
    return {split: judges[split] for split in [*SPLITS, *judges] if split in judges}


def headline_measure(result: dict, stage: str) -> tuple[str, float | None, float | None]:
    """(measure, before, after) a judged split's result leads with for `stage`: its objective's `judged_headline`
    detail where the judge recorded it (GRPO: the held-out mean of the reward it trains on), else the judge's metric."""
    wanted = objective(stage).report.judged_headline
    detail = (result.get("details") or {}).get(wanted) if wanted else None
    if isinstance(detail, dict):
        return wanted, detail.get("before"), detail.get("after")
    return result.get("metric", ""), result.get("before"), result.get("after")


def headline_judge(judged: dict[str, dict], stage: str) -> dict:
    """training_info.json's `judge` (the index's cell, the console's verdict, the reward-hacking alert, what the next
    stage of a pipeline carries): the measure `stage` leads with, on the test split (else the first judged)."""
    split = "test" if "test" in judged else next(iter(judged))
    metric, before, after = headline_measure(judged[split], stage)
    return {"metric": metric, "split": split, "n": judged[split].get("n"), "before": before, "after": after}


def _earlier_stages(info: dict, run_dir: Path) -> list[tuple[str, dict[str, dict]]]:
    """(label, judged results per split) of each earlier stage, oldest first: a pipeline's every stage before this one
    (sft_then_dpo_then_grpo: SFT, DPO), each followed through its `previous_stage`; a round's previous stage only.
    A stage's results are its own run directory's (per split, with details) when it is there, else the
    `previous_stage.judge` summary copied into the next stage's training_info.json. Stages that judged nothing are
    left out."""
    stages = []
    while (previous := info.get("previous_stage") or {}) and len(stages) < len(SPLITS) * 10:
        directory = run_dir / previous.get("run_dir", "")
        try:
            earlier = read_json(directory / TRAINING_INFO)
        except (OSError, ValueError):
            earlier = {}
        results = judge_results(earlier)
        if previous.get("judge"):
            results.setdefault(previous["judge"].get("split", "test"), previous["judge"])
        stages.insert(0, (stage_label(previous.get("stage", "previous")), results))
        if info.get("round"):
            break
        info, run_dir = earlier, directory
    return [(label, results) for label, results in stages if results]


def _models(result: dict, earlier: list[dict | None]) -> list[dict]:
    """Each judged model's numbers in training order, as {"main": metric, <detail name>: value}:
    [starting model, trained] or, in a pipeline, [untrained, after each earlier stage, after this stage]."""
    def numbers(source: dict | None, side: str) -> dict:
        if not source:
            return {}
        values = {name: pair.get(side) for name, pair in _sub_metrics(source).items()}
        return {"main": source.get(side), **values}

    starting, trained = numbers(result, "before"), numbers(result, "after")
    if not earlier:
        return [starting, trained]
    afters = [numbers(stage, "after") for stage in earlier]
    # The previous stage's own measurement of its trained model is the canonical "after" for that stage.
    afters[-1] = {**starting, **{k: v for k, v in afters[-1].items() if v is not None}}
    return [numbers(earlier[0], "before"), *afters, trained]


def judged_section(info: dict, run_dir: Path) -> tuple[list[str], str | None]:
    """Markdown for the judged results, and the one-sentence verdict they support."""
    stage = stage_label(f"round{info['round']['round']}" if info.get("round") else info["stage"])
    judges, earlier_stages = judge_results(info), _earlier_stages(info, run_dir)
    if not judges:
        return ["No held-out prompts were judged in this run."], None
    pipeline = bool(earlier_stages)
    previous_stage = earlier_stages[-1][0] if pipeline else "PREVIOUS"
    # Before the first stage: the untrained model before a pipeline's SFT, the previous round's start in rounds.
    first = "untrained" if not info.get("round") else f"before {previous_stage}"
    header = (["split", "metric", "n", first, *(f"after {label}" for label, _ in earlier_stages), f"after {stage}",
               f"{stage} change"]
              if pipeline else ["split", "metric", "n", "before (starting model)", "after (trained)", "change"])
    rows, notes = [], []
    for split, result in judges.items():
        earlier = earlier_stages[-1][1].get(split) if pipeline else None
        models = _models(result, [results.get(split) for _, results in earlier_stages])
        for name in ["main", *_sub_metrics(result)]:
            values = [model.get(name) for model in models]
            cells = [format_judged(name, value) for value in values]
            change = "" if name.startswith("mean_") else metric_points(values[-2], values[-1])
            if name == "main":
                cells[-1] += ci95(values[-1], result.get("n") or 0)
                rows.append([split, metric_name(result.get("metric", "")), result.get("n"), *cells, change])
            else:
                rows.append(["", f"↳ {metric_name(name)}", "", *cells, change])
        if earlier and _differs(earlier.get("after"), result.get("before")):
            notes.append(f"The {stage} stage measured its starting model at {format_percent(result.get('before'))} on {split}, "
                         f"the {previous_stage} stage at {format_percent(earlier.get('after'))}: generation was not "
                         f"deterministic or the prompts differ.")

    lines = table_lines(header, rows) + [""]
    judge_names = sorted({result.get("judge") for result in judges.values() if result.get("judge")})
    if judge_names:
        lines.append(f"Judge: {', '.join(judge_names)}.")
    if any(result.get("metric") == "pair_accuracy" for result in judges.values()):
        lines.append("Pair accuracy = how often the reward model scores the dataset's chosen answer above its rejected "
                     "one, on every held-out pair; 50% is chance.")
    if any(result.get("metric") == "win_rate" for result in judges.values()):
        lines.append("Win rate = how often the trained answer gets a higher reward than the starting model's answer "
                     "to the same prompt (ties count half), so 50% means no change.")
    lines.append("± is the 95% interval of the trained model's fraction (normal approximation).")
    for split, result in judges.items():
        counts = (result.get("details") or {}).get("changes") or (result.get("details") or {}).get("outcomes")
        if counts:
            lines.append(f"\n{split}: " + ", ".join(f"{value} {key}" for key, value in counts.items()) + ".")
    lines += [f"\n> {note}" for note in notes]
    return lines, _rounds_sentence(info) or _judged_sentence(stage, judges, earlier_stages, info["stage"],
                                                             bool(info.get("round")))


def _rounds_sentence(info: dict) -> str | None:
    """The last round's verdict: the held-out result before DPO, after DPO on the offline pairs, after the rounds."""
    rounds = info.get("rounds") or []
    judged = [(entry.get("judged") or {}) for entry in rounds]
    split = "test" if judged and all("test" in entry for entry in judged) else "val"
    if not rounds or (len(rounds) < 2 and rounds[0]["round"] == 0) or not all(split in entry for entry in judged):
        return None
    first, last = judged[0][split], judged[-1][split]
    if rounds[0]["round"] == 1:  # from prompts alone: no offline DPO stage
        return (f"On {last['n']} held-out {split} prompts, {metric_name(last['metric']).replace(' ', '-')} went from "
                f"{format_percent(first['before'])} (the starting model) to {format_percent(last['after'])} after "
                f"{len(rounds)} on-policy round{'s' if len(rounds) > 1 else ''} from prompts alone.")
    return (f"On {last['n']} held-out {split} prompts, {metric_name(last['metric']).replace(' ', '-')} went from "
            f"{format_percent(first['before'])} before DPO to {format_percent(first['after'])} after DPO on the offline "
            f"pairs and {format_percent(last['after'])} after {len(rounds) - 1} on-policy round"
            f"{'s' if len(rounds) > 2 else ''}.")


def stage_label(label: str) -> str:
    """A stage's label (sft, simpo, reward, round2) as reports write it: its row's title or name (SFT, SimPO, REWARD),
    ROUND 2."""
    return f"ROUND {label[5:]}" if label.startswith("round") and label[5:].isdigit() else display_name(label)


def _judged_sentence(stage: str, judges: dict, earlier_stages: list[tuple[str, dict]], objective_name: str,
                     round_stage: bool) -> str:
    split = "test" if "test" in judges else next(iter(judges))
    result = judges[split]
    metric, count = result.get("metric", "").replace("_", "-"), result.get("n")
    measure, before, after = headline_measure(result, objective_name)
    if measure == "win_rate":
        return (f"{stage}'s answers beat the starting model's on {format_percent(result.get('after'))} of {count} held-out "
                f"{split} prompts (reward-model win rate; 50% = no change).")
    if measure == "pair_accuracy":
        return (f"The reward model ranks the chosen answer first on {format_percent(result.get('after'))} of {count} held-out "
                f"{split} pairs ({format_percent(result.get('before'))} before training; 50% = chance).")
    # Each earlier stage's numbers on this split in the measure this stage leads with (a stage that lacks it: none)
    chain = [(label, headline_measure(results[split], objective_name) if results.get(split) else None)
             for label, results in earlier_stages]
    chain = chain if chain and all(found and found[0] == measure for _, found in chain) else []
    name = f"the judge's {metric_name(measure)}" if measure != result.get("metric") else metric
    if chain:
        start = "(untrained)" if not round_stage else f"before {chain[-1][0]}"
        steps = [f"{format_judged(measure, found[2])} after {label}" for label, found in chain]
        steps.append(f"{format_judged(measure, after)} after {stage}")
        return (f"On {count} held-out {split} prompts, {name} went from {format_judged(measure, chain[0][1][1])} "
                f"{start} to {', '.join(steps[:-1])} and {steps[-1]}.")
    if measure != result.get("metric"):  # the objective's own measure (GRPO: the judge's mean reward)
        return (f"{stage} moved {name} from {format_judged(measure, before)} to {format_judged(measure, after)} on "
                f"{count} held-out {split} prompts.")
    return (f"{stage} moved {metric} from {format_percent(result.get('before'))} to {format_percent(result.get('after'))} on {count} "
            f"held-out {split} prompts.")


def _differs(first: float | None, second: float | None) -> bool:
    return first is not None and second is not None and math.isfinite(first) and math.isfinite(second) \
        and abs(first - second) > 1e-9


def _sub_metrics(result: dict) -> dict:
    return {name: values for name, values in (result.get("details") or {}).items()
            if isinstance(values, dict) and ("before" in values or "after" in values)}


def final_numbers_table(summary: dict, info: dict, running: bool = False) -> list[str]:
    stage = summary.get("stage")
    steps = format_number(summary.get("last_step")) + _of_max_steps(info)
    best = summary.get("best_eval_loss")
    status = ("running (numbers so far)" if running else
              "finished" if summary.get("finished") else "**did not finish** (no end-of-training record)")
    rows = [
        ["status", status],
        ["optimizer steps", steps + (f" ({summary['last_epoch']:.2f} epochs)" if summary.get("last_epoch") else "")],
        ["final train loss (last logged)", format_number(summary.get("final_train_loss"))],
        ["mean train loss over the run", format_number(summary.get("train_loss"))],
        ["best eval loss",
         "n/a (no eval)" if best is None else f"{format_number(best)} at step {summary.get('best_eval_step')}"],
        ["final eval loss", format_number(summary.get("final_eval_loss"))],
    ]
    for number in objective(stage).report.summary_numbers:
        write = format_percent if number.percent else format_number
        rows.append([f"{number.label} (train / eval)", f"{write(summary.get(f'final_{number.name}_train'))} / "
                                                       f"{write(summary.get(f'final_{number.name}_eval'))}"])
    tokens_per_second, samples_per_second = summary.get("tokens_per_second"), summary.get("samples_per_second")
    peak = summary.get("peak_memory_mb")
    rows += [["throughput", f"{format_number(tokens_per_second and round(tokens_per_second))} tokens/s, "
                            f"{format_number(samples_per_second, 3)} samples/s (all ranks)"],
             ["wall time (training)", duration(summary.get("wall_time_s"))],
             ["peak memory per device", "n/a" if peak is None else f"{peak:,.0f} MB"]]
    if running:  # mid-run, the last logged values are the latest, not the final ones
        rows = [[label.replace("final ", "latest ", 1), value] for label, value in rows]
    return table_lines(["", "value"], rows)


def setup_table(info: dict) -> list[str]:
    if set(info) <= {"stage"}:
        return [f"`{TRAINING_INFO}` is missing: setup unknown."]
    get = info.get
    sources = (get("data") or {}).get("sources")  # a --dataset_mixture: what each source gave
    dataset = ("; ".join(f"`{source['source']}` ({source['rows_taken'].get('train', 0):,} training rows)"
                         for source in sources) if sources else f"`{get('dataset_name', 'n/a')}`")
    rows = [["model", f"`{get('model_name_or_path', 'n/a')}`"], ["dataset", dataset],
            ["processes", f"{get('world_size', '?')} ({get('num_nodes', '?')} node(s)), backend {get('backend', '?')}, "
                          f"device {get('device', '?')}"]]
    row = objective(get("stage") or infer_stage([]))
    unit = row.example_word
    rows.append(["batch", f"{get('per_device_batch_size')} per device × {get('gradient_accumulation_steps')} "
                          f"accumulation × {get('world_size')} processes = {get('global_batch_size')} {unit} per "
                          f"optimizer step"])
    rule = get("lr_scaling")
    if rule and rule != "none" and get("base_learning_rate") is not None:
        learning_rate = (f"{format_number(get('base_learning_rate'))} at base batch {get('base_batch_size')} → "
                         f"{format_number(get('learning_rate'))} at batch {get('global_batch_size')} ({rule} scaling)")
    else:
        learning_rate = f"{format_number(get('learning_rate'))} (not scaled)"
    rows.append(["learning rate", learning_rate])
    if row.report.setup_line:  # the objective's loss settings (beta, loss, weights)
        rows.append([row.display_name, row.report.setup_line(info)])
    forward = get(FORWARD) or get(OLD_FORWARD)  # an older run's name for it
    if forward:
        rows.append([f"{row.display_name} forward", _forward(forward)])
    rows += [["precision", f"{get('precision', '?')}, gradient checkpointing {format_number(get('gradient_checkpointing'))}"],
             ["LoRA / 4-bit", f"{format_number(get('use_lora'))} / {format_number(get('load_in_4bit'))}"],
             ["max steps, seed", f"{format_number(get('max_steps'))}, {format_number(get('seed'))}"],
             ["code", f"git {get('git_commit', 'n/a')}, started {get('started_at', 'n/a')}"]]
    versions = get("versions") or {}
    if versions:
        rows.append(["versions", " · ".join(f"{name} {version}" for name, version in versions.items())])
    return table_lines(["", "resolved value"], rows)


def _forward(forward: dict) -> str:
    """Which forward ran (training_info.json's `forward`, src/packed_dpo.py) and the share of its computed tokens
    that was padding or a repeated prompt, per pass."""
    text = forward.get("forward", "?") + (f" ({forward['reason']})" if forward.get("reason") else "")
    for kind, tokens in (forward.get("tokens") or {}).items():
        text += (f"; {kind}: {format_percent(tokens.get('padding_share'))} padding, "
                 f"{format_percent(tokens.get('repeated_prompt_share'))} repeated prompt")
    return text


def _alerts_section(alerts: list[Alert]) -> list[str]:
    if not alerts:
        return ["No health alerts: the logged metrics show none of the known failure patterns."]
    lines = []
    for alert in alerts:
        icon = "⛔" if alert.severity == "error" else "⚠️"
        lines += [f"- {icon} **{alert.severity}: {alert.title}**  ", f"  Evidence: {alert.evidence}.  ",
                  f"  What to do: {alert.advice}"]
    return lines


def _examples_section(samples_by_split: dict[str, list[dict]]) -> list[str]:
    split = "test" if samples_by_split.get("test") else next((s for s, rows in samples_by_split.items() if rows), None)
    if split is None:
        return ["No sample files in this run directory."]
    examples = pick_examples(samples_by_split[split])
    lines = [f"{len(examples)} of the {len(samples_by_split[split])} {split} prompts, chosen to be informative "
             f"(largest improvement, worst regression, other changed answers). All of them: "
             f"[`{samples_text_file(split)}`]({samples_text_file(split)})."]
    for sample in examples:
        verdict = sample.get("verdict") or {}
        label, _ = _change(sample)
        lines += ["", f"#### {split} #{sample.get('index')}: {label}", "", "**Prompt**",
                  *_fenced(sample.get("prompt"), REPORT_TEXT_LIMIT)]
        if sample.get("images"):  # the prompt's images, in the order it shows them (thumbnails in the run directory)
            lines += [" ".join(f"![image {number}]({path})" for number, path in enumerate(sample["images"], start=1)),
                      ""]
        for title, key, side in (("Reference (starting model)", "reference_answer", "reference"),
                                 ("Trained", "trained_answer", "trained")):
            suffix = f" — {_format_verdict(verdict.get(side))}" if verdict else ""
            lines += [f"**{title}**{suffix}", *_fenced(sample.get(key), REPORT_TEXT_LIMIT)]
        if sample.get("chosen") is not None:
            lines += ["**Chosen (dataset)**", *_fenced(sample.get("chosen"), REPORT_TEXT_LIMIT)]
    return lines


def _of_max_steps(info: dict) -> str:
    max_steps = info.get("max_steps")
    return f" of {max_steps}" if isinstance(max_steps, int) and max_steps > 0 else ""


def _eval_else_train(summary: dict, key: str) -> float | None:
    value = summary.get(f"{key}_eval")
    return value if value is not None else summary.get(f"{key}_train")


def _headline(info: dict, summary: dict, judged_sentence: str | None, alerts: list[Alert],
              running: bool = False) -> str:
    name = info.get("stage") or summary.get("stage") or ""
    stage = display_name(name) if name else ""
    numbers = [number for number in objective(name or infer_stage([])).report.summary_numbers if number.headline]
    final = "latest" if running else "final"
    parts = []
    if judged_sentence:
        parts.append(judged_sentence)
    elif numbers:
        values = [(number, _eval_else_train(summary, f"final_{number.name}")) for number in numbers]
        parts.append(f"{stage} ran {format_number(summary.get('last_step'))} steps; {final} " + ", ".join(
            f"{number.headline} {format_percent(value) if number.percent else format_number(value, 3)}"
            for number, value in values) + " (no held-out judge).")
    else:
        parts.append(f"SFT ran {format_number(summary.get('last_step'))} steps; {final} train loss "
                     f"{format_number(summary.get('final_train_loss'))}, best eval loss {format_number(summary.get('best_eval_loss'))} "
                     f"(no held-out judge).")
    if running:
        parts.append("Training is still running: these are the numbers so far.")
    elif not summary.get("finished"):
        parts.append(f"The run did not finish (last logged step {format_number(summary.get('last_step'))}"
                     f"{_of_max_steps(info)}).")
    errors = [alert for alert in alerts if alert.severity == "error"]
    if alerts:
        including = f" including {len(errors)} error(s)" if errors else ""
        titles = "; ".join(alert.title for alert in alerts)
        parts.append(f"**{len(alerts)} health alert(s){including}:** {titles}.")
    else:
        parts.append("No health alerts.")
    return " ".join(parts)


def render_report(run_dir: Path, info: dict, summary: dict, alerts: list[Alert], charts: list[tuple[str, Path]],
                  samples_by_split: dict[str, list[dict]], state: RunState | None = None) -> str:
    """report.md's text. `info` is training_info.json as read ({} when missing); `summary` names the stage; `state`
    (src/reporting/status.py) is the first line."""
    stage = display_name(summary["stage"])
    info = {**info, "stage": info.get("stage") or summary["stage"]}
    run_name = info.get("run_name") or run_dir.name
    running = state is not None and state.state == RUNNING
    judged_lines, judged_sentence = judged_section(info, run_dir)
    lines = [status_line(state), ""] if state is not None else []
    lines += [f"# {stage} run `{run_name}`", "",
              f"**Verdict:** {_headline(info, summary, judged_sentence, alerts, running)}", ""]
    links = [f"[`{samples_text_file(split)}`]({samples_text_file(split)})"
             for split in SPLITS if samples_by_split.get(split)]
    previous = info.get("previous_stage") or {}
    if previous.get("run_dir") and (run_dir / previous["run_dir"] / REPORT).exists():
        links.append(f"[{stage_label(previous.get('stage', 'previous'))} stage report]({previous['run_dir']}/{REPORT})")
    lines += ["Files: " + " · ".join(links + [f"`{METRICS}`", f"`{TRAINING_INFO}`"]) + ". "
              f"Rebuild with `python -m src.reporting {run_dir}`.", ""]
    lines += ["## Health alerts", "", *_alerts_section(alerts), ""]
    lines += ["## Judged results (held-out prompts)", "", *judged_lines, ""]
    if info.get("rounds"):
        plot = run_dir / PLOTS_DIR / ROUNDS_PLOT
        lines += ["## Rounds", "", *rounds_section(info["rounds"], plot if plot.exists() else None, run_dir), ""]
    if info.get("data_audit"):
        plot = run_dir / PLOTS_DIR / DATA_PLOT
        lines += ["## Data", "", *data_section(info["data_audit"], info["stage"], plot if plot.exists() else None,
                                               run_dir), ""]
    if info.get("answers"):
        lines += ["## Answers", "", *answers_section(info["answers"]), ""]
    lines += ["## Numbers so far" if running else "## Final numbers", "",
              *final_numbers_table(summary, info, running), ""]
    lines += ["## Curves", ""]
    if charts:
        for caption, path in charts:
            lines += [f"![{caption}]({path.relative_to(run_dir).as_posix()})", ""]
    else:
        lines += ["No curves: nothing plottable was logged.", ""]
    lines += ["## Sample comparisons", "", *_examples_section(samples_by_split), ""]
    lines += ["## Setup", "", *setup_table(info), ""]
    return "\n".join(lines)


def health_alerts(metrics: list[dict], info: dict, stage: str) -> list[Alert]:
    """The training curves' alerts and the data and answer audits' (src/audit/findings.py), errors first."""
    alerts = detect_alerts(metrics, stage, info) + audit_alerts({**info, "stage": stage})
    return sorted(alerts, key=lambda alert: alert.severity != "error")


def build_report(run_dir: str | Path, live: Live | None = None) -> Path:
    """Write plots/, distributed_output_<split>.txt and report.md into `run_dir`; return report.md's path. `live`:
    where the training loop is, when it calls this while it runs.

    Raises ReportError when `run_dir` is not a run directory with at least one logged metric record.
    """
    return _build(Path(run_dir), live)[0]


def _build(run_dir: Path, live: Live | None = None) -> tuple[Path, list[Alert]]:
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory")
    if not (run_dir / METRICS).exists():
        raise ReportError(f"{run_dir} has no {METRICS}: not a prefkit run directory (results/<run_name>/)?")
    try:
        metrics = read_jsonl(run_dir / METRICS)
    except ValueError as error:
        raise ReportError(str(error)) from None
    if not metrics:
        raise ReportError(f"{run_dir / METRICS} holds no complete record: the run stopped before its first log")
    try:
        info = read_json(run_dir / TRAINING_INFO) if (run_dir / TRAINING_INFO).exists() else {}
    except ValueError:
        info = {}
    stage = info.get("stage") or infer_stage(metrics)

    # Values measured by the job outside the metrics (e.g. wall time, peak memory) fill what the metrics lack.
    summary = summarize(metrics, stage)
    for key, value in (info.get("summary") or {}).items():
        if summary.get(key) is None:
            summary[key] = value
    alerts = health_alerts(metrics, info, stage)
    charts = plot_history(metrics, stage, run_dir / PLOTS_DIR, *dpo_loss_config(info), info=info)
    if info.get("rounds"):
        plot_rounds(info["rounds"], run_dir / PLOTS_DIR / ROUNDS_PLOT)
    if live is None or not (run_dir / PLOTS_DIR / DATA_PLOT).exists():  # it does not change while the run trains
        plot_data(info.get("data_audit"), run_dir / PLOTS_DIR / DATA_PLOT, objective(stage).display_name)

    samples_by_split = {}
    for split in SPLITS:
        path = run_dir / samples_file(split)
        if path.exists():
            samples_by_split[split] = sorted(read_jsonl(path), key=lambda sample: sample.get("index", 0))
            judge = (info.get("judges") or {}).get(split)
            text = render_samples_text(samples_by_split[split], split, info.get("run_name", ""), judge)
            write_text(run_dir / samples_text_file(split), text)

    written = datetime.fromtimestamp((run_dir / METRICS).stat().st_mtime, timezone.utc)
    state = run_state(info, metrics, live, last_written=written)
    report = run_dir / REPORT
    write_text(report, render_report(run_dir, info, summary, alerts, charts, samples_by_split, state))
    return report, alerts


def report_verdict(run_dir: str | Path) -> str | None:
    """report.md's one-sentence `**Verdict:**` line (without its label), or None without a report."""
    path = Path(run_dir) / REPORT
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return next((line.removeprefix("**Verdict:** ") for line in lines if line.startswith("**Verdict:** ")), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.reporting", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, e.g. results/<run_name>")
    args = parser.parse_args(argv)
    try:
        report, alerts = _build(Path(args.run_dir))
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(format_alerts(alerts))
    print(f"report: {report}")
    return 0

