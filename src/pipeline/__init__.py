"""The pipeline's steps, each a module that src/main_distributed.py (the pipeline on one page) calls in turn.

- stages.py        the run's stages planned before anything heavy: each one's config, plan, directories (`Stage`)
- run_directory.py one job per run directory (the hold), a finished or diverged run found and finished, not retrained
- preflight.py     the checks before any process group: sources, judge, Hub, the model-side checks, the prepared data;
                   a --dry_run's end
- stage_record.py  a stage's training_info.json: opened (or resumed) at its start, closed with its summary at its end
- held_out.py      held-out prompts answered (a reward model: held-out pairs scored) before and after training, judged
- training.py      a stage's model, its trainer (callbacks, trackers, judged evaluation, tools), the space and one-job
                   checks, training resumed from its checkpoint, a stop or divergence raised after it
- publishing.py    a finished stage's pages (report, index, model cards) and the run's copies (--final_model_dir,
                   --push_to_hub)
- stopping.py      a stop by signal, a divergence or a hang recorded in the stage that was running; the watches
                   (lost node, hang) started
- exits.py         every way a run ends → one line and its exit status (src/run_safety/exit_status.py's table)
"""
