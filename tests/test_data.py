"""Data: every recognised shape becomes the same training rows; tokenization matches TRL's own; bad data is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import preference_rows, write_jsonl
from src.config import DataArguments, SFTArguments
from src.data import DataError, prepare_data, tokenize_preference, tokenize_sft

ROWS = preference_rows(40)


def prepared(tokenizer, tmp_path, stage="dpo", sft=None, **data_fields):
    data = DataArguments(**({"val_size": 4, "test_size": 4, "max_length": 64} | data_fields))
    return prepare_data(data, sft or SFTArguments(), stage, 0, tokenizer, tmp_path / "cache")


def _text(messages):
    return messages[0]["content"]


SHAPES = {
    "explicit_prompt": lambda row: row,
    "implicit_prompt": lambda row: {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]},
    "ultrafeedback": lambda row: {"prompt": _text(row["prompt"]), "chosen": row["prompt"] + row["chosen"],
                                  "rejected": row["prompt"] + row["rejected"], "score_chosen": 8.0},
    "anthropic_hh": lambda row: {
        "chosen": f"\n\nHuman: {_text(row['prompt'])}\n\nAssistant: {_text(row['chosen'])}",
        "rejected": f"\n\nHuman: {_text(row['prompt'])}\n\nAssistant: {_text(row['rejected'])}"},
    "orca": lambda row: {"system": "", "question": _text(row["prompt"]), "chosen": _text(row["chosen"]),
                         "rejected": _text(row["rejected"])},
}


def _train_ids(result):
    train = result.train
    return [train["prompt_ids"], train["chosen_ids"], train["rejected_ids"]]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_preference_shape_gives_the_same_training_rows(shape, tiny_tokenizer, tmp_path):
    reference = prepared(tiny_tokenizer, tmp_path / "ref", dataset_name=str(write_jsonl(tmp_path / "ref.jsonl", ROWS)))
    path = write_jsonl(tmp_path / f"{shape}.jsonl", [SHAPES[shape](row) for row in ROWS])
    result = prepared(tiny_tokenizer, tmp_path / shape, dataset_name=str(path))
    assert result.summary["shape"] == shape
    assert _train_ids(result) == _train_ids(reference)
    assert len(result.train) == 32 and len(result.validation) == 4 and len(result.test) == 4


def test_column_mapping_gives_the_same_training_rows(tiny_tokenizer, tmp_path):
    reference = prepared(tiny_tokenizer, tmp_path / "ref", dataset_name=str(write_jsonl(tmp_path / "ref.jsonl", ROWS)))
    renamed = [{"query": row["prompt"], "good": row["chosen"], "bad": row["rejected"]} for row in ROWS]
    result = prepared(tiny_tokenizer, tmp_path / "mapped", dataset_name=str(write_jsonl(tmp_path / "m.jsonl", renamed)),
                      prompt_column="query", chosen_column="good", rejected_column="bad")
    assert _train_ids(result) == _train_ids(reference)


def test_parquet_csv_and_save_to_disk_load_the_same_rows(tiny_tokenizer, tmp_path):
    import datasets

    text_rows = [{"prompt": _text(r["prompt"]), "chosen": _text(r["chosen"]), "rejected": _text(r["rejected"])}
                 for r in ROWS]
    reference = prepared(tiny_tokenizer, tmp_path / "j", dataset_name=str(write_jsonl(tmp_path / "t.jsonl", text_rows)))
    table = datasets.Dataset.from_list(text_rows)
    table.to_parquet(tmp_path / "t.parquet")
    table.to_csv(tmp_path / "t.csv", index=False)
    table.save_to_disk(tmp_path / "saved")
    for source in ("t.parquet", "t.csv", "saved"):
        assert _train_ids(prepared(tiny_tokenizer, tmp_path / source.replace(".", "_"),
                                   dataset_name=str(tmp_path / source))) == _train_ids(reference)


def test_a_directory_of_split_files_keeps_its_splits(tiny_tokenizer, tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", ROWS[:30])
    write_jsonl(tmp_path / "d" / "validation.jsonl", ROWS[30:35])
    write_jsonl(tmp_path / "d" / "test.jsonl", ROWS[35:])
    result = prepared(tiny_tokenizer, tmp_path, dataset_name=str(tmp_path / "d"))
    assert (len(result.train), len(result.validation), len(result.test)) == (30, 5, 5)
    assert result.test[0]["sample_chosen"] == _text(ROWS[35]["chosen"])


def _trl_dpo_dataset(tokenizer, model_path, rows, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[], max_length=64,
                     activation_checkpointing=False)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_path), args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    return trainer.train_dataset


@pytest.mark.parametrize("conversational", [True, False])
def test_preference_tokenization_matches_trl(conversational, tiny_tokenizer, tiny_model, tmp_path):
    rows = ROWS[:12] if conversational else [
        {"prompt": _text(r["prompt"]) + " ", "chosen": _text(r["chosen"]), "rejected": _text(r["rejected"])}
        for r in ROWS[:12]]
    theirs = _trl_dpo_dataset(tiny_tokenizer, tiny_model, rows, tmp_path)
    ours = [tokenize_preference(row, tiny_tokenizer) for row in rows]
    for column in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert [item[column] for item in ours] == theirs[column]


SFT_DATA = {
    "messages": lambda row: {"messages": row["prompt"] + row["chosen"]},
    "prompt_completion_chat": lambda row: {"prompt": row["prompt"], "completion": row["chosen"]},
    "prompt_completion_text": lambda row: {"prompt": _text(row["prompt"]) + " ", "completion": _text(row["chosen"])},
    "text": lambda row: {"text": _text(row["prompt"]) + " " + _text(row["chosen"])},
}


@pytest.mark.parametrize("shape", list(SFT_DATA))
@pytest.mark.parametrize("assistant_only_loss", [False, True])
def test_sft_tokenization_matches_trl(shape, assistant_only_loss, tiny_tokenizer, tiny_model, tmp_path):
    """Our pre-tokenized rows, given to TRL's SFTTrainer, train on exactly the tokens and labels TRL's own
    preparation of the raw rows produces."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    if assistant_only_loss and shape not in ("messages", "prompt_completion_chat"):
        return  # TRL refuses assistant-only loss on non-chat data; covered by the chat shapes
    rows = [SFT_DATA[shape](row) for row in ROWS[:12]]
    args = SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[], max_length=64,
                     activation_checkpointing=False, assistant_only_loss=assistant_only_loss)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    theirs = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                        processing_class=tiny_tokenizer).train_dataset
    ours_rows = [row | tokenize_sft(row, tiny_tokenizer, assistant_only_loss, None) for row in rows]
    ours = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(ours_rows),
                      processing_class=tiny_tokenizer).train_dataset
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["labels"] == theirs["labels"]
    assert any(label == -100 for labels in ours["labels"] for label in labels) == (
        assistant_only_loss or shape.startswith("prompt_completion"))


