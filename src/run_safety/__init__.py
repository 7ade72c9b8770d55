"""Run safety: nothing lost, nothing run twice, every stop said in one line with its own exit status.

- checkpoints.py   complete checkpoints only (a `.complete` marker once every rank has saved), resume from the newest
                   intact one
- checkpoint_manifest.py  what a save wrote (sizes, checksums) in its marker, verified before it is trusted; exit 8
- stops.py         SIGTERM/SIGINT → a clean stop at the end of the step; a NaN/inf → TrainingDiverged; run Status
- parent_watch.py  no process outlives its job: a worker whose launcher is gone stops as on SIGTERM, a helper
                   exits at once
- run_lock.py      one job per run directory (a hold file with a heartbeat, NFS-safe)
- finished_run.py  the same command on a finished run finishes its end and exits 0; another one is refused, naming
                   what differs
- build_once.py    build-once directories (embedded model, tokenized data) before any process group exists
- disk_space.py    what a run will write vs free space (the space check); a failed write → one line, exit 5
- node_watch.py    a lost node of a multi-node job → the survivors stop in --node_timeout, exit 6
- hang_watch.py    a stuck rank → every process stops within a minute of --hang_timeout, naming it, exit 7
                   (its board: hang_board.py; the stacks: hang_stacks.py; who stuck: hang_blame.py; the stop:
                   hang_stop.py)
- exit_status.py   the exit statuses, one table (docs/reliability.md follows it)
- launcher_exit.py run_distributed.sh exits with the job's own status (2/4/5/6/7/8), not torchrun's restart and report

The trainer side (CompleteCheckpointsMixin, StopConditions) lives in src/trainers/ with the other trainer pieces;
these modules stay light (no torch at import) so a preflight reports errors fast.
"""
