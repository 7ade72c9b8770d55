"""What a row of the objectives' table holds (src/objectives/__init__.py reads the rows).

An objective declares, as data, what the rest of the toolkit needs from it: what it is (the data it takes, the word for
its examples, causal LM or not, its place in pipelines) and, grouped by who reads them, what TRL needs (`Training`:
its config and trainer, the reference model, beta), its memory-plan terms (`MemoryPlan`), what its pages show
(`Report`: curves, summary numbers, alerts and audit parts, the model card) and what the console and the advice say
(`Advice`: console keys, warnings, remedies). The launcher, data preparation, check_gpu, the report, compare, the
model card, the index and the audit read these fields (`row.report.charts`); none of them decides by an objective's
name (tests/test_objectives.py keeps it so). Light: no torch, no TRL, no matplotlib.
"""

from __future__ import annotations

from src.config_error import ConfigError

from collections.abc import Callable
from dataclasses import dataclass, field

# The data an objective trains on, as preparation makes it (src/data/): what its rows hold after tokenization.
PAIRS = "pairs"  # prompt, chosen, rejected: prompt and answers tokenized apart (DPO's layout, TRL's)
SCORED_PAIRS = "scored_pairs"  # prompt + chosen and prompt + rejected as two whole sequences (a reward model's)
UNPAIRED = "unpaired"  # prompt, completion, thumbs up or down (KTO's)
SEQUENCES = "sequences"  # one sequence to imitate (SFT's)
# prompts alone (text or chat, an optional `meta` the judges read): GRPO trains on them, answering each every step;
# on-policy rounds answer them to make pairs (src/rounds.py)
PROMPTS = "prompts"
PAIRED_SHAPES = (PAIRS, SCORED_PAIRS)  # the shapes read from prompt / chosen / rejected data

# The fields a reference-free objective on pairs shares (SimPO, ORPO: no reference model, a causal LM, chosen
# and rejected forwarded with gradients, TRL's default learning rate for their configs, the packed forward:
# src/trainers/legacy_pairs.py, proven against their padded one in tests/test_packed_objectives.py), by group.
REFERENCE_FREE_PAIRS = dict(data_shape=PAIRS, example_word="pairs", causal_lm=True)
REFERENCE_FREE_TRAINING = dict(default_learning_rate=1e-6, needs_reference=False, truncates_to_max_length=True,
                               packed_forward=True)
REFERENCE_FREE_MEMORY = dict(sequences_per_example=2, sequences_with_grad=2, reference_free=True)
REFERENCE_FREE_REPORT = dict(alerts=("dpo_saturated",), audit_parts=("judged",),
                             reference_unmeasured="none: a reference-free objective trains without one (how the "
                             "starting model ranks the training pairs: `python -m src.audit` with "
                             "--model_name_or_path, on a sample).")

TRAIN_COLOR = "#1f77b4"
# The judged held-out curve of an objective whose row sets `judged_eval` (src/trainers/judged_eval.py logs it)
JUDGED_CURVE = "eval_judged_reward"
REFERENCE_FLAGS = ("precompute_ref_log_probs",)  # the toolkit's flags that ask for a reference model
# A row's `loss_types`: the values its TRL config declares for `loss_type` (src/objectives/trl_field_names.json)
TRL_CHOICES = "the values its TRL config declares"


@dataclass(frozen=True)
class Curve:
    key: str  # train metric; its eval counterpart is "eval_" + key
    label: str
    color: str = TRAIN_COLOR
    smooth: bool = True  # False for exact quantities such as the learning-rate schedule


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    curves: tuple[Curve, ...]
    reference_lines: tuple[tuple[float, str], ...] = ()  # (y, legend label)
    ylim: tuple[float, float] | None = None
    log_when_wide: bool = False  # log y axis when the values span more than two decades
    # Smallest y range shown: a flat curve (a stuck run) then looks flat instead of its noise being blown up.
    min_y_span: float | None = None
    y_from_zero: bool = False  # for quantities read as "how much" (throughput, memory)
    # (training_info.json key, legend label): a reference line at the run's own setting (SimPO's target margin gamma)
    info_lines: tuple[tuple[str, str], ...] = ()
    # (pattern, label): one curve per logged key the fnmatch pattern matches, labelled by what its "*" stands for
    # (GRPO's "rewards/*/mean": a curve per judge), after `curves`
    per_logged_key: tuple[str, str] | None = None
    # (pattern, n): drawn only when at least n logged keys match the fnmatch pattern: a panel that would repeat
    # another's one curve (GRPO's per-judge panels with one judge; its held-out panel with no judged evaluation)
    shown_when: tuple[str, int] | None = None


