"""List import cycles between specfit's modules, and import each module fresh.

Only module-level imports count (imports inside functions, or under ``if TYPE_CHECKING``, run
later and cannot form a loop at import time). Usage: ``python scripts/import_cycles.py [--deferred]
[--fresh]``; ``--deferred`` also lists the loops that function-level imports close, ``--fresh``
imports every module in its own interpreter and reports those that fail.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specfit"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str], deferred: bool = False) -> set[str]:
    """specfit modules imported when ``path`` is imported (module level, not TYPE_CHECKING);
    ``deferred``: also those imported inside functions (when they are called)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node.body)
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                continue
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

    visit(ast.parse(path.read_text()).body)
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
        print("no import cycles between specfit modules (module-level imports)")
    if "--deferred" in sys.argv:  # loops closed by imports inside functions: legal, but a tangle
        graph = {m: imports(p, set(paths), deferred=True) - {m} for m, p in paths.items()}
        for component in cycles(graph):
            print("deferred cycle:", " <-> ".join(component))
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
