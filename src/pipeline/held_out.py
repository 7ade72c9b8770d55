"""Held-out prompts answered before and after a stage trains (a reward model: the held-out pairs it scores instead),
judged by --judge on rank 0 and kept in samples_<split>.jsonl; the tools a stage samples with (--tools); the prompts an
objective judges at each evaluation (GRPO's `judged_eval`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from src import run_files
from src.config import Config
from src.config_error import ConfigError
from src.data import PreparedData
from src.engines import generating
from src.generation import generate_answers, stop_ids
from src.judges import judge_for, pair_accuracy, score_pairs
from src.objectives import objective
from src.pipeline.stages import Stage
from src.plan import Plan
from src.tool_calls import ToolsError
from src.tools import check_template, session_for
from src.vision import IMAGE_COLUMN, thumbnail
from src.trainers.judged_eval import JudgedEval, judge_rows
from src.world import World


@dataclass
class HeldOut:
    """A stage's held-out measure as it stood before training: the rows answered (per split: "val", "test"), their
    answers, a reward model's scores of the held-out pairs, the tools sampled with, the evaluation's judged prompts."""

    rows: dict[str, list[dict]]
    before: dict[str, list]
    pairs_before: dict[str, list] = field(default_factory=dict)
    tools: object = None
    judged_eval: JudgedEval | None = None


def held_out_rows(prepared: PreparedData, split: str, count: int) -> list[dict]:
    """The first `count` rows of a held-out split that have a prompt to answer (a KTO split made from pairs holds each
    pair's prompt once, on its desirable row: the same prompts as the DPO stage's split)."""
    dataset = prepared.splits[split] if split in prepared.splits else None
    if dataset is None or count == 0:
        return []
    rows = dataset.select(range(min(2 * count, len(dataset)))).to_list()  # a KTO pair's rows: one with a sample
    return [row for row in rows if row["sample_prompt_ids"]][:count]


def answer_held_out(model, tokenizer, rows_by_split: dict[str, list[dict]], config: Config,
                    plan: Plan, world: World, tools=None, processing=None) -> dict[str, list[str]]:
    """Each split's rows answered; a vision-language model's from their images too (`processing`: src/vision.py)."""
    return {
        split: generate_answers(model, tokenizer, [row["sample_prompt_ids"] for row in rows],
                                config.training.max_new_tokens, max(8, plan.per_device_batch_size * 4), world, tools,
                                images=[row.get(IMAGE_COLUMN) for row in rows], processing=processing)
        for split, rows in rows_by_split.items()
    }


def score_held_out_pairs(model, tokenizer, prepared: PreparedData, plan: Plan, world: World) -> dict[str, list]:
    """A reward model's (chosen, rejected) rewards for every pair of the validation and test splits."""
    splits = {"val": prepared.validation, "test": prepared.test}
    return {split: score_pairs(model, list(zip(dataset["chosen_ids"], dataset["rejected_ids"])),
                               tokenizer.pad_token_id, max(8, plan.per_device_batch_size * 4), world)
            for split, dataset in splits.items() if dataset is not None}


def measure_before(stage: Stage, model, tokenizer, prepared: PreparedData, world: World, reward: bool) -> HeldOut:
    """The starting model's answers to the held-out prompts (its tools opened for the stage), or a reward model's
    scores of the held-out pairs: a reward model answers no prompts, it is measured by how it ranks them."""
    config, plan = stage.config, stage.plan
    rows = {} if reward else {split: held_out_rows(prepared, split, config.training.num_samples)
                              for split in ("validation", "test")}
    rows = {("val" if split == "validation" else split): value for split, value in rows.items() if value}
    tools = tool_session(config, tokenizer, model)
    # Under ZeRO-3 and FSDP2 each rank holds its share of the weights from the load on, and no trainer's engine
    # fetches them yet: each module's weights are gathered for its forward only (src/engines.py `generating`).
    with generating(model, plan.precision) if rows or reward else contextlib.nullcontext():
        before = answer_held_out(model, tokenizer, rows, config, plan, world, tools, prepared.processing)
        pairs_before = score_held_out_pairs(model, tokenizer, prepared, plan, world) if reward else {}
    return HeldOut(rows, before, pairs_before, tools)


def measure_after(held_out: HeldOut, stage: Stage, trained, tokenizer, prepared: PreparedData, world: World,
                  reward: bool) -> tuple[dict, dict]:
    """The trained model's answers to the same prompts (its tools closed after), or its scores of the same pairs."""
    after = answer_held_out(trained, tokenizer, held_out.rows, stage.config, stage.plan, world, held_out.tools,
                            prepared.processing)
    if held_out.tools is not None:
        held_out.tools.close()
    pairs_after = score_held_out_pairs(trained, tokenizer, prepared, stage.plan, world) if reward else {}
    return after, pairs_after


