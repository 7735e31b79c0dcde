"""The layer order of the production tree, checked on its import graph.

Bottom to top (a module may import its own layer and the layers below it, never above):

    core         rlvla3.* (wire, codec, config, shared memory, weights, logging, auth, ...)
    brokers      brokers.*
    contract     workers.contract (what envs and policies agree on: EnvSpec)
    envs         workers.envs.*        } side by side: neither imports the other
    policies     workers.policies.*    }
    release      workers.release.* (published checkpoint layouts: they build policies)
    workers      the rest of workers.* (the worker processes, model building, training, ...)
    front door   rlvla3.app.*, rlvla3.__main__ (the ``rlvla3`` command, eval, launcher, run)
    harness      rlvla3.harness.* (what tests and benches share)

``tests/`` and ``bench/`` sit above everything. Every ``import`` counts, also one inside a
function, and so does ``importlib.import_module`` of a literal or f-string name; the core may not
import by computed name at all, so nothing reaches up out of sight. A module named by the user's
config (``module:function`` orderings, out-of-tree env adapters) is a plug-in, not an edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlvla3", "brokers", "workers")
MAX_LINES = 450
"""Production modules stay this short: one job each."""

LAYERS = ("core", "brokers", "contract", "envs", "policies", "release", "workers", "front door", "harness")
SIDE_BY_SIDE = {"envs", "policies"}
"""Layers at the same height: neither may import the other."""


def layer_of(module: str) -> str:
    """The layer of a dotted module name of the production tree."""
    first = module.split(".")[0]
    if first == "rlvla3":
        if module == "rlvla3.__main__" or module == "rlvla3.app" or module.startswith("rlvla3.app."):
            return "front door"
        if module == "rlvla3.harness" or module.startswith("rlvla3.harness."):
            return "harness"
        return "core"
    if first == "brokers":
        return "brokers"
    for sub in ("contract", "envs", "policies", "release"):
        if module == f"workers.{sub}" or module.startswith(f"workers.{sub}."):
            return sub
    return "workers"


def height(layer: str) -> int:
    h = LAYERS.index(layer)
    return LAYERS.index("envs") if layer in SIDE_BY_SIDE else h


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every production module by dotted name (a package by its ``__init__``)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _named(node: ast.Call) -> str | None:
    """The module an ``importlib.import_module(...)`` call names: a literal, or an f-string's
    constant head (``f"workers.envs.{name}"`` -> ``workers.envs``); None for a computed name."""
    if not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".")
    return None


def _is_dynamic_import(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """``module -> modules of the tree it imports`` and the core modules that import by a
    computed name."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts:
            if ".".join(parts) in mods:
                return ".".join(parts)
            parts.pop()
        return None

    graph: dict[str, set[str]] = {}
    hidden: list[str] = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names += [target] + [f"{target}.{a.name}" for a in node.names]
            elif _is_dynamic_import(node):
                named = _named(node)
                if named is not None:
                    names.append(named)
                elif layer_of(mod) == "core":
                    hidden.append(f"{mod} (line {node.lineno})")
        graph[mod] = {r for r in map(resolve, names) if r is not None and r != mod}
    return graph, hidden


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs against the layer order."""
    bad = []
    for mod, deps in sorted(graph.items()):
        a = layer_of(mod)
        for dep in sorted(deps):
            b = layer_of(dep)
            if height(b) > height(a) or (a != b and a in SIDE_BY_SIDE and b in SIDE_BY_SIDE):
                bad.append(f"{mod} ({a}) imports {dep} ({b})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_runs_against_the_layer_order() -> None:
    graph, _ = import_graph()
    assert upward(graph) == []


def test_the_core_imports_no_room_above_it() -> None:
    graph, hidden = import_graph()
    above = [f"{m} imports {d}" for m, deps in sorted(graph.items()) if layer_of(m) == "core"
             for d in sorted(deps) if layer_of(d) != "core"]
    assert above == []
    assert hidden == [], "the core imports by a computed name"


def test_policies_import_no_release_layout() -> None:
    graph, _ = import_graph()
    assert [f"{m} imports {d}" for m, deps in sorted(graph.items()) if layer_of(m) == "policies"
            for d in sorted(deps) if layer_of(d) in ("release", "envs")] == []


def test_no_import_circle() -> None:
    graph, _ = import_graph()
    assert circles(graph) == []


def test_production_modules_stay_short() -> None:
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_the_broker_loads_no_torch_and_no_worker_module() -> None:
    """The broker is bookkeeping: it runs without torch and without anything from ``workers/``, and
    so does the ``rlvla3`` command it starts from (a broker host, ``rlvla3 status`` and every
    worker's start-up skip torch's 2 s import)."""
    code = ("import sys, rlvla3.app.cli, brokers.broker; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'workers'))); "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[-2000:]
