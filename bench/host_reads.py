"""Host reads of device values per optimizer step (each a GPU stall), TRL 1.16's own trainers against the toolkit's,
counted the same way on CPU (tests/read_probe.py: `Tensor.item`, `.tolist`, `bool()`, `float()`, `int()`,
`.nonzero`, `.cpu`, `.numpy`, from the second optimizer step to the one before the first log, evaluation or
checkpoint; one micro-batch of 2 per optimizer step; the tiny model of the tests).

    python bench/host_reads.py            # ~3 minutes on 2 CPU cores
    python bench/host_reads.py kto grpo   # some trainers only

TRL's arms: its plain trainers in this process (DPOTrainer with its reference model in the step, SFTTrainer, CPOTrainer
with SimPO's loss, ORPOTrainer, KTOTrainer, GRPOTrainer with the KL term and 2 answers per prompt, its sampling and
judging not counted: its training part). The toolkit's: `python -m src.main_distributed --stage <stage>` forked
(tests/forked.py) with its defaults (packed forward, reference log-probs precomputed). Prints docs/speed.md's table:
reads per optimizer step, by kind, and the model's own (transformers' sdpa mask check) apart.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import conftest  # noqa: E402
import forked  # noqa: E402
import read_probe  # noqa: E402

MODEL_OWN = "transformers/masking_utils.py"
STEPS = 6


def trl_arm(name: str, model_path: Path, rows: list[dict], work: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    common = dict(output_dir=str(work / name), per_device_train_batch_size=2, max_steps=STEPS, logging_steps=100,
                  save_strategy="no", use_cpu=True, bf16=False, report_to=[], disable_tqdm=True, max_length=64)
    pairs = Dataset.from_list([{"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}
                               for row in rows])
    if name == "sft":
        data = Dataset.from_list([{"messages": row["prompt"] + row["chosen"]} for row in rows])
        trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=data, processing_class=tokenizer)
    elif name == "dpo":
        trainer = DPOTrainer(model=model, args=DPOConfig(**common, activation_checkpointing=False),
                             train_dataset=pairs, processing_class=tokenizer)
    elif name == "simpo":
        trainer = CPOTrainer(model=model, args=CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0),
                             train_dataset=pairs, processing_class=tokenizer)
    elif name == "orpo":
        trainer = ORPOTrainer(model=model, args=ORPOConfig(**common), train_dataset=pairs, processing_class=tokenizer)
    elif name == "grpo":
        del common["max_length"]
        trainer = GRPOTrainer(model=model, reward_funcs=answer_length, train_dataset=pairs.select_columns(["prompt"]),
                              processing_class=tokenizer,
                              args=GRPOConfig(**common, num_generations=2, max_completion_length=8, beta=0.1,
                                              activation_checkpointing=False))
    else:
        unpaired = Dataset.from_list([{"prompt": row["prompt"], "completion": row[side], "label": side == "chosen"}
                                      for row in rows for side in ("chosen", "rejected")])
        trainer = KTOTrainer(model=model, args=KTOConfig(**common, activation_checkpointing=False),
                             train_dataset=unpaired, processing_class=tokenizer)
    counter = read_probe.ReadCounter().install()
    if name == "grpo":  # its training part, as tests/read_probe.py counts the toolkit's
        trainer._generate_and_score_completions = counter.paused(trainer._generate_and_score_completions)
    try:
        trainer.add_callback(counter.callback(name))
        trainer.train()
    finally:
        counter.remove()
    return counter.result()[name]


def answer_length(completions, **columns) -> list[float]:
    return [float(len(completion[-1]["content"] if isinstance(completion, list) else completion))
            for completion in completions]


def toolkit_arm(stage: str, model_path: Path, data: Path, work: Path) -> dict:
    result = work / f"{stage}.json"
    extra = {"kto": ["--kto_from_pairs"],
             "grpo": ["--dataset_name", str(conftest.write_jsonl(work / "prompts.jsonl", [
                 {"prompt": row["prompt"]} for row in conftest.preference_rows(48, seed=1)])),
                      "--num_generations", "2", "--max_new_tokens", "8", "--beta", "0.1", "--judge",
                      "tests.round_judges:by_length"]}.get(stage, [])
    completed = forked.run_main([str(result), "--stage", stage, "--model_name_or_path", str(model_path),
                                 "--dataset_name", str(data), "--results_dir", str(work / "results"), "--run_name",
                                 stage, "--max_length", "64", "--logging_steps", "100", "--eval_steps", "100",
                                 "--max_steps", str(STEPS), "--num_samples", "0", "--judge", "none", "--seed", "3",
                                 "--val_size", "0", "--test_size", "0", "--per_device_batch_size", "2", *extra],
                                entry=read_probe.entry)
    if completed.returncode:
        sys.exit(f"toolkit {stage} failed:\n{completed.stderr[-3000:]}")
    return json.loads(result.read_text())[stage]


def summary(window: dict) -> tuple[float, float, str]:
    steps = max(window["steps"], 1)
    own = sum(count for place, count in window["places"].items() if MODEL_OWN not in place) / steps
    model = sum(count for place, count in window["places"].items() if MODEL_OWN in place) / steps
    kinds = ", ".join(f"{name.strip('_')} {count / steps:g}" for name, count in sorted(window["reads"].items()))
    return own, model, kinds


def main() -> None:
    import os

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        os.environ.update(HF_HUB_OFFLINE="1", HF_HOME=str(work / "hf"))
        model = conftest.build_tiny_model(work / "model", conftest.tiny_corpus())
        rows = conftest.preference_rows(48, seed=1)
        data = conftest.write_jsonl(work / "pairs.jsonl", rows)
        table = ["| trainer | TRL 1.16's own: reads / step | the toolkit's | the model's own (TRL / toolkit) | "
                 "TRL's by kind (model's included) |", "|---|---:|---:|---:|---|"]
        for name in sys.argv[1:] or ("dpo", "sft", "simpo", "orpo", "kto", "grpo"):
            trl_own, trl_model, kinds = summary(trl_arm(name, model, rows, work))
            toolkit_own, toolkit_model, _ = summary(toolkit_arm(name, model, data, work))
            table.append(f"| {name} | {trl_own:g} | {toolkit_own:g} | {trl_model:g} / {toolkit_model:g} | {kinds} |")
    print("\n".join(table))  # at the end: the trainers' own output (progress bars, TRL's dicts) comes before


if __name__ == "__main__":
    main()
