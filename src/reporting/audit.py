"""report.md's Data and Answers sections and plots/data.png, from training_info.json's `data_audit` and `answers`
(src/audit/: what the numbers are and how they are computed)."""

from __future__ import annotations

from pathlib import Path

from src.objectives import PROMPTS, SEQUENCES, UNPAIRED, objective
from src.reporting.formatting import format_number, format_percent, table_lines
from src.run_files import atomic_path

DATA_PLOT = "data.png"
KINDS = ("train", "validation", "test")


def _fixed(value, decimals: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{decimals}f}"


def _tokens(stats: dict | None) -> str:
    stats = stats or {}
    return f"{_fixed(stats.get('mean'))} / {_fixed(stats.get('median'), 0)} / {_fixed(stats.get('p95'), 0)}"


def _count_share(count, share) -> str:
    return f"{format_number(count)} ({format_percent(share)})" if count is not None else "n/a"


def _per_split_table(headers: list[str], names: list[str], columns: list[list[str]]) -> list[str]:
    """A table with a row per measure (`names`) and a column per split (`columns`, in `headers`' order)."""
    return table_lines(["", *headers], [[name, *(column[index] for column in columns)]
                                        for index, name in enumerate(names)])


def _prompts_data_table(audit: dict, kinds: list[str]) -> list[str]:
    """Prompts alone (the answers are sampled as it trains): how many, repeats, lengths, held-out ones seen in train."""
    names = ["prompts", "distinct prompts", "duplicate rows", "empty prompts (dropped)",
             "prompts over --max_length (dropped)", "prompt tokens: mean / median / p95", "prompts also in train"]
    rows = [[format_number(item.get("pairs")), format_number(item.get("distinct_prompts")),
             _count_share(item.get("duplicate_pairs"), item.get("duplicate_share")),
             format_number(item.get("empty_answers")), format_number(item.get("prompts_dropped")),
             _tokens(item.get("prompt_tokens")),
             "—" if kind == "train" else format_percent(item.get("prompts_in_train_share"))]
            for kind, item in ((kind, audit[kind]) for kind in kinds)]
    return _per_split_table(kinds, names, rows)


def data_section(audit: dict, stage: str, plot: Path | None, run_dir: Path) -> list[str]:
    """Markdown lines: per split, what the pairs can teach; the reference's and the judge's view of the training
    pairs; the picture."""
    kinds = [kind for kind in KINDS if audit.get(kind)]
    if not kinds:
        return ["No data audit in this run (a run from before the audit, or no prepared data)."]
    shape = objective(stage).data_shape
    if shape == UNPAIRED:
        return _kto_data_table(audit, kinds) + _reasoning_lines(audit.get("train") or {})
    if shape == PROMPTS:
        return _prompts_data_table(audit, kinds)
    preference = shape != SEQUENCES
    lines = _pairs_data_table(audit, kinds) if preference else _sequences_data_table(audit, kinds)
    train = audit.get("train") or {}
    lines += _reasoning_lines(train) + _images_lines(audit, kinds)
    if preference:
        lines += ["", _reference_line(train, stage), _judge_line(train)]
    if plot is not None:
        lines += ["", f"![chosen vs rejected length, reference margin]({plot.relative_to(run_dir).as_posix()})"]
    return lines


def _images_lines(audit: dict, kinds: list[str]) -> list[str]:
    """Per split, the rows' images (src/data/pair_audit.py images_audit); none without images."""
    shown = [kind for kind in kinds if audit[kind].get("images")]
    if not shown:
        return []
    names = ["rows with images", "images per row: mean / median / p95", "image tokens per row: mean / median / p95",
             "megapixels per image: median", "repeated images (same content)",
             "same answer to the same question for other images"]
    rows = [[format_percent(item["rows_with_images_share"]), _tokens(item["images_per_row"]),
             _tokens(item["image_tokens"]), format_number(item["megapixels_per_image"]["median"]),
             format_percent(item["duplicate_image_share"]), format_percent(item["answer_ignores_image_share"])]
            for item in (audit[kind]["images"] for kind in shown)]
    return ["", "**Images**", "", *_per_split_table(shown, names, rows)]


