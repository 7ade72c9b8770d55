"""Layers that only point down: the import graph of src/, read from the source with `ast`, module-level and
in-function imports alike (an import inside a function is still an edge: it hides a cycle, it does not remove it).

The layers are the list under "Layers" in docs/development.md: each line a layer, lowest first, naming its modules
(`src.data.*` names a package's modules and the package itself). A module may import its own layer's modules and
lower layers', never a higher layer's, and no set of modules may import each other in a cycle. Every module of src/
must be on the list, so a new module is placed when it is written. `python tests/test_layers.py` prints the graph's
numbers (modules, lines, edges, cycles, upward imports, the longest functions).
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
LAYERS_DOC = ROOT / "docs" / "development.md"


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once per test process (every test here reads the same files)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name → file, for every module and package of src/."""
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict) -> set[str]:
    """The project modules one import statement names: `from a.b import c` is a.b.c where c is a module, else a.b."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importing module's package, up level - 1 packages
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:  # `import src.data.prepare as x` names the module; a.b.attr → a.b
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


@functools.cache
def import_graph(src: Path = SRC) -> dict[str, dict[str, int]]:
    """module → {imported project module: line of its first import}, module-level and deferred imports alike
    (those under `if TYPE_CHECKING:` too: an annotation's import is still a dependency)."""
    modules = module_files(src)
    graph = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(_parsed(path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, module, path.name == "__init__.py", modules):
                    edges.setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    """The import cycles: each strongly connected group of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, groups, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter[0]; counter[0] += 1
        stack.append(start); on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = counter[0]; counter[0] += 1
                    stack.append(target); on_stack.add(target)
                    work.append((target, iter(graph.get(target, {}))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop(); on_stack.discard(member); group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return sorted(groups)


def layers(doc: Path = LAYERS_DOC) -> list[list[str]]:
    """The layer list in docs/development.md: the numbered lines under "## Layers", lowest first, each a layer of
    backquoted module patterns."""
    text = doc.read_text(encoding="utf-8")
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    found = [re.findall(r"`(src[\w.*]*)`", line) for line in section.splitlines() if re.match(r"\d+\. ", line)]
    return [patterns for patterns in found if patterns]


def layer_of(module: str, layer_list: list[list[str]]) -> int | None:
    """The layer whose most specific pattern matches the module (`src.data.*` matches src.data too)."""
    best = None
    for number, patterns in enumerate(layer_list):
        for pattern in patterns:
            matches = fnmatch.fnmatchcase(module, pattern) or (pattern.endswith(".*") and module == pattern[:-2])
            if matches and (best is None or len(pattern) > best[1]):
                best = (number, len(pattern))
    return None if best is None else best[0]


def upward_imports(graph: dict[str, dict[str, int]], layer_list: list[list[str]]) -> list[str]:
    """Each import from a lower layer to a higher one, as "importer:line -> imported"."""
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            low, high = layer_of(module, layer_list), layer_of(target, layer_list)
            if low is not None and high is not None and high > low:
                found.append(f"{module}:{line} -> {target}")
    return found


def test_every_module_is_on_the_layer_list():
    layer_list = layers()
    unplaced = [module for module in module_files() if layer_of(module, layer_list) is None]
    assert not unplaced, "place these modules in docs/development.md's Layers list:\n" + "\n".join(unplaced)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (deferred imports counted):\n" + "\n".join(" <-> ".join(group) for group in found)


def test_no_import_points_up():
    found = upward_imports(import_graph(), layers())
    assert not found, "imports from a lower layer to a higher one (docs/development.md, Layers):\n" + "\n".join(found)


def test_the_graph_sees_deferred_relative_and_package_imports(tmp_path):
    """The scan is not blind: an import inside a function, a relative import and `from package import module` are
    edges, and a cycle through them is found; a layer list's upward edge is reported."""
    package = tmp_path / "src" / "low"
    package.mkdir(parents=True)
    (tmp_path / "src" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from .base import VALUE\n")
    (package / "base.py").write_text("VALUE = 1\n\ndef late():\n    from src.high import use\n    return use\n")
    (tmp_path / "src" / "high.py").write_text("from src.low import base\n\ndef use():\n    return base.VALUE\n")
    graph = import_graph(tmp_path / "src")
    assert graph["src.low"] == {"src.low.base": 1} and graph["src.low.base"] == {"src.high": 4}
    assert graph["src.high"] == {"src.low.base": 1}
    assert cycles(graph) == [["src.high", "src.low.base"]]
    assert upward_imports(graph, [["src.low.*", "src"], ["src.high"]]) == ["src.low.base:4 -> src.high"]


def _reason(lines: list[str], node: ast.stmt) -> str:
    """The comment that gives an import inside a function its reason: on its own lines, or the comment line just
    above it or above the run of imports it belongs to ("" when there is none)."""
    own = [line for line in lines[node.lineno - 1:node.end_lineno] if "#" in line]
    if own:
        return own[0].split("#", 1)[1].strip()
    above = node.lineno - 2
    while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
        above -= 1
    return lines[above].strip()[1:].strip() if above >= 0 and lines[above].strip().startswith("#") else ""


def deferred_project_imports(src: Path = SRC) -> list[tuple[str, int, str]]:
    """(file, line, its reason) of each import of a project module inside a function."""
    found = []
    for path in sorted(src.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for function in ast.walk(_parsed(path)):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else \
                        [alias.name for alias in node.names] if isinstance(node, ast.Import) else ["src"] \
                        if isinstance(node, ast.ImportFrom) else []
                    if any(name == "src" or name.startswith("src.") for name in names):
                        found.append((str(path.relative_to(src.parent)), node.lineno, _reason(lines, node)))
    return sorted(set(found))


def test_an_import_of_the_project_inside_a_function_says_why():
    """A project module imported inside a function is there to put off a heavy import (the training stack, torch
    through a model) for a command that does not need it; its line says so. Any other belongs at the module's top."""
    silent = [f"{path}:{line}" for path, line, reason in deferred_project_imports() if not reason]
    assert not silent, "imports inside functions without their reason (or move them to the top):\n" + "\n".join(silent)


# A function longer than this does more than one thing: split it into functions named by what each part does.
MAX_FUNCTION_LINES = 60
# Files allowed a longer function while it is being split: empty, and kept so (the test below fails on an entry that
# no longer needs it).
LONG_FUNCTIONS_ALLOWED_IN: tuple[str, ...] = ()


def function_lengths(src: Path = SRC) -> list[tuple[int, Path, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(lines from `def` to its last line, file, node) of every function of src/, methods and nested ones included."""
    return [(node.end_lineno - node.lineno + 1, path, node) for path in module_files(src).values()
            for node in ast.walk(_parsed(path)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def long_functions(src: Path = SRC, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, str]]:
    """(file relative to the project, "file:line name (N lines)") of each function over `limit` lines."""
    found = []
    for length, path, node in sorted(function_lengths(src), key=lambda item: (str(item[1]), item[2].lineno)):
        if length > limit:
            where = path.relative_to(src.parent).as_posix()
            found.append((where, f"{where}:{node.lineno} {node.name} ({length} lines)"))
    return found


def test_no_function_is_over_60_lines():
    found = long_functions()
    offenders = [line for where, line in found if where not in LONG_FUNCTIONS_ALLOWED_IN]
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines: split each into functions named by what each "
                           "part does:\n" + "\n".join(offenders))
    done = sorted(set(LONG_FUNCTIONS_ALLOWED_IN) - {where for where, _ in found})
    assert not done, "no function over the limit left in these: remove them from LONG_FUNCTIONS_ALLOWED_IN:\n" + \
        "\n".join(done)


def test_the_length_check_sees_methods_and_nested_functions(tmp_path):
    """The scan is not blind: a long method of a class built inside a function, and the function around it, are both
    reported with file:line."""
    (tmp_path / "src").mkdir()
    body = "".join(f"            x{index} = {index}\n" for index in range(60))
    (tmp_path / "src" / "factory.py").write_text("def make():\n    class Built:\n        def method(self):\n" + body +
                                                 "    return Built\n")
    assert [line for _, line in long_functions(tmp_path / "src")] == [
        "src/factory.py:1 make (64 lines)", "src/factory.py:3 method (61 lines)"]


def test_the_entry_point_is_the_pipeline_on_one_page():
    """src/main_distributed.py reads as the pipeline (issue 52): at most 300 lines (its functions under the limit
    above), each step a call into the module that owns it (src/pipeline/ and below), so a step that grows grows
    there."""
    lines = len((SRC / "main_distributed.py").read_text(encoding="utf-8").splitlines())
    assert lines <= 300, (f"src/main_distributed.py: {lines} lines (at most 300): move the step into the module "
                          "that owns it")


def structure(src: Path = SRC) -> dict:
    """The numbers issue 52 asks before and after: files, lines, import edges, cycles, upward imports, longest
    functions."""
    graph, modules = import_graph(src), module_files(src)
    module_of = {path: module for module, path in modules.items()}
    lengths = [(length, f"{module_of[path]}.{node.name}") for length, path, node in function_lengths(src)]
    deferred = sum(1 for path in modules.values() for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for inner in ast.walk(node) if isinstance(inner, (ast.Import, ast.ImportFrom)))
    try:
        upward = upward_imports(graph, layers())
    except (IndexError, FileNotFoundError):  # an older tree: no layer list yet
        upward = None
    return {"files": len(modules), "lines": sum(len(path.read_text().splitlines()) for path in modules.values()),
            "import edges": sum(len(edges) for edges in graph.values()),
            "imports inside functions": deferred,
            "cycles": [len(group) for group in cycles(graph)],
            "upward imports": None if upward is None else len(upward),
            "files over 600 lines": sorted(str(path.relative_to(src.parent)) for path in modules.values()
                                           if len(path.read_text().splitlines()) > 600),
            "functions over 60 lines": sum(1 for length, _ in lengths if length > MAX_FUNCTION_LINES),
            "longest functions": sorted(lengths, reverse=True)[:5]}


if __name__ == "__main__":
    for key, value in structure(Path(sys.argv[1]) / "src" if len(sys.argv) > 1 else SRC).items():
        print(f"{key}: {value}")
