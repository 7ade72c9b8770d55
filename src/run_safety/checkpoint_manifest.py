"""What a save wrote, and whether it is still there: the manifest inside a checkpoint's (or the final model's)
`.complete` marker, and its verification before that directory is trusted (resumed from, copied out, pushed).

- The manifest lists every file of the directory (subdirectories too: DeepSpeed's per-rank shards) with its size in
  bytes and a checksum of each BLOCK_BYTES block of it. Blocks, not files, are the unit of work: the ranks that wrote
  a checkpoint hash them between them right after the write, each its share (src/distributed.py
  `manifest_across_ranks`), so no rank reads a 16 GB checkpoint alone while the others wait.
- `verify`: each file the manifest names must be there, of its size, with its checksums; a file it does not name (a
  model card written later) is fine. The answer is one phrase naming the first file that is not as saved and how.
- A marker without a manifest (an empty `.complete`, written by a toolkit from before manifests) is trusted as it
  was: `read_manifest` says None and the caller says it was not verified.

The checksum is xxHash's XXH3-128 (the `xxhash` package, which datasets depends on): it detects damage (a file cut
short, flipped bytes, a bad copy), not tampering, which no one guards a checkpoint against. Measured on the 2-core
development machine (docs/reliability.md, "Verified checkpoints"): 6.7-14 GB/s from the page cache against sha256's
0.9-1.5, crc32's 1.6-2.8 and blake2b's 0.5-0.7, while writing the same file ran at 0.26-0.39 GB/s.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from src.run_safety.build_once import COMPLETE_MARKER

FORMAT = 1
CHECKSUM = "xxh3_128"
# 128 MiB: a 16 GB checkpoint is 128 blocks (16 for each of 8 ranks, or threads), and its manifest ~10 KB.
BLOCK_BYTES = 128 << 20
_READ_BYTES = 8 << 20  # one read: big enough for the disk, small enough that each thread's buffer does not matter


class Damaged(Exception):
    """A saved directory is not what was saved and nothing intact stands in for it (no intact checkpoint to resume
    from, a damaged final model to publish): one line, ExitStatus.DAMAGED, no traceback."""


@dataclass(frozen=True)
class Block:
    path: str  # relative to the directory, with forward slashes
    offset: int
    length: int


def listing(directory: Path, leave_out: tuple[str, ...] = ()) -> dict[str, int]:
    """Every file under `directory` but its marker (and the marker's temporary) and the files and folders named in
    `leave_out` (names at its top: what is rewritten after the save, as a model card), with its size."""
    directory = Path(directory)
    found = {}
    for root, dirs, names in os.walk(directory):
        if Path(root) == directory:
            dirs[:] = [name for name in dirs if name not in leave_out]
            names = [name for name in names if name not in leave_out]
        for name in names:
            if name.startswith(COMPLETE_MARKER):
                continue
            path = Path(root) / name
            found[path.relative_to(directory).as_posix()] = path.stat().st_size
    return found


def blocks(files: dict[str, int]) -> list[Block]:
    """The files cut into BLOCK_BYTES blocks, in a fixed order (an empty file is one empty block)."""
    return [Block(name, offset, min(BLOCK_BYTES, size - offset))
            for name, size in sorted(files.items()) for offset in range(0, max(size, 1), BLOCK_BYTES)]


def _checksum(directory: Path, block: Block) -> str:
    digest = xxhash.xxh3_128()
    buffer = memoryview(bytearray(min(_READ_BYTES, max(block.length, 1))))
    with open(Path(directory) / block.path, "rb", buffering=0) as handle:
        handle.seek(block.offset)
        left = block.length
        while left:
            read = handle.readinto(buffer[:min(left, len(buffer))])
            if not read:
                raise OSError(f"{block.path}: {block.offset + block.length - left:,} bytes, shorter than listed")
            digest.update(buffer[:read])
            left -= read
    return digest.hexdigest()


def checksums(directory: Path, share: list[Block], threads: int) -> list[str]:
    """Each block's checksum, in order; `threads` read at once (the reads and the hash release the GIL)."""
    if threads <= 1 or len(share) <= 1:
        return [_checksum(directory, block) for block in share]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda block: _checksum(directory, block), share))


def manifest(files: dict[str, int], block_checksums: list[str]) -> dict:
    """The manifest of `files`, given the checksums of `blocks(files)` in their order."""
    entries = {name: {"bytes": size, "checksums": []} for name, size in sorted(files.items())}
    for block, checksum in zip(blocks(files), block_checksums, strict=True):
        entries[block.path]["checksums"].append(checksum)
    return {"format": FORMAT, "checksum": CHECKSUM, "block_bytes": BLOCK_BYTES, "files": entries}


def write_marker(directory: Path, record: dict | None) -> None:
    """The `.complete` marker with its manifest, written whole or not at all (a temporary, synced, then renamed): a
    crash never leaves a marker with half a manifest."""
    marker = Path(directory) / COMPLETE_MARKER
    temporary = marker.with_name(f"{COMPLETE_MARKER}.{os.getpid()}")
    with open(temporary, "w") as handle:
        handle.write(json.dumps(record, separators=(",", ":")) if record else "")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, marker)


def remove_marker(directory: Path) -> None:
    """Before a directory is saved again in place (the final model of a resumed end): its old manifest would lie."""
    (Path(directory) / COMPLETE_MARKER).unlink(missing_ok=True)


def read_manifest(directory: Path) -> dict | None:
    """The manifest in `directory`'s marker; None for a marker without one (saved before manifests). Raises ValueError
    when the marker holds something else."""
    text = (Path(directory) / COMPLETE_MARKER).read_text()
    if not text.strip():
        return None
    record = json.loads(text)
    if not isinstance(record, dict) or record.get("checksum") != CHECKSUM or not isinstance(record.get("files"), dict):
        raise ValueError("not a manifest this toolkit writes")
    return record


def verify(directory: Path, threads: int) -> str | None:
    """None when every file the manifest names is there with its size and checksums (or the marker has no manifest);
    else one phrase: the first file not as saved and how. Sizes are compared first (a missing or cut file costs no
    read); the checksums cost one read of the directory, `threads` blocks at a time."""
    directory = Path(directory)
    try:
        record = read_manifest(directory)
    except (OSError, ValueError):
        return f"its completion record {COMPLETE_MARKER} is unreadable"
    if record is None:
        return None
    saved = {name: entry["bytes"] for name, entry in record["files"].items()}
    for name, size in saved.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        now = path.stat().st_size
        if now != size:
            how = "cut short" if now < size else "longer than saved"
            return f"{name} has {now:,} bytes of the {size:,} saved ({how})"
    expected = [checksum for entry in record["files"].values() for checksum in entry["checksums"]]
    if record.get("block_bytes") != BLOCK_BYTES or len(expected) != len(blocks(saved)):
        return f"its completion record {COMPLETE_MARKER} is unreadable"
    try:
        found = checksums(directory, blocks(saved), threads)
    except OSError as error:
        return f"{Path(error.filename).name if error.filename else 'a file'} cannot be read ({error.strerror or error})"
    for block, now, then in zip(blocks(saved), found, expected, strict=True):
        if now != then:
            return (f"{block.path} differs from what was saved (bytes {block.offset:,} to "
                    f"{block.offset + block.length:,}: checksum {now[:12]}, {then[:12]} when saved)")
    return None
