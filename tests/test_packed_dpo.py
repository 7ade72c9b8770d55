"""The packed, prefix-shared DPO forward (src/packed_dpo.py) against TRL's padded one: the same per-pair log-probs
(Llama and Qwen2 architectures, sdpa and eager, the flash-attention layout through transformers' varlen detection), the
same loss curve, LoRA, 2 processes, the fallback, and what training_info.json records."""

from __future__ import annotations

import random

import pytest

from conftest import build_template_tokenizer, build_tiny_tokenizer

WORDS = "the sky is blue green red sun moon sea river cat dog what color where yes no one two".split()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer([" ".join(WORDS)] * 4)


def tiny(architecture: str, tokenizer, attention: str = "sdpa", seed: int = 0):
    """A 2-layer model with grouped-query attention and tied embeddings, initialised wide enough (std 0.2) that a
    token that should not be seen changes the log-probs visibly; Qwen2 adds q/k/v biases."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        architecture]
    config = config_class(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          tie_word_embeddings=True, initializer_range=0.2, pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=None, eos_token_id=tokenizer.eos_token_id, attn_implementation=attention)
    torch.manual_seed(seed)
    model = model_class(config)
    if architecture == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model


def pairs(count: int, seed: int = 0, vocab: int = 60) -> list[dict]:
    """Token-id pairs of varied lengths (the columns src/data/ prepares); some answers share a first token."""
    rng = random.Random(seed)
    ids = lambda low, high: [rng.randrange(8, vocab) for _ in range(rng.randint(low, high))]  # noqa: E731
    rows = []
    for _ in range(count):
        chosen = ids(1, 14)
        rows.append({"prompt_ids": ids(1, 20), "chosen_ids": chosen,
                     "rejected_ids": chosen[:2] + ids(0, 12) if rng.random() < 0.3 else ids(1, 12)})
    return rows


def trainer_for(model, tokenizer, rows, tmp_path, packed: bool = True, **overrides):
    import copy

    from datasets import Dataset
    from trl import DPOConfig

    from src.trainers.dpo import PreparedDPOTrainer, packed_dpo_forward

    peft_config = overrides.pop("peft_config", None)
    attention = overrides.pop("packed_attention", "auto")
    ref_model = overrides.pop("ref_model", None) or (None if peft_config else copy.deepcopy(model))
    args = DPOConfig(**{"output_dir": str(tmp_path / ("packed" if packed else "padded")),
                        "per_device_train_batch_size": 4, "max_length": 40, "bf16": False, "use_cpu": True,
                        "activation_checkpointing": False, "report_to": [], "logging_steps": 1, "disable_tqdm": True,
                        "precompute_ref_log_probs": False, "learning_rate": 1e-3, "seed": 0, **overrides})
    return PreparedDPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=tokenizer, peft_config=peft_config,
                              **packed_dpo_forward(model, tokenizer, args, peft_config, packed, attention))


def reference_logps(trainer, rows):
    """Per-pair (chosen, rejected) log-probs through the trainer's reference path, with its collator."""
    import torch

    # on the model's device, as the training loop hands it over (Trainer._prepare_inputs)
    device = next(trainer.model.parameters()).device
    batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in trainer.data_collator(rows).items()}
    with torch.no_grad():
        chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    return torch.stack([chosen, rejected], dim=1)


def assert_close(packed, padded, rel=1e-5):
    assert packed.shape == padded.shape
    assert ((packed - padded).abs() <= rel * padded.abs() + 1e-6).all(), (packed - padded).abs().max()


