"""One check, start to finish: read the machine, decide what the launch would use, plan memory, measure, judge.

`check(options, sources)` returns the report as one JSON-able dict; `--json` prints it and `render.py` writes the
same content for people. `Sources` says where facts come from: `Sources.this_machine()` in use, a described
machine (fake NVML module, host and software facts) in tests.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Mapping

from src.config import Config
from src.config_error import ConfigError
from src.plan import BatchSplitError, Plan, stage_plans
from src.world import Devices, World

from . import topology
from .bandwidth import BenchRequest, BenchResult, bench_sizes, run_bench
from .data_lengths import DataLengths, find_data_lengths
from .devices import CudaView, cuda_view, torch_cuda_uuids
from .inputs import CheckOptions, InputError, with_plan
from .memory_plan import MemoryPlan, plan_memory
from .model_shape import ModelShape, shape_from_model, shape_from_param_count
from .nvml_probe import NvmlFacts, probe_nvml
from .problems import find_problems
from .problems.driver import driver_supports_torch
from .problems.machine import Machine, exclusion_reason, pci_positions
from .software import SoftwareFacts, collect_software, effective_nccl_settings
from .system import SystemFacts, collect_system
from .time_plan import StepTime, estimate_step_time, judge_kind
from .verdict import decide, needs_fp16

CPU_DEFAULT_PROCESSES = 2


@dataclass
class Sources:
    """Where the facts come from."""

    environ: Mapping[str, str]
    software: Callable[[], SoftwareFacts]
    system: Callable[[], SystemFacts]
    nvml: ModuleType | None  # the pynvml module, or None when nvidia-ml-py is missing
    torch_cuda_uuids: Callable[[], list[str] | None]
    bench: Callable[[BenchRequest], BenchResult]
    model_shape: Callable[[str, str], ModelShape]  # (name or path, how messages name it)
    # (the launcher's config, the stage planned) -> the lengths of that stage's prepared data, when it is cached
    data_lengths: Callable[[Config, str], DataLengths | None] = lambda config, stage: None

    @classmethod
    def this_machine(cls) -> "Sources":
        environ = dict(os.environ)
        try:
            import pynvml
        except ImportError:
            pynvml = None
        return cls(
            environ=environ,
            software=lambda: collect_software(environ),
            system=lambda: collect_system(environ),
            nvml=pynvml,
            torch_cuda_uuids=torch_cuda_uuids,
            bench=run_bench,
            model_shape=lambda name, subject: shape_from_model(name, environ, subject),
            data_lengths=find_data_lengths,
        )


def _launch_processes(options: CheckOptions, system: SystemFacts, usable_gpus: list[int], has_gpus: bool) -> int:
    """How many processes the command starts: one per usable GPU, or on CPU two (one core each at least)."""
    if has_gpus:
        return min(options.num_procs or len(usable_gpus), len(usable_gpus))
    return max(1, min(options.num_procs or CPU_DEFAULT_PROCESSES, system.usable_cpus))


def _nothing_runs(software: SoftwareFacts, system: SystemFacts, has_gpus: bool) -> bool:
    if software.torch is None or not software.distributed:
        return True
    if has_gpus:
        return software.torch_cuda is None or not software.nccl_backend
    return bool(system.nvidia_pci_devices)  # GPUs on the bus that the driver does not give us


def _memory_budget(machine: Machine) -> tuple[int, str]:
    if machine.has_gpus:
        gpus = [machine.gpu(index) for index in (machine.launch_gpus or machine.cuda.visible)]
        smallest = min(gpus, key=lambda gpu: gpu.memory_free_bytes or 0)
        return smallest.memory_free_bytes or 0, f"free on GPU {smallest.index}, the smallest"
    available = machine.system.memory_available_bytes or 0
    return available // machine.num_procs, f"available RAM / {machine.num_procs} processes"


def _model_shape(options: CheckOptions, sources: Sources) -> ModelShape:
    training = options.training
    if options.param_count is not None:
        return shape_from_param_count(options.param_count)
    name = training.model_name_or_path
    from_flag = options.config.sources.get("model_name_or_path", "").startswith("--")
    subject = f"--model_name_or_path {name}" if from_flag else f"model_name_or_path {name} in {training.recipe_path}"
    return sources.model_shape(name, subject)


def launch_plans(machine: Machine) -> tuple[list[tuple[str, Plan]], str | None]:
    """The launcher's own plan of every stage (src/config.py stage_plans) for the processes and devices the printed
    command launches, with the precision that command passes; or no plan and the launcher's reason for refusing it."""
    config = machine.options.config
    if needs_fp16(machine):  # the command adds --mixed_precision fp16: plan what it will run
        config = dataclasses.replace(config, training=dataclasses.replace(config.training, mixed_precision="fp16"),
                                     sources={**config.sources, "mixed_precision": "--mixed_precision"})
    processes = max(1, machine.num_procs)
    nodes_text = machine.environ.get("NNODES", "1").strip()
    nodes = int(nodes_text) if machine.multi_node and nodes_text.isdigit() else 1  # a bad NNODES is its own problem
    world = World(world_size=processes * nodes, local_world_size=processes)
    if machine.has_gpus:
        gpus = [machine.gpu(index) for index in (machine.launch_gpus or machine.cuda.visible)]
        # NVML may not say a GPU's capability: the launcher reads it from torch; 16-bit either way, same memory.
        devices = Devices("cuda", tuple(gpu.name or "GPU" for gpu in gpus),
                          tuple(gpu.compute_capability or (8, 0) for gpu in gpus))
    else:
        devices = Devices("cpu")
    try:
        return [(name, plan) for name, _staged, plan in stage_plans(config, world, devices)], None
    except BatchSplitError as error:
        # A global batch these processes cannot share: plan (and print the command) with the nearest that splits,
        # the learning rate still tuned for the batch asked for.
        resplit = dataclasses.replace(config, training=dataclasses.replace(
            config.training, batch_size=error.batch_sizes[0], base_batch_size=error.base_batch_size))
        try:
            plans = [(name, plan) for name, _staged, plan in stage_plans(resplit, world, devices)]
        except ConfigError:  # another stage's batch (a pipeline's sft block) or another limit: the launcher's word
            return [], str(error)
        machine.batch_split = error
        return plans, None
    except ConfigError as error:  # what the launcher would stop on here
        return [], str(error)


