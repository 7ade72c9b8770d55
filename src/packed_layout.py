"""The packed layout of a micro-batch (pure: examples in, tensors out, no model): where each token of each prompt and
answer sits in the packed rows, and where each scored token's per-token outputs sit in TRL's padded layout.

Layout (sdpa / eager: a 4D mask; on a GPU FlexAttention's BlockMask of the same rule where src/packed_attention.py
picks it by row width, all segments then in one bucketed row): one segment per pair,
`[prompt[:-1] | prompt[-1] chosen | prompt[-1] rejected]`.
The last prompt token is the one position that predicts an answer's first token, and it must predict both answers'
first tokens: it is written once per answer (same token, same position, same visible keys → the same hidden state),
so each pair repeats exactly one prompt token. Position ids restart after the shared prompt for each answer; the mask
(src/packed_attention.py) is causal within the segment except that the rejected answer does not see the chosen one. A
padded forward of one answer per prompt (KTO's completions, its KL completions: `answers` of one key) packs as one
segment per row, `[prompt | answer]`: the same layout with nothing shared, padding-free. Segments are packed
first-fit-decreasing into rows at least as long as the batch's longest segment, the width chosen to balance padding
against the dense mask's attention cost; the rest of a row is padding (counted).

Layout (flash-attention, varlen): flash-attention takes no such mask, so each answer is its own sequence
`[prompt | answer]` with positions restarting at 0 (transformers turns that into varlen); all sequences of the
micro-batch are one row: no padding, but the prompt is computed twice.

An answer's loss mask (a sampled tool trajectory's: ANSWER_MASKS) makes its labels -100 where the model did not write
the token. The counts of a batch, packed or TRL's padded: computed, padding, repeated prompt, useful tokens.
"""

from __future__ import annotations

import torch

from src.packed_attention import CHOSEN, FLEX, REJECTED, SHARED, AttentionPolicy, flex_rows

PACKED_KEYS = ("packed_input_ids", "packed_position_ids", "packed_shift_labels", "packed_segment_ids",
               "packed_branch_ids", "packed_source_index", "padded_target_index", "packed_counts")
PAIR_ANSWERS = ("chosen_ids", "rejected_ids")  # a pair's answers, in the order of TRL's padded rows
# An answer's loss mask, a prepared column beside its ids where the answer is a sampled tool trajectory: 1 where the
# model wrote the token, 0 on a tool result and the template's text around it (src/tools.py Trajectory.mask).
ANSWER_MASKS = {"chosen_ids": "chosen_loss_mask", "rejected_ids": "rejected_loss_mask"}


def _trained(answer: list, mask: list | None) -> list:
    """An answer's labels: its tokens, -100 where its loss mask is 0 (a tool result: no log-prob is read there)."""
    return answer if mask is None else [token if keep else -100 for token, keep in zip(answer, mask)]


def _truncated(example: dict, max_length: int | None, answers: tuple[str, ...]) -> tuple[list, list[list]]:
    """The prompt and each answer as TRL's collators truncate them (keep_start, each prompt+answer to max_length)."""
    prompt = list(example["prompt_ids"])[:max_length]
    cut = None if max_length is None else max_length - len(prompt)
    return prompt, [list(example[key])[:cut] for key in answers]


def _answer_masks(example: dict, answers: tuple[str, ...]) -> list[list | None]:
    """Each answer's loss mask where the example carries one (ANSWER_MASKS), else None."""
    # An empty mask is a pair of the data's own (a held-out pair beside a round's trajectories): none.
    return [list(example[ANSWER_MASKS[key]]) or None if ANSWER_MASKS.get(key) in example else None
            for key in answers]


def _first_fit_decreasing(sizes: list[int], width: int) -> list[list[int]]:
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        slot = next((r for r, used in enumerate(fill) if used + sizes[i] <= width), None)
        if slot is None:
            rows.append([])
            fill.append(0)
            slot = len(rows) - 1
        rows[slot].append(i)
        fill[slot] += sizes[i]
    return rows


