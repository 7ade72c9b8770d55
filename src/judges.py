"""Judges: score the starting (reference) model's answers and the trained model's answers to held-out prompts.

    result = ProgrammaticJudge(check, metric="correct_and_preferred").judge(rows, reference_answers, trained_answers)
    result = RewardModelJudge("path/or/hub-id-of-a-reward-model").judge(rows, reference_answers, trained_answers)
    result = pair_accuracy(score_pairs(untrained, ...), score_pairs(trained, ...))   # a reward model on pairs
    judge = judge_for(config.training.judge, config.data.dataset_name)   # what --judge names, or None
    scores = judge.scores(rows, answers)        # one number per (row, answer): on-policy rounds (src/rounds.py)

Every judge scores an answer's final answer, after its reasoning (`<think>…</think>`; an answer whose reasoning never
closed has none: ""). --judge module:function brings a user's own check (a math answer checker, unit tests):
`function(row, answer)` (or `function(row, answer, reasoning)`, to read the reasoning too) returns a number, higher is
better (a bool counts as 0/1), or a dict with a numeric "score" and boolean sub-criteria; it is called once per
answer, on every process for its share. A judge that raises or returns anything else stops the run with one line
naming the prompt and the value (JudgeError).

`rows` are dicts with at least "prompt" (str, or a list of chat messages) and "meta" (dict), optionally "chosen".
The per-sample verdicts go into `samples_<split>.jsonl`, the aggregates (`JudgeResult.to_dict()`) into
`training_info.json`.
"""

from __future__ import annotations

import abc
import importlib
import inspect
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable

from src.chat_templates import final_answer, reasoning_of
from src.config import EMBEDDED
from src.distributed import map_across_ranks
from src.embedded.tasks import check as check_embedded_answer
from src.engines import loading_whole
from src.generation import padded_batches
from src.run_safety import hang_watch


FUNCTION_JUDGE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # --judge module:function


class JudgeError(ValueError):
    """A judge that cannot be loaded, raised, or returned something other than a number: one line naming the judge,
    the prompt and the value."""


@dataclass
class JudgeResult:
    """Aggregates of one judged split. `before`/`after` are fractions 0..1 for the starting and the trained model.

    `details` maps a name to {"before": x, "after": y} (fractions 0..1, except names starting with "mean_", which
    are raw means such as rewards) or to a dict of counts (e.g. {"improved": 3, "regressed": 1, "unchanged": 36}).
    """

    metric: str
    n: int
    before: float
    after: float
    verdicts: list[dict]  # per sample: {"reference": {...}, "trained": {...}}
    details: dict = field(default_factory=dict)
    judge: str = ""  # which judge produced it, e.g. "programmatic" or "reward model ./rm"

    def to_dict(self) -> dict:
        """JSON-ready aggregates, without the per-sample verdicts (those go in samples_*.jsonl)."""
        result = asdict(self)
        del result["verdicts"]
        return result


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _reward(verdict: dict) -> float:
    """A programmatic verdict's reward: its "reward" where the check ranks answers more finely than its score."""
    return float(verdict["reward"] if isinstance(verdict.get("reward"), (int, float)) else verdict["score"])


def _check_lengths(rows: list[dict], reference_answers: list[str], trained_answers: list[str]) -> None:
    if not len(rows) == len(reference_answers) == len(trained_answers):
        raise ValueError(f"judge: {len(rows)} rows but {len(reference_answers)} reference answers and "
                         f"{len(trained_answers)} trained answers; they must match one to one")


def _changes(before: list[float], after: list[float]) -> dict:
    return {"improved": sum(b < a for b, a in zip(before, after)),
            "regressed": sum(b > a for b, a in zip(before, after)),
            "unchanged": sum(b == a for b, a in zip(before, after))}


def prompt_text(prompt) -> str:
    """A prompt as one short line for a message: a chat's last user turn, or the text, cut at 80 characters."""
    if isinstance(prompt, list):
        turns = [message.get("content") for message in prompt if isinstance(message, dict)]
        prompt = turns[-1] if turns else ""
    text = " ".join(str(prompt).split())
    return text if len(text) <= 80 else text[:77] + "..."


# What a judge's own code may raise: any error, and SystemExit (a user's check calling sys.exit or exit()), which would
# otherwise end one process alone in the middle of a step while the others wait for it in a collective.
JUDGE_FAILURES = (Exception, SystemExit)