def _pairs_data_table(audit: dict, kinds: list[str]) -> list[str]:
    """Pairs per split: how many, repeats, drops, lengths, which side is longer, truncation, shared starts, held-out
    prompts seen in train."""
    names = ["pairs", "distinct prompts", "duplicate rows", "chosen == rejected (dropped)", "empty answers (dropped)",
             "prompts over --max_length (dropped)", "chosen tokens: mean / median / p95",
             "rejected tokens: mean / median / p95", "chosen longer / shorter / equal", "pairs cut by --max_length",
             "chosen cut by --max_length", "rejected cut by --max_length", "answers' shared start: median",
             "near-identical pairs (> 80%)", "prompts also in train"]
    rows = [[format_number(item.get("pairs")), format_number(item.get("distinct_prompts")),
             _count_share(item.get("duplicate_pairs"), item.get("duplicate_share")),
             _count_share(item.get("identical_pairs"), item.get("identical_share")),
             format_number(item.get("empty_answers")), format_number(item.get("prompts_dropped")),
             _tokens(item.get("chosen_tokens")), _tokens(item.get("rejected_tokens")),
             " / ".join(format_percent(item.get(key)) for key in
                        ("chosen_longer_share", "chosen_shorter_share", "equal_length_share")),
             format_percent(item.get("truncated_share")), format_percent(item.get("chosen_truncated_share")),
             format_percent(item.get("rejected_truncated_share")),
             format_percent(item.get("overlap_median")), format_percent(item.get("near_identical_share")),
             "—" if kind == "train" else format_percent(item.get("prompts_in_train_share"))]
            for kind, item in ((kind, audit[kind]) for kind in kinds)]
    # A run from prompts alone: its held-out splits are prompts, audited as such (count, repeats, overlap with train)
    headers = [f"{kind} (prompts)" if "prompt_tokens" in audit[kind] and "chosen_tokens" not in audit[kind] else kind
               for kind in kinds]
    return _per_split_table(headers, names, rows)


def _sequences_data_table(audit: dict, kinds: list[str]) -> list[str]:
    """SFT's sequences per split: how many, repeats, drops, lengths, truncation."""
    names = ["rows", "distinct prompts", "duplicate rows", "empty answers (dropped)", "rows with nothing to learn "
             "after --max_length (dropped)", "tokens: mean / median / p95", "cut by --max_length"]
    rows = [[format_number(item.get("pairs")), format_number(item.get("distinct_prompts")),
             _count_share(item.get("duplicate_pairs"), item.get("duplicate_share")),
             format_number(item.get("empty_answers")), format_number(item.get("prompts_dropped")),
             _tokens(item.get("sequence_tokens")), format_percent(item.get("truncated_share"))]
            for item in (audit[kind] for kind in kinds)]
    return _per_split_table(kinds, names, rows)


def _reference_line(train: dict, stage: str) -> str:
    """How the reference model ranks the training pairs before training (or why it was not measured)."""
    if train.get("reference_agreement") is None:
        return f"**Reference model:** {objective(stage).report.reference_unmeasured}"
    margin = train.get("reference_margin") or {}
    return (f"**Reference model:** ranks {format_percent(train['reference_agreement'])} of "
            f"{format_number(train.get('reference_pairs'))} training pairs the labels' way by summed "
            f"log-probs, {format_percent(train.get('reference_agreement_per_token'))} per token; margin "
            f"(chosen − rejected log-prob) median {format_number(margin.get('median'), 3)}, 5–95% "
            f"{format_number(margin.get('p5'), 3)} … {format_number(margin.get('p95'), 3)}.")


def _judge_line(train: dict) -> str:
    """What a judge makes of the training pairs: the share it ranks the other way and its ties (or that none ran)."""
    if train.get("judge_inverted_share") is None:
        return "**Judge:** none for this data (`--judge`: the embedded check, a reward model, or `module:function`)."
    return (f"**Judge ({train.get('judge')}):** of {format_number(train.get('judged_pairs'))} training "
            f"pairs, ranks {format_percent(train['judge_inverted_share'])} the other way (listed in "
            f"[`{train.get('inverted_pairs_file')}`]({train.get('inverted_pairs_file')})) and ties "
            f"{format_percent(train.get('judge_tie_share'))}.")


