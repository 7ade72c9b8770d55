"""Reporting: everything that turns a run directory into something a person reads.

Pure functions over the files a run writes (`metrics.jsonl`, `training_info.json`, `samples_<split>.jsonl`; see
src/run_files.py), so they work on a running, crashed or copied run:

- `summary`  the final numbers of a run, from its metric history
- `alerts`   health alerts: what went wrong, the evidence, what to do
- `plots`    the training curves as PNG files
- `report`   report.md, the readable sample files; `python -m src.report RUN_DIR`
- `model_card` README.md beside the final model (pushed to the Hub by src/publish.py)
"""
