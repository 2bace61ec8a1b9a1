"""The layers hold (pyproject.toml's [tool.importlinter] contracts, checked by import-linter) and no
module imports another in a loop (scripts/import_cycles.py), counting imports inside functions and
under TYPE_CHECKING. Both checks are shown to fail on a copy of the package with bad imports."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "import_cycles.py"
LINT = Path(sys.executable).with_name("lint-imports")


def _checker():
    spec = importlib.util.spec_from_file_location("import_cycles", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_cycles", module)
    spec.loader.exec_module(module)
    return module


def _lint(package_parent: Path) -> subprocess.CompletedProcess:
    """lint-imports with the project's contracts over the ``specfit`` package under ``package_parent``."""
    if not LINT.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=120)


def _graph(checker, package: Path) -> dict[str, set[str]]:
    paths = {checker.module_name(p, package.parent): p for p in package.rglob("*.py")}
    return {m: checker.imports(p, set(paths)) - {m} for m, p in paths.items()}


def test_the_layers_and_the_plugin_boundary_hold():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_no_import_cycles_counting_every_import():
    checker = _checker()
    assert checker.cycles(_graph(checker, ROOT / "specfit")) == []


@pytest.fixture(scope="module")
def bad_tree(tmp_path_factory) -> Path:
    """A copy of the package with three bad imports: a plug-in reaching into the runtime, the
    contracts importing the decode loop inside a function, and a TYPE_CHECKING loop."""
    parent = tmp_path_factory.mktemp("bad")
    shutil.copytree(ROOT / "specfit", parent / "specfit", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    with (parent / "specfit" / "plugins" / "caches" / "lru.py").open("a") as fh:
        fh.write("\nfrom specfit.offload.runtime import OffloadRuntime  # a plug-in reaching into the runtime\n")
    with (parent / "specfit" / "interfaces" / "guard.py").open("a") as fh:
        fh.write("\n\ndef _late():\n    from specfit.decode import engine  # the contracts importing the loop\n")
    with (parent / "specfit" / "types" / "tree.py").open("a") as fh:
        fh.write("\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specfit.types.stats import CycleRecord\n")
    return parent


def test_the_contracts_fail_on_bad_imports(bad_tree):
    run = _lint(bad_tree)
    assert run.returncode != 0
    assert "specfit.plugins.caches.lru -> specfit.offload.runtime" in run.stdout
    assert "specfit.interfaces.guard -> specfit.decode.engine" in run.stdout


def test_the_cycle_check_fails_on_a_type_checking_loop(bad_tree):
    checker = _checker()
    assert ["specfit.types.stats", "specfit.types.tree"] in checker.cycles(_graph(checker, bad_tree / "specfit"))
    assert checker.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
