"""The table of objectives (src/objectives/): every row complete and true to TRL, and no code outside the objectives'
folder deciding by an objective's name. The three misses the table closes (issue 37), each failing before it:
compare drew no KTO curve, the console never showed KTO's KL, and --stage kto trained an encoder-only model (that one
is tests/test_user_mistakes.py's `encoder_only_kto`)."""

from __future__ import annotations

import ast
import dataclasses
import math
import typing
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT
from report_fixtures import training_info, write_run_dir
from src.objectives import (OBJECTIVES, PAIRED_SHAPES, PIPELINES, PROMPTS, SEQUENCES, STAGES, UNPAIRED, infer_stage,
                            load, objective)
from src.objectives.spec import Objective
from src.reporting.alerts import CHECKS

SRC = PROJECT_ROOT / "src"
SHAPES = PAIRED_SHAPES + (UNPAIRED, SEQUENCES, PROMPTS)


# ------------------------------------------------------------------------------------------------ the rows themselves


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_row_is_complete_and_names_what_exists(name):
    row = OBJECTIVES[name]
    assert row.name == name and row.data_shape in SHAPES and row.example_word
    assert 1 <= row.memory.sequences_with_grad <= row.memory.sequences_per_example
    assert row.training.trl_settings is not None
    assert callable(load(row.training.trainer))
    config_class = load(row.training.trl_config)
    # TRL's own default learning rate (the plan's fallback): the row's must be it, or the plan silently changes
    assert config_class.__dataclass_fields__["learning_rate"].default == row.training.default_learning_rate
    assert set(row.report.alerts) <= set(CHECKS) | {"data_near_identical"}
    assert set(row.report.audit_parts) <= {"reference", "judged"}
    files = [chart.filename for chart in row.report.charts]
    assert len(files) == len(set(files)) and row.report.charts[0].filename == "loss.png"
    assert row.report.compare_metrics and row.report.compare_metrics[0].key == "loss"
    for number in row.report.summary_numbers:
        assert number.label.startswith("final ")


def test_stages_and_pipelines_come_from_the_table():
    assert STAGES[:6] == ("dpo", "sft", "sft_then_dpo", "reward", "kto", "sft_then_kto")  # as before the table
    assert {name: PIPELINES[name] for name in ("sft_then_dpo", "sft_then_kto")} == {
        "sft_then_dpo": ("sft", "dpo"), "sft_then_kto": ("sft", "kto")}
    assert all(PIPELINES[f"sft_then_{name}"] == ("sft", name) for name, row in OBJECTIVES.items() if row.ends_pipeline)
    assert objective("sft_then_kto") is OBJECTIVES["kto"]


def test_the_stage_of_an_old_run_is_read_from_its_curves():
    assert infer_stage([{"loss": 0.6, "rewards/margins": 0.1, "rewards/accuracies": 0.6}]) == "dpo"
    assert infer_stage([{"loss": 0.5, "rewards/margins": 0.1, "rewards/chosen": 0.1, "kl": 0.2}]) == "kto"
    assert infer_stage([{"loss": 0.6, "margin": 0.1}]) == "reward"
    assert infer_stage([{"loss": 2.0}]) == "sft"


# ------------------------------------------------------------------------------------------- the misses the table closes


def kto_history(steps: int = 40, shift: float = 0.0) -> list[dict]:
    """A KTO run's records as TRL's KTOTrainer logs them (the margin grows, the KL with it), eval every 10 steps."""
    records = []
    for step in range(1, steps + 1):
        margin = (0.8 + shift) * (1 - math.exp(-step / 15))
        record = {"step": step, "loss": 0.5 - 0.2 * margin, "kl": 0.3 * margin, "rewards/chosen": margin / 2,
                  "rewards/rejected": -margin / 2, "rewards/margins": margin, "learning_rate": 1e-6,
                  "grad_norm": 1.0}
        records.append(record)
        if step % 10 == 0:
            records.append({"step": step, "eval_loss": record["loss"] + 0.01, "eval_kl": record["kl"],
                            "eval_rewards/margins": margin})
    return records


