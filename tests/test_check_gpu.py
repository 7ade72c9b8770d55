"""check_gpu.py on whole machines described as data (tests/fakes/machines.py): the topology matrix, the transport
NCCL picks per pair, the problems, the verdict, the exit status and the launch command."""

import json
import shlex
from dataclasses import replace

import pytest

from check_gpu import build_parser, options_from
from src.diagnostics.check import check
from src.diagnostics.inputs import parse_launch_arguments
from src.diagnostics.model_shape import shape_from_param_count
from src.diagnostics.render import render
from src.diagnostics.system import InfinibandPort

from fakes.fake_pynvml import real_pynvml
from fakes.machines import (
    MACHINES,
    a100_busy,
    a100_ecc,
    a100_mig,
    cpu_only,
    fake_sources,
    h100_nvswitch,
    l40s_two_sockets,
    rtx4090_pcie,
    t4_a100_mixed,
)

MIB = 1024**2


def run_check(spec, *flags):
    return run_check_with(fake_sources(spec), flags)


def run_check_with(sources, flags):
    return check(options_from(build_parser().parse_args(list(flags))), sources)


def codes(report):
    return [problem["code"] for problem in report["problems"]]


def every_pair_off_diagonal(matrix, label):
    return all(cell == ("X" if row == column else label) for row, cells in enumerate(matrix) for column, cell in enumerate(cells))


# --- the machines of the issue -------------------------------------------------------------------------------------


def test_h100_nvswitch_is_ready():
    report = run_check(h100_nvswitch())
    topology = report["topology"]
    assert every_pair_off_diagonal(topology["links"], "NV18")
    assert every_pair_off_diagonal(topology["p2p"], "OK")
    assert every_pair_off_diagonal(topology["transport"], "NVL")
    assert topology["cpu_affinity"][0] == "0-55,112-167" and topology["numa_affinity"][7] == "1"
    assert report["problems"] == []
    assert (report["verdict"], report["exit_code"]) == ("READY", 0)
    assert report["command"] == "./run_distributed.sh 8"


def test_rtx4090_pair_uses_shm_and_gets_p2p_disabled():
    report = run_check(rtx4090_pcie())
    topology = report["topology"]
    assert topology["links"] == [["X", "PHB"], ["PHB", "X"]]
    assert topology["p2p"] == [["X", "GNS"], ["GNS", "X"]]
    assert topology["transport"] == [["X", "SHM"], ["SHM", "X"]]
    # AMD with two GPUs lets NCCL try P2P through the CPU; the driver's "GPU not supported" is what stops it.
    assert topology["p2p_level"]["level"] == "SYS"
    assert topology["transport_reasons"]["0-1"] == "SHM: NVML P2P GPU not supported"
    assert codes(report) == ["consumer_gpus"]
    assert (report["verdict"], report["exit_code"]) == ("READY WITH WARNINGS", 1)
    assert report["command"] == "NCCL_P2P_DISABLE=1 ./run_distributed.sh 2"
    # Consumer GPUs do not support ECC, row remapping or MIG queries: those facts are missing, nothing crashed.
    assert {"ecc", "remapped_rows", "mig"} <= set(report["gpus"][0]["unavailable"])


def test_rtx4090_with_an_old_driver_also_needs_ib_disabled_for_accelerate():
    report = run_check(rtx4090_pcie(driver_version="535.183.01", cuda_driver_version=12020, torch_cuda="12.1"))
    assert report["command"] == "NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1 ./run_distributed.sh 2"


def test_t4_with_a100_sizes_by_the_smallest_and_uses_fp16():
    # The launcher's default global batch (32: 16 per GPU on two) does not fit a T4; a micro-batch cap of 1 does.
    report = run_check(t4_a100_mixed(), "--params", "1.5e9", "--use_lora", "--micro_batch_size", "1")
    topology = report["topology"]
    assert topology["links"] == [["X", "NODE"], ["NODE", "X"]]
    assert topology["transport"] == [["X", "SHM"], ["SHM", "X"]]
    assert codes(report) == ["mixed_models"]
    warning = report["problems"][0]
    assert "sized by the smallest (Tesla T4, 15.0 GiB)" in warning["what"] and "uses fp16" in warning["what"]
    # torch numbers the A100 cuda:0 (fastest first); the single-GPU alternative names it in nvidia-smi's numbers
    assert [gpu["cuda_index"] for gpu in report["gpus"]] == [1, 0]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=1 ./run_distributed.sh 1" in warning["fix"]
    plan = report["memory_plan"]
    assert plan["precision"] == "fp16" and plan["budget_source"] == "free on GPU 0, the smallest"
    assert plan["budget_bytes"] == (15360 - 512) * MIB
    assert (report["plan"]["dpo"]["per_device_batch_size"], report["plan"]["dpo"]["gradient_accumulation_steps"]) == (1, 16)
    assert report["plan"]["dpo"]["precision"] == "fp16"
    assert report["command"] == "./run_distributed.sh 2 --use_lora --micro_batch_size 1 --mixed_precision fp16"
    assert report["exit_code"] == 1


