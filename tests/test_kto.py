"""KTO (issue 29): world-size invariance of the loss, KL and rewards, in process.

One optimizer step on the same global batch of 8 rows, split as P processes x A accumulation steps (micro-batches of
8 / (P A) rows): DDP averages the P processes' gradients of a micro-step and accumulation adds the A micro-steps' (each
loss divided by A), so with equal micro-batches a micro-step's loss over P processes is the loss on the union of their
rows, with every gather TRL makes the gather over that union. That is what each split computes here, through the
trainer's own code (src/trainers/kto.py); the one thing not run is the cross-process sum, a plain all-reduce.

TRL 1.16 as shipped (its KL completions cycled inside each device batch, its KL per micro-step) gives another loss
and KL on each split: the same check fails on it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import preference_rows, thinking_rows, write_jsonl
from src import run_files

GLOBAL_BATCH = 8
SPLITS = [(1, 1), (1, 4), (2, 2), (4, 1)]  # (processes, accumulation steps)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def kto_setup(tiny_model, tiny_tokenizer, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig

    from src.config import DataArguments, SFTArguments
    from src.data import prepare_data
    from src.trainers.kto import PreparedKTOTrainer

    work = tmp_path_factory.mktemp("kto")
    pairs = write_jsonl(work / "pairs.jsonl", preference_rows(24, seed=5))
    prepared = prepare_data(DataArguments(dataset_name=str(pairs), max_length=64, kto_from_pairs=True, val_size=2,
                                          test_size=2), SFTArguments(), "kto", 7, tiny_tokenizer, work / "cache")
    reference = AutoModelForCausalLM.from_pretrained(tiny_model)
    policy = copy.deepcopy(reference)
    _raise_answer_likelihood(policy, prepared.train, tiny_tokenizer)  # a policy whose KL to the reference is not 0
    args = KTOConfig(output_dir=str(work / "out"), per_device_train_batch_size=2, precompute_ref_log_probs=False,
                     use_cpu=True, report_to=[], bf16=False, max_length=64, beta=0.5, disable_tqdm=True,
                     desirable_weight=1.0, undesirable_weight=1.5)
    trainer = PreparedKTOTrainer(model=policy, ref_model=reference, args=args, train_dataset=prepared.train,
                                 processing_class=tiny_tokenizer)
    rows = [prepared.train[index] for index in range(GLOBAL_BATCH)]
    assert 0 < sum(row["label"] for row in rows) < GLOBAL_BATCH
    return trainer, rows, prepared, reference


def _raise_answer_likelihood(model, dataset, tokenizer, steps: int = 5) -> None:
    """A few steps of plain likelihood on the split's completions: the policy then puts more mass on answers of this
    kind, matched or not, than the reference (KTO's KL estimate is clamped at 0 from below)."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rows = [dataset[index] for index in range(16)]
    ids = [row["prompt_ids"] + row["completion_ids"] for row in rows]
    width = max(map(len, ids))
    input_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    labels = torch.tensor([[-100] * len(row["prompt_ids"]) + row["completion_ids"] + [-100] * (width - len(seq))
                           for row, seq in zip(rows, ids)])
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=input_ids, attention_mask=(labels != -100) | (input_ids != tokenizer.pad_token_id),
              labels=labels).loss.backward()
        optimizer.step()
    model.zero_grad()


def _trl_kl_completions(rows: list[dict], device_batch: int) -> list[dict]:
    """TRL 1.16's KL completions (kto_trainer.py `add_kl_completion_ids`, a batched map of per_device_train_batch_size
    rows): row i's is row i-1's inside its device batch."""
    shipped = []
    for start in range(0, len(rows), device_batch):
        chunk = rows[start:start + device_batch]
        completions = [row["completion_ids"] for row in chunk]
        for row, kl in zip(chunk, completions[-1:] + completions[:-1]):
            shipped.append(dict(row, KL_completion_ids=kl))
    return shipped


def _collate(trainer, rows: list[dict]) -> dict:
    keys = ("prompt_ids", "completion_ids", "KL_completion_ids", "label", "ref_logps", "ref_KL_logps")
    return trainer.data_collator([{key: row[key] for key in keys if key in row} for row in rows])