def _memory_plan(machine: Machine, shape: ModelShape, plan: Plan, lengths: DataLengths | None) -> MemoryPlan:
    budget, budget_source = _memory_budget(machine)
    return plan_memory(
        shape,
        dataclasses.replace(with_plan(machine.options.training, plan), data_lengths=lengths),
        num_devices=max(1, machine.num_procs),
        device_kind="gpu" if machine.has_gpus else "cpu",
        budget_bytes=budget,
        budget_source=budget_source,
        deepspeed_installed=machine.software.deepspeed_installed,
    )


def _step_time(machine: Machine, shape: ModelShape, plan: Plan, sources: Sources) -> StepTime | None:
    """A sampling objective's (GRPO's) step time on the launch's first GPU; none on CPU or a GPU not in the table. A
    reward-model judge is sized as a model is (its config); one that cannot be read is left unestimated."""
    setup = with_plan(machine.options.training, plan)
    if not machine.has_gpus or not setup.generation_tokens:
        return None
    gpu = machine.gpu((machine.launch_gpus or machine.cuda.visible)[0])
    sizes = {}
    for judge in setup.judges:
        if judge_kind(judge) == "reward model":
            try:
                sizes[judge] = sources.model_shape(judge, f"--judge {judge}").total_params
            except InputError:
                sizes[judge] = None
    return estimate_step_time(shape, setup, gpu.name or "", sizes)


def _bench(machine: Machine, sources: Sources) -> tuple[BenchResult | None, str | None]:
    """Runs the all-reduce measurement, or says why it cannot run here."""
    if machine.software.torch is None:
        return None, "torch cannot be imported"
    environ = dict(machine.environ)
    if machine.has_gpus:
        if len(machine.launch_gpus) < 2:
            return None, "needs at least 2 usable GPUs"
        if machine.software.torch_cuda is None or not machine.software.nccl_backend:
            return None, "torch has no CUDA/NCCL here"
        environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, pci_positions(machine, machine.launch_gpus)))
        backend, nprocs = "nccl", len(machine.launch_gpus)
    else:
        backend, nprocs = "gloo", max(2, machine.num_procs)
    request = BenchRequest(backend, nprocs, environ, machine.options.bench_timeout_s, bench_sizes(backend))
    return sources.bench(request), None


def _topology(machine: Machine) -> dict[str, Any] | None:
    if not machine.has_gpus:
        return None
    gpus = machine.nvml.gpus
    indices = [gpu.index for gpu in gpus]

    def matrix(cell: Callable) -> list[list[str]]:
        return [["X" if a == b else cell(machine.nvml.pair(a, b), a, b) for b in indices] for a in indices]

    return {
        "gpus": indices,
        "links": matrix(lambda pair, a, b: topology.link_label(pair)),
        "p2p": matrix(lambda pair, a, b: topology.p2p_label(pair)),
        "transport": matrix(lambda pair, a, b: machine.transports[(pair.gpu_a, pair.gpu_b)].label),
        "transport_reasons": {
            f"{a}-{b}": f"{transport.kind}: {transport.reason}" for (a, b), transport in machine.transports.items()
        },
        "cpu_affinity": [topology.cpu_ranges(gpu.cpu_affinity) for gpu in gpus],
        "numa_affinity": [",".join(map(str, gpu.numa_nodes)) if gpu.numa_nodes else "N/A" for gpu in gpus],
        "p2p_level": {"level": machine.p2p_level[0], "source": machine.p2p_level[1]},
        "legend": {"links": topology.MATRIX_LEGEND, "p2p": topology.P2P_LEGEND, "transport": topology.TRANSPORT_LEGEND},
    }


