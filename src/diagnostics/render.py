"""The human-readable text of a report (the dict `report.check` returns): one section per concern, a matrix like
`nvidia-smi topo -m`, the problems with their fixes, and the verdict with the command last."""

from __future__ import annotations

import textwrap
from typing import Any

from src.plan import Plan, format_plan

from .memory_plan import GIB
from .problems.gpu_health import CLOCK_EVENT_REASONS

WIDTH = 110
INDENT = "  "
SEVERITY_MARKS = {"error": "[error]  ", "warning": "[warning]"}
COMPUTE_MODES = {0: "Default", 1: "Excl. thread", 2: "Prohibited", 3: "Excl. process"}


def _bytes(value: int | None) -> str:
    if value is None:
        return "?"
    for unit, scale in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value // 1024} KiB"


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / GIB:.1f}"


def _size(size_bytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:g} {unit}"
    return f"{size_bytes} B"


def _table(rows: list[list[str]], right_aligned: set[int] = frozenset()) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(width) if column in right_aligned else cell.ljust(width) for column, (cell, width) in enumerate(zip(row, widths))]
        lines.append((INDENT + "  ".join(cells)).rstrip())
    return lines


def _wrapped(text: str, first_prefix: str, next_prefix: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first_prefix, subsequent_indent=next_prefix, break_on_hyphens=False)


def _packed(items: list[str], separator: str) -> list[str]:
    """Items joined by separator, wrapped between items rather than inside one."""
    lines, current = [], ""
    for item in items:
        candidate = f"{current}{separator}{item}" if current else item
        if current and len(INDENT + candidate) > WIDTH:
            lines.append(INDENT + current)
            candidate = item
        current = candidate
    return lines + [INDENT + current] if current else lines


def _software(report: dict) -> list[str]:
    software = report["software"]
    if software["torch"] is None:
        torch = f"torch NOT IMPORTABLE ({software['torch_error']})"
    else:
        build = f"CUDA {software['torch_cuda']}, NCCL {software['nccl'] or '?'}" if software["torch_cuda"] else "CPU-only build"
        torch = f"torch {software['torch']} ({build})"
    backends = ", ".join(f"{name} {'yes' if software[key] else 'no'}" for name, key in (("gloo", "gloo"), ("nccl", "nccl_backend")))
    libraries = [f"{name} {version or '-'}" for name, version in software["libraries"].items()]
    lines = ["SOFTWARE", f"{INDENT}python {software['python']} · {torch} · backends: {backends}"]
    lines += _packed(libraries, " · ")
    settings = [f"{name}={value}" for name, value in software["environment"].items()]
    settings += [f"{name}={value} (nccl.conf)" for name, value in software["nccl_conf"].items() if name not in software["environment"]]
    lines += _wrapped("settings: " + (" ".join(settings) if settings else "no NCCL_*/CUDA_* variables, no nccl.conf"), INDENT, INDENT + "  ")
    return lines


def _system(report: dict) -> list[str]:
    system = report["system"]
    sockets = f"{system['sockets']} socket(s)" if system["sockets"] else "sockets ?"
    memlock = "unlimited" if system["memlock_bytes"] is None else _bytes(system["memlock_bytes"])
    shm = "none" if system["shm_bytes"] is None else _bytes(system["shm_bytes"])
    if system["rendezvous_port_free"] is None:
        port = f"port {system['rendezvous_port']} (checked on node rank 0)"
    else:
        port = f"port {system['rendezvous_port']} {'free' if system['rendezvous_port_free'] else 'IN USE'}"
    rows = [
        ["CPU", f"{system['cpu_model'] or '?'} · {system['usable_cpus']} usable of {system['logical_cpus']} logical CPUs · {sockets} · NUMA nodes {','.join(map(str, system['numa_nodes'])) or '?'}"],
        ["memory", f"{_bytes(system['memory_total_bytes'])} total, {_bytes(system['memory_available_bytes'])} available"],
        ["host", f"/dev/shm {shm} · memlock {memlock} · container {'yes' if system['in_container'] else 'no'} · VM {'yes' if system['hypervisor'] else 'no'} · IOMMU {system['iommu']}"],
        ["network", f"{_infiniband(system['infiniband_ports'])} · rendezvous {port}"],
    ]
    return ["SYSTEM"] + _table(rows)


