"""Loading under FSDP2 and ZeRO-3 a share at a time (src/sharded_weights.py, src/engines.py `share`): in a forked
2-process job with accelerate launch's environment for each engine (tests/engine_launch.py), each rank reads and holds
only its share of every weight, and the weights that arrive, gathered, are bit for bit a whole load's: a causal LM
from an fp32 checkpoint and from a bf16 one saved as sharded safetensors files with an index (the Hub's layout), and a
reward model whose new score head the checkpoint lacks (drawn as a whole load draws it, from the same seed); and each
model written whole again by rank 0 a tensor at a time (src/sharded_weights.py `save_whole`, the bf16 one into shards
with an index: under FSDP2 each weight gathered to rank 0 alone) reads back as the same weights."""

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

    from torch.distributed.tensor import DTensor
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
        gathers = {"to_every_rank": 0}  # FSDP2's all-gathers of a whole weight to every rank while it saves
        full_tensor = DTensor.full_tensor
        DTensor.full_tensor = lambda tensor, *args, **kwargs: gathers.__setitem__(
            "to_every_rank", gathers["to_every_rank"] + 1) or full_tensor(tensor, *args, **kwargs)
        sharded_weights.save_whole(model, saved, world.is_main)
        DTensor.full_tensor = full_tensor
        dist.barrier()
        if world.is_main:
            reread = whole_class.from_pretrained(saved, dtype=torch.float32).state_dict()
            differing += [f"saved {name}" for name, value in whole.items() if not torch.equal(reread[name], value)]
            differing += ["no index"] if label == "causal1" and not (saved / "model.safetensors.index.json").exists() \
                else []
        results[label] = {"gathers_to_every_rank": gathers["to_every_rank"], "held": held, "read": read["elements"], "whole": sum(parameter.numel() for parameter in whole_model.parameters())
                          if world.is_main else None, "differing": differing, "sharded": type(model.get_input_embeddings().weight
                                                                               ).__name__}
    Path(out_dir, f"rank{world.rank}.json").write_text(json.dumps(results))
    dist.barrier()
    return 0


def resize_entry(argv: list[str]) -> int:
    """One rank under FSDP2: each model loaded as a stage with --chat_template_path from another tokenizer loads it
    (src/pipeline/training.py `with_chat_template`: built at the template's vocabulary as it loads sharded, then TRL's
    clone_chat_template), what this rank held and read, and on rank 0 every weight gathered next to a whole load's
    resized by clone_chat_template (src/models.py `apply_chat_template_to_model`)."""
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from src import sharded_weights
    from src.config import ModelArguments
    from src.engines import share
    from src.models import apply_chat_template_path, apply_chat_template_to_model, load_model, load_tokenizer
    from src.models import resized_vocabulary
    from src.world import World

    out_dir, template, *paths = argv
    dist.init_process_group("gloo")
    read = {"elements": 0}
    checkpoint_read = sharded_weights.Checkpoint.read
    sharded_weights.Checkpoint.read = lambda checkpoint, key, block: read.__setitem__("elements", read["elements"] + (
        piece := checkpoint_read(checkpoint, key, block)).numel()) or piece
    world = World.from_environment()
    plan = SimpleNamespace(device="cpu", precision="fp32")
    results = {}
    for index, path in enumerate(paths):
        tokenizer = apply_chat_template_path(load_tokenizer(path), template)
        rows = resized_vocabulary(tokenizer, template)
        read["elements"] = 0
        model = load_model(path, ModelArguments(model_name_or_path=path), plan, world, resize=(rows, 7))
        loaded_read = read["elements"]
        model = apply_chat_template_to_model(model, tokenizer, template, "fp32", 7)
        differing = []
        if world.is_main:
            whole = apply_chat_template_to_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                                 apply_chat_template_path(load_tokenizer(path), template), template,
                                                 "fp32", 7)
            old_rows = AutoModelForCausalLM.from_pretrained(path).get_input_embeddings().weight.shape[0]
            expected = whole.state_dict()
        for name, parameter in model.named_parameters():
            value = parameter.full_tensor()
            if world.is_main and not torch.equal(value, expected[name]):
                differing.append(name)
        results[f"model{index}"] = {
            "rows": rows, "config_rows": model.config.vocab_size, "held": sum(share(p)[0].numel() for p in
                                                                            model.parameters()),
            "read": loaded_read, "whole": sum(p.numel() for p in whole.parameters()) if world.is_main else None,
            "old_rows": old_rows if world.is_main else None, "differing": differing,
            "eos": model.config.eos_token_id == tokenizer.eos_token_id}
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
        # the save gathered each weight to rank 0 alone, never to every rank (FSDP2: torch.distributed.gather)
        assert [rank[label]["gathers_to_every_rank"] for rank in ranks] == [0, 0], label


