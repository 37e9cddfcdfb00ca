"""The layout of tracer/ (docs/design.md, "Layout"): the folders follow the
data path, probes -> kernel -> trace -> analysis -> views / exporters ->
commands -> cli, and no module imports one of a later stage, nor any chain
of imports come back to where it started.

Read from the source with `ast`, not by importing it: every import counts,
at module level or inside a function, relative or absolute.
"""

import ast
from pathlib import Path

import pytest

TRACER = Path(__file__).resolve().parent.parent / "tracer"

# a module's rank: its folder's, or its own at the top of tracer/
RANKS = {"probes": 1, "kernel": 2, "trace": 3, "analysis": 4, "views": 5, "exporters": 5,
         "commands": 6}
TOP_RANKS = {"__init__": 0, "abi": 0, "errors": 0, "files": 0, "cache": 0, "cli": 7}


def module_name(path: Path) -> str:
    parts = path.relative_to(TRACER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict:
    """{dotted name: path} of every module and package of tracer/."""
    return {module_name(p): p for p in sorted(TRACER.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict) -> set:
    """The tracer modules that `name` (at `path`) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()

    def add(target: str):
        # the longest prefix that is a module: `from x import f` of a function f
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target:
            out.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tracer" or alias.name.startswith("tracer."):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base != "tracer" and not base.startswith("tracer."):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in modules else base)
    out.discard(name)
    return out


def rank(name: str) -> tuple:
    """(rank, stage) of a module; a folder with no rank fails the test."""
    parts = name.split(".")
    if len(parts) == 1:
        return TOP_RANKS["__init__"], "top"
    if len(parts) == 2 and parts[1] in TOP_RANKS:
        return TOP_RANKS[parts[1]], "top" if parts[1] != "cli" else "cli"
    assert parts[1] in RANKS, f"{name}: tracer/{parts[1]} is in no stage of the layout"
    return RANKS[parts[1]], parts[1]


def graph() -> dict:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def upward(g: dict) -> list:
    """Every import of a module of a later stage, or between views/ and
    exporters/ (the same rank, two outputs that stay apart)."""
    bad = []
    for name, targets in g.items():
        r, stage = rank(name)
        for t in sorted(targets):
            tr, tstage = rank(t)
            if tr > r or (tr == r and {stage, tstage} == {"views", "exporters"}):
                bad.append(f"{name} ({stage}) imports {t} ({tstage})")
    return bad


def cycles(g: dict) -> list:
    """The import cycles: each strongly connected component of more than
    one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_stage():
    for name in all_modules():
        rank(name)


def test_no_import_runs_back_up_the_data_path():
    assert upward(graph()) == []


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_graph_is_read_at_every_depth():
    """The reader finds what the checks rely on: a function-level import,
    a relative one two levels up, and the stages' own ties."""
    g = graph()
    assert "tracer.probes.sdt" in g["tracer.kernel.uprobes"]  # inside trial_link
    assert "tracer.kernel.records" in g["tracer.trace.stream"]  # from ..kernel.records
    assert "tracer.commands.attach" in g["tracer.commands.record"]
    assert "tracer.abi" in g["tracer.probes.discover"]


@pytest.mark.parametrize("edges,want_up,want_cycle", [
    ({"tracer.kernel.session": {"tracer.trace.stream"}}, 1, 0),
    ({"tracer.views.panels": {"tracer.exporters.folded"}}, 1, 0),
    ({"tracer.probes.a": {"tracer.probes.b"}, "tracer.probes.b": {"tracer.probes.a"}}, 0, 1),
    ({"tracer.commands.record": {"tracer.commands.attach"}, "tracer.commands.attach": set()},
     0, 0),
])
def test_the_checks_catch_what_they_should(edges, want_up, want_cycle):
    assert (len(upward(edges)), len(cycles(edges))) == (want_up, want_cycle)
