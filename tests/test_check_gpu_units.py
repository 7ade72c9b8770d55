"""check_gpu.py's pure pieces: input parsing, memory formulas (worked out by hand), topology labels and NCCL's
transport rule, CUDA's device numbering, nccl.conf precedence, bus bandwidth."""

import ctypes
from dataclasses import replace
import inspect

import pynvml
import pytest

from src.diagnostics.bandwidth import bus_bandwidth
from src.diagnostics.devices import cuda_view
from src.objectives import STAGES, final_stage
from src.plan import stage_plans
from src.world import Devices, World
from src.diagnostics.inputs import (InputError, TrainingSetup, parse_launch_arguments, parse_param_count, training_setup,
                                   with_plan)
from src.diagnostics.memory_plan import (
    activation_bytes_per_sample,
    host_load_bytes,
    largest_tensor_params,
    adapter_activation_bytes_per_sample,
    GIB,
    largest_batch,
    lora_trainable_params,
    model_state_bytes,
    plan_memory,
    reference_bytes,
    with_margin,
)
from src.diagnostics.model_shape import ModelShape, shape_from_param_count
from src.diagnostics.nvml_probe import GpuFacts, PairFacts, normalise_bus_id
from src.diagnostics.software import SoftwareFacts, effective_nccl_settings, read_nccl_conf
from src.diagnostics.topology import cpu_ranges, link_label, nccl_transport, p2p_label, p2p_level

from fakes.fake_pynvml import FakeGpu, FakeMachine, implemented_functions, make_fake_pynvml


# --- inputs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, count",
    [("7e9", 7_000_000_000), ("1.5B", 1_500_000_000), ("350M", 350_000_000), ("70b", 70_000_000_000), ("7000000000", 7_000_000_000)],
)
def test_param_counts_parse(text, count):
    assert parse_param_count(text) == count


@pytest.mark.parametrize("text", ["abc", "7", "", "7 billion", "-7e9"])
def test_bad_param_counts_name_the_flag(text):
    with pytest.raises(InputError, match="--params"):
        parse_param_count(text)


def setup_for(*arguments):
    """check_gpu's settings from launcher flags, through the launcher's parser (src/config.py)."""
    return training_setup(parse_launch_arguments(list(arguments)))


def launch_plan(arguments, processes):
    """The launcher's plan of the final stage for `processes` CPU processes (what check_gpu resolves)."""
    config = parse_launch_arguments(list(arguments))
    return stage_plans(config, World(world_size=processes, local_world_size=processes), Devices("cpu"))[-1][2]


def test_recipe_keys_are_read_and_flags_win(tmp_path):
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(
        "model_name_or_path: some/model\nuse_lora: true\nlora_r: 64\nlora_target_modules: [q_proj, v_proj]\n"
        "batch_size: 32\nmax_length: 2048\nlearning_rate: 5.0e-7\nbeta: 0.1\n"
    )
    setup = setup_for("--config", str(recipe), "--max_length", "512")
    assert (setup.model_name_or_path, setup.lora_r, setup.lora_target_modules) == ("some/model", 64, ["q_proj", "v_proj"])
    assert setup.max_length == 512  # the flag overrides the recipe
    assert setup.method == "lora" and setup.method_chosen
    plan = launch_plan(["--config", str(recipe)], 4)
    assert (plan.per_device_batch_size, plan.gradient_accumulation_steps) == (8, 1)  # the global 32 over 4
    assert with_plan(setup, plan).batch_source == "batch_size 32 / 4 processes"


def test_qlora_in_a_recipe_is_lora_on_a_4bit_base(tmp_path):
    recipe = tmp_path / "qlora.yaml"
    recipe.write_text("use_lora: true\nload_in_4bit: true\nmicro_batch_size: 2\n")
    setup = setup_for("--config", str(recipe))
    assert setup.use_lora and setup.method == "qlora"
    plan = launch_plan(["--config", str(recipe)], 8)  # the default global batch 32: 4 per process, capped at 2
    assert (plan.per_device_batch_size, plan.gradient_accumulation_steps) == (2, 2)
    assert with_plan(setup, plan).batch_source == "batch_size 32 / 8 processes / 2 accumulation"


