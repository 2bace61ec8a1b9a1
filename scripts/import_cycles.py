"""List import cycles between specfit's modules, and import each module fresh.

Every import counts: module level, inside functions and under ``if TYPE_CHECKING`` (a loop that
only a deferred import closes is a tangle all the same). Usage: ``python scripts/import_cycles.py
[--fresh]``; ``--fresh`` also imports every module in its own interpreter and reports those that fail.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specfit"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """specfit modules ``path`` imports anywhere: at module level, inside functions and under
    ``if TYPE_CHECKING`` alike (a loop closed by a deferred import is still a tangle)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:  # `from a.b import c`: a.b.c if a module, else a.b
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
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
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def main() -> int:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: imports(p, set(paths)) - {m} for m, p in paths.items()}
    found = cycles(graph)
    for component in found:
        print("cycle:", " <-> ".join(component))
    if not found:
        print("no import cycles between specfit modules (every import counted)")
    failed = 0
    if "--fresh" in sys.argv:
        for module in sorted(paths):
            run = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True)
            if run.returncode:
                failed += 1
                print(f"fresh import failed: {module}: {run.stderr.strip().splitlines()[-1]}")
    return 1 if found or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
