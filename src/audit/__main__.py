"""Audit a dataset without training: the launcher's flags and recipes, the numbers a run's Data section shows.

    python -m src.audit --dataset_name pairs.jsonl                                # the data alone (the tokenizer only)
    python -m src.audit --config configs/dpo_qwen2.5-0.5b_ultrafeedback.yaml      # a recipe's data
    python -m src.audit --dataset_name pairs.jsonl --model_name_or_path M         # + how M ranks a sample of pairs
    python -m src.audit --dataset_name pairs.jsonl --judge mychecks:score          # + the judge on a sample of pairs

The data is prepared exactly as a run prepares it (and cached: the run that follows reuses it), so the numbers are the
run's. The reference part runs when --model_name_or_path is on the command line, the judge part when --judge names a
judge (for the embedded data, the embedded check); both on --audit_judge_pairs pairs drawn with the seed, in this one
process. Writes results/audit-<run name>/data_audit.json (and data_audit_inverted.jsonl with a judge).
Exit status: 0 no warning, 1 a warning fired, 2 a mistake in the flags or the data (one line).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from src import library_warnings, run_files
from src.audit.findings import data_alerts
from src.audit.judged import INVERTED_FILE, drawn_rows, judge_pairs
from src.audit.reference import agreement, answer_tokens, sample_logps
from src.audit.run import opening
from src.config import EMBEDDED
from src.config_error import ConfigError
from src.config_parse import HelpRequested, format_help, parse_config, stage_config
from src.data import DataError, check_source, prepare_data, source_rows
from src.hub_access import needs_hub, use_local_files_only
from src.judges import JudgeError, judge_for
from src.models import (ModelError, apply_chat_template_path, load_model_for_audit, load_processing, load_tokenizer,
                        resolve_model_path)
from src.objectives import SEQUENCES, objective
from src.objectives import PIPELINES
from src.reporting.alerts import format_alerts
from src.reporting.audit import data_section
from src.run_safety.build_once import cache_root
from src.run_safety.exit_status import ExitStatus
from src.unneeded_libraries import without_torch
from src.world import World

WARNINGS = 1  # the exit status when any warning fired (as check_gpu.py's READY WITH WARNINGS)


def audit_stage(name: str, config, tokenizer, model_path: str, reference: bool, out_dir: Path,
                processing=None) -> dict:
    """One stage's data: prepared (or read from the cache), then the reference and judge parts on a sample.
    `processing`: a vision-language model's (src/vision.py), whose processor counts the images' tokens."""
    prepared = prepare_data(config.data, config.sft, name, config.training.seed, tokenizer, cache_root() / "datasets",
                            processing)
    audit = opening(prepared.summary, name)
    if objective(name).data_shape == SEQUENCES:  # no pairs, no rows to rank
        return audit
    count, seed = config.training.audit_judge_pairs, config.training.seed
    if reference and count:
        audit["train"].update(reference_sample(prepared.train, model_path, config, count, seed))
    judge = judge_for(config.training.judge, config.data.dataset_name) if count else None
    if judge is not None:
        found, inverted = judge_pairs(judge, prepared.train, source_rows(prepared, "train"),
                                      prepared.summary["source"], count, seed, World.from_environment(), tokenizer)
        run_files.write_text(out_dir / INVERTED_FILE, "".join(run_files.dumps(row) + "\n" for row in inverted))
        audit["train"].update(found, inverted_pairs_file=str(out_dir / INVERTED_FILE))
    return audit


def reference_sample(train, model_path: str, config, count: int, seed: int) -> dict:
    """How the model ranks `count` training pairs drawn with the seed (summed log-probs, truncated as DPO does)."""
    import numpy as np

    started = time.monotonic()
    pairs = train.select(drawn_rows(len(train), count, seed)).select_columns(["prompt_ids", "chosen_ids",
                                                                              "rejected_ids"]).to_list()
    model = load_model_for_audit(model_path, config.model)
    chosen, rejected = sample_logps(model, pairs, config.data.max_length)
    prompt = np.array([len(pair["prompt_ids"]) for pair in pairs])
    lengths = {side: answer_tokens(prompt, [len(pair[f"{side}_ids"]) for pair in pairs], config.data.max_length)
               for side in ("chosen", "rejected")}
    return agreement(chosen, rejected, lengths["chosen"], lengths["rejected"]) | {
        "reference_seconds": round(time.monotonic() - started, 2)}


def run(argv: list[str]) -> int:
    config = parse_config(argv, require_sources=False)
    if not config.data.dataset_name:
        raise ConfigError("--dataset_name is required (a file, a directory of split files, or a Hub id), or --config")
    if not config.model.model_name_or_path:  # the data alone: any tokenizer counts tokens; say which one
        config.model.model_name_or_path = EMBEDDED
        print("tokens are counted with the embedded model's character tokenizer: give --model_name_or_path to count "
              "them as your model does")
    import datasets  # its progress bars drown the audit's tables

    datasets.disable_progress_bars()
    names = list(PIPELINES.get(config.training.stage, (config.training.stage,)))
    for name in names:  # a missing file or a mistyped split: said before any model is built or loaded
        check_source(stage_config(config, name).data, name)
    if not needs_hub([config.model.model_name_or_path, config.data.dataset_name]):
        use_local_files_only()
    model_path = resolve_model_path(config.model, config.data.embedded_reasoning)
    reference = config.sources.get("model_name_or_path") == "--model_name_or_path"
    # No model in this process (no reference part; no judge, or the embedded check): the tokenizer without torch.
    lean = not reference and (not config.training.audit_judge_pairs or config.training.judge in ("none", "auto", EMBEDDED))
    with without_torch() if lean else contextlib.nullcontext():
        processing = load_processing(model_path, config.model)  # a vision-language model's processor, else None
        tokenizer = processing.tokenizer if processing else apply_chat_template_path(
            load_tokenizer(model_path, config.model.trust_remote_code), config.model.chat_template_path)
    if processing is not None and reference:
        reference = False
        print("the reference's ranking is not measured for a vision-language model yet (it would score the answers "
              "without their images): the data part alone")
    run_name = config.training.run_name or (Path(config.recipe).stem if config.recipe else "data")
    out_dir = Path(config.training.results_dir) / f"audit-{run_name}"
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    audits, alerts = {}, []
    for name in names:
        staged = stage_config(config, name)
        audits[name] = audit_stage(name, staged, tokenizer, model_path, reference and objective(name).data_shape != SEQUENCES,
                                   out_dir, processing)
        alerts += data_alerts(audits[name], name, staged.dpo.loss_type)
        print(f"\n== {name.upper()} data: {staged.data.dataset_name}\n")
        print("\n".join(data_section(audits[name], name, None, out_dir)))
    run_files.write_json(out_dir / "data_audit.json", audits)
    print(f"\n{format_alerts(alerts).replace('Health checks', 'Data audit')}")
    print(f"\naudited in {time.monotonic() - started:.1f} s; written to {out_dir / 'data_audit.json'}")
    return WARNINGS if alerts else 0


def main(argv: list[str] | None = None) -> int:
    library_warnings.install()  # the libraries' known-harmless lines kept off the console
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except HelpRequested:
        print(format_help())
        return 0
    except (ConfigError, DataError, ModelError, JudgeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitStatus.USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