def _reasoning_lines(train: dict) -> list[str]:
    """The training answers' reasoning (src/data/pair_audit.py reasoning_audit), when they reason."""
    sides = [side for side in ("chosen", "rejected", "completion") if train.get(f"{side}_reasoning_share")]
    if not sides:
        return []
    parts = []
    for side in sides:
        tokens = train.get(f"{side}_reasoning_tokens") or {}
        cut = train.get(f"{side}_reasoning_cut_share")
        parts.append(f"{format_percent(train[f'{side}_reasoning_share'])} of {side} answers reason (median "
                     f"{format_number(tokens.get('median'))}, p95 {format_number(tokens.get('p95'))} tokens"
                     + (f"; --max_length cuts into {format_percent(cut)})" if cut is not None else "; dropped by "
                        "--reasoning drop)"))
    if train.get("only_reasoning_differs_share") is not None:
        parts.append(f"pairs differing only in their reasoning {format_percent(train['only_reasoning_differs_share'])}"
                     f", only in their final answer {format_percent(train.get('only_answer_differs_share'))}")
    return ["", f"**Reasoning:** {'; '.join(parts)}."]


def _kto_data_table(audit: dict, kinds: list[str]) -> list[str]:
    """KTO's rows per split: the two classes, and per prompt which of them its answers have."""
    names = ["rows", "desirable / undesirable", "distinct prompts", "prompts with both / thumbs up only / thumbs down "
             "only", "answers per prompt", "duplicate rows", "empty answers (dropped)", "prompts over --max_length "
             "(dropped)", "completion tokens: mean / median / p95", "cut by --max_length", "prompts also in train"]
    columns = []
    for kind in kinds:
        item = audit[kind]
        columns.append([
            format_number(item.get("pairs")),
            f"{format_number(item.get('desirable'))} / {format_number(item.get('undesirable'))}",
            format_number(item.get("distinct_prompts")),
            " / ".join(format_number(item.get(key)) for key in
                       ("prompts_both", "prompts_only_desirable", "prompts_only_undesirable")),
            format_number(item.get("answers_per_prompt")),
            _count_share(item.get("duplicate_pairs"), item.get("duplicate_share")),
            format_number(item.get("empty_answers")), format_number(item.get("prompts_dropped")),
            _tokens(item.get("completion_tokens")), format_percent(item.get("truncated_share")),
            "—" if kind == "train" else format_percent(item.get("prompts_in_train_share"))])
    return _per_split_table(kinds, names, columns)


