"""A run that lost processes, or gained some, goes on with the numbers of the run never interrupted (issue 58): the
same command on another number of processes resumes from the newest complete checkpoint under DDP, ZeRO-1/2/3 and
FSDP2 (src/run_safety/checkpoint_split.py, resharding.py; src/trainers/resume_state.py), and what it cannot do is
refused in one line before any process group.

Each cell is a forked job killed, then the same command on another number of processes (tests/forked.py), held to
the uninterrupted 2-process DDP run of the same command: every logged loss, grad norm, eval metric and DPO/SFT metric
within 1e-5 from the first step after the resume. The covering set (why these cells suffice, and their measured cost:
docs/reliability.md, "Another number of processes"):

| cell | engine | objective | processes | killed |
|---|---|---|---|---|
| ddp | DDP | DPO, reference cached | 2 -> 1 | off the checkpoint grid (step 5; checkpoint-3) |
| zero1 | ZeRO-1 | DPO, reference cached | 2 -> 4 | right after checkpoint-3 (every rank) |
| zero2 | ZeRO-2 | DPO, reference cached | 4 -> 2 | off the checkpoint grid |
| zero3_live | ZeRO-3 | DPO, reference live (sharded too) | 2 -> 4 | right after checkpoint-3 |
| zero3_lora | ZeRO-3 | SFT with LoRA | 2 -> 1 | off the checkpoint grid |
| fsdp | FSDP2 (sharded checkpoints) | DPO, reference cached | 2 -> 4 | off the checkpoint grid |
| fsdp_lora | FSDP2 (whole checkpoints) | SFT with LoRA | 2 -> 1 (FSDP on one process) | right after checkpoint-3 |

KTO (2 -> 1, tests/test_kto.py) and GRPO (1 -> 2 and 2 -> 4, tests/test_grpo.py) resume on another number of
processes in their own tests' jobs. The checkpoint is off the logging grid in every cell (saved every 3 steps, logged
every 2), and the run crosses an epoch after the resume (44 training pairs, 5 steps of 8 an epoch, 4 left out).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import forked
from conftest import preference_rows, write_jsonl
from engine_launch import accelerate_environment
from src import run_files, seams
from src.run_safety import checkpoint_manifest
from src.run_safety.resharding import LATEST_UNIVERSAL, universal_ready
from test_training import common_args

pytest.importorskip("deepspeed")

# What a logged record holds that is not a number of the training: its timings and speeds.
NOT_NUMBERS = ("perf/", "time", "train_", "eval_runtime", "eval_samples", "eval_steps", "total_flos", "epoch")
OFF_GRID, AT_CHECKPOINT = "off the checkpoint grid", "at a checkpoint"


def logged(run_dir: Path) -> list[dict]:
    """The run's logged numbers, record by record (timings left out)."""
    return [{key: value for key, value in record.items() if not key.startswith(NOT_NUMBERS)}
            for record in run_files.read_jsonl(run_dir / run_files.METRICS)]


def launch(processes: int, args: list[str], strategy: str, seam: dict | None = None):
    """A forked job of `processes` as `STRATEGY=<strategy> ./run_distributed.sh <processes>` starts its workers
    (fsdp: configs/accelerate/fsdp.yaml, sharded checkpoints; fsdp_whole: with fsdp_state_dict_type FULL_STATE_DICT);
    `seam`: a test seam's variable (seams.env)."""
    whole = strategy == "fsdp_whole"
    strategy = "fsdp" if whole else strategy
    environment = (accelerate_environment(strategy, processes) if strategy != "ddp" else dict(os.environ)) | {
        "OMP_NUM_THREADS": "1"} | ({"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"} if whole else {})
    return forked.run_job(processes, args, env=environment | (seam or {}))


def killed(processes: int, args: list[str], strategy: str, kill: str, flag: Path) -> None:
    """The job killed: rank 0 SIGKILLed at the end of step 5 (the newest checkpoint is 3, and steps 4-5 were logged
    after it), or every rank right after checkpoint-3 completed."""
    if kill == OFF_GRID:
        seam = seams.env({}, kill_starter=f"step:5:{flag}")
    else:
        seam = seams.env({}, kill_at_checkpoint=f"after_complete:3:*:{flag}")
    result = launch(processes, args, strategy, seam)
    fired = flag.exists() if kill == OFF_GRID else Path(f"{flag}.rank0").exists()
    assert fired and result.returncode != 0, f"the seam never fired: the test proves nothing\n{result.stderr[-3000:]}"


