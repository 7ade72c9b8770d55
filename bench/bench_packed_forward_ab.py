"""The packed DPO forward of this checkout against another version's, forward + backward only, arms interleaved:

    git worktree add --detach /tmp/before 6eb9cac
    python bench/bench_packed_forward_ab.py --before /tmp/before/src/packed_dpo.py

What a change to src/packed_dpo.py costs (or saves) per micro-batch, without the noise of whole runs: the same Llama
(--hidden 256 --layers 4 by default, sdpa, fp32 on CPU), the same 6 micro-batches of 8 log-normal pairs (prompt median 31 tokens,
answers 26, capped at 150), each version on its own copy of the model (each installs its own fused-forward wrapper).
Prints the median seconds per 6 micro-batches of each and their ratio."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load_version(path: str):
    spec = importlib.util.spec_from_file_location("packed_dpo_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.utils import add_fused_lm_head

    import src.packed_dpo as after

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="another version's src/packed_dpo.py")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    versions = {"before": load_version(args.before), "after": after}
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=2000, hidden_size=args.hidden,
                                        intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                                        num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa"))
    models = {}
    for name in versions:
        models[name] = copy.deepcopy(base)
        add_fused_lm_head(models[name], outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    rng = random.Random(0)
    length = lambda median: min(150, max(1, int(rng.lognormvariate(math.log(median), 0.9) * 1.3)))  # noqa: E731
    ids = lambda count: [rng.randrange(3, 2000) for _ in range(count)]  # noqa: E731
    batches = [[{"prompt_ids": ids(length(24)), "chosen_ids": ids(length(20)), "rejected_ids": ids(length(20))}
                for _ in range(8)] for _ in range(6)]

    def step(module, model, rows):
        collator = module.PackedPreferenceCollator(DataCollatorForPreference(pad_token_id=0, max_length=400),
                                                   "prefix_shared", 1 / (3 * args.hidden))
        batch = collator(rows)
        forward = module.PackedDPOForward(None, "prefix_shared")
        forward.checked = True
        with forward.running(batch, ("policy",), [model]) as inputs:
            labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                            use_cache=False, fused_lm_head=True)
        outputs.log_probs.sum().backward()

    seconds = {name: [] for name in versions}
    for _ in range(args.repeats):
        for name, module in versions.items():
            started = time.perf_counter()
            for rows in batches:
                step(module, models[name], rows)
            seconds[name].append(time.perf_counter() - started)
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.3f} s per 6 micro-batches  {[round(v, 3) for v in values]}")
    print(f"after / before: {statistics.median(seconds['after']) / statistics.median(seconds['before']):.3f}")


if __name__ == "__main__":
    main()