def _infiniband(ports: list[dict]) -> str:
    """'8 ports ACTIVE (mlx5_0..mlx5_7)' rather than a line per port."""
    if not ports:
        return "no InfiniBand"
    groups: dict[tuple[str, str], list[str]] = {}
    for port in ports:
        groups.setdefault((port["link_layer"], port["state"].split(":")[-1].strip()), []).append(f"{port['device']}/{port['port']}")
    parts = []
    for (link_layer, state), names in groups.items():
        listed = ", ".join(names) if len(names) <= 2 else f"{names[0]}..{names[-1]}"
        parts.append(f"{len(names)} {link_layer} port(s) {state} ({listed})")
    return "; ".join(parts)


def _ecc_cell(gpu: dict) -> str:
    if gpu["ecc_enabled"] is None:
        return "n/a"
    if not gpu["ecc_enabled"]:
        return "off"
    findings = []
    if gpu["ecc_uncorrected_volatile"]:
        findings.append(f"{gpu['ecc_uncorrected_volatile']} err")
    if gpu["remap_pending"]:
        findings.append("remap")
    if gpu["remap_failed"]:
        findings.append("FAIL")
    return "+".join(findings) or "ok"


def _on_off(value: bool | None) -> str:
    return "n/a" if value is None else ("on" if value else "off")


def _clocks_cell(gpu: dict) -> str:
    reasons = gpu["clocks_event_reasons"]
    if reasons is None:
        return "n/a"
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if reasons & bit]
    return ", ".join(names) or "ok"


def _gpu_rows(report: dict) -> list[str]:
    header = ["GPU", "cuda", "model", "cc", "mem free/total GiB", "ECC", "MIG", "procs", "temp", "power W", "PCIe now/max", "bus id"]
    rows = [header]
    for gpu in report["gpus"]:
        if gpu["lost"]:
            rows.append([str(gpu["index"]), "-", "LOST (fell off the bus)"] + [""] * 8 + [gpu["bus_id"] or "?"])
            continue
        capability = ".".join(map(str, gpu["compute_capability"])) if gpu["compute_capability"] else "?"
        power = f"{gpu['power_w']:.0f}/{gpu['power_limit_w']:.0f}" if gpu["power_w"] is not None and gpu["power_limit_w"] else "n/a"
        pcie = f"{gpu['pcie_generation']}x{gpu['pcie_width']} / {gpu['pcie_generation_max']}x{gpu['pcie_width_max']}"
        rows.append(
            [
                str(gpu["index"]),
                "-" if gpu["cuda_index"] is None else str(gpu["cuda_index"]),
                gpu["name"] or "?",
                capability,
                f"{_gib(gpu['memory_free_bytes'])}/{_gib(gpu['memory_total_bytes'])}",
                _ecc_cell(gpu),
                _on_off(gpu["mig_enabled"]),
                str(len(gpu["processes"])),
                "n/a" if gpu["temperature_c"] is None else f"{gpu['temperature_c']}C",
                power,
                pcie if gpu["pcie_width"] else "n/a",
                gpu["bus_id"] or "?",
            ]
        )
    lines = _table(rows) + _wrapped(
        "ECC: uncorrected errors since reset (err), pending row remap (remap), failed remap (FAIL). "
        "PCIe: generation x width; the generation drops while a GPU idles, the width should not.",
        INDENT + "Legend: ",
        INDENT + "  ",
    )
    details = [["GPU", "UUID", "compute mode", "persistence", "clocks", "launch"]]
    for gpu in report["gpus"]:
        launch = "used" if gpu["in_launch"] else ("left out: " + gpu["excluded"] if gpu["excluded"] else ("hidden" if gpu["cuda_index"] is None else "not needed"))
        details.append(
            [
                str(gpu["index"]),
                gpu["uuid"] or "?",
                COMPUTE_MODES.get(gpu["compute_mode"], "n/a"),
                _on_off(gpu["persistence_mode"]),
                _clocks_cell(gpu),
                launch,
            ]
        )
    return lines + [""] + _table(details)


