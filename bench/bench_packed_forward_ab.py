"""The packed DPO forward of this checkout against another version's, forward + backward only, arms interleaved:

    git worktree add --detach /tmp/before 6eb9cac
    python bench/bench_packed_forward_ab.py --before /tmp/before/src/packed_dpo.py

What a change to src/packed_dpo.py costs (or saves) per micro-batch, without the noise of whole runs: the same Llama
(--hidden 256 --layers 4 by default, sdpa, fp32 on CPU), the same 6 micro-batches of 8 log-normal pairs (prompt median 31 tokens,
answers 26, capped at 150), each version on its own copy of the model (each installs its own fused-forward wrapper).
Prints the median seconds per 6 micro-batches of each and their ratio.

    python bench/bench_packed_forward_ab.py --objectives dpo simpo orpo kto

Per objective, the toolkit's packed forward against TRL's padded one, through the objectives' own trainers (their rows
in src/objectives/, built as build_trainer builds them, `forward_for` packed or not), on the same model and
micro-batches, arms interleaved: a training step (compute_loss + backward) for DPO (policy and reference forward inside
the step, the reference not cached), SimPO and ORPO (TRL's padded arm: their own concatenated_forward, full logits); for
KTO two things, each its own trainer: its reference pass (compute_ref_log_probs over completions and KL completions,
packed prefix-shared) and its training step as a run takes it (the reference log-probs cached, the default): the KL pass
over the step's micro-batch without gradients (kl_estimate), then compute_loss + backward, both passes packed
padding-free or both TRL's padded. Each arm runs once untimed first (its first-batch check). Prints a markdown table:
median seconds per 6 micro-batches of each arm, packed / padded, and the tokens each computed (all passes of the step)."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load_version(path: str):
    spec = importlib.util.spec_from_file_location("packed_dpo_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    if module.PackedDPOForward.__module__ != spec.name:  # its forward would be this checkout's: a ratio of 1, silently
        raise SystemExit(f"error: --before {path}: that version's packed forward is spread over src/packed_layout.py, "
                         "packed_forward.py and packed_attention.py, which would load from this checkout; give a "
                         "version whose src/packed_dpo.py holds the whole forward (before its split, 2026-11-27)")
    return module


VOCAB = 2000


def base_model(hidden: int, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                        attn_implementation="sdpa", pad_token_id=0, eos_token_id=1, bos_token_id=None))


def micro_batches() -> list[list[dict]]:
    """6 micro-batches of 8 log-normal pairs (token ids: prompt median 31, answers 26, capped at 150)."""
    rng = random.Random(0)
    length = lambda median: min(150, max(1, int(rng.lognormvariate(math.log(median), 0.9) * 1.3)))  # noqa: E731
    ids = lambda count: [rng.randrange(3, VOCAB) for _ in range(count)]  # noqa: E731
    return [[{"prompt_ids": ids(length(24)), "chosen_ids": ids(length(20)), "rejected_ids": ids(length(20))}
             for _ in range(8)] for _ in range(6)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="another version's src/packed_dpo.py, from when it held the whole forward")
    parser.add_argument("--objectives", nargs="+", help="per objective: packed vs TRL's padded (dpo simpo orpo kto)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.objectives:
        return objectives_ab(args)
    if not args.before:
        parser.error("--before or --objectives")
    versions_ab(args)


def versions_ab(args) -> None:
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.utils import add_fused_lm_head

    import src.packed_dpo as after

    versions = {"before": load_version(args.before), "after": after}
    base = base_model(args.hidden, args.layers)
    models = {}
    for name in versions:
        models[name] = copy.deepcopy(base)
        add_fused_lm_head(models[name], outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    batches = micro_batches()

    def step(module, model, rows):
        collator = module.PackedPreferenceCollator(DataCollatorForPreference(pad_token_id=0, max_length=400),
                                                   "prefix_shared", 1 / (3 * args.hidden))
        batch = collator(rows)
        forward = module.PackedDPOForward(None, "prefix_shared")
        forward.checked = True
        with forward.running(batch, ("policy",), [model]) as inputs:
            labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                            use_cache=False, fused_lm_head=True)
        outputs.log_probs.sum().backward()

    seconds = {name: [] for name in versions}
    for _ in range(args.repeats):
        for name, module in versions.items():
            started = time.perf_counter()
            for rows in batches:
                step(module, models[name], rows)
            seconds[name].append(time.perf_counter() - started)
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.3f} s per 6 micro-batches  {[round(v, 3) for v in values]}")
    print(f"after / before: {statistics.median(seconds['after']) / statistics.median(seconds['before']):.3f}")


def tokenizer_for_ids():
    """A tokenizer whose ids are the benchmark's token ids (t0 = padding, t1 = end): the trainers ask it for these."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
                                   pad_token="t0", eos_token="t1", unk_token="t2")


