"""Software facts: Python, torch and its CUDA/NCCL build, distributed backends, library versions, and the
NCCL_*/CUDA_* settings a launch would inherit (environment and nccl.conf)."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

LIBRARIES = ("trl", "transformers", "peft", "accelerate", "bitsandbytes", "deepspeed", "datasets", "nvidia-ml-py")
# Variables that change how CUDA, NCCL or torch.distributed behave; everything else in the environment is noise here.
RELEVANT_PREFIXES = ("NCCL_", "CUDA_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "MASTER_", "NNODES", "NODE_RANK")
SYSTEM_NCCL_CONF = "/etc/nccl.conf"


@dataclass
class SoftwareFacts:
    python: str
    platform: str
    torch: str | None
    torch_error: str | None = None
    torch_cuda: str | None = None  # the CUDA version torch was built for; None for a CPU-only build
    nccl: str | None = None
    distributed: bool = False
    gloo: bool = False
    nccl_backend: bool = False
    libraries: dict[str, str | None] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    nccl_conf: dict[str, str] = field(default_factory=dict)
    nccl_conf_files: list[str] = field(default_factory=list)

    @property
    def deepspeed_installed(self) -> bool:
        return self.libraries.get("deepspeed") is not None


def library_version(distribution: str) -> str | None:
    # Read from package metadata, not by importing: importing bitsandbytes or deepspeed prints and takes seconds.
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def relevant_environment(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: environ[name] for name in sorted(environ) if name.startswith(RELEVANT_PREFIXES)}


def nccl_conf_files(environ: Mapping[str, str]) -> list[str]:
    """The files NCCL reads, highest precedence first: NCCL_CONF_FILE or ~/.nccl.conf, then /etc/nccl.conf."""
    user_file = environ.get("NCCL_CONF_FILE") or str(Path(environ.get("HOME", "~")).expanduser() / ".nccl.conf")
    return [user_file, SYSTEM_NCCL_CONF]


def read_nccl_conf(paths: list[str]) -> tuple[dict[str, str], list[str]]:
    """Settings from the nccl.conf files that exist; like NCCL, the first file to set a variable wins."""
    settings: dict[str, str] = {}
    found = []
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        found.append(path)
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#") or "=" not in line:
                continue
            name, value = (part.strip() for part in line.split("=", 1))
            settings.setdefault(name, value)
    return settings, found


def effective_nccl_settings(software: SoftwareFacts) -> dict[str, str]:
    """What NCCL will see: the environment overrides nccl.conf."""
    settings = {name: value for name, value in software.nccl_conf.items() if name.startswith("NCCL_")}
    settings.update({name: value for name, value in software.environment.items() if name.startswith("NCCL_")})
    return settings


def _torch_facts() -> dict:
    try:
        import torch
        import torch.distributed as dist
    except Exception as error:  # a broken install must be reported, not crash the check
        return {"torch": None, "torch_error": f"{type(error).__name__}: {error}"}
    facts = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "distributed": dist.is_available()}
    if facts["distributed"]:
        facts["gloo"] = dist.is_gloo_available()
        facts["nccl_backend"] = dist.is_nccl_available()
    if torch.version.cuda:
        try:
            facts["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
        except Exception:  # NCCL missing from this build or its library failed to load
            facts["nccl"] = None
    return facts


def collect_software(environ: Mapping[str, str]) -> SoftwareFacts:
    nccl_conf, found = read_nccl_conf(nccl_conf_files(environ))
    return SoftwareFacts(
        python=sys.version.split()[0],
        platform=platform.platform(),
        libraries={name: library_version(name) for name in LIBRARIES},
        environment=relevant_environment(environ),
        nccl_conf=nccl_conf,
        nccl_conf_files=found,
        **_torch_facts(),
    )


def is_truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")