def test_mig_gpu_is_left_out():
    report = run_check(a100_mig())
    assert report["topology"]["links"] == [["X", "NV12"], ["NV12", "X"]]
    assert codes(report) == ["mig_enabled"]
    assert (report["verdict"], report["exit_code"]) == ("NOT READY", 2)
    assert report["command"] == "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0 ./run_distributed.sh 1"
    assert report["command_runs_now"]
    assert "sudo nvidia-smi -i 1 -mig 0" in report["problems"][0]["fix"]


def test_single_mig_gpu_leaves_nothing_to_run():
    spec = a100_mig()
    spec.nvml.gpus = [replace(spec.nvml.gpus[1], nvlinks=[])]
    report = run_check(spec)
    assert codes(report) == ["mig_enabled"] and report["exit_code"] == 2
    assert report["command"] is None
    assert "no command yet" in render(report)


def test_gpu_with_ecc_errors_is_not_ready_and_left_out():
    report = run_check(a100_ecc())
    assert every_pair_off_diagonal(report["topology"]["links"], "NV4")
    # The default recipe's global batch (32) does not split over the 3 GPUs left: the launcher would stop, so the
    # command uses the nearest batch that splits (33, or 30), the learning rate still tuned for 32.
    assert codes(report) == ["memory_errors", "batch_does_not_split"]
    assert "--batch_size 32 cannot be split across 3 processes" in report["problems"][1]["what"]
    assert "--batch_size 33 (the nearest that splits; or 30) with --base_batch_size 32" in report["problems"][1]["fix"]
    assert report["problems"][0]["gpus"] == [2]
    assert "pending row remap" in report["problems"][0]["what"]
    assert report["gpus"][2]["excluded"] == "uncorrected ECC errors"
    assert (report["verdict"], report["exit_code"]) == ("NOT READY", 2)
    assert report["command"] == ("CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1,3 ./run_distributed.sh 3 "
                                 "--batch_size 33 --base_batch_size 32")
    assert report["command_runs_now"]
    plan = report["plan"]["dpo"]
    assert (plan["global_batch_size"], plan["per_device_batch_size"], plan["base_batch_size"]) == (33, 11, 32)
    assert codes(run_check(a100_ecc(), "--batch_size", "33", "--base_batch_size", "32")) == ["memory_errors"]


def test_gpu_busy_with_another_process_warns_and_shrinks_the_budget():
    report = run_check(a100_busy(), "--params", "7e9", "--use_lora", "--micro_batch_size", "1")
    assert codes(report) == ["memory_held"]
    assert "PID 48213 python3 30.0 GiB" in report["problems"][0]["what"]
    assert report["memory_plan"]["budget_source"] == "free on GPU 1, the smallest"
    assert report["memory_plan"]["budget_bytes"] == (81920 - 512) * MIB - 30 * 1024**3
    assert (report["exit_code"], report["command"]) == (1, "./run_distributed.sh 2 --use_lora --micro_batch_size 1")


def test_gpus_across_two_sockets():
    report = run_check(l40s_two_sockets())
    topology = report["topology"]
    assert topology["links"] == [
        ["X", "PIX", "SYS", "SYS"],
        ["PIX", "X", "SYS", "SYS"],
        ["SYS", "SYS", "X", "PIX"],
        ["SYS", "SYS", "PIX", "X"],
    ]
    assert topology["p2p"][0] == ["X", "OK", "TNS", "TNS"]
    assert topology["transport"][0] == ["X", "P2P", "SHM", "SHM"] and topology["transport"][2] == ["SHM", "SHM", "X", "P2P"]
    assert topology["numa_affinity"] == ["0", "0", "1", "1"]
    assert codes(report) == ["cross_socket"]
    fix = report["problems"][0]["fix"]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1 ./run_distributed.sh 2" in fix and "--numa-binding=node" in fix
    assert (report["exit_code"], report["command"]) == (1, "./run_distributed.sh 4")


# --- no driver, broken driver, broken GPUs ----------------------------------------------------------------------------