@dataclass(frozen=True)
class Chart:
    filename: str
    caption: str
    panels: tuple[Panel, ...]


# How often the chosen answer's reward beats the rejected one's: every pair objective's (DPO, SimPO, ORPO)
REWARD_ACCURACY_CHART = Chart("reward_accuracy.png", "Reward accuracy", (
    Panel("Reward accuracy (chosen > rejected)", "accuracy (fraction of pairs)",
          (Curve("rewards/accuracies", "reward accuracy"),), reference_lines=((0.5, "chance"),), ylim=(-0.02, 1.04)),))


@dataclass(frozen=True)
class Metric:
    """A curve compare.md overlays across runs (src/reporting/compare.py)."""
    key: str
    title: str
    ylabel: str
    second: tuple[str, str] | None = None  # (key, label) drawn dashed on the same axes, e.g. rejected under chosen
    first_label: str = ""
    reference: tuple[float, str] | None = None


@dataclass(frozen=True)
class SummaryNumber:
    """A final number of a run: `final_<name>_train` / `final_<name>_eval` in the summary (src/reporting/summary.py),
    read from the last logged `metric` / `eval_<metric>`; a row `<label> (train / eval)` in report.md."""
    name: str
    metric: str
    label: str
    percent: bool = False
    headline: str = ""  # its name in report.md's first sentence when no judge ran ("" = not there)


def refuse_reference_flags(title: str, config) -> None:
    """A reference-free objective asked for a reference model by flag: one line, naming the flag."""
    for name in REFERENCE_FLAGS:
        if config.sources.get(name, "").startswith("--"):
            raise ConfigError(f"--{name}: {title} has no reference model (it is reference-free): drop the flag")


def refuse_batch_rebalance(name: str, staged, plan, world_size: int) -> str | None:
    """TRL's preference trainers gather their metrics across processes per micro-batch: equal sizes only."""
    if world_size > 1 and staged.trl_overrides.get("train_sampling_strategy") == "batch_rebalance":
        return ("--train_sampling_strategy batch_rebalance gives the ranks micro-batches of different sizes, which "
                f"TRL's {name.upper()} metrics cannot gather across processes: use group_by_length")
    return None


