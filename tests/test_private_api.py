"""docs/development.md's "Private API" list names every private name (`_name`) the toolkit reaches in TRL,
transformers, accelerate, datasets and peft, in the row of the file that reaches it, and nothing it no longer reaches:
the list a library upgrade starts from. Read from the source with `ast`, in this process; no library is imported.

What counts as reaching a library's private name, in src/:
- `from trl.x import _name` (any of the five libraries), or `module._name` on a module imported from one;
- in a class that derives from a library class (directly, through src classes, or as a mixin beside one: the trainers,
  the callbacks), a method `def _name` (an override), `self._name` or `super()._name`, when the libraries' source has
  that name (the class's own new helpers, `_kl_rows`, do not);
- anywhere else, `obj._name`, `getattr(obj, "_name")` (`model.config._attn_implementation`, `dataset._fingerprint`),
  when src does not define `_name` itself and the libraries' source has it (a marker src sets on a library's object,
  `_packed_dpo_installed`, is src's own).
The libraries' source is read as text, transformers' `models/` package aside (50 MB of model files; the base classes
src derives from and the attributes it reads live outside it): a name defined only there would be missed.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

from conftest import PROJECT_ROOT

LIBRARIES = ("trl", "transformers", "accelerate", "datasets", "peft")
PRIVATE = re.compile(r"_[A-Za-z]\w*")
DEVELOPMENT = PROJECT_ROOT / "docs" / "development.md"


@functools.lru_cache(maxsize=None)
def library_source() -> bytes:
    """The five libraries' Python source, as one text (transformers' models/ aside)."""
    parts = []
    for library in LIBRARIES:
        root = Path(importlib.util.find_spec(library).origin).parent
        for path in sorted(root.rglob("*.py")):
            if library != "transformers" or path.relative_to(root).parts[0] != "models":
                parts.append(path.read_bytes())
    return b"\n".join(parts)


def in_libraries(names: set[str]) -> set[str]:
    """The names that occur as a whole identifier in the libraries' source (bytes.find: a tenth of a regex's time)."""
    source = library_source()

    def occurs(name: bytes) -> bool:
        at = source.find(name)
        while at != -1:
            before, after = source[at - 1:at], source[at + len(name):at + len(name) + 1]
            if not (before.isalnum() or before == b"_") and not (after.isalnum() or after == b"_"):
                return True
            at = source.find(name, at + 1)
        return False

    return {name for name in names if occurs(name.encode())}


def imported_roots(nodes: list[ast.AST]) -> dict[str, str]:
    """{name bound by an import among `nodes` (a module's): the top-level package it came from}."""
    bound = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[(alias.asname or alias.name).split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                bound[alias.asname or alias.name] = node.module.split(".")[0]
    return bound


def library_facing_classes(modules: dict[Path, list[ast.AST]]) -> set[str]:
    """The src classes a library class is an ancestor of, or that sit beside one as a mixin."""
    bases = {}
    library_based = set()
    for nodes in modules.values():
        roots = imported_roots(nodes)
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                names = []
                for base in node.bases:
                    head = base
                    while isinstance(head, ast.Attribute):
                        head = head.value
                    if isinstance(head, ast.Name) and roots.get(head.id) in LIBRARIES:
                        library_based.add(node.name)
                    names.append(base.id if isinstance(base, ast.Name) else getattr(base, "attr", None))
                bases[node.name] = names
    facing, grown = set(library_based), True
    while grown:
        grown = False
        for name, names in bases.items():
            related = {name, *names} & bases.keys()
            if related - facing and (name in facing or facing & set(names)):
                facing |= related
                grown = True
    return facing


@functools.lru_cache(maxsize=None)
def reached_private_names() -> dict[str, set[str]]:
    """{private name of one of the five libraries: the src files that reach it}."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted((PROJECT_ROOT / "src").rglob("*.py"))}
    modules = {path: list(ast.walk(tree)) for path, tree in trees.items()}  # walked once: the scan's main cost
    facing = library_facing_classes(modules)
    certain, in_class, elsewhere, own = [], [], [], set()
    for path, tree in trees.items():
        roots = imported_roots(modules[path])
        for node in modules[path]:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
                certain += [(alias.name, path) for alias in node.names if PRIVATE.fullmatch(alias.name)]

        def visit(node, cls: str | None) -> None:
            if isinstance(node, ast.ClassDef):
                for child in node.body:
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and PRIVATE.fullmatch(child.name) \
                            and node.name in facing:
                        in_class.append((child.name, path))
                    visit(child, node.name)
                return
            if isinstance(node, ast.Attribute) and PRIVATE.fullmatch(node.attr):
                value = node.value
                if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                    if cls in facing:
                        in_class.append((node.attr, path))
                    elif isinstance(node.ctx, ast.Store):
                        own.add(node.attr)  # an attribute of src's own class
                elif isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super":
                    in_class.append((node.attr, path))
                elif isinstance(value, ast.Name) and value.id in roots:  # module._name
                    if roots[value.id] in LIBRARIES:
                        certain.append((node.attr, path))
                else:
                    elsewhere.append((node.attr, path))
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str) and PRIVATE.fullmatch(node.args[1].value)):
                elsewhere.append((node.args[1].value, path))
            for child in ast.iter_child_nodes(node):
                visit(child, cls)

        visit(tree, None)
    known = in_libraries({name for name, _ in in_class + elsewhere})
    reached: dict[str, set[str]] = {}
    for name, path in certain + [(name, path) for name, path in in_class if name in known] + \
            [(name, path) for name, path in elsewhere if name in known and name not in own]:
        reached.setdefault(name, set()).add(str(path.relative_to(PROJECT_ROOT)))
    return reached


def private_api_rows() -> list[tuple[str, set[str]]]:
    """(the "where" cell, the private names its row lists) for each row of docs/development.md's "Private API"."""
    text = DEVELOPMENT.read_text(encoding="utf-8")
    section = re.split(r"\n## Private API[^\n]*\n", text, maxsplit=1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and not set(cells[0]) <= set("-"):
            names = {name for span in re.findall(r"`([^`]+)`", cells[1])
                     for name in re.findall(r"(?<![\w])_[A-Za-z]\w*", span)}
            rows.append((cells[0], names))
    return rows[1:]  # past the header


def names_the_file(where: str, path: str) -> bool:
    """A "where" cell names a file by its path (`src/trainers/dpo.py`), or by its name after its folder's path in the
    same cell (`src/trainers/base.py`, `checkpointing.py`)."""
    folder, name = path.rsplit("/", 1)
    return path in where or (f"{folder}/" in where and re.search(rf"(?<![\w/]){re.escape(name)}", where) is not None)


def test_every_private_name_reached_in_the_libraries_is_listed_where_it_is_reached():
    reached = reached_private_names()
    rows = private_api_rows()
    listed = set().union(*(names for _, names in rows))
    missing = {name: sorted(files) for name, files in reached.items() if name not in listed}
    assert not missing, f"private names reached but not in docs/development.md's 'Private API' list: {missing}"
    stale = sorted(listed - set(reached))
    assert not stale, f"listed in 'Private API' but no longer reached in src/: {stale}"
    misplaced = {name: sorted(path for path in files
                              if not any(name in names and names_the_file(where, path) for where, names in rows))
                 for name, files in reached.items()}
    misplaced = {name: files for name, files in misplaced.items() if files}
    assert not misplaced, f"reached in files whose 'Private API' row does not list the name: {misplaced}"


def test_the_scan_finds_each_kind_of_reach():
    """The rule on a sample, so a scan that finds nothing cannot pass: an override, a `super()` call and `self._metrics`
    in a trainer, an import, a private attribute read off a model's config, src's own helpers and markers left out."""
    reached = set(reached_private_names())
    assert {"_prepare_dataset", "_compute_loss", "_metrics", "_tokenize", "_attn_implementation", "_fingerprint"} <= reached
    assert not {"_kl_rows", "_packed_dpo_installed", "_forward", "_exit", "_accelerator"} & reached
