"""Every mistake a user can make gets one line: the table of mistakes and what each gets.

One row per mistake, across every input a user gives: flags and recipe keys, data files and each shape's columns and
rows, model, tokenizer and adapter directories, chat templates, LoRA settings, the launcher's arguments and environment
variables. Each row runs the mistake through the preflight (`--dry_run`, what run_distributed.sh runs before starting
any worker; in this process, so the table takes seconds) and asserts a non-zero exit, exactly one `error:` line that
names the file, row or flag, and no traceback. docs/troubleshooting.md lists every row's line
(`test_the_doc_lists_every_mistake`).

    python -m pytest -q -n 0 tests/test_user_mistakes.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from conftest import CHAT_TEMPLATE, PROJECT_ROOT, preference_rows, write_jsonl

DOC = PROJECT_ROOT / "docs" / "troubleshooting.md"


@dataclass
class Workspace:
    """A user's inputs for one row: a working model and data, and a directory to put the broken copies in."""

    root: Path
    model: Path
    data: Path
    llava: Path | None = None  # a tiny vision-language model (tests/tiny_vlms.py), for the image rows

    def args(self, **changes: str | None) -> list[str]:
        """The flags of a run that works, with `changes` ({flag: value}; None drops the flag)."""
        flags = {"model_name_or_path": str(self.model), "dataset_name": str(self.data),
                 "results_dir": str(self.root / "results"), "max_length": "64", "stage": "dpo"} | changes
        return [item for key, value in flags.items() if value is not None for item in (f"--{key}", value)]

    def rows_file(self, name: str, rows: list[dict]) -> str:
        return str(write_jsonl(self.root / name, rows))

    def model_copy(self, name: str) -> Path:
        return shutil.copytree(self.model, self.root / name)


@dataclass
class Mistake:
    id: str
    mistake: str  # as a user makes it: the doc's words
    line: str  # what the one `error:` line says (a fragment without paths): the doc quotes it
    make: Callable[[Workspace], list[str]]  # builds the broken input, returns the command's arguments
    launcher: bool = False  # run through run_distributed.sh instead of src.main_distributed
    env: dict[str, str] = field(default_factory=dict)


def _prompts_only(count: int) -> list[dict]:
    return [{"prompt": row["prompt"], "meta": {"row": index}} for index, row in enumerate(preference_rows(count))]


def _edit_rows(edit: Callable[[list[dict]], None], count: int = 24) -> list[dict]:
    rows = preference_rows(count)
    edit(rows)
    return rows


def _latin1_jsonl(ws: Workspace) -> list[str]:
    lines = [json.dumps(row, ensure_ascii=False) for row in preference_rows(24)]
    lines[4] = lines[4].replace("what color", "what café color")
    path = ws.root / "latin1.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    return ws.args(dataset_name=str(path))


def _latin1_csv(ws: Workspace) -> list[str]:
    path = ws.root / "latin1.csv"
    path.write_bytes(("prompt,chosen,rejected\n" + "".join(f"q{i},a{i} café,b{i}\n" for i in range(24)))
                     .encode("latin-1"))
    return ws.args(dataset_name=str(path))


def _small_vocabulary(ws: Workspace) -> list[str]:
    """A model saved with fewer embeddings than its tokenizer has ids: tokens added to the tokenizer, model not
    resized."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(ws.model)
    config = LlamaConfig(vocab_size=len(tokenizer) - 20, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(ws.root / "small_vocab")
    tokenizer.save_pretrained(ws.root / "small_vocab")
    return ws.args(model_name_or_path=str(ws.root / "small_vocab"))


def _encoder(model_class: str, config_class: str, **sizes):
    def make(ws: Workspace) -> list[str]:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(ws.model)
        config = getattr(transformers, config_class)(vocab_size=len(tokenizer), **sizes)
        path = ws.root / model_class
        getattr(transformers, model_class)(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return ws.args(model_name_or_path=str(path))
    return make


def _learned_positions(ws: Workspace) -> list[str]:
    """GPT-2 learns one embedding per position, 64 here: a 128-token row has none for its positions 64 and on."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(ws.model)
    path = ws.root / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2)
                    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return ws.args(model_name_or_path=str(path), max_length="128")


def _broken_config(ws: Workspace) -> list[str]:
    model = ws.model_copy("broken_config")
    (model / "config.json").write_text('{"model_type": "llama", ')
    return ws.args(model_name_or_path=str(model))


def _unknown_model_type(ws: Workspace) -> list[str]:
    model = ws.model_copy("unknown_type")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_type": "llamaz"}))
    return ws.args(model_name_or_path=str(model))


def _no_tokenizer(ws: Workspace) -> list[str]:
    model = ws.root / "no_tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ws.model / name, model / name)
    return ws.args(model_name_or_path=str(model))


def _adapter(ws: Workspace) -> list[str]:
    adapter = ws.root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA",
                                                             "base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    return ws.args(model_name_or_path=str(adapter))


def _truncated_weights(ws: Workspace) -> list[str]:
    model = ws.model_copy("truncated")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return ws.args(model_name_or_path=str(model))


