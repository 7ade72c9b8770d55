"""One optimizer step of a trl.experimental pair trainer (SimPO's CPOTrainer, ORPOTrainer) on a global batch split as
P processes x A accumulation steps, each micro-batch collated and run on its own as a rank runs it: DDP averages the
P ranks' gradients, accumulation adds the A micro-steps' (each loss divided by A), after the step's token counts over
every micro-batch (`begin_step`, what transformers' loop hands it, summed over the ranks). The pairs' answers and
prompts differ in length, so micro-batches of another size hold other token counts (1 x 1 is 8 pairs per micro-batch,
the others 2). Used by tests/test_simpo.py and tests/test_orpo.py, with the trainer both build
(`trainer_on_prepared_pairs`)."""

from __future__ import annotations

import torch

GLOBAL_BATCH = 8
SPLITS = [(1, 1), (1, 4), (2, 2), (4, 1)]  # (processes, accumulation steps)
TOLERANCE = 1e-5


def one_step(trainer, rows: list[dict], processes: int, accumulation: int) -> dict:
    """Loss, logged metrics (the window's mean, as TRL logs them) and gradient of one step on `rows`."""
    model = trainer.model
    model.train()
    model.zero_grad()
    micro = len(rows) // (processes * accumulation)
    trainer._stored_metrics["train"].clear()
    losses = []
    batches = [trainer.data_collator(rows[index * micro:(index + 1) * micro]) for index in range(processes * accumulation)]
    trainer.begin_step(batches)
    for batch in batches:
        loss = trainer.compute_loss(model, batch)
        (loss / (processes * accumulation)).backward()  # DDP's mean over ranks, accumulation's 1/A
        losses.append(float(loss.detach()))
    trainer.metric_window.flush(trainer)  # the micro-batches' metrics, kept on the device until a log
    stored = trainer._stored_metrics["train"]
    result = {key: sum(float(value) for value in values) / len(values) for key, values in stored.items()}
    result["loss"] = sum(losses) / len(losses)
    result["grad"] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    model.zero_grad()
    return result


def assert_the_same_on_every_split(trainer, rows: list[dict], keys: tuple[str, ...]) -> None:
    results = [one_step(trainer, rows, processes, accumulation) for processes, accumulation in SPLITS]
    for key in keys:
        first = results[0][key]
        for result in results[1:]:
            difference = float((result[key] - first).abs().max()) if torch.is_tensor(first) else abs(result[key] - first)
            assert difference < TOLERANCE, (key, difference)
    assert float(results[0]["grad"].abs().max()) > 0


def trainer_on_prepared_pairs(stage: str, model_path, tokenizer, work, packed: bool = False, **config) -> tuple:
    """The objective's own trainer (its row in src/objectives/) on 24 pairs prepared by src/data/ for `stage`, its
    TRL config on CPU with `config`, with the packed forward as build_trainer gives it when `packed` (else TRL's padded
    one): (trainer, the first GLOBAL_BATCH training rows, the prepared data)."""
    from transformers import AutoModelForCausalLM

    from conftest import preference_rows, write_jsonl
    from src.config import DataArguments, SFTArguments
    from src.data import prepare_data
    from src.objectives import load, objective

    rows = preference_rows(24, seed=5)
    for index, row in enumerate(rows):  # other lengths: micro-batches of another size hold other token counts
        for side in ("chosen", "rejected"):
            row[side][0]["content"] += " very" * (1 + index % 3)
        row["prompt"][0]["content"] += " please" * (index % 4)
    pairs = write_jsonl(work / "pairs.jsonl", rows)
    prepared = prepare_data(DataArguments(dataset_name=str(pairs), max_length=64, val_size=2, test_size=2),
                            SFTArguments(), stage, 7, tokenizer, work / "cache")
    row = objective(stage)
    args = load(row.training.trl_config)(output_dir=str(work / "out"), per_device_train_batch_size=2, use_cpu=True, report_to=[],
                                bf16=False, max_length=64, disable_tqdm=True, **config)
    model, trainer_class = AutoModelForCausalLM.from_pretrained(model_path), load(row.training.trainer)
    forward = trainer_class.forward_for(model, tokenizer, args, None) if packed else {}
    trainer = trainer_class(model=model, args=args, train_dataset=prepared.train, processing_class=tokenizer,
                            **forward)
    return trainer, [trainer.train_dataset[index] for index in range(GLOBAL_BATCH)], prepared
