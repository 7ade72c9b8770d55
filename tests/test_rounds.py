"""On-policy rounds (--rounds, src/rounds.py): pairs formed from the policy's own judged answers, ties skipped, a
failing judge named in one line, resume inside a round, and the same pairs on 1 and 2 processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forked
from conftest import PROJECT_ROOT, preference_rows, write_jsonl
from src import run_files, seams
from src.generation import Sampling, answer_seed, generate
from src.rounds import form_pairs
from test_resilience import kill_tagged, seconds_until_gone, start_launcher

JUDGE = "tests.round_judges:by_length"


def round_args(model: Path, data: Path, results: Path, *extra: str) -> list[str]:
    return ["--stage", "dpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
            str(results), "--run_name", "iter", "--batch_size", "8", "--max_steps", "2", "--round_max_steps", "2",
            "--eval_strategy", "no", "--save_steps", "1", "--logging_steps", "1", "--num_samples", "4",
            "--max_new_tokens", "6", "--learning_rate", "1e-3", "--max_length", "64", "--val_size", "4",
            "--test_size", "4", "--seed", "7", "--judge", JUDGE, "--round_samples", "3", *extra]


def launch(args: list[str], processes: int = 0, **env) -> subprocess.CompletedProcess:
    """One process (`python -m src.main_distributed`), or `processes` as one job, forked (tests/forked.py)."""
    environment = os.environ | {"OMP_NUM_THREADS": "1"} | env
    if processes:
        return forked.run_job(processes, args, env=environment)
    return forked.run_main(args, env=environment)


def read_pairs(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "pairs" / "train.jsonl").read_text().splitlines()]


def test_each_prompt_pairs_its_best_answer_against_its_worst_and_ties_are_skipped():
    rows = [{"index": i, "prompt": [{"role": "user", "content": f"q{i}"}], "meta": {"i": i}} for i in range(4)]
    judged = [{"answers": ["a", "b", "c"], "scores": [1.0, 3.0, 0.0]},
              {"answers": ["a", "b", "c"], "scores": [2.0, 2.0, 2.0]},  # all equal: nothing to learn
              {"answers": ["x", "y", "z"], "scores": [0.0, 1.0, 1.0]},  # ties: the first best, the first worst
              {"answers": ["p", "q", "r"], "scores": [5.0, 5.0, -1.0]}]
    pairs, counts = form_pairs(rows, judged)
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [("b", "c"), ("y", "x"),
                                                                                          ("p", "r")]
    assert [p["source_row"] for p in pairs] == [0, 2, 3] and pairs[0]["meta"] == {"i": 0}
    assert (pairs[0]["chosen_score"], pairs[0]["rejected_score"]) == (3.0, 0.0)
    assert counts | {"mean_score": None} == {"prompts": 4, "answers": 12, "pairs": 3, "skipped_all_equal": 1,
                                             "unclosed_answers": 0, "mean_score": None,
                                             "best_of_k_score": (3 + 2 + 1 + 5) / 4}
    text_pairs, _ = form_pairs([{"index": 0, "prompt": "q", "meta": {}}], [{"answers": ["a", "b"], "scores": [0, 1]}])
    assert (text_pairs[0]["chosen"], text_pairs[0]["rejected"]) == ("b", "a")  # a text prompt gets text answers
    # An answer cut inside its reasoning (R1: the prompt opened <think>, no </think>) is never paired.
    thinking = [{"answers": ["<think>\nhm</think>\n\n4", "<think>\nhm hm", "<think>\nx</think>\n\n5"],
                 "scores": [1.0, 0.0, 0.5]}]
    reasoning_pairs, reasoning_counts = form_pairs(rows[:1], thinking)
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in reasoning_pairs] == [
        ("<think>\nhm</think>\n\n4", "<think>\nx</think>\n\n5")]
    assert reasoning_counts["unclosed_answers"] == 1


def test_a_sampled_answer_depends_on_its_seed_not_on_its_batch(tiny_model, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    prompts = [tiny_tokenizer(f"what color is the sky {i}")["input_ids"][: 3 + i % 4] for i in range(7)]
    seeds = [answer_seed(7, 1, i, 0) for i in range(7)]
    sampling = Sampling(temperature=1.0, top_p=0.9)
    alone = [generate(model, tiny_tokenizer, [p], 8, 1, sampling, [s])[0] for p, s in zip(prompts, seeds)]
    assert generate(model, tiny_tokenizer, prompts, 8, 3, sampling, seeds) == alone
    assert generate(model, tiny_tokenizer, prompts[::-1], 8, 7, sampling, seeds[::-1]) == alone[::-1]
    other = generate(model, tiny_tokenizer, prompts, 8, 7, sampling, [seed + 1 for seed in seeds])
    assert other != alone  # another seed, other draws
    assert generate(model, tiny_tokenizer, prompts, 8, 7) != alone  # greedy is not sampling


def test_a_reward_model_judges_a_round_whose_reference_is_the_dpo_stages_start(tiny_model, tmp_path):
    """--judge DIR: a sequence classifier (here the tiny model with a fresh one-output head, saved like a reward
    stage's model) scores every answer; its own scores rank each pair. The same launch: --round_reference start keeps
    the DPO stage's starting model as the round's reference."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

    from src.judges import RewardModelJudge

    set_seed(3)
    reward_dir = tmp_path / "reward_model"
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    model.config.pad_token_id = AutoTokenizer.from_pretrained(tiny_model).pad_token_id
    model.save_pretrained(reward_dir)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(reward_dir)
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    result = launch(round_args(tiny_model, data, tmp_path / "results", "--rounds", "1", "--judge", str(reward_dir),
                               "--round_reference", "start"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "results" / "iter"
    assert run_files.read_json(run_dir / "training_info.json")["round"]["reference"] == "start"
    first = next(r for r in run_files.read_jsonl(run_dir / "metrics.jsonl") if "rewards/chosen" in r)
    assert first["rewards/chosen"] != 0  # the policy left the reference (the tiny model) in the DPO stage
    pairs = read_pairs(run_dir)
    assert pairs and run_files.read_json(run_dir / "round.json")["counts"]["skipped_all_equal"] == 16 - len(pairs)
    judge = RewardModelJudge(str(reward_dir), device="cpu")
    chosen = judge.score([pair["prompt"] for pair in pairs], [pair["chosen"][0]["content"] for pair in pairs])
    rejected = judge.score([pair["prompt"] for pair in pairs], [pair["rejected"][0]["content"] for pair in pairs])
    assert chosen == pytest.approx([pair["chosen_score"] for pair in pairs], abs=1e-5)
    assert all(c > r for c, r in zip(chosen, rejected))
    assert run_files.read_json(run_dir / "training_info.json")["judge"]["metric"] == "win_rate"


FAILING_JUDGES = [
    ("raising", "round 1: judge tests.round_judges:raising, prompt 'what color is the sun ",
     "': raised ValueError: cannot parse the answer"),
    ("not_a_number", "round 1: judge tests.round_judges:not_a_number, prompt 'what color is the sea ",
     "': returned 'yes'; a judge returns a finite number"),
    ("always_one", "round 1: no pairs: the judge gave all 3 answers to each of the 16 prompts the same score", ""),
]


def test_a_failing_judge_stops_the_run_with_one_line_and_keeps_what_finished(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    dpo_info = tmp_path / "results" / "iter" / "dpo" / "training_info.json"
    for launch_number, (judge, expected, value) in enumerate(FAILING_JUDGES):
        # --audit_judge_pairs 0: the data audit would meet the failing judge first, on the data's own pairs
        result = launch(round_args(tiny_model, data, tmp_path / "results", "--rounds", "1", "--judge",
                                   f"tests.round_judges:{judge}", "--audit_judge_pairs", "0"))
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1 and expected in errors[0], result.stderr[-2000:]
        assert value in errors[0] and "Traceback" not in result.stderr + result.stdout
        # The DPO stage before the round is kept (trained once), and every later launch reuses it.
        assert run_files.read_json(dpo_info)["status"] == "completed"
        assert ("finished in an earlier launch, reused" in result.stdout) == (launch_number > 0)


def test_an_unimportable_judge_is_refused_before_any_data_is_prepared(tiny_model, tmp_path):
    """Before the tokenizer too: the process has imported neither torch nor transformers when it says so."""
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    args = round_args(tiny_model, data, tmp_path / "results", "--rounds", "1", "--judge", "tests.no_such_module:score",
                      "--dry_run")
    script = ("import sys\nfrom src.main_distributed import main\ncode = main(sys.argv[1:])\n"
              "print('imported:', [name for name in ('torch', 'transformers') if name in sys.modules])\nsys.exit(code)")
    result = subprocess.run([sys.executable, "-c", script, *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and "error: --judge tests.no_such_module:score: cannot import tests.no_such_module" \
        in result.stderr
    assert "Traceback" not in result.stderr and "train " not in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "imported: []", result.stdout[-2000:]


def test_a_round_stopped_in_its_judging_resumes_there_and_keeps_the_rounds_before(tiny_model, tmp_path):
    """Two rounds; the judge goes down in round 2, the relaunch resumes there, and the finished run trained on the
    judged pairs of each round and reports every round (the judge scores as by_length while it is up)."""
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    mark = tmp_path / "judge_down"
    args = round_args(tiny_model, data, tmp_path / "results", "--rounds", "2", "--judge",
                      "tests.round_judges:fails_after_first_round")
    run_dir = tmp_path / "results" / "iter"
    env = {"ROUND_JUDGE_MARK": str(mark), "ROUND_JUDGE_AFTER": str(run_dir / "round1" / "round.json")}
    # Round 1 finishes; the judge goes down in round 2 (it fails once round 1 is recorded, while the mark exists).
    mark.touch()
    first = launch(args, **env)
    out, err = first.stdout, first.stderr
    assert first.returncode == 2 and "judge service unavailable" in err, out[-2000:] + err[-2000:]
    assert "DPO ROUND 1 of 2" in out and "pairs from 16 prompts" in out
    pairs_before = (run_dir / "round1" / "pairs" / "train.jsonl").read_bytes()
    mark.unlink()
    second = launch(args, **env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "DPO → " in second.stdout and "finished in an earlier launch, reused" in second.stdout
    assert "DPO ROUND 1 of 2 → " in second.stdout and "round 1: sampling" not in second.stdout
    assert "round 2: sampling" in second.stdout
    assert (run_dir / "round1" / "pairs" / "train.jsonl").read_bytes() == pairs_before
    assert_trained_on_the_judged_pairs_and_reported_every_round(run_dir)


def assert_trained_on_the_judged_pairs_and_reported_every_round(run_dir: Path) -> None:
    """A finished --rounds 2 run judged by by_length's scores: each round's pairs, records, report and plot."""
    from tests.round_judges import by_length

    for directory in (run_dir / "round1", run_dir):
        pairs = read_pairs(directory)
        record = run_files.read_json(directory / "round.json")
        assert record["counts"]["prompts"] == 16 and record["counts"]["answers"] == 48
        assert len(pairs) == record["counts"]["pairs"] == 16 - record["counts"]["skipped_all_equal"] > 0
        for pair in pairs:  # the judge's own scores, best above worst
            assert pair["chosen_score"] == by_length({}, pair["chosen"][0]["content"]) > \
                   pair["rejected_score"] == by_length({}, pair["rejected"][0]["content"])
        held_out = [json.loads(line) for line in (directory / "pairs" / "validation.jsonl").read_text().splitlines()]
        assert len(held_out) == 4 and held_out[0]["chosen_score"] is None  # the run's own held-out pairs
    assert read_pairs(run_dir) != read_pairs(run_dir / "round1")  # another model, another round's seeds
    info = run_files.read_json(run_dir / "training_info.json")
    assert info["round"]["round"] == 2 and info["status"] == "completed"
    assert [entry["round"] for entry in info["rounds"]] == [0, 1, 2]
    assert info["rounds"][1]["pairs"] == run_files.read_json(run_dir / "round1" / "round.json")["counts"]["pairs"]
    assert all(entry["judged"]["val"]["metric"] == "score" for entry in info["rounds"])
    previous = run_files.read_json(run_dir / "round1" / "training_info.json")
    assert previous["model_name_or_path"] == str(run_dir / "dpo" / "model" / "final")  # round 1 starts from DPO
    assert info["model_name_or_path"] == str(run_dir / "round1" / "model" / "final")
    first = next(r for r in run_files.read_jsonl(run_dir / "round1" / "metrics.jsonl") if "rewards/chosen" in r)
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0  # reference = the round's starting model
    report = (run_dir / "report.md").read_text()
    assert "## Rounds" in report and "| round 2 |" in report and (run_dir / "plots" / "rounds.png").exists()


def test_two_processes_make_the_same_pairs_as_one_and_a_stopped_round_resumes_from_its_checkpoint(tiny_model,
                                                                                                   tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    one = launch(round_args(tiny_model, data, tmp_path / "one", "--rounds", "1"), processes=1)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]

    # Two processes, the launcher's process group killed (kill -9) during round 1's sampling, then during its
    # reference pass (seams: rank 0 kills it at that moment): nothing of the launch runs 10 s later, and the same
    # command relaunched at once goes on.
    # 10 round steps: the SIGTERM below lands at the end of step 3 (a seam), the stop at that step's end or the next
    args = round_args(tiny_model, data, tmp_path / "two", "--rounds", "1", "--round_max_steps", "10")
    for moment in ("sampling", "reference"):
        killed, tag = tmp_path / f"killed-{moment}", f"{tmp_path}-{moment}"
        started = time.monotonic()
        planted = seams.env({}, kill_starter=f"{moment}:{killed}", run_tag=tag)
        job = start_launcher(args, tmp_path / f"{moment}.log", **planted)
        try:
            job.wait(timeout=600)
            assert killed.exists(), (tmp_path / f"{moment}.log").read_text()[-3000:]
            print(f"killed during {moment} after {time.monotonic() - started:.0f} s: its processes ended "
                  f"{seconds_until_gone(tag):.1f} s after the kill")
        finally:
            kill_tagged(tag)
    assert "round 1: sampling" in (tmp_path / "reference.log").read_text(), "round 1 sampled again: nothing kept"

    # Stopped by SIGTERM to the launcher's process group at the end of round 1's third training step (its pairs
    # written; a seam: rank 0 sends it, the offline stage has 2 steps), then the same command again.
    log, signalled = tmp_path / "two.log", tmp_path / "signalled"
    job = start_launcher(args, log, **seams.env({}, kill_starter=f"step:3:{signalled}:TERM"))
    try:
        job.wait(timeout=600)
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    assert signalled.exists(), log.read_text()[-3000:]
    run_dir = tmp_path / "two" / "iter"
    info = run_files.read_json(run_dir / "training_info.json")
    assert info["status"] == "stopped", log.read_text()[-3000:]
    pairs_written = (run_dir / "pairs" / "train.jsonl").read_bytes()
    two = launch(args, processes=2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "round 1: pairs written by an earlier launch, reused" in two.stdout and "resuming from" in two.stdout
    assert (run_dir / "pairs" / "train.jsonl").read_bytes() == pairs_written
    assert read_pairs(run_dir) == read_pairs(tmp_path / "one" / "iter")  # same seed: same answers, same pairs


def prompts_rows(count: int) -> list[dict]:
    """The toy pairs' prompts alone, each with a `meta` a judge could read."""
    return [{"prompt": row["prompt"], "meta": {"colour": row["chosen"][0]["content"].split()[-1]}}
            for row in preference_rows(count)]


def round_one_pairs_in_this_process(model_dir: Path, data: Path) -> list[dict]:
    """Round 1 of a run from prompts as one process makes it: the given model (nothing trains before round 1) answers
    the train prompts with the round's seeds, by_length scores them, best against worst."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.config import DataArguments, SFTArguments
    from src.world import World
    from src.data import PROMPTS, prepare_data
    from src.run_safety.build_once import cache_root
    from src.judges import judge_for
    from src.rounds import RoundSettings, sample_and_judge, train_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = prepare_data(DataArguments(dataset_name=str(data), val_size=4, test_size=4, max_length=64),
                           SFTArguments(), PROMPTS, 7, tokenizer, cache_root() / "datasets")
    settings = RoundSettings(samples=3, prompts=0, sampling=Sampling(1.0, 1.0), max_new_tokens=6, batch_size=5, seed=7)
    rows = train_prompts(prompts.train, tokenizer, 0, 7, 1)
    judged = sample_and_judge(AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, rows, judge_for(JUDGE, None),
                              settings, 1, World())
    return json.loads(json.dumps(form_pairs(rows, judged)[0]))


def test_rounds_from_prompts_alone_start_from_the_model_pair_as_one_process_and_resume_by_round(tiny_model, tmp_path):
    """Prompts with a meta and no answers, --rounds 2 on 2 processes: no offline DPO stage, round 1 starts from the
    given model and its pairs are the ones one process makes; the held-out prompts are judged before and after each
    round; report, rounds table and plot. A relaunch after a kill once round 2's pairs were written reuses round 1
    and those pairs; the same command on a finished run exits 0."""
    data = write_jsonl(tmp_path / "prompts.jsonl", prompts_rows(24))
    args = round_args(tiny_model, data, tmp_path / "results", "--rounds", "2")
    two = launch(args, processes=2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    run_dir = tmp_path / "results" / "iter"
    assert not (run_dir / "dpo").exists() and "== DPO → " not in two.stdout
    first = run_files.read_json(run_dir / "round1" / "training_info.json")
    assert first["model_name_or_path"] == str(tiny_model) and first["round"]["from_prompts"]
    assert first["judges"]["val"]["n"] == first["judges"]["test"]["n"] == 4  # the held-out prompts, judged
    assert sorted(path.name for path in (run_dir / "round1" / "pairs").iterdir()) == ["train.jsonl"]
    pairs = read_pairs(run_dir / "round1")
    assert len(pairs) > 4 and pairs == round_one_pairs_in_this_process(tiny_model, data)
    sample = run_files.read_jsonl(run_dir / "samples_test.jsonl")[0]
    assert sample["chosen"] is None and sample["meta"]["colour"] and sample["verdict"] is not None
    info = run_files.read_json(run_dir / "training_info.json")
    assert [entry["round"] for entry in info["rounds"]] == [1, 2] and info["status"] == "completed"
    assert info["rounds"][1]["judged"]["test"]["before"] == pytest.approx(info["rounds"][0]["judged"]["test"]["after"])
    report = (run_dir / "report.md").read_text()
    assert "after 2 on-policy rounds from prompts alone" in report and "| round 2 |" in report
    assert (run_dir / "plots" / "rounds.png").exists()
    from src.reporting.compare import load_runs, rounds_rows

    row = [cell.strip() for cell in rounds_rows(load_runs([run_dir]))[-1].strip("|").split("|")]
    assert row[4] == "—" and all(cell.endswith("%") for cell in row[3:4] + row[5:]) and len(row) == 7, row

    pairs_written = (run_dir / "pairs" / "train.jsonl").read_bytes()
    (run_dir / run_files.TRAINING_INFO).unlink()  # as a kill leaves it once round 2's pairs are written
    shutil.rmtree(run_dir / "model")
    again = launch(args)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "finished in an earlier launch, reused" in again.stdout and "round 1: sampling" not in again.stdout
    assert "round 2: pairs written by an earlier launch, reused" in again.stdout
    assert (run_dir / "pairs" / "train.jsonl").read_bytes() == pairs_written
    finished = launch(args)
    assert finished.returncode == 0 and "is already finished" in finished.stdout, finished.stdout + finished.stderr


def test_a_round_where_every_answer_ties_names_what_the_judge_returned_and_what_to_change():
    from src.rounds import RoundSettings, no_pairs_line

    settings = RoundSettings(samples=4, prompts=0, sampling=Sampling(0.7, 1.0), max_new_tokens=8, batch_size=8, seed=1)
    judged = [{"scores": [0.0] * 4}] * 3 + [{"scores": [1.0] * 4}]
    assert no_pairs_line(2, settings, [{}] * 4, judged) == (
        "round 2: no pairs: the judge gave all 4 answers to each of the 4 prompts the same score (it returned 0 x 12, "
        "1 x 4); raise --round_samples (now 4) or --round_temperature (now 0.7), or use a judge with more levels "
        "(partial credit, a reward model) that tells the answers apart")