def test_reference_log_probs_are_precomputed_unless_the_recipe_moves_the_reference(tmp_path):
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text("stage: dpo\n")
    assert setup_for("--config", str(recipe)).precompute_ref_log_probs  # the toolkit's default
    recipe.write_text("stage: dpo\nsync_ref_model: true\n")  # TR-DPO: a reference model stays in memory
    assert not setup_for("--config", str(recipe)).precompute_ref_log_probs
    assert setup_for("--config", str(recipe), "--precompute_ref_log_probs", "true").precompute_ref_log_probs


def test_every_stage_of_the_launcher_is_taken():
    """One list of stages (src/config.py): reward and KTO included; a pipeline is planned by its final stage."""
    assert [setup_for("--stage", stage).stage for stage in STAGES][:6] == ["dpo", "sft", "dpo", "reward", "kto", "kto"]
    assert [setup_for("--stage", stage).stage for stage in STAGES] == [final_stage(stage) for stage in STAGES]


@pytest.mark.parametrize(
    "content, message",
    [("stage: ppo\n", f"stage must be one of {', '.join(STAGES)}, got 'ppo'"),  # every stage of the table
     ("- a\n- b\n", "a recipe is a mapping"), ("max_length: [\n", "not valid YAML"), ("lora_r: 0\n", "--lora_r")],
)
def test_bad_recipes_say_what_is_wrong(tmp_path, content, message):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(content)
    with pytest.raises(InputError, match=message.replace("[", r"\[")):
        setup_for("--config", str(recipe))


def test_missing_recipe_names_the_flag():
    with pytest.raises(InputError, match="--config: nowhere.yaml does not exist"):
        setup_for("--config", "nowhere.yaml")


# --- memory formulas, on a shape small enough to work out by hand ------------------------------------------------


@pytest.fixture
def tiny_shape():
    """2 layers, hidden 4, intermediate 8, vocab 10; linear layers as in a Llama block."""
    layers = []
    for layer in range(2):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            layers.append((f"model.layers.{layer}.self_attn.{name}", 4, 4))
        layers += [(f"model.layers.{layer}.mlp.gate_proj", 4, 8), (f"model.layers.{layer}.mlp.up_proj", 4, 8)]
        layers.append((f"model.layers.{layer}.mlp.down_proj", 8, 4))
    return ModelShape(
        name="tiny",
        source="by hand",
        exact=True,
        total_params=1000,
        num_layers=2,
        hidden_size=4,
        intermediate_size=8,
        kv_size=4,
        vocab_size=10,
        embedding_params=80,
        largest_layer_params=200,
        linear_layers=layers,
    )


def test_lora_trainable_params(tiny_shape):
    # per layer: q,k,v,o 4 * r(4+4) = 64 at r=2; gate, up 2 * 2(4+8) = 48; down 2(8+4) = 24 -> 136; two layers 272
    assert lora_trainable_params(tiny_shape, "all-linear", 2) == 272
    # q and v only: 2 * 2(4+4) = 32 per layer
    assert lora_trainable_params(tiny_shape, ["q_proj", "v_proj"], 2) == 64
    # a key matches a name's last component, not a substring of it
    assert lora_trainable_params(tiny_shape, ["proj"], 2) == 0


