"""check_gpu.py for real on this machine: the command line end to end (CPU path, --json, --bench on gloo), bad input,
a model measured from its config on the meta device, and the bench's hard timeout killing the whole process group.

The development and CI machines have no GPU; where a check only holds on the CPU path it says so.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from check_gpu import main
from src.diagnostics.bandwidth import BenchRequest, run_attempt
from src.diagnostics.inputs import InputError
from src.diagnostics.model_shape import shape_from_model

from fakes.machines import SCRIPTED_WORKER

REPOSITORY = Path(__file__).resolve().parents[1]
SECTIONS = ["SOFTWARE", "SYSTEM", "DRIVER AND GPUS", "MEMORY PLAN", "BANDWIDTH", "PROBLEMS", "VERDICT"]


def run_cli(*arguments, environ=None):
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "check_gpu.py", *arguments],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(environ or {})},
    )
    return completed, time.monotonic() - started


@pytest.fixture(scope="module")
def bench_report():
    """One real run of `check_gpu.py --json --bench`, shared by the tests that read it."""
    completed, _seconds = run_cli("--json", "--bench")
    assert "Traceback" not in completed.stderr, completed.stderr
    report = json.loads(completed.stdout)
    assert completed.returncode == report["exit_code"]
    return report


def test_plain_run_prints_every_section_and_the_command():
    completed, _seconds = run_cli()
    assert "Traceback" not in completed.stderr, completed.stderr
    text = completed.stdout
    positions = [text.index(f"\n{section}") if section != "SOFTWARE" else text.index(section) for section in SECTIONS]
    assert positions == sorted(positions)
    assert f"(exit {completed.returncode})" in text.splitlines()[-3] or f"(exit {completed.returncode})" in text
    assert completed.returncode in (0, 1, 2)
    if "No NVIDIA GPU" in text:  # this machine: the CPU path
        assert completed.returncode == 1
        assert "VERDICT: READY WITH WARNINGS (exit 1)\n  run: ./run_distributed.sh " in text
        assert "each process needs at least one core" in text


def test_json_holds_the_same_report(bench_report):
    assert set(bench_report) >= {"software", "system", "gpus", "topology", "memory_plan", "bench", "problems", "verdict", "command"}
    assert all(set(problem) >= {"severity", "what", "fix"} for problem in bench_report["problems"])
    assert bench_report["software"]["gloo"] is True
    if bench_report["launch"]["device"] == "cpu":
        assert bench_report["gpus"] == [] and bench_report["topology"] is None
        assert bench_report["command"].startswith("./run_distributed.sh ")


def test_bench_on_gloo_is_measured_and_checked(bench_report):
    bench = bench_report["bench"]
    if bench_report["launch"]["device"] != "cpu":
        pytest.fail("this test describes the CPU path; on a GPU machine see test_check_gpu.py's bench tests")
    assert (bench["backend"], bench["nprocs"], bench["outcome"]) == ("gloo", 2, "ok")
    points = bench["attempts"][0]["points"]
    assert [point["size_bytes"] for point in points] == [64 << 10, 1 << 20, 16 << 20]
    for point in points:
        assert point["correct"] and point["algbw_gbps"] > 0
        assert point["busbw_gbps"] == pytest.approx(point["algbw_gbps"] * 2 * (2 - 1) / 2)
        assert point["algbw_gbps"] == pytest.approx(point["size_bytes"] / point["seconds_per_iteration"] / 1e9)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--params", "abc"], "--params 'abc': write a count such as 7e9"),
        # the launcher's own recipe reader and messages (src/config.py)
        (["--config", "configs/no-such-recipe.yaml"], "--config: configs/no-such-recipe.yaml does not exist"),
        (["--model_name_or_path", "./no/such/model"], "--model_name_or_path ./no/such/model: no such model directory"),
        (["--model", "x", "--params", "7e9"], "--model and --params both given"),
        (["--num_procs", "0"], "--num_procs 0"),
        (["--bogus"], "--bogus: unknown key 'bogus'"),
        (["--batch_size", "0"], "--batch_size must be a positive whole number, got 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_3(arguments, message):
    completed, _seconds = run_cli(*arguments)
    assert completed.returncode == 3
    assert message in completed.stderr and "Traceback" not in completed.stderr
    assert completed.stdout == ""


def test_recipe_model_that_cannot_be_found_names_the_recipe(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: ./checkpoints/gone\n")
    completed, _seconds = run_cli("--config", str(recipe))
    assert completed.returncode == 3
    assert f"model_name_or_path ./checkpoints/gone in {recipe}: no such model directory" in completed.stderr


def test_unreachable_hub_id_fails_fast_and_suggests_params(tmp_path):
    completed, _seconds = run_cli("--model_name_or_path", "prefkit-tests/no-such-model", environ={"HF_HOME": str(tmp_path)})
    assert completed.returncode == 3 and "Traceback" not in completed.stderr
    assert "--model_name_or_path prefkit-tests/no-such-model" in completed.stderr and "--params" in completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1
    # the check before the Hub client (which alone would retry for about half a minute) answered: its words, not a
    # wall-clock bound, which a loaded machine breaks (56 s seen under load 14)
    assert "not in the local Hugging Face cache and the Hub is unreachable" in completed.stderr


@pytest.fixture(scope="module")
def tiny_model_directory(tmp_path_factory):
    """A Llama config (no weights): hidden 64, 2 layers, 4 heads with 2 key/value heads (head 16), vocab 128."""
    from transformers import LlamaConfig

    directory = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=False,
    ).save_pretrained(directory)
    return directory


def test_model_is_measured_from_its_config(tiny_model_directory):
    """Per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288, MLP 3 * 64*128 = 24576, two norms 128 -> 36992.
    Two layers 73984, embeddings and untied lm_head 2 * 128*64 = 16384, final norm 64: 90432 parameters."""
    shape = shape_from_model(str(tiny_model_directory))
    assert (shape.total_params, shape.num_layers, shape.hidden_size, shape.kv_size) == (90432, 2, 64, 32)
    assert (shape.embedding_params, shape.largest_layer_params, len(shape.linear_layers)) == (16384, 36992, 14)
    assert shape.exact


def test_tied_embeddings_are_counted_once(tmp_path):
    """The same model with the output layer tied to the embeddings: 90432 - 128*64 = 82240 parameters."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    shape = shape_from_model(str(tmp_path))
    assert (shape.total_params, shape.embedding_params) == (82240, 8192)