class Judge(abc.ABC):
    """`judge` and `scores` raise nothing but JudgeError, whatever fails inside the judge (its code raising anything, a
    count of scores that is not one per answer, a score that is not a finite number): every caller (GRPO's rewards,
    a round's scores, the data audit, the held-out verdicts) stops every process on it in one line."""

    name: str = "judge"

    def judge(self, rows: list[dict], reference_answers: list[str], trained_answers: list[str]) -> JudgeResult:
        """Verdicts for the reference and the trained answer to every row, and their aggregates."""
        try:
            with hang_watch.phase("judge", f"{self.name}: {len(rows)} prompts"):
                return self._judge(rows, reference_answers, trained_answers)
        except JudgeError:
            raise
        except JUDGE_FAILURES as error:
            raise JudgeError(f"judge {self.name}: raised {type(error).__name__}: {error}") from error

    def scores(self, rows: list[dict], answers: list[str]) -> list[float]:
        """One number per (row, answer), higher is better: how GRPO rewards an answer and on-policy rounds rank a
        prompt's answers."""
        try:
            with hang_watch.phase("judge", f"{self.name}: {len(answers)} answers"):
                scores = list(self._scores(rows, answers))
        except JudgeError:
            raise
        except JUDGE_FAILURES as error:
            raise JudgeError(f"judge {self.name}: raised {type(error).__name__}: {error}") from error
        if len(scores) != len(answers):
            raise JudgeError(f"judge {self.name}: returned {len(scores)} scores for {len(answers)} answers; a judge "
                             "scores every answer once")
        for row, score in zip(rows, scores):
            if not isinstance(score, (int, float)) or not math.isfinite(score):
                raise JudgeError(f"judge {self.name}, prompt {prompt_text(row.get('prompt'))!r}: returned {score!r}; "
                                 "a judge returns a finite number (higher is better)")
        return [float(score) for score in scores]

    @abc.abstractmethod
    def _judge(self, rows: list[dict], reference_answers: list[str], trained_answers: list[str]) -> JudgeResult:
        """`judge`, as the judge computes it."""

    @abc.abstractmethod
    def _scores(self, rows: list[dict], answers: list[str]) -> list[float]:
        """`scores`, as the judge computes them."""


class ProgrammaticJudge(Judge):
    """Checks every answer with code: for verifiable tasks (the embedded default's tasks).

    `check(row, answer)` returns a verdict dict with "score" (float 0..1) and any boolean sub-criteria
    (e.g. "correct", "preferred"). before/after = mean score; details = the mean of each boolean sub-criterion.
    """

    name = "programmatic"

    def __init__(self, check: Callable[[dict, str], dict | float], metric: str = "accuracy", name: str = "programmatic"):
        self.check = check
        self.metric = metric
        self.name = name
        try:
            self.wants_reasoning = "reasoning" in inspect.signature(check).parameters
        except (TypeError, ValueError):  # a builtin or C function: no signature to read
            self.wants_reasoning = False

    def _verdict(self, row: dict, answer: str) -> dict:
        where = f"judge {self.name}, prompt {prompt_text(row.get('prompt'))!r}"
        try:
            # The final answer by default (its reasoning apart); a check with a `reasoning` parameter gets that too.
            if self.wants_reasoning:
                verdict = self.check(row, final_answer(answer), reasoning=reasoning_of(answer))
            else:
                verdict = self.check(row, final_answer(answer))
        except JUDGE_FAILURES as error:  # the user's code: whatever it raises is named, with the prompt
            raise JudgeError(f"{where}: raised {type(error).__name__}: {error}") from error
        if isinstance(verdict, (int, float)):  # a bare number (or bool) is the score
            verdict = {"score": float(verdict)}
        score = verdict.get("score") if isinstance(verdict, dict) else None
        if not isinstance(score, (int, float)) or (isinstance(score, float) and not math.isfinite(score)):
            raise JudgeError(f"{where}: returned {verdict!r}; a judge returns a finite number (higher is better) or a "
                             "dict with a numeric 'score'")
        return dict(verdict)

    def _scores(self, rows: list[dict], answers: list[str]) -> list[float]:
        """The verdict's "reward" where the check ranks answers more finely than its score, else the score."""
        return [_reward(self._verdict(row, answer)) for row, answer in zip(rows, answers)]

    def scores_and_turns(self, rows: list[dict], answers: list[str]) -> tuple[list[float], list[list[float] | None]]:
        """`scores`, and each verdict's per-turn scores (`turn_rewards`: one number per turn the model wrote, for
        GRPO's per-turn credit with --tools; None where the check gives none)."""
        with hang_watch.phase("judge", f"{self.name}: {len(answers)} answers"):
            verdicts = [self._verdict(row, answer) for row, answer in zip(rows, answers)]
        turns = [verdict.get("turn_rewards") for verdict in verdicts]
        return [_reward(verdict) for verdict in verdicts], [
            [float(value) for value in turn] if isinstance(turn, (list, tuple)) else None for turn in turns]

    def _judge(self, rows: list[dict], reference_answers: list[str], trained_answers: list[str]) -> JudgeResult:
        _check_lengths(rows, reference_answers, trained_answers)
        verdicts = [{"reference": self._verdict(row, reference), "trained": self._verdict(row, trained)}
                    for row, reference, trained in zip(rows, reference_answers, trained_answers)]
        before = [float(verdict["reference"]["score"]) for verdict in verdicts]
        after = [float(verdict["trained"]["score"]) for verdict in verdicts]
        criteria = sorted({key for verdict in verdicts for side in verdict.values() for key, value in side.items()
                           if isinstance(value, bool)})
        details = {key: {"before": _mean([float(v["reference"].get(key, False)) for v in verdicts]),
                         "after": _mean([float(v["trained"].get(key, False)) for v in verdicts])} for key in criteria}
        if any(isinstance(side.get("reward"), (int, float)) for verdict in verdicts for side in verdict.values()):
            # a check that ranks answers more finely than its score (the embedded checker): the held-out mean of that
            # reward, the number GRPO is trained to raise (its report leads with it)
            details["mean_reward"] = {side_name: _mean([_reward(verdict[side]) for verdict in verdicts])
                                      for side_name, side in (("before", "reference"), ("after", "trained"))}
        details["changes"] = _changes(before, after)
        return JudgeResult(self.metric, len(rows), _mean(before), _mean(after), verdicts, details, judge=self.name)


