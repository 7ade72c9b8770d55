"""The problems check_gpu.py detects, one rule per problem, each with its fix.

A rule reads the `Machine` (every fact gathered, plus what was derived from them) and returns zero or more `Problem`s.
"error" means the launch as things stand would fail or give wrong results; "warning" means it runs, but slower or at
risk. A problem may name environment variables the launch command needs to work around it (`command_env`); `verdict.py`
puts them in the command.

The rules by what they look at: driver.py (torch's build and the driver), gpu_health.py (each GPU and the set),
interconnect.py (between GPUs), host.py (the host and launch settings), run_request.py (what the user asked for);
machine.py holds what they read and return. RULES below is their order.
"""

from __future__ import annotations

from typing import Callable

from src.diagnostics.problems.driver import driver, driver_too_old, no_visible_gpu, torch_build
from src.diagnostics.problems.gpu_health import (bf16_unsupported, compute_mode, gpu_lost, memory_errors, mig,
                                                 mixed_models, other_processes, pcie_width, throttling,
                                                 too_many_processes)
from src.diagnostics.problems.host import (infiniband, memlock, multi_node, rendezvous_port, shared_memory,
                                           stale_settings)
from src.diagnostics.problems.interconnect import (consumer_gpus, cross_socket, nvlink_p2p_broken, p2p_unavailable,
                                                   p2p_unreliable)
from src.diagnostics.problems.machine import ERROR, Machine, Problem
from src.diagnostics.problems.run_request import (batch_does_not_split, bench_outcome, max_length_cuts_data, memory_fit,
                                                  past_context, plan_refused)


RULES: tuple[Callable[[Machine], list[Problem]], ...] = (
    driver,
    torch_build,
    driver_too_old,
    no_visible_gpu,
    gpu_lost,
    mig,
    memory_errors,
    compute_mode,
    too_many_processes,
    multi_node,
    bf16_unsupported,
    nvlink_p2p_broken,
    plan_refused,
    batch_does_not_split,
    memory_fit,
    max_length_cuts_data,
    past_context,
    bench_outcome,
    shared_memory,
    other_processes,
    throttling,
    pcie_width,
    mixed_models,
    consumer_gpus,
    p2p_unavailable,
    p2p_unreliable,
    cross_socket,
    rendezvous_port,
    infiniband,
    memlock,
    stale_settings,
)


def find_problems(machine: Machine) -> list[Problem]:
    """Every problem, errors first, in the order of RULES within each severity."""
    problems = [problem for rule in RULES for problem in rule(machine)]
    return sorted(problems, key=lambda problem: problem.severity != ERROR)