def test_the_first_batch_check_in_a_bf16_training_step_takes_the_half_precision_tolerance(tokenizer, tmp_path):
    """With a warm reference cache (here: the reference computed inside each step) the first-batch check runs in the
    first training step, outside the autocast that accelerate enters inside the model's own forward: read from the
    ambient state alone it took the fp32 tolerance (1e-4) for bf16 log-probs (differences ~1e-2) and turned the packed
    forward off. Seen on an H200 (bench_dpo.py's warm-cache arm ran padded) and reproduced here on CPU in bf16."""
    trainer = trainer_for(tiny("qwen2", tokenizer), tokenizer, pairs(32, seed=7), tmp_path, True, bf16=True,
                          precompute_ref_log_probs=False, max_steps=2, per_device_train_batch_size=8)
    trainer.train()
    check = trainer.packed_forward.check_result
    assert trainer.packed_forward.enabled, trainer.packed_forward.reason
    assert check["passed"] and check["tolerance"] == 0.1 and 0 < check["max_abs_difference"] < 0.1, check


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_per_pair_log_probs_equal_the_padded_forward(architecture, attention, tokenizer, tmp_path):
    rows = pairs(12, seed=1)
    model = tiny(architecture, tokenizer, attention)
    packed_trainer = trainer_for(model, tokenizer, rows, tmp_path, packed=True)
    padded_trainer = trainer_for(model, tokenizer, rows, tmp_path, packed=False)
    packed, padded = reference_logps(packed_trainer, rows), reference_logps(padded_trainer, rows)
    assert packed_trainer.packed_forward.enabled, packed_trainer.packed_forward.reason
    assert packed_trainer.packed_forward.check_result["passed"]
    assert_close(packed, padded)
    # and with ld_alpha's shared / tail split of each answer
    model_ld = tiny(architecture, tokenizer, attention)
    packed_ld = reference_logps(trainer_for(model_ld, tokenizer, rows, tmp_path, True, ld_alpha=0.5), rows)
    padded_ld = reference_logps(trainer_for(model_ld, tokenizer, rows, tmp_path, False, ld_alpha=0.5), rows)
    assert_close(packed_ld, padded_ld)
    assert not (packed_ld - packed).abs().max() < 1e-3  # ld_alpha changed something: the check above had teeth


def test_the_lm_head_projects_only_the_positions_whose_log_prob_is_read(tokenizer, tmp_path, monkeypatch):
    """Issue 50 point 3: TRL's fused head gets the hidden states of each answer's tokens' predecessors (the answer's
    positions and the prompt token before it), not the packed rows' every position (the log-probs themselves: the
    tests above and below)."""
    from trl.trainer import utils as trl_utils

    projected = []
    original = trl_utils._ChunkedLogProbFunction.apply

    def counted(hidden_states, *rest):
        projected.append(hidden_states.shape[0])
        return original(hidden_states, *rest)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", staticmethod(counted))
    rows = pairs(6, seed=3)
    trainer = trainer_for(tiny("llama", tokenizer), tokenizer, rows, tmp_path)
    trainer.packed_forward.checked = True  # the first-batch check would run the padded forward too
    reference_logps(trainer, rows)
    answers = sum(len(row["chosen_ids"]) + len(row["rejected_ids"]) for row in rows)
    computed = trainer.packed_forward.counts["reference"].as_dict()["computed_tokens"]
    assert projected == [answers] and answers < computed, (projected, answers, computed)


def test_truncation_at_max_length_matches_the_padded_forward(tokenizer, tmp_path):
    rows = pairs(8, seed=2)
    model = tiny("llama", tokenizer)
    packed = reference_logps(trainer_for(model, tokenizer, rows, tmp_path, True, max_length=16), rows)
    padded = reference_logps(trainer_for(model, tokenizer, rows, tmp_path, False, max_length=16), rows)
    assert_close(packed, padded)


