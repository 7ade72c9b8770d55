"""A run's model card: `README.md` beside the final model, built from the run directory alone.

    python -m src.publish results/<run_name>        # (re)write the model card(s)

The card lives in the final model directory (`model/final/`, and `model/merged/` with --merge_adapter) and is written
at the end of every run. Like report.md it reads only `training_info.json` and `plots/`, with report.py's own tables:
base model, data, method (stage, loss, beta, LoRA/QLoRA), the resolved plan, final numbers and judged before/after,
and the curves (copied next to the card, so the Hub shows them). Pushing it is src/publish.py's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from src.config import EMBEDDED
from src.hub_access import looks_like_hub_id
from src.objectives import DEFAULT_STAGE, OBJECTIVES, display_name, objective
from src.reporting.plots import CHARTS
from src.reporting.formatting import format_number
from src.reporting.report import final_numbers_table, judged_section, setup_table
from src.run_files import MODEL_CARD, PLOTS_DIR, TRAINING_INFO, read_json

CARD = MODEL_CARD
# The merged copy goes to a repository of its own (<hub_model_id>-merged), so its card names that id.
MERGED_SUFFIX = "-merged"


def model_dirs(run_dir: Path, info: dict) -> dict[str, Path]:
    """The run's saved model directories: "final" (adapter or full model) and, when one was made, "merged": inside
    the run directory (so a copied run directory is self-contained), else where training_info.json says
    (--output_dir elsewhere)."""
    found = {}
    for kind, key in (("final", "final_model"), ("merged", "merged_model")):
        recorded = Path(info[key]) if info.get(key) else None
        if (run_dir / "model" / kind).is_dir() and (kind == "final" or recorded is not None):
            found[kind] = run_dir / "model" / kind
        elif recorded is not None and recorded.is_dir():
            found[kind] = recorded
    return found


def _hub_id(name: str | None) -> str | None:
    """`name` when it can be a Hub repository id (not a local path, not the embedded default)."""
    return name if name and name != EMBEDDED and looks_like_hub_id(name) else None


def _method_table(info: dict, merged: bool) -> list[str]:
    config = info.get("config") or {}
    stage = info.get("stage", "?")
    previous = (info.get("previous_stage") or {}).get("stage")
    name = display_name(stage)
    rows = [["stage", f"{display_name(previous)} then {name} (this model is after {name})" if previous else name]]
    loss_rows = objective(stage).report.loss_rows if stage in OBJECTIVES else None
    if loss_rows:  # the objective's loss settings (beta, loss type, weights), as its row words them
        rows += [list(row) for row in loss_rows(info)]
    if info.get("use_lora"):
        targets = config.get("lora_target_modules")
        targets = ", ".join(targets) if isinstance(targets, list) else str(targets)
        rows.append(["LoRA", f"r {config.get('lora_r')}, alpha {config.get('lora_alpha')}, dropout "
                             f"{format_number(config.get('lora_dropout'))}, target modules {targets}"
                             + (" — merged into the base weights in this repository" if merged else "")])
    if info.get("load_in_4bit"):
        rows.append(["QLoRA", f"base quantized to 4 bits ({config.get('bnb_4bit_quant_type', 'nf4')}, double "
                              f"quantization {format_number(config.get('use_bnb_nested_quant'))}) during training"])
    rows += [["max length", f"{info.get('max_length')} tokens (prompt + completion)"],
             ["training", "full fine-tuning" if not info.get("use_lora") else "LoRA adapters, base frozen"]]
    return ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]


def _loading(where: str, head: str, adapter: bool, vision: bool, base: str, load_args: str) -> list[str]:
    """The card's code that loads the model: its class (a vision-language model's image-text-to-text class and its
    processor; an adapter onto its base, peft having no auto class for vision models) and its tokenizer."""
    if vision:
        model = (f'model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained("{base}"), "{where}")'
                 if adapter else f'model = AutoModelForImageTextToText.from_pretrained("{where}")')
        return ["from transformers import AutoModelForImageTextToText, AutoProcessor",
                *(["from peft import PeftModel"] if adapter else []), "", model,
                f'processor = AutoProcessor.from_pretrained("{where}")']
    load = f"peft import AutoPeftModelFor{head} as Model" if adapter else f"transformers import AutoModelFor{head} as Model"
    return [f"from {load}", "from transformers import AutoTokenizer", "",
            f'model = Model.from_pretrained("{where}"{load_args})', f'tokenizer = AutoTokenizer.from_pretrained("{where}")']


def render_model_card(run_dir: Path, info: dict, merged: bool = False, repo_id: str | None = None,
                      vision: bool = False) -> str:
    """The card's text for the final model (or, with `merged`, the merged copy), from training_info.json. `vision`: a
    vision-language model saved with its processor (loaded with AutoModelForImageTextToText and AutoProcessor)."""
    from huggingface_hub import ModelCardData

    config = info.get("config") or {}
    stage = info.get("stage", DEFAULT_STAGE)
    row = objective(stage)
    base = config.get("model_name_or_path") or info.get("model_name_or_path")
    dataset = info.get("dataset_name") or config.get("dataset_name")
    adapter = bool(info.get("use_lora")) and not merged
    versions = info.get("versions") or {}
    tags = ["prefkit", "trl", stage] + (["lora"] if info.get("use_lora") else []) + (
        ["qlora"] if info.get("load_in_4bit") else [])
    metadata = ModelCardData(base_model=_hub_id(base), datasets=[_hub_id(dataset)] if _hub_id(dataset) else None,
                             library_name="peft" if adapter else "transformers", tags=tags,
                             pipeline_tag="image-text-to-text" if vision else row.report.hub_pipeline_tag)
    title = repo_id or info.get("run_name") or run_dir.name
    what = ("a LoRA adapter: load it on top of the base model" if adapter else
            "the LoRA adapter merged into the base weights: a full model" if merged else "a full model")
    judged_lines, judged_sentence = judged_section(info, run_dir)
    # A reward model is a one-output sequence classifier; its adapter loads only onto a base built with num_labels=1.
    load_args = ", num_labels=1" if not row.causal_lm and adapter else ""
    lines = [f"---\n{metadata.to_yaml()}\n---", "", f"# {title}", "",
             f"A {display_name(stage)} fine-tune of `{base}` on `{dataset}`, trained with prefkit on TRL "
             f"{versions.get('trl', '?')}. This repository holds {what}.", ""]
    if judged_sentence:
        lines += [f"**Judged on held-out prompts:** {judged_sentence}", ""]
    lines += ["```python", *_loading(repo_id or "<this directory>", row.report.auto_class, adapter, vision, base,
                                     load_args), "```", ""]
    lines += ["## Method", "", *_method_table(info, merged), ""]
    lines += ["## Results on held-out prompts (before → after)", "", *judged_lines, ""]
    lines += ["## Final training numbers", "", *final_numbers_table(info.get("summary") or {}, info), ""]
    lines += ["## Hyperparameters (as resolved for this run)", "", *setup_table(info), ""]
    plots = [(chart.caption, chart.filename) for chart in CHARTS.get(stage, [])
             if (run_dir / PLOTS_DIR / chart.filename).is_file()]  # in the report's order
    if plots:
        lines += ["## Training curves", ""]
        lines += [f"![{caption}]({PLOTS_DIR}/{filename})\n" for caption, filename in plots]
    return "\n".join(lines)


def write_model_cards(run_dir: str | Path, hub_model_id: str | None = None) -> dict[str, Path]:
    """README.md (and the run's plots) into each saved model directory; returns the directories."""
    run_dir = Path(run_dir)
    info = read_json(run_dir / TRAINING_INFO)
    hub_model_id = hub_model_id or (info.get("config") or {}).get("hub_model_id")
    dirs = model_dirs(run_dir, info)
    for kind, directory in dirs.items():
        repo_id = (hub_model_id + (MERGED_SUFFIX if kind == "merged" else "")) if hub_model_id else None
        vision = (directory / "processor_config.json").is_file()  # a vision-language model's processor beside it
        (directory / CARD).write_text(render_model_card(run_dir, info, kind == "merged", repo_id, vision),
                                      encoding="utf-8")
        if (run_dir / PLOTS_DIR).is_dir():
            shutil.copytree(run_dir / PLOTS_DIR, directory / PLOTS_DIR, dirs_exist_ok=True)
    return dirs
