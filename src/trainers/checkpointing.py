"""Complete-only checkpoints for the trainers (the trainer side of src/run_safety/checkpoints.py), and a failed write
on any rank stopping every rank (src/run_safety/disk_space.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from src.distributed import any_rank, gather_objects
from src.run_safety.checkpoints import mark_complete
from src.run_safety.disk_space import WriteFailed, write_failed_message, write_failure_errno


class CompleteCheckpointsMixin:
    """For transformers Trainers: a checkpoint is marked complete once every rank has saved, and older checkpoints
    are rotated only then (transformers rotates inside the save, so a crash mid-save could leave none whole). A write
    that fails (full disk, quota, I/O error: src/run_safety/disk_space.py) on any rank stops every rank in the same
    collective, with the half-written checkpoint removed and one line naming the newest complete one."""

    _write_failure: tuple[int, Path] | None = None

    def _note_write_failure(self, error: Exception, directory) -> None:
        number = write_failure_errno(error, directory)
        if number is None:
            raise error
        if self._write_failure is None:
            self._write_failure = (number, Path(directory))

    # Each piece of a checkpoint save records its failure instead of raising, so this rank still reaches the
    # collectives transformers runs between the pieces (a barrier after the weights when a best model is tracked).
    def save_model(self, output_dir=None, _internal_call=False):
        if not _internal_call:
            return super().save_model(output_dir, _internal_call)
        try:
            return super().save_model(output_dir, _internal_call)
        except Exception as error:
            self._note_write_failure(error, output_dir)

    def _save_piece(self, save, output_dir) -> None:
        if self._write_failure is None:  # after one failure the rest of this checkpoint is not attempted
            try:
                save(output_dir)
            except Exception as error:
                self._note_write_failure(error, output_dir)

    def _save_optimizer_and_scheduler(self, output_dir):
        self._save_piece(super()._save_optimizer_and_scheduler, output_dir)

    def _save_rng_state(self, output_dir):
        self._save_piece(super()._save_rng_state, output_dir)

    def _save_checkpoint(self, model, trial):
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        try:
            super()._save_checkpoint(model, trial)
        except Exception as error:  # the trainer state, written after every collective of the save
            self._note_write_failure(error, checkpoint)
        finally:
            self.args.save_total_limit = limit
        # Every rank's RNG state and shards are on disk, or some rank could not write its share.
        (failed,) = any_rank(self._write_failure is not None)
        if failed:
            number, directory = next(failure for (failure,) in gather_objects([self._write_failure]) if failure)
            message = write_failed_message(number, directory, Path(run_dir))  # the free space when it failed
            if self.args.should_save:
                shutil.rmtree(checkpoint, ignore_errors=True)  # never complete: its space goes back
            raise WriteFailed(message)
        if self.args.should_save:
            mark_complete(checkpoint)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
        self.accelerator.wait_for_everyone()
