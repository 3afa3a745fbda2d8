"""The house is shaped like its architecture: every module's imports against one table.

:data:`zerobubble.architecture.LAYERS` lists the package's rooms (a subpackage of
``zerobubble`` or a module at its top) from the bottom up. Every ``import`` statement of every
module under ``src/zerobubble`` is read with :mod:`ast` (nothing is imported), and each is an
*arrow* from the importing module to the module it names (``from a.b import c`` names
``a.b.c`` where that is a module, else ``a.b``; importing a module also runs its parent
packages' ``__init__``, which is not counted as an arrow). An arrow is one of three kinds:

* ``module``: at the module's top level (class bodies, ``try`` blocks included): it runs when
  the module is imported;
* ``function``: inside a function: it runs when the function is first called, so it is a
  dependency all the same (hiding one there does not break a circle);
* ``type``: under ``if TYPE_CHECKING:``: it never runs; it only names types.

The rules, each failing with the importing file, its line and the rule:

1. no import circle among the arrows that run (``module`` and ``function``); ``type`` arrows
   may close a circle inside one room (an instruction's ``step(model)`` and the model that
   runs instructions name each other's types), and across rooms rule 2 forbids them anyway;
2. no arrow of any kind runs up the layers or sideways to another room of the same layer (a
   type named from a higher layer is knowledge of that layer all the same);
3. no room below :data:`~zerobubble.architecture.MODEL_SIDE` imports ``zerobubble.models`` or
   ``zerobubble.interop``: the library takes a model only through the layer contract
   (docs/layer-contract.md), whose hooks must be read where that page says;
4. the :data:`~zerobubble.architecture.TORCH_FREE` rooms import no torch, by any arrow, and
   importing all of their modules leaves torch out of ``sys.modules``.

Not seen: modules imported by a string (``importlib.import_module``: the lazy public names of
``zerobubble/__init__.py`` and the search kinds of ``schedule/generators``).
"""

from __future__ import annotations

import ast
import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from zerobubble.architecture import LAYERS, MODEL_SIDE, TORCH_FREE

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "zerobubble"

KNOWN_CIRCLES: set[frozenset[str]] = set()
"""Circles that exist today and are owned elsewhere: a ratchet, never a place to add one."""


@dataclass(frozen=True)
class Arrow:
    source: str
    """The importing module, ``zerobubble.parallel.tp``."""
    target: str
    """The imported module (or ``torch``, ``torch.nn``, ... for torch)."""
    path: Path
    line: int
    kind: str
    """``module``, ``function`` or ``type`` (see the module docstring)."""

    def where(self, src: Path) -> str:
        """``zerobubble/parallel/tp.py:12``: the file (under ``src``) and the line."""
        return f"{self.path.relative_to(src)}:{self.line}"