def test_compare_draws_the_kto_curves(tmp_path):
    """Before the table: compare's metric table had no `kto` row, so KTO runs got a heading and no curve."""
    from src.reporting.compare import compare

    for name, shift in (("kto_a", 0.0), ("kto_b", 0.3)):
        write_run_dir(tmp_path / name, kto_history(shift=shift), training_info("kto", run_name=name, beta=0.1,
                                                                              loss_type="kto"))
    page = compare([str(tmp_path / "kto_a"), str(tmp_path / "kto_b")], str(tmp_path / "out"))
    text = page.read_text(encoding="utf-8")
    curves = [line for line in text.splitlines() if line.startswith("![")]
    assert len(curves) == len(OBJECTIVES["kto"].report.compare_metrics), text
    assert "](kl.png)" in text and (page.parent / "kl.png").stat().st_size > 10_000
    assert "](rewards_margins.png)" in text


def test_reports_name_an_objective_by_its_title(tmp_path):
    """Where a user reads a stage's name (the model card, compare, the index, report.md's heading), it is the row's
    title: "SimPO", not "SIMPO" (they wrote `stage.upper()`)."""
    from src.reporting.compare import Run, render_page
    from src.reporting.index import _stage
    from src.reporting.model_card import _method_table
    from src.reporting.report import _headline, stage_label

    info = {"stage": "simpo", "previous_stage": {"stage": "sft"}}
    assert stage_label("simpo") == "SimPO" and stage_label("round2") == "ROUND 2" and stage_label("dpo") == "DPO"
    assert "| stage | SFT then SimPO (this model is after SimPO) |" in _method_table(info, False)
    assert _stage(info, tmp_path) == "SFT → SimPO"
    runs = [Run("a", tmp_path / "a", {"stage": "simpo"}, [], "simpo"), Run("b", tmp_path / "b", {"stage": "dpo"}, [],
                                                                            "dpo")]
    page = render_page(runs, tmp_path)
    assert "## Curves: SimPO runs" in page and "| SimPO |" in page and "SIMPO" not in page
    assert _headline({"stage": "simpo"}, {"stage": "simpo", "last_step": 3}, None, []).startswith("SimPO ran 3 steps")