def test_sft_recognises_chat_prompt_completion_text_and_preference_data(tiny_tokenizer, tmp_path):
    for shape, make in (("messages", SFT_DATA["messages"]), ("prompt_completion", SFT_DATA["prompt_completion_chat"]),
                        ("text", SFT_DATA["text"]), ("preference", lambda row: row)):
        path = write_jsonl(tmp_path / f"{shape}.jsonl", [make(row) for row in ROWS])
        result = prepared(tiny_tokenizer, tmp_path / shape, stage="sft", dataset_name=str(path))
        assert result.summary["shape"] == shape
        assert len(result.train) == 32 and all(result.train["input_ids"])


def test_sharegpt_speakers_become_chat_roles(tiny_tokenizer, tmp_path):
    # ShareGPT as it is published (human / gpt): the same training rows as the same chats written with roles, with
    # the loss on the assistant's turns.
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    chats = [[{"role": "system", "content": "answer briefly"}] + row["prompt"] + row["chosen"] for row in ROWS]
    sharegpt = [{"conversations": [{"from": speakers[turn["role"]], "value": turn["content"]} for turn in chat]}
                for chat in chats]
    sft = SFTArguments(assistant_only_loss=True)
    ours = prepared(tiny_tokenizer, tmp_path / "a", stage="sft", sft=sft,
                    dataset_name=str(write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt)))
    theirs = prepared(tiny_tokenizer, tmp_path / "b", stage="sft", sft=sft,
                      dataset_name=str(write_jsonl(tmp_path / "messages.jsonl", [{"messages": c} for c in chats])))
    assert ours.summary["shape"] == "sharegpt" and len(ours.train) == len(theirs.train) == 32
    for column in ("input_ids", "assistant_masks"):
        assert ours.train[column] == theirs.train[column]
    assert all(any(mask) for mask in ours.train["assistant_masks"])

    sharegpt[5]["conversations"][1]["from"] = "narrator"
    with pytest.raises(DataError, match=r"row \d+: 'conversations' has a turn from 'narrator': the known speakers are "
                                        r"human, user, gpt, assistant, system, observation, tool; rename it"):
        prepared(tiny_tokenizer, tmp_path / "c", stage="sft",
                 dataset_name=str(write_jsonl(tmp_path / "narrator.jsonl", sharegpt)))