def modules(src: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``src``: dotted name -> file."""
    found = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST, kind: str = "module") -> Iterator[tuple[ast.stmt, str]]:
    """Every import statement under ``tree`` with the kind of arrow it makes."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, kind
        elif isinstance(node, ast.If) and _type_checking(node):
            for child in node.body:
                yield from _statements(ast.Module(body=[child], type_ignores=[]), "type")
            for child in node.orelse:
                yield from _statements(ast.Module(body=[child], type_ignores=[]), kind)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _statements(node, "type" if kind == "type" else "function")
        else:
            yield from _statements(node, kind)


def arrows(src: Path, package: str = PACKAGE) -> list[Arrow]:
    """Every import of every module of ``package`` that names the package or torch."""
    mods = modules(src, package)
    out = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node, kind in _statements(tree):
            named: list[str] = []
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                assert isinstance(node, ast.ImportFrom)
                base = node.module or ""
                if node.level:
                    up = here[: len(here) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                named = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for target in dict.fromkeys(named):  # one arrow per module a statement names
                top = target.split(".")[0]
                if top == package:
                    while target not in mods:  # an attribute path: its module
                        target = target.rpartition(".")[0]
                    if target != name:
                        out.append(Arrow(name, target, path, node.lineno, kind))
                elif top == "torch":
                    out.append(Arrow(name, target, path, node.lineno, kind))
    return out


def room(module: str) -> str:
    """``zerobubble.parallel.tp`` -> ``runtime``; ``zerobubble`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {r: i for i, rooms in enumerate(layers) for r in rooms}


# ---- the checks (functions of a tree, so that the tests below can try them on made-up ones) ---


def table_problems(
    src: Path, layers: tuple[tuple[str, ...], ...], package: str = PACKAGE
) -> list[str]:
    listed = [r for rooms in layers for r in rooms]
    present = {room(m) for m in modules(src, package)}
    out = [
        f"room {r!r} is listed {listed.count(r)} times"
        for r in sorted(set(listed))
        if listed.count(r) > 1
    ]
    out += [
        f"room {r!r} is listed but no module of it exists" for r in sorted(set(listed) - present)
    ]
    out += [
        f"room {r!r} ({package}/{r}) is in no layer: add it to LAYERS in zerobubble/architecture.py"
        for r in sorted(present - set(listed))
    ]
    return out


def running(found: list[Arrow]) -> dict[str, dict[str, Arrow]]:
    """The arrows that run (``module``, ``function``) between modules of the package."""
    graph: dict[str, dict[str, Arrow]] = {}
    for a in found:
        if a.kind != "type" and a.target.split(".")[0] == PACKAGE:
            graph.setdefault(a.source, {}).setdefault(a.target, a)
    return graph


def circles(found: list[Arrow], src: Path, known: set[frozenset[str]] | None = None) -> list[str]:
    """Rule 1: one message per import circle among the arrows that run, naming each arrow's
    file and line; a circle in ``known`` is not reported."""
    graph = running(found)
    out = []
    for component in _strongly_connected(graph):
        if frozenset(component) in (known or set()):
            continue
        start = min(component)
        cycle = _shortest_cycle(graph, start, set(component))
        steps = " -> ".join(f"{b} ({graph[a][b].where(src)})" for a, b in itertools.pairwise(cycle))
        out.append(
            f"import circle of {len(component)} modules: {start} -> {steps} "
            f"(rule 1: no import circle; break it by moving the shared code down)"
        )
    return out


def _strongly_connected(graph: dict[str, dict[str, Arrow]]) -> list[list[str]]:
    """Tarjan's components with more than one module (an import of itself is no arrow)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _shortest_cycle(graph: dict[str, dict[str, Arrow]], start: str, within: set[str]) -> list[str]:
    """The modules of a shortest circle through ``start``, ``start`` first and last."""
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if w in within and w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no circle")


def upward(found: list[Arrow], layers: tuple[tuple[str, ...], ...], src: Path) -> list[str]:
    """Rule 2: one message per arrow to a higher layer or to another room of the same one."""
    level = layer_of(layers)
    out = []
    for a in found:
        if a.target.split(".")[0] != PACKAGE:
            continue
        mine, theirs = room(a.source), room(a.target)
        if mine == theirs or mine not in level or theirs not in level:
            continue
        if level[theirs] >= level[mine]:
            how = "up to layer" if level[theirs] > level[mine] else "sideways, within layer"
            out.append(
                f"{a.where(src)}: {a.source} imports {a.target} ({a.kind} import): room "
                f"{mine!r} (layer {level[mine]}) -> room {theirs!r} ({how} {level[theirs]}); "
                "rule 2: a module imports only its own room and lower layers "
                "(LAYERS in zerobubble/architecture.py, docs/architecture.md)"
            )
    return out


def contract_breaches(
    found: list[Arrow], layers: tuple[tuple[str, ...], ...], model_side: tuple[str, ...], src: Path
) -> list[str]:
    """Rule 3: one message per import of a model-side room from a room below it."""
    level = layer_of(layers)
    floor = min(level[r] for r in model_side)
    out = []
    for a in found:
        mine, theirs = room(a.source), room(a.target)
        if theirs in model_side and level.get(mine, floor) < floor:
            out.append(
                f"{a.where(src)}: {a.source} imports {a.target} ({a.kind} import); rule 3: "
                f"room {mine!r} takes models only through the layer contract (the hooks of "
                "docs/layer-contract.md), never by importing zerobubble."
                f"{theirs}"
            )
    return out


def torch_imports(found: list[Arrow], torch_free: tuple[str, ...], src: Path) -> list[str]:
    """Rule 4, read statically: one message per import of torch in a torch-free room."""
    return [
        f"{a.where(src)}: {a.source} imports {a.target} ({a.kind} import); rule 4: room "
        f"{room(a.source)!r} is torch-free (TORCH_FREE in zerobubble/architecture.py)"
        for a in found
        if a.target.split(".")[0] == "torch" and room(a.source) in torch_free
    ]


def _failing(problems: list[str]) -> str:
    return f"{len(problems)} problem(s):\n" + "\n".join(problems)


# ---- the package --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def found() -> list[Arrow]:
    return arrows(SRC)


def test_the_table_lists_every_room_once():
    problems = table_problems(SRC, LAYERS)
    assert not problems, _failing(problems)
    assert set(MODEL_SIDE) <= layer_of(LAYERS).keys() and set(TORCH_FREE) <= layer_of(LAYERS).keys()
    floor = {layer_of(LAYERS)[r] for r in MODEL_SIDE}
    assert len(floor) == 1, "the model side is one layer"


def test_no_import_circle(found):
    problems = circles(found, SRC, KNOWN_CIRCLES)
    assert not problems, _failing(problems)
    components = {frozenset(c) for c in _strongly_connected(running(found))}
    stale = KNOWN_CIRCLES - components
    assert not stale, (
        f"the circles {sorted(map(sorted, stale))} are gone: remove them from KNOWN_CIRCLES"
    )


def test_no_arrow_runs_up_the_layers(found):
    problems = upward(found, LAYERS, SRC)
    assert not problems, _failing(problems)


def test_the_library_takes_models_only_through_the_contract(found):
    problems = contract_breaches(found, LAYERS, MODEL_SIDE, SRC)
    assert not problems, _failing(problems)


def test_the_torch_free_rooms_name_no_torch(found):
    problems = torch_imports(found, TORCH_FREE, SRC)
    assert not problems, _failing(problems)


def test_the_torch_free_rooms_never_import_torch():
    """Every module of the torch-free rooms imported in a fresh process: no torch module
    loaded (what the static rule cannot see: torch pulled in by another library)."""
    names = sorted(m for m in modules(SRC) if room(m) in TORCH_FREE)
    code = (
        "import importlib, sys\n"
        f"for m in {names!r}:\n"
        "    importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---- the layer contract -------------------------------------------------------------------

CONTRACT = ROOT / "docs" / "layer-contract.md"


def contract_rows() -> list[tuple[str, list[str]]]:
    """The rows of docs/layer-contract.md's table of hooks: ``(hook, files said to read it)``
    (a row starts with the hook in backticks; its last cell names the readers)."""
    rows = []
    for line in CONTRACT.read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append(
                (cells[0].split("`")[1], re.findall(r"`(src/zerobubble/[^`]+\.py)`", cells[-1]))
            )
    return rows


def test_every_hook_of_the_contract_is_read_where_the_page_says():
    rows = contract_rows()
    hooks = [h for h, _ in rows]
    assert len(rows) >= 15 and len(set(hooks)) == len(hooks), hooks
    for hook, readers in rows:
        assert readers, f"docs/layer-contract.md: {hook!r} names no file that reads it"
        name = re.split(r"[(.\s]", hook, maxsplit=1)[0]
        for reader in readers:
            assert name in (ROOT / reader).read_text(), f"{reader} never names {name!r} ({hook})"
            module = ".".join(Path(reader).relative_to("src").with_suffix("").parts)
            assert room(module) not in MODEL_SIDE, f"{hook}: {reader} is a model, not the library"


# ---- the checks on made-up trees ----------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "zerobubble" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


TOY_LAYERS = (("low",), ("mid", "side"), ("models",), ("top", "__init__"))


def test_the_checks_name_the_file_line_and_rule(tmp_path):
    src = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "import typing\nif typing.TYPE_CHECKING:\n    import zerobubble.top\n",
            "low/b.py": "import torch\n\ndef f():\n    from zerobubble.models import m\n",
            "mid/__init__.py": "",
            "mid/c.py": "from zerobubble.mid import d\nfrom zerobubble.low.a import X\n",
            "mid/d.py": "def g():\n    from zerobubble.mid.c import Y\n",
            "side.py": "from zerobubble.mid import c\n",
            "models/__init__.py": "",
            "models/m.py": "",
            "top.py": "from . import side\n",
            "stray.py": "",
        },
    )
    found = arrows(src)
    assert table_problems(src, TOY_LAYERS) == [
        "room 'stray' (zerobubble/stray) is in no layer: add it to LAYERS in "
        "zerobubble/architecture.py"
    ]
    (circle,) = circles(found, src)
    assert circle.startswith(
        "import circle of 2 modules: zerobubble.mid.c -> zerobubble.mid.d "
        "(zerobubble/mid/c.py:1) -> zerobubble.mid.c (zerobubble/mid/d.py:2) (rule 1"
    )
    up = upward(found, TOY_LAYERS, src)
    assert [u.split(":")[0:2] for u in up] == [
        ["zerobubble/low/a.py", "3"],
        ["zerobubble/low/b.py", "4"],
        ["zerobubble/side.py", "1"],
    ]
    assert "(type import): room 'low' (layer 0) -> room 'top' (up to layer 3); rule 2" in up[0]
    assert "room 'side' (layer 1) -> room 'mid' (sideways, within layer 1)" in up[2]
    (breach,) = contract_breaches(found, TOY_LAYERS, ("models",), src)
    assert breach.startswith("zerobubble/low/b.py:4: zerobubble.low.b imports zerobubble.models.m")
    assert "rule 3" in breach
    (torch,) = torch_imports(found, ("low",), src)
    assert torch.startswith("zerobubble/low/b.py:1: zerobubble.low.b imports torch (module import)")
    assert not circles([a for a in found if a.source != "zerobubble.mid.d"], src)


# ---- sizes: small modules, one job each -------------------------------------------------------

MAX_FUNCTION, MAX_CLASS, MAX_EXECUTOR = 80, 350, 500
LONG_BY_DESIGN = {("zerobubble/cli.py", "build_parser")}  # the parser table: one flag a row


def oversized(src: Path) -> list[str]:
    """Every function over MAX_FUNCTION and class over MAX_CLASS lines (def to last line,
    docstring included), as ``path:line name (n lines)``."""
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            if n > limit and (rel, node.name) not in LONG_BY_DESIGN:
                found.append(f"{rel}:{node.lineno} {node.name} ({n} lines > {limit})")
    return found


def test_functions_and_classes_stay_small():
    assert oversized(SRC) == []
    assert len((SRC / "zerobubble/executor.py").read_text().splitlines()) < MAX_EXECUTOR


def test_the_size_check_names_what_is_too_long(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n")
    assert oversized(tmp_path) == [f"m.py:1 long ({MAX_FUNCTION + 1} lines > {MAX_FUNCTION})"]