def _driver_and_gpus(report: dict) -> list[str]:
    driver = report["driver"]
    lines = ["DRIVER AND GPUS"]
    if driver["status"] != "ok" or not report["gpus"]:
        on_bus = report["system"]["nvidia_pci_devices"]
        if driver["status"] in ("no_library", "no_pynvml", "ok") and not on_bus:
            lines.append(f"{INDENT}No NVIDIA GPU: no NVIDIA driver and no NVIDIA device on the PCI bus. This machine trains on CPU with gloo.")
        else:
            lines.append(f"{INDENT}NVML unavailable ({driver['status']}: {driver['error'] or 'no GPU reported'}); {on_bus} NVIDIA device(s) on the PCI bus.")
        return lines
    torch_cuda = report["software"]["torch_cuda"]
    order = {"torch": "as torch reports", "pci": "PCI bus order", "assumed-pci": "PCI bus order assumed"}[driver["cuda_order"]]
    lines.append(
        f"{INDENT}driver {driver['driver_version']} · CUDA {driver['cuda_driver_version']}"
        + (f" (torch built for {torch_cuda}: {'new enough' if driver['supports_torch_cuda'] else 'TOO OLD'})" if torch_cuda else "")
        + f" · cuda numbering: {order}"
        + (f" · CUDA_VISIBLE_DEVICES={report['launch']['cuda_visible_devices']}" if report["launch"]["cuda_visible_devices"] is not None else "")
    )
    if driver["cuda_order_note"]:
        lines.append(f"{INDENT}note: {driver['cuda_order_note']}")
    return lines + _gpu_rows(report)


def _matrix(title: str, labels: list[list[str]], gpus: list[int], extra_columns: list[tuple[str, list[str]]] = ()) -> list[str]:
    header = [title] + [f"GPU{index}" for index in gpus] + [name for name, _values in extra_columns]
    rows = [header]
    for row_number, index in enumerate(gpus):
        rows.append([f"GPU{index}"] + labels[row_number] + [values[row_number] for _name, values in extra_columns])
    return _table(rows)


def _topology(report: dict) -> list[str]:
    topology = report["topology"]
    if topology is None:
        return []
    gpus = topology["gpus"]
    level = topology["p2p_level"]
    lines = ["TOPOLOGY (as nvidia-smi topo -m, rebuilt from NVML)"]
    lines += _matrix("", topology["links"], gpus, [("CPU Affinity", topology["cpu_affinity"]), ("NUMA Affinity", topology["numa_affinity"])])
    lines += _wrapped(topology["legend"]["links"], INDENT + "Legend: ", INDENT + "  ")
    lines += [""] + _matrix("P2P r/w", topology["p2p"], gpus)
    lines += _wrapped(topology["legend"]["p2p"], INDENT + "Legend: ", INDENT + "  ")
    lines += [""] + _matrix("NCCL", topology["transport"], gpus)
    lines += _wrapped(
        f"{topology['legend']['transport']}. P2P level {level['level']} ({level['source']}).", INDENT + "Legend: ", INDENT + "  "
    )
    return lines


