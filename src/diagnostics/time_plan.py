"""check_gpu's estimate of the time of one optimizer step of an objective that samples as it trains (GRPO), split into
sampling, judging and training: from the model's size, the step's tokens and the GPU's datasheet peaks
(src/gpu_specs.py), at the efficiencies below. An estimate to plan with, not a measurement: the run logs the real
split every step (time/generation_s, time/judging_s, step_time). Per process (each process samples, judges and trains
its share of the global batch at once; the gradients' all-reduce is left out):

  sequences   per-device batch x accumulation answers per step, each a prompt (--max_length, all of it) and an
              answer of --max_new_tokens (every answer as long as allowed: an upper bound where answers end early)
  sampling    per generate call (per-device batch x steps_per_generation sequences at once): the prompts' prefill,
              2 x params FLOPs per token at MFU; then one pass per new token, the longest of (a) reading the weights
              and the KV cache from memory at BANDWIDTH_EFFICIENCY of the bandwidth (decoding is memory-bound: the
              weights are read once per token for the whole batch), (b) 2 x params FLOPs per sequence at MFU, plus
              (c) transformers' generate overhead, DECODE_OVERHEAD_S per layer per new token (eager mode launches each
              kernel from Python: a rule of thumb, not measured here)
  judging     the embedded checker: ~0 (string checks; measured 1.2% of a step on CPU); a reward model: one forward
              per answer, 2 x its params FLOPs per token at MFU; a function (module:function): not estimated
  training    6 x params FLOPs per token (forward 2, backward 4; with LoRA 4: the frozen weights need no weight
              gradient), + 2 x params with gradient checkpointing (the forward again), + 2 x params for the reference
              model's forward when the KL term needs one (--beta > 0), at MFU
"""

from __future__ import annotations

from dataclasses import dataclass, field

from src.config import EMBEDDED
from src.gpu_specs import memory_bandwidth, peak_flops
from src.judges import FUNCTION_JUDGE

from .inputs import TrainingSetup
from .model_shape import ModelShape

MFU = 0.40  # of the bf16 peak, in the matmuls of training, prefill and a reward model's forward
BANDWIDTH_EFFICIENCY = 0.70  # of the datasheet memory bandwidth, in decoding
DECODE_OVERHEAD_S = 0.5e-3  # per decoder layer per new token: transformers' eager generate (Python, kernel launches)
EMBEDDED_JUDGES = ("auto", EMBEDDED)  # "auto" is the checker on the embedded data, and no judge elsewhere


@dataclass
class JudgeTime:
    judge: str
    kind: str  # "checker", "reward model" or "function"
    seconds: float | None  # None: not estimated (a function's time is the user's code)


@dataclass
class StepTime:
    gpu: str
    peak_flops: float
    bandwidth: float
    answers: int  # per process per optimizer step
    generate_calls: float  # generate calls per optimizer step per process
    generation_s: float
    training_s: float
    judges: list[JudgeTime] = field(default_factory=list)
    assumptions: str = (f"{MFU:.0%} of the bf16 peak in matmuls, {BANDWIDTH_EFFICIENCY:.0%} of the memory bandwidth "
                        f"in decoding, {DECODE_OVERHEAD_S * 1e3:g} ms of generate's overhead per layer per new token, "
                        "every answer --max_new_tokens long")

    @property
    def judging_s(self) -> float | None:
        """The judges' seconds together; None when one of them is not estimated."""
        times = [judge.seconds for judge in self.judges]
        return None if any(time is None for time in times) else sum(times)

    @property
    def total_s(self) -> float:
        """Sampling + training + the judges that are estimated."""
        return self.generation_s + self.training_s + sum(judge.seconds or 0.0 for judge in self.judges)


def judge_kind(judge: str) -> str:
    if judge in EMBEDDED_JUDGES:
        return "checker"
    return "function" if FUNCTION_JUDGE.match(judge) else "reward model"  # as src/judges.py's judge_for reads it


def estimate_step_time(shape: ModelShape, setup: TrainingSetup, gpu_name: str,
                       judge_params: dict[str, int | None] | None = None) -> StepTime | None:
    """A sampling objective's step on one GPU named `gpu_name`; None when the step samples nothing or the GPU is not in
    src/gpu_specs.py's tables. `judge_params`: each reward-model judge's parameter count (None: unknown)."""
    flops, bandwidth = peak_flops(gpu_name), memory_bandwidth(gpu_name)
    if not setup.generation_tokens or not setup.answer_tokens or not flops or not bandwidth:
        return None
    params, layers = shape.total_params, shape.num_layers
    weight_bytes = 4 if setup.precision == "fp32" else 2
    accumulation = max(1, setup.accumulation_steps)
    answers = setup.per_device_batch_size * accumulation
    per_call = setup.per_device_batch_size * (setup.generation_steps or accumulation)
    calls = answers / per_call
    answer_tokens = setup.answer_tokens
    prompt_tokens = max(0, setup.generation_tokens - answer_tokens)
    compute = flops * MFU
    prefill = 2 * params * per_call * prompt_tokens / compute
    # per new token: the weights once, and the KV cache as long as it is on average (the prompt and half the answer)
    cache = per_call * (prompt_tokens + answer_tokens / 2) * layers * 2 * shape.kv_size * weight_bytes
    memory_s = (weight_bytes * params + cache) / (bandwidth * BANDWIDTH_EFFICIENCY)
    per_token = max(memory_s, 2 * params * per_call / compute) + layers * DECODE_OVERHEAD_S
    generation = calls * (prefill + answer_tokens * per_token)
    tokens = answers * setup.generation_tokens
    per_token_flops = ((4 if setup.method in ("lora", "qlora") else 6) * params
                       + (2 * params if setup.gradient_checkpointing else 0)
                       + (2 * params if setup.reference_kept else 0))
    judges = []
    for judge in (judge for judge in setup.judges if judge != "none"):
        kind = judge_kind(judge)
        seconds = 0.0 if kind == "checker" else None
        if kind == "reward model" and (judge_params or {}).get(judge):
            seconds = 2 * judge_params[judge] * tokens / compute
        judges.append(JudgeTime(judge, kind, seconds))
    return StepTime(gpu=gpu_name, peak_flops=flops, bandwidth=bandwidth, answers=answers, generate_calls=calls,
                    generation_s=generation, training_s=tokens * per_token_flops / compute, judges=judges)
