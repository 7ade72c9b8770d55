"""The sharding engines on CPU processes (src/engines.py): DeepSpeed ZeRO-1/2/3 and FSDP2 through accelerate's launch
configs (configs/accelerate/zero*.yaml, fsdp.yaml: the environment accelerate launch gives its workers:
tests/engine_launch.py), each a forked 2-process job on gloo; DPO's DDP run is made once for both engines' tests. One
job per engine and objective carries every assertion: the engine that ran (training_info.json, read from the
trainer's accelerator), the same loss curve as plain DDP at the same global batch (fp32, 1e-5), each rank's share
(tests/rank_probe.py: optimizer states halved, under ZeRO-3 and FSDP2 the weights and a live reference too), and the
final model consolidated into ordinary safetensors equal to DDP's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import forked
import rank_probe
from conftest import preference_rows, write_jsonl
from engine_launch import accelerate_environment
from src import run_files, seams
from test_training import assert_reloads_generates_and_changed, common_args, probes

pytest.importorskip("deepspeed")


def run_engine(strategy: str, args: list[str], probe_dir: Path, killed_after: int | None = None,
               launch_config: dict[str, str] | None = None, nproc: int = 2) -> dict:
    """A forked 2-process job as `STRATEGY=<strategy> ./run_distributed.sh 2` starts its workers (ddp: torchrun's
    plain DDP; `nproc` 1: one process); its training_info.json, loss curve, grad norms and per-rank probes. `killed_after`: rank 1 is killed right after
    that checkpoint is complete (the seam in src/run_safety/checkpoints.py), then the same job is launched again.
    `launch_config`: variables as an edited launch config would set them (FSDP_STATE_DICT_TYPE)."""
    environment = (accelerate_environment(strategy) if strategy != "ddp" else dict(os.environ)) | {
        "OMP_NUM_THREADS": "1"} | (launch_config or {})
    if killed_after is not None:
        killed = probe_dir.with_name(f"{probe_dir.name}_killed")
        first = forked.run_job(2, [str(probe_dir), *args], entry=rank_probe.entry, env=seams.env(
            environment, kill_at_checkpoint=f"after_complete:{killed_after}:1:{killed}"))
        assert killed.exists() and first.returncode != 0, "the seam never fired: the test proves nothing"
    result = forked.run_job(nproc, [str(probe_dir), *args], env=environment, entry=rank_probe.entry)
    assert result.returncode == 0, (f"{strategy}: exit {result.returncode}\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-4000:]}")
    run_dir = Path(args[args.index("--results_dir") + 1]) / args[args.index("--run_name") + 1]
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    logged = [record for record in run_files.read_jsonl(run_dir / run_files.METRICS) if "loss" in record]
    stage = args[args.index("--stage") + 1]
    return {"info": info, "losses": [record["loss"] for record in logged], "ranks": probes(probe_dir, stage, nproc),
            "grad_norms": [record["grad_norm"] for record in logged], "final": run_dir / "model" / "final",
            "console": (result.stdout + result.stderr).splitlines()}


# What an engine's libraries printed on the console before src/library_warnings.py (and FSDP2's alarm before the
# packed forward stopped returning views): none of it may reach an engine run's console.
LIBRARY_NOISE = ("Warning:", "mismatch", "return func(*args, **kwargs)", "built successfully", "Setting accelerator",
                 "returned a view tensor")


def assert_console_reads_as_ddp(run: dict, ddp: dict, label: str, engine: str) -> None:
    """An engine run's console is the toolkit's, as DDP's is: no library noise, the engine named in the plan block
    (`engine`: its title), and as many lines as the DDP run's, within what the runs do differently."""
    noise = [line for line in run["console"] if any(word in line for word in LIBRARY_NOISE)]
    assert not noise, f"{label}: {noise[:4]}"
    rows = [line.split(maxsplit=1)[1] for line in run["console"] if line.strip().startswith("engine ")]
    assert rows and all(row.startswith(engine) and "over 2 processes" in row for row in rows), (label, rows)
    # the same lines but the engine's row, within what the runs do differently: one that reuses the DDP run's reference
    # cache says so in 2 lines where DDP's computed it in 4, a resumed run says where from and skips what it did before
    assert abs(len(run["console"]) - len(ddp["console"])) <= 4, (label, len(ddp["console"]), run["console"])