def answers_section(answers: dict) -> list[str]:
    """Markdown lines: the held-out answers before → after, per split."""
    splits = [split for split in ("val", "test") if answers.get(split)]
    if not splits:
        return ["No answer audit (no held-out answers, or a run from before the audit)."]
    names = ["answers", "tokens: mean before → after", "tokens: median before → after", "length ratio (after/before)",
             "cut at --max_new_tokens", "repetitive (seq-rep-4 ≥ 0.5)", "empty"]
    columns = []
    for split in splits:
        item = answers[split]
        columns.append([
            format_number(item.get("n")),
            f"{_fixed(item['length_before']['mean'])} → {_fixed(item['length_after']['mean'])}",
            f"{_fixed(item['length_before']['median'], 0)} → {_fixed(item['length_after']['median'], 0)}",
            _fixed(item.get("length_ratio"), 2),
            *(f"{format_percent(item.get(f'{name}_before'))} → {format_percent(item.get(f'{name}_after'))}"
              for name in ("cut_share", "repetition_share", "empty_share"))])
    if any(answers[split].get(f"reasoning_share_{name}") for split in splits for name in ("before", "after")):
        names += ["answers that reason", "reasoning tokens: median before → after",
                  "final answer tokens: median before → after", "no closing tag", "cut inside the reasoning (no answer)"]
        for split, column in zip(splits, columns):
            item = answers[split]
            column += [f"{format_percent(item.get('reasoning_share_before'))} → "
                       f"{format_percent(item.get('reasoning_share_after'))}",
                       *(f"{_fixed((item.get(f'{name}_before') or {}).get('median'), 0)} → "
                         f"{_fixed((item.get(f'{name}_after') or {}).get('median'), 0)}"
                         for name in ("reasoning_length", "final_answer_length")),
                       *(f"{format_percent(item.get(f'{name}_before'))} → {format_percent(item.get(f'{name}_after'))}"
                         for name in ("unclosed_share", "cut_in_reasoning_share"))]
    if any("tool_calls_per_answer_after" in answers[split] for split in splits):  # --tools (src/tools.py)
        names += ["tool calls per answer", "valid calls", "tool errors", "turns per answer"]
        for split, column in zip(splits, columns):
            item = answers[split]
            errors = {side: ", ".join(f"{kind} {count}" for kind, count in (item.get(f"tool_errors_{side}") or {})
                                      .items()) or "none" for side in ("before", "after")}
            column += [f"{_fixed(item.get('tool_calls_per_answer_before'), 2)} → "
                       f"{_fixed(item.get('tool_calls_per_answer_after'), 2)}",
                       f"{format_percent(item.get('tool_valid_share_before'))} → "
                       f"{format_percent(item.get('tool_valid_share_after'))}",
                       f"{errors['before']} → {errors['after']}",
                       f"{_fixed(item.get('tool_turns_per_answer_before'), 2)} → "
                       f"{_fixed(item.get('tool_turns_per_answer_after'), 2)}"]
    lines = _per_split_table(splits, names, columns)
    judged = (answers.get("test") or answers[splits[0]]).get("judged_by_length")
    if judged:
        parts = [f"{name.replace('_', ' ')}: {format_number(group['n'])} answers, mean judged change "
                 f"{format_number(group['mean_change'], 3)}" for name, group in judged.items() if group["n"]]
        lines += ["", f"Judged change by length ({'test' if answers.get('test') else splits[0]}): {'; '.join(parts)}."]
    return lines


def plot_data(audit: dict, path: Path, title: str) -> bool:
    """Chosen vs rejected answer length (training pairs) and the reference margin; False and no file when the audit
    has no length histogram (an SFT stage, a run from before the audit). `title`: the objective's name (its row's
    display_name)."""
    train = (audit or {}).get("train") or {}
    lengths = train.get("length_histogram") or {}
    if "chosen" not in lengths:
        return False
    from matplotlib.figure import Figure  # drawn at the end of a run only (~1 s import)

    margins = train.get("reference_margin_histogram")
    figure = Figure(figsize=(11 if margins else 6.5, 4.0), dpi=110)
    figure.subplots_adjust(left=0.07, right=0.98, top=0.86, bottom=0.14, wspace=0.25)
    axes = figure.subplots(1, 2 if margins else 1, squeeze=False)[0]
    edges = lengths["edges"]
    centers = [(low + high) / 2 for low, high in zip(edges, edges[1:])]
    width = edges[1] - edges[0]
    for name, color in (("chosen", "#2ca02c"), ("rejected", "#d62728")):
        axes[0].bar(centers, lengths[name], width=width, alpha=0.5, color=color, label=name)
    axes[0].set_xlabel("answer length (tokens; the last bar holds the longest 1%)")
    axes[0].set_ylabel("training pairs")
    axes[0].set_title(f"Answer length: chosen longer in {format_percent(train.get('chosen_longer_share'))}, "
                      f"shorter in {format_percent(train.get('chosen_shorter_share'))}", fontsize=10)
    axes[0].legend(fontsize=8)
    if margins:
        edges = margins["edges"]
        centers = [(low + high) / 2 for low, high in zip(edges, edges[1:])]
        colors = ["#2ca02c" if center > 0 else "#d62728" for center in centers]
        axes[1].bar(centers, margins["margin"], width=edges[1] - edges[0], color=colors, alpha=0.7)
        axes[1].axvline(0, color="black", linewidth=0.8)
        axes[1].set_xlabel("reference log-prob margin: chosen − rejected (summed)")
        axes[1].set_title(f"Reference ranks {format_percent(train.get('reference_agreement'))} of pairs the labels' "
                          f"way ({format_percent(train.get('reference_agreement_per_token'))} per token)", fontsize=10)
    figure.suptitle(f"Training pairs: what {title} is given", fontsize=11)
    for ax in axes:
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as temporary:
        figure.savefig(temporary)
    return True
