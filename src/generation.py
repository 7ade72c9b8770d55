"""Answers to prompts: greedy for held-out prompts, sampled for on-policy rounds; every rank answers its share.

Splitting the work keeps every rank busy (no rank idles in a collective toward a timeout while rank 0 generates) and
makes sample outputs N times faster on N GPUs. Greedy decoding is deterministic for given weights. Sampling is seeded
per answer (`SeededSampling`): each answer draws from its own random stream, so the answers do not depend on how the
prompts were split across processes or batched, and a rerun with the same seed repeats them. A vision-language
model's prompts come with their images (each prompt's image files' bytes), processed per batch by its processing
(src/vision.py) and given to `generate` beside the ids.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from src.chat_templates import THINK_CLOSE, decoded_answer, opened_reasoning, split_reasoning
from src.distributed import any_rank, map_across_ranks, most_on_any_rank
from src.engines import sharded
from src.tools import sample_with_tools
from src.run_safety import hang_watch
from src.vision import decode
from src.world import World


# An answer's repetition: seq-rep-4 (Welleck et al. 2019; src/audit/answers.py says what it is read for).
REPETITION_N = 4


def repetition(tokens: list[int], n: int = REPETITION_N) -> float:
    """seq-rep-n: 1 - distinct n-grams / n-grams (0 for an answer with no repeated n-gram)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def answer_record(text: str, generated_ids: list[int], eos_ids: set, close_ids: list[int] | None = None) -> dict:
    """One generated answer: its text, the tokens before its end, whether it ended (an end-of-sequence token before
    --max_new_tokens ran out), and its repetition. An answer that reasons (its text starts with <think>: the model's or
    its generation prompt's, src/generation.py) adds its reasoning tokens (up to and with `close_ids`, the tokens of
    </think>) and whether its reasoning closed."""
    end = next((position for position, token in enumerate(generated_ids) if token in eos_ids), None)
    tokens = generated_ids if end is None else generated_ids[:end]
    record = {"text": text, "tokens": len(tokens), "ended": end is not None, "repetition": round(repetition(tokens), 4)}
    parts = split_reasoning({"content": text})
    if parts.reasoning is not None:
        closed = THINK_CLOSE in text
        width = len(close_ids or [])
        at = next((i for i in range(len(tokens) - width + 1) if tokens[i:i + width] == close_ids), None) if width \
            else None
        record.update(reasoning_tokens=len(tokens) if not closed else (at + width if at is not None else
                                                                        round(len(tokens) * text.find(THINK_CLOSE)
                                                                              / max(len(text), 1))),
                      closed=closed)
    return record