def test_the_console_line_shows_kto_kl(capsys):
    """Before the table: the console's keys were one list for every stage, without KTO's KL."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from src.trainers.metrics_log import ConsoleLog

    state = TrainerState(max_steps=100, global_step=10)
    console = ConsoleLog(OBJECTIVES["kto"].advice.console_keys)
    console.on_log(TrainingArguments(output_dir="unused", report_to=[]), state, TrainerControl(),
                   logs={"loss": 0.41, "kl": 0.237, "rewards/margins": 0.5, "learning_rate": 1e-6})
    line = capsys.readouterr().out
    assert "kl 0.237" in line and "rewards/margins 0.5" in line and line.index("loss") < line.index("kl")


# ------------------------------------------------------------------------------------------ no name-branch outside it

OBJECTIVE_NAMES = set(OBJECTIVES) | set(PIPELINES)
# String constants equal to an objective's name that are not a decision by it: (file, the line's text) → why.
NOT_A_BRANCH = {
    ("src/audit/findings.py", '"sft" not in (loss_type or [])'): "TRL's DPO loss type 'sft' (an added NLL term)",
    ("src/audit/answers.py", 'for key in ("score", "reward"):'): "a judge verdict's fields",
    ("src/judges.py", "reward"): "a judge verdict's field 'reward' (src/embedded/tasks.py ranks with it)",
    ("src/reporting/alerts.py", '_trend(metrics, "reward")'): "TRL's logged metric 'reward' (GRPO's mean reward)",
    ("src/data/", '"sft": sft'): "a keyword argument named sft (the SFT settings)",
    ("src/objectives", ""): "the table itself",
    ("src/embedded", ""): "the embedded default's data folders (src/embedded/data/dpo, sft) and verdict fields",
    ("src/trainers/kto.py", ""): "KTO's trainer module: its loss type 'kto' and its own key in the reference cache",
    ("src/trainers/simpo.py", "self.loss_type in"): "CPOTrainer's loss types that average the log-probs (its rule)",
    ("src/trainers/grpo.py", "CLIPPED_LOSSES = "): "GRPOTrainer's loss types whose clipped shares TRL logs (its rule)",
}


def _allowed(path: str, line: str) -> bool:
    return any(path.startswith(where) and text in line for (where, text) in NOT_A_BRANCH)


def name_literals(root: Path) -> list[str]:
    """Every string constant in the project's Python code under `root` (src/ and check_gpu.py) that equals an
    objective's or a pipeline's name, as "path:line: text", less the NOT_A_BRANCH ones."""
    found = []
    entry_points = [root.parent / "check_gpu.py"] if (root.parent / "check_gpu.py").exists() else []
    for path in sorted(root.rglob("*.py")) + entry_points:
        relative = path.relative_to(root.parent).as_posix()
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.lower() in OBJECTIVE_NAMES:  # "KTO" too: stage.upper() == "KTO"
                line = lines[node.lineno - 1].strip()
                if not _allowed(relative, line):
                    found.append(f"{relative}:{node.lineno}: {line}")
    return found


def test_no_code_outside_the_objectives_decides_by_a_name():
    """An objective's name as a string outside src/objectives/ is a branch on it (or a table keyed by it) that the next
    objective would have to find and extend: the row lacks a field. Add the field and read it instead."""
    found = name_literals(SRC)
    assert not found, "decisions by an objective's name outside src/objectives/ (add a field to the row):\n" + \
        "\n".join(found)


def test_the_scan_finds_a_branch(tmp_path):
    """The scan is not blind: a branch on a name in a module it reads is reported."""
    module = tmp_path / "src" / "example.py"
    module.parent.mkdir()
    module.write_text('def unit(stage):\n    return "rows" if stage == "kto" else "pairs"\n')
    assert [hit.split(": ", 1)[1] for hit in name_literals(tmp_path / "src") if "example.py" in hit] == [
        'return "rows" if stage == "kto" else "pairs"']


# ------------------------------------------------------------------------------------- every field of a row is read

def _is_row(node) -> bool:
    """objective(...) or OBJECTIVES[...]: an expression that is an objective's row."""
    if isinstance(node, ast.Call):
        func = node.func
        return (isinstance(func, ast.Name) and func.id == "objective") or \
            (isinstance(func, ast.Attribute) and func.attr == "objective")
    return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "OBJECTIVES"


def _is_table_call(node, method: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method and \
        isinstance(node.func.value, ast.Name) and node.func.value.id == "OBJECTIVES"


def _row_names(scope) -> set[str]:
    """Names a scope binds to a row: `x = objective(...)`, `for x in OBJECTIVES.values()`, `for _, x in
    OBJECTIVES.items()` (comprehensions too), a parameter annotated Objective."""
    names = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and _is_row(node.value):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, (ast.For, ast.comprehension)):
            target = node.target
            if _is_table_call(node.iter, "values") and isinstance(target, ast.Name):
                names.add(target.id)
            elif _is_table_call(node.iter, "items") and isinstance(target, ast.Tuple) and \
                    isinstance(target.elts[1], ast.Name):
                names.add(target.elts[1].id)
        elif isinstance(node, ast.arg) and node.annotation is not None and "Objective" in ast.unparse(node.annotation):
            names.add(node.arg)
    return names


