"""Host memory per rank while a job loads its model: the policy (src/models.py `load_model`) and then a reference as
TRL loads one (`create_model_from_path`, a DPO config alive), under each engine's accelerate launch config.

    python bench/load_memory.py                                  # hidden 256 and 1024, ddp zero3 fsdp, 2 processes
    python bench/load_memory.py --hidden 1024 --strategies ddp zero3 --processes 4

For each hidden size a Llama of that width (8 layers, 4x-wide MLP, a 32,000-token vocabulary, untied head) is built
here with random weights and saved in bf16; each strategy is launched as run_distributed.sh launches it (accelerate
launch with configs/accelerate/<strategy>.yaml, --processes CPU processes, gloo). Each rank resets its peak resident set
(/proc/self/clear_refs 5) right before each load and reads it back (VmHWM) right after: the table gives, per rank, the
resident set before the policy load, and for each load the rise of the peak above what was resident before it and
what stays resident after it, against the model's whole fp32 size; and the share of the weights the rank holds once
loaded (elements in its own tensors: ZeRO-3's partition; FSDP's rank-efficient load puts the others on meta). The process group, torch, transformers and deepspeed are set up before the first reset.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 2 ** 20


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
    parameters = list(model.parameters())
    local = sum(getattr(p, "ds_tensor", p).numel() for p in parameters if not p.is_meta)  # FSDP: on meta off rank 0
    return local, sum(getattr(p, "ds_numel", p.numel()) for p in parameters)


def worker(model_dir: str, out_dir: str) -> None:
    """One rank: the process group as the toolkit starts it, then the two loads, measured."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from trl import DPOConfig
    from trl.trainer.utils import create_model_from_path

    from src.config import ModelArguments
    from src.distributed import init
    from src.engines import accelerate_cpu
    from src.models import load_model
    from src.world import World

    world = World.from_environment()
    plan = SimpleNamespace(device="cpu", precision="fp32", backend="gloo", world_size=world.world_size)
    init(plan, world)
    import deepspeed  # noqa: F401  imported before the first measure, as the trainer stack imports it

    policy, numbers = measured(lambda: load_model(model_dir, ModelArguments(model_name_or_path=model_dir), plan, world))
    record = {"rank": world.rank, "policy": numbers | {"held": held_elements(policy)}}
    dist.barrier()
    config = DPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=accelerate_cpu("cpu"), report_to=[],  # noqa: F841
                       bf16=False)
    reference, numbers = measured(lambda: create_model_from_path(model_dir, dtype=torch.float32))
    record["reference"] = numbers | {"held": held_elements(reference)}
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


def launch(strategy: str, model_dir: Path, out_dir: Path, processes: int) -> list[dict]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / f"{strategy}.yaml"), "--num_processes", str(processes),
               "--main_process_port", "29731", str(Path(__file__).resolve()), "--worker", str(model_dir), str(out_dir)]
    environment = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    subprocess.run(command, check=True, env=environment, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(processes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero3", "fsdp"])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    print(f"{args.processes} processes")
    print("| hidden | whole fp32 | strategy | rank | resident before | policy load: peak rise, kept | held | "
          "reference load: peak rise, kept | held |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as temporary:
        for hidden in args.hidden:
            model_dir = Path(temporary, f"llama{hidden}")
            whole = build_model(model_dir, hidden)
            for strategy in args.strategies:
                out_dir = Path(temporary, f"{strategy}{hidden}")
                out_dir.mkdir()
                for record in launch(strategy, model_dir, out_dir, args.processes):
                    cells = [f"{record['policy']['before'] / MiB:.0f} MiB"]
                    for part in ("policy", "reference"):
                        numbers = record[part]
                        local, total = numbers["held"]
                        cells += [f"{(numbers['peak'] - numbers['before']) / MiB:+.0f}, "
                                  f"{(numbers['after'] - numbers['before']) / MiB:+.0f} MiB", f"{local / total:.2f}"]
                    print(f"| {hidden} | {whole / MiB:.0f} MiB | {strategy} | {record['rank']} | " + " | ".join(cells)
                          + " |", flush=True)


if __name__ == "__main__":
    main()