def _gpus(machine: Machine) -> list[dict[str, Any]]:
    rows = []
    for gpu in machine.nvml.gpus:
        row = dataclasses.asdict(gpu)
        row["cuda_index"] = machine.cuda.cuda_index(gpu.index) if machine.cuda else None
        row["excluded"] = machine.excluded.get(gpu.index)
        row["in_launch"] = gpu.index in machine.launch_gpus
        rows.append(row)
    return rows


def _driver(nvml: NvmlFacts, cuda: CudaView | None, software: SoftwareFacts) -> dict[str, Any]:
    return {
        "status": nvml.status,
        "error": nvml.error,
        "driver_version": nvml.driver_version,
        "cuda_driver_version": ".".join(map(str, nvml.cuda_driver_version)) if nvml.cuda_driver_version else None,
        "supports_torch_cuda": driver_supports_torch(nvml.cuda_driver_version, software.torch_cuda),
        "cuda_order": cuda.order_source if cuda else None,
        "cuda_order_note": cuda.note if cuda else None,
    }


def _json_ready(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return _json_ready(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item) for item in value]
    return value


def _memory_plan_dict(plan: MemoryPlan | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    content = dataclasses.asdict(plan)
    content["model"].pop("linear_layers")  # hundreds of rows; the totals say what matters
    return content


def assess(options: CheckOptions, sources: Sources) -> Machine:
    """Reads the machine and works out what a launch would use."""
    software = sources.software()
    system = sources.system()
    nvml = probe_nvml(sources.nvml, system.logical_cpus)
    has_gpus = nvml.status == "ok" and bool(nvml.gpus)
    cuda = None
    if has_gpus:
        uuids = sources.torch_cuda_uuids() if software.torch_cuda else None
        cuda = cuda_view(nvml.gpus, sources.environ, uuids)
    excluded = {index: reason for index in (cuda.visible if cuda else []) if (reason := exclusion_reason(nvml.gpus[index]))}
    usable = [index for index in (cuda.visible if cuda else []) if index not in excluded]
    num_procs = 0 if _nothing_runs(software, system, has_gpus) else _launch_processes(options, system, usable, has_gpus)
    launch_gpus = usable[:num_procs] if has_gpus else []
    nccl_settings = effective_nccl_settings(software)
    level = topology.p2p_level(nccl_settings, system.cpu_vendor, len(launch_gpus) or len(nvml.gpus))
    return Machine(
        options=options,
        environ=sources.environ,
        software=software,
        system=system,
        nvml=nvml,
        cuda=cuda,
        nccl_settings=nccl_settings,
        excluded=excluded,
        launch_gpus=launch_gpus,
        num_procs=num_procs,
        requested_procs=options.num_procs,
        p2p_level=level,
        transports={
            (pair.gpu_a, pair.gpu_b): topology.nccl_transport(pair, level[0], nccl_settings) for pair in nvml.pairs
        },
    )


def check(options: CheckOptions, sources: Sources) -> dict[str, Any]:
    # The model is looked up first, so a bad --model_name_or_path fails before the machine is read.
    shape = _model_shape(options, sources) if options.plan_requested else None
    machine = assess(options, sources)
    plans, machine.plan_refused = launch_plans(machine)
    if shape is not None and plans:
        name, plan = plans[-1]  # the final stage: a pipeline's peak (DPO)
        machine.memory_plan = _memory_plan(machine, shape, plan, sources.data_lengths(options.config, name))
        machine.memory_plan.step_time = _step_time(machine, shape, plan, sources)
    bench_skipped = None
    if options.bench:
        machine.bench, bench_skipped = _bench(machine, sources)
    problems = find_problems(machine)
    verdict = decide(machine, problems)
    return _json_ready(
        {
            "software": machine.software,
            "system": machine.system,
            "driver": _driver(machine.nvml, machine.cuda, machine.software),
            "gpus": _gpus(machine),
            "topology": _topology(machine),
            "launch": {
                "device": "gpu" if machine.has_gpus else "cpu",
                "num_procs": machine.num_procs,
                "gpus": machine.launch_gpus,
                "cuda_visible_devices": machine.environ.get("CUDA_VISIBLE_DEVICES"),
            },
            "plan": {name: plan.as_dict() for name, plan in plans} or None,
            "memory_plan": _memory_plan_dict(machine.memory_plan),
            "bench": machine.bench if machine.bench else ({"skipped": bench_skipped} if bench_skipped else None),
            "problems": problems,
            "verdict": verdict.verdict,
            "exit_code": verdict.exit_code,
            "command": verdict.command,
            "command_runs_now": verdict.command_runs_now,
            "command_notes": verdict.command_notes,
        }
    )