def _missing_shard(ws: Workspace) -> list[str]:
    model = ws.model_copy("sharded")
    (model / "model.safetensors").unlink()
    (model / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    return ws.args(model_name_or_path=str(model))


def _template_file(ws: Workspace, name: str, text: str) -> str:
    path = ws.root / name
    path.write_text(text)
    return str(path)


def _gzip_file(ws: Workspace, name: str, text: str) -> str:
    import gzip

    path = ws.root / name
    path.write_bytes(gzip.compress(text.encode()))
    return str(path)


def _truncated_gz(ws: Workspace) -> list[str]:
    path = Path(_gzip_file(ws, "cut.jsonl.gz", "".join(json.dumps(row) + "\n" for row in preference_rows(200))))
    path.write_bytes(path.read_bytes()[:-100])
    return ws.args(dataset_name=str(path))


def _recipe(ws: Workspace, text: str, **changes: str | None) -> list[str]:
    path = ws.root / "recipe.yaml"
    path.write_text(text)
    return ws.args(**changes) + ["--config", str(path)]


def _empty_dir(ws: Workspace) -> str:
    (ws.root / "data").mkdir()
    return str(ws.root / "data")


def _mixed_split_files(ws: Workspace) -> list[str]:
    (ws.root / "splits").mkdir()
    write_jsonl(ws.root / "splits" / "train.jsonl", preference_rows(12))
    (ws.root / "splits" / "test.csv").write_text("prompt,chosen,rejected\na,b,c\n")
    return ws.args(dataset_name=str(ws.root / "splits"))


def _finished_run(ws: Workspace) -> list[str]:
    """A run finished with --beta 0.5, relaunched without it: what the finished run recorded, made as a run makes it."""
    from src.config_parse import parse_config
    from src.world import Devices, World
    from src.pipeline.stages import data_locations, plan_stages
    from src.provenance import git_commit
    from src.run_safety.finished_run import data_fingerprint

    (stage,) = plan_stages(parse_config(ws.args(run_name="done", beta="0.5")), World.from_environment(),
                           Devices.detect())
    stage.run_dir.mkdir(parents=True)
    (stage.run_dir / "training_info.json").write_text(json.dumps({
        "status": "completed", "config": stage.config.flat(), **stage.plan.as_dict(), "git_commit": git_commit(),
        "data_fingerprint": data_fingerprint(data_locations(stage))}, default=str))
    return ws.args(run_name="done")


def _base_model(ws: Workspace) -> list[str]:
    """A model whose tokenizer has no chat template, given chat data."""
    model = ws.model_copy("base")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return ws.args(model_name_or_path=str(model))


def _roles(rows: list[dict], row: int, column: str, role: str) -> None:
    rows[row][column][0]["role"] = role


def _assistant_first(ws: Workspace) -> list[str]:
    rows = preference_rows(24)
    rows[5]["prompt"].insert(0, {"role": "assistant", "content": "hi"})
    return ws.args(chat_template_path=_template_file(ws, "strict.jinja", STRICT_TEMPLATE),
                   dataset_name=ws.rows_file("assistant_first.jsonl", rows))


def _vlm(ws: Workspace, edit: Callable[[list[dict], Path], None] | None = None, model: Path | None = None,
         **changes: str | None) -> list[str]:
    """The tiny LLaVA on RLAIF-V-shaped pairs (tests/tiny_vlms.py), `edit(rows, directory)` breaking them first."""
    from tiny_vlms import colour_pairs

    directory = ws.root / "vlm"
    rows = colour_pairs(24, directory)
    if edit:
        edit(rows, directory)
    return ws.args(model_name_or_path=str(model or ws.llava), dataset_name=str(write_jsonl(directory / "pairs.jsonl",
                                                                                              rows)), **changes)


def _vlm_copy(ws: Workspace, name: str) -> Path:
    return shutil.copytree(ws.llava, ws.root / name)


def _without_processor(ws: Workspace) -> list[str]:
    copy = _vlm_copy(ws, "no_processor")
    (copy / "processor_config.json").unlink()
    return _vlm(ws, model=copy)


def _unverified_family(ws: Workspace) -> list[str]:
    copy = _vlm_copy(ws, "llava_next")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"model_type": "llava_next"}))
    return _vlm(ws, model=copy)


def _two_images_one_part(rows: list[dict], directory: Path) -> None:
    rows[4]["images"] = rows[4]["images"] + rows[5]["images"]


def _text_prompts(rows: list[dict], directory: Path) -> None:
    for row in rows:
        row.update(prompt=row["prompt"][0]["content"][-1]["text"], chosen="red", rejected="blue")


def _image_in_answer(rows: list[dict], directory: Path) -> None:
    rows[2]["chosen"][0]["content"].append({"type": "image"})


STRICT_TEMPLATE = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user "
                   "turn') }}{% endif %}" + CHAT_TEMPLATE)

