"""What verified checkpoints cost (src/run_safety/checkpoint_manifest.py): a checkpoint-like directory is written,
its manifest recorded as a save records it, then verified as a resume verifies it, at each size given; next to the
write itself and a plain read of the same bytes. The arms of one size run in turn on the same file.

    python bench/bench_checkpoint_checksums.py --sizes_mb 256 1024 --repeats 2

- write: the file written and fsynced (8 MiB writes), what a save costs at least;
- record: `manifest_across_ranks` on one process right after the write (the bytes mostly in the page cache);
- cold read / verify: the file's pages dropped first (posix_fadvise DONTNEED, this file only), then a plain read of
  it, or `verify` on every core: what a resume pays.
Also the checksum functions alone on the warm file (xxh3_128, crc32, sha256, blake2b), in GB/s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from src.world import World  # noqa: E402
from src.distributed import manifest_across_ranks  # noqa: E402
from src.resource_limits import usable_cores  # noqa: E402
from src.run_safety.checkpoint_manifest import verify, write_marker  # noqa: E402

CHUNK = 8 << 20


def write(path: Path, size: int) -> float:
    data = os.urandom(CHUNK)
    started = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(size // CHUNK):
            handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def drop_pages(path: Path) -> None:
    with open(path, "rb") as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read(path: Path, update=None) -> float:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while read_bytes := handle.readinto(buffer):
            if update:
                update(view[:read_bytes])
    return time.perf_counter() - started


class Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data):
        self.value = zlib.crc32(data, self.value)


CHECKSUMS = {"xxh3_128": xxhash.xxh3_128, "crc32": Crc32, "sha256": hashlib.sha256, "blake2b": hashlib.blake2b}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes_mb", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"{usable_cores()} cores; load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        for size_mb in args.sizes_mb:
            checkpoint = Path(root) / f"checkpoint-{size_mb}"
            checkpoint.mkdir()
            weights = checkpoint / "model.safetensors"
            for repeat in range(args.repeats):
                seconds = {"write": write(weights, size_mb << 20)}
                started = time.perf_counter()
                manifest, _ = manifest_across_ranks(checkpoint, World())
                seconds["record"] = time.perf_counter() - started
                write_marker(checkpoint, manifest)
                drop_pages(weights)
                seconds["cold read"] = read(weights)
                drop_pages(weights)
                started = time.perf_counter()
                assert verify(checkpoint, usable_cores()) is None
                seconds["verify"] = time.perf_counter() - started
                for name, make in CHECKSUMS.items():
                    seconds[f"{name} (warm)"] = read(weights, make().update)
                print(f"{size_mb} MB, run {repeat + 1}: " + ", ".join(
                    f"{name} {value:.2f} s ({size_mb / 1024 / value:.2f} GB/s)" for name, value in seconds.items()),
                    flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