class RewardModelJudge(Judge):
    """Scores answers with a sequence-classification reward model (one logit), e.g. one trained with TRL's
    RewardTrainer, and reports how often the trained answer beats the reference answer.

    The text is built the way RewardTrainer builds its training pairs, so such a model sees what it was trained
    on: a chat prompt (list of messages) goes through the tokenizer's chat template with the answer as the
    assistant turn; a string prompt is concatenated with the answer plus the EOS token. Over-long inputs are
    truncated from the left, because the model scores the last token and the answer is at the end.

    Metric "win_rate": after = fraction of prompts where reward(trained) > reward(reference), ties (identical
    answers, or equal rewards) counting 0.5; before = 0.5, the reference model against itself. details:
    mean rewards before/after, win/tie/loss counts and, when every row has a "chosen" answer,
    "win_rate_vs_chosen" — how often each model's answer beats the dataset's chosen answer, a before/after pair
    measured against one fixed anchor.
    """

    metric = "win_rate"

    def __init__(self, model_name_or_path: str, batch_size: int = 16, device: str | None = None,
                 max_length: int = 1024):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name = f"reward model {model_name_or_path}"
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        with loading_whole():  # whole on the rank that judges, even under ZeRO-3 (which the other ranks would join)
            self.model = AutoModelForSequenceClassification.from_pretrained(model_name_or_path).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"RewardModelJudge: {model_name_or_path} has num_labels={self.model.config.num_labels}; "
                             f"a reward model has one output (num_labels=1), e.g. one trained with TRL's RewardTrainer")
        # The model pools the last token that is not padding, so it must know the padding id; RewardTrainer falls
        # back to EOS the same way when the tokenizer has no padding token.
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def _input_ids(self, prompt: str | list, answer: str) -> list[int]:
        answer = final_answer(answer)  # a reward model scores the final answer, as it was trained on answers
        if isinstance(prompt, list) and self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": answer}],
                                                     tokenize=True, return_dict=True)["input_ids"]
        else:
            if isinstance(prompt, list):  # a chat but no template to render it with: plain text turns
                prompt = "".join(f"{message['role']}: {message['content']}\n" for message in prompt)
            text = prompt + answer
            eos = self.tokenizer.eos_token
            if eos and not text.endswith(eos):
                text += eos
            ids = self.tokenizer(text)["input_ids"]
        return list(ids)[-self.max_length:]

    def score(self, prompts: list[str | list], answers: list[str]) -> list[float]:
        """The reward of each (prompt, answer) pair."""
        sequences = [self._input_ids(prompt, answer) for prompt, answer in zip(prompts, answers)]
        return reward_scores(self.model, sequences, self.tokenizer.pad_token_id, self.batch_size)

    def _scores(self, rows: list[dict], answers: list[str]) -> list[float]:
        return self.score([row["prompt"] for row in rows], answers)

    def _judge(self, rows: list[dict], reference_answers: list[str], trained_answers: list[str]) -> JudgeResult:
        _check_lengths(rows, reference_answers, trained_answers)
        prompts = [row["prompt"] for row in rows]
        reference_rewards = self.score(prompts, reference_answers)
        trained_rewards = self.score(prompts, trained_answers)
        wins = [_win(trained, reference, same_text=new == old)
                for trained, reference, new, old in zip(trained_rewards, reference_rewards, trained_answers,
                                                        reference_answers)]
        verdicts = [{"reference": {"reward": reference}, "trained": {"reward": trained, "win": win}}
                    for reference, trained, win in zip(reference_rewards, trained_rewards, wins)]
        details = {"mean_reward": {"before": _mean(reference_rewards), "after": _mean(trained_rewards)},
                   "outcomes": {"wins": wins.count(1.0), "ties": wins.count(0.5), "losses": wins.count(0.0)}}
        chosen = [row.get("chosen") for row in rows]
        if rows and all(isinstance(answer, str) for answer in chosen):
            chosen_rewards = self.score(prompts, chosen)
            details["win_rate_vs_chosen"] = {
                "before": _mean([_win(r, c) for r, c in zip(reference_rewards, chosen_rewards)]),
                "after": _mean([_win(t, c) for t, c in zip(trained_rewards, chosen_rewards)])}
            for verdict, reward in zip(verdicts, chosen_rewards):
                verdict["reference"]["chosen_reward"] = verdict["trained"]["chosen_reward"] = reward
        return JudgeResult(self.metric, len(rows), 0.5 if rows else math.nan, _mean(wins), verdicts, details,
                           judge=self.name)


