"""The audit inside a training run: what a stage of the pipeline calls at each of its steps (src/main_distributed.py,
src/pipeline/).

    info["data_audit"] = opening(prepared.summary, stage)    # training_info.json as the stage opens
    judge_training_pairs(prepared, stage, world, tokenizer)   # before training, every rank its share
    reference_part(trainer.train_dataset, stage, max_length)  # rank 0, once the trainer has the reference log-probs
    info["answers"] = answers_of(run_dir)                     # rank 0, from the samples files the stage wrote

training_info.json's `data_audit` holds, per split (train, validation, test), the preparation pass's numbers
(src/data/pair_audit.py) with the reference's and the judge's next to them (null where the run has none), and
`answers` holds, per split (val, test), the held-out answers before → after (src/audit/answers.py).
"""

from __future__ import annotations

from pathlib import Path

from src import run_files
from src.audit.answers import answers_audit
from src.audit.judged import INVERTED_FILE, judge_pairs
from src.audit.reference import reference_audit
from src.data import source_rows
from src.distributed import print0
from src.judges import judge_for
from src.objectives import PAIRED_SHAPES, PROMPTS, SEQUENCES, UNPAIRED, objective
from src.run_safety.disk_space import write_failures_noted
from src.reporting.formatting import format_number, format_percent

JUDGE_FIELDS = ("judge", "judged_pairs", "judge_inverted_share", "judge_tie_share", "inverted_pairs_file")
REFERENCE_FIELDS = ("reference_pairs", "reference_agreement", "reference_agreement_per_token", "reference_margin")


def opening(summary: dict, stage: str) -> dict:
    """The data audit as a stage opens: the preparation pass's numbers, the reference and judge parts still null."""
    audit = {}
    for kind, numbers in (summary.get("audit") or {}).items():
        audit[kind] = dict(numbers)
        if "reference" in objective(stage).report.audit_parts:
            audit[kind].update(dict.fromkeys(REFERENCE_FIELDS + JUDGE_FIELDS))
    return audit


def judged(stage) -> bool:
    """Whether a stage's training pairs are judged: its objective's audit has the "judged" part (DPO and reward), and
    it is not a round (a round's pairs are the judge's)."""
    return "judged" in objective(stage.name).report.audit_parts and not stage.round and stage.config.training.audit_judge_pairs > 0


def _update_train(info_path: Path, fields: dict) -> None:
    info = run_files.read_json(info_path)
    audit = info.get("data_audit") or {}
    audit["train"] = {**(audit.get("train") or {}), **fields}
    run_files.update_json(info_path, data_audit=audit)


def judge_training_pairs(prepared, stage, world, tokenizer) -> None:
    """The judge part, with the run's judge (none: nothing): every rank scores its share of the drawn pairs; rank 0
    records it and writes the inverted pairs to data_audit_inverted.jsonl in the run directory. The judge is let go
    before training: a reward model does not sit in the GPU's memory beside the policy."""
    config = stage.config
    judge = judge_for(config.training.judge, config.data.dataset_name)
    if judge is None:
        return
    audit, inverted = judge_pairs(judge, prepared.train, source_rows(prepared, "train"), prepared.summary["source"],
                                  config.training.audit_judge_pairs, config.training.seed, world, tokenizer)
    del judge
    release_memory()
    if not world.is_main:
        return
    path = stage.run_dir / INVERTED_FILE
    audit["inverted_pairs_file"] = INVERTED_FILE
    with write_failures_noted(stage.run_dir):  # rank 0's files: a failed write stops every rank at the next barrier
        run_files.write_text(path, "".join(run_files.dumps(row) + "\n" for row in inverted))
        _update_train(stage.run_dir / run_files.TRAINING_INFO, audit)
    print0(f"  data audit: {audit['judge']} ranks {format_percent(audit['judge_inverted_share'])} of "
           f"{audit['judged_pairs']:,} training pairs the other way and ties {format_percent(audit['judge_tie_share'])}"
           f" ({audit['judge_seconds']} s){f'; listed in {path}' if inverted else ''}")


def release_memory() -> None:
    """Free what a judge held (a reward model's weights) before the trainer claims the device."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reference_part(dataset, stage, max_length: int | None) -> None:
    """The reference part, rank 0: from the log-probs TRL's precompute pass attached to the training dataset."""
    audit = reference_audit(dataset, max_length)
    if audit is None:
        return
    with write_failures_noted(stage.run_dir):
        _update_train(stage.run_dir / run_files.TRAINING_INFO, audit)
    print0(f"  data audit: the reference ranks {format_percent(audit['reference_agreement'])} of training pairs the "
           f"labels' way ({format_percent(audit['reference_agreement_per_token'])} per token), median margin "
           f"{audit['reference_margin']['median']}")


