"""The data and answer audit (src/audit/): defects planted at known rates are reported at those rates, a judge finds
the swapped labels, a clean set raises nothing, and the standalone command reads 100k pairs in seconds."""

from __future__ import annotations

import json
import random
import time

import pytest

from conftest import write_jsonl
from src import run_files
from src.audit.__main__ import main as audit_main
from src.audit.answers import answers_audit
from src.audit.findings import audit_alerts, data_alerts
from src.generation import answer_record, repetition

MAX_LENGTH = 128
TAIL = " and so on," * 18  # ~200 characters: prompt + answer well past --max_length (the embedded tokenizer: characters)


def _answer(a: int, b: int, total: int, long: bool, tail: bool) -> str:
    if not long:
        return str(total)
    return f"the sum of {a} and {b} is {total}, which you can check by counting{TAIL if tail else ''}."


def planted_sums(count: int = 2000, seed: int = 0) -> tuple[list[dict], dict]:
    """`count` rows of sums with the issue's defects: 7.5% chosen == rejected, 11% exact copies of other rows, 11% of
    the pairs with the wrong sum chosen, the chosen answer the longer one in two pairs of three, a fifth of the pairs
    with an answer past --max_length 128. Returns the rows and which source rows (1-based) are swapped."""
    rng = random.Random(seed)
    copies, identical = round(0.11 * count), round(0.075 * count)
    unique = count - copies
    kept = count - identical
    swapped = set(rng.sample(range(identical, unique), round(0.11 * kept)))
    rows, kinds = [], []
    for index in range(unique):
        a, b = rng.randrange(10, 99), rng.randrange(10, 99)
        prompt = f"q{index}: what is {a} + {b}?"
        if index < identical:
            rows.append({"prompt": prompt, "chosen": str(a + b), "rejected": str(a + b)})
            kinds.append("identical")
            continue
        wrong = a + b + rng.randrange(1, 9)
        chosen_longer = rng.random() < 2 / 3
        tail = rng.random() < 0.2
        good = _answer(a, b, a + b, chosen_longer, tail and chosen_longer)
        bad = _answer(a, b, wrong, not chosen_longer, tail and not chosen_longer)
        if index in swapped:  # the wrong sum chosen, lengths as planned
            good = _answer(a, b, wrong, chosen_longer, tail and chosen_longer)
            bad = _answer(a, b, a + b, not chosen_longer, tail and not chosen_longer)
        rows.append({"prompt": prompt, "chosen": good, "rejected": bad})
        kinds.append("swapped" if index in swapped else "clean")
    originals = [index for index, kind in enumerate(kinds) if kind == "clean"]
    for _ in range(copies):
        original = rng.choice(originals)
        rows.append(dict(rows[original]))
        kinds.append("copy")
    order = list(range(count))
    rng.shuffle(order)
    rows = [rows[index] for index in order]
    kinds = [kinds[index] for index in order]
    return rows, {"swapped_rows": {number + 1 for number, kind in enumerate(kinds) if kind == "swapped"}}