def test_model_state_per_method(tiny_shape):
    """P = 1000, N = 4, 16-bit, T = 272 LoRA parameters, linear weights 2 * (4*16 + 2*32 + 32) = 320; hidden 4, so
    DeepSpeed's reduce bucket is 16 gradient elements; the largest layer 200 parameters."""
    assert model_state_bytes("full", tiny_shape, 0, 4, 2) == 22_000  # 4 + 2 (autocast's copy) + 4 + 4 (buckets) + 8
    assert model_state_bytes("full", tiny_shape, 0, 4, 4) == 20_000  # fp32: no 16-bit copy
    assert model_state_bytes("lora", tiny_shape, 272, 4, 2) == 2_000 + 272 * 16
    assert model_state_bytes("qlora", tiny_shape, 272, 4, 2) == int(320 * 0.55) + 680 * 2 + 272 * 16
    assert model_state_bytes("zero1", tiny_shape, 0, 4, 2) == 2_000 + 16_000 // 4 + 16 * 2
    assert model_state_bytes("zero2", tiny_shape, 0, 4, 2) == 2_000 + 16_000 // 4 + 16 * 2  # 2P + 16P/N
    assert model_state_bytes("zero2", tiny_shape, 0, 4, 4) == 4_000 + 16_000 // 4 + 16 * 4  # fp32: 4P + 16P/N
    assert model_state_bytes("zero3", tiny_shape, 0, 4, 2) == 20_000 // 4 + 16 * 2 + 4 * 200  # 20P/N
    assert model_state_bytes("zero3", tiny_shape, 0, 4, 4) == 24_000 // 4 + 16 * 4 + 8 * 200  # fp32: 24P/N
    assert model_state_bytes("fsdp", tiny_shape, 0, 4, 4) == 16_000 // 4 + 8 * 200  # fp32 shards either way
    assert model_state_bytes("fsdp", tiny_shape, 0, 4, 2) == 16_000 // 4 + 4 * 200


def test_host_memory_per_rank_while_the_model_loads(tiny_shape):
    """P = 1000, N = 4, a 16-bit checkpoint; the largest tensor the embeddings, 10 x 4 = 40 (the widest linear layer
    4 x 8 = 32). Whole loads hold the fp32 weights and the checkpoint's pages,
    6P; a sharded load a share of one tensor's checkpoint bytes (2 x 40 / 4 = 20) on a GPU host, plus its share of the
    fp32 weights (4P/N) on CPU processes, and under ZeRO-3 the largest tensor built whole once (4 x 40)."""
    assert largest_tensor_params(tiny_shape) == 40
    for method in ("full", "lora", "zero1", "zero2"):
        assert host_load_bytes(method, tiny_shape, 4, "gpu") == 6_000 == host_load_bytes(method, tiny_shape, 4, "cpu")
    assert host_load_bytes("qlora", tiny_shape, 4, "gpu") == 80
    assert host_load_bytes("fsdp", tiny_shape, 4, "gpu") == host_load_bytes("zero3", tiny_shape, 4, "gpu") == 20
    assert host_load_bytes("fsdp", tiny_shape, 4, "cpu") == 1_000 + 20
    assert host_load_bytes("zero3", tiny_shape, 4, "cpu") == 1_000 + 20 + 160


def test_reference_model_only_for_full_dpo_without_precomputed_log_probs(tiny_shape):
    assert reference_bytes("full", TrainingSetup(stage="dpo"), tiny_shape, 4, 2) == 0  # the toolkit precomputes them
    dpo = TrainingSetup(stage="dpo", precompute_ref_log_probs=False)
    assert reference_bytes("full", dpo, tiny_shape, 4, 2) == 2_000  # a 16-bit copy on every GPU
    assert reference_bytes("zero2", dpo, tiny_shape, 4, 2) == 2_000
    assert reference_bytes("zero3", dpo, tiny_shape, 4, 2) == 500  # sharded only under ZeRO-3 and FSDP
    assert reference_bytes("fsdp", dpo, tiny_shape, 4, 2) == 500
    assert reference_bytes("lora", dpo, tiny_shape, 4, 2) == 0  # adapters disabled = the reference
    assert reference_bytes("full", TrainingSetup(precompute_ref_log_probs=True), tiny_shape, 4, 2) == 0
    assert reference_bytes("full", TrainingSetup(stage="sft"), tiny_shape, 4, 2) == 0