def test_unreadable_config_is_bad_input(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(InputError, match="transformers cannot read its config"):
        shape_from_model(str(tmp_path))


def test_model_directory_through_the_command_line(tiny_model_directory, capsys):
    """LoRA r=8 on all linear layers, per layer: q 8*(64+64) + k 8*(64+32) + v 8*96 + o 8*128 + gate, up, down
    3 * 8*(64+128) = 1024 + 768 + 768 + 1024 + 4608 = 8192; two layers 16384."""
    exit_code = main(["--json", "--model_name_or_path", str(tiny_model_directory), "--use_lora", "--stage", "sft",
                      "--max_length", "256"])
    report = json.loads(capsys.readouterr().out)
    assert exit_code == report["exit_code"]
    plan = report["memory_plan"]
    assert plan["model"]["total_params"] == 90432 and plan["stage"] == "sft" and plan["max_length"] == 256
    assert plan["lora_r"] == 16 and plan["lora_trainable_params"] == 16384 * 2  # r=16 is twice r=8
    chosen = [estimate for estimate in plan["estimates"] if estimate["chosen"]]
    assert [estimate["method"] for estimate in chosen] == ["lora"] and chosen[0]["fits"]
    assert report["command"].endswith(f"--model_name_or_path {tiny_model_directory} --use_lora --stage sft --max_length 256")


def test_bench_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    environ = {**os.environ, "FAKE_BENCH_BEHAVIOUR": "hang_with_child", "FAKE_BENCH_CHILD_PID_FILE": str(pid_file)}
    request = BenchRequest("nccl", 2, environ, timeout_s=1.5, sizes=(1 << 20,))
    attempt = run_attempt(request, p2p_disabled=False, worker_command=(sys.executable, str(SCRIPTED_WORKER)))
    assert attempt.status == "timeout" and "killed" in attempt.error
    child_pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child_pid):
        time.sleep(0.05)
    assert not _alive(child_pid), "the worker's own child survived the timeout"


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a parent that may never reap it in a container."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_launch_line_checks_to_the_plan_the_launchers_dry_run_prints(tiny_model, tmp_path, capsys):
    """`./run_distributed.sh 2 --config <shipped recipe> --batch_size 48 --use_lora ...`: the preflight the launcher
    runs (`python -m src.main_distributed --dry_run` with the world size of 2 processes, as run_distributed.sh sets
    it) prints the same batch and learning-rate rows as `check_gpu.py --num_procs 2 <same flags>` resolves. Global 48
    over 2 = 24 per process, under the recipe's micro_batch_size 8: 8 per device x 3 accumulation."""
    from dataclasses import replace

    from conftest import preference_rows, write_jsonl
    from fakes.machines import cpu_only, fake_sources
    from src.plan import Plan, format_plan
    from src.diagnostics.model_shape import shape_from_param_count

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    launch = ["--config", "configs/dpo_qwen2.5-0.5b_ultrafeedback.yaml", "--batch_size", "48", "--use_lora",
              "--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--val_size", "0.1",
              "--test_size", "0.1", "--results_dir", str(tmp_path / "results")]
    environ = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    dry_run = subprocess.run([sys.executable, "-m", "src.main_distributed", "--dry_run", *launch], cwd=REPOSITORY,
                             capture_output=True, text=True, timeout=300, env=environ)
    assert dry_run.returncode == 0, dry_run.stderr[-2000:]

    sources = replace(fake_sources(cpu_only()), model_shape=lambda name, subject: shape_from_param_count(1_000_000))
    assert main(["--json", "--num_procs", "2", *launch], sources) in (0, 1, 2)
    report = json.loads(capsys.readouterr().out)
    checked = format_plan(Plan(**report["plan"]["dpo"])).splitlines()
    rows = [line for line in checked if line.strip().startswith(("batch", "learning rate", "precision", "processes"))]
    assert len(rows) == 4 and all(row in dry_run.stdout.splitlines() for row in rows), (rows, dry_run.stdout)
    assert "8 per device x 3 accumulation x 2 processes = 48 global" in rows[1]


def test_a_max_length_past_a_rotary_models_context_is_a_warning(tiny_model_directory, capsys):
    """The Llama config's rotary positions are made for 2048 tokens (max_position_embeddings): --max_length 4096 runs
    on positions it never saw, which the launcher says at the stage's start and check_gpu before the launch."""
    from dataclasses import replace

    from fakes.machines import fake_sources, h100_nvswitch

    shape = shape_from_model(str(tiny_model_directory))
    assert (shape.context_tokens, shape.context_source) == (2048, "max_position_embeddings 2048")
    sources = replace(fake_sources(h100_nvswitch()), model_shape=lambda name, subject: shape)
    for max_length, warned in (("4096", True), ("2048", False)):
        main(["--json", "--num_procs", "1", "--model_name_or_path", "tiny", "--max_length", max_length], sources)
        report = json.loads(capsys.readouterr().out)
        found = [problem for problem in report["problems"] if problem["code"] == "past_context"]
        assert bool(found) == warned, report["problems"]
        if warned:
            assert f"max_length 4096 is past {shape.name}'s context of 2048 tokens" in found[0]["what"]
            assert found[0]["severity"] == "warning" and "--max_length 2048" in found[0]["fix"]