def kto_step(trainer, rows: list[dict], processes: int, accumulation: int, shipped: bool) -> dict:
    """Loss, KL, rewards and gradient of one optimizer step on `rows` split as processes x accumulation."""
    from trl import KTOTrainer

    model = trainer.model
    model.train()
    model.zero_grad()
    micro = len(rows) // (processes * accumulation)
    if shipped:
        rows = _trl_kl_completions(rows, micro)
    batches = [_collate(trainer, rows[index * micro:(index + 1) * micro]) for index in range(processes * accumulation)]
    trainer._metrics["train"].clear()
    trainer.metric_window.weights.clear()
    trainer._step_kl = None if shipped else trainer.kl_estimate(model, batches)  # every rank's batches: the all-reduce
    losses = []
    for step in range(accumulation):
        # The P processes' micro-batches of this micro-step: TRL gathers its KL and metrics over them. Their rows
        # collated as one batch: the ranks' padded batches concatenated (each right-padded to the widest), and with
        # the packed forward a layout of the union that the packed keys' indices fit.
        joined = _collate(trainer, rows[step * processes * micro:(step + 1) * processes * micro])
        if shipped:
            loss = KTOTrainer._compute_loss(trainer, model, joined, False)
        else:
            loss = trainer._compute_loss(model, joined, False)
        (loss / accumulation).backward()
        losses.append(float(loss.detach()))
    metrics = trainer._metrics["train"]
    # the toolkit's: the training metrics, kept on the device (no read per step), as a log reads them
    result = ({key: sum(values) / len(values) for key, values in metrics.items() if key != "num_tokens"} if shipped
              else trainer.window_means())
    result["loss"] = sum(losses) / len(losses)
    result["grad"] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    model.zero_grad()
    return result


def _largest_difference(results: list[dict], key: str) -> float:
    first = results[0][key]
    if torch.is_tensor(first):
        return max(float((result[key] - first).abs().max()) for result in results[1:])
    return max(abs(result[key] - first) for result in results[1:])


KEYS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
        "grad")


def test_kto_step_is_the_same_on_any_split_of_the_global_batch(kto_setup):
    trainer, rows, *_ = kto_setup
    ours = [kto_step(trainer, rows, processes, accumulation, shipped=False) for processes, accumulation in SPLITS]
    assert ours[0]["kl"] > 1e-3  # the KL term is in play
    for key in KEYS:
        assert _largest_difference(ours, key) < TOLERANCE, key
    # TRL as shipped: measured 3.4e-4 apart in loss and 2.2e-3 in a gradient entry between 1x1 and the other splits.
    shipped = [kto_step(trainer, rows, processes, accumulation, shipped=True) for processes, accumulation in SPLITS]
    differences = {key: _largest_difference(shipped, key) for key in ("loss", "kl", "grad")}
    assert differences["kl"] > 100 * TOLERANCE and differences["loss"] > 10 * TOLERANCE, differences


def test_per_row_eval_values_are_trls_loss(kto_setup):
    """The eval's per-row losses (kto_row_values, TRL's formula) average to TRL's own _compute_loss with that KL."""
    from trl import KTOTrainer

    trainer, rows, *_ = kto_setup
    batch = _collate(trainer, rows)
    kl = torch.tensor(0.3)
    trainer.model.eval()
    with torch.no_grad():
        with trainer.fixed_kl(kl):
            loss = KTOTrainer._compute_loss(trainer, trainer.model, dict(batch), False)
        values = trainer.row_values(trainer.model, batch, kl)
    trainer._metrics["eval"].clear()
    assert abs(float(values["loss"].mean()) - float(loss)) < 1e-6