def test_activations_per_sample(tiny_shape):
    """Per token per layer in 16-bit: 12*4 + 4*4 + 8*8 = 128 bytes; logits 10 * (2 + 8) = 100 bytes per token."""
    dpo = TrainingSetup(stage="dpo", max_length=3, gradient_checkpointing=False)
    assert activation_bytes_per_sample(tiny_shape, dpo, 2) == 6 * (2 * 128 + 100)  # chosen + rejected: 6 tokens
    checkpointed = TrainingSetup(stage="dpo", max_length=3, gradient_checkpointing=True)
    # only each layer's 16-bit input (2 * 4 bytes) is kept, plus one layer recomputed in backward
    assert activation_bytes_per_sample(tiny_shape, checkpointed, 2) == 6 * (2 * 2 * 4 + 128 + 100)
    reward = TrainingSetup(stage="reward", max_length=3, gradient_checkpointing=False)
    assert activation_bytes_per_sample(tiny_shape, reward, 2) == 6 * (2 * 128)  # a pair, a one-number score head
    sft_fp32 = TrainingSetup(stage="sft", max_length=3, gradient_checkpointing=False)
    assert activation_bytes_per_sample(tiny_shape, sft_fp32, 4) == 3 * (2 * 256 + 10 * 12)


def test_lora_activations_per_sample(tiny_shape):
    """Per token per layer, 16-bit, r=2, all seven linears adapted: inputs 4*4 (q, k, v, o) + 4*2 (gate, up) + 8 (down)
    = 32 elements, each a dropped-out 2-byte copy plus a 1-byte mask = 96 bytes, and 7 adapters * r 2 * 2 bytes = 28:
    124 bytes, two layers, 6 tokens of a pair. Without dropout only the 28; checkpointed, one layer's worth; adapting
    q_proj alone: 4 * 3 + 2 * 2 = 16 bytes a layer."""
    dpo = TrainingSetup(stage="dpo", max_length=3, lora_r=2, lora_dropout=0.05)
    assert adapter_activation_bytes_per_sample(tiny_shape, dpo, 2) == 6 * 2 * 124
    assert adapter_activation_bytes_per_sample(tiny_shape, replace(dpo, lora_dropout=0.0), 2) == 6 * 2 * 28
    assert adapter_activation_bytes_per_sample(tiny_shape, replace(dpo, gradient_checkpointing=True), 2) == 6 * 124
    assert adapter_activation_bytes_per_sample(tiny_shape, replace(dpo, lora_target_modules=["q_proj"]), 2) == 6 * 2 * 16
    plan = plan_memory(tiny_shape, replace(dpo, per_device_batch_size=4, precision="bf16"), num_devices=1, device_kind="cuda",
                       budget_bytes=80 * GIB, budget_source="test", deepspeed_installed=False)
    by_method = {estimate.method: estimate.activation_bytes for estimate in plan.estimates}
    assert by_method["lora"] - by_method["full"] == by_method["qlora"] - by_method["full"] == 4 * 6 * 2 * 124


@pytest.mark.parametrize("static, per_sample, budget", [(0, 10 * 1024**2, 3 * GIB), (5 * GIB, 3 * 1024**2, 40 * GIB), (2 * GIB, 1, 4 * GIB)])
def test_largest_batch_is_the_last_that_fits(static, per_sample, budget):
    batch = largest_batch(static, per_sample, budget)
    assert with_margin(static + batch * per_sample) <= budget < with_margin(static + (batch + 1) * per_sample)


def test_largest_batch_is_zero_when_the_model_alone_does_not_fit():
    assert largest_batch(100 * GIB, 1024, 80 * GIB) == 0