def load_function(spec: str) -> Callable:
    """`module:function` from the working directory or the Python path; JudgeError when it is not there."""
    module_name, _, name = spec.partition(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # the launch directory, where a user keeps their judge's module
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or the module's own code failing on import
        raise JudgeError(f"--judge {spec}: cannot import {module_name} ({type(error).__name__}: {error}); the module "
                         "must be importable from the launch directory or PYTHONPATH") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise JudgeError(f"--judge {spec}: {module_name} has no function {name!r}")
    return function


def names_a_reward_model(choice: str) -> bool:
    """--judge names a reward model (a path or Hub id): not auto, none, the embedded check or a module:function."""
    return choice not in ("auto", "none", EMBEDDED) and not FUNCTION_JUDGE.match(choice)


def judge_for(choice: str, dataset_name: str | None) -> Judge | None:
    """The judge --judge names: the embedded tasks' check, a user's function (module:function), a reward model (a
    path or Hub id); None for 'none' and for 'auto' on data no judge knows."""
    if choice == "none" or (choice == "auto" and dataset_name != EMBEDDED):
        return None
    if choice in ("auto", EMBEDDED):
        return ProgrammaticJudge(check_embedded_answer, metric="correct_and_preferred")
    if FUNCTION_JUDGE.match(choice):
        return ProgrammaticJudge(load_function(choice), metric="score", name=choice)
    return RewardModelJudge(choice)


def reward_scores(model, sequences: list[list[int]], pad_token_id: int, batch_size: int) -> list[float]:
    """The reward (the one output) of a sequence-classification model for each token sequence, in order."""
    import torch

    rewards = [math.nan] * len(sequences)
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for batch, input_ids, attention_mask in padded_batches(model, sequences, batch_size, pad_token_id, left=False):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            for index, value in zip(batch, logits[:, 0].float().cpu().tolist()):
                rewards[index] = value
    model.train(was_training)
    return rewards


def score_pairs(model, pairs: list[tuple[list[int], list[int]]], pad_token_id: int, batch_size: int,
                world) -> list[tuple[float, float]]:
    """(chosen reward, rejected reward) of each held-out (chosen ids, rejected ids) pair, every rank scoring its
    share; identical on every rank."""
    def score(share: list[tuple[list[int], list[int]]]) -> list[tuple[float, float]]:
        rewards = reward_scores(model, [ids for pair in share for ids in pair], pad_token_id, batch_size)
        return list(zip(rewards[0::2], rewards[1::2]))

    return map_across_ranks(pairs, score, world)


def pair_accuracy(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> JudgeResult:
    """A reward model judged on held-out preference pairs, before and after training: the fraction of pairs whose
    chosen answer it scores strictly above the rejected one (ties count as wrong, as in TRL's own accuracy; 0.5 is
    chance), and the mean margin (chosen - rejected reward)."""
    ranked_before = [float(chosen > rejected) for chosen, rejected in before]
    ranked_after = [float(chosen > rejected) for chosen, rejected in after]
    details = {"mean_margin": {"before": _mean([c - r for c, r in before]), "after": _mean([c - r for c, r in after])},
               "changes": _changes(ranked_before, ranked_after)}
    verdicts = [{"reference": {"chosen_reward": b[0], "rejected_reward": b[1]},
                 "trained": {"chosen_reward": a[0], "rejected_reward": a[1]}} for b, a in zip(before, after)]
    return JudgeResult("pair_accuracy", len(after), _mean(ranked_before), _mean(ranked_after), verdicts, details,
                       judge="the reward model itself, on held-out preference pairs")


def _win(reward: float, other: float, same_text: bool = False) -> float:
    """1 if `reward` beats `other`, 0.5 for a tie (or the very same answer), 0 otherwise."""
    if same_text or reward == other:
        return 0.5
    return 1.0 if reward > other else 0.0