@dataclass(frozen=True)
class Training:
    """What TRL needs: the config and trainer a stage builds, and what the launch resolves or refuses for them."""
    trl_config: str  # "module:Class" of its TRL config (imported when a run builds it: trl costs seconds)
    trainer: str  # "module:Class" of the toolkit's trainer (src/trainers/)
    default_learning_rate: float  # TRL's default for the config (tests/test_config.py checks it against TRL's)
    needs_reference: bool  # keeps a reference model (none with adapters or cached reference log-probs)
    truncates_to_max_length: bool = False  # prompt + answer cut to --max_length (else a pair over it is dropped)
    # The toolkit's packed, prefix-shared forward serves it (src/packed_dpo.py; the model allow-list of
    # src/packed_dpo_support.py): its trainer builds it (`forward_for`), the launch checks the model before preparation
    packed_forward: bool = False
    # It trains a vision-language model on image + text data (src/vision.py; proven in tests/test_vision.py): a VLM
    # given to any other objective is refused before launch (src/input_checks.py check_vision_model)
    takes_images: bool = False
    # Its rewards are the judges' scores (--rewards, else --judge): a launch with no judge is refused as the config is
    # parsed (src/config_checks.py), and its trainer gets the judges as reward functions (`trainer_inputs`)
    rewards_from_judges: bool = False
    # Its evaluations judge held-out prompts (--judged_eval_prompts of the validation split, answered greedily, scored
    # by --judge: src/trainers/judged_eval.py) at the start and every --eval_steps, instead of computing a held-out
    # loss it does not have (GRPO: prompts alone): the curve `eval_judged_reward` in --judge's headline measure, the
    # best checkpoint's metric, and what the reward-hacking alert reads. Its trainer takes a `judged_eval`.
    judged_eval: bool = False
    # --beta when none is given (neither a recipe's `beta:` nor the flag), set when the config is built
    # (src/config_parse.py): its TRL config's default or its paper's (SimPO's 2.0: a per-token reward needs a larger
    # scale than DPO's); None for an objective without a beta. `--beta 2` and no --beta are the same SimPO run.
    default_beta: float | None = None
    # --beta 0 is a setting, not a mistake (src/config.py): GRPO's beta weighs a KL term that 0 turns off
    beta_may_be_zero: bool = False
    # What --loss_type may name for it, checked as the config is parsed (src/config_parse.py): TRL_CHOICES, the values
    # its TRL config declares for `loss_type` (several at once, weighed by --loss_weights, where TRL's field is a list:
    # DPO's), its default TRL's; a loss the toolkit fixes (SimPO: CPO's "simpo"): that value alone; () where it has no
    # loss type to choose (SFT: the toolkit passes none; ORPO; a reward model)
    loss_types: str | tuple[str, ...] = ()
    # (config, overrides, extras) → (its own TRL config fields, the pass-through overrides it leaves): beta, loss,
    # weights from the toolkit's flags; `extras` holds what the run resolved (precompute, sft_forward, kto_weights).
    trl_settings: Callable | None = field(default=None, compare=False)
    # (config, the training split's counts) → (settings resolved from the data, the console line that says so, a
    # warning or None): KTO's desirable / undesirable weights. The settings go to trl_settings' extras and
    # training_info.json.
    data_settings: Callable | None = field(default=None, compare=False)
    # (config) → keyword arguments its trainer takes beyond TRL's common ones (GRPO: the names of the judges its
    # trainer makes its reward functions of), passed on every process when the trainer is built (src/trainers/build.py)
    trainer_inputs: Callable | None = field(default=None, compare=False)
    # (name, staged config, plan, world size) → a refusal (one line) or None: what its trainer cannot run, said
    # before any process group exists
    preflight: Callable | None = field(default=None, compare=False)
    # config → refusal or None, as the config is parsed (before any data or model): what only it cannot take
    validate: Callable | None = field(default=None, compare=False)


