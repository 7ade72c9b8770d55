"""GRPO: reinforcement learning from the judges' rewards, on-policy every step (Shao et al. 2024, arXiv 2402.03300),
through TRL's GRPOTrainer (src/trainers/grpo.py). Each step the policy answers every prompt of the batch
`num_generations` times (transformers' generate, each answer from its own seeded stream), the judges (--rewards, else
--judge: the embedded checker, `module:function`, a reward model) score every answer, and each answer's advantage is
its reward against its prompt's group. `--stage grpo`, `--stage sft_then_grpo`, `--stage sft_then_dpo_then_grpo`
(SFT, DPO on the pairs, then GRPO on the prompts from the DPO model); docs/grpo.md.

The batch counts answers: --batch_size 32 with --num_generations 8 is 4 prompts per step."""

from __future__ import annotations

from src.config_error import ConfigError
from src.objectives.spec import (PROMPTS, TRL_CHOICES, Advice, Chart, Curve, MemoryPlan, Metric, Objective, Panel,
                                 Report, SummaryNumber, Training)
from src.reporting.formatting import format_number

# TRL's GRPOConfig defaults where a toolkit flag of the same name has none (--beta: the row's default_beta): GRPO's KL
# weight is 0 (no reference model) unless asked for; its loss, TRL's dapo (normalised over the global batch's answer
# tokens) unless asked for (the row's loss_types: src/config_parse.py `resolve_loss_type`; bnpo is a token mean per
# micro-batch: its step depends on how the global batch is split into processes x accumulation, docs/grpo.md). The
# answer length is the held-out answers' (--max_new_tokens, as the rounds sample).
DEFAULT_NUM_GENERATIONS = 8
DEFAULT_BETA = 0.0


def num_generations_of(config) -> int:
    return int(config.trl_overrides.get("num_generations", DEFAULT_NUM_GENERATIONS))


def beta_of(config) -> float:
    return config.dpo.beta  # the row's default_beta unless given (src/config_parse.py)


def loss_type_of(config) -> str:
    """GRPOConfig's loss_type: --loss_type as the config was parsed, one of GRPOConfig's declared choices or its default
    (src/config_parse.py `resolve_loss_type`: a DPO recipe's loss run with --stage grpo does not apply)."""
    return config.dpo.loss_type[0]


def trl_settings(config, overrides: dict, extras: dict) -> tuple[dict, dict]:
    specific = {"beta": beta_of(config), "loss_type": loss_type_of(config),
                "max_completion_length": config.training.max_new_tokens,
                # The toolkit keeps the prepared columns (meta for the judges, prompt_ids as generation sees them).
                "remove_unused_columns": False}
    return specific, overrides


def judges_of(config) -> list[str]:
    """The judges whose scores are the rewards: --rewards, else --judge."""
    return list(config.training.rewards) or [config.training.judge]


def trainer_inputs(config) -> dict:
    """The judges the trainer turns into its reward functions (src/trainers/grpo.py `judge_rewards`: they load torch,
    a reward model its weights), named here and built there."""
    return {"reward_judges": (judges_of(config), config.data.dataset_name)}


def memory_setup(config) -> dict:
    """check_gpu's view of a GRPO step: a sequence is a prompt (kept under --max_length) and its answer; sampling keeps
    a KV cache for as many; a reference copy only with the KL term (--beta > 0); the judges (its time estimate)."""
    answer = int(config.trl_overrides.get("max_completion_length", config.training.max_new_tokens))
    tokens = config.data.max_length + answer
    return {"max_length": tokens, "generation_tokens": tokens, "reference_kept": beta_of(config) > 0,
            "precompute_ref_log_probs": False, "generation_steps": config.trl_overrides.get("steps_per_generation"),
            "answer_tokens": answer, "judges": tuple(judges_of(config))}


def validate(config) -> None:
    overrides = config.trl_overrides
    for flag in ("use_vllm", "use_transformers_continuous_batching", "use_transformers_paged"):
        if overrides.get(flag):
            raise ConfigError(f"--{flag}: the toolkit's GRPO generates through transformers' generate, each answer "
                              "from its own seeded stream (the same answers on any number of processes): drop the flag")
    if overrides.get("min_p") is not None:
        raise ConfigError("--min_p: per-answer seeded sampling (src/generation.py) draws with temperature, top_p and "
                          "top_k; drop --min_p")
    weights = overrides.get("reward_weights")
    judges = judges_of(config)
    if weights is not None and len(weights) != len(judges):
        raise ConfigError(f"--reward_weights has {len(weights)} weight(s) for {len(judges)} judge(s) "
                          f"({', '.join(judges)}): give one weight per judge of --rewards, in its order")
    if num_generations_of(config) < 2:
        raise ConfigError(f"--num_generations {num_generations_of(config)}: GRPO's advantage is an answer's reward "
                          "against its prompt's other answers: at least 2")


