"""The layering docs/design.md promises, read from the installed package's source: no import cycles
between its modules (function-level imports included), and lowering knows no op."""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

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


# torch's compiler internals, named anywhere in a module's source (an import, an attribute, a string)
_COMPILER_INTERNALS = (r"torch\.(_C\.)?_(inductor|dynamo|functorch)\b"
                       r"|from torch(\._C)? import [^\n]*\b_(inductor|dynamo|functorch)\b")
# the sub-packages whose job is to talk to torch's compiler: Dynamo and functorch, Inductor
COMPILER_FOLDERS = ("fxshard.backend.capture", "fxshard.backend.inductor")


def test_torchs_compiler_internals_are_named_in_at_most_ten_modules_of_two_folders():
    """A new torch's hunt for the private names fxshard uses reads these modules only."""
    import re

    naming = sorted(m for m, f in modules().items() if re.search(_COMPILER_INTERNALS, f.read_text()))
    assert [m for m in naming if not m.startswith(tuple(f + "." for f in COMPILER_FOLDERS))] == []
    assert len(naming) <= 10, naming


def test_the_fence_sees_every_way_of_naming_them():
    import re

    named = ["from torch._inductor import config", "torch._dynamo.config.x", "import torch._functorch.config",
             "torch._C._functorch.get_unwrapped(x)", '"torch._inductor.fx_passes.bucketing"',
             "from torch import _dynamo", "from torch._C import _dynamo"]
    assert [s for s in named if not re.search(_COMPILER_INTERNALS, s)] == []
    assert not re.search(_COMPILER_INTERNALS, "torch.compiler.allow_in_graph; torch._subclasses; torch/_inductor/x.py")


# backend's sub-packages, lowest first: a module imports modules of its own level or lower only (fxshard's core
# and lowering sit below all of backend: the tests above); backend's top-level modules (its front doors) are highest,
# but for its options (backend/options.py), which every level reads and which imports no module of the backend
BACKEND_LEVELS = ({"options"}, {"reports", "inductor"}, {"capture"}, {"layers"}, {"programs"})


def _level(module: str) -> int | None:
    """A backend module's level (``BACKEND_LEVELS``; a top-level module's is above them all); None outside backend."""
    if module != "fxshard.backend" and not module.startswith("fxshard.backend."):
        return None
    sub = module.split(".")[2] if module.count(".") >= 2 else None
    return next((level for level, names in enumerate(BACKEND_LEVELS) if sub in names), len(BACKEND_LEVELS))


def test_backends_sub_packages_import_their_own_level_or_lower():
    edges = imports()
    upward = sorted((m, t) for m, targets in edges.items() for t in targets
                    if _level(m) is not None and _level(t) is not None and _level(t) > _level(m))
    assert upward == [], "a backend module imports a higher sub-package (lowest first: " \
                         "reports, inductor < capture < layers < programs < backend's top-level modules)"


def test_the_levels_are_read_as_declared():
    assert [_level(m) for m in ("fxshard.backend.options", "fxshard.backend.inductor.buckets",
                                "fxshard.backend.reports", "fxshard.backend.capture.trace",
                                "fxshard.backend.layers.regions", "fxshard.backend.programs.fold",
                                "fxshard.backend.driver", "fxshard.backend", "fxshard.graph")] == [0, 1, 1, 2, 3, 4, 5, 5, None]


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """A module's top-level ``NAME = "text"`` assignments."""
    return {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}


def _is_meta(e: ast.AST) -> bool:
    return isinstance(e, ast.Attribute) and e.attr == "meta"


