import os, sys
from pathlib import Path
import forked, rank_probe
from conftest import preference_rows, write_jsonl
from engine_launch import accelerate_environment
from test_training import common_args

def test_debug(tiny_model, tmp_path):
    strategy = os.environ.get("DBG_STRATEGY", "fsdp")
    stage = os.environ.get("DBG_STAGE", "dpo")
    extra = os.environ.get("DBG_ARGS", "").split()
    if stage == "sft":
        rows = [{"messages": row["prompt"] + row["chosen"]} for row in preference_rows(48)]
        data = write_jsonl(tmp_path / "chat.jsonl", rows)
    else:
        data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(48))
    args = common_args(tiny_model, data, tmp_path / "results", "dbg", stage) + [
        "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e-3", "--save_steps", "2", *extra]
    env = (accelerate_environment(strategy) if strategy != "ddp" else dict(os.environ)) | {"OMP_NUM_THREADS": "1"}
    result = forked.run_job(2, [str(tmp_path / "probe"), *args], env=env, entry=rank_probe.entry)
    Path("/tmp/sl62/dbg.out").write_text(result.stdout + "\n=====STDERR=====\n" + result.stderr)
    assert result.returncode == 0
