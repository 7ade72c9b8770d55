"""The SFT trainer: TRL's SFTTrainer with the toolkit's additions."""

from __future__ import annotations

from trl import SFTTrainer

from src.trainers.base import ToolkitTrainerMixin


class ToolkitSFTTrainer(ToolkitTrainerMixin, SFTTrainer):
    """SFTTrainer with the toolkit's additions (it already skips tokenizing data that has input_ids).

    Padding-free without packing: TRL then refuses a max_length (it would not enforce it), so the SFTConfig gets none
    and the rows are cut here to `truncate_to`, as TRL's own truncation cuts them (rows left with no trained token
    were already dropped by src/data/)."""

    TRUNCATED_COLUMNS = ("input_ids", "assistant_masks", "completion_mask")

    def __init__(self, *args, truncate_to: int | None = None, **kwargs):
        self.truncate_to = truncate_to
        super().__init__(*args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        if self.truncate_to is not None and "input_ids" in dataset.column_names:
            length, keep_end = self.truncate_to, args.truncation_mode == "keep_end"
            columns = [column for column in self.TRUNCATED_COLUMNS if column in dataset.column_names]
            dataset = dataset.map(lambda batch: {column: [values[-length:] if keep_end else values[:length]
                                                          for values in batch[column]] for column in columns},
                                  batched=True, desc=f"Truncating {dataset_name} dataset")
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