def assert_same_numbers(run: list[dict], reference: list[dict]) -> None:
    assert [record["step"] for record in run] == [record["step"] for record in reference]
    wrong = []
    for mine, theirs in zip(run, reference):
        assert mine.keys() == theirs.keys(), (mine["step"], mine.keys() ^ theirs.keys())
        wrong += [(mine["step"], key, mine[key], value) for key, value in theirs.items()
                  if mine[key] != pytest.approx(value, rel=1e-5, abs=1e-7)]
    assert not wrong, wrong


def run_args(model: Path, data: Path, results: Path, stage: str):
    """The command of every cell of a stage: a global batch of 8 in micro-batches of 2, 6 steps, a log every 2
    steps, a checkpoint and an evaluation every 3."""
    def args(name: str, *extra: str) -> list[str]:
        return common_args(model, data, results, name, stage) + [
            "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "6", "--learning_rate", "1e-3",
            "--logging_steps", "2", "--save_steps", "3", "--eval_steps", "3", "--num_samples", "0", *extra]
    return args


@pytest.fixture(scope="module")
def dpo(tiny_model, tmp_path_factory):
    """DPO's command and its uninterrupted 2-process DDP run, the reference every DPO cell is held to."""
    root = tmp_path_factory.mktemp("resharding_dpo")
    args = run_args(tiny_model, write_jsonl(root / "pairs.jsonl", preference_rows(52)), root / "results", "dpo")
    reference = launch(2, args("reference"), "ddp")
    assert reference.returncode == 0, reference.stderr[-3000:]
    return args, logged(root / "results" / "reference"), root / "results"


@pytest.fixture(scope="module")
def sft_lora(tiny_model, tmp_path_factory):
    """SFT with LoRA, its command and uninterrupted 2-process DDP run. Without LoRA's dropout (the default, said here):
    its masks are drawn by each process from its own random stream, so with dropout no two splits give the same
    numbers, resumed or not."""
    root = tmp_path_factory.mktemp("resharding_sft")
    rows = [{"messages": row["prompt"] + row["chosen"]} for row in preference_rows(52)]
    args = run_args(tiny_model, write_jsonl(root / "chat.jsonl", rows), root / "results", "sft")
    lora = ("--use_lora", "true", "--lora_dropout", "0")
    reference = launch(2, args("reference", *lora), "ddp")
    assert reference.returncode == 0, reference.stderr[-3000:]
    return (lambda name: args(name, *lora)), logged(root / "results" / "reference"), root / "results"


def resume_cell(setup, name: str, strategy: str, first: int, then: int, kill: str, tmp_path: Path,
                extra: tuple[str, ...] = (), between=None) -> tuple[Path, dict, str]:
    """A cell: the job of `first` processes killed, then the same command on `then`, held to the reference. Returns
    its run directory, training_info.json and the resumed launch's console. `between(args)`: what a test does with
    the killed run before the resume."""
    args_for, reference, results = setup
    args = args_for(name) + list(extra)
    killed(first, args, strategy, kill, tmp_path / "killed")
    if between is not None:
        between(args)
    again = launch(then, args, strategy)
    assert again.returncode == 0, f"{again.stdout[-3000:]}\n{again.stderr[-5000:]}"
    run_dir = results / name
    assert_same_numbers(logged(run_dir), reference)
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    resume = info["resumes"][-1]
    assert (info["world_size"], resume["from_step"], resume["saved_by"]["world_size"]) == (then, 3, first)
    return run_dir, info, again.stdout