def answers_of(run_dir: Path) -> dict:
    """The answer audit of every samples file the stage wrote (val, test)."""
    audits = {}
    for split in ("val", "test"):
        path = Path(run_dir) / run_files.samples_file(split)
        if path.exists():
            audit = answers_audit(run_files.read_jsonl(path))
            if audit:
                audits[split] = audit
    return audits


def print_answers(answers: dict) -> None:
    for split, audit in answers.items():
        print0(f"  answers ({split}): {audit['length_before']['mean']} → {audit['length_after']['mean']} tokens "
               f"(x{audit['length_ratio']}), cut {format_percent(audit['cut_share_before'])} → "
               f"{format_percent(audit['cut_share_after'])}, repetitive {format_percent(audit['repetition_share_before'])}"
               f" → {format_percent(audit['repetition_share_after'])}")
        if "tool_calls_per_answer_after" in audit:  # --tools: the answers' tool use (src/tools.py)
            errors = {side: ", ".join(f"{kind} {count}" for kind, count in audit[f"tool_errors_{side}"].items())
                      or "none" for side in ("before", "after")}
            print0(f"  tool use ({split}): calls per answer {audit['tool_calls_per_answer_before']} → "
                   f"{audit['tool_calls_per_answer_after']}, valid {format_percent(audit['tool_valid_share_before'])}"
                   f" → {format_percent(audit['tool_valid_share_after'])}, errors {errors['before']} → "
                   f"{errors['after']}, turns per answer {audit['tool_turns_per_answer_before']} → "
                   f"{audit['tool_turns_per_answer_after']}")


def format_data_audit(audit: dict, stage: str) -> str:
    """A few console lines for the training split, as the stage opens (its tool calls' problems last, where it has
    calls)."""
    lines = _data_audit_lines(audit, stage)
    train = audit.get("train") or {}
    if lines and train.get("tool_calls"):
        lines += (f"\n  data audit (train): {format_number(train['tool_calls'])} tool calls; "
                  f"{format_number(train['tool_unparsed'])} with arguments that do not parse, "
                  f"{format_number(train['tool_unknown'])} naming a tool the row's `tools` lack, "
                  f"{format_number(train['tool_schema'])} breaking its schema")
    if lines and train.get("images"):
        lines += f"\n{images_line(train['images'])}"
    return lines


def images_line(images: dict) -> str:
    """The training split's images in one console line (src/data/pair_audit.py images_audit)."""
    return (f"  data audit (train): images in {format_percent(images['rows_with_images_share'])} of rows, "
            f"{images['images_per_row']['mean']} a row, {images['image_tokens']['mean']} image tokens a row, "
            f"{images['megapixels_per_image']['median']} megapixels each (median); repeated images "
            f"{format_percent(images['duplicate_image_share'])}; the same answer to the same question for different "
            f"images {format_percent(images['answer_ignores_image_share'])}")


def _data_audit_lines(audit: dict, stage: str) -> str:
    train = audit.get("train")
    if not train:
        return ""
    shape = objective(stage).data_shape
    line = (f"  data audit (train): {train['pairs']:,} {'pairs' if shape in PAIRED_SHAPES else 'rows'}, "
            f"{format_number(train['distinct_prompts'])} distinct prompts, {format_percent(train['duplicate_share'])} "
            "duplicate rows")
    if shape == UNPAIRED:
        per_prompt = (f"; per prompt: {format_number(train['prompts_both'])} with both, "
                      f"{format_number(train['prompts_only_desirable'])} thumbs up only, "
                      f"{format_number(train['prompts_only_undesirable'])} thumbs down only"
                      if train.get("prompts_both") is not None else "")
        return (f"{line}\n  data audit (train): {format_number(train['desirable'])} desirable, "
                f"{format_number(train['undesirable'])} undesirable{per_prompt}; completions "
                f"{train['completion_tokens']['mean']} tokens on average, {format_percent(train['truncated_share'])} "
                "truncated")
    if shape == PROMPTS:  # prompts alone: the answers are sampled as it trains
        return f"{line}; prompts {train['prompt_tokens']['mean']} tokens on average (p95 {train['prompt_tokens']['p95']})"
    if shape == SEQUENCES:
        return (f"{line}; {train['sequence_tokens']['mean']} tokens on average (p95 {train['sequence_tokens']['p95']}),"
                f" {format_percent(train['truncated_share'])} truncated")
    return (f"{line}\n  data audit (train): chosen longer in {format_percent(train['chosen_longer_share'])}, shorter in "
            f"{format_percent(train['chosen_shorter_share'])} (mean {train['chosen_tokens']['mean']} vs "
            f"{train['rejected_tokens']['mean']} tokens); truncated: chosen "
            f"{format_percent(train['chosen_truncated_share'])}, rejected "
            f"{format_percent(train['rejected_truncated_share'])}; near-identical "
            f"{format_percent(train['near_identical_share'])}")