def test_training_loss_and_metrics_are_trls_without_a_read(kto_setup):
    """The training step's loss and metrics (computed on the device, read at the log: no stall per step) are TRL's
    KTOTrainer._compute_loss's with the same KL, to float rounding."""
    from trl import KTOTrainer

    trainer, rows, *_ = kto_setup
    batch, kl, model = _collate(trainer, rows), torch.tensor(0.3), trainer.model
    model.train()
    logged = {}
    for name in ("toolkit", "trl"):
        trainer._metrics["train"].clear()
        trainer.metric_window.weights.clear()
        tokens_before = trainer._total_train_tokens
        if name == "toolkit":
            trainer._step_kl = kl
            loss = trainer._compute_loss(model, dict(batch), False)
            trainer.metric_window.flush(trainer)
        else:
            with trainer.fixed_kl(kl):
                loss = KTOTrainer._compute_loss(trainer, model, dict(batch), False)
        logged[name] = {key: values[-1] for key, values in trainer._metrics["train"].items() if key != "num_tokens"}
        logged[name] |= {"loss": float(loss.detach()), "tokens": trainer._total_train_tokens - tokens_before}
    trainer._metrics["train"].clear()
    trainer.metric_window.weights.clear()
    trainer._step_kl = None
    assert set(logged["toolkit"]) == set(logged["trl"]) - {"rewards/margins"}  # the margin: the window's, at a log
    for key, value in logged["toolkit"].items():
        assert abs(value - logged["trl"][key]) < 1e-5, (key, value, logged["trl"][key])


def test_kl_partners_are_a_seeded_derangement():
    import numpy as np

    from src.data import kl_partners

    partners = kl_partners(101, seed=3)
    assert sorted(partners.tolist()) == list(range(101))  # every completion used once
    assert not (partners == np.arange(101)).any()  # no row is its own partner
    assert (partners == kl_partners(101, seed=3)).all() and not (partners == kl_partners(101, seed=4)).all()


@pytest.mark.parametrize("value, label", [(True, True), (0, False), ("👍", True), (" Thumbs_Down ", False),
                                          ("bad", False), ("1", True)])
def test_thumbs_labels(value, label):
    from src.data import parse_label

    assert parse_label(value) is label


@pytest.mark.parametrize("value", ["maybe", 3, 0.5, None, "4 stars"])
def test_a_label_that_is_not_a_thumb_is_refused(value):
    from src.data import DataError, parse_label

    with pytest.raises(DataError, match="not a thumbs up / down"):
        parse_label(value)


def test_kto_weights_from_the_data_and_the_flags():
    from src.config_parse import parse_config
    from src.kto_weights import resolve_kto_weights

    base = ["--stage", "kto", "--model_name_or_path", "m", "--dataset_name", "d.jsonl"]
    weights, line, warning = resolve_kto_weights(parse_config(base), {"desirable": 900, "undesirable": 100})
    assert weights == {"desirable_weight": 1.0, "undesirable_weight": 9.0} and warning is None
    assert "set from the data's counts" in line and "weighted ratio 1.00, inside" in line
    weights, line, warning = resolve_kto_weights(parse_config(base), {"desirable": 100, "undesirable": 120})
    assert weights == {"desirable_weight": 1.2, "undesirable_weight": 1.0}
    weights, line, warning = resolve_kto_weights(parse_config(base), {"desirable": 110, "undesirable": 100})
    assert weights == {"desirable_weight": 1.0, "undesirable_weight": 1.0} and "TRL's defaults" in line
    config = parse_config(base + ["--desirable_weight", "3"])
    weights, line, warning = resolve_kto_weights(config, {"desirable": 100, "undesirable": 100})
    assert weights["desirable_weight"] == 3.0 and "from --desirable_weight" in line
    assert "ratio of 3.00" in warning and "outside the KTO paper's recommended [1, 4/3]" in warning
    assert "--undesirable_weight 3 gives 1.00" in warning