def test_no_driver_and_no_gpu_is_the_cpu_path():
    report = run_check(cpu_only())
    assert report["gpus"] == [] and report["topology"] is None
    assert codes(report) == ["no_gpu"] and report["exit_code"] == 1
    assert report["command"] == "./run_distributed.sh 2"
    assert "No NVIDIA GPU" in render(report)


def test_gpus_on_the_bus_without_a_driver_are_not_ready():
    spec = cpu_only()
    spec.system = replace(spec.system, nvidia_pci_devices=2, in_container=True)
    report = run_check(spec)
    assert codes(report) == ["no_library"]
    assert "docker run --gpus all" in report["problems"][0]["fix"]
    assert (report["exit_code"], report["command"]) == (2, None)


@pytest.mark.parametrize(
    "error, code",
    [
        (real_pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "version_mismatch"),
        (real_pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver_not_loaded"),
    ],
)
def test_broken_driver_is_not_ready(error, code):
    spec = h100_nvswitch()
    spec.nvml.init_error = error
    report = run_check(spec)
    assert codes(report) == [code]
    assert report["driver"]["status"] == code
    assert (report["exit_code"], report["command"]) == (2, None)
    assert "NVML unavailable" in render(report)


def test_gpu_lost_during_the_probe_is_left_out():
    spec = a100_busy()
    spec.nvml.gpus[1].failing["nvmlDeviceGetTemperature"] = real_pynvml.NVML_ERROR_GPU_IS_LOST
    report = run_check(spec)
    assert report["gpus"][1]["lost"] and report["gpus"][1]["name"] == "NVIDIA A100-SXM4-80GB"
    assert codes(report) == ["gpu_lost"]
    assert report["command"] == "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0 ./run_distributed.sh 1"
    assert "LOST" in render(report)


def test_per_call_errors_leave_facts_missing():
    spec = a100_busy()
    gpu = spec.nvml.gpus[0]
    gpu.failing["nvmlDeviceGetPowerUsage"] = real_pynvml.NVML_ERROR_NO_PERMISSION
    gpu.failing["nvmlDeviceGetCurrentClocksEventReasons"] = real_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    gpu.clocks_event_reasons = 0x40  # answered through the older ThrottleReasons call
    report = run_check(spec)
    facts = report["gpus"][0]
    assert facts["unavailable"] == {"power": "Insufficient Permissions"}
    assert facts["power_w"] is None and facts["clocks_event_reasons"] == 0x40
    assert "throttling" in codes(report)


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_machine_is_fully_answered_by_the_fake_and_renders(name):
    report = run_check(MACHINES[name]())
    for gpu in report["gpus"]:
        assert not any("missing from this nvidia-ml-py" in reason for reason in gpu["unavailable"].values())
    text = render(report)
    assert f"VERDICT: {report['verdict']} (exit {report['exit_code']})" in text
    assert "Traceback" not in text and (report["command"] is None or report["command"] in text)


# --- what the launch uses ---------------------------------------------------------------------------------------------


def test_cuda_visible_devices_is_honoured():
    spec = h100_nvswitch()
    spec.environ["CUDA_VISIBLE_DEVICES"] = "4,5"
    report = run_check(spec)
    assert [gpu["cuda_index"] for gpu in report["gpus"]] == [None] * 4 + [0, 1, None, None]
    assert report["launch"]["gpus"] == [4, 5]
    assert (report["exit_code"], report["command"]) == (0, "./run_distributed.sh 2")


def test_cuda_visible_devices_hiding_every_gpu():
    spec = h100_nvswitch()
    spec.environ["CUDA_VISIBLE_DEVICES"] = ""
    report = run_check(spec)
    assert codes(report) == ["no_visible_gpu"] and report["command"] is None


@pytest.mark.parametrize("requested, command, problem", [(4, "./run_distributed.sh 4", []), (16, "./run_distributed.sh 8", ["too_many_processes"])])
def test_process_count(requested, command, problem):
    report = run_check(h100_nvswitch(), "--num_procs", str(requested))
    assert report["command"] == command and codes(report) == problem


def test_more_processes_than_cores_on_cpu():
    report = run_check(cpu_only(), "--num_procs", "4")
    assert "too_many_processes" in codes(report) and report["command"] == "./run_distributed.sh 2"


def test_multi_node_passes_the_rendezvous_variables():
    spec = h100_nvswitch()
    spec.environ.update({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"})
    assert run_check(spec)["command"] == "NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_distributed.sh 8"
    del spec.environ["MASTER_ADDR"]
    assert "no_master_addr" in codes(run_check(spec))


# --- host and environment -----------------------------------------------------------------------------------------


def test_rendezvous_port_in_use_gets_a_free_port():
    spec = h100_nvswitch()
    spec.system = replace(spec.system, rendezvous_port_free=False, free_port=41234)
    report = run_check(spec)
    assert codes(report) == ["port_in_use"]
    assert report["command"] == "MASTER_PORT=41234 ./run_distributed.sh 8"


def test_infiniband_without_an_active_port():
    spec = h100_nvswitch()
    spec.system = replace(spec.system, infiniband_ports=[InfinibandPort("mlx5_0", "1", "1: DOWN", "InfiniBand")])
    assert codes(run_check(spec)) == ["infiniband_down"]


def test_memlock_limit_with_active_infiniband():
    spec = h100_nvswitch()
    spec.system = replace(spec.system, memlock_bytes=64 * 1024)
    assert codes(run_check(spec)) == ["memlock_limited"]


def test_docker_default_shm_breaks_nccl():
    spec = h100_nvswitch()
    spec.system = replace(spec.system, shm_bytes=64 * MIB, in_container=True)
    report = run_check(spec)
    assert codes(report) == ["shm_too_small"] and "--shm-size" in report["problems"][0]["fix"]
    assert report["exit_code"] == 2 and not report["command_runs_now"]
    assert "once the errors are fixed, run: ./run_distributed.sh 8" in render(report)


def test_stale_debug_settings():
    spec = h100_nvswitch()
    spec.environ.update({"NCCL_DEBUG": "INFO", "CUDA_LAUNCH_BLOCKING": "1"})
    report = run_check(spec)
    assert codes(report) == ["debug_settings", "cuda_launch_blocking"]
    assert "unset NCCL_DEBUG" in report["problems"][0]["fix"]


def test_needless_p2p_disable():
    spec = h100_nvswitch()
    spec.environ["NCCL_P2P_DISABLE"] = "1"
    report = run_check(spec)
    assert every_pair_off_diagonal(report["topology"]["transport"], "SHM")
    assert codes(report) == ["needless_p2p_disable"]


def test_torch_cpu_build_on_a_gpu_machine():
    spec = h100_nvswitch()
    spec.software = replace(spec.software, torch="2.13.0+cpu", torch_cuda=None, nccl=None, nccl_backend=False)
    report = run_check(spec)
    assert codes(report) == ["torch_cpu_build"] and report["command"] is None
    assert "at most 12.8" in report["problems"][0]["fix"]


@pytest.mark.parametrize("torch_cuda, code, severity", [("12.8", "driver_older_than_torch", "warning"), ("13.0", "driver_too_old", "error")])
def test_driver_too_old_for_torch(torch_cuda, code, severity):
    spec = h100_nvswitch()
    spec.nvml.driver_version, spec.nvml.cuda_driver_version = "550.54.15", 12040
    spec.software = replace(spec.software, torch_cuda=torch_cuda)
    report = run_check(spec)
    assert codes(report) == [code] and report["problems"][0]["severity"] == severity


# --- interconnect faults ------------------------------------------------------------------------------------------


def test_nvlink_pair_with_p2p_reported_broken():
    spec = a100_busy()
    spec.nvml.gpus[1].processes = []
    spec.nvml.p2p_overrides[frozenset((0, 1))] = real_pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
    report = run_check(spec)
    assert report["topology"]["transport"] == [["X", "ERR"], ["ERR", "X"]]
    assert codes(report) == ["nvlink_p2p_broken"] and "nvidia-fabricmanager" in report["problems"][0]["fix"]
    assert report["command"] == "NCCL_P2P_DISABLE=1 ./run_distributed.sh 2" and report["command_runs_now"]


def test_p2p_over_pcie_under_a_translating_iommu_asks_for_the_bench():
    spec = l40s_two_sockets()
    spec.system = replace(spec.system, iommu="translated")
    report = run_check(spec)
    assert sorted(codes(report)) == ["cross_socket", "p2p_unreliable"]
    unreliable = next(problem for problem in report["problems"] if problem["code"] == "p2p_unreliable")
    assert unreliable["gpus"] == [0, 1, 2, 3] and "--bench" in unreliable["fix"]


def test_p2p_refused_where_the_topology_allows_it():
    spec = l40s_two_sockets()
    spec.nvml.p2p_overrides[frozenset((0, 1))] = real_pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED
    report = run_check(spec)
    assert report["topology"]["transport"][0][1] == "SHM"
    unavailable = next(problem for problem in report["problems"] if problem["code"] == "p2p_unavailable")
    assert unavailable["gpus"] == [0, 1] and "iommu=pt" in unavailable["fix"]


def test_throttling_and_narrow_pcie_link():
    spec = a100_busy()
    spec.nvml.gpus[1].processes = []
    spec.nvml.gpus[0].clocks_event_reasons = 0x40 | 0x1
    spec.nvml.gpus[0].temperature_c = 88
    spec.nvml.gpus[1].pcie = (4, 4, 8, 16)
    report = run_check(spec)
    assert codes(report) == ["throttling", "pcie_width"]
    assert "hardware thermal slowdown, 88 °C" in report["problems"][0]["what"]
    assert "x8 of x16" in report["problems"][1]["what"]


# --- the recipe against the memory -------------------------------------------------------------------------------


def test_recipe_that_does_not_fit_is_not_ready(tmp_path):
    recipe = tmp_path / "big.yaml"
    recipe.write_text("use_lora: true\nmax_length: 1024\ngradient_checkpointing: true\n")
    report = run_check(h100_nvswitch(), "--config", str(recipe), "--params", "70e9")
    assert codes(report) == ["does_not_fit"]
    assert "use QLoRA r=16 (" in report["problems"][0]["fix"] and "in all: --use_lora --load_in_4bit)" in report[
        "problems"][0]["fix"]
    assert report["command"] == f"./run_distributed.sh 8 --config {recipe}" and not report["command_runs_now"]
    chosen = [estimate for estimate in report["memory_plan"]["estimates"] if estimate["chosen"]]
    assert [estimate["method"] for estimate in chosen] == ["lora"]


def test_a_full_fine_tune_that_fits_only_sharded_names_the_strategy(tmp_path):
    recipe = tmp_path / "full.yaml"
    recipe.write_text("stage: sft\nuse_lora: false\ngradient_checkpointing: true\n")
    report = run_check(h100_nvswitch(), "--config", str(recipe), "--params", "13e9")
    fits = {estimate["method"] for estimate in report["memory_plan"]["estimates"] if estimate["fits"]}
    assert "zero3" in fits and "full" not in fits
    problem = next(problem for problem in report["problems"] if problem["code"] == "does_not_fit")
    assert "ZeRO-3 (" in problem["fix"] and "STRATEGY=zero3 ./run_distributed.sh ..., with deepspeed installed)" in problem["fix"]


def test_batch_too_large_for_the_gpu():
    report = run_check(rtx4090_pcie(), "--params", "7e9", "--use_lora", "--per_device_batch_size", "64",
                       "--gradient_checkpointing")
    problem = next(problem for problem in report["problems"] if problem["code"] == "does_not_fit")
    lora = next(estimate for estimate in report["memory_plan"]["estimates"] if estimate["method"] == "lora")
    assert 1 <= lora["max_per_device_batch"] < 64
    assert f"add --micro_batch_size {lora['max_per_device_batch']} (or less)" in problem["fix"]
    # The advice, taken: it fits, and the batch per optimizer step is the same.
    advised = run_check(rtx4090_pcie(), "--params", "7e9", "--use_lora", "--per_device_batch_size", "64",
                        "--gradient_checkpointing", "--micro_batch_size", str(lora["max_per_device_batch"]))
    assert "does_not_fit" not in codes(advised)
    assert advised["plan"]["dpo"]["global_batch_size"] == report["plan"]["dpo"]["global_batch_size"] == 128


def test_bf16_recipe_on_a_t4(tmp_path):
    recipe = tmp_path / "bf16.yaml"
    recipe.write_text("mixed_precision: bf16\n")
    report = run_check(t4_a100_mixed(), "--config", str(recipe))
    assert "bf16_unsupported" in codes(report)
    assert report["command"] == f"./run_distributed.sh 2 --config {recipe} --mixed_precision fp16"


# --- the bandwidth measurement's verdicts, through the real child process and timeout -------------------------------


@pytest.mark.parametrize("behaviour, first_status", [("hang_with_p2p", "timeout"), ("wrong_with_p2p", "wrong_result")])
def test_bench_retries_without_p2p_and_the_command_keeps_it_off(behaviour, first_status):
    spec = h100_nvswitch()
    spec.bench_behaviour = behaviour
    report = run_check(spec, "--bench", "--bench_timeout", "2")
    bench = report["bench"]
    assert [attempt["status"] for attempt in bench["attempts"]] == [first_status, "ok"]
    assert [attempt["p2p_disabled"] for attempt in bench["attempts"]] == [False, True]
    assert bench["outcome"] == "ok_without_p2p"
    assert codes(report) == ["p2p_broken"]
    assert report["command"] == "NCCL_P2P_DISABLE=1 ./run_distributed.sh 8" and report["exit_code"] == 1


def test_bench_failing_both_ways_is_not_ready():
    spec = h100_nvswitch()
    spec.bench_behaviour = "crash"
    report = run_check(spec, "--bench")
    assert [attempt["status"] for attempt in report["bench"]["attempts"]] == ["failed", "failed"]
    assert codes(report) == ["bench_failed"] and "unhandled cuda error" in report["problems"][0]["what"]
    assert report["exit_code"] == 2


def test_bench_passing_reports_bus_bandwidth():
    report = run_check(h100_nvswitch(), "--bench")
    points = report["bench"]["attempts"][0]["points"]
    assert [point["size_bytes"] for point in points] == [1 << 20, 16 << 20, 128 << 20]
    assert all(point["busbw_gbps"] == pytest.approx(350.0) and point["correct"] for point in points)
    assert report["exit_code"] == 0


def test_bench_needs_two_gpus():
    spec = a100_mig()
    assert run_check(spec, "--bench")["bench"] == {"skipped": "needs at least 2 usable GPUs"}


# --- the launcher's flags and plan ------------------------------------------------------------------------------------

QWEN_RECIPE = "configs/dpo_qwen2.5-0.5b_ultrafeedback.yaml"


def sized_sources(spec, params=494_000_000):
    """The machine as data, and any model named measured as a Llama-style shape of `params` (no Hub here)."""
    return replace(fake_sources(spec), model_shape=lambda name, subject: shape_from_param_count(params))


def check_json(capsys, spec, arguments):
    """main() on a described machine: (report, the stderr lines)."""
    from check_gpu import main

    exit_code = main(["--json", *arguments], sized_sources(spec))
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert exit_code == report["exit_code"]
    return report, err.splitlines()


def test_a_launch_line_checks_to_the_launchers_own_plan(capsys):
    """`./run_distributed.sh 2 --config <qwen recipe> --batch_size 128 --base_batch_size 64 --use_lora` as
    `check_gpu.py --num_procs 2 ...`: global 128 over 2 GPUs = 64 per process, capped by the recipe's
    micro_batch_size 8 -> 8 per device x 8 accumulation; learning rate 5e-7 x sqrt(128 / 64)."""
    from src.config_parse import parse_config
    from src.world import Devices, World
    from src.pipeline.stages import plan_stages  # the function --dry_run prints the plan of

    launch = ["--config", QWEN_RECIPE, "--batch_size", "128", "--base_batch_size", "64", "--use_lora"]
    report, _ = check_json(capsys, h100_nvswitch(), ["--num_procs", "2", *launch])
    (stage,) = plan_stages(parse_config(launch), World(world_size=2, local_world_size=2),
                           Devices("cuda", ("NVIDIA H100 80GB HBM3",) * 2, ((9, 0),) * 2))
    checked = report["plan"]["dpo"]
    keys = ("per_device_batch_size", "gradient_accumulation_steps", "global_batch_size", "learning_rate", "precision")
    assert {key: checked[key] for key in keys} == {key: getattr(stage.plan, key) for key in keys}
    assert (checked["per_device_batch_size"], checked["gradient_accumulation_steps"]) == (8, 8)
    assert checked["learning_rate"] == pytest.approx(5e-7 * 2 ** 0.5)
    memory = report["memory_plan"]
    assert (memory["per_device_batch_size"], memory["precision"]) == (8, "bf16")
    assert [estimate["method"] for estimate in memory["estimates"] if estimate["chosen"]] == ["lora"]
    assert report["command"] == "./run_distributed.sh 2 " + " ".join(launch)
    assert "8 per device x 8 accumulation x 2 processes = 128 global (global mode)" in render(report)  # the table
    assert "engine         DDP: the whole model on each of 2 processes, gradients all-reduced" in render(report)


def test_the_launch_plan_names_the_engine_strategy_asks_for(capsys, monkeypatch):
    """`STRATEGY=zero3 python check_gpu.py --num_procs 8 ...` prints the plan `STRATEGY=zero3 ./run_distributed.sh 8`
    prints: the engine, its version and what it shards, and where it was asked for."""
    import importlib.metadata

    monkeypatch.setenv("STRATEGY", "zero3")
    report, _ = check_json(capsys, h100_nvswitch(), ["--num_procs", "8", "--config", QWEN_RECIPE])
    assert report["plan"]["dpo"]["engine"] == "zero3" and report["plan"]["dpo"]["engine_from"] == "STRATEGY=zero3"
    assert (f"engine         DeepSpeed ZeRO-3 (deepspeed {importlib.metadata.version('deepspeed')}): weights, gradients, "
            "optimizer states over 8 processes  [STRATEGY=zero3]") in render(report)


def test_the_printed_command_checks_to_the_same_plan(capsys, tmp_path):
    """The command (with what the check added: --mixed_precision fp16 on a T4) fed back gives the same plan and
    command."""
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text("stage: dpo\nmodel_name_or_path: some/model\ndataset_name: some/data\nbatch_size: 12\n"
                      "micro_batch_size: 3\n")
    first, _ = check_json(capsys, t4_a100_mixed(), ["--config", str(recipe), "--use_lora", "--learning_rate", "1e-5"])
    assert "--mixed_precision fp16" in first["command"]
    words = shlex.split(first["command"])
    assert words[0] == "./run_distributed.sh"
    again, _ = check_json(capsys, t4_a100_mixed(), ["--num_procs", words[1], *words[2:]])
    assert again["plan"] == first["plan"] and again["command"] == first["command"]
    assert (first["plan"]["dpo"]["per_device_batch_size"], first["plan"]["dpo"]["gradient_accumulation_steps"]) == (3, 2)
    assert first["plan"]["dpo"]["precision"] == "fp16"


def test_old_flag_names_work_with_one_notice_each(capsys, tmp_path):
    old, old_notices = check_json(capsys, h100_nvswitch(), ["--num_procs", "2", "--model", "some/model", "--qlora",
                                                             "--lora", "--stage", "sft"])
    assert old_notices == [
        "note: --model is now --model_name_or_path (the launcher's name); the old name works until the next release",
        "note: --qlora is now --use_lora --load_in_4bit (the launcher's name); the old name works until the next "
        "release",
        "note: --lora is now --use_lora (the launcher's name); the old name works until the next release",
    ]
    new, new_notices = check_json(capsys, h100_nvswitch(), ["--num_procs", "2", "--model_name_or_path", "some/model",
                                                            "--use_lora", "--load_in_4bit", "--use_lora", "--stage",
                                                            "sft"])
    assert new_notices == []
    assert old["plan"] == new["plan"] and old["memory_plan"] == new["memory_plan"]
    assert old["command"] == new["command"]  # printed with the launcher's names
    assert [estimate["method"] for estimate in old["memory_plan"]["estimates"] if estimate["chosen"]] == ["qlora"]


def test_per_device_batch_size_keeps_the_launchers_meaning(capsys):
    """The launcher's --per_device_batch_size (per-device mode: the global batch grows with the processes, and the
    learning rate with it) is the flag check_gpu took before, with the same per-device batch: no notice."""
    report, notices = check_json(capsys, h100_nvswitch(), ["--num_procs", "4", "--params", "1e9",
                                                           "--per_device_batch_size", "6"])
    plan = report["plan"]["dpo"]
    assert notices == []
    assert (plan["batch_mode"], plan["per_device_batch_size"], plan["global_batch_size"]) == ("per_device", 6, 24)
    assert report["memory_plan"]["per_device_batch_size"] == 6


def test_several_nodes_split_the_global_batch_over_every_process():
    """NNODES=2 x 8 GPUs = 16 processes, as run_distributed.sh starts them: the global 64 is 4 per device."""
    spec = h100_nvswitch()
    spec.environ.update({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"})
    plan = run_check(spec, "--params", "1e9", "--batch_size", "64")["plan"]["dpo"]
    assert (plan["world_size"], plan["num_nodes"], plan["per_device_batch_size"]) == (16, 2, 4)


# --- the memory plan from the data audit's lengths (issue 38: reasoning answers are long) --------------------------


def test_the_memory_plan_takes_the_lengths_of_the_runs_prepared_data(tmp_path, thinking_model):
    """With the run's data prepared in the cache (by a launch, its --dry_run or `python -m src.audit`), check_gpu
    plans activations at the longest sequence as trained (prompt + reasoning + answer), cut to --max_length, and says
    where that length came from; a --max_length that cuts the reasoning gets the audit's 99th percentile with its
    memory. Without prepared data, the plan is at --max_length, as before."""
    from conftest import thinking_rows, write_jsonl
    from src.config_parse import stage_config
    from src.data import prepare_data
    from src.diagnostics.data_lengths import find_data_lengths
    from src.run_safety.build_once import cache_root
    from src.models import load_tokenizer

    data = write_jsonl(tmp_path / "reasoning.jsonl", thinking_rows(40))
    launch = ["--stage", "dpo", "--model_name_or_path", str(thinking_model), "--dataset_name", str(data),
              "--use_lora"]
    sources = replace(fake_sources(cpu_only()), data_lengths=find_data_lengths)

    def checked(max_length):
        arguments = [*launch, "--max_length", str(max_length)]
        return run_check_with(sources, arguments), arguments

    def prepare(arguments):
        staged = stage_config(parse_launch_arguments(arguments), "dpo")
        return prepare_data(staged.data, staged.sft, "dpo", staged.training.seed, load_tokenizer(str(thinking_model)),
                            cache_root() / "datasets")

    before, arguments = checked(512)
    assert before["memory_plan"]["data_lengths"] is None and before["memory_plan"]["sequence_tokens"] == 512
    assert "max_length 512 · per-device batch" in render(before)
    prepared = prepare(arguments)
    longest = prepared.summary["splits"]["train"]["longest_tokens"]
    after, _ = checked(512)
    plan = after["memory_plan"]
    assert plan["data_lengths"]["source"] == f"the data audit of the prepared data in {prepared.path}"
    assert plan["sequence_tokens"] == longest < 512 and plan["data_lengths"]["reasoning_share"] == 1.0
    # activations are per token: the longest sequence instead of max_length scales them by longest / 512
    assert plan["activation_bytes_per_sample"] == pytest.approx(
        before["memory_plan"]["activation_bytes_per_sample"] * longest / 512, rel=1e-6)
    assert (f"max_length 512 · planned at {longest} tokens per sequence: the data's longest, reasoning included; 99% "
            f"within {plan['data_lengths']['suggested_max_length']} (the data audit of the prepared data in "
            in " ".join(render(after).split()))
    assert "max_length_cuts_data" not in codes(after)

    cut_arguments = checked(24)[1]
    cut_prepared = prepare(cut_arguments)  # another --max_length is another preparation
    cut, _ = checked(24)
    suggested = cut_prepared.summary["audit"]["train"]["suggested_max_length"]
    assert cut["memory_plan"]["sequence_tokens"] == 24 and suggested > 24
    assert "planned at 24 tokens per sequence: the data's longest, cut to max_length, reasoning included" in " ".join(
        render(cut).split())
    problem = next(problem for problem in cut["problems"] if problem["code"] == "max_length_cuts_data")
    assert problem["severity"] == "warning" and str(cut_prepared.path) in problem["what"]
    assert f"({cut['memory_plan']['data_lengths']['source']})" in problem["what"] and "into the reasoning" in problem[
        "what"]
    assert problem["fix"].startswith(f"--max_length {suggested} keeps 99% of them whole, reasoning included: LoRA r=16"
                                     " needs about") and problem["fix"].endswith("(--reasoning drop)")
    assert cut["memory_plan"]["at_suggested_max_length"]["method"] == "lora"


def test_grpo_plan_prints_its_step_time_split(capsys):
    """--stage grpo on a GPU: a line under the memory table estimates a step's time split into sampling, judging and
    training (src/diagnostics/time_plan.py), labelled an estimate with its assumptions; a function judge is not
    estimated; a reward-model judge is sized as a model is. On CPU: no estimate."""
    flags = ["--num_procs", "1", "--stage", "grpo", "--model_name_or_path", "some/model", "--batch_size", "64",
             "--num_generations", "8", "--max_length", "512", "--max_new_tokens", "1024"]
    report, _ = check_json(capsys, h100_nvswitch(), [*flags, "--judge", "embedded"])
    step = report["memory_plan"]["step_time"]
    assert step["gpu"] == "NVIDIA H100 80GB HBM3" and step["answers"] == 64
    assert step["generation_s"] > step["training_s"] > 0 and step["judges"] == [
        {"judge": "embedded", "kind": "checker", "seconds": 0.0}]
    text = " ".join(render(report).split())
    assert "GRPO step time, an estimate for NVIDIA H100 80GB HBM3 (989 TFLOP/s bf16, 3.4 TB/s)" in text
    assert "judging [embedded checker ~0 s]" in text and "assuming 40% of the bf16 peak in matmuls" in text
    report, _ = check_json(capsys, h100_nvswitch(), [*flags, "--rewards", "my_checks:score", "org/rm"])
    text = " ".join(render(report).split())
    assert "my_checks:score: not estimated (a function: the run logs time/judging_s)" in text
    assert "reward model org/rm " in text and "+ judging per optimizer step" in text
    report, _ = check_json(capsys, cpu_only(), [*flags, "--judge", "embedded"])
    assert report["memory_plan"]["step_time"] is None and "step time" not in render(report)