def clean_sums(count: int, seed: int, offset: int = 0) -> list[dict]:
    """Right sums chosen, the longer answer chosen in every other pair, nothing cut, repeated or identical."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b = rng.randrange(10, 99), rng.randrange(10, 99)
        long = index % 2 == 0
        rows.append({"prompt": f"q{offset + index}: what is {a} + {b}?", "chosen": _answer(a, b, a + b, long, False),
                     "rejected": _answer(a, b, a + b + 1 + index % 7, not long, False)})
    return rows


def _truth(rows: list[dict]) -> dict:
    """The planted rates, counted from the rows themselves (characters stand for tokens: the tokenizer is
    character-level, and the planted lengths differ by tens of characters)."""
    kept = [row for row in rows if row["chosen"] != row["rejected"]]
    seen, repeats = set(), 0
    for row in rows:
        key = json.dumps(row, sort_keys=True)
        repeats += key in seen
        seen.add(key)
    cut = lambda answer: len(answer) > 150  # noqa: E731 - the tails; untailed answers are under 70 characters
    return {"identical_share": (len(rows) - len(kept)) / len(rows), "duplicate_share": repeats / len(rows),
            "chosen_longer_share": sum(len(r["chosen"]) > len(r["rejected"]) for r in kept) / len(kept),
            "chosen_truncated_share": sum(cut(r["chosen"]) for r in kept) / len(kept),
            "rejected_truncated_share": sum(cut(r["rejected"]) for r in kept) / len(kept)}


def _split_dir(tmp_path, train: list[dict]):
    directory = tmp_path / "sums"
    write_jsonl(directory / "train.jsonl", train)
    write_jsonl(directory / "validation.jsonl", clean_sums(40, seed=1, offset=100_000))
    write_jsonl(directory / "test.jsonl", clean_sums(40, seed=2, offset=200_000))
    return directory


def _audit_args(data, results, name: str) -> list[str]:
    return ["--stage", "dpo", "--dataset_name", str(data), "--max_length", str(MAX_LENGTH), "--results_dir",
            str(results), "--run_name", name, "--judge", "tests.round_judges:sum_checker", "--audit_judge_pairs",
            "5000"]


def test_planted_defects_are_reported_at_their_rates_and_the_judge_finds_the_swapped_labels(tmp_path, capsys):
    rows, planted = planted_sums()
    data = _split_dir(tmp_path, rows)
    status = audit_main(_audit_args(data, tmp_path / "results", "planted"))
    printed = capsys.readouterr().out
    assert status == 1, printed  # warnings fired
    audit = run_files.read_json(tmp_path / "results" / "audit-planted" / "data_audit.json")["dpo"]
    train = audit["train"]
    truth = _truth(rows)
    assert truth["identical_share"] == pytest.approx(0.075) and truth["duplicate_share"] == pytest.approx(0.11)
    assert abs(truth["chosen_longer_share"] - 2 / 3) < 0.03 and abs(truth["chosen_truncated_share"] +
                                                                    truth["rejected_truncated_share"] - 0.2) < 0.03
    for key, value in truth.items():
        assert abs(train[key] - value) <= 0.01, (key, train[key], value)
    assert train["rows"] == 2000 and train["pairs"] == 1850 and train["identical_pairs"] == 150
    # The judge saw every kept pair: the swapped ones are the inverted ones, named by their row in the file.
    inverted = [json.loads(line) for line in
                (tmp_path / "results" / "audit-planted" / "data_audit_inverted.jsonl").read_text().splitlines()]
    found = {row["row"] for row in inverted}
    swapped = planted["swapped_rows"]
    recall, precision = len(found & swapped) / len(swapped), len(found & swapped) / max(len(found), 1)
    assert recall >= 0.95 and precision >= 0.95, (recall, precision)
    assert abs(train["judge_inverted_share"] - len(swapped) / 1850) <= 0.01
    assert all(row["source"].endswith("sums") for row in inverted)
    codes = {alert.code for alert in data_alerts(audit, "dpo")}
    assert {"data_length_bias", "data_inverted_labels", "data_truncation", "data_duplicates",
            "data_identical"} <= codes
    assert "--label_smoothing" in printed and f"--max_length {train['suggested_max_length']}" in printed


def test_a_clean_set_raises_no_warning(tmp_path, capsys):
    data = _split_dir(tmp_path, clean_sums(600, seed=3))
    status = audit_main(_audit_args(data, tmp_path / "results", "clean"))
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "Data audit: no alerts." in printed
    train = run_files.read_json(tmp_path / "results" / "audit-clean" / "data_audit.json")["dpo"]["train"]
    assert train["judge_inverted_share"] == 0 and train["duplicate_share"] == 0
    assert train["chosen_longer_share"] == pytest.approx(0.5)


def test_the_standalone_audit_reads_30k_pairs_and_finds_their_copies(tmp_path, capsys):
    """At a size past one preparation chunk; its speed at 100k pairs is bench/bench_audit_cost.py's (docs/data-audit.md)."""
    rows = clean_sums(27_000, seed=4)
    rows += [dict(row) for row in rows[:3_000]]  # 10% copies
    data = write_jsonl(tmp_path / "big.jsonl", rows)
    started = time.monotonic()
    status = audit_main(["--stage", "dpo", "--dataset_name", str(data), "--results_dir", str(tmp_path / "results"),
                         "--run_name", "big", "--max_length", str(MAX_LENGTH)])
    seconds = time.monotonic() - started
    printed = capsys.readouterr().out
    assert status == 1 and "exact copies" in printed, printed
    audit = run_files.read_json(tmp_path / "results" / "audit-big" / "data_audit.json")["dpo"]
    rows_seen = sum(audit[kind]["rows"] for kind in audit)
    assert rows_seen == 30_000
    assert audit["train"]["judge_inverted_share"] is None  # no judge for this data
    print(f"30k pairs audited in {seconds:.1f} s")