def test_the_data_audits_lengths_set_the_tokens_per_sequence_and_a_plan_that_fits_only_at_its_max_length_says_so():
    """A LoRA 7B DPO (gradient checkpointing, batch 4) at max_length 16384 on 80 GiB: the data's longest (40,000
    tokens) is cut to max_length, so the plan stays at 16384 and does not fit (activations grow linearly in the
    tokens: 16384 / 2048 = 8x the suggested length's); at the audit's --max_length 2048 (99% of the data whole, 0.2%
    cut: under the 5% warning) it fits, and the does_not_fit fix says so. With the longest under max_length, the plan
    counts the longest."""
    from types import SimpleNamespace

    from src.diagnostics.data_lengths import DataLengths
    from src.diagnostics.problems.run_request import max_length_cuts_data, memory_fit

    lengths = DataLengths(longest_tokens=40000, suggested_max_length=2048, truncated_share=0.002,
                          reasoning_share=1.0, reasoning_cut_share=0.001, reasoning="keep", packed=False,
                          source="the data audit of the prepared data in /cache/dpo-x")
    setup = TrainingSetup(stage="dpo", use_lora=True, method_chosen=True, max_length=16384, per_device_batch_size=4,
                          gradient_checkpointing=True, precision="bf16", data_lengths=lengths)
    shape = shape_from_param_count(7_000_000_000)
    plan = plan_memory(shape, setup, num_devices=8, device_kind="gpu", budget_bytes=80 * GIB, budget_source="test",
                       deepspeed_installed=False)
    assert plan.sequence_tokens == 16384 and not plan.chosen().fits
    at_suggested = plan.at_suggested_max_length
    assert at_suggested.method == "lora" and at_suggested.fits
    assert at_suggested.activation_bytes * 8 == pytest.approx(plan.chosen().activation_bytes, rel=1e-6)
    machine = SimpleNamespace(memory_plan=plan, launch_gpus=[0])
    (problem,) = memory_fit(machine)
    assert "16384 tokens per sequence (the data audit's longest within max_length 16384)" in problem.what
    assert problem.fix.startswith("--max_length 2048 keeps 99% of the data whole (the data audit of the prepared data "
                                  "in /cache/dpo-x): LoRA r=16 needs about") and "(fits, max batch" in problem.fix
    assert max_length_cuts_data(machine) == []
    short = plan_memory(shape, replace(setup, data_lengths=replace(lengths, longest_tokens=3000)), num_devices=8,
                        device_kind="gpu", budget_bytes=80 * GIB, budget_source="test", deepspeed_installed=False)
    assert short.sequence_tokens == 3000 and short.chosen().fits


def test_assumed_shape_has_the_requested_size():
    shape = shape_from_param_count(7_000_000_000)
    assert shape.total_params == 7_000_000_000 and not shape.exact
    assert shape.hidden_size == 4096  # nearest well-known model: Llama-2-7B
    assert abs(sum(d_in * d_out for _name, d_in, d_out in shape.linear_layers) + shape.embedding_params - 7e9) < 0.05 * 7e9


# --- topology and NCCL's transport rule ---------------------------------------------------------------------------

OK, GNS = pynvml.NVML_P2P_STATUS_OK, pynvml.NVML_P2P_STATUS_GPU_NOT_SUPPORTED


def pair(ancestor=pynvml.NVML_TOPOLOGY_SINGLE, p2p=OK, nvlinks=0):
    return PairFacts(0, 1, ancestor, p2p, p2p, nvlinks)


@pytest.mark.parametrize(
    "ancestor, nvlinks, label",
    [
        (pynvml.NVML_TOPOLOGY_SINGLE, 0, "PIX"),
        (pynvml.NVML_TOPOLOGY_MULTIPLE, 0, "PXB"),
        (pynvml.NVML_TOPOLOGY_HOSTBRIDGE, 0, "PHB"),
        (pynvml.NVML_TOPOLOGY_NODE, 0, "NODE"),
        (pynvml.NVML_TOPOLOGY_SYSTEM, 0, "SYS"),
        (pynvml.NVML_TOPOLOGY_SYSTEM, 18, "NV18"),  # NVLink wins, as in nvidia-smi topo -m
    ],
)
def test_matrix_labels(ancestor, nvlinks, label):
    assert link_label(pair(ancestor, nvlinks=nvlinks)) == label


def test_p2p_labels_report_the_failing_direction():
    assert p2p_label(pair()) == "OK"
    assert p2p_label(PairFacts(0, 1, 10, OK, pynvml.NVML_P2P_STATUS_NOT_SUPPORTED, 0)) == "NS"
    assert p2p_label(pair(p2p=pynvml.NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED)) == "TNS"
    assert p2p_label(pair(p2p=None)) == "U"