def _groups() -> dict[str, type]:
    """The row's groups: each field of Objective whose type is a dataclass of its own (training, memory, report,
    advice), by name."""
    hints = typing.get_type_hints(Objective)
    return {item.name: hints[item.name] for item in dataclasses.fields(Objective)
            if dataclasses.is_dataclass(hints[item.name])}


def row_fields() -> list[str]:
    """Every field a row holds: its own (`name`) and each group's, as `group.field` (`report.charts`)."""
    groups = _groups()
    return [f"{item.name}.{inner.name}" if item.name in groups else item.name
            for item in dataclasses.fields(Objective)
            for inner in (dataclasses.fields(groups[item.name]) if item.name in groups else [item])]


def row_reads(source: str) -> set[str]:
    """What this source reads of an objective's row: `row.name` as "name", `row.report.charts` as "report.charts"
    (a group's field counts only read through its row), and `self.x` inside class Objective."""
    groups = _groups()
    tree = ast.parse(source)
    reads = set()
    scopes = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    for scope in scopes + [tree]:
        rows = _row_names(scope)

        def is_row(node) -> bool:
            return _is_row(node) or (isinstance(node, ast.Name) and node.id in rows)

        for node in ast.walk(scope):
            if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)):
                continue
            if is_row(node.value) and node.attr not in groups:
                reads.add(node.attr)
            elif isinstance(node.value, ast.Attribute) and node.value.attr in groups and is_row(node.value.value):
                reads.add(f"{node.value.attr}.{node.attr}")
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == "Objective":
            reads |= {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute) and
                      isinstance(node.value, ast.Name) and node.value.id == "self"}
    return reads


def test_the_objective_record_has_no_field_left_unread():
    """Each field of a row, each group's field among them, is read somewhere outside the rows (a field nobody reads is
    a promise nobody keeps): read on a row, not on anything that happens to have an attribute of that name
    (`card.title` is not a row's title, `trainer.packed_forward` not its `training.packed_forward`)."""
    rows = {SRC / "objectives" / f"{name}.py" for name in OBJECTIVES}
    reads = set().union(*(row_reads(path.read_text(encoding="utf-8")) for path in SRC.rglob("*.py")
                          if path not in rows))
    unread = [name for name in row_fields() if name not in reads]
    assert not unread, unread


def test_the_row_is_grouped_by_concern():
    """A row's fields come in groups by who reads them; the groups hold most of them (issue 52)."""
    assert set(_groups()) == {"training", "memory", "report", "advice"}
    assert sum("." in name for name in row_fields()) > len(dataclasses.fields(Objective))


def test_a_field_counts_as_read_only_on_a_row():
    source = """
def a(stage, card, trainer):
    row = objective(stage)
    return row.report.charts, objective(stage).report.alerts, card.title, OBJECTIVES["dpo"].help, card.report.charts, \
        trainer.training.trainer

def b():
    return [row.training.trainer for row in OBJECTIVES.values()], \
        {name: spec.causal_lm for name, spec in OBJECTIVES.items()}

def c(row: Objective, other):
    return row.title, other.warnings, row.advice.warnings, row.memory
"""
    assert row_reads(source) == {"report.charts", "report.alerts", "help", "training.trainer", "causal_lm", "title",
                                 "advice.warnings"}


def test_prompts_alone_are_the_rounds_preparation_and_the_shape_grpo_trains_on():
    """The rounds prepare prompts alone under the shape's own name (no objective of that name); an objective that
    trains on prompts (GRPO) declares the same shape, and gets the same preparation."""
    from src.data.shapes import stage_shape

    assert PROMPTS not in OBJECTIVES and stage_shape(PROMPTS) == PROMPTS
    on_prompts = [name for name, row in OBJECTIVES.items() if row.data_shape == PROMPTS]
    assert on_prompts and all(stage_shape(name) == PROMPTS and OBJECTIVES[name].training.rewards_from_judges
                              for name in on_prompts)