def _rows(sizes: list[int], attention_cost: float) -> tuple[int, list[list[int]]]:
    """The row width and rows (segment indices) for a 4D-masked forward: a dense mask costs every row width² in
    attention, so wider rows pad less but attend more. Cost of a token ∝ 1 + attention_cost * width (attention_cost:
    the attention's share per key, ~1 / (3 * hidden_size)); the width among a few candidates that costs least."""
    longest, total = max(sizes), sum(sizes)
    best = None
    for width in sorted({longest, *(max(longest, -(-total // k)) for k in range(1, len(sizes) + 1))}):
        rows = _first_fit_decreasing(sizes, width)
        cost = len(rows) * width * (1 + attention_cost * width)
        if best is None or cost < best[0]:
            best = (cost, width, rows)
    return best[1], best[2]


def pack_pairs(examples: list[dict], max_length: int | None, pad_token_id: int, layout: str,
               padded_length: int, attention_cost: float = 0.0, score_prompt: bool = False,
               answers: tuple[str, ...] = PAIR_ANSWERS, attention: AttentionPolicy | None = None) -> dict:
    """The packed tensors for a micro-batch of prompts with one or two answers each (`answers`: their keys, in the
    order of the padded rows: answer j of example i is padded row j * examples + i; see the module docstring for the
    layouts).

    packed_source_index / padded_target_index: for every scored token, where its per-token outputs sit in the
    flattened packed `(rows, width)` output and in TRL's flattened padded `(answers * examples, padded_length - 1)`
    output. Scored: the answers' tokens, and with `score_prompt` also the prompt's (from its second token) in the first
    answer's row (ORPO's NLL term covers prompt + chosen answer): the shared prompt's positions, computed once.
    `attention`: where it picks FlexAttention for the dense layout's width, every segment goes in one bucketed row."""
    if len(answers) not in (1, 2):
        raise ValueError(f"the packed layout holds one or two answers per prompt, not {len(answers)}")
    segments, useful, repeated = _segments(examples, max_length, layout, score_prompt, answers)
    width, rows = _packed_rows([len(segment[0]) for segment in segments], layout, attention_cost, attention)
    packed = _packed_tensors(segments, rows, width, pad_token_id, padded_length, layout)
    computed = len(rows) * width
    # computed, padding, repeated prompt, useful tokens
    packed["packed_counts"] = torch.tensor([computed, computed - useful - repeated, repeated, useful], dtype=torch.long)
    return packed


def _segments(examples: list[dict], max_length: int | None, layout: str, score_prompt: bool,
              answers: tuple[str, ...]) -> tuple[list[tuple], int, int]:
    """The layout's segments (per segment: tokens, positions, branch ids, labels, [(padded row, padded start, offset,
    count)]), the useful tokens and the prompt tokens computed more than once."""
    pairs = len(examples)
    segments = []
    useful = repeated = 0
    for index, example in enumerate(examples):
        prompt, replies = _truncated(example, max_length, answers)
        labelled = [_trained(answer, mask) for answer, mask in zip(replies, _answer_masks(example, answers))]
        useful += len(prompt) + sum(len(answer) for answer in replies)
        padded_rows = range(index, len(replies) * pairs, pairs)
        if layout == "prefix_shared":
            repeated += len(prompt[-1:]) * (len(replies) - 1)
            segments.append(_prefix_shared_segment(index, prompt, replies, labelled, padded_rows, score_prompt))
            continue
        repeated += len(prompt) * (len(replies) - 1)
        for row, answer, answer_labels in zip(padded_rows, replies, labelled):
            sequence = prompt + answer
            start = 0 if score_prompt and row == index else max(0, len(prompt) - 1)
            labels = [-100] * start + (prompt + answer_labels)[start + 1:] + [-100]
            segments.append((sequence, list(range(len(sequence))), [SHARED] * len(sequence), labels[:len(sequence)],
                             [(row, start, start, len(sequence) - 1 - start)]))
    return segments, useful, repeated


def _prefix_shared_segment(index: int, prompt: list, replies: list[list], labelled: list[list], padded_rows,
                           score_prompt: bool) -> tuple:
    """One prompt and its answers as one segment: the prompt but its last token once, then each answer's branch
    (that last prompt token, which predicts the answer's first, then the answer); `labelled`: each answer's labels
    (its tokens, -100 where its loss mask is 0)."""
    shared, pivot = prompt[:-1], prompt[-1:]
    tokens, positions, branches, labels, targets = list(shared), list(range(len(shared))), \
        [SHARED] * len(shared), [-100] * len(shared), []
    if score_prompt and shared:  # shared[k] predicts prompt[k + 1], the chosen row's shifted position k
        labels = list(prompt[1:])
        targets.append((index, 0, 0, len(shared)))
    for branch, row, answer, answer_labels in zip((CHOSEN, REJECTED), padded_rows, replies, labelled):
        sequence = pivot + answer
        # sequence[k] predicts sequence[k + 1]; in TRL's padded row that is shifted position start + k
        targets.append((row, len(shared), len(tokens), len(sequence) - 1))
        tokens += sequence
        positions += range(len(shared), len(shared) + len(sequence))
        branches += [branch] * len(sequence)
        labels += answer_labels + [-100]
    return tokens, positions, branches, labels, targets


def _packed_rows(sizes: list[int], layout: str, attention_cost: float,
                 attention: AttentionPolicy | None) -> tuple[int, list[list[int]]]:
    """The row width and which segments each row holds."""
    if layout == "varlen":  # everything in one row: flash-attention's cost follows each sequence, not the row
        return sum(sizes), [list(range(len(sizes)))]
    width, rows = _rows(sizes, attention_cost)
    if attention is not None and attention.kind_for(width) == FLEX:
        width, rows = flex_rows(sizes)
    return width, rows


def _packed_tensors(segments: list[tuple], rows: list[list[int]], width: int, pad_token_id: int, padded_length: int,
                    layout: str) -> dict:
    """The segments laid into their rows, and each scored token's place in the packed and in TRL's padded output."""
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    shift_labels = torch.full(shape, -100, dtype=torch.long)
    segment_ids = torch.full(shape, -1, dtype=torch.long)  # padding: its own segment, so it never reaches a token
    branch_ids = torch.zeros(shape, dtype=torch.long)
    source, target = [], []
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            tokens, positions, branches, labels, targets = segments[i]
            n = len(tokens)
            input_ids[r, at:at + n] = torch.tensor(tokens)
            position_ids[r, at:at + n] = torch.tensor(positions)
            shift_labels[r, at:at + n] = torch.tensor(labels)
            segment_ids[r, at:at + n] = i
            branch_ids[r, at:at + n] = torch.tensor(branches)
            for padded_row, padded_start, offset, count in targets:
                source.extend(range(r * width + at + offset, r * width + at + offset + count))
                target.extend(range(padded_row * (padded_length - 1) + padded_start,
                                    padded_row * (padded_length - 1) + padded_start + count))
            at += n
    if layout == "varlen":  # the row's trailing padding (none today) would join the last sequence: keep it out
        position_ids[segment_ids < 0] = 0
    return {"packed_input_ids": input_ids, "packed_position_ids": position_ids, "packed_shift_labels": shift_labels,
            "packed_segment_ids": segment_ids, "packed_branch_ids": branch_ids,
            "packed_source_index": torch.tensor(source, dtype=torch.long),
            "padded_target_index": torch.tensor(target, dtype=torch.long)}


def padded_counts(batch: dict, answers: int = 2) -> torch.Tensor:
    """computed, padding, repeated prompt, useful tokens of TRL's padded batch (rows [chosen; rejected]; with one
    answer per prompt, no prompt is repeated), on the batch's device: counted without a read (src/packed_forward.py
    TokenCounts)."""
    computed = batch["input_ids"].new_full((), batch["input_ids"].numel())
    real = batch["attention_mask"].sum()
    pairs = batch["input_ids"].shape[0] // answers
    repeated = batch["attention_mask"][pairs:].sum() - batch["completion_mask"][pairs:].sum()
    return torch.stack([computed, computed - real, repeated, real - repeated]).long()