def judge_held_out(stage: Stage, held_out: HeldOut, after: dict, pairs_after: dict) -> dict:
    """Rank 0: the answers before and after judged and written to samples_<split>.jsonl; a reward model's held-out
    pair accuracy before and after. Returns the judged results per split."""
    config = stage.config
    judge = held_out.judged_eval.judge if held_out.judged_eval else judge_for(config.training.judge,
                                                                              config.data.dataset_name)
    judged = record_samples(stage.run_dir, held_out.rows, held_out.before, after, judge if held_out.rows else None)
    judged.update({split: pair_accuracy(held_out.pairs_before[split], scores).to_dict()
                   for split, scores in pairs_after.items()})
    return judged


def record_samples(run_dir: Path, rows_by_split, before, after, judge) -> dict:
    """samples_<split>.jsonl on rank 0, and the judged results per split. `before` / `after`: per split, each answer as
    generate_answers gives it (its text and the answer audit's numbers, src/generation.py) or as plain text."""
    results = {}
    for split, rows in rows_by_split.items():
        answers = {side: [answer if isinstance(answer, dict) else {"text": answer} for answer in given[split]]
                   for side, given in (("reference", before), ("trained", after))}
        judged = None
        if judge is not None and rows:
            judged = judge.judge(judge_rows(rows), *([answer["text"] for answer in answers[side]]
                                                     for side in ("reference", "trained")))
            results[split] = judged.to_dict()
        path = run_dir / run_files.samples_file(split)
        path.unlink(missing_ok=True)
        for index, row in enumerate(rows):
            stats = {side: {key: value for key, value in answers[side][index].items() if key != "text"}
                     for side in answers}
            images = sample_thumbnails(run_dir, split, index, row.get(IMAGE_COLUMN))
            run_files.append_jsonl(path, {
                "index": index,
                "split": split,
                "prompt": row["sample_prompt"],
                "reference_answer": answers["reference"][index]["text"],
                "trained_answer": answers["trained"][index]["text"],
                "chosen": row["sample_chosen"],
                "rejected": row["sample_rejected"],
                "meta": row.get("meta") or {},
                "verdict": judged.verdicts[index] if judged else None,
                **({"answer_stats": stats} if all(stats.values()) else {}),
                **({"images": images} if images else {}),
            })
    return results


def sample_thumbnails(run_dir: Path, split: str, index: int, images: list | None) -> list[str]:
    """A held-out prompt's images as thumbnails in the run directory (its pages link them), their relative paths."""
    paths = []
    for number, data in enumerate(images or [], start=1):
        name = f"{run_files.SAMPLE_IMAGES_DIR}/{split}_{index}_{number}.png"
        run_files.write_bytes(run_dir / name, thumbnail(data))
        paths.append(name)
    return paths


def tool_session(config: Config, tokenizer, model):
    """The stage's tools (--tools: src/tools.py), checked against the chat template and the model's end tokens before
    anything is sampled; None without --tools."""
    session = session_for(config)
    if session is not None:
        try:
            check_template(tokenizer, stop_ids(model, tokenizer), config.data.chat_template_kwargs)
        except ToolsError as error:
            session.close()
            raise ConfigError(str(error)) from None
    return session


def judged_eval_of(stage: Stage, prepared: PreparedData, held_out: HeldOut, tokenizer, world: World):
    """The held-out prompts an objective whose row sets `judged_eval` (GRPO) judges at the start and each evaluation
    (src/trainers/judged_eval.py): the first --judged_eval_prompts validation prompts, scored by --judge; None without
    them or a judge. Its start reuses the answers judged before training when they are to the same prompts."""
    config, rows, before = stage.config, held_out.rows, held_out.before
    count = config.training.judged_eval_prompts if objective(stage.name).training.judged_eval else 0
    curve_rows = held_out_rows(prepared, "validation", count)
    judge = judge_for(config.training.judge, config.data.dataset_name) if curve_rows else None
    if judge is None:
        return None
    ids = [row["sample_prompt_ids"] for row in curve_rows]
    start = [answer["text"] for answer in before.get("val", [])][:len(ids)]
    same = [row["sample_prompt_ids"] for row in rows.get("val", [])][:len(ids)] == ids and len(start) == len(ids)
    return JudgedEval(curve_rows, judge, tokenizer, config.training.max_new_tokens,
                      max(8, stage.plan.per_device_batch_size * 4), world, start if same else None, held_out.tools)
