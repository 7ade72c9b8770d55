"""Shared fixtures: an offline, isolated environment and tiny models built locally (no Hub on this machine)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_ROOT))

from src.resource_limits import threads_per_process, usable_cores  # noqa: E402

# The cores shared out between the xdist workers (pytest.ini: one per core), for each worker's own torch and, through
# the environment, the processes its tests start: torch's OpenMP threads spin while they wait, so two workers of 2
# threads each on 2 cores spent ~40% of their time waiting for each other (measured: test_packed_dpo.py beside
# test_packed_support.py took 67.7 s with 2 threads each, 38.6 s with 1). A value you set yourself wins; the launcher
# and the tests that pin OMP_NUM_THREADS for a job keep theirs.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(_WORKERS)))
if "torch" in sys.modules:  # imported before this file by a plugin: its thread pool is sized already
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>{{ message['content'] }}{{ '\\n' }}"
    "{%- elif message['role'] == 'user' -%}<|user|>{{ message['content'] }}{{ '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{% generation %}{{ message['content'] }}<|end|>"
    "{% endgeneration %}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
WORDS = ("the sky is blue green red yellow sun moon sea river cat dog bird fish tree leaf happy sad fast slow "
         "what color where is in the question answer yes no one two three four five hello world").split()


@pytest.fixture(autouse=True, scope="session")
def offline_environment(tmp_path_factory):
    """No Hub, and every cache in a temporary directory, for this process and the ones it starts."""
    home = tmp_path_factory.mktemp("hf_home")
    values = {
        "HF_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PREFKIT_CACHE": str(tmp_path_factory.mktemp("prefkit_cache")),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
    }
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    yield values
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def build_tiny_tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|unk|>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|pad|>", eos_token="<|end|>",
                                      unk_token="<|unk|>",
                                      additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


# Real chat templates (tests/chat_templates/, copied from the models' tokenizer_config.json) and the special tokens of
# them all, for a tokenizer that renders any of them.
TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
TEMPLATE_SPECIALS = ["<|pad|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                     "<｜tool▁output▁end｜>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                     "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                     "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


def build_template_tokenizer(corpus: list[str], template: str | None = None):
    """A byte-level BPE tokenizer that knows every template's special tokens (the ids differ from the real models',
    the boundary between prompt and answer does not); <think> and </think> are added tokens that decoding keeps.
    `template`: a file of TEMPLATES (without .jinja) to set as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=TEMPLATE_SPECIALS,
                                                          show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<|pad|>", bos_token="<｜begin▁of▁sentence｜>",
                                      eos_token="<｜end▁of▁sentence｜>")
    wrapped.add_tokens(["<think>", "</think>"])  # added, not special, as in DeepSeek-R1's and Qwen3's tokenizers
    if template:
        wrapped.chat_template = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    return wrapped


def build_tiny_model(path: Path, corpus: list[str], seed: int = 0, template: str | None = None) -> Path:
    """A 2-layer, 32-wide Llama with a BPE tokenizer trained on `corpus`, saved (and reloadable) at `path`;
    `template`: a real chat template of TEMPLATES (and its special tokens) instead of the toolkit's tiny one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_template_tokenizer(corpus, template) if template else build_tiny_tokenizer(corpus)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return save_seeded(LlamaForCausalLM, config, tokenizer, tokenizer, path, seed)


def save_seeded(model_class, config, tokenizer, saved_with, path: Path, seed: int) -> Path:
    """A model of `config` drawn from `seed`, generating to the tokenizer's EOS, saved at `path` with `saved_with` (the
    tokenizer, or a vision model's processor)."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    saved_with.save_pretrained(path)
    return path


def preference_rows(count: int, seed: int = 0) -> list[dict]:
    """Toy conversational preference pairs: the chosen answer names the colour asked about."""
    import random

    rng = random.Random(seed)
    colours = ["blue", "green", "red", "yellow"]
    things = ["sky", "sea", "leaf", "sun", "moon", "river", "tree", "fish"]
    rows = []
    for index in range(count):
        thing, colour = things[index % len(things)], rng.choice(colours)
        wrong = rng.choice([c for c in colours if c != colour])
        rows.append({
            "prompt": [{"role": "user", "content": f"what color is the {thing} {index}"}],
            "chosen": [{"role": "assistant", "content": f"the {thing} is {colour}"}],
            "rejected": [{"role": "assistant", "content": f"the {thing} is {wrong} no"}],
        })
    return rows