def thinking_pairs(count: int, seed: int = 0):
    """R1-style pairs (reasoning inside <think>…</think>, then the final answer) prepared as the toolkit prepares them
    with DeepSeek-R1-Distill's template: the prompt ends with the opened `<think>\\n`, each answer is its reasoning,
    `</think>`, the final answer and the end of sentence; some pairs share their reasoning and differ in the answer."""
    from src.data import tokenize_preference

    tokenizer = build_template_tokenizer([" ".join(WORDS)] * 4, "deepseek-r1-distill")
    rng = random.Random(seed)
    text = lambda low, high: " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))  # noqa: E731
    answer = lambda thought: [  # noqa: E731
        {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{text(1, 6)}"}]
    rows = []
    for _ in range(count):
        reasoning = text(3, 14)
        row = {"prompt": [{"role": "user", "content": text(2, 10) + "?"}], "chosen": answer(reasoning),
               "rejected": answer(reasoning if rng.random() < 0.4 else text(2, 12))}
        rows.append(tokenize_preference(row, tokenizer))
    return tokenizer, rows


def test_pairs_prepared_through_a_thinking_template_match_the_padded_forward(tmp_path):
    """Issue 38: the answers trained are the reasoning and the final answer after R1's opened <think>; the packed
    forward shares the prompt (and a shared reasoning's tokens are each answer's own) exactly as the padded one."""
    tokenizer, rows = thinking_pairs(10, seed=4)
    close = tokenizer.convert_tokens_to_ids("</think>")
    assert all(tokenizer.decode(row["prompt_ids"]).endswith("<｜Assistant｜><think>\n") for row in rows)
    assert all(close in row["chosen_ids"] and close in row["rejected_ids"] for row in rows)  # the reasoning is trained
    model = tiny("qwen2", tokenizer)
    packed_trainer = trainer_for(model, tokenizer, rows, tmp_path, True, max_length=128)
    packed = reference_logps(packed_trainer, rows)
    assert packed_trainer.packed_forward.enabled, packed_trainer.packed_forward.reason
    assert_close(packed, reference_logps(trainer_for(model, tokenizer, rows, tmp_path, False, max_length=128), rows))
    # and where --max_length cuts into the reasoning
    cut = reference_logps(trainer_for(model, tokenizer, rows, tmp_path, True, max_length=24), rows)
    assert_close(cut, reference_logps(trainer_for(model, tokenizer, rows, tmp_path, False, max_length=24), rows))
    assert not (cut - packed).abs().max() < 1e-3  # the cut changed something: the check above had teeth


def test_the_varlen_layout_for_flash_attention_matches_through_restarting_positions(tokenizer, tmp_path):
    """The flash-attention layout (no mask, positions restarting at 0) run with sdpa on CPU: transformers builds the
    block-diagonal mask from the positions, as flash-attention's varlen does."""
    from src.packed_dpo import PackedPreferenceCollator
    from src.packed_forward import PackedDPOForward

    rows = pairs(10, seed=3)
    model = tiny("qwen2", tokenizer)
    trainer = trainer_for(model, tokenizer, rows, tmp_path, True)
    trainer.packed_forward = PackedDPOForward(None, "varlen")
    trainer.data_collator = PackedPreferenceCollator(trainer.data_collator.padded_collator, "varlen")
    padded = reference_logps(trainer_for(model, tokenizer, rows, tmp_path, False), rows)
    assert_close(reference_logps(trainer, rows), padded)
    tokens = trainer.packed_forward.summary()["tokens"]["reference"]
    assert tokens["padding_share"] == 0


def test_a_mask_that_lets_the_rejected_answer_see_the_chosen_one_is_caught(tokenizer, tmp_path, monkeypatch, capsys):
    """The first-batch check has teeth: with the mask's one rule broken, the run falls back to the padded forward
    (and its numbers), with one warning line."""
    import src.packed_attention as packed_attention

    rows = pairs(8, seed=4)
    model = tiny("llama", tokenizer)
    padded = reference_logps(trainer_for(model, tokenizer, rows, tmp_path, False), rows)
    correct_mask = packed_attention.prefix_shared_mask

    def leaky_mask(segment_ids, branch_ids, position_ids, window=None):  # the rejected answer sees all of its pair
        return correct_mask(segment_ids, branch_ids.clamp(max=packed_attention.CHOSEN), position_ids, window)

    monkeypatch.setattr(packed_attention, "prefix_shared_mask", leaky_mask)
    trainer = trainer_for(model, tokenizer, rows, tmp_path, True)
    assert_close(reference_logps(trainer, rows), padded)
    assert not trainer.packed_forward.enabled
    assert "differ from the padded forward" in trainer.packed_forward.reason
    warnings = [line for line in capsys.readouterr().out.splitlines() if "packed forward off" in line]
    assert len(warnings) == 1


def test_a_packed_forward_that_raises_falls_back_with_the_error(tokenizer, tmp_path, monkeypatch, capsys):
    """A shape the model cannot take in the packed layout is a failed first-batch check, not a crash: the padded
    forward's numbers, one warning line naming the error."""
    import src.packed_attention as packed_attention

    rows = pairs(8, seed=5)
    model = tiny("llama", tokenizer)
    padded = reference_logps(trainer_for(model, tokenizer, rows, tmp_path, False), rows)

    def unbuildable_mask(*args, **kwargs):
        raise ValueError("too many values to unpack (expected 2)")  # what BLOOM's ALiBi raised on a 4D mask

    monkeypatch.setattr(packed_attention, "prefix_shared_mask", unbuildable_mask)
    trainer = trainer_for(model, tokenizer, rows, tmp_path, True)
    assert_close(reference_logps(trainer, rows), padded)
    assert not trainer.packed_forward.enabled
    assert "raised ValueError: too many values to unpack" in trainer.packed_forward.reason
    assert trainer.packed_forward.check_result["error"].startswith("ValueError")
    assert len([line for line in capsys.readouterr().out.splitlines() if "packed forward off" in line]) == 1


def test_a_window_the_mask_does_not_reproduce_is_named_as_the_likely_cause(tokenizer, tmp_path, monkeypatch):
    """The first-batch check's warning names a windowed model's window when the numbers differ."""
    import src.packed_attention as packed_attention

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    rows = pairs(8, seed=6)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2, pad_token_id=tokenizer.pad_token_id, use_sliding_window=True,
        sliding_window=4, max_window_layers=1, attn_implementation="sdpa"))
    correct_mask = packed_attention.prefix_shared_mask
    monkeypatch.setattr(packed_attention, "prefix_shared_mask",  # the window left out of the mask
                        lambda segment_ids, branch_ids, position_ids, window=None: correct_mask(
                            segment_ids, branch_ids, position_ids, None))
    trainer = trainer_for(model, tokenizer, rows, tmp_path, True)
    reference_logps(trainer, rows)
    assert not trainer.packed_forward.enabled
    assert "likely cause: its attention window (sliding_attention 4 positions)" in trainer.packed_forward.reason


