"""Loading under FSDP2 and ZeRO-3 a share at a time (src/sharded_weights.py, src/engines.py `share`): in a forked
2-process job with accelerate launch's environment for each engine (tests/engine_launch.py), each rank reads and holds
only its share of every weight, and the weights that arrive, gathered, are bit for bit a whole load's: a causal LM
from an fp32 checkpoint and from a bf16 one saved as sharded safetensors files with an index (the Hub's layout), and a
reward model whose new score head the checkpoint lacks (drawn as a whole load draws it, from the same seed); and each
model written whole again by rank 0 a tensor at a time (src/sharded_weights.py `save_whole`, the bf16 one into shards
with an index) reads back as the same weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import forked
from engine_launch import accelerate_environment

pytest.importorskip("deepspeed")


def load_entry(argv: list[str]) -> int:
    """One rank: load each model as the toolkit loads it (src/models.py `load_model`), then write what this rank held
    after the load and, on rank 0, every weight gathered whole next to a whole load's."""
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, set_seed

    from src.config import ModelArguments
    from src.engines import gathered, share
    from src.models import load_model
    from src.world import World

    from src import sharded_weights

    out_dir, *paths = argv
    dist.init_process_group("gloo")
    read = {"elements": 0}
    checkpoint_read = sharded_weights.Checkpoint.read

    def counted(checkpoint, key, block):  # what this rank read of the checkpoint
        piece = checkpoint_read(checkpoint, key, block)
        read["elements"] += piece.numel()
        return piece

    sharded_weights.Checkpoint.read = counted
    world = World.from_environment()
    plan = SimpleNamespace(device="cpu", precision="fp32")
    results = {}
    for label, path in [(f"causal{index}", path) for index, path in enumerate(paths)] + [("reward", paths[0])]:
        reward = label == "reward"
        set_seed(0)
        read["elements"] = 0
        model = load_model(path, ModelArguments(model_name_or_path=path), plan, world,
                           reward_pad_token_id=0 if reward else None)
        held = sum(share(parameter)[0].numel() for parameter in model.parameters())
        differing = []
        if world.is_main:
            set_seed(0)
            whole_class = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
            whole_model = whole_class.from_pretrained(path, dtype=torch.float32, **(
                {"num_labels": 1, "pad_token_id": 0} if reward else {}))
            whole = whole_model.state_dict()
        for name, parameter in model.named_parameters():
            with gathered([parameter]):
                value = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter.data
                if world.is_main and not torch.equal(value, whole[name]):
                    differing.append(name)
        # the model written whole again, rank 0 a tensor at a time (the bf16 one split into shards with an index), and
        # read back by from_pretrained
        saved = Path(out_dir, f"saved_{label}")
        sharded_weights.MAX_SHARD_SIZE = "20KB" if label == "causal1" else "50GB"
        sharded_weights.save_whole(model, saved, world.is_main)
        dist.barrier()
        if world.is_main:
            reread = whole_class.from_pretrained(saved, dtype=torch.float32).state_dict()
            differing += [f"saved {name}" for name, value in whole.items() if not torch.equal(reread[name], value)]
            differing += ["no index"] if label == "causal1" and not (saved / "model.safetensors.index.json").exists() \
                else []
        results[label] = {"held": held, "read": read["elements"], "whole": sum(parameter.numel() for parameter in whole_model.parameters())
                          if world.is_main else None, "differing": differing, "sharded": type(model.get_input_embeddings().weight
                                                                               ).__name__}
    Path(out_dir, f"rank{world.rank}.json").write_text(json.dumps(results))
    dist.barrier()
    return 0


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory) -> list[Path]:
    """The tiny model (fp32, one file, tied embeddings) and a bf16 copy of it split into shards with an index."""
    import torch
    from transformers import AutoModelForCausalLM

    split = tmp_path_factory.mktemp("split")
    AutoModelForCausalLM.from_pretrained(tiny_model).to(torch.bfloat16).save_pretrained(split, max_shard_size="20KB")
    assert (split / "model.safetensors.index.json").exists()
    return [tiny_model, split]


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_each_rank_reads_and_holds_its_share_and_the_weights_are_a_whole_loads(strategy, checkpoints, tmp_path):
    environment = accelerate_environment(strategy) | {"OMP_NUM_THREADS": "1"}
    result = forked.run_job(2, [str(tmp_path), *map(str, checkpoints)], env=environment, entry=load_entry)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert "loads whole" not in result.stdout
    for label, rank0 in ranks[0].items():
        assert rank0["differing"] == [], (strategy, label)
        # each rank its half: a weight of odd size (a norm, a row count) is split one element or row apart
        held = [rank[label]["held"] for rank in ranks]
        assert sum(held) == rank0["whole"] and abs(held[0] - held[1]) <= 64, (label, held)
        # and read no more than it holds, but for the score head a reward model draws, and under ZeRO-3 the rows that
        # cover its flat partition: at most one row more per weight (32 wide)
        for rank in ranks:
            assert rank[label]["held"] - 32 <= rank[label]["read"] <= rank[label]["held"] + 32 * 20, (label, rank)
        assert rank0["sharded"] == ("DTensor" if strategy == "fsdp" else "Parameter"), label