def _launch_plan(report: dict) -> list[str]:
    """The launcher's own plan table (src/config.py format_plan), as its --dry_run prints it for the same launch."""
    if not report.get("plan"):
        return []
    lines = ["LAUNCH PLAN (the launcher's, for the command below)"]
    for stage, plan in report["plan"].items():
        if len(report["plan"]) > 1:
            lines.append(f"{INDENT}{stage}:")
        lines += [INDENT + line for line in format_plan(Plan(**plan)).splitlines()]
    return lines


def _lengths(plan: dict) -> str:
    """max_length, and the tokens per sequence the plan counts when the data audit gave them (and where from)."""
    lengths = plan.get("data_lengths")
    if not lengths:
        return f"max_length {plan['max_length']}"
    if lengths["packed"]:
        return f"max_length {plan['max_length']} (sequences packed to it)"
    cut = ", cut to max_length" if lengths["longest_tokens"] > plan["max_length"] else ""
    reasoning = ", reasoning included" if lengths["reasoning_share"] and lengths["reasoning"] == "keep" else ""
    return (f"max_length {plan['max_length']} · planned at {plan['sequence_tokens']} tokens per sequence: the data's "
            f"longest{cut}{reasoning}; 99% within {lengths['suggested_max_length']} ({lengths['source']})")


def _memory_plan(report: dict) -> list[str]:
    plan = report["memory_plan"]
    if plan is None and report.get("plan") is None:
        return ["MEMORY PLAN", f"{INDENT}none: the launcher would not start this launch (see PROBLEMS)"]
    if plan is None:
        return ["MEMORY PLAN", f"{INDENT}add --model_name_or_path NAME_OR_PATH or --params 7e9 (and --config RECIPE.yaml) for memory per GPU and the batch that fits"]
    model = plan["model"]
    on_gpu = plan["device_kind"] == "gpu"
    devices = f"{plan['num_devices']} GPU(s)" if on_gpu else f"{plan['num_devices']} process(es) on CPU"
    lines = [
        f"MEMORY PLAN  {model['name']} · {_parameters(model['total_params'])} parameters · {model['num_layers']} layers · "
        f"hidden {model['hidden_size']} · vocab {model['vocab_size']}"
    ]
    lines += _wrapped(f"source: {model['source']}", INDENT, INDENT + "  ")
    lines += _wrapped(
        f"{plan['stage'].upper()} · {_lengths(plan)} · per-device batch {plan['per_device_batch_size']} ({plan['batch_source']}) · "
        f"gradient checkpointing {'on' if plan['gradient_checkpointing'] else 'off'} · {plan['precision']} · {devices} · "
        f"budget {_gib(plan['budget_bytes'])} GiB ({plan['budget_source']})",
        INDENT,
        INDENT + "  ",
    )
    targets = plan["lora_target_modules"] if isinstance(plan["lora_target_modules"], str) else ",".join(plan["lora_target_modules"])
    lines.append(f"{INDENT}LoRA r={plan['lora_r']} on {targets}: {plan['lora_trainable_params'] / 1e6:.1f}M trainable parameters")
    rows = [["method", "model+optim", "reference", "activations", "margin", "per GPU" if on_gpu else "per process", "fits", "max batch", "note"]]
    for estimate in plan["estimates"]:
        rows.append(
            [
                estimate["label"] + (" <- chosen" if estimate["chosen"] else ""),
                f"{_gib(estimate['model_state_bytes'])} GiB",
                f"{_gib(estimate['reference_bytes'])} GiB" if estimate["reference_bytes"] else
                f"none (-{_gib(estimate['reference_saved_bytes'])} GiB)" if estimate.get("reference_saved_bytes") else "-",
                f"{_gib(estimate['activation_bytes'])} GiB",
                f"{_gib(estimate['margin_bytes'])} GiB",
                f"{_gib(estimate['total_bytes'])} GiB",
                ("yes" if estimate["fits"] else "NO") if estimate["runs_here"] else "-",
                str(estimate["max_per_device_batch"]) if estimate["runs_here"] else "-",
                estimate["note"] or "",
            ]
        )
    lines += _table(rows, right_aligned={1, 2, 3, 4, 5, 7})
    lines += _wrapped(_engine_states(plan), INDENT, INDENT)
    lines += _wrapped(_host_loads(plan), INDENT, INDENT)
    if plan.get("generation_bytes_per_sample"):
        lines += _wrapped(
            f"{plan['stage'].upper()} samples its answers before each step: a KV cache of "
            f"{_gib(plan['generation_bytes_per_sample'] * plan['per_device_batch_size'])} GiB per process for "
            f"sequences of {plan['generation_tokens']} tokens (prompt + answer); the activations column is the larger "
            "of that and the step's activations.", INDENT, INDENT)
    if plan.get("step_time"):
        lines += _wrapped(_step_time(plan["stage"], plan["step_time"]), INDENT, INDENT)
    lines += _wrapped(
        "Activations are an estimate (Llama-style blocks, fused attention, logits in fp32); margin = 10% for "
        "fragmentation + 1 GiB per process for the CUDA context. The DPO (and KTO) reference is none with LoRA or "
        "precomputed log-probs, sharded only under ZeRO-3; a reference-free objective's none (-X) is the copy DPO "
        "keeps when it does not cache reference log-probs.",
        INDENT,
        INDENT,
    )
    return lines


