"""specfit's modules import each other without loops (scripts/import_cycles.py, read from the source).

Issue 12 ended config <-> registry and plugins <-> trace: the contracts, the plug-in base configs and
ACCEPTED_KEY live in specfit.interfaces, which imports neither.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_cycles.py"


def _checker():
    spec = importlib.util.spec_from_file_location("import_cycles", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_cycles", module)
    spec.loader.exec_module(module)
    return module


def _graph(checker, deferred: bool) -> dict[str, set[str]]:
    paths = {checker.module_name(p): p for p in checker.PACKAGE.rglob("*.py")}
    return {m: checker.imports(p, set(paths), deferred=deferred) - {m} for m, p in paths.items()}


def test_no_module_level_import_cycles():
    assert _checker().cycles(_graph(_checker(), deferred=False)) == []


def test_the_plugin_contracts_are_outside_every_loop():
    checker = _checker()
    graph = _graph(checker, deferred=True)  # imports inside functions too
    tangled = {m for component in checker.cycles(graph) for m in component}
    ours = {m for m in graph if m.startswith(("specfit.interfaces", "specfit.plugins", "specfit.trace"))}
    assert not tangled & (ours | {"specfit.config", "specfit.registry"}), sorted(tangled)
    assert not {m for m in graph["specfit.interfaces.protocols"] | graph["specfit.interfaces.configs"]
                if m in ("specfit.config", "specfit.registry") or m.startswith("specfit.trace")}


def test_the_checker_finds_a_loop():
    """It can fail: two modules that import each other are reported."""
    checker = _checker()
    assert checker.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