def nearest_divisible(batch: int, divisor: int) -> list[int]:
    """The nearest batch sizes below and above `batch` that `divisor` divides (below only when above zero)."""
    below = batch - batch % divisor
    return [size for size in (below, below + divisor) if size > 0]


def preflight(name: str, staged, plan, world_size: int) -> str | None:
    """A generation batch that `num_generations` does not divide: TRL groups each prompt's answers in it."""
    generations = num_generations_of(staged)
    steps = staged.trl_overrides.get("steps_per_generation") or plan.gradient_accumulation_steps
    generation_batch = staged.trl_overrides.get("generation_batch_size") or \
        plan.per_device_batch_size * plan.world_size * steps
    if generation_batch % generations:
        sizes = " or ".join(str(size) for size in nearest_divisible(plan.global_batch_size, generations))
        return (f"--num_generations {generations} does not divide the batch of {generation_batch} answers "
                f"({plan.per_device_batch_size} per process x {plan.world_size} processes x {steps} steps): every "
                f"prompt is answered {generations} times in one batch; use --batch_size {sizes}, or another "
                "--num_generations")
    return None


def warnings(config) -> list[str]:
    """Settings whose step depends on how the global batch is split into processes x accumulation (TRL averages them
    per micro-batch): the run trains, but not to the same numbers on another number of processes."""
    found = []
    if loss_type_of(config) == "bnpo":
        found.append("--loss_type bnpo averages over each micro-batch's tokens, so its step differs with the number "
                     "of processes and accumulation steps (dapo normalises over the global batch's tokens: the same "
                     "step on any split)")
    if float(config.trl_overrides.get("entropy_coef", 0.0)) or config.trl_overrides.get("use_adaptive_entropy"):
        found.append("the entropy bonus (--entropy_coef, --use_adaptive_entropy) is TRL's mean over each "
                     "micro-batch's tokens, so the step differs with the number of processes and accumulation steps")
    return found


def run_info(config, data_settings: dict) -> dict:
    overrides = config.trl_overrides
    return {"beta": beta_of(config), "loss_type": loss_type_of(config),
            "num_generations": num_generations_of(config), "rewards": judges_of(config),
            "reward_weights": overrides.get("reward_weights"), "temperature": float(overrides.get("temperature", 1.0)),
            "max_completion_length": int(overrides.get("max_completion_length", config.training.max_new_tokens))}


def loss_rows(info: dict) -> list[tuple[str, str]]:
    weights = info.get("reward_weights") or [1.0] * len(info.get("rewards") or [])
    rewards = ", ".join(f"{name} x {format_number(weight)}" for name, weight in zip(info.get("rewards") or [], weights))
    return [("loss type", str(info.get("loss_type"))), ("beta (KL weight)", format_number(info.get("beta"))),
            ("answers per prompt", str(info.get("num_generations"))), ("rewards", rewards)]


def setup_line(info: dict) -> str:
    return "; ".join(f"{name} {value}" for name, value in loss_rows(info))