MISTAKES = [
    # Flags and recipes
    Mistake("misspelt_flag", "A misspelt flag (`--learnign_rate`)", "unknown key 'learnign_rate'",
            lambda ws: ws.args(learnign_rate="1e-4")),
    Mistake("negative_batch", "A batch size that is not a positive number", "--batch_size must be a positive whole "
            "number", lambda ws: ws.args(batch_size="-4")),
    Mistake("positional_argument", "A value without its flag (`... abc`)", "unexpected argument 'abc'",
            lambda ws: ["abc"] + ws.args()),
    Mistake("unknown_stage", "An unknown `--stage`", "stage must be one of", lambda ws: ws.args(stage="ppo")),
    Mistake("short_max_length", "`--max_length` too short to hold anything", "--max_length must be at least 8",
            lambda ws: ws.args(max_length="4")),
    Mistake("missing_recipe", "A `--config` recipe that does not exist", "does not exist (recipes live in configs/",
            lambda ws: ws.args() + ["--config", "configs/nope.yaml"]),
    Mistake("bad_yaml", "A recipe that is not valid YAML", "not valid YAML",
            lambda ws: _recipe(ws, "learning_rate: [1e-4\n")),
    Mistake("unknown_recipe_key", "A misspelt recipe key", "unknown key 'lerning_rate'",
            lambda ws: _recipe(ws, "lerning_rate: 1e-4\n")),
    Mistake("unknown_tracker", "An unknown `--report_to` tracker", "--report_to nope: not a supported tracker",
            lambda ws: ws.args(report_to="nope")),
    Mistake("finished_run", "A `--run_name` that already holds a finished run of another configuration", "already "
            "holds a finished run of another configuration (beta: 0.5 → 0.1): pass --overwrite", _finished_run),
    Mistake("unknown_scheduler", "An `--lr_scheduler_type` transformers does not have (`cosin`)",
            "'lr_scheduler_type' must be one of linear, cosine", lambda ws: ws.args(lr_scheduler_type="cosin")),
    Mistake("unknown_choice_of_trl", "A value a TRL option does not have (`--optim adamw_torchh`)",
            "'optim' must be one of adamw_torch", lambda ws: ws.args(optim="adamw_torchh")),
    Mistake("sft_override_outside_pipeline", "An `--sft.*` override outside `--stage sft_then_dpo`", "--sft.* "
            "overrides apply only to --stage sft_then_dpo", lambda ws: ws.args() + ["--sft.max_steps", "3"]),
    Mistake("wrong_value_type_flag", "A flag value of the wrong type (`--seed abc`)", "'seed' must be int, got 'abc'",
            lambda ws: ws.args(seed="abc")),
    Mistake("fp16_on_cpu", "`--mixed_precision fp16` on a machine without a GPU", "--mixed_precision fp16 needs a GPU",
            lambda ws: ws.args(mixed_precision="fp16")),
    Mistake("4bit_without_lora", "`--load_in_4bit` without `--use_lora`", "--load_in_4bit trains adapters on a frozen "
            "4-bit base: add --use_lora", lambda ws: ws.args(load_in_4bit="true")),
    Mistake("push_without_repo", "`--push_to_hub` without `--hub_model_id`", "--push_to_hub needs --hub_model_id",
            lambda ws: ws.args(push_to_hub="true")),
    Mistake("lora_rank_zero", "`--lora_r 0`", "--lora_r is the adapters' rank",
            lambda ws: ws.args(use_lora="true", lora_r="0")),
    # Data: files, lines, columns, rows
    Mistake("missing_data_file", "A data file that does not exist", "no such file or directory",
            lambda ws: ws.args(dataset_name=str(ws.root / "nope.jsonl"))),
    Mistake("unsupported_file", "A data file of a type the toolkit cannot read (`.txt`)", "unsupported file type",
            lambda ws: ws.args(dataset_name=_template_file(ws, "pairs.txt", "a\n"))),
    Mistake("empty_file", "An empty data file", "is empty: it needs one row per example",
            lambda ws: ws.args(dataset_name=_template_file(ws, "empty.jsonl", ""))),
    Mistake("broken_json_line", "A JSON Lines file with a broken line", "line 2: not valid JSON",
            lambda ws: ws.args(dataset_name=_template_file(
                ws, "broken.jsonl", '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{oops\n'))),
    Mistake("broken_line_in_gz", "A broken line inside a compressed JSON Lines file (`pairs.jsonl.gz`)",
            "pairs.jsonl.gz line 2: not valid JSON", lambda ws: ws.args(dataset_name=_gzip_file(
                ws, "pairs.jsonl.gz", '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{oops\n'))),
    Mistake("truncated_gz", "A compressed data file cut short (an interrupted download)", "cut.jsonl.gz: cannot "
            "decompress it", _truncated_gz),
    Mistake("undecodable_jsonl", "Undecodable (Latin-1) bytes in a JSON Lines file", "line 5: not UTF-8 text (byte "
            "0xe9", _latin1_jsonl),
    Mistake("undecodable_csv", "Undecodable (Latin-1) bytes in a CSV file", "line 2: not UTF-8 text (byte 0xe9",
            _latin1_csv),
    Mistake("missing_columns", "Preference data without chosen/rejected columns", "answers.jsonl: preference data "
            "needs chosen and rejected answers", lambda ws: ws.args(dataset_name=ws.rows_file(
                "answers.jsonl", [{"prompt": "a", "answer": "b"}] * 12))),
    Mistake("unknown_mapped_column", "A `--chosen_column` the data does not have", "--chosen_column good: no such "
            "column", lambda ws: ws.args(chosen_column="good")),
    Mistake("wrong_value_type", "A row whose answer is neither text nor messages", "row 1: 'chosen' must be text or "
            "a list of", lambda ws: ws.args(dataset_name=ws.rows_file(
                "numbers.jsonl", [{"prompt": "a", "chosen": 3, "rejected": "c"}] * 12))),
    Mistake("all_identical", "Every pair has chosen == rejected", "chosen identical to rejected: nothing to learn",
            lambda ws: ws.args(dataset_name=ws.rows_file(
                "same.jsonl", [{"prompt": "a", "chosen": "same", "rejected": "same"}] * 12))),
    Mistake("sft_without_known_columns", "SFT data with none of the columns SFT reads", "notes.jsonl: SFT data needs a "
            "'messages' chat, 'prompt' + 'completion', or 'text' column", lambda ws: ws.args(
                stage="sft", dataset_name=ws.rows_file("notes.jsonl", [{"note": "a"}] * 12))),
    Mistake("missing_completion", "A row with a column left empty (`\"completion\": null` in row 20)", "row 20: "
            "'completion' is missing", lambda ws: ws.args(stage="sft", dataset_name=ws.rows_file(
                "gaps.jsonl", [{"prompt": "a", "completion": "b"}] * 19 + [{"prompt": "a", "completion": None}] +
                [{"prompt": "a", "completion": "b"}] * 4))),
    Mistake("directory_without_data", "A `--dataset_name` directory with no data files in it", "the directory holds "
            "neither a save_to_disk dataset nor data files", lambda ws: ws.args(dataset_name=_empty_dir(ws))),
    Mistake("split_files_of_two_formats", "Split files of two formats in one directory", "split files of one format "
            "please", _mixed_split_files),
    Mistake("mixture_without_name", "A `dataset_mixture` entry without a name", "'name' (a Hub id, a file or a "
            "directory) is required", lambda ws: _recipe(ws, "dataset_mixture:\n  - weight: 0.5\n")),
    Mistake("no_such_split", "A `--dataset_split` the data does not have", "--dataset_split dev: no such split",
            lambda ws: ws.args(dataset_split="dev")),
    Mistake("too_many_held_out", "`--val_size` / `--test_size` that leave no training rows", "lower --val_size / "
            "--test_size", lambda ws: ws.args(val_size="30")),
    Mistake("unknown_role", "A chat message with an unknown role (`\"role\": \"robot\"` in row 10)", "row 10: "
            "'chosen' message 1 has role 'robot'", lambda ws: ws.args(dataset_name=ws.rows_file(
                "robot.jsonl", _edit_rows(lambda rows: _roles(rows, 9, "chosen", "robot"))))),
    Mistake("misspelt_role", "A misspelt role (`assitant`)", "has role 'assitant' (did you mean 'assistant'?)",
            lambda ws: ws.args(dataset_name=ws.rows_file(
                "typo.jsonl", _edit_rows(lambda rows: _roles(rows, 3, "chosen", "assitant"))))),
    Mistake("content_as_parts", "Message content as a list of parts for a text-only chat template", "row 1: 'prompt' "
            "message 1 has its content as a list of parts", lambda ws: ws.args(dataset_name=ws.rows_file(
                "parts.jsonl", _edit_rows(lambda rows: [row["prompt"][0].update(content=[
                    {"type": "text", "text": row["prompt"][0]["content"]}]) for row in rows])))),
    Mistake("sharegpt_speaker", "A ShareGPT turn from an unknown speaker", "'conversations' has a turn from 'bot'",
            lambda ws: ws.args(stage="sft", dataset_name=ws.rows_file("sharegpt.jsonl", [
                {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]}] * 12))),
    Mistake("chat_without_template", "Chat data for a model whose tokenizer has no chat template", "has no chat "
            "template to render it", _base_model),
    Mistake("template_refuses_row", "A row the chat template refuses (its `raise_exception`, row 6)", "row 6: the chat "
            "template refused it (Conversations must start with a user turn)",
            _assistant_first),
    Mistake("reasoning_field_ignored", "Answers with a `reasoning_content` field for a template that reads none",
            "row 1: the chat template of", lambda ws: ws.args(dataset_name=ws.rows_file(
                "reasoning.jsonl", _edit_rows(lambda rows: [row["chosen"][0].update(reasoning_content="I recall it")
                                                            for row in rows])))),
    Mistake("reasoning_never_closes", "An answer whose `<think>` never closes (row 3)", "row 3: 'rejected' opens "
            "<think> and never closes it", lambda ws: ws.args(dataset_name=ws.rows_file(
                "unclosed.jsonl", _edit_rows(lambda rows: rows[2]["rejected"][0].update(content="<think>\nhmm"))))),
    Mistake("tool_calls_without_tool_syntax", "Answers that call tools, for a template with no tool syntax",
            "drops the answer's tool calls", lambda ws: ws.args(dataset_name=ws.rows_file(
                "tools.jsonl", _edit_rows(lambda rows: [row["chosen"][0].update(content="", tool_calls=[
                    {"type": "function", "function": {"name": "sky", "arguments": {}}}]) for row in rows])))),
    # Models, tokenizers, adapters, chat templates
    Mistake("missing_model_dir", "A model directory that does not exist", "no such directory",
            lambda ws: ws.args(model_name_or_path=str(ws.root / "no_model"))),
    Mistake("dir_without_config", "A directory that is not a saved model", "the directory has no config.json",
            lambda ws: ws.args(model_name_or_path=str(ws.root))),
    Mistake("adapter_as_model", "A LoRA adapter directory given as the model", "is a LoRA adapter, not a model",
            _adapter),
    Mistake("truncated_weights", "Weights cut short (an interrupted download)", "model.safetensors is corrupt",
            _truncated_weights),
    Mistake("missing_shard", "A sharded model with a shard missing", "names shards that are missing",
            _missing_shard),
    Mistake("broken_config", "A model's config.json that is not valid JSON", "config.json' is not a valid JSON file",
            _broken_config),
    Mistake("unknown_model_type", "A model type this transformers does not know", "could not read its config.json",
            _unknown_model_type),
    Mistake("no_tokenizer", "A model directory without tokenizer files", "no tokenizer files", _no_tokenizer),
    Mistake("tokenizer_larger_than_model", "A tokenizer with more ids than the model's embeddings", "token ids but "
            "the model's embeddings hold", _small_vocabulary),
    Mistake("encoder_only", "An encoder-only model (BERT) for SFT/DPO", "is encoder-only",
            _encoder("BertForMaskedLM", "BertConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, max_position_embeddings=128)),
    # Before the objectives' table (issue 37) the causal-LM check named sft and dpo only: KTO trained a BERT to exit 0.
    Mistake("encoder_only_kto", "An encoder-only model (BERT) for KTO", "is encoder-only",
            lambda ws: _encoder("BertForMaskedLM", "BertConfig", hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=128)(ws)
            + ["--stage", "kto", "--kto_from_pairs", "true"]),
    Mistake("encoder_decoder", "An encoder-decoder model (T5) for SFT/DPO", "is an encoder-decoder",
            _encoder("T5ForConditionalGeneration", "T5Config", d_model=32, d_ff=64, d_kv=16, num_layers=1,
                     num_heads=2)),
    Mistake("past_learned_positions", "A `--max_length` longer than a GPT-2-style model's position table",
            "has learned positions for 64 tokens only", _learned_positions),
    Mistake("unknown_attention", "An `--attn_implementation` transformers does not have", "--attn_implementation "
            "flash: Specified", lambda ws: ws.args(attn_implementation="flash")),
    Mistake("flash_attention_missing", "`--attn_implementation flash_attention_2` without FlashAttention installed",
            "--attn_implementation flash_attention_2: FlashAttention2 has been toggled on",
            lambda ws: ws.args(attn_implementation="flash_attention_2")),
    Mistake("lora_target_matches_nothing", "LoRA target modules that match nothing (`nope_proj`)",
            "--lora_target_modules nope_proj: matches no module", lambda ws: ws.args(
                use_lora="true", lora_target_modules="nope_proj")),
    Mistake("lora_target_typo", "One misspelt LoRA target among several (`q_proj v_pro`)", "--lora_target_modules "
            "v_pro: matches no module of", lambda ws: ws.args(use_lora="true") + [
                "--lora_target_modules", "q_proj", "v_pro"]),
    Mistake("lora_target_not_linear", "A LoRA target that is not a linear layer (`norm`)", "which LoRA cannot adapt",
            lambda ws: ws.args(use_lora="true", lora_target_modules="norm")),
    Mistake("judge_missing", "A `--judge` reward model path that does not exist", "no such directory (a reward "
            "model's", lambda ws: ws.args(judge=str(ws.root / "reward_model"))),
    Mistake("judge_not_a_model", "A `--judge` directory that is not a saved model", "not a saved reward model",
            lambda ws: ws.args(judge=str(ws.root))),
    Mistake("judge_function_missing", "A `--judge module:function` that cannot be imported",
            "--judge nosuch_judges:score: cannot import nosuch_judges", lambda ws: ws.args(judge="nosuch_judges:score")),
    Mistake("judge_function_misspelt", "A `--judge module:function` whose module lacks the function",
            "has no function 'no_such_function'", lambda ws: ws.args(judge="json:no_such_function")),
    # On-policy rounds
    Mistake("rounds_without_judge", "`--rounds` on data no judge knows, without `--judge`", "--rounds needs a judge to "
            "rank each prompt's answers", lambda ws: ws.args(rounds="2")),
    Mistake("audit_judge_pairs_negative", "`--audit_judge_pairs -1`", "--audit_judge_pairs must be 0 or more",
            lambda ws: ws.args(audit_judge_pairs="-1")),
    Mistake("rounds_one_sample", "`--round_samples 1`: no pair can be formed", "--round_samples must be at least 2",
            lambda ws: ws.args(rounds="1", round_samples="1", judge="json:loads")),
    # SimPO (no reference model): docs/simpo.md
    Mistake("simpo_reference_flag", "A reference-model flag with a reference-free objective (`--stage simpo "
            "--precompute_ref_log_probs true`)", "--precompute_ref_log_probs: SimPO has no reference model",
            lambda ws: ws.args(stage="simpo", precompute_ref_log_probs="true")),
    Mistake("simpo_unpaired_rows", "Thumbs up / down rows given to a pair objective (`--stage simpo`)",
            "preference data needs chosen and rejected answers", lambda ws: ws.args(
                stage="simpo", dataset_name=ws.rows_file("thumbs_for_simpo.jsonl", [
                    {"prompt": f"q{index}", "completion": "a", "label": index % 2 == 0} for index in range(12)]))),
    Mistake("simpo_dpo_loss_type", "A DPO loss type asked of SimPO (`--stage simpo --loss_type ipo`)",
            "--loss_type ipo: SimPO's loss is fixed", lambda ws: ws.args(stage="simpo", loss_type="ipo")),
    Mistake("orpo_reference_flag", "A reference-model flag with ORPO (`--stage orpo --precompute_ref_log_probs true`)",
            "--precompute_ref_log_probs: ORPO has no reference model",
            lambda ws: ws.args(stage="orpo", precompute_ref_log_probs="true")),
    # KTO (thumbs up / down): docs/kto.md
    Mistake("kto_label_not_thumbs", "A KTO label column that is not a thumbs up / down (`\"thumbs\": \"maybe\"` in row "
            "3)", "row 3: 'label' is 'maybe', not a thumbs up / down", lambda ws: ws.args(
                stage="kto", label_column="thumbs", dataset_name=ws.rows_file("thumbs.jsonl", [
                    {"prompt": "a", "completion": "b", "thumbs": ["up", "down"][i % 2] if i != 2 else "maybe"}
                    for i in range(24)]))),
    Mistake("kto_one_class", "KTO data whose labels are all thumbs up", "every training row is desirable (",
            lambda ws: ws.args(stage="kto", dataset_name=ws.rows_file(
                "all_up.jsonl", [{"prompt": f"q{i}", "completion": "b", "label": True} for i in range(24)]))),
    Mistake("kto_pairs_without_conversion", "A preference pair file given to `--stage kto`", "preference pairs "
            "(chosen / rejected), not thumbs up / down rows: add --kto_from_pairs",
            lambda ws: ws.args(stage="kto")),
    Mistake("kto_micro_batch_of_one", "KTO with one row per device micro-batch", "KTO needs at least 2 rows per "
            "device micro-batch", lambda ws: ws.args(stage="kto", kto_from_pairs="true", batch_size="4",
                                                     micro_batch_size="1")),
    Mistake("kto_dpo_loss_type", "A DPO loss type for `--stage kto`", "--loss_type ipo: KTO takes one of kto, "
            "apo_zero_unpaired", lambda ws: ws.args(stage="kto", kto_from_pairs="true", loss_type="ipo")),
    # A value an objective does not take, from its row / TRL's declared choices (src/objectives/trl_field_names.json)
    Mistake("dpo_grpo_loss_type", "A GRPO loss type asked of DPO (`--stage dpo --loss_type dapo`)",
            "--loss_type dapo: DPO takes one or more (combined with --loss_weights) of sigmoid, hinge",
            lambda ws: ws.args(loss_type="dapo")),
    Mistake("sft_loss_type", "A loss type for `--stage sft` (its loss has none to choose)",
            "--loss_type sigmoid: SFT has no loss type to choose; drop it", lambda ws: ws.args(stage="sft",
                                                                                           loss_type="sigmoid")),
    Mistake("trl_value_not_declared", "A TRL field's value its config does not declare (`--truncation_mode "
            "keep_middle`)", "--truncation_mode: 'truncation_mode' must be one of keep_end, keep_start for --stage dpo",
            lambda ws: ws.args(truncation_mode="keep_middle")),
    # A key in a pipeline stage's block that the stage does not read (src/config_parse.py block_reads)
    Mistake("rounds_in_a_stage_block", "`rounds: 2` inside a recipe's `dpo:` block (rounds follow the run's final "
            "stage)", "recipe.yaml: 'dpo.rounds': the DPO stage of sft_then_dpo_then_grpo does not read rounds; it is "
            "the run's, not a stage's: a top-level key of --stage dpo or sft_then_dpo", lambda ws: _recipe(
                ws, "stage: sft_then_dpo_then_grpo\njudge: json:loads\ndpo:\n  rounds: 2\n", stage=None)),
    Mistake("dpo_key_in_the_sft_block", "A DPO key in the `sft:` block (`sft: {beta: 0.3}`)", "recipe.yaml: "
            "'sft.beta': the SFT stage of sft_then_dpo does not read beta; it belongs in the top level",
            lambda ws: _recipe(ws, "stage: sft_then_dpo\nsft:\n  beta: 0.3\n", stage=None)),
    Mistake("flex_attention_on_cpu", "`--attn_implementation flex_attention` on CPU (no backward there)",
            "--attn_implementation flex_attention needs a CUDA GPU: FlexAttention has no backward on CPU; use sdpa "
            "(transformers' default) or eager", lambda ws: ws.args(attn_implementation="flex_attention")),
    Mistake("kto_flag_on_dpo", "`--kto_from_pairs` on a DPO run", "--kto_from_pairs applies to --stage kto or "
            "sft_then_kto", lambda ws: ws.args(kto_from_pairs="true")),
    Mistake("rounds_on_sft", "`--rounds` with `--stage sft`", "--rounds runs DPO rounds after the DPO stage",
            lambda ws: ws.args(stage="sft", rounds="1", judge="json:loads")),
    Mistake("prompts_without_rounds", "A file of prompts alone (no chosen/rejected) for DPO without `--rounds`",
            "the data holds prompts without chosen and rejected answers: prompts alone train by on-policy rounds",
            lambda ws: ws.args(dataset_name=ws.rows_file("prompts.jsonl", _prompts_only(24)))),
    Mistake("prompts_for_sft", "`--stage sft_then_dpo --rounds` on prompts alone without SFT data of its own",
            "SFT needs answers to learn from, and the data holds prompts alone",
            lambda ws: ws.args(stage="sft_then_dpo", rounds="1", judge="json:loads",
                               dataset_name=ws.rows_file("prompts.jsonl", _prompts_only(24)))),
    Mistake("prompts_mixed_with_pairs", "A `dataset_mixture` of prompts alone and preference pairs, with `--rounds`",
            "hold prompts without answers and the other sources hold preference pairs",
            lambda ws: _recipe(ws, "dataset_mixture:\n"
                               f"  - name: {ws.rows_file('prompts.jsonl', _prompts_only(24))}\n  - name: {ws.data}\n")
            + ["--rounds", "1", "--judge", "json:loads"]),
    Mistake("template_syntax", "A chat template that is not valid Jinja", "is not valid Jinja",
            lambda ws: ws.args(chat_template_path=_template_file(ws, "bad.jinja", "{% for m in messages %}{{ m }"))),
    Mistake("template_source_missing", "A `--chat_template_path` that is neither a file nor a tokenizer",
            "neither a .jinja/.j2 file nor a tokenizer directory",
            lambda ws: ws.args(chat_template_path=str(ws.root / "nope"))),
    # Images and vision-language models (src/vision.py, src/data/images.py)
    Mistake("image_file_missing", "An image file the data names that is not there", "row 3: image 1 does not exist",
            lambda ws: _vlm(ws, lambda rows, directory: (directory / rows[2]["images"][0]).unlink())),
    Mistake("image_unreadable", "An image file that is not an image (damaged, or another kind of file)",
            "row 3: image 1 is not a readable image", lambda ws: _vlm(
                ws, lambda rows, directory: (directory / rows[2]["images"][0]).write_bytes(b"not a png"))),
    Mistake("image_count_mismatch", "More images in a row than image parts in its messages",
            "row 5: its messages hold 1 image part(s) ({'type': 'image'}) for 2 image(s)",
            lambda ws: _vlm(ws, _two_images_one_part)),
    Mistake("image_in_answer", "An image part in an answer", "row 3: 'chosen' holds an image part: images belong to "
            "the prompt", lambda ws: _vlm(ws, _image_in_answer)),
    Mistake("image_web_address", "An image given as a web address on a machine that reads files",
            "row 1: image 1 is a web address", lambda ws: _vlm(
                ws, lambda rows, directory: rows[0].update(images=["https://example.com/cat.png"]))),
    Mistake("image_text_prompt", "Images with a text prompt (not chat messages)", "image(s) with a text prompt: give "
            "the prompt as chat messages", lambda ws: _vlm(ws, _text_prompts)),
    Mistake("text_model_given_images", "Image data for a text-only model", "is a text-only model: train a "
            "vision-language model on it", lambda ws: _vlm(ws, model=ws.model)),
    Mistake("vlm_stage_not_yet", "A vision-language model for a stage that does not train one yet (`--stage kto`, "
            "`grpo`, `reward`, `simpo`, `orpo`)", "does not train one yet: use --stage dpo or sft (sft_then_dpo)",
            lambda ws: _vlm(ws, stage="kto", kto_from_pairs="true")),
    Mistake("vlm_rounds", "On-policy `--rounds` with a vision-language model", "--rounds with a vision-language "
            "model (llava): not verified with images yet", lambda ws: _vlm(ws, rounds="1", judge="json:loads")),
    Mistake("vlm_under_sharding", "A vision-language model under a sharding engine (`STRATEGY=zero3`, `fsdp`, ...)",
            "DeepSpeed ZeRO-3 (STRATEGY=zero3) with a vision-language model (llava): not verified with images yet",
            lambda ws: _vlm(ws), env={"STRATEGY": "zero3"}),
    Mistake("vlm_without_processor", "A vision-language model directory without its processor",
            "a vision-language model without its processor (no processor_config.json or preprocessor_config.json)",
            _without_processor),
    Mistake("vlm_family_not_verified", "A vision-language model family not verified here (`llava_next`, Qwen2-VL, "
            "...)", "a vision-language model, llava_next: not verified for training here", _unverified_family),
    # The launch: environment variables and run_distributed.sh
    Mistake("comm_hook_under_zero", "A DDP communication hook (`--ddp_comm_hook`) with a sharding engine "
            "(`STRATEGY=zero3`)", "--ddp_comm_hook fp16 compresses DDP's all-reduce, and DeepSpeed ZeRO-3 reduces "
            "gradients its own way", lambda ws: ws.args(ddp_comm_hook="fp16"), env={"STRATEGY": "zero3"}),
    Mistake("qlora_under_zero3", "4-bit QLoRA (`--load_in_4bit`) under a sharding engine that shards weights "
            "(`STRATEGY=zero3` or `fsdp`)", "--load_in_4bit (QLoRA) under DeepSpeed ZeRO-3: the 4-bit base as "
            "bitsandbytes stores it cannot be sharded; launch QLoRA with plain DDP or STRATEGY=zero2",
            lambda ws: ws.args(use_lora="true", load_in_4bit="true"), env={"STRATEGY": "zero3"}),
    Mistake("qlora_under_fsdp", "4-bit QLoRA under FSDP (`STRATEGY=fsdp`)", "--load_in_4bit (QLoRA) under FSDP: the "
            "4-bit base as bitsandbytes stores it cannot be sharded",
            lambda ws: ws.args(use_lora="true", load_in_4bit="true"), env={"STRATEGY": "fsdp"}),
    Mistake("batch_not_divisible_under_zero", "A global batch that DeepSpeed's processes cannot share "
            "(`STRATEGY=zero2`)", "--batch_size 3 cannot be split across 2 processes: use a multiple of 2",
            lambda ws: ws.args(batch_size="3"), env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "STRATEGY": "zero2"}),
    Mistake("batch_not_divisible", "A global batch that the processes cannot share", "--batch_size 3 cannot be "
            "split across 2 processes: use a multiple of 2, the nearest 2 or 4", lambda ws: ws.args(batch_size="3"),
            env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}),
    Mistake("nnodes_not_a_number", "`NNODES` that is not a number", "NNODES must be a whole number",
            lambda ws: ws.args(), launcher=True, env={"NNODES": "two"}),
    Mistake("node_rank_beyond_nodes", "`NODE_RANK` not below `NNODES`", "NODE_RANK 2 with NNODES 2",
            lambda ws: ws.args(), launcher=True, env={"NNODES": "2", "NODE_RANK": "2"}),
    Mistake("bad_master_port", "A `MASTER_PORT` that is not a port", "MASTER_PORT must be a port number",
            lambda ws: ws.args(), launcher=True, env={"MASTER_PORT": "99999"}),
    Mistake("unknown_strategy", "An unknown `STRATEGY`", "STRATEGY=ddp2: use torchrun (default)",
            lambda ws: ws.args(), launcher=True, env={"STRATEGY": "ddp2"}),
    Mistake("zero_processes", "`./run_distributed.sh 0`", "NUM_PROCS must be at least 1",
            lambda ws: ["0"] + ws.args(), launcher=True),
]


