"""The reward-model trainer: TRL's RewardTrainer with the toolkit's additions."""

from __future__ import annotations

from trl import RewardTrainer

from src.trainers.base import PairLengthsMixin, ToolkitTrainerMixin


class ToolkitRewardTrainer(PairLengthsMixin, ToolkitTrainerMixin, RewardTrainer):
    """RewardTrainer with the toolkit's additions, on data already tokenized by src/data/ (same ids as its own
    preparation, pairs over max_length already dropped and counted there, so its length filter has nothing to do)."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "chosen_ids" in dataset.column_names:
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