@pytest.mark.parametrize(
    "the_pair, settings, cpu_vendor, kind",
    [
        (pair(nvlinks=12), {}, "GenuineIntel", "P2P/NVLink"),
        (pair(pynvml.NVML_TOPOLOGY_MULTIPLE), {}, "GenuineIntel", "P2P/PCIe"),  # PXB: within the default level
        (pair(pynvml.NVML_TOPOLOGY_HOSTBRIDGE), {}, "GenuineIntel", "SHM"),  # PHB: beyond it
        (pair(pynvml.NVML_TOPOLOGY_NODE), {}, "GenuineIntel", "SHM"),  # NCCL calls NODE PHB too
        (pair(pynvml.NVML_TOPOLOGY_HOSTBRIDGE), {}, "AuthenticAMD", "P2P/PCIe"),  # AMD, 2 GPUs: level SYS
        (pair(p2p=GNS), {}, "GenuineIntel", "SHM"),  # within the level but the driver says no
        (pair(nvlinks=4, p2p=GNS), {}, "GenuineIntel", "fails"),  # NCCL aborts on broken NVLink P2P
        (pair(nvlinks=4, p2p=GNS), {"NCCL_IGNORE_DISABLED_P2P": "1"}, "GenuineIntel", "SHM"),
        (pair(nvlinks=18), {"NCCL_P2P_DISABLE": "1"}, "GenuineIntel", "SHM"),
        (pair(p2p=GNS), {"NCCL_SHM_DISABLE": "1"}, "GenuineIntel", "NET"),
        (pair(pynvml.NVML_TOPOLOGY_SINGLE), {"NCCL_P2P_LEVEL": "NVL"}, "GenuineIntel", "SHM"),
        (pair(pynvml.NVML_TOPOLOGY_SYSTEM), {"NCCL_P2P_LEVEL": "SYS"}, "GenuineIntel", "P2P/PCIe"),
        (pair(pynvml.NVML_TOPOLOGY_HOSTBRIDGE), {"NCCL_P2P_LEVEL": "3"}, "GenuineIntel", "P2P/PCIe"),  # old 3 = PHB
    ],
)
def test_nccl_transport_follows_ncclTopoCheckP2p(the_pair, settings, cpu_vendor, kind):
    level, _source = p2p_level(settings, cpu_vendor, gpu_count=2)
    assert nccl_transport(the_pair, level, settings).kind == kind


def test_amd_rule_is_for_two_gpus_at_most():
    assert p2p_level({}, "AuthenticAMD", 2)[0] == "SYS"
    assert p2p_level({}, "AuthenticAMD", 4)[0] == "PXB"


def test_cpu_ranges_are_written_like_nvidia_smi():
    assert cpu_ranges([0, 1, 2, 3, 8, 9, 12]) == "0-3,8-9,12"
    assert cpu_ranges([5]) == "5"
    assert cpu_ranges(None) == "N/A"


@pytest.mark.parametrize("bus_id", ["00000000:18:00.0", "0000:18:00.0", "18:00.0", b"00000000:18:00.0"])
def test_bus_ids_from_nvml_and_cuda_compare_equal(bus_id):
    assert normalise_bus_id(bus_id) == "0000:18:00.0"


# --- CUDA's numbering ----------------------------------------------------------------------------------------------


def gpus_for_cuda(names=("A", "A", "A")):
    return [GpuFacts(index=index, name=name, uuid=f"GPU-{index}abc{index}-0000", bus_id=f"0000:{16 * (index + 1):02x}:00.0") for index, name in enumerate(names)]


@pytest.mark.parametrize(
    "setting, visible",
    [
        (None, [0, 1, 2]),
        ("2,0", [2, 0]),
        ("0,7,1", [0]),  # CUDA stops at the first invalid entry
        ("", []),
        ("-1", []),
        ("GPU-1abc", [1]),  # a unique UUID prefix
        ("1,1", [1]),  # a duplicate ends the list
    ],
)
def test_cuda_visible_devices_like_cuda(setting, visible):
    environ = {} if setting is None else {"CUDA_VISIBLE_DEVICES": setting}
    assert cuda_view(gpus_for_cuda(), environ, None).visible == visible


