"""The trainers: TRL's DPO, SFT and reward trainers with what the toolkit adds, built from the resolved plan.

- stage_plan.py     what a stage's training will do, from the config alone (no training stack): planned steps, the SFT
                    forward, options TRL would silently ignore
- trl_config.py     DPOConfig / SFTConfig / RewardConfig from the plan (build_trl_config)
- build.py          the stage's trainer with the toolkit's callbacks (build_trainer)
- dpo.py, sft.py, reward.py   one trainer each (PreparedDPOTrainer with the packed forward, ToolkitSFTTrainer,
                    ToolkitRewardTrainer)
- base.py           what every toolkit trainer adds to TRL's (micro-batch, pause and wrapped-model hooks)
- checkpointing.py  complete-only checkpoints and a failed write stopping every rank (the trainer side of
                    src/run_safety/)
- callbacks.py      the stop conditions, the one-job check, gradient compression; `callback(trainer, name)`
- metrics_log.py    metrics.jsonl as it happens, one console line per logged event
- judged_eval.py    an evaluation that judges held-out prompts (GRPO's: the judged held-out curve)

Importing this package imports nothing: stage_plan.py is light, the others pull in the training stack (TRL,
transformers' Trainer, peft, bitsandbytes: ~5 s after `import src.main_distributed`) and are imported where
training starts.
"""