def test_an_attention_implementation_not_known_to_honour_the_mask_falls_back(tokenizer, tmp_path, capsys):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("custom_test_attention", sdpa_attention_forward)
    model = tiny("llama", tokenizer, "custom_test_attention")
    rows = pairs(4)
    trainer = trainer_for(model, tokenizer, rows, tmp_path, True)
    assert not trainer.packed_forward.enabled
    assert "custom_test_attention" in trainer.packed_forward.reason
    assert "packed forward off" in capsys.readouterr().out
    reference_logps(trainer, rows)
    assert trainer.packed_forward.summary()["forward"] == "padded (TRL)"


def loss_curves(architecture: str, tokenizer, tmp_path, steps: int, **overrides) -> dict[bool, list[float]]:
    """Train the same model packed and padded, policy and reference forwards both in every step (no precompute)."""
    rows = pairs(8 * steps, seed=5)
    curves = {}
    for packed in (True, False):
        model = tiny(architecture, tokenizer, seed=1)
        trainer = trainer_for(model, tokenizer, rows, tmp_path, packed, max_steps=steps,
                              ref_model=tiny(architecture, tokenizer, seed=1), **overrides)
        trainer.train()
        curves[packed] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        if packed:
            summary = trainer.packed_forward.summary()
            assert summary["forward"].startswith("packed") and summary["first_batch_check"]["passed"]
            assert summary["tokens"]["policy"]["batches"] == steps
            assert summary["tokens"]["reference"]["batches"] == steps
    assert len(curves[True]) == steps
    return curves


def test_loss_curve_over_20_steps_equals_the_padded_forward(tokenizer, tmp_path):
    curves = loss_curves("qwen2", tokenizer, tmp_path, 20)
    assert curves[True] == pytest.approx(curves[False], rel=1e-4, abs=1e-6)
    assert max(curves[True]) - min(curves[True]) > 1e-3  # the weights moved: equal curves are not flat ones


