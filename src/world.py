"""The world a run runs in: the accelerators one process sees (`Devices`), the processes of the job (`World`: ranks,
world size, nodes, from torchrun's variables), and SageMaker's one-process-per-machine default when GPUs would idle."""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass


def sagemaker_process_hint(world: World, environ: Mapping[str, str] | None = None) -> str | None:
    """SageMaker starts one process per machine unless the estimator asks for torchrun: say so when GPUs would idle."""
    environ = os.environ if environ is None else environ
    gpus = int(environ.get("SM_NUM_GPUS") or 0)
    if gpus > world.local_world_size:
        return (f"SageMaker gives this machine {gpus} GPUs (SM_NUM_GPUS) but started {world.local_world_size} "
                "process(es): pass distribution={'torch_distributed': {'enabled': True}} to the estimator to use all")
    return None


def gpu_device_files() -> list[str]:
    """The device files a GPU driver makes on Linux (NVIDIA: /dev/nvidia*; ROCm: /dev/kfd; WSL 2: /dev/dxg), which
    torch.cuda needs to see any GPU. Elsewhere (macOS, Windows) the answer is left to torch: ["unknown"]."""
    if not sys.platform.startswith("linux"):
        return ["unknown"]
    return glob.glob("/dev/nvidia*") + [path for path in ("/dev/kfd", "/dev/dxg") if os.path.exists(path)]


@dataclass(frozen=True)
class Devices:
    """The accelerators one process can see (all processes of a job are assumed to see the same kind)."""

    kind: str  # "cuda" or "cpu"
    names: tuple[str, ...] = ()
    compute_capabilities: tuple[tuple[int, int], ...] = ()

    @classmethod
    def detect(cls) -> Devices:
        if not gpu_device_files():  # no GPU driver here: torch would say the same, after a ~2 s import
            return cls(kind="cpu")
        import torch

        if not torch.cuda.is_available():
            return cls(kind="cpu")
        count = torch.cuda.device_count()
        return cls(
            kind="cuda",
            names=tuple(torch.cuda.get_device_name(index) for index in range(count)),
            compute_capabilities=tuple(torch.cuda.get_device_capability(index) for index in range(count)),
        )


@dataclass(frozen=True)
class World:
    """The processes of the job, as torchrun (or a plain `python`) describes them."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> World:
        environ = os.environ if environ is None else environ
        world_size = int(environ.get("WORLD_SIZE", 1))
        return cls(
            world_size=world_size,
            rank=int(environ.get("RANK", 0)),
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world_size)),
        )

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0
