"""The real entry point under torchrun, instrumented so a test can compare GRPO's steps across splits of the batch.

    torchrun --nproc_per_node N tests/grpo_probe.py PROBE_DIR [main_distributed flags...]

Each rank writes PROBE_DIR/rank<r>.json when training ends: per optimizer step, every answer it sampled (its prompt's
train row, its token ids, its advantage), and (rank 0) the rewards of the whole generation batch as TRL gathered them,
in the batch's order.

PROBE_TRL_OWN=1 puts TRL's own sampling (each process's global generator) and metric averaging back, to measure whether
TRL's GRPOTrainer as shipped gives the same numbers on any split (docs/grpo.md: it does not).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import TrainerCallback  # noqa: E402


def instrument(build_trainer, probe_dir: Path):
    def build(stage, *args, **kwargs):
        trainer = build_trainer(stage, *args, **kwargs)
        if os.environ.get("PROBE_TRL_OWN") == "1":
            from trl import GRPOTrainer

            for name in ("_generate_single_turn", "_compute_loss", "log"):
                setattr(trainer, name, types.MethodType(getattr(GRPOTrainer, name), trainer))
        answers, rewards = [], {}
        generate, calculate = trainer._generate_and_score_completions, trainer._calculate_rewards

        def recording_generate(inputs):
            output = generate(inputs)
            mask = output["completion_mask"].bool()
            for row, ids, kept, advantage in zip(inputs, output["completion_ids"], mask, output["advantages"]):
                answers.append({"step": trainer.state.global_step, "prompt": int(row["prompt_index"]),
                                "answer": ids[kept].tolist(), "advantage": float(advantage)})
            return output

        def recording_rewards(*arguments):
            gathered = calculate(*arguments)
            rewards[trainer.state.global_step] = gathered.tolist()
            return gathered

        trainer._generate_and_score_completions = recording_generate
        trainer._calculate_rewards = recording_rewards

        class WriteProbe(TrainerCallback):
            def on_train_end(self, args, state, control, **kw):
                rank = int(os.environ.get("RANK", 0))
                (probe_dir / f"rank{rank}.json").write_text(json.dumps(
                    {"world_size": trainer.args.world_size, "accumulation": trainer.args.gradient_accumulation_steps,
                     "answers": answers, "rewards": rewards}))

        trainer.add_callback(WriteProbe())
        return trainer

    return build


def entry(argv: list[str]) -> int:
    """The instrumented main as a forked process's entry point (tests/forked.py): `argv` is also its sys.argv[1:]."""
    from rank_probe import run

    return run(instrument)


if __name__ == "__main__":
    from rank_probe import run  # tests/ is on the path: this script's folder

    sys.exit(run(instrument))
