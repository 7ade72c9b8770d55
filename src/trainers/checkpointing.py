"""Complete-only checkpoints for the trainers (the trainer side of src/run_safety/checkpoints.py), each with its
manifest (every file's size and checksums, hashed by every rank: src/distributed.py `manifest_across_ranks`), and a
failed write on any rank stopping every rank (src/run_safety/disk_space.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from src.distributed import barrier, manifest_across_ranks, write_failure_on_any_rank
from src.run_safety import hang_watch
from src.run_safety.build_once import COMPLETE_MARKER, is_complete
from src.run_safety.checkpoints import kill_if_injected, mark_complete
from src.run_safety.checkpoint_split import SPLIT_FILE
from src.run_safety.disk_space import WriteFailed, fail_write_if_injected, noticed_write_failure, write_failures_noted
from src.trainers.resume_state import window_at_save, write as write_resume_state
from src.world import World


class CompleteCheckpointsMixin:
    """For transformers Trainers: a checkpoint is marked complete once every rank has saved, its marker holding the
    manifest of what they wrote, and older checkpoints are rotated only then (transformers rotates inside the save, so
    a crash mid-save could leave none whole). A write
    that fails (full disk, quota, I/O error: src/run_safety/disk_space.py) on any rank stops every rank in the same
    collective, with the half-written checkpoint removed and one line naming the newest complete one."""

    # Each piece of a checkpoint save notes its failure instead of raising, so this rank still reaches the
    # collectives transformers runs between the pieces (a barrier after the weights when a best model is tracked).
    def save_model(self, output_dir=None, _internal_call=False):
        if not _internal_call:
            return super().save_model(output_dir, _internal_call)
        self._save_piece(lambda directory: super(CompleteCheckpointsMixin, self).save_model(directory, True),
                         output_dir, "model.safetensors")

    def _save_piece(self, save, output_dir, name: str) -> None:
        if noticed_write_failure() is None:  # after one failure the rest of this checkpoint is not attempted
            hang_watch.beat(f"writing {Path(output_dir).name}/{name}")
            with write_failures_noted(output_dir):
                if self.args.should_save or name.startswith("rng_state"):
                    fail_write_if_injected(Path(output_dir) / name)
                save(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """transformers 5.23 saves a model whose class renames weights as it loads them (a conversion mapping: LLaVA's,
        Gemma 3's, Idefics3's, ...) under the original checkpoint names, and its Trainer resumes by loading that file by
        name, not strictly: none of the weights load, with a warning only (transformers issue 43701), and training goes
        on from the starting weights with the checkpoint's optimizer. Such a checkpoint is loaded as from_pretrained
        loads it (renamed) and put into the model strictly: every weight, or an error."""
        target = model if model is not None else self.model
        saved = _saved_weight_names(Path(resume_from_checkpoint))
        if saved is None or saved <= set(target.state_dict()) or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        dtype = next(target.parameters()).dtype
        loaded = type(target).from_pretrained(resume_from_checkpoint, dtype=dtype, config=target.config)
        target.load_state_dict(loaded.state_dict(), strict=True)
        return None

    def _save_optimizer_and_scheduler(self, output_dir):
        self._save_piece(super()._save_optimizer_and_scheduler, output_dir, "optimizer.pt")

    def _save_rng_state(self, output_dir):
        rank = self.args.process_index
        self._save_piece(super()._save_rng_state, output_dir, f"rng_state_{rank}.pth")

    def _save_checkpoint(self, model, trial):
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        try:
            with write_failures_noted(checkpoint):  # the trainer state, written after every collective of the save
                super()._save_checkpoint(model, trial)
                if self.args.should_save:  # the seam fails it as the save's last write
                    fail_write_if_injected(checkpoint / TRAINER_STATE_NAME)
            # what a resume on any split needs beside transformers' files: the split, the logging window (src/
            # trainers/resume_state.py); every rank takes part (the window is gathered), rank 0 writes
            window = window_at_save(self)
            if self.args.should_save:
                self._save_piece(lambda directory: write_resume_state(self, Path(directory), window), checkpoint,
                                 SPLIT_FILE)
        finally:
            self.args.save_total_limit = limit
        # Every rank's RNG state and shards are on disk, or some rank could not write its share (or an earlier write
        # failed since the last step's agreement: rank 0's metrics line).
        message = write_failure_on_any_rank()
        manifest, unreadable = (None, None) if message else manifest_across_ranks(checkpoint, World.from_environment())
        if unreadable:
            message = (f"reading back {checkpoint} to record its checksums failed ({unreadable}): check the storage, "
                       "then relaunch the same command (it resumes from the newest intact checkpoint)")
        if message:
            if self.args.should_save:
                shutil.rmtree(checkpoint, ignore_errors=True)  # never complete: its space goes back
            raise WriteFailed(message)
        if self.args.should_save:
            kill_if_injected("before_complete", self.state.global_step, self.args.process_index)
            with write_failures_noted(checkpoint):
                fail_write_if_injected(checkpoint / COMPLETE_MARKER)
                mark_complete(checkpoint, manifest)
                rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                                   best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
            if not is_complete(checkpoint):
                shutil.rmtree(checkpoint, ignore_errors=True)
        barrier()  # the marker's own failure (rank 0) stops every rank here
        kill_if_injected("after_complete", self.state.global_step, self.args.process_index)


def _saved_weight_names(checkpoint: Path) -> set[str] | None:
    """The weight names a checkpoint's safetensors files hold (one file or an index), or None (no such files: an
    adapter, DeepSpeed's or FSDP's own layout)."""
    from safetensors import safe_open

    index = checkpoint / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    if not (checkpoint / SAFE_WEIGHTS_NAME).is_file():
        return None
    with safe_open(checkpoint / SAFE_WEIGHTS_NAME, "pt") as weights:
        return set(weights.keys())