@pytest.mark.parametrize("loss_type, use_weighting", [
    (["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
      "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"], False),
    # WPO weights multiply in place, which TRL's own hinge, sft and sorting losses do not survive (padded too)
    (["sigmoid"], True),
])
def test_every_loss_type_and_wpo_weighting_equal_the_padded_forward(loss_type, use_weighting, tokenizer, tmp_path):
    """All TRL loss types (summed), WPO weights: whatever per-token quantity a loss reads."""
    curves = loss_curves("llama", tokenizer, tmp_path, 3, loss_type=loss_type, label_smoothing=0.1,
                         use_weighting=use_weighting)
    assert curves[True] == pytest.approx(curves[False], rel=1e-4, abs=1e-6)


TOKEN_MEANS = ("entropy", "mean_token_accuracy", "logits/chosen", "logits/rejected")


@pytest.mark.parametrize("packed, precompute", [(True, False), (False, True)], ids=["packed", "padded-reference-cached"])
def test_token_metrics_are_means_over_the_steps_tokens_on_any_split(packed, precompute, tokenizer, tmp_path):
    """A global batch of 4 pairs as 1 micro-batch of 4 (what 2 processes x 1 gather: each step one ratio of the two
    ranks' summed tokens) and as 2 micro-batches of 2 (1 process x 2 accumulation): the same logged entropy, token
    accuracy and mean logits, each the mean over the step's tokens (its pairs for rewards and log-probs). TRL logs the
    mean of the micro-batches' ratios, which differs where they hold different token counts (the pairs here vary in
    length): before, step 1's mean_token_accuracy was (a/n1 + b/n2) / 2 on 1 x 2, against (a + b) / (n1 + n2)."""
    rows = answers_starting_as_the_model_would(tiny("llama", tokenizer, seed=1), pairs(8, seed=3))
    logged = {}
    for micro, accumulation in ((4, 1), (2, 2)):
        trainer = trainer_for(tiny("llama", tokenizer, seed=1), tokenizer, rows, tmp_path / f"{micro}x{accumulation}",
                              packed, max_steps=2, per_device_train_batch_size=micro,
                              gradient_accumulation_steps=accumulation, precompute_ref_log_probs=precompute,
                              ref_model=tiny("llama", tokenizer, seed=1))
        trainer.train()
        logged[accumulation] = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logged[1]) == len(logged[2]) == 2
    for whole, split in zip(logged[1], logged[2]):
        for key in ("loss", "rewards/margins", "logps/chosen") + TOKEN_MEANS:
            assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), (whole["step"], key)
    assert 0 < logged[1][0]["mean_token_accuracy"] < 1