def meta_keys_named() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The ``node.meta`` keys the package's source names, key -> its modules: read or written by a string or a
    module's string constant (its own or imported; a loop over such constants names them where they are listed),
    and fxshard's keys inside ``meta["custom"]`` (those starting ``fxshard_`` in a module that reads it)."""
    mods = modules()
    trees = {m: ast.parse(f.read_text()) for m, f in mods.items()}
    own = {m: _string_constants(t) for m, t in trees.items()}
    keys: dict[str, set[str]] = {}
    custom: dict[str, set[str]] = {}
    for m, tree in trees.items():
        names = dict(own[m])
        pkg = m if mods[m].stem == "__init__" else m.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                target = own.get(".".join(base + ([node.module] if node.module else [])), {})
                names |= {a.asname or a.name: target[a.name] for a in node.names if a.name in target}

        def key(e: ast.AST | None) -> str | None:
            if isinstance(e, ast.Constant) and isinstance(e.value, str):
                return e.value
            return names.get(e.id) if isinstance(e, ast.Name) else None

        named, anywhere = [], []  # keys of node.meta; keys of any dict access (custom's are among them)
        for n in ast.walk(tree):
            if isinstance(n, ast.Subscript):
                (named if _is_meta(n.value) else anywhere).append(n.slice)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                on_meta = _is_meta(n.func.value)
                if n.func.attr in ("get", "setdefault", "pop") and n.args:
                    (named if on_meta else anywhere).append(n.args[0])
                elif n.func.attr == "update" and on_meta:
                    named += [k for a in n.args if isinstance(a, ast.Dict) for k in a.keys]
                    named += [ast.Constant(kw.arg) for kw in n.keywords if kw.arg]
            elif isinstance(n, ast.Compare) and isinstance(n.ops[-1], (ast.In, ast.NotIn)) and _is_meta(n.comparators[-1]):
                named.append(n.left)
            elif isinstance(n, ast.Assign) and any(_is_meta(t) for t in n.targets) and isinstance(n.value, ast.Dict):
                named += n.value.keys
            elif isinstance(n, ast.Dict):
                anywhere += n.keys
        found = {key(e) for e in named} - {None}
        for k in found:
            keys.setdefault(k, set()).add(m)
        if "custom" in found:
            for k in {key(e) for e in anywhere} - {None}:
                if k.startswith("fxshard_"):
                    custom.setdefault(k, set()).add(m)
    return keys, custom


def test_every_node_meta_key_is_declared_in_the_graph_contract():
    """fxshard/graph.py's ``META_KEYS`` (and ``CUSTOM_KEYS``) declare each key the stages name, and only those."""
    from fxshard.graph import CUSTOM_KEYS, META_KEYS

    keys, custom = meta_keys_named()
    declared, declared_custom = {k.key for k in META_KEYS}, {k.key for k in CUSTOM_KEYS}
    assert {k: sorted(keys[k]) for k in set(keys) - declared} == {}, "declare these in fxshard/graph.py's META_KEYS"
    assert declared - set(keys) == set(), "declared in fxshard/graph.py's META_KEYS, named nowhere"
    assert {k: sorted(custom[k]) for k in set(custom) - declared_custom} == {}, "declare in CUSTOM_KEYS"
    assert declared_custom - set(custom) == set(), "declared in fxshard/graph.py's CUSTOM_KEYS, named nowhere"
    assert len(declared) == len(META_KEYS) and len(declared_custom) == len(CUSTOM_KEYS), "a key declared twice"


def test_every_package_is_installed_and_every_meta_key_is_in_the_design_page():
    """pyproject.toml lists every package folder (a sub-package it misses is left out of the wheel CI installs),
    and docs/design.md's graph contract has a row for every key fxshard/graph.py declares."""
    import fxshard.graph as graph

    repo = pathlib.Path(__file__).resolve().parent.parent
    if not (repo / "pyproject.toml").is_file():
        return
    listed = set(re.findall(r'"(fxshard[a-z_.]*)"', (repo / "pyproject.toml").read_text().split("packages =")[1]
                            .split("]")[0]))
    folders = {"fxshard", "fxshard.lowering"} | {
        ".".join(("fxshard", *p.parent.relative_to(repo).parts)) for p in (repo / "backend").rglob("__init__.py")}
    assert folders <= listed, f"add to pyproject.toml's packages: {sorted(folders - listed)}"
    design = (repo / "docs" / "design.md").read_text()
    keys = [k.key for k in graph.META_KEYS] + [f'custom["{k.key}"]' for k in graph.CUSTOM_KEYS]
    assert not [k for k in keys if f"| `{k}` |" not in design], "docs/design.md's graph contract lacks keys"
