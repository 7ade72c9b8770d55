"""Which GPUs the training processes will see, in CUDA's numbering.

NVML numbers GPUs in PCI bus order and ignores CUDA_VISIBLE_DEVICES; CUDA applies CUDA_VISIBLE_DEVICES and, unless
CUDA_DEVICE_ORDER=PCI_BUS_ID, orders "fastest first". When torch can see CUDA it tells us the answer (the UUID of
each cuda:i); otherwise CUDA's rules are applied here to the NVML list. The launch command written by this tool
pins CUDA_DEVICE_ORDER=PCI_BUS_ID whenever it names GPUs, so the numbers it writes are nvidia-smi's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .nvml_probe import GpuFacts


@dataclass
class CudaView:
    visible: list[int]  # NVML indices, in CUDA order: visible[i] is cuda:i
    order_source: str  # "torch", "pci" (CUDA_DEVICE_ORDER=PCI_BUS_ID or identical GPUs) or "assumed-pci"
    mig_devices: list[str] = field(default_factory=list)  # MIG-... entries of CUDA_VISIBLE_DEVICES
    note: str | None = None

    def cuda_index(self, nvml_index: int) -> int | None:
        return self.visible.index(nvml_index) if nvml_index in self.visible else None


def _strip_gpu_prefix(uuid: str) -> str:
    return uuid[4:] if uuid.upper().startswith("GPU-") else uuid


def torch_cuda_uuids() -> list[str] | None:
    """UUIDs of cuda:0, cuda:1, ... as this process's torch sees them, or None when torch has no CUDA."""
    try:
        import torch

        if not torch.version.cuda or not torch.cuda.is_available():
            return None
        return [str(torch.cuda.get_device_properties(index).uuid) for index in range(torch.cuda.device_count())]
    except Exception:  # a CUDA that fails to initialise is reported through NVML and the driver checks
        return None


def _view_from_torch(gpus: list[GpuFacts], uuids: list[str]) -> CudaView:
    by_uuid = {_strip_gpu_prefix(gpu.uuid or "").lower(): gpu.index for gpu in gpus}
    visible = [by_uuid[key] for uuid in uuids if (key := _strip_gpu_prefix(uuid).lower()) in by_uuid]
    unmatched = [uuid for uuid in uuids if _strip_gpu_prefix(uuid).lower() not in by_uuid]
    return CudaView(visible=visible, order_source="torch", mig_devices=unmatched)


def _resolve_entry(entry: str, pci_order: list[GpuFacts]) -> int | None:
    """One CUDA_VISIBLE_DEVICES entry -> NVML index, or None where CUDA would stop reading the list."""
    if entry.lstrip("-").isdigit():
        position = int(entry)
        return pci_order[position].index if 0 <= position < len(pci_order) else None
    if entry.upper().startswith("GPU-"):
        wanted = _strip_gpu_prefix(entry).lower()
        matches = [gpu.index for gpu in pci_order if _strip_gpu_prefix(gpu.uuid or "").lower().startswith(wanted)]
        return matches[0] if len(matches) == 1 else None  # CUDA accepts a unique UUID prefix
    return None


def cuda_view(gpus: list[GpuFacts], environ: Mapping[str, str], torch_uuids: list[str] | None) -> CudaView:
    if torch_uuids is not None:
        return _view_from_torch(gpus, torch_uuids)
    pci_order = sorted(gpus, key=lambda gpu: gpu.bus_id or "")
    same_model = len({gpu.name for gpu in gpus}) <= 1
    order_source = "pci" if environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" or same_model else "assumed-pci"
    note = None
    if order_source == "assumed-pci":
        note = "CUDA orders different GPU models fastest first: its numbers may differ from nvidia-smi's"
    setting = environ.get("CUDA_VISIBLE_DEVICES")
    if setting is None:
        return CudaView(visible=[gpu.index for gpu in pci_order], order_source=order_source, note=note)
    visible: list[int] = []
    mig_devices: list[str] = []
    for entry in (part.strip() for part in setting.split(",")):
        if entry.upper().startswith("MIG-"):
            mig_devices.append(entry)
            continue
        index = _resolve_entry(entry, pci_order)
        if index is None or index in visible:
            break  # CUDA ignores an invalid entry and everything after it
        visible.append(index)
    return CudaView(visible=visible, order_source=order_source, mig_devices=mig_devices, note=note)