def answers_starting_as_the_model_would(model, rows: list[dict]) -> list[dict]:
    """The rows with each chosen answer's first half replaced by the model's greedy continuation of its prompt: a
    token accuracy between 0 and 1 (a random model's is about 0), different in each micro-batch."""
    import torch

    changed = []
    for row in rows:
        ids = list(row["prompt_ids"])
        with torch.no_grad():
            for _ in range(len(row["chosen_ids"]) // 2):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        greedy = ids[len(row["prompt_ids"]):]
        changed.append(row | {"chosen_ids": greedy + row["chosen_ids"][len(greedy):]})
    return changed


def test_lora_with_gradient_checkpointing_matches_the_padded_forward(tokenizer, tmp_path):
    from peft import LoraConfig

    rows = pairs(40, seed=6)
    curves = {}
    for packed in (True, False):
        model = tiny("qwen2", tokenizer, seed=2)
        trainer = trainer_for(model, tokenizer, rows, tmp_path, packed, max_steps=6, activation_checkpointing=True,
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        trainer.train()
        curves[packed] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        if packed:
            assert trainer.packed_forward.summary()["tokens"]["policy"]["batches"] == 6
            assert trainer.packed_forward.check_result["passed"]
    assert curves[True] == pytest.approx(curves[False], rel=1e-4, abs=1e-6)


def test_the_toolkit_run_packs_by_default_on_two_processes_and_records_the_forward(tiny_model, tmp_path,
                                                                                    monkeypatch):
    """End to end through src.main_distributed: reference precompute (a cold cache), training and evaluation packed
    on 2 processes give the loss curve of `--padding_free false` (TRL's padded forward) on 1; training_info.json says
    which forward ran and what share of its computed tokens was padding or repeated prompt."""
    from conftest import preference_rows, write_jsonl
    from src import run_files
    from test_training import common_args, launch

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(48))
    runs = {}
    for name, processes, extra in (("padded", 1, ["--padding_free", "false"]), ("packed", 2, [])):
        monkeypatch.setenv("PREFKIT_CACHE", str(tmp_path / f"cache-{name}"))  # each computes its reference pass
        args = common_args(tiny_model, data, tmp_path / "results", name, "dpo") + [
            "--batch_size", "8", "--micro_batch_size", "4", "--max_steps", "4", "--learning_rate", "1e-3",
            "--num_samples", "0", *extra]
        launch(processes, args, tmp_path / f"probe-{name}")
        run_dir = tmp_path / "results" / name
        metrics = run_files.read_jsonl(run_dir / run_files.METRICS)
        runs[name] = {"info": run_files.read_json(run_dir / run_files.TRAINING_INFO),
                      "loss": [record["loss"] for record in metrics if "loss" in record],
                      "eval_loss": [record["eval_loss"] for record in metrics if "eval_loss" in record]}
    padded, packed = runs["padded"]["info"]["forward"], runs["packed"]["info"]["forward"]
    assert padded["forward"] == "padded (TRL)" and padded["reason"] == "--padding_free false"
    assert packed["forward"].startswith("packed (prefix-shared") and packed["first_batch_check"]["passed"]
    for forward in ("policy", "reference"):
        assert packed["tokens"][forward]["repeated_prompt_share"] < padded["tokens"][forward]["repeated_prompt_share"]
        assert packed["tokens"][forward]["computed_tokens"] < padded["tokens"][forward]["computed_tokens"]
    would = packed["padded_forward_would_compute"]["policy"]  # the same batches, had they been padded
    assert would["repeated_prompt_share"] > packed["tokens"]["policy"]["repeated_prompt_share"]
    assert would["useful_share"] < packed["tokens"]["policy"]["useful_share"]
    assert len(runs["padded"]["loss"]) == 4 and runs["padded"]["eval_loss"]
    assert runs["packed"]["info"]["world_size"] == 2
    # perf/padding_fraction is the share of what the forward computed, in the layout that ran (the training forwards;
    # `forward`'s policy counts also hold the evaluation batches, hence the tolerance).
    fraction = {name: run["info"]["summary"]["throughput"]["padding_fraction"] for name, run in runs.items()}
    assert fraction["padded"] == pytest.approx(padded["tokens"]["policy"]["padding_share"], abs=0.05)
    assert fraction["packed"] == pytest.approx(packed["tokens"]["policy"]["padding_share"], abs=0.05)
    assert fraction["packed"] < fraction["padded"], fraction
    assert runs["packed"]["loss"] == pytest.approx(runs["padded"]["loss"], rel=1e-4, abs=1e-6)
    assert runs["packed"]["eval_loss"] == pytest.approx(runs["padded"]["eval_loss"], rel=1e-4, abs=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flash_attention_2"])
def test_on_gpu_in_bf16_the_packed_forward_matches_the_padded_one(attention, tokenizer, tmp_path):
    """`python -m pytest -m gpu`: flash-attention takes the varlen layout (positions restarting at 0, no mask), sdpa
    the prefix-shared mask; both against the padded forward under bf16 autocast on CUDA."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if attention.startswith("flash") and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    rows = pairs(16, seed=7)
    model = tiny("qwen2", tokenizer, attention).cuda()
    results = {}
    for packed in (True, False):
        trainer = trainer_for(model, tokenizer, rows, tmp_path, packed, bf16=True, use_cpu=False)
        results[packed] = reference_logps(trainer, rows).float()
        if packed:
            expected = "varlen" if attention.startswith("flash") else "prefix_shared"
            assert trainer.packed_forward.layout == expected and trainer.packed_forward.enabled
            assert trainer.packed_forward.check_result["passed"]
    assert ((results[True] - results[False]).abs() <= 2e-2 * results[False].abs() + 0.1).all()


def test_the_report_names_the_forward_and_its_shares():
    from src.reporting.report import setup_table

    lines = "\n".join(setup_table({"stage": "dpo", "beta": 0.1, "loss_type": ["sigmoid"], "dpo_forward": {
        "forward": "padded (TRL)", "reason": "--padding_free false",
        "tokens": {"policy": {"padding_share": 0.4567, "repeated_prompt_share": 0.125}}}}))
    assert "padded (TRL) (--padding_free false); policy: 45.7% padding, 12.5% repeated prompt" in lines


def trajectory_pairs(count: int, seed: int = 0) -> list[dict]:
    """Pairs whose answers are tool trajectories (src/tools.py): the model's turn, a tool block (loss mask 0), the
    model's next turn; every answer ends with a one-token tool block, so nothing after it reads that token."""
    rng = random.Random(seed)
    ids = lambda low, high: [rng.randrange(8, 60) for _ in range(rng.randint(low, high))]  # noqa: E731
    rows = []
    for _ in range(count):
        row = {"prompt_ids": ids(1, 10)}
        for answer in ("chosen", "rejected"):
            turn, tool, last = ids(1, 6), ids(1, 5), ids(1, 6)
            row[f"{answer}_ids"] = turn + tool + last + ids(1, 1)
            row[f"{answer}_loss_mask"] = [1] * len(turn) + [0] * len(tool) + [1] * len(last) + [0]
        rows.append(row)
    return rows


@pytest.mark.parametrize("max_length", [40, 14])
def test_a_tool_trajectorys_results_are_out_of_the_loss_in_both_forwards_and_the_reference_cache(
        max_length, tokenizer, tmp_path):
    """The answers' loss masks (a tool trajectory's results: 0) are multiplied into TRL's completion_mask by the
    packed and the padded collators alike (truncated as TRL truncates), so the policy, the reference pass and its
    precomputed cache read only the model's own tokens: a masked token changed leaves the log-probs unchanged."""
    import torch

    rows = trajectory_pairs(8, seed=4)
    model = tiny("llama", tokenizer)
    packed_trainer = trainer_for(model, tokenizer, rows, tmp_path, True, max_length=max_length)
    padded_trainer = trainer_for(model, tokenizer, rows, tmp_path, False, max_length=max_length)
    batch = padded_trainer.data_collator(rows)
    for index, row in enumerate(rows):  # the chosen rows, then the rejected ones
        for block, answer in enumerate(("chosen", "rejected")):
            start = len(row["prompt_ids"])
            expected = ([0] * start + row[f"{answer}_loss_mask"])[:max_length]
            got = batch["completion_mask"][block * len(rows) + index, :len(expected)].tolist()
            assert got == expected, (index, answer)
    assert packed_trainer.data_collator(rows)["completion_mask"].equal(batch["completion_mask"])
    packed, padded = reference_logps(packed_trainer, rows), reference_logps(padded_trainer, rows)
    assert packed_trainer.packed_forward.check_result["passed"], packed_trainer.packed_forward.check_result
    assert_close(packed, padded)
    unmasked = [{key: value for key, value in row.items() if not key.endswith("_loss_mask")} for row in rows]
    assert (reference_logps(padded_trainer, unmasked) - padded).abs().max() > 1e-3  # the masks took tokens out
    # Each answer's last token is a masked tool token nothing reads after it: another token there changes nothing.
    changed = [row | {"chosen_ids": row["chosen_ids"][:-1] + [8 + (row["chosen_ids"][-1] - 7) % 52],
                      "rejected_ids": row["rejected_ids"][:-1] + [8 + (row["rejected_ids"][-1] - 7) % 52]}
               for row in rows]
    assert_close(reference_logps(packed_trainer, changed), packed)
    assert_close(reference_logps(padded_trainer, changed), padded)
    # TRL keeps the masks as columns for the collator, and its precomputed reference cache reads them too.
    columns = padded_trainer._remove_unused_columns(padded_trainer.train_dataset).column_names
    assert {"chosen_loss_mask", "rejected_loss_mask"} <= set(columns)
    cached = trainer_for(model, tokenizer, rows, tmp_path / "cache", True, max_length=max_length,
                         precompute_ref_log_probs=True).train_dataset
    assert_close(torch.tensor([cached["ref_chosen_logps"], cached["ref_rejected_logps"]]).T, packed)
