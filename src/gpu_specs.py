"""GPUs' datasheet peaks by the name NVML and torch give them: dense bf16 tensor FLOP/s (no sparsity; fp16 for GPUs
without bf16: V100, T4) and memory bandwidth in bytes/s. Read by the throughput meter's MFU (src/throughput.py) and by
check_gpu's step-time estimate (src/diagnostics/time_plan.py). Light: imports nothing. Only GPUs named here get a
number: a wrong peak would give a confidently wrong one. A name matches its most specific key ("NVIDIA H100 80GB
HBM3", the SXM part, before the bare "H100", which takes the PCIe card's lower numbers)."""

from __future__ import annotations

PEAK_BF16_FLOPS = {
    "H200": 989e12, "H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12,
    "H100": 756e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "A10G": 70e12, "A10": 125e12,
    "RTX 4090": 165e12, "RTX 3090": 71e12, "A6000": 155e12, "V100": 125e12, "T4": 65e12,
}
MEMORY_BANDWIDTH = {
    "H200": 4.8e12, "H100 SXM": 3.35e12, "H100 80GB HBM3": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12,
    "H100": 2.0e12, "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 864e9,
    "L40": 864e9, "A10G": 600e9, "A10": 600e9, "RTX 4090": 1008e9, "RTX 3090": 936e9, "A6000": 768e9, "V100": 900e9,
    "T4": 320e9,
}


def _lookup(table: dict[str, float], device_name: str) -> float | None:
    for name, value in sorted(table.items(), key=lambda item: -len(item[0])):  # most specific first
        if name in device_name:
            return value
    return None


def peak_flops(device_name: str) -> float | None:
    return _lookup(PEAK_BF16_FLOPS, device_name)


def memory_bandwidth(device_name: str) -> float | None:
    return _lookup(MEMORY_BANDWIDTH, device_name)
