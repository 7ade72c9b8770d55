"""The software under the GPUs: torch's build (CPU-only, CUDA it cannot run), the driver (absent, not loaded, mismatched
after an upgrade, too old for torch's CUDA) and no GPU visible to torch.
"""

from __future__ import annotations

from src.diagnostics.problems.machine import ERROR, WARNING, Machine, Problem, version_tuple


# Oldest driver for each CUDA release (CUDA release notes, Linux), for the "driver too old" fix.
MIN_DRIVER_FOR_CUDA = {
    (11, 8): "520", (12, 0): "525", (12, 1): "530", (12, 2): "535", (12, 3): "545", (12, 4): "550",
    (12, 5): "555", (12, 6): "560", (12, 8): "570", (12, 9): "575", (13, 0): "580",
}  # fmt: skip


def torch_build(machine: Machine) -> list[Problem]:
    software = machine.software
    reinstall = "pip install -r requirements.txt (on a GPU machine install your CUDA build of torch first)"
    if software.torch is None:
        return [Problem(ERROR, "torch_missing", f"torch cannot be imported ({software.torch_error})", reinstall)]
    if not software.distributed:
        return [Problem(ERROR, "no_distributed", f"torch {software.torch} was built without torch.distributed", reinstall)]
    if not machine.has_gpus:
        if not software.gloo:
            return [Problem(ERROR, "no_gloo", f"torch {software.torch} has no gloo backend for CPU training", reinstall)]
        return []
    if software.torch_cuda is None:
        driver_cuda = ".".join(map(str, machine.nvml.cuda_driver_version or ()))
        return [
            Problem(
                ERROR,
                "torch_cpu_build",
                f"torch {software.torch} is a CPU-only build but this machine has {len(machine.nvml.gpus)} NVIDIA GPU(s)",
                "install torch's CUDA build for a CUDA version your driver supports"
                + (f" (at most {driver_cuda})" if driver_cuda else "")
                + ": see https://pytorch.org/get-started/locally/",
            )
        ]
    if not software.nccl_backend:
        return [Problem(ERROR, "no_nccl", f"torch {software.torch} has CUDA but no NCCL backend", reinstall)]
    return []


def driver(machine: Machine) -> list[Problem]:
    nvml, system = machine.nvml, machine.system
    on_bus = system.nvidia_pci_devices
    # /sys is not namespaced: a container sees the host's NVIDIA devices on the bus even when they are not passed in.
    container_hint = " In a container, start it with the NVIDIA container toolkit: docker run --gpus all ..." if system.in_container else ""
    if nvml.status == "ok" and nvml.gpus:
        return []
    if nvml.status == "ok" and on_bus:
        what = f"the NVIDIA driver is loaded but sees none of the {on_bus} NVIDIA GPU(s) on the PCI bus"
        return [Problem(ERROR, "driver_sees_no_gpu", what, "dmesg | grep -i nvrm says why; reboot, then reinstall the driver")]
    if nvml.status in ("ok", "no_library", "no_pynvml") and not on_bus:
        return [
            Problem(
                WARNING,
                "no_gpu",
                "no NVIDIA GPU on this machine: training runs on CPU with gloo, fine for tiny models and tests, "
                "far too slow for real ones",
                "nothing to do for CPU runs; for real training use a machine with NVIDIA GPUs",
            )
        ]
    if nvml.status == "no_pynvml":
        return [Problem(ERROR, "no_pynvml", f"nvidia-ml-py is not installed: cannot inspect the {on_bus} NVIDIA GPU(s)", "pip install nvidia-ml-py")]
    fixes = {
        "no_library": (
            f"{on_bus} NVIDIA GPU(s) on the PCI bus but no NVIDIA driver (libnvidia-ml.so not found)",
            "install the NVIDIA driver (e.g. sudo ubuntu-drivers install, or your distribution's nvidia-driver package) and reboot."
            + container_hint,
        ),
        "driver_not_loaded": (
            "the NVIDIA driver library is installed but its kernel module is not loaded",
            "sudo modprobe nvidia, or reboot; dmesg | grep -i nvidia says why it failed (Secure Boot blocks unsigned modules)",
        ),
        "version_mismatch": (
            "the NVIDIA driver library and kernel module versions differ (the driver was updated without a reboot)",
            "reboot, or unload and reload the nvidia kernel modules with no GPU process running",
        ),
        "no_permission": ("no permission to query the NVIDIA driver", "run as a user that can open /dev/nvidia* (e.g. the video group)"),
    }
    what, fix = fixes.get(nvml.status, (f"NVML failed: {nvml.error}", "check nvidia-smi; reinstall the driver if it fails too"))
    return [Problem(ERROR, nvml.status if nvml.status in fixes else "nvml_failed", what, fix)]


def driver_supports_torch(driver_cuda: tuple[int, int] | None, torch_cuda: str | None) -> bool | None:
    """Whether the driver's CUDA version is at least the one torch was built for; None when either is unknown."""
    wanted = version_tuple(torch_cuda)
    if driver_cuda is None or wanted is None:
        return None
    return driver_cuda >= wanted[:2]


def driver_too_old(machine: Machine) -> list[Problem]:
    driver_cuda = machine.nvml.cuda_driver_version
    if not machine.has_gpus or driver_supports_torch(driver_cuda, machine.software.torch_cuda) in (None, True):
        return []
    torch_cuda = version_tuple(machine.software.torch_cuda)
    wanted = ".".join(map(str, torch_cuda[:2]))
    have = ".".join(map(str, driver_cuda))
    minimum = MIN_DRIVER_FOR_CUDA.get(torch_cuda[:2])
    fix = (
        f"update the NVIDIA driver{f' to {minimum} or newer' if minimum else ''}, "
        f"or install a torch build for CUDA {have} or older"
    )
    if driver_cuda[0] < torch_cuda[0]:
        what = f"driver {machine.nvml.driver_version} supports CUDA {have} but torch was built for CUDA {wanted}: CUDA will not initialise"
        return [Problem(ERROR, "driver_too_old", what, fix)]
    what = (
        f"driver {machine.nvml.driver_version} supports CUDA {have}, older than torch's CUDA {wanted}: it runs through "
        "minor-version compatibility, but kernels that need PTX JIT or newer driver features fail"
    )
    return [Problem(WARNING, "driver_older_than_torch", what, fix)]


def no_visible_gpu(machine: Machine) -> list[Problem]:
    if not machine.has_gpus or machine.cuda.visible:
        return []
    setting = machine.environ.get("CUDA_VISIBLE_DEVICES")
    what = f"CUDA_VISIBLE_DEVICES={setting!r} hides all {len(machine.nvml.gpus)} GPUs"
    if machine.cuda.mig_devices:
        what += f" (it names MIG instances {', '.join(machine.cuda.mig_devices)}; NCCL cannot all-reduce across MIG instances)"
    return [Problem(ERROR, "no_visible_gpu", what, "unset CUDA_VISIBLE_DEVICES, or list whole GPUs (e.g. CUDA_VISIBLE_DEVICES=0,1)")]
