"""Throughput accounting for every run: tokens/s and samples/s (all ranks, and per process), step time, padding
fraction, peak memory, and on GPUs an MFU estimate. Logged as `perf/*` into metrics.jsonl at every logging step
(the report plots them) and summarised in training_info.json.

Time spent evaluating, checkpointing or refreshing the live report is not training: the trainer reports each such
pause (`on_pause`, src/trainers/base.py) and the meter leaves it out of the window it falls in, so the curve does not
dip after every evaluation. Wall time, which includes them, is in the report separately.

Token counts come from the batches themselves (attention mask: real tokens; input_ids: real + padding), so DPO
counts chosen and rejected sequences, and the padding fraction is what the collator actually produced. They are summed
on the device and read when logged: a training step reads no device value (each read a GPU stall).
"""

from __future__ import annotations

import resource
import time

from transformers import TrainerCallback

from src.gpu_specs import peak_flops  # the GPUs' datasheet peaks (MFU is reported only for those named there)


def peak_memory_mb(device: str) -> float:
    """GPU: most memory torch ever allocated on this rank; CPU: this process's peak resident set."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def training_flops_per_token(parameters: int, reference_forward: bool) -> float:
    """6N per trained token (forward 2N + backward 4N), plus 2N when a reference model runs forward too. Attention's
    sequence-length term is left out: small next to 6N at the lengths DPO uses, and it keeps the estimate honest-low."""
    return 6 * parameters + (2 * parameters if reference_forward else 0)


class ThroughputMeter(TrainerCallback):
    """Counts the tokens every micro-batch carries (`on_micro_batch`, called from the trainer's training_step) and adds
    `perf/*` to each logged record. Must come before the callbacks that write the logs."""

    def __init__(self, device: str, parameters: int, reference_forward: bool, device_name: str = "",
                 sequences_per_example: int = 1):
        self.device = device
        self.sequences_per_example = sequences_per_example  # DPO batches hold chosen and rejected: 2 per pair
        self.flops_per_token = training_flops_per_token(parameters, reference_forward)
        self.peak = peak_flops(device_name) if device == "cuda" else None
        self.tokens = self.computed = self.padding = self.samples = 0.0
        self.computed_tokens = None  # () -> (computed, padding) of the last micro-batch, set by a forward that knows
        self.window_start = None
        self.window_steps = 0
        self.world_size = 1
        self.totals = {"tokens": 0.0, "computed": 0.0, "padding": 0.0, "samples": 0.0, "seconds": 0.0}

    def on_micro_batch(self, loss, inputs: dict) -> None:
        mask = inputs.get("attention_mask")
        ids = inputs.get("input_ids")
        if ids is None:
            return
        tokens = mask.sum() if mask is not None else ids.numel()  # on the device: read when logged
        self.tokens += tokens
        # The tokens the forward computed: the collated batch's, unless the forward lays them out itself (the packed
        # DPO forward: each prompt once, little padding), which says what it computed.
        computed = self.computed_tokens() if self.computed_tokens else None
        self.computed += computed[0] if computed else ids.numel()
        self.padding += computed[1] if computed else ids.numel() - tokens
        positions = inputs.get("position_ids")
        # A padding-free batch is one row of several sequences, each starting again at position 0.
        rows = (positions == 0).sum() if mask is None and positions is not None else ids.shape[0]
        self.samples += rows / self.sequences_per_example

    def on_step_begin(self, args, state, control, **kwargs):
        if self.window_start is None:
            self.window_start = time.perf_counter()

    def on_pause(self, seconds: float) -> None:
        """`seconds` of the current window were not training (evaluation, a checkpoint, a report refresh)."""
        if self.window_start is not None:
            self.window_start += seconds

    def on_step_end(self, args, state, control, **kwargs):
        self.window_steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.window_start is None or not self.window_steps or "loss" not in logs:
            return
        seconds = time.perf_counter() - self.window_start
        tokens, computed, padding, samples, memory = _sum_and_max_over_ranks(
            *(float(value) for value in (self.tokens, self.computed, self.padding, self.samples)),  # the reads
            peak_memory_mb(self.device))
        world = self.world_size = max(1, args.world_size)
        logs["perf/tokens_per_second"] = tokens / seconds
        logs["perf/tokens_per_second_per_process"] = tokens / seconds / world
        logs["perf/samples_per_second"] = samples / seconds
        logs["perf/step_time_s"] = seconds / self.window_steps
        logs["perf/padding_fraction"] = padding / computed if computed else 0.0
        logs["perf/peak_memory_mb"] = memory
        if self.peak:
            logs["perf/mfu"] = tokens / seconds * self.flops_per_token / (self.peak * world)
        for key, value in (("tokens", tokens), ("computed", computed), ("padding", padding), ("samples", samples),
                           ("seconds", seconds)):
            self.totals[key] += value
        self.totals["peak_memory_mb"] = max(self.totals.get("peak_memory_mb", 0.0), memory)
        self.tokens = self.computed = self.padding = self.samples = 0.0
        self.window_start, self.window_steps = time.perf_counter(), 0

    def summary(self) -> dict:
        """Whole-run figures for training_info.json (over the logged windows; the first window includes warm-up)."""
        seconds = self.totals["seconds"]
        if not seconds:
            return {}
        summary = {
            "tokens_per_second": self.totals["tokens"] / seconds,
            "samples_per_second": self.totals["samples"] / seconds,
            "padding_fraction": self.totals["padding"] / self.totals["computed"] if self.totals["computed"] else 0.0,
            "peak_memory_mb": self.totals["peak_memory_mb"],
        }
        if self.peak:
            summary["mfu"] = summary["tokens_per_second"] * self.flops_per_token / (self.peak * self.world_size)
        return summary


def _sum_and_max_over_ranks(*sums_then_memory: float) -> tuple[float, ...]:
    """Every value summed over the ranks but the last (peak memory), which takes the largest."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return sums_then_memory
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    sums = torch.tensor(sums_then_memory[:-1], dtype=torch.float64, device=device)
    peak = torch.tensor([sums_then_memory[-1]], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return (*sums.tolist(), peak.item())