@dataclass(frozen=True)
class MemoryPlan:
    """What a step holds and computes: check_gpu's memory plan (src/diagnostics/memory_plan.py) and the tokens a step
    computes (src/throughput.py)."""
    sequences_per_example: int  # sequences forwarded per example (throughput: tokens a step computes)
    sequences_with_grad: int  # of those, the ones whose activations are kept for backward (memory plan)
    # No reference model where a preference objective would keep one: check_gpu's memory plan says what that saves
    reference_free: bool = False
    scores_tokens: bool = True  # logits over the vocabulary (memory plan); False for a sequence classifier
    # (config) → check_gpu's view of its step where the table's sequences do not say it all, as TrainingSetup fields
    # (src/diagnostics/inputs.py): GRPO's sequence is a prompt and its sampled answer, it samples with a KV cache
    # before it trains, and it keeps a reference copy only with a KL term
    memory_setup: Callable | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Report:
    """What the run's pages show of it: charts, compare.md, summary numbers, alerts and audit parts, the model card,
    the setup line, what training_info.json records of its loss."""
    charts: tuple[Chart, ...]  # its curves in plots/ (the learning-rate and throughput charts are everyone's)
    compare_metrics: tuple[Metric, ...]  # its curves in compare.md
    summary_numbers: tuple[SummaryNumber, ...]
    # The checks that apply beside every stage's: src/reporting/alerts.py's CHECKS on its curves, and the data audit's
    # (src/audit/findings.py: "data_near_identical", pairs whose answers barely differ).
    alerts: tuple[str, ...]
    audit_parts: tuple[str, ...] = ()  # beyond the preparation's numbers: "reference" ranking, "judged" pairs
    # Its loss can combine TRL loss terms (--loss_type a b, --loss_weights): the loss chart names them, and ln 2 is
    # drawn only for the plain sigmoid loss (src/reporting/plots.py dpo_loss_chart)
    combined_loss: bool = False
    hub_pipeline_tag: str = "text-generation"
    auto_class: str = "CausalLM"  # AutoModelFor<...> that loads the saved model (the model card's snippet)
    # The judged held-out measure its verdict leads with (report.md's headline, the index, the console, the measure a
    # pipeline's earlier stages are shown in): a detail the judge records beside its own metric, where it did
    # (src/judges.py), else the judge's metric. GRPO's: "mean_reward", the held-out mean of the reward it is trained
    # to raise (the embedded checker's metric, correct-and-preferred, is a DPO measure: a chatty SFT model at 0% stays
    # there while its correctness, and so its reward, rises).
    judged_headline: str = ""
    # report.md's Data section when the reference's ranking of the training pairs was not measured: why, for it
    reference_unmeasured: str = ("not measured (`python -m src.audit` with --model_name_or_path measures how a model "
                                 "ranks the training pairs, on a sample).")
    # (config, its resolved data settings) → what training_info.json records of its loss (beta, loss type, ...)
    run_info: Callable | None = field(default=None, compare=False)
    # training_info.json → [(setting, value)]: its loss settings as the model card's method table lists them; also
    # the index's key settings (beta and loss) for a row that has them
    loss_rows: Callable | None = field(default=None, compare=False)
    # training_info.json → its line in report.md's setup table (beta, loss, weights)
    setup_line: Callable | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Advice:
    """What the console and the advice say for it: the keys on the console line, the warnings as its stage opens, and
    the remedies the audit's alerts suggest in its own flags."""
    console_keys: tuple[str, ...]  # logged keys on the console line, between the loss and the learning rate
    # (config) → warnings printed as its stage opens (src/trainers/stage_plan.py): options its TRL trainer accepts and
    # then ignores, settings outside the ranges its paper tried
    warnings: Callable | None = field(default=None, compare=False)
    # What the length alerts advise for it (src/audit/findings.py: the chosen answers are mostly the longer or the
    # shorter ones; the trained answers grew): its own remedies, as a clause ("--ld_alpha 0.5 or ...")
    length_remedy: str = "balance the chosen and rejected answers' lengths in the data"
    # The flags that train through noisy labels (the audit's inverted and tied pairs), "{smoothing}" the assumed share
    # of flipped labels; "" = its loss has none (the advice is then to fix or drop those pairs)
    label_noise_flags: str = ""
    # How to add an NLL (SFT) term on the chosen answers, as a clause ("" = none to add: ORPO's loss has one); the
    # audit's pairs that share their reasoning are answered with it
    sft_term: str = ""
    # What the answer audit advises when the trained answers degenerate (repeat themselves): its own knobs, as a clause
    drift_remedy: str = "a lower --learning_rate or fewer steps"


@dataclass(frozen=True)
class Objective:
    """One row of the table: an objective (a training stage), what it is at the top, and what each part of the
    toolkit reads about it in a group of its own: `training` (what TRL needs), `memory` (the memory plan), `report`
    (the run's pages), `advice` (the console and the audit's advice)."""
    name: str
    help: str  # what `--stage <name>` trains, in a few words (the --stage help)
    data_shape: str  # PAIRS, SCORED_PAIRS, UNPAIRED or SEQUENCES: what preparation makes of the rows
    example_word: str  # what one example is called: pairs, rows, sequences
    causal_lm: bool  # trains a causal LM (an encoder-only model is refused before launch)
    # sft_then_<name> exists: SFT first, then this objective from the SFT model (alone on the untrained embedded model:
    # a warning, src/trainers/stage_plan.py)
    ends_pipeline: bool
    training: Training
    memory: MemoryPlan
    report: Report
    advice: Advice
    on_policy_rounds: bool = False  # --rounds: on-policy rounds of it follow its stage (src/rounds.py)
    embedded_data: str = "dpo"  # the embedded default's directory it trains on (src/embedded/data/<...>)
    # Its name in what a user reads (report.md's setup table, one-line refusals); "" = the stage name in capitals
    title: str = ""
    # Objectives a pipeline may train between SFT and this one, each from the model before it:
    # `sft_then_<before>_then_<name>` (GRPO: dpo, Tulu 3's SFT → DPO → RL from verifiable rewards). Each must end a
    # pipeline itself (start from a trained model); its stage reads the recipe's `<before>:` block (--<before>.KEY).
    pipeline_after: tuple[str, ...] = ()

    @property
    def display_name(self) -> str:
        return self.title or self.name.upper()