OBJECTIVE = Objective(
    name="grpo",
    help="GRPO from prompts: the judges' scores of sampled answers as rewards (docs/grpo.md)",
    data_shape=PROMPTS,
    example_word="answers",
    causal_lm=True,
    ends_pipeline=True,
    pipeline_after=("dpo",),
    embedded_data="prompts",
    training=Training(
        trl_config="trl:GRPOConfig",
        trainer="src.trainers.grpo:PreparedGRPOTrainer",
        default_learning_rate=1e-6,
        default_beta=DEFAULT_BETA,
        loss_types=TRL_CHOICES,
        # TRL keeps a reference model only with --beta > 0 (the KL term); its default beta is 0
        needs_reference=False,
        rewards_from_judges=True,
        judged_eval=True,
        beta_may_be_zero=True,
        trl_settings=trl_settings,
        trainer_inputs=trainer_inputs,
        validate=validate,
        preflight=preflight,
    ),
    memory=MemoryPlan(
        sequences_per_example=1,
        sequences_with_grad=1,
        memory_setup=memory_setup,
    ),
    report=Report(
        judged_headline="mean_reward",
        charts=(
            Chart("loss.png", "GRPO loss", (
                Panel("GRPO loss (clipped policy-gradient surrogate + β·KL)", "loss", (Curve("loss", "loss"),),
                      min_y_span=0.05),)),
            Chart("rewards.png", "Rewards per judge", (
                Panel("Reward (the judges' weighted sum)", "reward",
                      (Curve("reward", "mean over the batch's answers", "#2ca02c"),
                       Curve("reward_std", "spread (std)", "#9467bd")), min_y_span=0.2),
                Panel("Train reward, and held-out prompts judged in training", "reward",
                      (Curve("reward", "train reward", "#2ca02c"),
                       Curve("judged_reward", "held-out prompts, greedy, --judge", "#d62728")), min_y_span=0.2,
                      shown_when=("judged_reward", 1)),
                Panel("Reward per judge: mean", "reward", (), per_logged_key=("rewards/*/mean", "mean"),
                      min_y_span=0.2, shown_when=("rewards/*/mean", 2)),
                Panel("Reward per judge: spread (std)", "reward", (), per_logged_key=("rewards/*/std", "std"),
                      min_y_span=0.2, shown_when=("rewards/*/std", 2)),)),
            Chart("groups.png", "Groups whose answers all score the same", (
                Panel("Prompts whose answers all score the same (no advantage: they teach nothing)",
                      "fraction of prompts", (Curve("frac_reward_zero_std", "tied groups", "#d62728"),),
                      ylim=(-0.02, 1.04)),)),
            Chart("policy.png", "KL, entropy and clipping", (
                Panel("KL to the reference (needs --beta > 0)", "nats / token", (Curve("kl", "KL"),), min_y_span=0.01),
                Panel("Entropy of the policy on its answers", "nats / token", (Curve("entropy", "entropy", "#ff7f0e"),),
                      min_y_span=0.1),
                Panel("Clipped tokens (0 if --num_iterations 1)", "fraction of tokens",
                      (Curve("clip_ratio/region_mean", "clipped"),), ylim=(-0.02, 1.04)),)),
            Chart("answers.png", "Answer length", (
                Panel("Answer length", "tokens", (Curve("completions/mean_length", "mean"),
                                                  Curve("completions/mean_terminated_length", "mean, ended answers",
                                                        "#2ca02c")), y_from_zero=True),
                Panel("Answers cut at --max_completion_length", "fraction of answers",
                      (Curve("completions/clipped_ratio", "cut"),), ylim=(-0.02, 1.04)),)),
            Chart("step_time.png", "Where a step's time goes", (
                Panel("Seconds per step (rank 0)", "seconds",
                      (Curve("step_time", "step"), Curve("time/generation_s", "sampling", "#ff7f0e"),
                       Curve("time/judging_s", "judging", "#2ca02c")), y_from_zero=True),)),
        ),
        compare_metrics=(
            Metric("loss", "GRPO loss", "loss"),
            Metric("reward", "Reward (weighted sum of the judges)", "reward"),
            Metric("frac_reward_zero_std", "Prompts whose answers all score the same", "fraction of prompts"),
            Metric("entropy", "Entropy", "nats / token"),
            Metric("completions/mean_length", "Answer length", "tokens"),
        ),
        summary_numbers=(SummaryNumber("reward", "reward", "final reward", headline="reward"),
                         SummaryNumber("tied_groups", "frac_reward_zero_std", "final share of tied groups",
                                       percent=True),
                         SummaryNumber("entropy", "entropy", "final entropy"),
                         SummaryNumber("answer_length", "completions/mean_length", "final answer length")),
        alerts=("grpo_entropy_collapse", "grpo_groups_tied", "grpo_length_runaway", "grpo_reward_hacking"),
        run_info=run_info,
        loss_rows=loss_rows,
        setup_line=setup_line,
    ),
    advice=Advice(
        console_keys=("eval_judged_reward", "reward", "reward_std", "frac_reward_zero_std", "entropy", "kl",
                      "completions/mean_length"),
        warnings=warnings,
    ),
)
