"""Reporting: everything that turns a run directory into something a person reads.

Functions over the files a run writes (`metrics.jsonl`, `training_info.json`, `samples_<split>.jsonl`; see
src/run_files.py), so they work on a running, crashed or copied run:

- `summary`     the final numbers of a run, from its metric history
- `alerts`      health alerts: what went wrong, the evidence, what to do
- `plots`       the training curves as PNG files
- `status`      where a run stands, in one line (running / finished / stopped / diverged, step, elapsed, ETA)
- `report`      report.md and the readable sample files; `python -m src.reporting RUN_DIR`
- `live`        the callback that refreshes the report on rank 0 while a run trains
- `index`       results/index.md, every run on one page
- `compare`     runs side by side; `python -m src.reporting.compare RUN_DIR...`
- `model_card`  README.md beside the final model (pushed to the Hub by src/publish.py)
"""