def test_sharegpt_ranking_pairs_prepare_as_the_same_pairs_written_as_chats(tiny_tokenizer, tmp_path):
    """LLaMA-Factory's ShareGPT ranking layout (Light-R1's DPO data, issue 38's recipe): `conversations` holds the
    turns so far, `chosen` and `rejected` one {from, value} message each; the same tokens as those pairs as chats."""
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}

    def turns(messages):
        return [{"from": speakers[turn["role"]], "value": turn["content"]} for turn in messages]

    ranking = [{"conversations": turns(row["prompt"]), "chosen": turns(row["chosen"])[0],
                "rejected": turns(row["rejected"])[0]} for row in ROWS]
    ours = prepared(tiny_tokenizer, tmp_path / "a", dataset_name=str(write_jsonl(tmp_path / "ranking.jsonl", ranking)))
    theirs = prepared(tiny_tokenizer, tmp_path / "b", dataset_name=str(write_jsonl(tmp_path / "pairs.jsonl", ROWS)))
    assert ours.summary["shape"] == "sharegpt_pairs" and len(ours.train) == len(theirs.train) > 0
    for column in ("prompt", "chosen", "rejected", "prompt_ids", "chosen_ids", "rejected_ids"):
        assert ours.train[column] == theirs.train[column], column

    ranking[3]["rejected"]["from"] = "narrator"
    with pytest.raises(DataError, match=r"row \d+: 'rejected' has a turn from 'narrator': the known speakers are"):
        prepared(tiny_tokenizer, tmp_path / "c", dataset_name=str(write_jsonl(tmp_path / "narrator.jsonl", ranking)))


def test_a_chat_without_an_assistant_turn_trains_as_text_and_has_no_sample_prompt(tiny_tokenizer, tmp_path):
    # Held-out rows become sample prompts up to the last assistant turn; a chat with none used to crash there.
    chats = [{"messages": row["prompt"] + ([] if index % 2 else row["chosen"])} for index, row in enumerate(ROWS)]
    result = prepared(tiny_tokenizer, tmp_path, stage="sft", dataset_name=str(write_jsonl(tmp_path / "c.jsonl", chats)))
    held_out = result.validation.to_list() + result.test.to_list()
    assert len(result.train) == 32 and len(held_out) == 8
    for row in held_out:
        has_assistant = any(message["role"] == "assistant" for message in row["messages"])
        assert bool(row["sample_prompt_ids"]) == has_assistant


def test_tool_calling_chat_with_a_tools_column(tiny_tokenizer, tmp_path):
    tools = [{"type": "function", "function": {"name": "get_heart_rate", "description": "read the sensor",
                                                  "parameters": {"type": "object", "properties": {}}}}]
    rows = [{"messages": [{"role": "user", "content": f"how is my heart {i}"},
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"type": "function", "function": {"name": "get_heart_rate", "arguments": {}}}]},
                          {"role": "tool", "name": "get_heart_rate", "content": str(60 + i)},
                          {"role": "assistant", "content": f"your heart rate is {60 + i}"}],
             "tools": json.dumps(tools)} for i in range(20)]
    result = prepared(tiny_tokenizer, tmp_path, stage="sft", dataset_name=str(write_jsonl(tmp_path / "t.jsonl", rows)))
    assert result.summary["shape"] == "messages" and len(result.train) == 12