def test_kto_weights_set_from_the_counts_are_never_warned_about():
    """With no weights given the toolkit sets one from the counts: its weighted ratio is inside the paper's [1, 4/3] for
    every count (21 desirable and 22 undesirable rows took 1.0476 before, a ratio of 0.99998, then warned "outside",
    suggesting the same 1.0476). Weights a user typed outside are warned about, and the value the warning suggests is
    inside."""
    from src.config_parse import parse_config
    from src.kto_weights import in_range, resolve_kto_weights, weighted_ratio

    base = ["--stage", "kto", "--model_name_or_path", "m", "--dataset_name", "d.jsonl"]
    config = parse_config(base)
    weights, line, warning = resolve_kto_weights(config, {"desirable": 21, "undesirable": 22})
    assert weights == {"desirable_weight": 1.0477, "undesirable_weight": 1.0} and warning is None, warning
    assert "weighted ratio 1.00, inside" in line
    for desirable in range(1, 121):
        for undesirable in range(1, 121):
            weights, line, warning = resolve_kto_weights(config, {"desirable": desirable, "undesirable": undesirable})
            assert warning is None and in_range(weighted_ratio(**weights, desirable=desirable,
                                                               undesirable=undesirable)), (desirable, undesirable)
    for flag, value, counts in (("--desirable_weight", "1", (21, 22)), ("--undesirable_weight", "1", (300, 7)),
                                ("--desirable_weight", "3", (100, 100))):
        typed = resolve_kto_weights(parse_config(base + [flag, value]), dict(zip(("desirable", "undesirable"), counts)))
        assert typed[2] and "outside the KTO paper's recommended [1, 4/3]" in typed[2]
        suggested = typed[2].split("; ")[-1].split(" gives 1.00")[0].split()  # "--desirable_weight 1.0477"
        again = resolve_kto_weights(parse_config(base + [flag, value] + suggested),
                                    dict(zip(("desirable", "undesirable"), counts)))
        assert again[2] is None and "inside" in again[1], (typed[2], again[1])


def test_ktoconfig_fields_are_flags():
    from src.config_parse import parse_config

    config = parse_config(["--stage", "sft_then_kto", "--model_name_or_path", "m", "--dataset_name", "d.jsonl",
                           "--undesirable_weight", "1.2", "--ref_model_sync_steps", "8", "--sft.packing", "true"])
    assert config.trl_overrides["undesirable_weight"] == 1.2 and config.trl_overrides["ref_model_sync_steps"] == 8
    assert config.sft_stage_overrides == {"packing": "true"}


def test_kto_with_lora_on_two_processes_killed_and_resumed_matches_one(thinking_model, tmp_path):
    """The one launch of this file: a real 2-process KTO run with LoRA (reference: the adapters off, computed in the
    run), whose rank 1 is killed right after checkpoint-2 (a seam, src/run_safety/checkpoints.py) and the job
    relaunched on the one process left (issue 58: 2 -> 1), against one uninterrupted process on the same global batch
    (1 x 2 accumulation vs 2 x 1): every logged train and eval metric agrees. That covers the cross-process sums the in-process test leaves out, the eval's
    rows gathered without accelerate's duplicates (7 validation pairs, 14 rows, on 2 ranks) and resume. Its answers
    reason first and the model has DeepSeek-R1-Distill's template (issue 38: the guarantees hold with the reasoning
    trained; the same code prepares plain answers, which every other launch here uses)."""
    from test_resilience import one_process_against_two_killed_and_resumed
    from test_training import _same, common_args

    data = write_jsonl(tmp_path / "pairs.jsonl", thinking_rows(40, seed=2))
    metrics, info, _console = one_process_against_two_killed_and_resumed(
        lambda name: common_args(thinking_model, data, tmp_path / "results", name, "kto") + [
            "--kto_from_pairs", "true", "--use_lora", "true", "--batch_size", "4", "--micro_batch_size", "2",
            "--max_steps", "4", "--learning_rate", "5e-3", "--beta", "0.5", "--eval_steps", "2", "--save_steps", "2",
            "--val_size", "7", "--precompute_ref_log_probs", "false", "--num_samples", "0"],
        tmp_path / "results", tmp_path / "log.txt", resumed_on=1)
    assert info["data"]["reasoning"] == "keep"  # and the completions trained hold it:
    assert info["data_audit"]["train"]["completion_reasoning_share"] == 1.0
    assert any(record.get("kl", 0) > 0 for record in metrics[1]) and any("eval_kl" in r for r in metrics[1])
    assert _same(metrics[1], metrics[2])


def test_kto_alerts():
    from src.reporting.alerts import detect_alerts

    def history(kl, margin):
        return [{"step": step, "loss": 0.5, "kl": kl(step), "rewards/margins": margin(step)} for step in range(1, 21)]

    codes = lambda metrics: {alert.code for alert in detect_alerts(metrics, "kto")}  # noqa: E731
    assert codes(history(lambda step: 0.2 * step, lambda step: 0.1 * step)) == {"kto_kl_runaway"}
    assert codes(history(lambda step: 0.01, lambda step: 0.0)) == {"kto_not_separating"}
    assert codes(history(lambda step: 0.3, lambda step: 0.05 * step)) == set()