def thinking_rows(count: int, seed: int = 0) -> list[dict]:
    """preference_rows as a reasoning model writes them (DeepSeek-R1's shape): each answer reasons inside
    <think>…</think> first, then gives the final answer."""
    rows = preference_rows(count, seed)
    for row in rows:
        thing = row["prompt"][0]["content"].split()[-2]
        for side, thought in (("chosen", f"look at the {thing} it is happy"), ("rejected", "a fast guess")):
            row[side][0]["content"] = f"<think>\n{thought}\n</think>\n\n{row[side][0]['content']}"
    return rows


def plant(monkeypatch, **planted) -> None:
    """Test seams planted in this process for one test (src/seams.py; a process it starts inherits them)."""
    from src import seams

    monkeypatch.setenv(seams.VARIABLE, seams.env(**planted)[seams.VARIABLE])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def tiny_corpus() -> list[str]:
    """The tiny tokenizer's training text: the toy vocabulary and every text of 64 preference pairs."""
    texts = [" ".join(WORDS)]
    for row in preference_rows(64):
        texts += [row["prompt"][0]["content"], row["chosen"][0]["content"], row["rejected"][0]["content"]]
    return texts


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return tiny_corpus()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, corpus) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), corpus)


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory, corpus) -> Path:
    """tiny_model's shape with DeepSeek-R1-Distill's chat template: its generation prompt opens <think>."""
    return build_tiny_model(tmp_path_factory.mktemp("thinking_model"), corpus, template="deepseek-r1-distill")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def preference_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "pairs.jsonl", preference_rows(48))


def pytest_configure(config):
    # torch.jit's own deprecation of script_method fires on every import of transformers' models: noise, not ours.
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; deselected unless asked for (python -m pytest -m gpu)")
    config.addinivalue_line("markers", "soak: a long run (15+ minutes) watched for growth; deselected unless asked "
                                       "for (python -m pytest -n 0 -m soak)")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest.ini): one worker per core this process may use, at most 4 (tests start processes too)."""
    return min(4, usable_cores())


# The files that cost the most, longest first: the xdist workers (pytest.ini) take files in collection order, so
# the long ones start at once and the short ones (every file not listed: under ~20 CPU-s each) fill the gaps, instead
# of one long file starting last and running alone. Order by each file's cost alone: `OMP_NUM_THREADS=1 /usr/bin/time
# python -m pytest -q -n 0 tests/FILE` (user + system, its processes included), plus what it waits idle (the lost
# node's --node_timeout, the hang tests' timeouts). Measured 2026-11-27 (CPU-s): two_hosts 117 (+20 idle), resilience
# 90, engines 70, disk_space 55, rounds 51, data 45, memory_plan_engines 41, training 35, tools 34, trackers 33,
# hang_watch 23 (+10 idle), cli 30, reference_cache 28, run_lock 27, launchers 26, check_gpu_cli 26, finished_run 24,
# live_report 23, packed_support 22, grpo 22. A file that grows past ~20 CPU-s goes in by its cost.
LONG_FILES = ("test_two_hosts.py", "test_resilience.py", "test_engines.py", "test_disk_space.py", "test_rounds.py",
              "test_data.py", "test_memory_plan_engines.py", "test_training.py", "test_tools.py", "test_trackers.py",
              "test_hang_watch.py", "test_cli.py", "test_reference_cache.py", "test_run_lock.py", "test_launchers.py",
              "test_check_gpu_cli.py", "test_finished_run.py", "test_live_report.py", "test_packed_support.py",
              "test_grpo.py")


# Tests that run only when a -m expression names their marker: a plain `pytest` (and CI) deselects them.
OPT_IN_MARKERS = ("gpu", "soak")


def pytest_collection_modifyitems(config, items):
    """Long files first (LONG_FILES); GPU and soak tests run only when a -m expression names them (`-m gpu`,
    `-m soak`), a plain `pytest` deselects them."""
    rank = {name: number for number, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: each file keeps its own order
    wanted = config.option.markexpr or ""
    opted_out = [marker for marker in OPT_IN_MARKERS if marker not in wanted]
    deselected = [item for item in items if any(item.get_closest_marker(marker) for marker in opted_out)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, corpus) -> Path:
    """A tiny LLaVA (CLIP tower + Llama) with its processor, built offline (tests/tiny_vlms.py)."""
    from tiny_vlms import build_llava

    return build_llava(tmp_path_factory.mktemp("tiny_llava"), corpus)
