"""A checkpoint is verified before it is trusted (src/run_safety/checkpoint_manifest.py): what a save wrote is recorded
in its `.complete` marker, and a damaged checkpoint (cut short, a byte altered, a file missing) is named and skipped
for the newest intact one. In the pytest process: what lives between processes (every rank's share, the resume to the
same numbers, the exit status) is tests/test_resilience.py's test_a_damaged_checkpoint_...."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from src.distributed import manifest_across_ranks
from src.run_safety import checkpoint_manifest
from src.run_safety.build_once import COMPLETE_MARKER
from src.run_safety.checkpoint_manifest import Damaged, verify, write_marker
from src.run_safety.checkpoints import checkpoints, newest_intact_checkpoint
from src.world import World

BLOCK = 1000  # blocks of 1,000 bytes (128 MiB in use): files of several blocks in a few KB


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(checkpoint_manifest, "BLOCK_BYTES", BLOCK)


def save(directory: Path, seed: int = 0) -> Path:
    """A checkpoint as a save leaves it: weights of several blocks, a subdirectory (DeepSpeed's shards), an empty
    file, and the marker with the manifest recorded the way CompleteCheckpointsMixin does."""
    (directory / "global_step4").mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(bytes((seed + index) % 251 for index in range(4500)))
    (directory / "global_step4" / "optim_rank_1.pt").write_bytes(bytes(range(200)) * 3)
    (directory / "rng_state_1.pth").write_bytes(b"")
    manifest, unreadable = manifest_across_ranks(directory, World())
    assert unreadable is None
    write_marker(directory, manifest)
    return directory


def cut_to_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def alter_one_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_marker_records_every_file_with_its_size_and_a_checksum_per_block(tmp_path):
    checkpoint = save(tmp_path / "checkpoint-4")
    record = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    files = record["files"]
    assert record["checksum"] == "xxh3_128" and record["block_bytes"] == BLOCK
    assert sorted(files) == ["global_step4/optim_rank_1.pt", "model.safetensors", "rng_state_1.pth"]
    assert files["model.safetensors"]["bytes"] == 4500 and len(files["model.safetensors"]["checksums"]) == 5
    assert files["rng_state_1.pth"] == {"bytes": 0, "checksums": [files["rng_state_1.pth"]["checksums"][0]]}
    assert verify(checkpoint, threads=2) is None
    (checkpoint / "README.md").write_text("a model card written after the save")  # a file it does not name: fine
    assert verify(checkpoint, threads=1) is None


@pytest.mark.parametrize("damage, named", [
    (lambda c: cut_to_half(c / "model.safetensors"),
     "model.safetensors has 2,250 bytes of the 4,500 saved (cut short)"),
    (lambda c: alter_one_byte(c / "model.safetensors", 3210),
     "model.safetensors differs from what was saved (bytes 3,000 to 4,000: checksum"),
    (lambda c: (c / "global_step4" / "optim_rank_1.pt").unlink(), "global_step4/optim_rank_1.pt is missing"),
    (lambda c: (c / COMPLETE_MARKER).write_text("{\"files\": "),
     f"its completion record {COMPLETE_MARKER} is unreadable"),
])
def test_a_damaged_file_is_named_with_what_is_wrong(tmp_path, damage, named):
    checkpoint = save(tmp_path / "checkpoint-4")
    damage(checkpoint)
    assert named in verify(checkpoint, threads=2)


def test_resume_skips_each_damaged_checkpoint_for_the_newest_intact_one(tmp_path):
    """checkpoint-12 cut to half (the issue's reproduction), checkpoint-8 missing a file: both named in one line each
    and set aside, checkpoint-4 resumed from; what is set aside is out of the checkpoint-N names (never resumed from,
    counted or rotated out)."""
    output_dir = tmp_path / "model"
    for step in (4, 8, 12):
        save(output_dir / f"checkpoint-{step}", seed=step)
    cut_to_half(output_dir / "checkpoint-12" / "model.safetensors")
    (output_dir / "checkpoint-8" / "rng_state_1.pth").unlink()

    resume_from, lines = newest_intact_checkpoint(output_dir, threads=2)

    assert resume_from == output_dir / "checkpoint-4"
    assert lines == [
        f"warning: {output_dir / 'checkpoint-12'} is damaged (model.safetensors has 2,250 bytes of the 4,500 saved "
        "(cut short)): set aside as damaged-checkpoint-12; resuming from checkpoint-4, the newest intact checkpoint",
        f"warning: {output_dir / 'checkpoint-8'} is damaged (rng_state_1.pth is missing): set aside as "
        "damaged-checkpoint-8; resuming from checkpoint-4, the newest intact checkpoint"]
    assert checkpoints(output_dir) == [output_dir / "checkpoint-4"]
    assert (output_dir / "damaged-checkpoint-12" / "model.safetensors").stat().st_size == 2250


def test_with_no_intact_checkpoint_the_resume_stops_in_one_line_and_changes_nothing(tmp_path):
    output_dir = tmp_path / "model"
    for step in (4, 8):
        save(output_dir / f"checkpoint-{step}", seed=step)
    cut_to_half(output_dir / "checkpoint-8" / "model.safetensors")
    alter_one_byte(output_dir / "checkpoint-4" / "global_step4" / "optim_rank_1.pt", 7)

    with pytest.raises(Damaged) as raised:
        newest_intact_checkpoint(output_dir, threads=2)

    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{output_dir} has no intact checkpoint to resume from: ")
    assert "checkpoint-8: model.safetensors has 2,250 bytes of the 4,500 saved (cut short)" in message
    assert "checkpoint-4: global_step4/optim_rank_1.pt differs from what was saved (bytes 0 to 600" in message
    assert message.endswith("Nothing was changed: restore them from a copy and run the same command, or start "
                            "afresh with --overwrite")
    assert checkpoints(output_dir) == [output_dir / "checkpoint-4", output_dir / "checkpoint-8"]


def test_a_checkpoint_saved_before_manifests_is_resumed_from_unverified_and_said_so(tmp_path):
    output_dir = tmp_path / "model"
    old = save(output_dir / "checkpoint-4")
    (old / COMPLETE_MARKER).write_text("")  # what the toolkit wrote before this change
    cut_to_half(old / "model.safetensors")  # not detectable without a manifest: trusted as before

    resume_from, lines = newest_intact_checkpoint(output_dir, threads=1)

    assert resume_from == old and lines == [
        "note: checkpoint-4 was saved before checkpoints recorded their checksums: resumed from without verifying it"]
    assert newest_intact_checkpoint(tmp_path / "nothing yet", threads=1) == (None, [])


def test_a_damaged_final_model_is_neither_pushed_nor_copied_out(tmp_path, monkeypatch, capsys):
    """The same check guards the final model: `python -m src.publish RUN --hub_model_id ...` refuses in one line with
    exit status 8 before any Hub call, and the run's own --final_model_dir copy / --push_to_hub stop the same way."""
    from types import SimpleNamespace

    from huggingface_hub import HfApi

    from src import publish, run_files
    from src.pipeline.publishing import make_copies

    run_dir = tmp_path / "run"
    final = save(run_dir / "model" / "final")
    run_files.write_json(run_dir / run_files.TRAINING_INFO, {"final_model": str(final), "status": "completed"})
    assert publish.damaged_model(run_dir) is None
    alter_one_byte(final / "model.safetensors", 10)
    monkeypatch.setattr(HfApi, "create_repo", lambda *args, **kwargs: pytest.fail("a damaged model reached the Hub"))

    assert publish.main([str(run_dir), "--hub_model_id", "my-org/tiny"]) == 8
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"error: not pushed: {final} is damaged (model.safetensors differs from what was saved (bytes 0 to 1,000")

    target = tmp_path / "sm_model_dir"
    stage = SimpleNamespace(run_dir=run_dir, output_dir=run_dir / "model")
    config = SimpleNamespace(training=SimpleNamespace(final_model_dir=str(target)),
                             hub=SimpleNamespace(push_to_hub=True))
    with pytest.raises(Damaged, match=r"^--final_model_dir and --push_to_hub refused: .*/final is damaged "
                                      r"\(model.safetensors differs .*: restore it from a copy, or train it again"):
        make_copies(stage, config)
    assert not target.exists()
    shutil.rmtree(run_dir)


def test_a_file_that_cannot_be_read_back_is_said_not_raised(tmp_path, monkeypatch):
    """Every rank reaches the gather of the manifest whatever its share's reads do (a rank that raised alone would leave
    the others in the collective): an I/O error comes back as the one problem, and the save stops on it (exit 5)."""
    import errno

    import src.distributed as distributed

    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")

    def failing(directory, share, threads):
        raise OSError(errno.EIO, "Input/output error", str(directory / share[0].path))

    monkeypatch.setattr(distributed, "checksums", failing)
    assert manifest_across_ranks(checkpoint, World()) == (
        None, f"{checkpoint / 'model.safetensors'}: Input/output error")
