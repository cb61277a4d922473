"""The layers import one way (DSL <- kernels <- CUDA layer <- ops and the
executor <- driver tools <- llm (the runner) <- testing), and no two modules
import each other, even through imports made inside functions: a static walk
of every ``import`` in ptxgen/, kernels/, driver/, llm/ and testing/.  (Importing ``pkg.sub`` runs ``pkg/__init__``; that is not counted
as a dependency on the package's own module.)"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"ptxgen": "ptxgen", "kernels": "ptxgen.kernels", "driver": "ptxgen.driver",
           "llm": "ptxgen.llm", "testing": "ptxgen.testing"}

#: the CUDA layer of driver/: below the ops, the model and the CLI
CUDA_LAYER = {"backend", "cache", "collective", "device", "errors", "graph", "jit", "launch",
              "memory", "module", "nccl", "release", "stream", "tensor_map", "timeline"}


def _modules():
    mods = {}
    for folder, pkg in FOLDERS.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((pkg,) + tuple(p for p in parts if p != "__init__"))
            mods[name] = f
    return mods


def _graph():
    mods = _modules()
    graph = {}
    for name, f in mods.items():
        pkg = name if f.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")
                    up = up[:len(up) - (node.level - 1)]
                    base = ".".join(up) + ("." + node.module if node.module else "")
                subs = [base + "." + a.name for a in node.names if base + "." + a.name in mods]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycles(graph):
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def _layer(m):
    if m.startswith("ptxgen.testing"):
        return 7
    if m.startswith("ptxgen.llm"):
        return 6
    if m.startswith("ptxgen.driver."):
        sub = m.split(".")[2]
        if sub in CUDA_LAYER:
            return 2
        if sub.startswith("ops") or sub == "executor":
            return 3
        return 4                                  # driver tools (tune) on top
    if m == "ptxgen.driver":
        return 2                                  # the package re-exports the CUDA layer
    if m.startswith("ptxgen.kernels"):
        return 1
    return 0


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_layers_import_downward_only():
    upward = [(a, b) for a, deps in _graph().items() for b in deps if _layer(b) > _layer(a)
              and a not in ("ptxgen.cli", "ptxgen.registry")]   # entry-point plugin loaders
    assert upward == []


def test_llm_sits_above_driver():
    """The runner imports the CUDA layer; nothing below imports the runner."""
    g = _graph()
    assert any(d.startswith("ptxgen.driver") for m, deps in g.items()
               if m.startswith("ptxgen.llm") for d in deps)
    below = [(a, b) for a, deps in g.items() for b in deps
             if b.startswith(("ptxgen.llm", "ptxgen.testing"))
             and not a.startswith(("ptxgen.llm", "ptxgen.testing"))
             and a not in ("ptxgen.cli", "ptxgen.registry")]
    assert below == []