def unpaired(pairs: list[dict]) -> list[dict]:
    """KTO's rows from pairs: chosen thumbs up, rejected down; each row's KL completion the next row's (a derangement,
    as src/data/ fixes one per split)."""
    rows = [{"prompt_ids": pair["prompt_ids"], "completion_ids": pair[side], "label": side == "chosen_ids"}
            for pair in pairs for side in ("chosen_ids", "rejected_ids")]
    return [dict(row, KL_completion_ids=rows[(index + 1) % len(rows)]["completion_ids"])
            for index, row in enumerate(rows)]


KTO_TIMED = ("reference pass", "training step")


def timed_things(name: str) -> tuple[str, ...]:
    from src.objectives import objective

    return KTO_TIMED if objective(name).data_shape == "unpaired" else ("training step",)


def objective_arm(name: str, what: str, packed: bool, base, tokenizer, batches, work: Path):
    """(step function over one micro-batch, the trainer's packed forward) for an objective's trainer, packed or not:
    its training step, or (`what`, KTO) its reference pass."""
    import torch
    from datasets import Dataset

    from src.objectives import load, objective

    row = objective(name)
    trainer_class, config_class = load(row.training.trainer), load(row.training.trl_config)
    options = dict(output_dir=str(work / f"{name}-{what}-{packed}".replace(" ", "_")), per_device_train_batch_size=8,
                   use_cpu=True, report_to=[], bf16=False, max_length=400, disable_tqdm=True)
    if row.training.needs_reference:  # KTO's step: the reference cached, as a run takes it
        options["precompute_ref_log_probs"] = row.data_shape == "unpaired" and what == "training step"
    args = config_class(**options)
    model = copy.deepcopy(base)
    rows = [row_ for batch in batches for row_ in batch]
    data = Dataset.from_list(unpaired(rows) if row.data_shape == "unpaired" else rows)
    extra = {"ref_model": copy.deepcopy(base)} if row.training.needs_reference else {}
    trainer = trainer_class(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                            **trainer_class.forward_for(model, tokenizer, args, None, packed), **extra)
    micro = [[trainer.train_dataset[i] for i in range(start, start + (16 if row.data_shape == "unpaired" else 8))]
             for start in range(0, len(data), 16 if row.data_shape == "unpaired" else 8)]

    if what == "reference pass":  # KTO
        collator = trainer.reference_collator()

        def step(index: int):
            with torch.no_grad():
                trainer.compute_ref_log_probs(trainer.ref_model, trainer._prepare_inputs(collator(micro[index])))
    elif row.data_shape == "unpaired":  # KTO's step: its KL over the step's batch first, then the loss
        def step(index: int):
            trainer.model.train()
            batch = trainer._prepare_inputs(trainer.data_collator(micro[index]))
            trainer._step_kl = trainer.kl_estimate(trainer.model, [batch])
            trainer.compute_loss(trainer.model, batch).backward()
            trainer.model.zero_grad()
    else:
        def step(index: int):
            trainer.model.train()
            loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(trainer.data_collator(micro[index])))
            loss.backward()
            trainer.model.zero_grad()
    return step, trainer.packed_forward, len(micro)


def objectives_ab(args) -> None:
    import tempfile

    base = base_model(args.hidden, args.layers)
    tokenizer = tokenizer_for_ids()
    batches = micro_batches()
    arms, seconds, forwards = {}, {}, {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.objectives:
            for what in timed_things(name):
                for packed in (False, True):
                    step, forward, count = objective_arm(name, what, packed, base, tokenizer, batches, Path(work))
                    forward.counts = {kind: type(counts)() for kind, counts in forward.counts.items()}  # not init's
                    forward.padded_equivalent = {kind: type(counts)() for kind, counts in forward.counts.items()}
                    for index in range(count):  # untimed: the first-batch check, allocator warm-up
                        step(index)
                    key = name, what, packed
                    arms[key], seconds[key], forwards[key] = (step, count), [], forward
        for _ in range(args.repeats):
            for key, (step, count) in arms.items():
                started = time.perf_counter()
                for index in range(count):
                    step(index)
                seconds[key].append(time.perf_counter() - started)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, fp32 on CPU; 6 micro-batches of 8 pairs (KTO: 16 rows);"
          f" median of {args.repeats} interleaved repeats\n")
    print("| objective | what is timed | padded (TRL) s | packed s | packed / padded | tokens computed per 6 "
          "micro-batches, padded → packed |\n|---|---|---|---|---|---|")
    for name in args.objectives:
        for what in timed_things(name):
            padded, packed = (statistics.median(seconds[name, what, flag]) for flag in (False, True))
            summary = forwards[name, what, True].summary()
            runs = args.repeats + 1  # each arm ran its 6 micro-batches once untimed, then once per repeat
            per_run = lambda counts: round(sum(one["computed_tokens"] for one in counts.values()) / runs)  # noqa: E731
            print(f"| {name} | {what} | {padded:.3f} | {packed:.3f} | {packed / padded:.2f} | "
                  f"{per_run(summary['padded_forward_would_compute']):,} → {per_run(summary['tokens']):,} "
                  f"({', '.join(summary['tokens'])}) |")


if __name__ == "__main__":
    main()
