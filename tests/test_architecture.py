"""The layering docs/design.md promises, read from the installed package's source: no import cycles
between its modules (function-level imports included), and lowering knows no op."""
from __future__ import annotations

import ast
import importlib.util
import pathlib

PACKAGES = ("fxshard", "fxshard.backend", "fxshard.lowering")
# what knows ops: the registry and everything it is made of
OP_KNOWLEDGE = {"fxshard.registry", "fxshard.op_kinds", "fxshard.rules", "fxshard.strategies", "fxshard.views",
                "fxshard.slicing", "fxshard.decompose", "fxshard.factories", "fxshard.propagate"}


def modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package, its sub-packages' included: dotted name -> file."""
    out = {}
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)
        for folder in spec.submodule_search_locations:
            for f in pathlib.Path(folder).rglob("*.py"):
                parts = f.relative_to(folder).with_suffix("").parts
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                out[".".join((pkg, *parts))] = f
    return out


def imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source."""
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.stem == "__init__" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names]
                targets = subs + ([target] if node.module and not any(s in mods for s in subs) else [])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges[m] |= {t for t in targets if t in mods and t != m}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(imports()) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lowering_knows_no_op():
    edges = imports()
    lowering = {m for m in edges if m.startswith("fxshard.lowering")}
    reached = set()
    todo = list(lowering)
    while todo:  # everything lowering imports, directly or not
        m = todo.pop()
        for t in edges[m]:
            if t not in reached:
                reached.add(t)
                todo.append(t)
    assert not reached & OP_KNOWLEDGE, sorted(reached & OP_KNOWLEDGE)
    assert not any(m.startswith("fxshard.backend") for m in reached)


def test_fxshard_core_knows_no_process_group():
    edges = imports()
    for m in edges:
        if m.startswith(("fxshard.backend", "fxshard.lowering")) or m == "fxshard":
            continue
        assert not any(t.startswith(("fxshard.backend", "fxshard.lowering")) for t in edges[m]), (m, edges[m])


# what makes a test file one that reaches into torch's internals or runs real ranks (.ci/TORCH_INTERNALS)
_INTERNAL = r"torch\._(inductor|dynamo|functorch|guards|higher_order_ops)\b|_c10d_functional|gloo|register_sharding"


def test_ci_runs_every_test_file_that_touches_torchs_internals_on_both_versions():
    """.ci/run runs the files .ci/TORCH_INTERNALS lists on its second torch version: each listed file exists,
    and every test file that names a private torch internal or runs gloo ranks is listed."""
    import re

    tests = pathlib.Path(__file__).resolve().parent
    lines = (tests.parent / ".ci" / "TORCH_INTERNALS").read_text().splitlines()
    listed = {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
    assert not {f for f in listed if not (tests / f).is_file()}, "listed files that do not exist"
    touching = {f.name for f in tests.glob("test_*.py")
                if f.name != pathlib.Path(__file__).name and re.search(_INTERNAL, f.read_text())}
    assert touching <= listed, f"add to .ci/TORCH_INTERNALS: {sorted(touching - listed)}"
