"""What one rank of a job actually holds in tensors under each engine, for tests/test_memory_plan_engines.py to set
against check_gpu's memory plan (src/diagnostics/memory_plan.py).

Each forked process of a job (tests/forked.py `run_job(N, [MODEL_DIR, OUT_DIR, STRATEGY...], entry=memory_probe.entry)`)
builds, for each strategy in turn, the model of MODEL_DIR/config.json in fp32 (as the toolkit loads it for full
fine-tuning), spreads it with the engine (ddp: torch's DistributedDataParallel; zero1/zero2/zero3:
`deepspeed.initialize` with a torch AdamW, as accelerate hands it the trainer's optimizer, and the buffer sizes
accelerate fills for "auto"; fsdp: torch's `fully_shard` per decoder layer, then the model), takes one optimizer step
(AdamW's states exist from then on) and one more, measured after its backward and as its optimizer steps (each
part at the larger), and writes OUT_DIR/rank<r>.json: per strategy (zero1_bf16 ...: DeepSpeed's bf16), the bytes of every
tensor storage the engine created on this rank, each counted once (the tensors Python
reaches, through the garbage collector, less those that existed before the model was built, plus DDP's all-reduce
buckets, which only its C++ reducer holds), split into the weights (the rank's own parameters or shard), the optimizer's
(its states and the fp32 partition DeepSpeed steps) and the rest: the gradients and the engine's gradient buffers.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

AUTO_BUFFERS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def _storages() -> dict[int, int]:
    """Every live tensor storage reachable from Python: its address and bytes (a DTensor's local shard counts, the
    DTensor wrapper holds none)."""
    found = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta or type(obj).__name__ == "DTensor":
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a parameter (or gradient) this rank holds: ZeRO-3's partition, FSDP's shard, else itself."""
    tensor = getattr(tensor, "ds_tensor", tensor)
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _bytes_of(tensors, storages: dict[int, int], counted: set[int]) -> int:
    total = 0
    for tensor in tensors:
        address = _local(tensor).untyped_storage().data_ptr()
        if address in storages and address not in counted:
            counted.add(address)
            total += storages[address]
    return total


def _engine(strategy: str, model, hidden: int):
    """The model under the engine, and the torch optimizer that holds the states."""
    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optimizer, optimizer
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optimizer, optimizer
    import deepspeed

    sizes = dict(zip(AUTO_BUFFERS, (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)))
    stage, _, precision = strategy.partition("_")  # zero2, or zero2_bf16: DeepSpeed's bf16 (accelerate's bf16 config)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": precision == "bf16"},
              "zero_optimization": {"stage": int(stage[-1]), **sizes}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                                   config=config)
    inner = optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return engine, optimizer, inner


def _step(strategy: str, model, optimizer, batch, then_step: bool) -> None:
    loss = model(input_ids=batch, labels=batch).loss
    if strategy.startswith("zero"):
        model.backward(loss)
        if then_step:
            model.step()
        return
    loss.backward()
    if then_step:
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # as the Trainer keeps them: allocated again by the next backward


def probe(strategy: str, model_dir: Path, rank: int) -> dict:
    """This rank's weights, gradients and optimizer bytes under `strategy` (module doc), each the larger of two
    moments: after the backward (every gradient reduced), and as the torch optimizer steps (DeepSpeed has then
    replaced its 16-bit gradient partition by an fp32 copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    gc.collect()  # the previous strategy's engine gone
    torch.manual_seed(0)
    before = _storages()
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model, optimizer, inner = _engine(strategy, model, config.hidden_size)
    batch = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))
    _step(strategy, model, optimizer, batch, then_step=True)  # AdamW's states exist from here on
    _step(strategy, model, optimizer, batch, then_step=False)
    after_backward = _parts(model, optimizer, inner, strategy, before)
    at_step = []
    hook = inner.register_step_pre_hook(lambda *_: at_step.append(_parts(model, optimizer, inner, strategy, before)))
    model.step() if strategy.startswith("zero") else optimizer.step()
    hook.remove()
    torch.distributed.barrier()  # every rank measured before the next strategy's collectives
    return {part: max(after_backward[part], at_step[0][part]) for part in after_backward}


def _parts(model, optimizer, inner, strategy: str, before: dict[int, int]) -> dict:
    """This rank's weights, optimizer and gradient bytes now: the storages created since `before`."""
    gc.collect()
    held = {address: size for address, size in _storages().items() if address not in before}
    counted: set[int] = set()
    parameters = list(model.parameters())
    weights = _bytes_of((_local(p) for p in parameters), held, counted)
    states = [value for state in inner.state.values() for value in state.values() if torch.is_tensor(value)]
    # The fp32 partition DeepSpeed steps (ZeRO-1/2: single_partition_of_fp32_groups; ZeRO-3: fp32_partitioned_groups_flat)
    stepped = [p for group in inner.param_groups for p in group["params"]] + [
        *getattr(optimizer, "single_partition_of_fp32_groups", []), *getattr(optimizer, "fp32_partitioned_groups_flat", [])]
    optimizer_bytes = _bytes_of(states + stepped, held, counted)
    # DDP's gradient buckets live in its C++ reducer (gradient_as_bucket_view=False: a copy of every gradient)
    buckets = (sum(int(size) for size in model._get_ddp_logging_data()["bucket_sizes"].split(","))
               if strategy == "ddp" else 0)
    return {"weights": weights, "optimizer": optimizer_bytes,
            "gradients": sum(held.values()) - weights - optimizer_bytes + buckets}


def entry(argv: list[str]) -> int:
    """A forked rank's entry point (tests/forked.py): `MODEL_DIR OUT_DIR STRATEGY...`, one job group for them all."""
    model_dir, out_dir, *strategies = argv
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # torch's process group, which DDP and FSDP use too
    rank = torch.distributed.get_rank()
    record = {strategy: probe(strategy, Path(model_dir), rank) for strategy in strategies}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(entry(sys.argv[1:]))
