"""check_gpu's memory plan against what each rank of a job actually holds under each engine (issue 49, point 4), and
docs/configuration.md's engine table against the plan and check_gpu's advice (point 7).

The plan's per-process weights, gradients and optimizer states for full fine-tuning (src/diagnostics/memory_plan.py
`engine_state`) are set against the tensors each rank holds after a backward and as the optimizer steps (fp32, as
the toolkit loads a model it fully fine-tunes; DeepSpeed's stages in bf16 too), measured by tests/memory_probe.py on 2
and 4 forked processes: plain DDP, DeepSpeed ZeRO-1/2/3 on gloo, and FSDP2 (torch's `fully_shard`, as src/engines.py's FSDP path runs it). The
model is shaped so that no single parameter is a large share of a rank's partition (16 narrow layers, a 64-token
vocabulary): ZeRO-1/2 keep whole the gradient of a parameter that crosses a partition's edge, which the plan leaves out.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import forked
import memory_probe
from conftest import PROJECT_ROOT
from src.diagnostics.inputs import TrainingSetup
from src.diagnostics.memory_plan import GIB, engine_state, plan_memory
from src.diagnostics.model_shape import shape_from_model, shape_from_param_count
from src.diagnostics.problems.machine import gib
from src.diagnostics.problems.run_request import memory_fit

pytest.importorskip("deepspeed")

# DeepSpeed's stages also in bf16 (its own mixed precision: 16-bit weights and gradients, fp32 master and states)
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "zero1_bf16", "zero2_bf16", "zero3_bf16")
METHOD = {"ddp": "full", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp": "fsdp"}


def plan_for(strategy: str, shape, nproc: int):
    engine, _, precision = strategy.partition("_")
    return engine_state(METHOD[engine], shape, nproc, 2 if precision == "bf16" else 4)
PARTS = ("weights", "gradients", "optimizer")


@pytest.fixture(scope="module")
def narrow_model(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("narrow_model")
    LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=16, num_attention_heads=4,
                num_key_value_heads=4, tie_word_embeddings=False).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("nproc", [2, 4])
def test_each_rank_holds_the_weights_gradients_and_optimizer_states_the_plan_says(narrow_model, tmp_path, nproc):
    """Within 15% per rank and part, and the plan's ratios between engines (model state per rank against DDP's)
    hold on the same processes. The gathered working set of ZeRO-3 / FSDP exists only while a layer runs: not here.
    bf16 on 2 processes only: its terms shrink with N as the fp32 ones do (4 processes on 2 cores cost twice as much)."""
    shape = shape_from_model(str(narrow_model))
    strategies = STRATEGIES if nproc == 2 else tuple(name for name in STRATEGIES if "_" not in name)
    result = forked.run_job(nproc, [str(narrow_model), str(tmp_path), *strategies], entry=memory_probe.entry,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(nproc)]
    planned = {strategy: plan_for(strategy, shape, nproc) for strategy in strategies}
    for strategy in strategies:
        for rank, held in enumerate(ranks):
            for part in PARTS:
                assert held[strategy][part] == pytest.approx(getattr(planned[strategy], part), rel=0.15), (
                    strategy, rank, part, held[strategy], planned[strategy])
    held_state = {strategy: max(sum(held[strategy].values()) for held in ranks) for strategy in strategies}
    planned_state = {strategy: sum(getattr(planned[strategy], part) for part in PARTS) for strategy in strategies}
    for strategy in strategies:
        assert held_state[strategy] / held_state["ddp"] == pytest.approx(
            planned_state[strategy] / planned_state["ddp"], rel=0.15), strategy


# docs/configuration.md's engine table: its first cell per row, and the plan's method whose number it quotes
DOC_ROWS = {"DDP (default)": "full", "ZeRO-1, ZeRO-2": "zero2", "ZeRO-3": "zero3", "FSDP2": "fsdp"}


def test_the_docs_engine_table_quotes_the_plan_and_check_gpus_advice_names_the_same_numbers():
    """The table's last column (a 7B model, Llama-2-7B's shape, on 8 GPUs of 80 GiB, bf16) is the plan's model state
    per GPU for each engine; a full fine-tune that does not fit there gets check_gpu's does_not_fit advice naming each
    engine that fits with that same number and its command."""
    shape = shape_from_param_count(7_000_000_000)
    setup = TrainingSetup(stage="sft", method_chosen=True, max_length=2048, per_device_batch_size=1,
                          gradient_checkpointing=True, precision="bf16")
    plan = plan_memory(shape, setup, num_devices=8, device_kind="gpu", budget_bytes=80 * GIB, budget_source="test",
                       deepspeed_installed=True)
    estimates = {estimate.method: estimate for estimate in plan.estimates}
    doc = (PROJECT_ROOT / "docs" / "configuration.md").read_text()
    quoted = {cells[1].strip(): cells[-2].strip() for cells in (line.split("|") for line in doc.splitlines())
              if len(cells) > 2 and cells[1].strip() in DOC_ROWS}
    assert quoted == {row: gib(estimates[method].model_state_bytes) for row, method in DOC_ROWS.items()}
    assert estimates["zero1"].model_state_bytes == estimates["zero2"].model_state_bytes
    (problem,) = memory_fit(SimpleNamespace(memory_plan=plan, launch_gpus=[0]))
    for row, method in DOC_ROWS.items():
        if method != "full":
            assert f"{estimates[method].label} ({quoted[row]} of model state per GPU" in problem.fix, (row, problem.fix)
            assert f"STRATEGY={method} ./run_distributed.sh" in problem.fix