def _engine_states(plan: dict) -> str:
    """One line: each engine's model+optim split per process into weights + gradients + optimizer states (+ the layer
    ZeRO-3 and FSDP gather as it runs)."""
    parts = []
    for estimate in plan["estimates"]:
        state = estimate.get("engine_state")
        if state:
            gathered = f" + {_gib(state['working_set'])} gathered" if state["working_set"] else ""
            parts.append(f"{estimate['label']} {_gib(state['weights'])} + {_gib(state['gradients'])} + "
                         f"{_gib(state['optimizer'])}{gathered}")
    per = "GPU" if plan["device_kind"] == "gpu" else "process"
    return f"Full fine-tuning's model+optim per {per}, weights + gradients + optimizer states (GiB): " + "; ".join(parts)


def _host_loads(plan: dict) -> str:
    """One line: each method's host memory per rank at the peak of the model's load."""
    parts = [f"{estimate['label']} {_gib(estimate['host_load_bytes'])}" for estimate in plan["estimates"]
             if estimate.get("host_load_bytes")]
    return ("Host memory per rank while the model loads (GiB; ZeRO-3 and FSDP2: each rank reads its share, the final "
            "model is written by rank 0 a tensor at a time): " + "; ".join(parts))


def _seconds(value: float) -> str:
    return f"{value:.2g} s" if value < 10 else f"{value:.0f} s"


def _step_time(stage: str, step: dict) -> str:
    """One line: the estimated step time of a sampling objective and its split (src/diagnostics/time_plan.py)."""
    judged = [judge["seconds"] for judge in step["judges"]]
    total = step["generation_s"] + step["training_s"] + sum(seconds or 0.0 for seconds in judged)
    share = lambda seconds: f"{seconds / total:.0%}" if total else "-"  # noqa: E731
    parts = []
    for judge in step["judges"]:
        if judge["seconds"] is None:
            parts.append(f"{judge['judge']}: not estimated (a {judge['kind']}: the run logs time/judging_s)")
        elif judge["kind"] == "checker":
            parts.append(f"{judge['judge']} checker ~0 s")
        else:
            parts.append(f"reward model {judge['judge']} {_seconds(judge['seconds'])} ({share(judge['seconds'])})")
    unknown = any(seconds is None for seconds in judged)
    return (f"{stage.upper()} step time, an estimate for {step['gpu']} ({step['peak_flops'] / 1e12:.0f} TFLOP/s bf16, "
            f"{step['bandwidth'] / 1e12:.2g} TB/s): ~{_seconds(total)}{' + judging' if unknown else ''} per optimizer "
            f"step ({step['answers']} answers per process) = sampling {_seconds(step['generation_s'])} "
            f"({share(step['generation_s'])}) + judging [{'; '.join(parts) or 'none'}] + training "
            f"{_seconds(step['training_s'])} ({share(step['training_s'])}); assuming {step['assumptions']} "
            "(docs/grpo.md). The run logs the measured split: time/generation_s, time/judging_s, step_time.")


