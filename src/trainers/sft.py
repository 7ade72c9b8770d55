"""The SFT trainer: TRL's SFTTrainer with the toolkit's additions."""

from __future__ import annotations

from trl import SFTTrainer

from src.trainers.base import ToolkitTrainerMixin
from src.trainers.device_metrics import Mean, MetricWindow, Ratio, RunningTokens

# What TRL 1.16's SFTTrainer.compute_loss gathers for its training metrics, in its order (MoE models: "aux_loss" last),
# and how it turns them into what it logs (src/trainers/device_metrics.py)
SFT_GATHERED = ("label_tokens", "entropy_sum", "correct_tokens", "batch_tokens")
SFT_METRICS = {"entropy": Ratio("entropy_sum", "label_tokens"), "mean_token_accuracy": Ratio("correct_tokens",
                                                                                              "label_tokens"),
               "num_tokens": RunningTokens("batch_tokens")}


class ToolkitSFTTrainer(ToolkitTrainerMixin, SFTTrainer):
    """SFTTrainer with the toolkit's additions (it already skips tokenizing data that has input_ids).

    Padding-free without packing: TRL then refuses a max_length (it would not enforce it), so the SFTConfig gets none
    and the rows are cut here to `truncate_to`, as TRL's own truncation cuts them (rows left with no trained token
    were already dropped by src/data/)."""

    TRUNCATED_COLUMNS = ("input_ids", "assistant_masks", "completion_mask")

    def __init__(self, *args, truncate_to: int | None = None, **kwargs):
        self.truncate_to = truncate_to
        super().__init__(*args, **kwargs)
        aux = ("aux_loss",) if self.aux_loss_enabled else ()
        self.metric_window = MetricWindow(SFT_GATHERED + aux, {**SFT_METRICS, **{name: Mean(name) for name in aux}},
                                          "TRL's SFTTrainer", lambda trainer: trainer._metrics, weighted=True)

    def compute_loss(self, model, inputs, *args, **kwargs):
        if not self.model.training:
            return super().compute_loss(model, inputs, *args, **kwargs)
        with self.metric_window.recording(self):  # a training micro-batch's metrics stay on the device until a log
            return super().compute_loss(model, inputs, *args, **kwargs)

    def log(self, *args, **kwargs):
        # entropy and token accuracy as means over the window's tokens, not TRL's mean of micro-batch ratios: the
        # same on any split of a global batch (src/trainers/device_metrics.py)
        self.metric_window.at_log(self)
        return super().log(*args, **kwargs)

    def evaluation_loop(self, *args, **kwargs):
        self.metric_window.flush(self)  # eval logs the running count of training tokens
        return super().evaluation_loop(*args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        if self.truncate_to is not None and "input_ids" in dataset.column_names:
            length, keep_end = self.truncate_to, args.truncation_mode == "keep_end"
            columns = [column for column in self.TRUNCATED_COLUMNS if column in dataset.column_names]
            dataset = dataset.map(lambda batch: {column: [values[-length:] if keep_end else values[:length]
                                                          for values in batch[column]] for column in columns},
                                  batched=True, desc=f"Truncating {dataset_name} dataset")
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