@pytest.fixture
def workspace(tiny_model, tiny_llava, tmp_path) -> Workspace:
    return Workspace(tmp_path, tiny_model, write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24)), tiny_llava)


@pytest.fixture
def preflight(capsys, monkeypatch):
    """Run src.main_distributed's run through src.pipeline.exits' exit_status in this process (its dry run), as a
    user's command would: the environment and the signal handlers it changes are put back after."""
    from src.main_distributed import run as run_pipeline
    from src.pipeline.exits import exit_status

    def run(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        saved_environ, saved_handlers = dict(os.environ), {s: signal.getsignal(s) for s in (signal.SIGINT,
                                                                                             signal.SIGTERM)}
        try:
            code = exit_status(run_pipeline, argv)
        finally:
            os.environ.clear()
            os.environ.update(saved_environ)
            for number, handler in saved_handlers.items():
                signal.signal(number, handler)
        captured = capsys.readouterr()
        return code, captured.err + captured.out
    return run


def run_launcher(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    # PRINT_LAUNCH=1: the launcher's own checks only, no Python started (these rows are about its environment).
    result = subprocess.run(["bash", "run_distributed.sh", *argv], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=60, env=os.environ | {"PYTHON": sys.executable, "PRINT_LAUNCH": "1"} | env)
    return result.returncode, result.stderr + result.stdout


@pytest.mark.parametrize("mistake", MISTAKES, ids=[mistake.id for mistake in MISTAKES])
def test_each_mistake_gets_one_line_and_no_traceback(mistake, workspace, preflight):
    argv = mistake.make(workspace)
    if mistake.launcher:
        code, output = run_launcher(argv + ["--dry_run"], mistake.env)
    else:
        code, output = preflight(argv + ["--dry_run"], mistake.env)  # an exception escaping it fails the test
    assert code != 0, f"{mistake.id}: exit 0; the mistake went through:\n{output[-2000:]}"
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    assert mistake.line in errors[0], errors[0]


def test_debug_shows_the_traceback(workspace, preflight):
    from src.models import ModelError

    with pytest.raises(ModelError, match="matches no module"):
        preflight(workspace.args(use_lora="true", lora_target_modules="nope_proj") + ["--dry_run", "--debug"], {})


def test_the_doc_lists_every_mistake():
    doc = DOC.read_text()
    missing = [f"{mistake.id}: {mistake.line!r}" for mistake in MISTAKES if mistake.line not in doc]
    assert not missing, f"docs/troubleshooting.md does not list: {missing}"


def test_a_mistake_leaves_an_earlier_run_untouched(workspace):
    """A real launch (not a dry run) with --overwrite over a finished run: the mistake stops it before the old run's
    directory is touched."""
    run_dir = workspace.root / "results" / "earlier"
    (run_dir / "model" / "final").mkdir(parents=True)
    (run_dir / "training_info.json").write_text('{"status": "completed"}')
    (run_dir / "model" / "final" / "model.safetensors").write_bytes(b"weights")
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in run_dir.rglob("*") if path.is_file()}
    result = subprocess.run(
        [sys.executable, "-m", "src.main_distributed", *workspace.args(
            run_name="earlier", use_lora="true", lora_target_modules="nope_proj"), "--overwrite"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--lora_target_modules nope_proj" in result.stderr, result.stderr[-2000:]
    after = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in run_dir.rglob("*") if path.is_file()}
    assert after == before


@pytest.mark.parametrize("targets, accepted", [
    (["q_proj"], True),  # one name: TRL made it a string, which PEFT read as a regex over the full name
    (["q_proj", "v_proj"], True),
    ([r".*\.(q|v)_proj"], True),  # a regular expression stays one
    (["all-linear"], True),
    (["nope_proj"], False),
    (["norm"], False),
])
def test_the_lora_target_check_agrees_with_peft(targets, accepted, tiny_model):
    """The preflight's verdict on --lora_target_modules is PEFT's own, given the same model."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from src.config import ModelArguments
    from src.input_checks import check_lora_targets, load_config, meta_model
    from src.models import ModelError, peft_config

    model_args = ModelArguments(model_name_or_path=str(tiny_model), use_lora=True, lora_target_modules=targets)
    try:
        built = meta_model(load_config(str(tiny_model), False), causal=True, trust_remote_code=False)
        check_lora_targets(str(tiny_model), built, model_args, causal=True)
        ours = True
    except ModelError:
        ours = False
    try:
        get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), peft_config(model_args))
        peft = True
    except ValueError:  # NoMatchingPeftModuleError, "Target module ... is not supported"
        peft = False
    assert (ours, peft) == (accepted, accepted)


def test_the_scheduler_choices_are_transformers():
    from transformers.trainer_utils import SchedulerType

    from src.config import LR_SCHEDULERS

    assert list(LR_SCHEDULERS) == [member.value for member in SchedulerType]


def test_a_max_length_past_a_rotary_models_context_is_one_warning(workspace, preflight):
    """The tiny Llama's rotary positions were made for 256 tokens: --max_length 512 runs (no table to run out of) but
    on positions it never saw, which nothing else would say. One warning line in the dry run, and none within 256."""
    code, output = preflight(workspace.args(max_length="512") + ["--dry_run"], {})
    warnings = [line for line in output.splitlines() if "past" in line and "warning:" in line]
    assert code == 0 and len(warnings) == 1, output[-3000:]
    assert "--max_length 512 is past" in warnings[0] and "context of 256 tokens (max_position_embeddings 256" in \
        warnings[0] and "lower --max_length to 256" in warnings[0]
    code, output = preflight(workspace.args(max_length="256") + ["--dry_run"], {})
    assert code == 0 and "positions the model never saw" not in output


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "llama", "max_position_embeddings": 4096}, 4096),
    # Llama 3.1: the table already holds the scaled length (8192 x 8 = 65536 < 131072)
    ({"model_type": "llama", "max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0}}, 131072),
    # Qwen2.5 with YaRN as its card advises: 32768 x 4
    ({"model_type": "qwen2", "max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, 131072),
    ({"model_type": "llama", "max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}},
     16384),
    ({"model_type": "gpt2", "n_positions": 1024}, None),  # learned positions: check_positions' error instead
])
def test_the_rotary_context_counts_rope_scaling(config, expected):
    from transformers import AutoConfig

    from src.input_checks import rotary_context

    found = rotary_context(AutoConfig.for_model(**config))
    assert (found and found[0]) == expected