def test_prepared_data_is_cached_and_reused(tiny_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    first = prepared(tiny_tokenizer, tmp_path, dataset_name=str(path))
    second = prepared(tiny_tokenizer, tmp_path, dataset_name=str(path))
    assert first.path == second.path
    path.write_text(path.read_text() + json.dumps(ROWS[0]) + "\n")  # the source changed: a new key
    assert prepared(tiny_tokenizer, tmp_path, dataset_name=str(path)).path != first.path


@pytest.mark.parametrize("content, message", [
    ("", "is empty: it needs one row per example"),
    ('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": \n', "line 2: not valid JSON"),
    ('{"prompt": "a", "answer": "b"}\n', "missing chosen, rejected; the data has prompt, answer"),
    ('{"prompt": "a", "chosen": 3, "rejected": "c"}\n' * 12, "row 1: 'chosen' must be text or a list of"),
    ('{"prompt": "a", "chosen": "same", "rejected": "same"}\n' * 12, "chosen identical to rejected: nothing to learn"),
])
def test_bad_data_is_named(content, message, tiny_tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as error:
        prepared(tiny_tokenizer, tmp_path, dataset_name=str(path))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_missing_path_and_unknown_mapped_column(tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        prepared(tiny_tokenizer, tmp_path, dataset_name=str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="--chosen_column good: no such column; the data has prompt, chosen, rejected"):
        prepared(tiny_tokenizer, tmp_path, dataset_name=str(write_jsonl(tmp_path / "p.jsonl", ROWS)),
                 chosen_column="good")


def test_identical_and_empty_pairs_are_dropped_and_counted(tiny_tokenizer, tmp_path):
    rows = [dict(row) for row in ROWS]
    rows[3]["rejected"] = rows[3]["chosen"]
    rows[5]["chosen"] = [{"role": "assistant", "content": "  "}]
    result = prepared(tiny_tokenizer, tmp_path, dataset_name=str(write_jsonl(tmp_path / "p.jsonl", rows)),
                      val_size=0, test_size=0)
    counts = result.summary["splits"]["train"]
    assert (counts["identical_pairs"], counts["empty_answers"], counts["kept"]) == (1, 1, 38)
    assert counts["first_identical_rows"] == [4] and counts["first_empty_rows"] == [6]


def test_long_prompts_are_counted_and_dropped(tiny_tokenizer, tmp_path):
    rows = [dict(row) for row in ROWS]
    rows[0] = dict(rows[0], prompt=[{"role": "user", "content": "what color is the sky " * 40}])
    result = prepared(tiny_tokenizer, tmp_path, dataset_name=str(write_jsonl(tmp_path / "p.jsonl", rows)),
                      val_size=0, test_size=0)
    assert result.summary["splits"]["train"]["dropped_prompt_too_long"] == 1
    assert len(result.train) == 39


def test_prepared_output_is_unchanged(tmp_path):
    """Every recognised shape, stage and option prepares to the same rows, ids, columns and counts as the list-based
    preparation did (digests recorded from it: tests/prepared_snapshots.py)."""
    from prepared_snapshots import DIGESTS, compute_all

    expected = json.loads(DIGESTS.read_text())
    computed = compute_all(tmp_path)
    assert computed == expected


def test_memory_does_not_grow_with_the_number_of_rows(tmp_path):
    """Peak RSS of preparing 12,000 generated UltraFeedback-shaped pairs stays within 50 MB of preparing 2,000, each
    in a fresh process. Rows held as Python lists (the old preparation) grew it by ~140 MB from 2,000 to 16,000."""
    import subprocess
    import sys

    from conftest import PROJECT_ROOT

    peaks = {}
    for rows in (2000, 12000):
        output = subprocess.run([sys.executable, str(PROJECT_ROOT / "tests" / "prepare_probe.py"), str(tmp_path),
                                 str(rows), "1"], capture_output=True, text=True, check=True)
        result = json.loads(output.stdout.strip().splitlines()[-1])
        assert result["kept"] >= rows - 200  # all but the held-out rows
        peaks[rows] = result["peak_mb"]
    assert peaks[12000] - peaks[2000] < 50, peaks


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssFile from /proc")
def test_kept_rows_are_written_without_keeping_the_tokenized_files_resident(tmp_path):
    """The kept rows go from the tokenized chunk files to the split's file in record batches read with plain reads,
    so the files' pages do not stay in this process's resident set. Filtering and `save_to_disk` through the memory
    map (the way before) left ~59 MB of this 64 MB file resident: at 200k pairs the peak grew to 1.6x the 50k one."""
    import re

    import pyarrow.compute  # noqa: F401  (its library is mapped before the measurement, not during it)
    from datasets import Dataset, Features, Value
    from datasets.arrow_writer import ArrowWriter

    from src.data.checks import KEPT, TOO_LONG
    from src.data.prepared import write_kept

    def resident_file_pages_mb() -> float:
        return int(re.search(r"RssFile:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024

    features = Features({"text": Value("string"), "_status": Value("int8")})
    with ArrowWriter(features=features, path=str(tmp_path / "chunk.arrow")) as writer:
        for start in range(0, 16384, 256):
            rows = range(start, start + 256)
            writer.write_batch({"text": [f"{i:06d}" + "x" * 4000 for i in rows],
                                "_status": [TOO_LONG if i % 3 == 0 else KEPT for i in rows]})
        writer.finalize()
    tokenized = Dataset.from_file(str(tmp_path / "chunk.arrow"))
    before = resident_file_pages_mb()
    write_kept([tokenized], ["text"], tmp_path / "train.arrow")
    grown = resident_file_pages_mb() - before
    kept = Dataset.from_file(str(tmp_path / "train.arrow"))
    assert kept.column_names == ["text"] and kept.features["text"] == Value("string")
    assert [int(text[:6]) for text in kept["text"]] == [i for i in range(16384) if i % 3]
    assert grown < 16, f"{grown:.0f} MB of the 64 MB tokenized file stayed resident"


def _base_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = None  # a base model's tokenizer
    return tokenizer


def test_a_base_model_is_told_which_flag_gives_it_a_chat_template(tiny_model, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": r["prompt"] + r["chosen"]} for r in ROWS])
    with pytest.raises(DataError, match="no chat template.*--chat_template_path"):
        prepared(_base_tokenizer(tiny_model), tmp_path, stage="sft", dataset_name=str(path))


def test_chat_template_path_a_jinja_file_or_a_tokenizer_directory(tiny_tokenizer, tiny_model, tmp_path):
    """Either form gives the base tokenizer the template: the prepared ids equal those of a tokenizer that had it, and a
    directory's extra special tokens are added to the tokenizer and to the model's embeddings (TRL's clone)."""
    from conftest import CHAT_TEMPLATE
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.models import apply_chat_template_path, apply_chat_template_to_model

    path = str(write_jsonl(tmp_path / "chat.jsonl", [{"messages": r["prompt"] + r["chosen"]} for r in ROWS]))
    reference = prepared(tiny_tokenizer, tmp_path / "ref", stage="sft", dataset_name=path)
    jinja = tmp_path / "template.jinja"
    jinja.write_text(CHAT_TEMPLATE)
    from_file = prepared(apply_chat_template_path(_base_tokenizer(tiny_model), str(jinja)), tmp_path / "file",
                         stage="sft", dataset_name=path)
    assert from_file.train["input_ids"] == reference.train["input_ids"]

    source = AutoTokenizer.from_pretrained(tiny_model)
    source.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    source.save_pretrained(tmp_path / "source")
    tokenizer = apply_chat_template_path(_base_tokenizer(tiny_model), str(tmp_path / "source"))
    assert "<|tool|>" in tokenizer.get_vocab() and tokenizer.chat_template == CHAT_TEMPLATE
    from_directory = prepared(tokenizer, tmp_path / "dir", stage="sft", dataset_name=path)
    assert from_directory.train["input_ids"] == reference.train["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    before = model.get_input_embeddings().weight.shape[0]
    model = apply_chat_template_to_model(model, tokenizer, str(tmp_path / "source"), "fp32", seed=0)
    assert model.get_input_embeddings().weight.shape[0] >= len(tokenizer) > before
    assert model.config.eos_token_id == tokenizer.eos_token_id


def test_a_mixture_of_two_shapes_takes_each_sources_fraction_and_records_it(tiny_tokenizer, tmp_path):
    from conftest import preference_rows

    explicit = write_jsonl(tmp_path / "explicit.jsonl", ROWS)
    orca = write_jsonl(tmp_path / "orca.jsonl", [SHAPES["orca"](row) | {"question": "orca " + _text(row["prompt"])}
                                                 for row in preference_rows(40, seed=1)])
    result = prepared(tiny_tokenizer, tmp_path, dataset_mixture=[{"name": str(explicit)},
                                                                 {"name": str(orca), "weight": 0.5}])
    sources = result.summary["sources"]
    assert [(s["shape"], s["rows_taken"]["train"]) for s in sources] == [("explicit_prompt", 32), ("orca", 16)]
    # Held-out rows are carved per source (4 + 4 each); the training rows of both are mixed with the seed.
    assert (len(result.train), len(result.validation), len(result.test)) == (48, 8, 8)
    assert result.summary["splits"]["train"]["kept"] == 48
    from_orca = [prompt[-1]["content"].startswith("orca ") for prompt in result.train["prompt"]]
    assert sum(from_orca) == 16 and from_orca.index(True) < 32  # mixed with the seed, not appended


def test_a_bad_row_in_a_mixture_names_its_source(tiny_tokenizer, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    bad_rows = [dict(row) for row in ROWS]
    bad_rows[2] = dict(bad_rows[2], chosen=7)
    bad = write_jsonl(tmp_path / "bad.jsonl", bad_rows)
    with pytest.raises(DataError, match=r"bad.jsonl row 3: 'chosen' must be text"):
        prepared(tiny_tokenizer, tmp_path, val_size=0, test_size=0,
                 dataset_mixture=[{"name": str(good)}, {"name": str(bad)}])


def run_prepare_probe(argv: list[str]) -> int:
    """tests/prepare_probe.py as its command line runs it, in a process forked from this one (tests/forked.py)."""
    import runpy
    import sys

    from conftest import PROJECT_ROOT

    sys.argv = [str(PROJECT_ROOT / "tests" / "prepare_probe.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


def test_a_killed_preparation_leaves_no_worker_and_the_same_command_prepares_the_same_rows(tmp_path):
    """`kill -9` of a one-process data preparation while its 2 pool workers tokenize (a seam: a worker kills it at its
    first batch): no worker is left 10 s later (pool workers outlive a killed parent unless they watch it), and the
    same command relaunched prepares the rows a preparation left alone does. The killed one is a fresh process (what
    its pool workers inherit is a real start's); the relaunch and the one left alone are forked (tests/forked.py):
    what they check is the rows prepared."""
    import os
    import subprocess
    import sys

    import forked
    from conftest import PROJECT_ROOT
    from src import seams
    from test_resilience import kill_tagged, seconds_until_gone

    killed, tag, log = tmp_path / "killed", f"{tmp_path}-preparation", tmp_path / "killed.log"
    try:
        with open(log, "w") as output:  # a file, not a pipe: a pipe would wait for any worker left holding it
            status = subprocess.run([sys.executable, str(PROJECT_ROOT / "tests" / "prepare_probe.py"),
                                     str(tmp_path / "run"), "3000", "2"], stdout=output, stderr=subprocess.STDOUT,
                                    env=os.environ | seams.env({}, kill_starter=f"preparation:{killed}", run_tag=tag),
                                    timeout=300).returncode
        assert status == -9 and killed.exists(), log.read_text()[-2000:]
        print(f"the preparation's pool workers ended {seconds_until_gone(tag):.1f} s after the kill")
    finally:
        kill_tagged(tag)
    relaunched, alone = (forked.run_main([str(tmp_path / workdir), "3000", num_proc], entry=run_prepare_probe,
                                         timeout=300) for workdir, num_proc in (("run", "2"), ("alone", "1")))
    assert relaunched.returncode == alone.returncode == 0, relaunched.stderr[-2000:] + alone.stderr[-2000:]
    first, second = (json.loads(result.stdout.strip().splitlines()[-1]) for result in (relaunched, alone))
    assert first["kept"] == second["kept"] == 2800 and first["train_digest"] == second["train_digest"]


def test_prompts_alone_are_recognised_and_prepared_for_rounds(tiny_tokenizer, tmp_path):
    """A `prompt` column with a `meta` and no answers: found without loading the data (jsonl, parquet, csv, a split
    directory, a mapped column), prepared as the ids generation sees (an empty or over-long prompt dropped and
    counted), held-out rows ready to answer with no dataset answer, and the audit's prompt numbers."""
    import datasets

    from src.data import PROMPTS, format_summary, prompts_only, sample_fields

    rows = [{"prompt": row["prompt"], "meta": {"answer": str(index)}} for index, row in enumerate(ROWS)]
    rows[5]["prompt"] = [{"role": "user", "content": " "}]  # empty: dropped
    rows[6]["prompt"] = [{"role": "user", "content": "x" * 80}]  # leaves no room for an answer in 64 tokens
    rows[7] = dict(rows[8])  # a repeated prompt
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    datasets.Dataset.from_list([{"question": "q", "meta": "m"}]).to_parquet(tmp_path / "asked.parquet")
    (tmp_path / "text.csv").write_text("prompt,meta\nwhat is 1 + 1?,2\n")
    write_jsonl(tmp_path / "split" / "train.jsonl", rows)
    assert prompts_only(DataArguments(dataset_name=str(path)))
    assert prompts_only(DataArguments(dataset_name=str(tmp_path / "text.csv")))
    assert prompts_only(DataArguments(dataset_name=str(tmp_path / "split")))
    import gzip  # a compressed file with a byte-order mark, and a folder of the Hub's shards: read as they come
    (tmp_path / "prompts.jsonl.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + path.read_bytes()))
    assert prompts_only(DataArguments(dataset_name=str(tmp_path / "prompts.jsonl.gz")))
    write_jsonl(tmp_path / "hub" / "data" / "train-00000-of-00002.jsonl", rows)
    assert prompts_only(DataArguments(dataset_name=str(tmp_path / "hub")))
    assert not prompts_only(DataArguments(dataset_name=str(tmp_path / "asked.parquet")))
    assert prompts_only(DataArguments(dataset_name=str(tmp_path / "asked.parquet"), prompt_column="question"))
    assert not prompts_only(DataArguments(dataset_name=str(write_jsonl(tmp_path / "pairs.jsonl", ROWS))))
    assert not prompts_only(DataArguments(dataset_name=str(tmp_path / "missing.jsonl")))  # check_source names it

    result = prepared(tiny_tokenizer, tmp_path, stage=PROMPTS, dataset_name=str(path), val_size=0, test_size=4)
    assert result.summary["shape"] == PROMPTS and result.validation is None
    train = result.summary["splits"]["train"]
    assert train["empty_answers"] + train["dropped_prompt_too_long"] == 2 and train["kept"] == 34
    first = result.train[0]
    assert first["prompt_ids"] == sample_fields(first, tiny_tokenizer)["sample_prompt_ids"] and first["meta"]
    held_out = result.test[0]
    assert held_out["sample_prompt_ids"] and held_out["sample_chosen"] is None and held_out["judge_prompt"]
    audit = result.summary["audit"]["train"]
    assert audit["duplicate_pairs"] == 1 and audit["prompt_tokens"]["median"] > 0 and "chosen_tokens" not in audit
    assert "prompts_in_train_share" in result.summary["audit"]["test"]
    assert "rows with an empty prompt dropped" in format_summary(result.summary)


def test_a_hub_dataset_of_prompts_is_recognised_from_its_card_or_its_rows(monkeypatch, tiny_tokenizer, tmp_path):
    """A Hub id (`org/math-prompts`): the features its card lists (no rows downloaded), else the rows themselves (the
    download the preparation reuses); pairs stay pairs; an unreachable Hub leaves the preparation to say why. Its
    prompts prepare for the rounds as a file's do."""
    import datasets

    from src.data import PROMPTS, prompts_only

    cards, downloads = {}, []

    class Builder:
        def __init__(self, name):
            self.info = datasets.DatasetInfo(features=cards[name])

    def load_dataset_builder(name, config=None):
        if name not in cards:
            raise ConnectionError("the Hub is unreachable")
        return Builder(name)

    def load_dataset(name, config=None):
        downloads.append(name)
        if name == "org/prompts-no-card":
            return datasets.DatasetDict({"train": datasets.Dataset.from_list(
                [{"problem": f"{index} + 1?", "meta": str(index + 1)} for index in range(24)])})
        raise ConnectionError("the Hub is unreachable")

    monkeypatch.setattr(datasets, "load_dataset_builder", load_dataset_builder)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    text = datasets.Value("string")
    cards["org/math-prompts"] = datasets.Features({"prompt": text, "meta": {"answer": text}})
    cards["org/pairs"] = datasets.Features({"prompt": text, "chosen": text, "rejected": text})
    cards["org/prompts-no-card"] = None
    assert prompts_only(DataArguments(dataset_name="org/math-prompts")) and downloads == []
    assert not prompts_only(DataArguments(dataset_name="org/pairs")) and downloads == []
    assert prompts_only(DataArguments(dataset_name="org/prompts-no-card", prompt_column="problem"))
    assert downloads == ["org/prompts-no-card"]
    assert not prompts_only(DataArguments(dataset_name="org/offline"))
    result = prepared(tiny_tokenizer, tmp_path, stage=PROMPTS, dataset_name="org/prompts-no-card",
                      prompt_column="problem", val_size=0, test_size=4)
    assert result.summary["shape"] == PROMPTS and len(result.train) == 20 and result.train[0]["meta"]