def test_a_new_adapter_is_its_own_reference_and_a_trained_one_is_refused(tiny_model):
    """TRL 1.16's DPO, KTO and GRPO, handed a model with adapters and no reference, add a "ref" adapter and copy each
    "default" weight into it (its `__init__`, as done here by hand): in src/trainers/base.py's block for a new adapter
    (LoRA's B at zero) no "ref" adapter is added and the copy is a no-op, so TRL's reference is the base with the
    adapters disabled, and the block leaves the model as it was; a trained adapter is refused in one line."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from src.models import ModelError
    from src.trainers.base import reference_is_the_base

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=4, target_modules="all-linear"))
    config = model.peft_config["default"]
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    with reference_is_the_base(model):
        model.add_adapter("ref", config)  # TRL's own lines (trl/trainer/dpo_trainer.py, "ref" adapter)
        for name, parameter in model.named_parameters():
            if ".default." in name:
                model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(parameter.data)
    assert list(model.peft_config) == ["default"] and not {"add_adapter", "get_parameter"} & set(vars(model))
    assert all(torch.equal(parameter, before[name]) for name, parameter in model.named_parameters())
    with torch.no_grad():
        next(parameter for name, parameter in model.named_parameters() if "lora_B" in name).add_(1.0)
    with pytest.raises(ModelError, match="trained already"), reference_is_the_base(model):
        pass
    model.add_adapter("ref", config)  # the model's own add_adapter again
    assert list(model.peft_config) == ["default", "ref"]


def test_a_chat_template_from_another_tokenizer_resizes_the_embeddings_as_the_model_loads_sharded(
        tiny_model, tmp_path):
    """--chat_template_path from a tokenizer with a new special token, under FSDP2 on 2 processes: the model (tied
    embeddings, and a copy with an untied head) is built at the template's vocabulary as it loads, each rank reading
    its share of every weight and the old embedding rows whole once (one tensor: the new rows are drawn from all of
    them, as transformers draws them), and every weight, the new rows included, is bit for bit a whole load resized by
    TRL's clone_chat_template from the same seed. Before, such a stage loaded whole on every rank (one line said so)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import CHAT_TEMPLATE

    source = AutoTokenizer.from_pretrained(tiny_model)
    source.add_special_tokens({"additional_special_tokens": ["<|turn|>"]})
    source.chat_template = CHAT_TEMPLATE.replace("<|user|>", "<|turn|><|user|>")
    source.save_pretrained(tmp_path / "source")
    untied = AutoModelForCausalLM.from_pretrained(tiny_model, tie_word_embeddings=False)
    with torch.no_grad():
        untied.lm_head.weight.copy_(untied.lm_head.weight + 0.01)  # a head of its own
    untied.save_pretrained(tmp_path / "untied")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "untied")
    environment = accelerate_environment("fsdp") | {"OMP_NUM_THREADS": "1"}
    result = forked.run_job(2, [str(tmp_path), str(tmp_path / "source"), str(tiny_model), str(tmp_path / "untied")],
                            env=environment, entry=resize_entry)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "loads whole" not in result.stdout
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for label, rank0 in ranks[0].items():
        assert rank0["differing"] == [] and rank0["rows"] > rank0["old_rows"], (label, rank0)
        assert all(rank[label]["config_rows"] == rank0["rows"] and rank[label]["eos"] for rank in ranks), label
        held = [rank[label]["held"] for rank in ranks]
        assert sum(held) == rank0["whole"] and abs(held[0] - held[1]) <= 64, (label, held)
        hidden = AutoModelForCausalLM.from_pretrained(tiny_model).config.hidden_size
        for rank in ranks:  # its share, and the old rows of each resized tensor read whole once (tied: one)
            whole_reads = (1 if label == "model0" else 2) * rank0["old_rows"] * hidden
            assert rank[label]["read"] <= rank[label]["held"] + whole_reads, (label, rank)