@dataclass(frozen=True)
class Sampling:
    """How sampled answers are drawn: softmax(logits / temperature), restricted to the top_k most likely tokens (0:
    all) and the top_p nucleus."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def answer_seed(*parts) -> int:
    """A 63-bit seed from the parts (run seed, round, prompt index, answer index): the same on every machine."""
    digest = hashlib.blake2b("/".join(str(part) for part in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SeededSampling:
    """A logits processor that turns greedy decoding into sampling with one random stream per row (Gumbel-max:
    argmax(logits / T + Gumbel noise) is a draw from softmax(logits / T)). Row r's t-th token uses the t-th draw of the
    generator seeded with seeds[r], whatever else is in the batch."""

    def __init__(self, seeds: list[int], sampling: Sampling, device):
        import torch

        self.sampling = sampling
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids, scores):
        import torch

        scores = scores.float() / self.sampling.temperature
        if 0 < self.sampling.top_k < scores.shape[-1]:
            kth = scores.topk(self.sampling.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.sampling.top_p < 1.0:
            ordered, order = scores.sort(dim=-1, descending=True)
            probabilities = ordered.softmax(dim=-1)
            # Tokens whose more likely predecessors already hold top_p of the mass; the most likely token always stays.
            outside = probabilities.cumsum(dim=-1) - probabilities >= self.sampling.top_p
            scores = scores.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=generator, device=scores.device)
                               for generator in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1 - 1e-7)))
        return scores + gumbel


def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
             sampling: Sampling | None = None, seeds: list[int] | None = None, on_batch=None,
             details: bool = False, tools=None, trajectories: bool = False, images: list | None = None,
             processing=None) -> list:
    """This process's answers to `prompts` (token ids), in order: greedy, or sampled with one seed per prompt;
    `on_batch(count)` after every batch (a progress line). `details`: each answer as a dict with its text and what the
    answer audit reads (answer_record: tokens generated, whether it ended, its repetition). `tools` (a
    src/tools.py ToolSession): each answer is a trajectory whose calls are run and their results fed back
    (src/tools.py sample_with_tools), every turn of an answer from its own seed; its text is the whole trajectory;
    `trajectories` (with tools): each answer also carries its ids as sampled and their loss mask (`ids`, `loss_mask`:
    0 on the tool results), what a round's DPO pair trains on. `images`: each prompt's image files (bytes), processed
    by `processing` (src/vision.py)."""
    eos_ids = stop_ids(model, tokenizer)
    close_ids = tokenizer(THINK_CLOSE, add_special_tokens=False)["input_ids"]  # where an answer's reasoning ends
    if tools is not None:
        def sample(indices, contexts, turn, budgets):  # none of its own: this process joins its peers' turn
            turn_seeds = None if seeds is None else [answer_seed(seeds[index], "turn", turn) for index in indices]
            written = sample_ids(model, tokenizer, contexts, max(budgets, default=1), batch_size, eos_ids, sampling,
                                 turn_seeds)
            return [ids[:budget] for ids, budget in zip(written, budgets)]

        trajectories = trajectories_by_batch(sample, tokenizer, prompts, tools, max_new_tokens, eos_ids, batch_size,
                                             on_batch, in_lockstep(model))
        answers = []
        for prompt, trajectory in zip(prompts, trajectories):
            text = opened_reasoning(tokenizer, prompt) + trajectory.text(tokenizer)
            # The audit's length, end and repetition are of what the model wrote, every turn (the results apart).
            written = [token for token, own in zip(trajectory.ids, trajectory.mask) if own and token not in eos_ids]
            ending = [min(eos_ids)] if trajectory.ended else []
            answer = answer_record(text, written + ending, eos_ids, close_ids) | trajectory.record() if details \
                else {"text": text} if trajectories else text
            if trajectories:
                answer.update(ids=trajectory.ids, loss_mask=trajectory.mask)
            answers.append(answer)
        return answers
    answers: list = [""] * len(prompts)

    def batch_done(batch: list[int], written: list[list[int]]) -> None:
        # An answer continuing a reasoning block its prompt opened (DeepSeek-R1's "<think>\n") starts with it, so
        # judges, audits and round pairs see where its reasoning starts and whether it closed.
        for index, ids in zip(batch, written):
            text = opened_reasoning(tokenizer, prompts[index]) + decoded_answer(tokenizer, ids)
            answers[index] = answer_record(text, ids, eos_ids, close_ids) if details else text
        if on_batch:
            on_batch(len(batch))

    sample_ids(model, tokenizer, prompts, max_new_tokens, batch_size, eos_ids, sampling, seeds, batch_done,
               trim=False, images=images, processing=processing)
    return answers


def trajectories_by_batch(sample, tokenizer, prompts: list[list[int]], tools, max_new_tokens: int, eos_ids: set[int],
                          batch_size: int, on_batch=None, lockstep: bool = False) -> list:
    """Each prompt's trajectory (src/tools.py sample_with_tools; `sample(indices, ...)` with the prompts' own indices),
    a batch of prompts at a time, every turn of its answers before the next batch starts, so that `on_batch(count)`
    reports answers as they finish (a round's progress line), not once this process's whole share is done. The
    batches are the ones the first turn forms without this (sample_ids: by length); a later turn batches only its
    batch's answers still going. `lockstep` (in_lockstep): every process runs as many batches and turns as the
    busiest, with none of its own where it has no more."""
    trajectories: list = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
    starts = range(0, len(order), batch_size)
    if lockstep:
        starts = range(0, most_on_any_rank(len(starts))[0] * batch_size, batch_size)
    for start in starts:
        batch = order[start:start + batch_size]

        def sample_batch(indices, contexts, turn, budgets, batch=batch):
            return sample([batch[index] for index in indices], contexts, turn, budgets)

        finished = sample_with_tools(sample_batch, tokenizer, [prompts[index] for index in batch], tools,
                                     max_new_tokens, eos_ids,
                                     keep_sampling=(lambda going: any_rank(going)[0]) if lockstep else None)
        for index, trajectory in zip(batch, finished):
            trajectories[index] = trajectory
        if on_batch:
            on_batch(len(batch))
    return trajectories


def in_lockstep(model) -> bool:
    """Whether every generate call is a collective: under DeepSpeed ZeRO-3 or FSDP with more than one process each
    forward gathers the weights from all of them and transformers keeps the processes' generation in step
    (synced_gpus). A process with fewer batches or turns than another must then join the other's (its own none);
    else the other waits inside one, or the next collectives cross (held-out prompts that did not divide evenly:
    1 over 2 processes under ZeRO-3 ended in gloo's "Received data size doesn't match expected size")."""
    import torch.distributed as dist
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model) or sharded(model.parameters())


def stop_ids(model, tokenizer) -> set[int]:
    """The tokens an answer (or a turn of one) ends at: the tokenizer's EOS and the model's generation config's."""
    eos_ids = {tokenizer.eos_token_id} | set(_as_list(getattr(model.generation_config, "eos_token_id", None)))
    return {token for token in eos_ids if token is not None}


def sample_ids(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int, eos_ids: set[int],
               sampling: Sampling | None = None, seeds: list[int] | None = None, on_batch=None,
               trim: bool = True, images: list | None = None, processing=None) -> list[list[int]]:
    """The ids generated after each prompt, in order (greedy, or sampled with one seed per prompt), each cut after its
    first stop token (`trim`; else as the batch padded them); `on_batch(indices, ids)` after every batch."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    generation = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        eos_token_id=sorted(eos_ids), pad_token_id=tokenizer.pad_token_id,
    )
    written: list[list[int]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    lockstep = in_lockstep(model)
    with torch.no_grad():
        # Left padding, so every prompt ends where generation starts.
        batches = list(padded_batches(model, prompts, batch_size, tokenizer.pad_token_id, left=True))
        if lockstep:  # as many generate calls as the busiest process: each is a collective
            one_token = torch.tensor([[tokenizer.pad_token_id]], device=next(model.parameters()).device)
            for _ in range(most_on_any_rank(len(batches))[0] - len(batches)):
                with hang_watch.phase("generation", "joining the other processes' batch (none of its own)"):
                    model.generate(input_ids=one_token, attention_mask=torch.ones_like(one_token),
                                   generation_config=generation, max_new_tokens=1, synced_gpus=True)
        for batch, input_ids, attention_mask in batches:
            processors = LogitsProcessorList(
                [SeededSampling([seeds[index] for index in batch], sampling, input_ids.device)] if sampling else [])
            with hang_watch.phase("generation", f"{len(batch)} prompts, up to {max_new_tokens} new tokens"):
                output = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                        generation_config=generation, logits_processor=processors,
                                        synced_gpus=lockstep, **image_inputs(processing, images, batch, input_ids))
            rows = output[:, input_ids.shape[1]:].tolist()
            if trim:
                rows = [row[:next((at + 1 for at, token in enumerate(row) if token in eos_ids), len(row))]
                        for row in rows]
            for index, row in zip(batch, rows):
                written[index] = row
            if on_batch:
                on_batch(batch, rows)
    model.train(was_training)
    return written


def image_inputs(processing, images: list | None, batch: list[int], input_ids) -> dict:
    """A batch's image tensors and per-token inputs for `generate` (src/vision.py), on the ids' device; {} without
    images."""
    if processing is None or not images or not any(images[index] for index in batch):
        return {}
    inputs = processing.image_inputs([[decode(data) for data in images[index]] for index in batch])
    inputs = {key: value.to(input_ids.device) for key, value in inputs.items()}
    return inputs | processing.token_inputs(input_ids)


def padded_batches(model, sequences: list[list[int]], batch_size: int, pad_token_id: int, left: bool):
    """(indices, input_ids, attention_mask) on the model's device, batches of similar lengths (less padding), padded on
    the left (generation) or the right (scoring the last token); the caller puts results back by the indices."""
    import torch

    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda index: len(sequences[index]))
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        width = max(len(sequences[index]) for index in batch)
        pads = [[pad_token_id] * (width - len(sequences[index])) for index in batch]
        masks = [[0] * (width - len(sequences[index])) for index in batch]
        input_ids = [pad + sequences[index] if left else sequences[index] + pad for pad, index in zip(pads, batch)]
        attention_mask = [mask + [1] * len(sequences[index]) if left else [1] * len(sequences[index]) + mask
                          for mask, index in zip(masks, batch)]
        yield batch, torch.tensor(input_ids, device=device), torch.tensor(attention_mask, device=device)


def generate_answers(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                     world: World, tools=None, images: list | None = None, processing=None) -> list[dict]:
    """The model's greedy answer to each prompt (token ids), identical on every rank, in prompt order: its text and
    the answer audit's numbers (answer_record; with `tools`, a trajectory's tool record too). `images`: each
    prompt's image files (a vision-language model's, with its `processing`)."""
    items = list(zip(prompts, images or [None] * len(prompts)))
    return map_across_ranks(
        items, lambda share: generate(model, tokenizer, [ids for ids, _ in share], max_new_tokens, batch_size,
                                      details=True, tools=tools, images=[seen for _, seen in share],
                                      processing=processing), world)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