def test_mig_entries_are_kept_apart():
    view = cuda_view(gpus_for_cuda(), {"CUDA_VISIBLE_DEVICES": "MIG-5c2a,0"}, None)
    assert view.mig_devices == ["MIG-5c2a"] and view.visible == [0]


def test_torch_numbering_is_authoritative_and_mixed_models_are_flagged_without_it():
    gpus = gpus_for_cuda(("Tesla T4", "NVIDIA A100"))
    from_torch = cuda_view(gpus, {}, ["1abc1-0000", "GPU-0abc0-0000"])  # torch omits the GPU- prefix
    assert (from_torch.visible, from_torch.order_source) == ([1, 0], "torch")
    assert cuda_view(gpus, {}, None).order_source == "assumed-pci"
    assert cuda_view(gpus, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, None).order_source == "pci"


# --- software, bandwidth -----------------------------------------------------------------------------------------


def test_nccl_conf_precedence(tmp_path):
    user, system = tmp_path / "user.conf", tmp_path / "system.conf"
    user.write_text("# mine\nNCCL_DEBUG=INFO\n\n")
    system.write_text("NCCL_DEBUG=WARN\nNCCL_IB_HCA = mlx5_0\nnot a setting\n")
    settings, found = read_nccl_conf([str(user), str(tmp_path / "missing.conf"), str(system)])
    assert settings == {"NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5_0"}  # the first file to set a variable wins
    assert found == [str(user), str(system)]
    software = SoftwareFacts(python="3", platform="x", torch=None, environment={"NCCL_DEBUG": "WARN"}, nccl_conf=settings)
    assert effective_nccl_settings(software) == {"NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5_0"}  # environment wins


def test_bus_bandwidth_as_nccl_tests():
    assert bus_bandwidth(100.0, 8) == pytest.approx(175.0)  # 2 * 7 / 8
    assert bus_bandwidth(100.0, 2) == pytest.approx(100.0)
    assert bus_bandwidth(100.0, 1) == 0.0


# --- the fake stays true to pynvml -------------------------------------------------------------------------------


def test_fake_functions_have_pynvml_names_and_signatures():
    fake = make_fake_pynvml(FakeMachine([]))
    names = implemented_functions(fake)
    assert len(names) > 30
    for name in names:
        assert inspect.signature(getattr(fake, name)) == inspect.signature(getattr(pynvml, name)), name


def test_fake_keeps_pynvml_constants_errors_and_the_p2p_index_quirk():
    fake = make_fake_pynvml(FakeMachine([FakeGpu("X", "0000:01:00.0", 1024, (8, 0), ("cpu0",))] * 2))
    assert fake.NVML_P2P_CAPS_INDEX_READ == (0,)
    assert fake.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    fake.nvmlInit()
    first, second = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(ctypes.ArgumentError):
        fake.nvmlDeviceGetP2PStatus(first, second, fake.NVML_P2P_CAPS_INDEX_READ)
    assert fake.nvmlDeviceGetP2PStatus(first, second, 0) == pynvml.NVML_P2P_STATUS_OK
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


# --- a sampling objective's step time (GRPO) ----------------------------------------------------------------------


def _grpo_setup(*flags: str) -> TrainingSetup:
    config = parse_launch_arguments(["--stage", "grpo", "--batch_size", "16", "--gradient_accumulation_steps", "2",
                                     "--max_length", "256", "--max_new_tokens", "768", "--judge", "embedded",
                                     *flags], size_given=True)
    setup = training_setup(config)
    ((_name, _staged, plan),) = stage_plans(config, World(), Devices("cuda", ("NVIDIA H100 80GB HBM3",), ((9, 0),)))
    return with_plan(setup, plan)


