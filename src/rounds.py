"""On-policy rounds (iterative DPO): the current policy answers the train prompts K times, the judge scores every
answer, each prompt's best and worst answers become a preference pair, and DPO trains on those pairs; `--rounds N`
repeats it N times after the first DPO stage. Data of prompts alone (a `prompt` column, an optional `meta` the judge
reads, no answers) needs no offline pairs: the rounds replace the DPO stage and round 1 starts from the given model.

    ./run_distributed.sh --config configs/iterative.yaml     # the embedded default's SFT model through rounds
    ./run_distributed.sh --config configs/iterative_prompts.yaml   # the same from the tasks' prompts alone

This module owns one round's data: which prompts it asks (`round_prompts`), sampling them (seeded per answer, so the
answers do not depend on how prompts are split across processes or batched: src/generation.py), judging (the judges
of src/judges.py, every process its share), pairing (best vs worst; a prompt whose answers all score the same is
skipped and counted) and the round's dataset directory `<round dir>/pairs/` (train.jsonl: the pairs with their scores;
validation.jsonl and test.jsonl: the run's held-out pairs, so every round is judged on the same prompts; a run from
prompts judges its held-out prompts, which have no pairs to write), written before training on it and reused when a
stopped run resumes. Training each round is the DPO stage's own code
(src/main_distributed.py run_stage, src/pipeline/).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import shutil
import time
from pathlib import Path

from src import run_files
from src.chat_templates import split_reasoning
from src.config_error import ConfigError
from src.data import PROMPTS, PreparedData, prepare_data, sample_fields
from src.distributed import barrier, map_across_ranks, print0
from src.engines import generating
from src.generation import Sampling, answer_seed, generate
from src.judges import JudgeError, judge_for
from src.models import apply_chat_template_to_model, load_model
from src.objectives import ROUNDS_STAGE
from src.progress import Progress
from src.run_safety.build_once import cache_root
from src.run_safety.parent_watch import kill_starter_if_injected
from src.tools import session_for
from src.world import World

PAIRS_DIR = "pairs"
ROUND_FILE = "round.json"  # beside pairs/, written after it: a round whose record exists has its pairs complete
HELD_OUT_COLUMNS = ("prompt", "chosen", "rejected", "meta", "tools")
# What a pair records besides the pair itself; the held-out rows carry the same columns, empty, since one dataset's
# splits share their columns.
SCORE_COLUMNS = ("chosen_score", "rejected_score", "mean_score", "source_row")


@dataclasses.dataclass(frozen=True)
class RoundSettings:
    """How a round asks, samples and pairs (from the DPO arguments round_*)."""

    samples: int  # answers per prompt (K)
    prompts: int  # train prompts asked per round (0: all)
    sampling: Sampling
    max_new_tokens: int
    batch_size: int  # sequences generated at once per process
    seed: int
    template_kwargs: dict | None = None  # --chat_template_kwargs: the prompts rendered as the training data's


def train_prompts(train, tokenizer, count: int, seed: int, round_index: int,
                  template_kwargs: dict | None = None) -> list[dict]:
    """The prompts a round asks: all train rows, or `count` of them drawn with the round's seed (another sample each
    round). Each: its row index, the prompt as the data has it, its meta and the prompt's token ids as generation
    sees them (chat template with the generation prompt, as the held-out answers use); a repeated prompt once."""
    indices = list(range(len(train)))
    if 0 < count < len(indices):
        indices = sorted(random.Random(answer_seed(seed, round_index, "prompts")).sample(indices, count))
    rows, seen = [], set()
    for index in indices:
        row = train[index]
        fields = sample_fields({key: row[key] for key in ("prompt", "chosen", "rejected", "tools", "meta")
                                if key in row}, tokenizer, template_kwargs)
        ids = tuple(fields["sample_prompt_ids"])
        if ids and ids not in seen:  # a prompt the data repeats is asked once: the same answers, the same pair
            seen.add(ids)
            rows.append({"index": index, "prompt": row["prompt"], "meta": row.get("meta") or {},
                         "prompt_ids": list(ids)})
    return rows


def sample_and_judge(model, tokenizer, rows: list[dict], judge, settings: RoundSettings, round_index: int,
                     world: World, tools=None) -> list[dict]:
    """K sampled answers to every row and the judge's score of each, every rank its share; identical on every rank,
    in row order. A progress line (rank 0, its share) with the ETA. `tools` (a src/tools.py ToolSession): each answer
    is a trajectory with the calls run (src/generation.py), judged whole, its ids and loss mask kept
    (`trajectories`)."""
    k = settings.samples
    share = -(-len(rows) // world.world_size)  # rank 0's share: the line counts its answers, the ETA holds for all
    progress = Progress(f"  round {round_index}: sampling {k} answers per prompt", total=share * k, unit="answers",
                        enabled=world.is_main)

    def work(share: list[dict]) -> list[dict]:
        prompts = [row["prompt_ids"] for row in share for _ in range(k)]
        seeds = [answer_seed(settings.seed, round_index, row["index"], sample) for row in share for sample in range(k)]

        def on_batch(answered: int) -> None:
            progress.update(answered)
            kill_starter_if_injected("sampling", world.rank)  # a test seam

        sampled = generate(model, tokenizer, prompts, settings.max_new_tokens, settings.batch_size,
                           settings.sampling, seeds, on_batch=on_batch, tools=tools, trajectories=tools is not None)
        answers = [answer["text"] for answer in sampled] if tools is not None else sampled
        judged_rows = [{"prompt": row["prompt"], "meta": row["meta"]} for row in share for _ in range(k)]
        try:
            scores = judge.scores(judged_rows, answers)
        except JudgeError as error:  # said by every rank, rank 0 among them, whichever rank's share it was in
            return [{"error": str(error)}] * len(share)
        trajectories = [{"ids": answer["ids"], "loss_mask": answer["loss_mask"]} for answer in sampled] \
            if tools is not None else None
        return [{"answers": answers[i * k:(i + 1) * k], "scores": scores[i * k:(i + 1) * k],
                 **({"trajectories": trajectories[i * k:(i + 1) * k]} if trajectories else {})}
                for i in range(len(share))]

    judged = map_across_ranks(rows, work, world)
    progress.close()
    failed = next((result["error"] for result in judged if "error" in result), None)
    if failed:
        raise JudgeError(f"round {round_index}: {failed}")
    return judged


def form_pairs(rows: list[dict], judged: list[dict]) -> tuple[list[dict], dict]:
    """Each prompt's best-scored answer (chosen) against its worst (rejected), the first of each in sampling order,
    among its answers whose reasoning (if any) closed; a prompt whose answers all score the same teaches nothing and is
    skipped. Returns the pairs and the counts."""
    pairs, skipped, unclosed = [], 0, 0
    for row, result in zip(rows, judged):
        # An answer cut inside its reasoning (no closing tag: no final answer) is judged but never paired: its text is
        # not an answer the model finished, and preparation refuses a reasoning block that never closes.
        whole = [index for index, answer in enumerate(result["answers"])
                 if split_reasoning({"content": answer}).closed]
        unclosed += len(result["answers"]) - len(whole)
        scores = [result["scores"][index] for index in whole]
        if not scores or max(scores) == min(scores):
            skipped += 1
            continue
        best, worst = max(scores), min(scores)
        chosen, rejected = whole[scores.index(best)], whole[scores.index(worst)]
        pairs.append({"prompt": row["prompt"],
                      "chosen": _as_answer(row["prompt"], result["answers"][chosen]),
                      "rejected": _as_answer(row["prompt"], result["answers"][rejected]),
                      **({"meta": row["meta"]} if row["meta"] else {}), "chosen_score": best, "rejected_score": worst,
                      "mean_score": sum(scores) / len(scores), "source_row": row["index"],
                      **({"trajectory": pair_trajectory(row["prompt_ids"], result["trajectories"][chosen],
                                                        result["trajectories"][rejected])}
                         if "trajectories" in result else {})})
    all_scores = [score for result in judged for score in result["scores"]]
    counts = {"prompts": len(rows), "answers": len(all_scores), "pairs": len(pairs), "skipped_all_equal": skipped,
              "unclosed_answers": unclosed,
              "mean_score": sum(all_scores) / len(all_scores) if all_scores else None,
              "best_of_k_score": (sum(max(result["scores"]) for result in judged) / len(judged)) if judged else None}
    return pairs, counts


def pair_trajectory(prompt_ids: list[int], chosen: dict, rejected: dict) -> dict:
    """A pair of tool trajectories as DPO trains them (src/data/tokenization.py reads it in place of the texts): the
    prompt's ids and each answer's ids as sampled, with its loss mask (0 on the tool results: src/packed_dpo.py
    multiplies it into TRL's completion mask)."""
    return {"prompt_ids": prompt_ids, "chosen_ids": chosen["ids"], "chosen_loss_mask": chosen["loss_mask"],
            "rejected_ids": rejected["ids"], "rejected_loss_mask": rejected["loss_mask"]}


def _as_answer(prompt, text: str):
    """An answer in the prompt's form: an assistant message for a chat, plain text otherwise."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def pairs_ready(round_dir: Path) -> dict | None:
    """The round's record when its pairs directory is complete (written by an earlier launch), else None."""
    path = Path(round_dir) / ROUND_FILE
    return run_files.read_json(path) if path.exists() else None


def write_pairs(round_dir: Path, pairs: list[dict], held_out: dict, record: dict) -> Path:
    """`<round dir>/pairs/` as a dataset directory a user can open (train / validation / test JSONL), written in a
    temporary directory and renamed into place, then round.json beside it: a killed write leaves no half dataset."""
    target = Path(round_dir) / PAIRS_DIR
    temporary = target.with_name(f".{PAIRS_DIR}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    for split, rows in {"train": pairs, **held_out}.items():
        with open(temporary / f"{split}.jsonl", "w", encoding="utf-8") as file:
            for row in rows:
                file.write(json.dumps(row, ensure_ascii=False) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    temporary.rename(target)
    run_files.write_json(Path(round_dir) / ROUND_FILE, record)
    return target


def held_out_pairs(prepared) -> dict[str, list[dict]]:
    """The DPO stage's validation and test pairs as the data holds them (normalized), for every round's directory."""
    held_out = {}
    for split in ("validation", "test"):
        dataset = prepared.splits[split] if split in prepared.splits else None
        if dataset is not None:
            columns = [column for column in HELD_OUT_COLUMNS if column in dataset.column_names]
            held_out[split] = [row | dict.fromkeys(SCORE_COLUMNS) for row in dataset.select_columns(columns).to_list()]
    return held_out


def make_round_pairs(model, tokenizer, prepared, judge, settings: RoundSettings, round_index: int, round_dir: Path,
                     world: World, tools=None) -> dict:
    # The held-out pairs (validation, test) go beside the round's pairs; a run from prompts has none to write.
    """One round's pairs, sampled, judged, paired and written (rank 0) before training. Returns the round's record
    (counts, seconds per phase, where the pairs are)."""
    started = time.monotonic()
    rows = train_prompts(prepared.train, tokenizer, settings.prompts, settings.seed, round_index,
                         settings.template_kwargs)
    judged = sample_and_judge(model, tokenizer, rows, judge, settings, round_index, world, tools)
    sampled = time.monotonic()
    pairs, counts = form_pairs(rows, judged)
    if not pairs:
        raise ConfigError(no_pairs_line(round_index, settings, rows, judged))
    record = {"round": round_index, "counts": counts, "seconds": {"sample_and_judge": round(sampled - started, 1)},
              "settings": {"samples": settings.samples, "prompts": settings.prompts,
                           "temperature": settings.sampling.temperature, "top_p": settings.sampling.top_p,
                           "max_new_tokens": settings.max_new_tokens, "seed": settings.seed},
              "pairs_dir": str(Path(round_dir) / PAIRS_DIR)}
    if world.is_main:
        held_out = {} if prepared.summary.get("stage") == PROMPTS else held_out_pairs(prepared)
        if tools is not None:  # the data's own pairs beside the trajectories: one dataset's splits share columns
            held_out = {split: [row | {"trajectory": None} for row in split_rows]
                        for split, split_rows in held_out.items()}
        write_pairs(round_dir, pairs, held_out, record)
        best = counts["best_of_k_score"]
        print0(f"  round {round_index}: {counts['pairs']:,} pairs from {counts['prompts']:,} prompts "
              f"({counts['skipped_all_equal']:,} skipped: all answers scored the same"
              + (f"; {counts['unclosed_answers']:,} answers cut inside their reasoning left out"
                 if counts["unclosed_answers"] else "") + "); mean score "
              f"{counts['mean_score']:.3f}, best of {settings.samples} {best:.3f}; "
              f"{record['pairs_dir']}")
    barrier()
    return record


def no_pairs_line(round_index: int, settings: RoundSettings, rows: list[dict], judged: list[dict]) -> str:
    """The one line of a round where every prompt's answers tie: the round, what the judge returned (its scores and
    how often), and what to change."""
    scores: dict[float, int] = {}
    for result in judged:
        for score in result["scores"]:
            scores[score] = scores.get(score, 0) + 1
    common = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
    returned = ", ".join(f"{score:g} x {count:,}" for score, count in common[:5]) + (
        f", and {len(common) - 5} other values" if len(common) > 5 else "")
    return (f"round {round_index}: no pairs: the judge gave all {settings.samples} answers to each of the "
            f"{len(rows):,} prompts the same score (it returned {returned}); raise --round_samples (now "
            f"{settings.samples}) or --round_temperature (now {settings.sampling.temperature:g}), or use a judge with "
            "more levels (partial credit, a reward model) that tells the answers apart")


def round_settings(config, plan) -> RoundSettings:
    """A round's sampling settings from the DPO arguments (round_*) and the plan."""
    dpo = config.dpo
    return RoundSettings(samples=dpo.round_samples, prompts=dpo.round_prompts,
                         sampling=Sampling(dpo.round_temperature, dpo.round_top_p),
                         max_new_tokens=config.training.max_new_tokens,
                         batch_size=max(8, plan.per_device_batch_size * 8), seed=config.training.seed,
                         template_kwargs=config.data.chat_template_kwargs)


def round_stage_config(config, round_index: int):
    """The DPO stage's config for one round: --round_max_steps steps, or one pass over the round's pairs."""
    staged = copy.deepcopy(config)
    staged.training.max_steps = config.dpo.round_max_steps
    if staged.training.max_steps == -1:
        staged.training.num_epochs = 1.0
    return staged


def round_data(config, pairs_dir: Path, tokenizer):
    """The round's pairs prepared like any DPO data (tokenized once per machine under a file lock, cached)."""
    held_out = (Path(pairs_dir) / "validation.jsonl").exists()  # a run from prompts writes its pairs alone: none carved
    data = dataclasses.replace(
        config.data, dataset_name=str(pairs_dir), dataset_config=None, dataset_split="train", dataset_mixture=None,
        prompt_column=None, chosen_column=None, rejected_column=None, system_prompt=None, max_train_samples=None,
        **({} if held_out else {"val_size": 0, "test_size": 0}))
    return prepare_data(data, config.sft, ROUNDS_STAGE, config.training.seed, tokenizer, cache_root() / "datasets")


def start_round(stage, model_path: str, tokenizer, dpo_data, world: World, adapters=None,
                whole_because: str | None = None):
    """Before a round trains: its starting model (the previous round's) loaded on this rank (`adapters`,
    `whole_because`: as src/models.py `load_model` takes them), its pairs made (or reused) and prepared. Returns
    (model, prepared pairs, the round's record)."""
    config = stage.config
    model = load_model(model_path, config.model, stage.plan, world, adapters=adapters, whole_because=whole_because)
    model = apply_chat_template_to_model(model, tokenizer, config.model.chat_template_path,
                                         stage.plan.precision)
    print0(f"\n== DPO ROUND {stage.round} of {config.dpo.rounds}: pairs from the answers of {model_path}")
    record = pairs_ready(stage.run_dir)
    if record:  # an earlier launch wrote them: no sampling, no judge
        print0(f"  round {stage.round}: pairs written by an earlier launch, reused ({record['counts']['pairs']:,} pairs)")
    else:
        tools = session_for(config)  # --tools: the round's answers are trajectories with the calls run
        try:  # under ZeRO-3 and FSDP2 each rank holds its share: each module's weights gathered for its forward only
            with generating(model, stage.plan.precision):
                record = make_round_pairs(model, tokenizer, dpo_data,
                                          judge_for(config.training.judge, config.data.dataset_name),
                                          round_settings(config, stage.plan), stage.round, stage.run_dir, world, tools)
        finally:
            if tools is not None:
                tools.close()
    started = time.monotonic()
    prepared = round_data(config, Path(record["pairs_dir"]), tokenizer)
    if dpo_data.summary.get("stage") == PROMPTS:
        prepared = with_held_out_prompts(prepared, dpo_data)
    record["seconds"]["prepare"] = round(time.monotonic() - started, 1)
    return model, prepared, record


def with_held_out_prompts(pairs: PreparedData, prompts: PreparedData) -> PreparedData:
    """A round of a run from prompts: its pairs to train on, and the run's held-out prompts (validation, test) to
    judge before and after, as the data audit and the summary name them. The held-out prompts have no answers, so the
    round is not evaluated on pairs (no eval loss): the judge's before/after is its measure."""
    import datasets

    held_out = [split for split in ("validation", "test") if split in prompts.splits]
    splits = datasets.DatasetDict({"train": pairs.train, **{split: prompts.splits[split] for split in held_out}})
    summary = dict(pairs.summary)
    summary["splits"] = {"train": pairs.summary["splits"]["train"],
                         **{split: prompts.summary["splits"][split] for split in held_out}}
    audit = pairs.summary.get("audit") or {}
    summary["audit"] = {**({"train": audit["train"]} if "train" in audit else {}),
                        **{split: (prompts.summary.get("audit") or {}).get(split) for split in held_out
                           if (prompts.summary.get("audit") or {}).get(split)}}
    summary["held_out"] = f"prompts of {prompts.summary['source']}"
    return PreparedData(path=pairs.path, splits=splits, summary=summary)


def rounds_summary(run_dir: Path, rounds: int, last: dict | None = None, from_prompts: bool = False) -> list[dict]:
    """Every round of a run from its files, the DPO stage as round 0 (none in a run from prompts alone: round 1 is the
    first): pairs formed and skipped, the judged held-out results after it, and seconds per phase. For
    training_info.json's "rounds" and the report's table and plot. `last`: the last round's fields that are written
    with the summary (its judged results, status, summary)."""
    run_dir = Path(run_dir)
    entries = []
    for index in range(1 if from_prompts else 0, rounds + 1):
        directory = run_dir / (ROUNDS_STAGE if index == 0 else "." if index == rounds else f"round{index}")
        info_path = directory / run_files.TRAINING_INFO
        info = run_files.read_json(info_path) if info_path.exists() else {}
        if index == rounds and last:
            info = {**info, **last}
        record = (info.get("round") or {}) if index else {}
        counts = record.get("counts") or {}
        summary = info.get("summary") or {}
        entry = {"round": index, "run_dir": ROUNDS_STAGE if index == 0 else "." if index == rounds else f"round{index}",
                 "status": info.get("status"),
                 "pairs": counts.get("pairs", (((info.get("data") or {}).get("splits") or {}).get("train") or {})
                                     .get("kept")),
                 "skipped_all_equal": counts.get("skipped_all_equal"), "prompts": counts.get("prompts"),
                 "mean_score": counts.get("mean_score"), "best_of_k_score": counts.get("best_of_k_score"),
                 "seconds": {**(record.get("seconds") or {}), "train_and_judge": summary.get("wall_time_s")},
                 "judged": {split: {"metric": result["metric"], "n": result["n"], "before": result["before"],
                                    "after": result["after"],
                                    "details": {name: value["after"] for name, value in result.get("details", {}).items()
                                                if isinstance(value, dict) and "after" in value},
                                    "details_before": {name: value["before"] for name, value
                                                       in result.get("details", {}).items()
                                                       if isinstance(value, dict) and "before" in value}}
                            for split, result in (info.get("judges") or {}).items()}}
        entries.append(entry)
    return entries