def _bench(report: dict) -> list[str]:
    bench = report["bench"]
    if bench is None:
        return ["BANDWIDTH", f"{INDENT}add --bench to measure all-reduce bus bandwidth (a few seconds)"]
    if "skipped" in bench:
        return ["BANDWIDTH", f"{INDENT}not measured: {bench['skipped']}"]
    lines = [f"BANDWIDTH  all-reduce over {bench['nprocs']} processes, {bench['backend']}; busbw = algbw * 2(n-1)/n as nccl-tests"]
    for number, attempt in enumerate(bench["attempts"], start=1):
        p2p = "NCCL_P2P_DISABLE=1" if attempt["p2p_disabled"] else ("P2P allowed" if bench["backend"] == "nccl" else "TCP")
        status = attempt["status"] + (f": {attempt['error']}" if attempt["error"] else "")
        lines += _wrapped(f"attempt {number} ({p2p}, {attempt['seconds']:.1f} s): {status}", INDENT, INDENT + "  ")
        if attempt["points"]:
            rows = [["size", "time/iter", "algbw", "busbw", "sum"]]
            for point in attempt["points"]:
                rows.append(
                    [
                        _size(point["size_bytes"]),
                        f"{point['seconds_per_iteration'] * 1e3:.3f} ms",
                        f"{point['algbw_gbps']:.2f} GB/s",
                        f"{point['busbw_gbps']:.2f} GB/s",
                        "ok" if point["correct"] else "WRONG",
                    ]
                )
            lines += _table(rows, right_aligned={0, 1, 2, 3})
    return lines


def _problems(report: dict) -> list[str]:
    problems = report["problems"]
    if not problems:
        return ["PROBLEMS", f"{INDENT}none"]
    errors = sum(problem["severity"] == "error" for problem in problems)
    lines = [f"PROBLEMS ({errors} error(s), {len(problems) - errors} warning(s))"]
    for problem in problems:
        mark = SEVERITY_MARKS[problem["severity"]]
        lines += _wrapped(problem["what"], INDENT + mark + " ", INDENT + " " * (len(mark) + 1))
        lines += _wrapped("fix: " + problem["fix"], INDENT + " " * (len(mark) + 1), INDENT + " " * (len(mark) + 6))
    return lines


def _verdict(report: dict) -> list[str]:
    lines = [f"VERDICT: {report['verdict']} (exit {report['exit_code']})"]
    if report["command"] is None:
        lines.append(f"{INDENT}no command yet: fix the errors above, then run python check_gpu.py again")
        return lines
    if not report["command_runs_now"]:
        label = "once the errors are fixed, run:"
    else:
        label = "run what works now:" if report["exit_code"] == 2 else "run:"
    lines.append(f"{INDENT}{label} {report['command']}")
    for note in report["command_notes"]:
        lines += _wrapped(note, INDENT + "  - ", INDENT + "    ")
    return lines


def _title(report: dict) -> list[str]:
    return [f"check_gpu.py on {report['system']['hostname']}: is this machine ready to train, and how to launch"]


def render(report: dict[str, Any]) -> str:
    sections = [_title, _software, _system, _driver_and_gpus, _topology, _launch_plan, _memory_plan, _bench, _problems,
                _verdict]
    blocks = [section(report) for section in sections]
    return "\n\n".join("\n".join(block) for block in blocks if block) + "\n"


def _parameters(count: int) -> str:
    """7.24B, 494.0M, 0.9M: billions where it reads naturally, millions below."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
