"""Test seams live in src/seams.py alone, and docs/development.md names each one and each environment variable the
toolkit reads: production code asks `seams.get("name")`, it reads no test variable of its own. Read from the source
(ast and text), in this process: no run, no import of the modules checked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import PROJECT_ROOT
from src import seams

DEVELOPMENT = PROJECT_ROOT / "docs" / "development.md"
PRODUCTION = sorted((PROJECT_ROOT / "src").rglob("*.py")) + [PROJECT_ROOT / "check_gpu.py",
                                                               PROJECT_ROOT / "run_distributed.sh"]
TOOLKIT_VARIABLE = re.compile(r"\bPREFKIT_[A-Z0-9_]+")
# An environment variable with TEST as one of its words (PREFKIT_TEST_X, PYTEST_CURRENT_TEST): asking whether a test
# runs is a seam, whoever's the variable.
TEST_VARIABLE = re.compile(r"\b(?:[A-Z0-9]+_)*TEST(?:_[A-Z0-9]+)*\b")


def relative(path: Path) -> str:
    return str(path.relative_to(PROJECT_ROOT))


def section_rows(title: str) -> list[list[str]]:
    """The cells of each row of the table under docs/development.md's `## <title>` heading."""
    text = DEVELOPMENT.read_text(encoding="utf-8")
    assert f"\n## {title}\n" in text, f"docs/development.md has no '## {title}' section"
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|")]
    return [row for row in rows[2:]]  # past the header and its rule


def documented_variables() -> set[str]:
    return {name for row in section_rows("Environment variables") for name in TOOLKIT_VARIABLE.findall(row[0])}


def test_production_code_reads_no_test_variable_and_every_variable_it_reads_is_documented():
    """Every PREFKIT_* name in src/, check_gpu.py and run_distributed.sh is a documented user or launcher setting
    (docs/development.md "Environment variables"), never a test's; the test seams' own variable appears in
    src/seams.py alone; no production file names a variable that asks whether a test runs."""
    documented = documented_variables()
    undocumented, test_variables = {}, {}
    for path in PRODUCTION:
        text = path.read_text(encoding="utf-8")
        if path == PROJECT_ROOT / "src" / "seams.py":
            continue
        for name in TOOLKIT_VARIABLE.findall(text):
            if name not in documented:
                undocumented.setdefault(name, set()).add(relative(path))
        for name in TEST_VARIABLE.findall(text):
            test_variables.setdefault(name, set()).add(relative(path))
    assert not test_variables, f"production code reads a test's variable: {test_variables}; ask a seam instead " \
                               f"(seams.get, src/seams.py; docs/development.md 'Test seams')"
    assert not undocumented, f"variables read but not in docs/development.md 'Environment variables': {undocumented}"
    assert seams.VARIABLE not in documented  # not a setting: the seams' table


def test_every_documented_variable_is_read_somewhere():
    """The list stays honest the other way: a documented variable nothing reads any more is a stale line."""
    readers = PRODUCTION + sorted((PROJECT_ROOT / "tests").glob("*.py")) + sorted((PROJECT_ROOT / "bench").glob("*.py"))
    read = {name for path in readers for name in TOOLKIT_VARIABLE.findall(path.read_text(encoding="utf-8"))}
    assert documented_variables() <= read, f"documented but read nowhere: {documented_variables() - read}"


def asked_seams(paths) -> dict[str, set[str]]:
    """{seam name: files} for every `seams.get("name", ...)` in `paths`; a name that is not a string literal fails (the
    table is read from the code)."""
    asked: dict[str, set[str]] = {}
    for path in paths:
        text = path.read_text(encoding="utf-8")
        if "seams.get" not in text:  # parsed only where it can be: the whole of src/ costs ~0.5 CPU-s
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "seams"):
                name = node.args[0] if node.args else None
                assert isinstance(name, ast.Constant) and isinstance(name.value, str), \
                    f"{relative(path)}:{node.lineno}: seams.get takes the seam's name as a string literal"
                asked.setdefault(name.value, set()).add(relative(path))
    return asked


def planted_seams() -> dict[str, set[str]]:
    """{seam name: test files} for every seam the tests plant: `seams.env(..., name=value)`, `plant(monkeypatch,
    name=value)` (tests/conftest.py)."""
    planted: dict[str, set[str]] = {}
    for path in sorted((PROJECT_ROOT / "tests").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "seams.env" not in text and "plant(" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            function = node.func
            if (isinstance(function, ast.Attribute) and function.attr == "env" and isinstance(function.value, ast.Name)
                    and function.value.id == "seams") or (isinstance(function, ast.Name) and function.id == "plant"):
                for keyword in node.keywords:
                    if keyword.arg is not None:  # None: `**planted` passed on (conftest.plant)
                        planted.setdefault(keyword.arg, set()).add(path.name)
    return planted


def test_every_seam_is_in_the_table_with_the_tests_that_plant_it():
    """docs/development.md's "Test seams" table, read against the code: a row for each seam production code asks
    (seams.get) or the tests plant, each seam asked by production code planted by some test (else it is dead code),
    and the table's third column naming exactly the test files that plant it. Seams others add show up here by
    themselves."""
    asked = asked_seams(sorted((PROJECT_ROOT / "src").rglob("*.py")))
    planted = planted_seams()
    rows = section_rows("Test seams")
    table = {}
    for row in rows:
        names = re.findall(r"`([a-z0-9_]+)`", row[0])
        assert len(names) == 1 and len(row) == 4, f"a row of 'Test seams' is | `name` | where asked | what it " \
                                                  f"plants | tests that plant it |: {row}"
        table[names[0]] = set(re.findall(r"test_\w+\.py", row[3]))
    missing = sorted((set(asked) | set(planted)) - set(table))
    assert not missing, f"seams missing from docs/development.md's 'Test seams' table: {missing} (asked in " \
                        f"{ {name: sorted(asked.get(name, ())) for name in missing} })"
    assert set(table) <= set(asked) | set(planted), f"rows for seams nothing asks or plants: " \
                                                    f"{sorted(set(table) - set(asked) - set(planted))}"
    assert set(asked) <= set(planted), f"seams no test plants: {sorted(set(asked) - set(planted))}"
    wrong = {name: (sorted(table[name]), sorted(planted.get(name, ()))) for name in table
             if table[name] != planted.get(name, set())}
    assert not wrong, f"'Test seams' names other test files than those that plant the seam (table, code): {wrong}"
    for name, files in asked.items():
        where = next(row[1] for row in rows if f"`{name}`" in row[0])
        assert all(Path(file).name in where for file in files), f"seam {name} is asked in {sorted(files)}: " \
                                                                f"its row says {where!r}"
