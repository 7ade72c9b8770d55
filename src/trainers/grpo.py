"""GRPO's trainer: TRL's GRPOTrainer with the toolkit's additions, on the prompts src/data/ prepared (a `prompt`,
its `meta` for the judges, `prompt_ids` as generation sees them), with the toolkit's judges as reward functions.

What it changes in TRL's step, and why:
- Every answer is sampled from its own random stream, seeded by (seed, step, prompt row, answer number in its group)
  (src/generation.py's SeededSampling), not from each process's global generator: the answers, and so the rewards,
  advantages and loss, are the same whether a prompt's group was sampled on one process or split across several,
  and under any accumulation (TRL's own sampling differs with the number of processes: docs/grpo.md).
- The prompt ids are the prepared ones (the chat template with the generation prompt, as the held-out answers use).
- A judge that fails on any process (whatever it raises, a sys.exit, a non-number: src/judges.py turns each into a
  JudgeError) stops every process, with one line naming the judge and the prompt, after the rewards' gather (an error
  on one rank alone would leave the others waiting in that collective).

- Each step logs the seconds its sampling and its judging took (time/generation_s, time/judging_s) beside TRL's
  step_time.
- An evaluation answers held-out prompts greedily and judges them (JudgedEvalMixin: the judged held-out curve).
- The logged KL, entropy and clipped shares are means over the logging window's answer tokens (TRL's: a mean of
  micro-batch means), so they too are the same on any split.
- The training part of a step (TRL's loss code) reads nothing on the host: its metrics stay on the device until a log
  (src/trainers/device_metrics.py; TRL's reads 11.2 per micro-batch with the KL term: docs/speed.md). With
  `--use_adaptive_entropy` or `--top_entropy_quantile` below 1 TRL's code runs as shipped (its loss uses a value
  gathered from every process), its metric reads with it.

The TRL internals it overrides (_prepare_inputs, _generate_and_score_completions, _tokenize_prompts,
_generate_single_turn, _calculate_rewards, _compute_loss, log, _metrics) are listed in docs/development.md.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
from trl import GRPOTrainer

from src.distributed import any_rank, gather_objects
from src.engines import engine_record
from src.generation import Sampling, SeededSampling, answer_seed
from src.judges import FUNCTION_JUDGE, JudgeError, judge_for
from src.tools import sample_with_tools, summary
from src.run_safety import hang_watch
from src.trainers.base import ToolkitTrainerMixin, reference_is_the_base
from src.trainers.device_metrics import Max, Mean, MetricWindow, Min, Ratio
from src.trainers.judged_eval import JudgedEvalMixin

PROMPT_INDEX = "prompt_index"  # the train row a prompt came from: part of each answer's seed
SEED_SALT = "grpo-answers"  # apart from the rounds' streams (seed, round, row, answer) for the same seed
# TRL logs these as one mean per micro-batch (over every process's tokens), then averages the micro-batches of the
# logging window: under accumulation that weighs a micro-batch of few answer tokens like one of many, so the logged KL
# differs with the split of the global batch. Re-weighted here by each micro-batch's tokens (sequences for the clip
# ratios at sequence level): the mean over the window's tokens, the same on any split.
TOKEN_MEANS = ("kl", "entropy")
CLIP_MEANS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL logs the clipped shares of these loss types


def grpo_metric_window(trainer) -> MetricWindow | None:
    """What TRL 1.16's GRPOTrainer._compute_loss gathers and reduces for its training metrics, in its order, for this
    trainer's settings, kept on the device. None where TRL's loss itself uses a gathered value: the adaptive entropy
    bonus (its controller reads the window's entropy) and --top_entropy_quantile below 1 (a quantile over every
    process's entropies)."""
    if trainer.use_adaptive_entropy or trainer.top_entropy_quantile < 1.0:
        return None
    metrics: dict = {}
    if trainer._entropy_bonus_enabled:
        metrics["policy_loss"] = Mean("policy_loss")
    if trainer.aux_loss_enabled:
        metrics["aux_loss"] = Mean("aux_loss")
    means = (["kl"] if trainer.beta != 0.0 else []) + ["entropy"]
    means += {"cispo": ["cispo_clip_ratio"], "vespo": ["vespo/phi_seq_mean"]}.get(trainer.loss_type, [])
    if trainer.loss_type in CLIPPED_LOSSES:
        means += list(CLIP_MEANS)
    metrics |= {name: Ratio(f"{name}:sum", f"{name}:count") for name in means}
    gathered = [value for formula in metrics.values() for value in
                ((formula.value,) if isinstance(formula, Mean) else (formula.numerator, formula.denominator))]
    if trainer.loss_type in CLIPPED_LOSSES:
        metrics |= {"clip_ratio/low_min": Min("low_clipped"), "clip_ratio/high_max": Max("high_clipped")}
        gathered += ["low_clipped", "high_clipped"]
    return MetricWindow(tuple(gathered), metrics, "TRL's GRPOTrainer", lambda trainer: trainer._metrics,
                        kept=("entropy_coef",))


class JudgeReward:
    """A toolkit judge as a TRL reward function: `reward(prompts, completions, meta=..., **columns)` → one number per
    answer, higher is better (the judge's `scores`: its verdict's "reward" where it ranks more finely than its score).
    TRL logs each reward function's mean and spread under `rewards/<name>/`. A judge that fails (a JudgeError: the judge
    raises nothing else) is recorded (`error`) and gives NaN; the trainer stops every process on it after the rewards'
    gather."""

    def __init__(self, judge, name: str):
        self.judge = judge
        self.__name__ = name  # TRL's name for the reward function: its curves' key
        self.error: str | None = None
        self.turn_rewards: list | None = None  # the last call's per-turn scores (a judge that gives them: --turn_credit)

    def __call__(self, prompts, completions, meta=None, **columns) -> list[float]:
        metas = meta if meta is not None else [None] * len(prompts)
        rows = [{"prompt": prompt, "meta": row_meta or {}} for prompt, row_meta in zip(prompts, metas)]
        answers = [answer[-1]["content"] if isinstance(answer, list) else answer for answer in completions]
        if columns.get("trajectory") is not None:  # --tools: the whole trajectory, its turns apart (src/tools.py)
            answers = list(columns["trajectory"])
        self.turn_rewards = None
        try:
            if hasattr(self.judge, "scores_and_turns"):
                scores, self.turn_rewards = self.judge.scores_and_turns(rows, answers)
                return [float(score) for score in scores]
            return [float(score) for score in self.judge.scores(rows, answers)]
        except JudgeError as error:
            self.error = self.error or str(error)
            return [math.nan] * len(prompts)


def reward_name(choice: str) -> str:
    """A judge's name in the curves: the embedded checker's, a function's `module.function`, a reward model's folder."""
    if FUNCTION_JUDGE.match(choice):
        return choice.replace(":", ".")
    return choice.rstrip("/").rsplit("/", 1)[-1] if choice not in ("auto",) else "embedded"


def judge_rewards(choices: list[str], dataset_name: str | None) -> list[JudgeReward]:
    """The judges --rewards (else --judge) names, each a reward function; built on every process."""
    rewards = []
    for choice in choices:
        judge = judge_for(choice, dataset_name)
        if judge is None:
            raise JudgeError(f"--rewards {choice}: no judge for {dataset_name}; name one: embedded, module:function, "
                             "or a reward model's path or Hub id")
        rewards.append(JudgeReward(judge, reward_name(choice)))
    return rewards


def answer_numbers(prompt_rows: list[int], rank: int) -> list[int]:
    """Each of this rank's answers' number within its prompt's group, counted over the whole generation batch in rank
    order (the order TRL gathers the rewards in to form the groups): 0..num_generations-1 wherever it is sampled."""
    everyone = [rows for (rows,) in gather_objects([prompt_rows])]
    seen: dict[int, int] = {}
    numbers = []
    for rows in everyone:
        for row in rows:
            numbers.append(seen.get(row, 0))
            seen[row] = numbers[-1] + 1
    start = sum(len(rows) for rows in everyone[:rank])
    return numbers[start:start + len(prompt_rows)]


@contextlib.contextmanager
def reference_handed_in(reference):
    """GRPOTrainer takes no reference model: with the KL term (--beta > 0) and no adapters, its `__init__` loads the
    starting model again itself (`create_model_from_path`, whole on every rank, before the engine shards it). Given
    one (the starting model loaded by the toolkit, each rank reading its share), TRL's `__init__` is handed that one
    where it would load its own, and does with it all it does with its own: dropout off, its fused LM head, prepared by
    the engine (FSDP2: already sharded, kept; ZeRO-3: its inference engine)."""
    if reference is None:
        yield
        return
    from trl.trainer import grpo_trainer

    own = grpo_trainer.create_model_from_path

    def loaded(model_id, *args, **kwargs):  # the starting model's path, as TRL asks for its reference
        return reference if model_id == reference.name_or_path else own(model_id, *args, **kwargs)

    grpo_trainer.create_model_from_path = loaded
    try:
        yield
    finally:
        grpo_trainer.create_model_from_path = own


class PreparedGRPOTrainer(JudgedEvalMixin, ToolkitTrainerMixin, GRPOTrainer):
    """GRPOTrainer on prepared prompts, answers sampled from per-answer seeded streams, judges as rewards; its
    evaluations judge held-out prompts (src/trainers/judged_eval.py), not TRL's sampled-answer loss."""

    tool_session = None  # src/tools.py ToolSession with --tools: set with use_tools

    def use_tools(self, session) -> None:
        """Sample through tool trajectories (rollout_with_tools) from now on."""
        self.tool_session = session
        self.rollout_func = self.rollout_with_tools

    def __init__(self, *args, train_dataset=None, reward_judges: tuple[list[str], str | None] | None = None,
                 ref_model=None, **kwargs):
        """`ref_model`: the reference of the KL term (--beta > 0) when the toolkit loaded it (under FSDP2 and ZeRO-3,
        each rank reading its share: src/pipeline/training.py), which TRL then uses instead of loading its own
        (`reference_handed_in`)."""
        if reward_judges is not None:  # the row's trainer_inputs: (the judges' names, the dataset they judge)
            kwargs["reward_funcs"] = judge_rewards(*reward_judges)
        if train_dataset is not None and PROMPT_INDEX not in train_dataset.column_names:
            train_dataset = train_dataset.add_column(PROMPT_INDEX, list(range(len(train_dataset))))
        self._generation_inputs: list[dict] = []
        self._micro_batch: dict = {}
        self._micro_batch_weights: dict[str, list[torch.Tensor]] = {}  # per mode: [tokens, sequences] per micro-batch
        # TRL copies a model's adapters into a reference adapter only for the KL term
        adapted = kwargs.get("model") if kwargs["args"].beta != 0.0 else None
        with reference_handed_in(ref_model), reference_is_the_base(adapted, ref_model):
            super().__init__(*args, train_dataset=train_dataset, **kwargs)
        self.metric_window = grpo_metric_window(self)

    def get_train_dataloader(self):
        # GRPO gives a prompt to several processes by design (its answers may be sampled on each): the one-job check's
        # "no row on two ranks in a step" does not apply, so its hook is not given this loader (the weights are still
        # compared at the end).
        return GRPOTrainer.get_train_dataloader(self)

    def _prepare_inputs(self, generation_batch):
        self._micro_batch = super()._prepare_inputs(generation_batch)
        return self._micro_batch

    def micro_batch_seen(self, inputs):
        """The micro-batch trained: each prompt followed by its sampled answer (what the forward computed)."""
        batch = self._micro_batch
        return {"input_ids": torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
                "attention_mask": torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)}

    turn_credit = 0.0  # --turn_credit: the weight of the per-turn advantage (0: the trajectory's reward alone)

    def _generate_and_score_completions(self, inputs):
        self._generation_inputs = inputs  # the prepared rows: their prompt ids and train row numbers
        output = super()._generate_and_score_completions(inputs)
        if self.turn_credit and "tool_mask" in output:
            output["advantages"] = self._with_turn_credit(output)
        return output

    def _with_turn_credit(self, output: dict) -> torch.Tensor:
        """Per-token advantages (B, T), which TRL's loss takes as given: each token of turn t of answer i gets
            A_i + w * (r_it - mean_g r) / (std_g r + 1e-4)
        where A_i is TRL's advantage of the trajectory's reward, r_it the judge's score of that turn (its verdict's
        `turn_rewards`), mean_g and std_g (unbiased, as TRL's) over every turn of every answer to the same prompt (its
        group, gathered from every process), and w --turn_credit. A turn is a run of the model's own tokens (the tool
        results between them are masked anyway). Answers whose judge gave no turn scores keep A_i."""
        local = [None] * len(output["advantages"])
        for reward in self.reward_funcs:  # the first judge that gives turn scores
            if getattr(reward, "turn_rewards", None):
                local = reward.turn_rewards
                break
        everyone = [turns for (share,) in gather_objects([local]) for turns in share]
        groups = self.num_generations if self.model.training else self.num_generations_eval
        turn_advantage: list[list[float] | None] = []
        for start in range(0, len(everyone), groups):
            group = everyone[start:start + groups]
            values = [value for turns in group if turns for value in turns]
            mean = sum(values) / len(values) if values else 0.0
            spread = math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1)) if len(values) > 1 \
                else 0.0
            turn_advantage += [[(value - mean) / (spread + 1e-4) for value in turns] if turns else None
                               for turns in group]
        start = self.accelerator.process_index * len(local)
        mine = turn_advantage[start:start + len(local)]
        advantages = output["advantages"].unsqueeze(1).repeat(1, output["completion_ids"].size(1)).float()
        written = (output["tool_mask"] * output["completion_mask"]).tolist()
        for row, (mask, turns) in enumerate(zip(written, mine)):
            if not turns:
                continue
            turn = -1
            for position, (token, before) in enumerate(zip(mask, [0] + mask[:-1])):
                if token and not before:
                    turn += 1
                if token and turn < len(turns):
                    advantages[row, position] += self.turn_credit * turns[turn]
        return advantages

    def _tokenize_prompts(self, prompts: list):
        return [list(row["prompt_ids"]) for row in self._generation_inputs], None, {}

    def _answer_seeds(self) -> list[int]:
        """Each answer's seed: (seed, step, prompt row, answer number), the same on any number of processes (a
        collective: every process asks once per generation batch)."""
        rows = [int(row.get(PROMPT_INDEX, -1)) for row in self._generation_inputs]
        numbers = answer_numbers(rows, self.accelerator.process_index)
        return [answer_seed(self.args.seed, SEED_SALT, self.state.global_step, row, number)
                for row, number in zip(rows, numbers)]

    def _generate_single_turn(self, *args, **kwargs):
        with hang_watch.phase("generation", f"step {self.state.global_step + 1}'s answers"):
            return self._seeded_single_turn(*args, **kwargs)

    def _seeded_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Each answer from its own stream seeded by (seed, step, prompt row, answer number): greedy decoding of the
        logits plus per-row Gumbel noise (SeededSampling), as the on-policy rounds sample."""
        return self._sampled(prompt_ids, self._answer_seeds(), self.max_completion_length), None

    def _sampled(self, prompt_ids: list[list[int]], seeds: list[int], max_new_tokens: int) -> list[list[int]]:
        """Each prompt's answer (ids up to and including its first end token, as TRL keeps them), from its seed."""
        from transformers import GenerationConfig, LogitsProcessorList
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        started = time.perf_counter()
        device = self.accelerator.device
        sampling = Sampling(self.temperature, self.top_p, self.top_k or 0)
        generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                      pad_token_id=self._tokenizer.pad_token_id, eos_token_id=self.eos_token_ids,
                                      repetition_penalty=self.repetition_penalty,
                                      cache_implementation=self.args.cache_implementation, disable_compile=True)
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        attention_mask = pad([torch.ones_like(ids) for ids in prompts], padding_value=0, padding_side="left").to(device)
        with (unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                          gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                          gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs)
              as unwrapped_model, torch.no_grad()):
            output = unwrapped_model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=generation,
                logits_processor=LogitsProcessorList([SeededSampling(seeds, sampling, device)]))
        self._note_seconds("time/generation_s", started)
        completions = output[:, input_ids.size(1):].cpu()
        answers = []
        for row in completions.tolist():  # up to and including the first end token, as TRL keeps them
            end = next((index for index, token in enumerate(row) if token in self.eos_token_ids), len(row) - 1)
            answers.append(row[:end + 1])
        return answers

    def rollout_with_tools(self, prompts, trainer=None) -> dict:
        """TRL's `rollout_func` with --tools: each answer a trajectory (src/tools.py), every turn from the answer's
        seed and the turn, the tool results masked from the loss (TRL's `env_mask`); the judges read the whole
        trajectory, and its tool record (`tool_record`: calls, valid calls, errors, turns) as a column. Tool use is
        logged as tools/* means over the generation batch's answers, every process's."""
        prompt_ids, _, _ = self._tokenize_prompts(prompts)
        seeds = self._answer_seeds()

        def sample(indices, contexts, turn, budgets):
            if not indices:  # ZeRO-3: this process is done, its peers are not; it joins their generate (discarded)
                self._sampled([prompt_ids[0][-1:]], [0], 1)
                return []
            written = self._sampled(contexts, [answer_seed(seeds[index], "turn", turn) for index in indices],
                                    max(budgets))
            return [ids[:budget] for ids, budget in zip(written, budgets)]

        # Under ZeRO-3 every generate call is a collective (the parameters gathered): the processes agree on each turn.
        zero3 = engine_record(self.accelerator).get("zero_stage") == 3
        trajectories = sample_with_tools(sample, self._tokenizer, prompt_ids, self.tool_session,
                                         self.max_completion_length, set(self.eos_token_ids),
                                         keep_sampling=(lambda going: any_rank(going)[0]) if zero3 else None)
        # Over the whole generation batch (every process's answers), so the logged tool use is the same on any split.
        used = summary([trajectory for (share,) in gather_objects([trajectories]) for trajectory in share])
        mode = "train" if self.model.training else "eval"
        for key in ("calls_per_answer", "turns_per_answer"):
            self._metrics[mode][f"tools/{key}"].append(used[key])
        self._metrics[mode]["tools/errors_per_answer"].append(sum(used["errors"].values()) / max(1, used["answers"]))
        return {"prompt_ids": prompt_ids, "completion_ids": [trajectory.ids for trajectory in trajectories],
                "logprobs": None, "env_mask": [trajectory.mask for trajectory in trajectories],
                "tool_record": [trajectory.record() for trajectory in trajectories],
                "trajectory": [trajectory.text(self._tokenizer) for trajectory in trajectories]}

    def _note_seconds(self, key: str, started: float) -> None:
        """Seconds of a phase of the step on this process (rank 0's are logged): where a step's time goes, beside
        TRL's step_time (the whole step: sampling, judging and training)."""
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][key].append(time.perf_counter() - started)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        # The tokens TRL's KL and entropy means run over: with --tools, the model's own (tool results masked).
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        # this rank's answer tokens and answers, summed over the ranks and read when logged (no read per step)
        self._micro_batch_weights.setdefault(mode, []).append(torch.stack([mask.sum().double(),
                                                                           mask.new_tensor(mask.size(0)).double()]))
        if mode != "train" or self.metric_window is None:
            return super()._compute_loss(model, inputs)
        with self.metric_window.recording(self):
            return super()._compute_loss(model, inputs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        if self.metric_window is not None:
            self.metric_window.flush(self)  # the training metrics, kept on the device since the last log
        counts = self._micro_batch_weights.pop(mode, [])
        weights = self.accelerator.reduce(torch.stack(counts), reduction="sum").tolist() if counts else []
        metrics = self._metrics[mode]
        for key in TOKEN_MEANS + CLIP_MEANS:
            values = metrics.get(key)
            if not values or len(values) != len(weights):
                continue
            by_sequence = key in CLIP_MEANS and self.args.importance_sampling_level == "sequence"
            counts = [sequences if by_sequence else tokens for tokens, sequences in weights]
            pairs = [(value, count) for value, count in zip(values, counts) if not math.isnan(value)]
            total = sum(count for _, count in pairs)
            if total > 0:
                metrics[key] = [sum(value * count for value, count in pairs) / total]
        super().log(logs, start_time)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        started = time.perf_counter()
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # gathered: all ranks
        self._note_seconds("time/judging_s", started)
        local = next((reward.error for reward in self.reward_funcs if getattr(reward, "error", None)), None)
        failed = next((error for (error,) in gather_objects([local]) if error), None)
        if failed:
            raise JudgeError(f"step {self.state.global_step + 1}: {failed}")
        return rewards