def test_reference_log_probs_of_both_completions_are_cached_and_reused(kto_setup, tiny_tokenizer, tmp_path):
    """The reference's log-probs of each row's completion and KL completion are computed once and reused by a run
    with another beta or weights; another max_length (part of the key) computes them anew."""
    from trl import KTOConfig

    from src.trainers.kto import PreparedKTOTrainer

    _, _, prepared, reference = kto_setup
    outcomes = []
    for beta, max_length in ((0.1, 64), (0.3, 64), (0.1, 48)):
        args = KTOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, use_cpu=True, report_to=[],
                         bf16=False, max_length=max_length, beta=beta, disable_tqdm=True,
                         precompute_ref_log_probs=True)
        trainer = PreparedKTOTrainer(model=copy.deepcopy(reference), args=args, train_dataset=prepared.train,
                                     processing_class=tiny_tokenizer)
        outcomes.append(trainer.reference_cache["train"]["cache"])
        assert {"ref_logps", "ref_KL_logps"} <= set(trainer.train_dataset.column_names)
    assert outcomes == ["computed", "reused", "computed"]


def test_thumbs_rows_prepare_for_kto_and_for_the_sft_stage_before_it(tiny_tokenizer, tmp_path):
    """A feedback export with its own column names (chat prompts, 👍/👎): KTO gets both classes, each row a KL
    completion from another row; the SFT stage of sft_then_kto trains on the thumbs-up rows only."""
    from src.config import DataArguments, SFTArguments
    from src.data import prepare_data

    rows = [{"question": row["prompt"], "answer": row[("chosen", "rejected")[index % 3 == 0]],
             "thumbs": "👎" if index % 3 == 0 else "👍"} for index, row in enumerate(preference_rows(30, seed=1))]
    data = DataArguments(dataset_name=str(write_jsonl(tmp_path / "feedback.jsonl", rows)), max_length=64,
                         prompt_column="question", completion_column="answer", label_column="thumbs", val_size=2,
                         test_size=2)
    kto = prepare_data(data, SFTArguments(), "kto", 3, tiny_tokenizer, tmp_path / "cache")
    train = kto.summary["splits"]["train"]
    assert train["desirable"] + train["undesirable"] == train["kept"] == 26 and train["undesirable"] > 0
    assert kto.train.features["label"].dtype == "bool"
    completions = kto.train["completion_ids"]
    partners = [completions.index(kl) for kl in kto.train["KL_completion_ids"]]  # each a completion of the split
    assert len(partners) == 26
    audit = kto.summary["audit"]["train"]
    assert audit["desirable"] == train["desirable"] and audit["prompts_only_desirable"] == train["desirable"]
    sft = prepare_data(data, SFTArguments(), "sft", 3, tiny_tokenizer, tmp_path / "cache")
    assert sft.summary["splits"]["train"]["kept"] == train["desirable"]
    assert sft.summary["splits"]["train"]["undesirable_dropped"] == train["undesirable"]


def test_unpaired_rows_tokenize_as_trls_ktotrainer(tiny_tokenizer):
    """src/data/'s KTO ids equal TRL 1.16 KTOTrainer._prepare_dataset's, for text and chat rows."""
    from types import SimpleNamespace

    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from src.data import tokenize_unpaired

    pairs = preference_rows(4, seed=9)
    chat = [{"prompt": row["prompt"], "completion": row["chosen"], "label": True} for row in pairs]
    text = [{"prompt": row["prompt"][0]["content"], "completion": " " + row["rejected"][0]["content"],
             "label": False} for row in pairs]
    fake = SimpleNamespace(_tokenizer=tiny_tokenizer, calculate_KL=False, desirable_weight=1.0,
                           undesirable_weight=1.0)
    for rows in (chat, text):
        theirs = KTOTrainer._prepare_dataset(fake, Dataset.from_list(rows), tiny_tokenizer,
                                             KTOConfig(output_dir="unused", max_length=None, use_cpu=True, bf16=False),
                                             "eval")
        for row, their in zip(rows, theirs):
            ours = tokenize_unpaired(row, tiny_tokenizer)
            assert (ours["prompt_ids"], ours["completion_ids"]) == (their["prompt_ids"], their["completion_ids"])