def test_grpo_step_time_worked_out_by_hand():
    """16 answers per step on one GPU, 8 per micro-batch x 2 accumulation, sampled in one generate call of 16
    sequences (TRL's steps_per_generation = the accumulation); a sequence is 256 prompt + 768 answer tokens.
    Sampling: the prompts' prefill at 40% of the bf16 peak, then 768 passes, each reading the weights and the average
    KV cache at 70% of the bandwidth plus 0.5 ms per layer; training 6 x params per token (+2 with the KL term's
    reference forward, +2 with gradient checkpointing, 4 with LoRA); the embedded checker ~0."""
    from src.diagnostics.time_plan import BANDWIDTH_EFFICIENCY, DECODE_OVERHEAD_S, MFU, estimate_step_time

    shape = shape_from_param_count(1_500_000_000)
    params, layers, kv = shape.total_params, shape.num_layers, shape.kv_size
    setup = _grpo_setup("--beta", "0")
    assert (setup.per_device_batch_size, setup.accumulation_steps, setup.generation_steps, setup.answer_tokens,
            setup.generation_tokens, setup.judges, setup.precision) == (8, 2, 2, 768, 1024, ("embedded",), "bf16")
    step = estimate_step_time(shape, setup, "NVIDIA H100 80GB HBM3")
    compute, bandwidth = 989e12 * MFU, 3.35e12 * BANDWIDTH_EFFICIENCY
    cache = 16 * (256 + 768 / 2) * layers * 2 * kv * 2
    per_token = max((2 * params + cache) / bandwidth, 2 * params * 16 / compute) + layers * DECODE_OVERHEAD_S
    assert (step.answers, step.generate_calls) == (16, 1)
    assert step.generation_s == pytest.approx(2 * params * 16 * 256 / compute + 768 * per_token)
    assert step.training_s == pytest.approx(16 * 1024 * 6 * params / compute)
    assert step.judging_s == 0 and step.total_s == pytest.approx(step.generation_s + step.training_s)
    assert 10 < step.generation_s < 30 and step.training_s < 1  # sampling dominates at 768 new tokens
    with_kl = estimate_step_time(shape, _grpo_setup("--beta", "0.04", "--gradient_checkpointing", "true"),
                                 "NVIDIA H100 80GB HBM3")
    assert with_kl.training_s == pytest.approx(16 * 1024 * 10 * params / compute)
    lora = estimate_step_time(shape, _grpo_setup("--beta", "0", "--use_lora"), "NVIDIA H100 80GB HBM3")
    assert lora.training_s == pytest.approx(16 * 1024 * 4 * params / compute)
    # the PCIe card: the bare name takes its lower peaks; a GPU not in the table, or no sampling: no estimate
    assert estimate_step_time(shape, setup, "NVIDIA H100 PCIe").generation_s > step.generation_s
    assert estimate_step_time(shape, setup, "Some Future GPU") is None
    assert estimate_step_time(shape, replace(setup, generation_tokens=0), "NVIDIA H100 80GB HBM3") is None


def test_grpo_step_time_judges():
    """A reward model: one forward per answer (2 x its params per token); a function: not estimated, so the step has
    no judging total; 'none' is no judge."""
    from src.diagnostics.time_plan import MFU, estimate_step_time

    shape = shape_from_param_count(1_500_000_000)
    setup = _grpo_setup("--rewards", "embedded", "my_checks:score", "org/reward-model", "--beta", "0")
    step = estimate_step_time(shape, setup, "NVIDIA H200", {"org/reward-model": 500_000_000})
    kinds = {judge.judge: (judge.kind, judge.seconds) for judge in step.judges}
    assert kinds["embedded"] == ("checker", 0.0) and kinds["my_checks:score"] == ("function", None)
    assert kinds["org/reward-model"] == ("reward model", pytest.approx(2 * 500_000_000 * 16 * 1024 / (989e12 * MFU)))
    assert step.judging_s is None
    assert step.total_s == pytest.approx(step.generation_s + step.training_s + kinds["org/reward-model"][1])
    unknown = estimate_step_time(shape, setup, "NVIDIA H200", {"org/reward-model": None})
    assert {judge.judge: judge.seconds for judge in unknown.judges}["org/reward-model"] is None