def final_weights(path: Path) -> dict:
    """The saved model's weights as from_pretrained loads them (a tied head saved separately or not alike)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.fixture(scope="module")
def dpo_engines(tiny_model, tmp_path_factory):
    """DPO (packed forward) at global batch 8 = 2 per device x 2 accumulation x 2 processes, 3 steps, checkpoint
    every 2, under any engine (`run(name, strategy, extra flags, killed_after, launch_config)`), and its DDP run:
    the one reference the ZeRO and FSDP tests compare with."""
    root = tmp_path_factory.mktemp("dpo_engines")
    data = write_jsonl(root / "pairs.jsonl", preference_rows(48))

    def run(name, strategy, extra=(), killed_after=None, launch_config=None):
        args = common_args(tiny_model, data, root / "results", name, "dpo") + [
            "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e-3",
            "--save_steps", "2", *extra]
        return run_engine(strategy, args, root / f"probe_{name}", killed_after, launch_config)

    ddp = run("ddp", "ddp")
    assert (ddp["info"]["engine"], ddp["info"]["distributed_type"]) == ("ddp", "MULTI_CPU")
    assert len(ddp["losses"]) == 3 and ddp["losses"][0] > ddp["losses"][-1]
    whole = ddp["ranks"][0]["held"]
    assert whole["weights"] == whole["full_weights"] and whole["optimizer_states"] == 2 * whole["weights"]  # AdamW
    return run, ddp, root


def first_held_out_answers(run: dict) -> list[str]:
    """The first held-out test prompt's answers before and after training (a job of one prompt per split: one
    process answers it, the other joins its generate calls under a sharded engine)."""
    sample = run_files.read_jsonl(run["final"].parent.parent / "samples_test.jsonl")[0]
    return [sample["reference_answer"], sample["trained_answer"]]


def assert_same_final_model(saved_dir: Path, expected_dir: Path, label: str) -> None:
    """The saved model's weights as from_pretrained loads them equal the expected run's to fp32 noise."""
    import torch

    saved, expected = final_weights(saved_dir), final_weights(expected_dir)
    assert saved.keys() == expected.keys(), label
    for key, tensor in expected.items():
        torch.testing.assert_close(saved[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{label} {key}")


def test_dpo_under_zero2_and_zero3_trains_as_ddp_does_each_rank_holding_its_share(dpo_engines, tiny_model):
    """DPO (packed forward), global batch 8 = 2 per device x 2 accumulation x 2 processes, 3 steps: DDP, ZeRO-2 and
    ZeRO-3 with the reference log-probs precomputed (TRL's inference engine under DeepSpeed, released before
    training: src/trainers/dpo.py), ZeRO-3 with the live reference (prepared by TRL as a sharded engine too). The
    ZeRO-3 job loses a worker right after checkpoint-2 and is launched again: it resumes from its sharded checkpoint
    (each rank's own partition of weights and optimizer states) to the uninterrupted DDP curve. Under ZeRO-3 the
    policy is partitioned as it loads (deepspeed.zero.Init: each rank holds half of it before any trainer exists),
    recorded as `weights_at_load`, and still trains to DDP's losses (its weights read from disk, not drawn)."""
    run, ddp, root = dpo_engines
    runs = {name: run(name, strategy, extra, killed_after) for name, strategy, extra, killed_after in (
        ("zero2", "zero2", [], None), ("zero3", "zero3", [], 2),
        # one held-out prompt per split over two processes: one generates, the other joins its generate calls
        ("zero3_live", "zero3", ["--precompute_ref_log_probs", "false", "--num_samples", "1"], None))}
    assert [resume["from_step"] for resume in runs["zero3"]["info"]["resumes"]] == [2]
    checkpoint = root / "results" / "zero3" / "model" / "checkpoint-2"
    assert sorted(path.name for path in checkpoint.glob("global_step2/*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    whole = ddp["ranks"][0]["held"]
    for name, stage in (("zero2", 2), ("zero3", 3), ("zero3_live", 3)):
        run = runs[name]
        assert (run["info"]["distributed_type"], run["info"]["engine"], run["info"]["zero_stage"]) == (
            "DEEPSPEED", "deepspeed", stage), name
        assert run["losses"] == pytest.approx(ddp["losses"], rel=1e-5), name
        assert run["info"]["one_job"]["identical_weights"] and run["info"]["one_job"]["disjoint_rows_per_step"]
        for rank in run["ranks"]:
            held = rank["held"]
            assert held["full_weights"] == whole["weights"], name
            assert held["optimizer_states"] == whole["optimizer_states"] // 2, name  # each rank its half
            assert held["weights"] == (whole["weights"] // 2 if stage == 3 else whole["weights"]), name
            # ZeRO-3: each rank read only its share as the model loaded (deepspeed.zero.Init), not all of it
            assert rank["loaded"] == {"weights": held["weights"], "full_weights": whole["weights"]}, name
            # sized by the model (hidden 32: 32 x 32), not DeepSpeed's 5e8 default (2 GB per ZeRO-3 rank)
            assert held["reduce_bucket"] == 32 * 32, name
        assert run["info"].get("weights_at_load") == ("partitioned" if stage == 3 else None), name
        assert_console_reads_as_ddp(run, ddp, name, f"DeepSpeed ZeRO-{stage}")
        if name == "zero3_live":
            assert [rank["held"]["reference_weights"] for rank in run["ranks"]] == [whole["weights"] // 2] * 2
        else:
            assert [rank["held"]["reference_weights"] for rank in run["ranks"]] == [None, None]
    assert first_held_out_answers(runs["zero3_live"]) == first_held_out_answers(ddp)
    # ZeRO-3's final model: the partitions gathered into ordinary safetensors, DDP's weights to fp32 noise
    assert_reloads_generates_and_changed(runs["zero3"]["final"], tiny_model)
    for name in ("zero2", "zero3"):
        assert_same_final_model(runs[name]["final"], ddp["final"], name)


def test_dpo_under_fsdp2_on_cpu_processes_trains_as_ddp_does_each_rank_holding_its_shard(dpo_engines, tiny_model):
    """DPO under FSDP2 (configs/accelerate/fsdp.yaml on CPU processes: src/engines.py `adopt_fsdp_on_cpu`), the
    DDP run's batch and steps: the reference precomputed, then live. The first job checkpoints sharded (the launch
    config's fsdp_state_dict_type set to SHARDED_STATE_DICT: each rank writes its own shard of the weights and of the
    optimizer states, covered by the checkpoint's manifest), loses a worker right after checkpoint-2 and resumes
    from it to the DDP curve; its final model is gathered whole into ordinary safetensors equal to DDP's."""
    from src.run_safety import checkpoint_manifest

    run, ddp, root = dpo_engines
    runs = {"fsdp": run("fsdp", "fsdp", killed_after=2),  # configs/accelerate/fsdp.yaml: sharded checkpoints
            "fsdp_live": run("fsdp_live", "fsdp", ["--precompute_ref_log_probs", "false", "--num_samples", "1"])}
    whole = ddp["ranks"][0]["held"]
    for name, fsdp in runs.items():
        assert (fsdp["info"]["distributed_type"], fsdp["info"]["engine"], fsdp["info"]["fsdp_version"]) == (
            "FSDP", "fsdp", 2), name
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5), name
        assert fsdp["info"]["one_job"]["identical_weights"] and fsdp["info"]["one_job"]["disjoint_rows_per_step"]
        for rank in fsdp["ranks"]:  # each rank its half: DTensor local shards of weights and AdamW's moments
            held = rank["held"]
            assert held["full_weights"] == whole["weights"], name
            assert (held["weights"], held["optimizer_states"]) == (whole["weights"] // 2,
                                                                   whole["optimizer_states"] // 2), name
        assert_same_final_model(fsdp["final"], ddp["final"], name)
        assert_console_reads_as_ddp(fsdp, ddp, name, "FSDP2")
    assert [resume["from_step"] for resume in runs["fsdp"]["info"]["resumes"]] == [2]
    checkpoint = root / "results" / "fsdp" / "model" / "checkpoint-2"
    listed = checkpoint_manifest.read_manifest(checkpoint)["files"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        shards = sorted(path.relative_to(checkpoint).as_posix() for path in (checkpoint / folder).glob("*.distcp"))
        assert shards == [f"{folder}/__0_0.distcp", f"{folder}/__1_0.distcp"] and set(shards) <= set(listed)
    assert checkpoint_manifest.verify(checkpoint, threads=1) is None
    shard = checkpoint / "optimizer_0" / "__1_0.distcp"  # rank 1's optimizer shard, one byte flipped: found
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "optimizer_0/__1_0.distcp" in checkpoint_manifest.verify(checkpoint, threads=1)
    assert_reloads_generates_and_changed(runs["fsdp"]["final"], tiny_model)
    # the live reference sharded as the policy is (TRL prepares it through the same accelerator)
    assert [rank["held"]["reference_weights"] for rank in runs["fsdp_live"]["ranks"]] == [whole["weights"] // 2] * 2
    assert first_held_out_answers(runs["fsdp_live"]) == first_held_out_answers(ddp)
    assert [rank["held"]["reference_weights"] for rank in runs["fsdp"]["ranks"]] == [None, None]


def test_lora_sft_under_zero1_zero2_zero3_and_fsdp2_trains_and_saves_the_adapter_ddp_does(tiny_model, tmp_path):
    """LoRA SFT, the same global batch on DDP, ZeRO-1, ZeRO-2, ZeRO-3 and FSDP2: the same loss curve, each rank half the
    adapter's optimizer states (ZeRO-3, FSDP2: half of every weight), and a saved adapter with every tensor whole and
    equal to DDP's (the empty adapter_model.safetensors ZeRO-3 leaves without its 16-bit gather). DDP and FSDP2 also
    merge it (--merge_adapter): FSDP2's merged model, merged from its base loaded whole since rank 0 holds only a
    shard (src/models.py), equals DDP's."""
    import torch
    from safetensors.torch import load_file

    rows = [{"messages": row["prompt"] + row["chosen"]} for row in preference_rows(48)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    runs = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        args = common_args(tiny_model, data, tmp_path / "results", strategy, "sft") + [
            "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e-3",
            "--use_lora", "true", "--merge_adapter", str(strategy in ("ddp", "fsdp")).lower()]
        runs[strategy] = run_engine(strategy, args, tmp_path / f"probe_{strategy}")
    whole = runs["ddp"]["ranks"][0]["held"]
    adapter = load_file(runs["ddp"]["final"] / "adapter_model.safetensors")
    assert adapter and all(tensor.numel() for tensor in adapter.values())
    assert all(tensor.abs().max() > 0 for key, tensor in adapter.items() if "lora_B" in key)  # trained: B starts at 0
    for strategy, engine, shards_weights in (("zero1", ("deepspeed", 1), False), ("zero2", ("deepspeed", 2), False),
                                             ("zero3", ("deepspeed", 3), True), ("fsdp", ("fsdp", 2), True)):
        run = runs[strategy]
        assert (run["info"]["engine"], run["info"].get("zero_stage", run["info"].get("fsdp_version"))) == engine
        assert run["info"].get("weights_at_load") == ("partitioned" if strategy == "zero3" else None), strategy
        assert run["losses"] == pytest.approx(runs["ddp"]["losses"], rel=1e-5), strategy
        assert [rank["held"]["optimizer_states"] for rank in run["ranks"]] == [whole["optimizer_states"] // 2] * 2
        assert run["ranks"][0]["held"]["weights"] == whole["weights"] // (2 if shards_weights else 1)
        saved = load_file(run["final"] / "adapter_model.safetensors")
        assert saved.keys() == adapter.keys(), strategy
        for key, tensor in adapter.items():
            # Adam divides each update by the gradient's own size: an element whose gradient is fp32 noise, summed
            # in another order, moves by more than fp32 rounding (measured: 1.1e-7 here, 8e-6 at a 1e-2 rate)
            torch.testing.assert_close(saved[key], tensor, rtol=1e-5, atol=1e-5, msg=f"{strategy} {key}")
    assert_same_final_model(runs["fsdp"]["final"].parent / "merged", runs["ddp"]["final"].parent / "merged", "merged")


def test_lora_dpo_under_zero3_zero2_and_fsdp2_trains_and_saves_the_adapter_one_ddp_process_does(tiny_model, tmp_path):
    """LoRA DPO with its reference log-probs cached, global batch 8 on one DDP process (8 per device) and on 2 x 4
    under ZeRO-3, ZeRO-2 and FSDP2, and under FSDP2 with the reference live: the same losses and grad norms (the first
    step to fp32 summation order, 1e-6; every step 1e-5) and a saved adapter, every tensor whole, equal to one
    process's. ZeRO-3 runs first and computes the reference cache (its key over the base weights, each gathered as it
    is read: before the fix, TRL's hash of the LoRA weights, which require grad, ended both ranks); every later run
    reuses it, its key the same, and every first loss is ln 2 (the reference is the starting policy: the base, LoRA's
    B at zero). Under FSDP2 each rank loaded only its half of the model, its adapters added as it loaded, and the
    reference is the base with the adapters disabled (TRL's copy of them into a "ref" adapter skipped:
    src/trainers/base.py `reference_is_the_base`; before, the model loaded whole on every rank)."""
    import math

    import torch
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(48, seed=5))  # its own prepared data and cache
    runs = {}
    for name, strategy, nproc, extra in (("zero3", "zero3", 2, []), ("ddp1", "ddp", 1, []), ("zero2", "zero2", 2, []),
                                         ("fsdp", "fsdp", 2, []),
                                         ("fsdp_live", "fsdp", 2, ["--precompute_ref_log_probs", "false"])):
        args = common_args(tiny_model, data, tmp_path / "results", name, "dpo") + [
            "--batch_size", "8", "--max_steps", "3", "--learning_rate", "1e-3", "--use_lora", "true",
            "--num_samples", "0", *extra]
        runs[name] = run_engine(strategy, args, tmp_path / f"probe_{name}", nproc=nproc)
    one = runs["ddp1"]
    adapter = load_file(one["final"] / "adapter_model.safetensors")
    assert adapter and all(tensor.numel() for tensor in adapter.values())
    assert [run["info"].get("reference_log_probs", {}).get("train", {}).get("cache") for run in runs.values()] == [
        "computed", "reused", "reused", "reused", None]
    for name, run in runs.items():
        assert run["info"]["per_device_batch_size"] == (8 if name == "ddp1" else 4), name
        assert run["losses"][0] == pytest.approx(math.log(2), rel=1e-7), name
        assert run["losses"][0] == pytest.approx(one["losses"][0], rel=1e-6), name
        assert run["grad_norms"][0] == pytest.approx(one["grad_norms"][0], rel=1e-6), name
        assert run["losses"] == pytest.approx(one["losses"], rel=1e-5), name
        assert run["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5), name
        saved = load_file(run["final"] / "adapter_model.safetensors")
        assert saved.keys() == adapter.keys(), name
        for key, tensor in adapter.items():
            torch.testing.assert_close(saved[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
    whole = one["ranks"][0]["held"]["full_weights"]  # the base and its adapters, as one process trained them
    for name in ("fsdp", "fsdp_live"):
        assert not [line for line in runs[name]["console"] if "loads whole" in line], name
        for rank in runs[name]["ranks"]:  # its half of every weight as it loaded, and no reference model but the base
            assert (rank["loaded"]["weights"], rank["loaded"]["full_weights"]) == (whole // 2, whole), name
            assert rank["held"]["reference_weights"] is None, name


def test_lora_kto_and_grpo_with_a_reference_under_fsdp2_load_sharded_and_train_as_ddp_does(tiny_model, tmp_path):
    """LoRA KTO (its reference log-probs precomputed) and LoRA GRPO with its KL term (--beta 0.1) under FSDP2 against
    plain DDP, 2 steps at the same global batch: the same losses (GRPO: the same rewards and KL). Each rank loaded only
    its half of the model, its adapters added as it loaded, and there is no reference model: the reference is the base
    with the adapters disabled (src/trainers/base.py `reference_is_the_base`). Before: KTO loaded whole on every rank
    (one line said so); GRPO stopped in TRL's copy of the sharded adapters into a "ref" adapter of its own."""
    from test_grpo import grpo_args, prompt_rows

    pairs = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(40, seed=2))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(24))
    lora = ["--use_lora", "true", "--num_samples", "0"]
    arguments = {
        "kto": lambda name: common_args(tiny_model, pairs, tmp_path / "results", name, "kto") + lora + [
            "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "2", "--learning_rate", "1e-3",
            "--kto_from_pairs", "true"],
        "grpo": lambda name: grpo_args(tiny_model, prompts, tmp_path / "results", name, *lora),
    }
    for stage, args_for in arguments.items():
        ddp, fsdp = (run_engine(strategy, args_for(f"{stage}_{strategy}"), tmp_path / f"probe_{stage}_{strategy}")
                     for strategy in ("ddp", "fsdp"))
        whole = ddp["ranks"][0]["held"]["full_weights"]  # the base and its adapters
        assert len(ddp["losses"]) == 2 and fsdp["info"]["engine"] == "fsdp", stage
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5, abs=1e-7), stage
        assert not [line for line in fsdp["console"] if "loads whole" in line], stage
        for rank in fsdp["ranks"]:
            assert (rank["loaded"]["weights"], rank["loaded"]["full_weights"]) == (whole // 2, whole), stage
            assert rank["held"]["reference_weights"] is None, stage
        if stage == "grpo":
            kl = {name: [record["kl"] for record in run_files.read_jsonl(run["final"].parent.parent / run_files.METRICS)
                         if "loss" in record] for name, run in (("ddp", ddp), ("fsdp", fsdp))}
            assert kl["fsdp"] == pytest.approx(kl["ddp"], rel=1e-5, abs=1e-9) and any(kl["ddp"]), kl


def test_dpo_with_a_chat_template_from_another_tokenizer_loads_sharded_under_fsdp2_and_trains_as_ddp_does(
        tiny_model, tmp_path):
    """DPO with --chat_template_path from a tokenizer whose template brings a new special token (in every prompt),
    under FSDP2 (the reference precomputed) and DDP (the reference live), 2 steps at the same global batch: the same
    losses. Under FSDP2 the policy is built at the template's vocabulary as it loads, each rank holding half, and the
    reference the precompute pass runs (the toolkit loads it) is resized the same way: the same new rows, drawn from
    the run's seed (src/sharded_weights.py `resized_reader`). DDP's live reference is the toolkit's, resized too.
    Before: under FSDP2 the policy loaded whole on every rank (one line said so), then the unresized reference ended
    both jobs in "IndexError: index out of range in self"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import CHAT_TEMPLATE

    source = AutoTokenizer.from_pretrained(tiny_model)
    source.add_special_tokens({"additional_special_tokens": ["<|turn|>"]})
    source.chat_template = CHAT_TEMPLATE.replace("<|user|>", "<|turn|><|user|>")
    source.save_pretrained(tmp_path / "source")
    pairs = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(40, seed=4))
    runs = {strategy: run_engine(strategy, common_args(tiny_model, pairs, tmp_path / "results", strategy, "dpo") + [
        "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "2", "--learning_rate", "1e-3",
        "--num_samples", "0", "--chat_template_path", str(tmp_path / "source"), "--precompute_ref_log_probs",
        str(strategy == "fsdp").lower()], tmp_path / f"probe_{strategy}") for strategy in ("ddp", "fsdp")}
    whole = runs["ddp"]["ranks"][0]["held"]["full_weights"]
    # resized: more rows than the checkpoint's
    assert whole > sum(parameter.numel() for parameter in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert runs["fsdp"]["losses"] == pytest.approx(runs["ddp"]["losses"], rel=1e-5), runs["fsdp"]["losses"]
    assert not [line for line in runs["fsdp"]["console"] if "loads whole" in line]
    for rank in runs["fsdp"]["ranks"]:
        assert (rank["loaded"]["weights"], rank["loaded"]["full_weights"]) == (whole // 2, whole)


def test_kto_simpo_orpo_and_grpo_under_zero3_and_fsdp2_train_as_ddp_does(tiny_model, tmp_path):
    """Each objective's own trainer under ZeRO-3 and FSDP2 against plain DDP, 2 steps at the same global batch: the
    same loss curve (GRPO: the same rewards, so the same sampled answers, and KL), each rank half the weights and
    optimizer states, and half a live reference (KTO here precomputes its reference; GRPO keeps one live). Under ZeRO-3
    each rank read only its half of the policy as it loaded, and KTO's reference cache, keyed by the whole weights,
    is the DDP run's, reused. GRPO's reference (--beta 0.1) is loaded by the toolkit, each rank reading its half, and
    TRL runs that one (src/trainers/grpo.py `reference_handed_in`; before, TRL loaded it whole on every rank)."""
    from test_grpo import grpo_args, prompt_rows

    pairs = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(40, seed=2))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(24))
    short = ["--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "2", "--learning_rate", "1e-3",
             "--num_samples", "0"]
    arguments = {
        "kto": lambda name: common_args(tiny_model, pairs, tmp_path / "results", name, "kto") + short + [
            "--kto_from_pairs", "true"],
        "simpo": lambda name: common_args(tiny_model, pairs, tmp_path / "results", name, "simpo") + short,
        "orpo": lambda name: common_args(tiny_model, pairs, tmp_path / "results", name, "orpo") + short,
        "grpo": lambda name: grpo_args(tiny_model, prompts, tmp_path / "results", name, "--num_samples", "0"),
    }
    for stage, args_for in arguments.items():
        runs = {strategy: run_engine(strategy, args_for(f"{stage}_{strategy}"), tmp_path / f"probe_{stage}_{strategy}")
                for strategy in ("ddp", "zero3", "fsdp")}
        ddp = runs["ddp"]
        whole = ddp["ranks"][0]["held"]
        assert len(ddp["losses"]) == 2, stage
        for strategy, engine in (("zero3", ("deepspeed", 3)), ("fsdp", ("fsdp", 2))):
            sharded = runs[strategy]
            label = f"{stage} {strategy}"
            assert (sharded["info"]["engine"], sharded["info"].get("zero_stage", sharded["info"].get(
                "fsdp_version"))) == engine, label
            assert sharded["losses"] == pytest.approx(ddp["losses"], rel=1e-5, abs=1e-7), label
            assert sharded["info"].get("weights_at_load") == ("partitioned" if strategy == "zero3" else None), label
            for rank in sharded["ranks"]:
                held = rank["held"]
                assert (held["weights"], held["optimizer_states"]) == (whole["weights"] // 2,
                                                                       whole["optimizer_states"] // 2), label
                if strategy == "zero3":  # each rank read its share only as the policy loaded
                    assert rank["loaded"]["weights"] == whole["weights"] // 2, label
                if stage == "grpo":  # its reference (the KL term) loaded by the toolkit, each rank reading its half,
                    # and run by TRL in place of the one it would load whole on every rank
                    assert rank["loaded_reference"]["weights"] == whole["weights"] // 2, label
                    assert rank["loaded_reference"]["kept_as_given"], label
            if (stage, strategy) == ("kto", "zero3"):  # its reference cache keyed by the whole weights: DDP's, reused
                assert sharded["info"]["reference_log_probs"]["train"]["cache"] == "reused", label
                assert held["reference_weights"] == (whole["reference_weights"] // 2 if whole["reference_weights"]
                                                     else None), label
        if stage == "grpo":
            metrics = {strategy: [record for record in run_files.read_jsonl(
                run["final"].parent.parent / run_files.METRICS) if "loss" in record] for strategy, run in runs.items()}
            for strategy in ("zero3", "fsdp"):
                assert [record["reward"] for record in metrics[strategy]] == [
                    record["reward"] for record in metrics["ddp"]], strategy
                assert [record["kl"] for record in metrics[strategy]] == pytest.approx(
                    [record["kl"] for record in metrics["ddp"]], rel=1e-5, abs=1e-9), strategy



def test_zero3_loads_partitioned_only_where_its_launch_config_keeps_zero3_init(monkeypatch, tmp_path):
    """In the pytest process, no processes: `partitioned_loading` lets transformers see ZeRO-3 (so from_pretrained
    loads inside deepspeed.zero.Init) for the block only, under a ZeRO-3 launch with zero3_init_flag; a ZeRO-2 launch or
    zero3_init_flag off load whole, a stage that loaded whole under ZeRO-3 says so with the switch to flip, and a
    model that cannot be built inside zero.Init stops in one line naming it."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    from src.engines import DEEPSPEED, Engine, load_warning, loading_whole, partitioned, partitioned_loading
    from src.judges import RewardModelJudge
    from test_judges import build_reward_model

    reward_model = build_reward_model(tmp_path / "reward_model")
    for name, value in accelerate_environment("zero3").items():
        monkeypatch.setenv(name, value)
    with partitioned_loading("fp32") as partitioning:
        assert partitioning and is_deepspeed_zero3_enabled()
        # a model one rank loads alone (the reward-model judge on rank 0) loads whole, and ZeRO-3 is seen again after
        with loading_whole():
            assert not is_deepspeed_zero3_enabled()
        judge = RewardModelJudge(reward_model, device="cpu")
        assert is_deepspeed_zero3_enabled() and not partitioned(judge.model.parameters())
    assert not is_deepspeed_zero3_enabled()  # after the load: nothing else sees ZeRO-3 before the trainer
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false")
    with partitioned_loading("fp32") as partitioning:
        assert not partitioning and not is_deepspeed_zero3_enabled()
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    with partitioned_loading("fp32") as partitioning:
        assert not partitioning
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")
    assert_zero_init_failure_names_the_switch(monkeypatch)
    assert "zero3_init_flag: true" in load_warning(Engine(DEEPSPEED, 3), loaded_partitioned=False)
    assert load_warning(Engine(DEEPSPEED, 3), loaded_partitioned=True) is None
    assert load_warning(Engine(DEEPSPEED, 2), loaded_partitioned=False) is None


def assert_zero_init_failure_names_the_switch(monkeypatch) -> None:
    """A model whose code fails while transformers builds it inside deepspeed.zero.Init: one line with the switch that
    loads it whole instead (from_pretrained stood in for: no process group in the pytest process)."""
    from types import SimpleNamespace

    import transformers

    from src.config import ModelArguments
    from src.models import ModelError, load_model

    def fails_under_zero_init(*args, **kwargs):
        raise RuntimeError("a custom layer's __init__ reads a weight's shape\nmore")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fails_under_zero_init)
    with pytest.raises(ModelError) as raised:
        load_model("some/model", ModelArguments(model_name_or_path="some/model"),
                   SimpleNamespace(precision="fp32", device="cpu"), SimpleNamespace(local_rank=0, world_size=1))
    assert str(raised.value) == (
        "--model_name_or_path some/model: could not load the model (a custom layer's __init__ reads a weight's shape); "
        "its code may not build under deepspeed.zero.Init: set zero3_init_flag: false in the launch config (every rank "
        "then loads it whole)")
