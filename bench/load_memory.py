"""Host memory per rank while a job loads its model and saves it: the policy (src/models.py `load_model`), then a
reference as the stage loads one (a DPO config alive: under FSDP2 and ZeRO-3 the toolkit's own load, each rank its
share, src/pipeline/training.py `reference_model`; under DDP TRL's `create_model_from_path`), then the final model
written whole (under FSDP2 and ZeRO-3 src/sharded_weights.py `save_whole`: rank 0 a tensor at a time; under DDP
save_pretrained on rank 0), under each engine's accelerate launch config.

    python bench/load_memory.py                                  # hidden 512 and 1024, ddp zero3 fsdp, 2 processes
    python bench/load_memory.py --hidden 1024 --strategies ddp zero3 --processes 4
    python bench/load_memory.py --mmap-threshold 1048576          # glibc returning freed buffers at once

For each hidden size a Llama of that width (8 layers, 4x-wide MLP, a 32,000-token vocabulary, untied head) is built
here with random weights and saved in bf16; each strategy is launched as run_distributed.sh launches it (accelerate
launch with configs/accelerate/<strategy>.yaml, --processes CPU processes, gloo). Each rank resets its peak resident set
(/proc/self/clear_refs 5) right before each load and reads it back (VmHWM) right after: the table gives, per rank, the
resident set before the policy load, and for each load the rise of the peak above what was resident before it and
what stays resident after it, against the model's whole fp32 size; the share of the weights the rank holds once
loaded (elements in its own tensors: ZeRO-3's partition, FSDP2's local shards); and the slowest rank's seconds for the
policy load. The process group, torch, transformers and deepspeed are set up before the first reset. VmHWM counts
every resident page: the weights, what glibc keeps of freed buffers (its arenas; `--mmap-threshold` sets glibc's
M_MMAP_THRESHOLD for the workers, which then return every buffer above it at once) and pages of the checkpoint file
mapped while a tensor is read (sharded loads open the file for each read and let its pages go with it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 2 ** 20
METHODS = {"ddp": "full", "zero3": "zero3", "fsdp": "fsdp"}  # check_gpu's memory plan's name of each strategy


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measured(load) -> tuple:
    """(result, {resident before, peak during, resident after}): the peak reset first."""
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kib("VmRSS") * 1024
    result = load()
    return result, {"before": before, "peak": status_kib("VmHWM") * 1024, "after": status_kib("VmRSS") * 1024}


def held_elements(model) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model)."""
    from src.engines import local_shard, whole_numel

    parameters = list(model.parameters())
    local = sum(getattr(p, "ds_tensor", local_shard(p)).numel() for p in parameters if not p.is_meta)
    return local, sum(whole_numel(p) for p in parameters)


def worker(model_dir: str, out_dir: str) -> None:
    """One rank: the process group as the toolkit starts it, then the two loads and the save, measured."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from trl import DPOConfig
    from trl.trainer.utils import create_model_from_path

    from src.config import ModelArguments
    from src.distributed import init
    from src.engines import accelerate_cpu, loads_sharded, resharded_after_forward, sharded
    from src.models import load_model
    from src.sharded_weights import save_whole
    from src.world import World

    world = World.from_environment()
    plan = SimpleNamespace(device="cpu", precision="fp32", backend="gloo", world_size=world.world_size)
    init(plan, world)
    import deepspeed  # noqa: F401  imported before the first measure, as the trainer stack imports it

    arguments = ModelArguments(model_name_or_path=model_dir)
    started = time.perf_counter()
    policy, numbers = measured(lambda: load_model(model_dir, arguments, plan, world))
    record = {"rank": world.rank, "policy": numbers | {"held": held_elements(policy),
                                                       "seconds": time.perf_counter() - started}}
    dist.barrier()
    config = DPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=accelerate_cpu("cpu"), report_to=[],  # noqa: F841
                       bf16=False)
    reference, numbers = measured(lambda: resharded_after_forward(load_model(model_dir, arguments, plan, world))
                                  if loads_sharded(world.world_size) else create_model_from_path(
                                      model_dir, dtype=torch.float32))
    record["reference"] = numbers | {"held": held_elements(reference)}
    del reference
    dist.barrier()
    saved = Path(out_dir, "saved")
    saved.mkdir(exist_ok=True)
    _, numbers = measured(lambda: save_whole(policy, saved, world.is_main) if sharded(policy.parameters()) else
                          policy.save_pretrained(saved) if world.is_main else None)
    record["save"] = numbers | {"held": held_elements(policy)}
    Path(out_dir, f"rank{world.rank}.json").write_text(json.dumps(record))
    dist.barrier()


def build_model(directory: Path, hidden: int) -> int:
    """A Llama `hidden` wide, saved in bf16 as the Hub's checkpoints are (the toolkit loads fp32: a converted copy, not
    pages of the file); its whole size in bytes as loaded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=8,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory)
    return sum(p.numel() for p in model.parameters()) * 4


def launch(strategy: str, model_dir: Path, out_dir: Path, processes: int, mmap_threshold: int | None) -> list[dict]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / f"{strategy}.yaml"), "--num_processes", str(processes),
               "--main_process_port", "29731", str(Path(__file__).resolve()), "--worker", str(model_dir), str(out_dir)]
    environment = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error") | (
        {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else {})
    subprocess.run(command, check=True, env=environment, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(processes)]


def row(hidden: int, whole: int, strategy: str, record: dict, seconds: float, planned: int) -> str:
    """One rank's table row: each part's peak rise and what it kept (MiB, and the peak as a share of the model), the
    share of the weights it held, check_gpu's plan for the policy load's peak, and the slowest rank's seconds for it."""
    cells = [f"{record['policy']['before'] / MiB:.0f} MiB"]
    for part in ("policy", "reference", "save"):
        numbers = record[part]
        local, total = numbers["held"]
        rise = numbers["peak"] - numbers["before"]
        cells += [f"{rise / MiB:+.0f} ({rise / whole:.2f}x), {(numbers['after'] - numbers['before']) / MiB:+.0f} MiB"]
        cells += [f"{local / total:.2f}"] if part != "save" else []
    return f"| {hidden} | {whole / MiB:.0f} MiB | {strategy} | {record['rank']} | " + " | ".join(cells) + \
        f" | {planned / MiB:+.0f} MiB | {seconds:.1f} |"


def main() -> None:
    from src.diagnostics.memory_plan import host_load_bytes
    from src.diagnostics.model_shape import shape_from_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero3", "fsdp"])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--mmap-threshold", type=int, default=None, help="glibc's MALLOC_MMAP_THRESHOLD_ (bytes)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    print(f"{args.processes} processes" + (f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold
                                           else ""))
    print("| hidden | whole fp32 | strategy | rank | resident before | policy load: peak rise, kept | held | "
          "reference load: peak rise, kept | held | final save: peak rise, kept | plan: policy load | policy load s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as temporary:
        for hidden in args.hidden:
            model_dir = Path(temporary, f"llama{hidden}")
            whole = build_model(model_dir, hidden)
            for strategy in args.strategies:
                out_dir = Path(temporary, f"{strategy}{hidden}")
                out_dir.mkdir()
                records = launch(strategy, model_dir, out_dir, args.processes, args.mmap_threshold)
                seconds = max(record["policy"]["seconds"] for record in records)
                planned = host_load_bytes(METHODS[strategy], shape_from_model(str(model_dir)), args.processes, "cpu")
                for record in records:
                    print(row(hidden, whole, strategy, record, seconds, planned), flush=True)


if __name__ == "__main__":
    main()