def test_the_audit_of_data_alone_does_not_import_torch(tmp_path):
    """`python -m src.audit --dataset_name F` (no model part, no judge that loads one) counts tokens with the
    tokenizer alone: transformers would import torch with it (~3 s of CPU), src/unneeded_libraries.py's without_torch
    keeps it out. A fresh interpreter: the pytest process has torch imported. The embedded model whose tokenizer
    counts the tokens is built already, as after a machine's first run (building its weights needs torch)."""
    import subprocess
    import sys

    from conftest import PROJECT_ROOT, preference_rows
    from src.embedded.model import ensure_embedded_model

    ensure_embedded_model()
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(30, seed=9))  # new data: prepared, not read back
    script = ("import sys\nfrom src.audit.__main__ import main\ncode = main(sys.argv[1:])\n"
              "print('imported:', [name for name in ('torch', 'transformers', 'datasets') if sys.modules.get(name)])\n"
              "sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", script, "--dataset_name", str(data), "--results_dir",
                             str(tmp_path / "results")], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    assert "| pairs | 2" in result.stdout and "chosen tokens: mean" in result.stdout, result.stdout[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "imported: ['transformers', 'datasets']", result.stdout[-2000:]


def test_a_mistake_in_the_audits_flags_is_one_line(tmp_path, capsys):
    status = audit_main(["--dataset_name", str(tmp_path / "missing.jsonl"), "--stage", "dpo"])
    error = capsys.readouterr().err
    assert status == 2 and error.startswith("error: ") and len(error.strip().splitlines()) == 1, error


# ----------------------------------------------------------------------------------------------- answers, findings


def test_repetition_is_seq_rep_4_and_an_answer_record_knows_where_it_ended():
    assert repetition([1, 2, 3, 4, 5, 6]) == 0
    assert repetition([7, 8] * 10) == pytest.approx(1 - 2 / 17)  # 17 four-grams, 2 distinct
    record = answer_record("ab", [5, 6, 0, 0], eos_ids={0})
    assert (record["tokens"], record["ended"]) == (2, True)
    assert answer_record("ab", [5, 6, 7, 8], eos_ids={0})["ended"] is False


def _sample(before_tokens, after_tokens, ended_after=True, repeat_after=0.0, score=(0, 1)):
    return {"reference_answer": "x" * before_tokens, "trained_answer": "y" * after_tokens,
            "verdict": {"reference": {"score": score[0]}, "trained": {"score": score[1]}},
            "answer_stats": {"reference": {"tokens": before_tokens, "ended": True, "repetition": 0.0},
                             "trained": {"tokens": after_tokens, "ended": ended_after, "repetition": repeat_after}}}


def test_answers_that_grew_looped_and_were_cut_are_alerted_and_steady_ones_are_not():
    grown = [_sample(10, 40, ended_after=index % 4 != 0, repeat_after=0.8 if index % 5 == 0 else 0.0)
             for index in range(20)]
    audit = answers_audit(grown)
    assert audit["length_ratio"] == pytest.approx(4.0)
    assert audit["cut_share_after"] == pytest.approx(0.25) and audit["repetition_share_after"] == pytest.approx(0.2)
    assert audit["judged_by_length"]["longer"] == {"n": 20, "mean_change": 1.0}
    codes = {alert.code for alert in audit_alerts({"stage": "dpo", "answers": {"test": audit}})}
    assert codes == {"answers_longer", "answers_repetition", "answers_cut"}
    steady = answers_audit([_sample(10, 11) for _ in range(20)])
    assert audit_alerts({"stage": "dpo", "answers": {"test": steady}}) == []
    assert answers_audit([{"reference_answer": "a", "trained_answer": "b"}]) is None  # a run from before the audit


def test_reasoning_answers_are_measured_apart_and_cut_reasoning_names_max_new_tokens():
    """An answer that reasons (its text starts with <think>): its reasoning tokens up to and with </think> (ids 9),
    whether it closed; the audit's reasoning and final-answer lengths, the unclosed and cut-inside-reasoning shares."""
    closed = answer_record("<think>\nhm\n</think>\n\n42", [5, 6, 9, 7, 0], eos_ids={0}, close_ids=[9])
    assert (closed["tokens"], closed["reasoning_tokens"], closed["closed"]) == (4, 3, True)
    cut = answer_record("<think>\nhm hm hm", [5, 6, 6, 6], eos_ids={0}, close_ids=[9])
    assert (cut["reasoning_tokens"], cut["closed"], cut["ended"]) == (4, False, False)
    assert "reasoning_tokens" not in answer_record("42", [7, 0], eos_ids={0}, close_ids=[9])

    def sample(trained: dict) -> dict:
        return {"reference_answer": "a", "trained_answer": "b",
                "answer_stats": {"reference": {"tokens": 4, "ended": True, "repetition": 0.0,
                                               "reasoning_tokens": 3, "closed": True},
                                 "trained": {"repetition": 0.0, **trained}}}

    samples = ([sample({"tokens": 10, "ended": True, "reasoning_tokens": 8, "closed": True})] * 6 +
               [sample({"tokens": 16, "ended": False, "reasoning_tokens": 16, "closed": False})] * 3 +
               [sample({"tokens": 5, "ended": True, "reasoning_tokens": 5, "closed": False})])
    audit = answers_audit(samples)
    assert audit["reasoning_share_after"] == 1.0 and audit["reasoning_length_after"]["median"] == 8.0
    assert audit["final_answer_length_after"] == {"mean": 2.0, "median": 2.0}
    assert audit["unclosed_share_after"] == pytest.approx(0.4) and audit["cut_in_reasoning_share_after"] == 0.3
    assert audit["unclosed_share_before"] == 0.0
    alerts = {alert.code: alert for alert in audit_alerts({"stage": "dpo", "answers": {"test": audit}})}
    assert "--max_new_tokens" in alerts["answers_cut_in_reasoning"].advice
    assert "answers_unclosed_reasoning" in alerts
    from src.reporting.audit import answers_section

    section = "\n".join(answers_section({"test": audit}))
    assert "| cut inside the reasoning (no answer) | 0.0% → 30.0% |" in section
    assert "| reasoning tokens: median before → after | 3 → 8 |" in section


def test_a_judge_that_fails_on_the_datas_own_pairs_is_one_line(tmp_path, capsys, preference_file):
    status = audit_main(["--stage", "dpo", "--dataset_name", str(preference_file), "--results_dir",
                         str(tmp_path / "results"), "--judge", "tests.round_judges:not_a_number"])
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if line.startswith("error")]  # (a first use builds the embedded
    assert status == 2 and len(lines) == 1 and "Traceback" not in error, error  # model: its progress bar)
    assert lines[0].startswith("error: data audit: judge tests.round_judges:not_a_number, prompt 'what color is the sea")
