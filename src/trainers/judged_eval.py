"""Held-out prompts judged during training: the evaluation of an objective whose row sets `judged_eval` (GRPO), which
learns from prompts alone and so has no held-out loss. At the start and at each evaluation (--eval_steps), the first
--judged_eval_prompts validation prompts are answered greedily by the policy as it is and scored by --judge, as the
held-out answers before and after training are (src/pipeline/held_out.py's answer_held_out and record_samples: the
same rows, the same greedy generation, the same judge); the mean is logged as `eval_judged_reward` (--judge's
per-answer reward: the embedded checker's 3/1/0, a function's number, a reward model's score, so the measure GRPO's
verdict leads with), with `eval_judged_reward_sem` (its standard error over the prompts: the reward-hacking alert's
noise floor) and `eval_runtime` (its seconds).

The same on any number of processes: the prompts are split over the ranks, each answers and judges its share, and
the scores are gathered in prompt order (src/distributed.py's map_across_ranks). A judge that fails on any rank stops
every rank with its one line (the failure travels in the gather). The start's point reuses the answers judged
"before" when they are the same prompts (no extra generation); a resumed launch's start adds no point (the history
up to its checkpoint holds it)."""

from __future__ import annotations

import math
import statistics
import time

from src.distributed import World, map_across_ranks
from src.generation import generate
from src.judges import JudgeError
from src.objectives.spec import JUDGED_CURVE as CURVE  # metrics.jsonl's evaluation records; the best checkpoint's


def judge_rows(rows: list[dict]) -> list[dict]:
    """Prepared held-out rows as a judge reads them: the prompt as the data has it, its meta, its chosen answer."""
    return [{"prompt": row["judge_prompt"], "meta": row.get("meta") or {}, "chosen": row["sample_chosen"]}
            for row in rows]


class JudgedEval:
    """`measure(model)`: the mean (and its standard error) of --judge's scores of `model`'s greedy answers to `rows`
    (the held-out rows as src/pipeline/held_out.py's held_out_rows gives them), identical on every rank;
    `start_answers`: the starting model's answers to the same rows, already generated (the "before" answers), for
    the start's point."""

    def __init__(self, rows: list[dict], judge, tokenizer, max_new_tokens: int, batch_size: int, world: World,
                 start_answers: list[str] | None = None, tools=None):
        self.rows, self.judge, self.tokenizer, self.world = rows, judge, tokenizer, world
        self.tools = tools  # --tools: the answers are trajectories whose calls run (src/tools.py)
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.start_answers = start_answers

    def measure(self, model, answers: list[str] | None = None) -> tuple[float, float]:
        """The mean score and its standard error (the prompts' spread / sqrt(their count))."""
        def work(share: list[tuple[dict, str | None]]) -> list[dict]:
            texts = [answer for _, answer in share]
            if share and any(text is None for text in texts):
                texts = [answer["text"] for answer in generate(
                    model, self.tokenizer, [row["sample_prompt_ids"] for row, _ in share], self.max_new_tokens,
                    self.batch_size, details=True, tools=self.tools)]
            try:
                return [{"score": score} for score in self.judge.scores(judge_rows([row for row, _ in share]), texts)]
            except JudgeError as error:  # said by every rank, whichever rank's share it was in
                return [{"error": str(error)}] * len(share)

        judged = map_across_ranks(list(zip(self.rows, answers or [None] * len(self.rows))), work, self.world)
        failed = next((result["error"] for result in judged if "error" in result), None)
        if failed:
            raise JudgeError(f"the held-out prompts judged during training: {failed}")
        scores = [result["score"] for result in judged]
        if not scores:
            return math.nan, math.nan
        return statistics.fmean(scores), statistics.stdev(scores) / math.sqrt(len(scores)) if len(scores) > 1 else 0.0


class JudgedEvalMixin:
    """A trainer whose evaluation is its `judged_eval` (a JudgedEval, set after it is built): the start's point, then
    one per evaluation, logged as an evaluation record and shown to the callbacks (on_evaluate). Without one, no
    evaluation."""

    judged_eval: JudgedEval | None = None
    _evaluated = False

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        first, self._evaluated = not self._evaluated, True
        if self.judged_eval is None or (first and self.args.eval_on_start and self.state.global_step > 0):
            return {}  # no curve; or a resumed launch's start: its point is in the history up to the checkpoint
        with self.pause():  # the callbacks that keep time leave it out (src/trainers/base.py)
            started = time.perf_counter()
            reuse = self.judged_eval.start_answers if self.state.global_step == 0 else None
            value, error = self.judged_eval.measure(self.accelerator.unwrap_model(self.model), reuse)
            curve = CURVE.replace("eval", metric_key_prefix, 1)
            metrics = {curve: value, f"{curve}_sem": error,
                       f"{metric_key_prefix}_runtime": round(time.perf_counter() - started, 4)}
            was_training = self.model.training
            self.model.eval()  # TRL's log adds the mode's own metrics: the evaluation's (none), not the training's
            try:
                self.log(dict(metrics))
            finally:
                self.model.train(was_training)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