def assert_universal_checkpoint_recorded(run_dir: Path, info: dict, first: int) -> None:
    """DeepSpeed's universal checkpoint, converted once inside checkpoint-3, is in its manifest and verifies; one
    byte altered in it is found."""
    conversion = info["resumes"][-1]["universal_checkpoint"]
    assert conversion["from_world_size"] == first and conversion["bytes"] > 0
    checkpoint = run_dir / "model" / "checkpoint-3"
    listed = checkpoint_manifest.read_manifest(checkpoint)["files"]
    converted = [name for name in listed if name.startswith(conversion["universal"] + "/")]
    assert LATEST_UNIVERSAL in listed and converted and universal_ready(checkpoint)
    assert checkpoint_manifest.verify(checkpoint, threads=1) is None
    damaged = checkpoint / converted[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert converted[0] in checkpoint_manifest.verify(checkpoint, threads=1)


def test_ddp_killed_off_the_checkpoint_grid_resumes_on_one_process_saying_what_changed(dpo, tmp_path):
    """DDP, 2 -> 1. Before the resume, 3 processes are refused in one line (8 does not split over 3: the counts that
    split it and the command), before any process group, nothing of the run changed. The resume says what changed
    (console, training_info.json) and the report's curves mark it."""
    from src.reporting.plots import resume_marks

    def three_processes_refused(args):
        metrics = dpo[2] / "ddp" / run_files.METRICS
        before = metrics.read_bytes()
        three = launch(3, args, "ddp")
        errors = [line for line in three.stderr.splitlines() if line.startswith("error:")]
        assert three.returncode == 2 and len(errors) == 1 and "Traceback" not in three.stderr, three.stderr[-3000:]
        assert "unfinished run at a global batch of 8, which 3 processes cannot split: resume it on 1, 2, 4 " \
               "processes" in errors[0] and "; run: ./run_distributed.sh 2 --stage dpo" in errors[0], errors[0]
        assert metrics.read_bytes() == before

    _run_dir, info, console = resume_cell(dpo, "ddp", "ddp", 2, 1, OFF_GRID, tmp_path,
                                          between=three_processes_refused)
    change = "saved by 2 processes, now 1: accumulation 2 → 4, global batch 8 unchanged"
    assert f"model/checkpoint-3 (step 3 of 6; {change})" in console
    assert info["resumes"][-1]["split_change"] == change
    assert resume_marks(info) == [(3, "resumed at step 3 on 1 process (saved by 2)")]


@pytest.mark.parametrize(("name", "strategy", "first", "then", "kill", "extra"), [
    ("zero1", "zero1", 2, 4, AT_CHECKPOINT, ()),
    ("zero2", "zero2", 4, 2, OFF_GRID, ()),
    ("zero3_live", "zero3", 2, 4, AT_CHECKPOINT, ("--precompute_ref_log_probs", "false")),
])
def test_deepspeed_checkpoints_resume_on_another_number_of_processes(dpo, tmp_path, name, strategy, first, then,
                                                                     kill, extra):
    """DeepSpeed ZeRO-1/2/3 (DPO): the checkpoint converted once to DeepSpeed's universal checkpoint and loaded on
    the new number of processes, recorded in the checkpoint's manifest. Before it, a launch under plain DDP is
    refused in one line naming the engine that saved it."""
    def ddp_refused(args):
        refused = launch(then, args, "ddp")
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert refused.returncode == 2 and len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert f"was saved under DeepSpeed ZeRO-{strategy[-1]} and this launch runs plain DDP: relaunch with " \
               f"STRATEGY={strategy}" in errors[0], errors[0]

    run_dir, info, _console = resume_cell(dpo, name, strategy, first, then, kill, tmp_path, extra,
                                          between=ddp_refused if name == "zero2" else None)
    assert (info["engine"], info["zero_stage"]) == ("deepspeed", int(strategy[-1]))
    assert_universal_checkpoint_recorded(run_dir, info, first)


def test_fsdp2_sharded_checkpoint_resumes_on_more_processes(dpo, tmp_path):
    """FSDP2 with sharded checkpoints (torch.distributed.checkpoint, which reshards as it loads), DPO, 2 -> 4."""
    _run_dir, info, _console = resume_cell(dpo, "fsdp", "fsdp", 2, 4, OFF_GRID, tmp_path)
    assert (info["engine"], info["resumes"][-1]["saved_by"]["state_dict_type"]) == ("fsdp", "SHARDED_STATE_DICT")


@pytest.mark.parametrize(("name", "strategy", "first", "then", "kill"), [
    ("zero3_lora", "zero3", 2, 1, OFF_GRID),
    ("fsdp_lora", "fsdp_whole", 2, 1, AT_CHECKPOINT),
])
def test_lora_sft_resumes_on_another_number_of_processes(sft_lora, tmp_path, name, strategy, first, then, kill):
    """SFT with LoRA (the base frozen, only the adapter in the optimizer): ZeRO-3 2 -> 1 (its universal checkpoint
    holds the adapter's states; the issue's own case, with the model whole), FSDP2 with whole checkpoints 2 -> 1 (FSDP
    on one process: a group of one)."""
    run_dir, info, _console = resume_cell(sft_lora, name, strategy, first, then, kill, tmp_path)
    assert info["engine"] == ("deepspeed" if strategy == "zero3" else "fsdp"), info["engine"]
    if strategy == "zero3":
        assert_universal_checkpoint_recorded(run_dir, info, first)


# ------------------------------------------------------------------------------------ in this process: the lines


def plan_of(world_size: int, per_device: int, accumulation: int, nodes: int = 1, mode: str = "global"):
    from types import SimpleNamespace

    return SimpleNamespace(world_size=world_size, num_nodes=nodes, per_device_batch_size=per_device,
                           gradient_accumulation_steps=accumulation, batch_mode=mode,
                           global_batch_size=world_size * per_device * accumulation)


def test_what_cannot_resume_with_the_same_numbers_is_refused_in_one_line_naming_the_fix(tmp_path):
    """src/run_safety/checkpoint_split.refusal, on checkpoints laid out as each engine saves them: another global batch
    (per-device batches on fewer processes), another engine or ZeRO stage, one FSDP shard per process, optimizer
    states offloaded to NVMe; what reshards is let through, and a checkpoint from before split.json is read from
    its files."""
    from src.engines import DEEPSPEED, FSDP, Engine
    from src.run_safety.checkpoint_split import SPLIT_FILE, change_line, refusal, saved_split, split_record

    def checkpoint(name: str, record: dict | None, *files: str) -> Path:
        path = tmp_path / "model" / name
        path.mkdir(parents=True)
        for file in files:
            (path / file).parent.mkdir(parents=True, exist_ok=True)
            (path / file).write_bytes(b"")
        if record is not None:
            (path / SPLIT_FILE).write_text(__import__("json").dumps(record))
        return path

    zero3 = checkpoint("checkpoint-43", split_record(2, 1, 2, 2, {"engine": DEEPSPEED, "zero_stage": 3}),
                       "global_step43/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    saved = saved_split(zero3)
    assert refusal(zero3, saved, plan_of(1, 2, 4), Engine(DEEPSPEED, 3)) is None  # converted at the resume
    assert refusal(zero3, saved, plan_of(2, 8, 1, mode="per_device"), Engine(DEEPSPEED, 3)) == (
        "model/checkpoint-43 was trained at a global batch of 8, and this launch's is 16 (--per_device_batch_size 8 on "
        "2 processes): relaunch with --batch_size 8 (the same steps on any number of processes), or start afresh "
        "with --overwrite")
    assert refusal(zero3, saved, plan_of(1, 2, 4), None) == (
        "model/checkpoint-43 was saved under DeepSpeed ZeRO-3 and this launch runs plain DDP: relaunch with "
        "STRATEGY=zero3, or start afresh with --overwrite")
    assert "relaunch with STRATEGY=zero3" in refusal(zero3, saved, plan_of(2, 2, 2), Engine(DEEPSPEED, 2))
    fsdp_local = checkpoint("checkpoint-44", split_record(2, 1, 2, 2, {"engine": FSDP, "fsdp_version": 2,
                                                                       "state_dict_type": "LOCAL_STATE_DICT"}))
    assert refusal(fsdp_local, saved_split(fsdp_local), plan_of(1, 2, 4), Engine(FSDP)).startswith(
        "model/checkpoint-44 holds one FSDP shard per process (saved by 2), which only 2 processes can load: resume "
        "it on 2 processes; for checkpoints any number can resume, keep fsdp_state_dict_type: SHARDED_STATE_DICT")
    assert refusal(fsdp_local, saved_split(fsdp_local), plan_of(2, 2, 2), Engine(FSDP)) is None  # the same split
    nvme = checkpoint("checkpoint-45", split_record(2, 1, 2, 2, {"engine": DEEPSPEED, "zero_stage": 2}),
                      "global_step45/offloaded_tensors/rank00/x")
    assert "offloaded to NVMe" in refusal(nvme, saved_split(nvme), plan_of(4, 2, 1), Engine(DEEPSPEED, 2))
    older = checkpoint("checkpoint-46", None, "model.safetensors", "optimizer.pt", "rng_state_0.pth",
                       "rng_state_1.pth")
    assert saved_split(older) == {"world_size": 2, "global_batch_size": None, "engine": "ddp"}
    assert refusal(older, saved_split(older), plan_of(1, 2, 4), None) is None
    assert change_line(saved_split(older), plan_of(1, 2, 4)) == "saved by 2 processes, now 1: global batch 8"
    assert change_line(saved, plan_of(2, 2, 2)) is None
    two_nodes = split_record(16, 2, 4, 1, {"engine": "ddp"})
    assert change_line(two_nodes, plan_of(8, 4, 2)) == (
        "saved by 2 nodes x 8 processes, now 8: accumulation 1 → 2, global batch 64 unchanged")


def test_the_lost_node_line_names_the_launch_that_goes_on_with_the_nodes_left(monkeypatch):
    """A job of 2 nodes x 2 processes at a global batch of 8 loses node 1: the line says the relaunch on every node,
    or node 0 alone with its 2 processes (NNODES=1: the launch had NNODES=2 set). A job of 3 nodes x 4 at 12 that
    loses one goes on as 2 nodes x 3 (8 processes would not split 12): the most processes the batch splits over."""
    from src.config_parse import parse_config
    from src.pipeline.stopping import without_lost_node
    from src.run_safety.node_watch import lost_node_line
    from src.world import World

    monkeypatch.setenv("NNODES", "2")
    monkeypatch.delenv("STRATEGY", raising=False)
    arguments = ["--stage", "dpo", "--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--batch_size", "8"]
    command = without_lost_node(parse_config(arguments), World(world_size=4, local_world_size=2), arguments)
    assert command == f"NNODES=1 ./run_distributed.sh 2 {' '.join(arguments)} on it (2 processes)"
    assert lost_node_line(1, "rank(s) 2, 3", 181.2, "results/job/model/checkpoint-40", command) == (
        "error: node 1 stopped answering (rank(s) 2, 3: nothing for 181 s, --node_timeout); stopping this node; a "
        "relaunch of the same command on every node resumes from results/job/model/checkpoint-40; or go on without "
        f"node 1 from there, with the same numbers: {command}")
    arguments[-1] = "12"  # 3 nodes x 4 left with 2 nodes: 8 does not split 12, 2 x 3 does
    command = without_lost_node(parse_config(arguments), World(world_size=12, local_world_size=4), arguments)
    assert command.startswith("NNODES=2 NODE_RANK=<0-1> MASTER_ADDR=<the first node's address> ./run_distributed.sh"
                              " 3 ") and command.endswith(" on each of them (6 processes)")
    assert lost_node_line(0, "the rendezvous store it holds", 30, None, command).endswith(
        "stopping this node; no complete checkpoint was saved yet")


def test_the_report_curves_mark_each_resume():
    """Each resume of training_info.json is a dashed vertical line on every panel, labelled with the processes
    when they changed."""
    from matplotlib.figure import Figure

    from src.objectives.spec import Curve, Panel
    from src.reporting.plots import _draw_panel, resume_marks

    info = {"resumes": [{"from_step": 0}, {"from_step": 3, "saved_by": {"world_size": 2}, "world_size": 2},
                        {"from_step": 6, "saved_by": {"world_size": 2}, "world_size": 1}]}
    marks = resume_marks(info)
    assert marks == [(3, "resumed at step 3"), (6, "resumed at step 6 on 1 process (saved by 2)")]
    axes = Figure().subplots()
    _draw_panel(axes, [{"step": step, "loss": 1.0 / step} for step in range(1, 9)],
                Panel("loss", "loss", (Curve("loss", "loss"),)), bottom=True, resumes=marks)
    lines = {line.get_label(): line.get_xdata()[0] for line in axes.get_lines() if line.get_linestyle() == "-."}
    assert lines == {label: step for step, label in marks}


def test_a_deepspeed_checkpoint_its_converter_cannot_read_is_refused_in_one_line(tmp_path):
    """DeepSpeed's ds_to_universal failing on a checkpoint (here its optimizer file is not a torch file): one line
    naming the checkpoint, the converter's last line and log, and what works instead; nothing half-written is left
    in the checkpoint."""
    from src.config_error import ConfigError
    from src.run_safety.resharding import _convert

    checkpoint = tmp_path / "checkpoint-4"
    (checkpoint / "global_step4").mkdir(parents=True)
    (checkpoint / "latest").write_text("global_step4")
    (checkpoint / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a checkpoint")
    (checkpoint / "global_step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    refused = _convert(checkpoint, {"world_size": 2})
    assert isinstance(refused, ConfigError)
    assert str(refused).startswith(f"{checkpoint} could not be converted for another number of processes by "
                                   "DeepSpeed's ds_to_universal (exit 1: ") and str(refused).endswith(
        f"; its log: {checkpoint}/ds_to_universal.log): resume it on 2 processes (the split that saved it), or start "
        "afresh with --overwrite"), refused
    assert "\n" not in str(refused) and sorted(path.name for path in checkpoint.iterdir()) == [
        "ds_to_universal.log", "global_step4", "latest"]
