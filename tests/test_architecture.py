"""The layers hold (pyproject.toml's [tool.importlinter] contracts, checked by import-linter) and no
module imports another in a loop (scripts/import_cycles.py), counting imports inside functions and
under TYPE_CHECKING. Both checks are shown to fail on a copy of the package with bad imports.

Plug-ins import nothing of specfit's but :mod:`specfit.interfaces` (and built-ins specfit.plugins):
import-linter checks the built-ins, an AST scan checks them and docs/example-plugin (a package of its
own, which may also use the public root ``specfit``), and ``import specfit.interfaces`` stays light."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import specfit

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
    """A copy of the package with four bad imports: a plug-in reaching into the runtime, one importing
    specfit.errors around specfit.interfaces, the contracts importing the decode loop inside a
    function, and a TYPE_CHECKING loop."""
    parent = tmp_path_factory.mktemp("bad")
    shutil.copytree(ROOT / "specfit", parent / "specfit", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    with (parent / "specfit" / "plugins" / "caches" / "lru.py").open("a") as fh:
        fh.write("\nfrom specfit.offload.runtime import OffloadRuntime  # a plug-in reaching into the runtime\n")
    with (parent / "specfit" / "plugins" / "caches" / "full.py").open("a") as fh:
        fh.write("\nfrom specfit.errors import ConfigError  # a plug-in going around specfit.interfaces\n")
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
    # only the interfaces-only contract forbids specfit.errors (the other plug-in contract allows it)
    assert "specfit.plugins is not allowed to import specfit.errors" in run.stdout
    assert "specfit.plugins.caches.full -> specfit.errors" in run.stdout


def test_the_cycle_check_fails_on_a_type_checking_loop(bad_tree):
    checker = _checker()
    assert ["specfit.types.stats", "specfit.types.tree"] in checker.cycles(_graph(checker, bad_tree / "specfit"))
    assert checker.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


# ------------------------------------------------------------------ plug-ins import specfit.interfaces

EXAMPLE = ROOT / "docs" / "example-plugin"
PUBLIC_ROOT = set(specfit.__all__) | {"interfaces"}  # what a plug-in package's tests may take from `specfit`


def outside_interfaces(folder: Path, own: str | None = None) -> list[str]:
    """``file:line module`` for each use of specfit under ``folder`` other than ``specfit.interfaces``
    and the public root ``specfit`` (``import specfit.x``, ``from specfit.x import``, ``from specfit
    import x`` and ``specfit.x`` for an x outside the root's ``__all__``), inside functions too.
    ``own``: a package of specfit's the files may import as well (the built-ins: specfit.plugins); its
    files may not use the root."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                used = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                used = [f"specfit.{a.name}" for a in node.names] if node.module == "specfit" else [node.module]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "specfit":
                used = [f"specfit.{node.attr}"]
            else:
                continue
            for name in used:
                if name != "specfit" and not name.startswith("specfit."):
                    continue
                if own is not None and (name == own or name.startswith(own + ".")):
                    continue
                public = name == "specfit" or name.removeprefix("specfit.") in PUBLIC_ROOT
                if name != "specfit.interfaces" and (own is not None or not public):
                    found.append(f"{path.relative_to(folder)}:{node.lineno} {name}")
    return found


def test_the_example_plugin_and_its_tests_import_specfit_interfaces_only():
    assert sorted(p.relative_to(EXAMPLE).as_posix() for p in EXAMPLE.rglob("*.py")) == [
        "specfit_fifo_cache/__init__.py", "tests/test_fifo_cache.py"]
    assert outside_interfaces(EXAMPLE) == []


def test_the_built_in_plugins_import_specfit_interfaces_itself():
    """Not its submodules either (import-linter allows those): the names a plug-in uses are exported there."""
    assert outside_interfaces(ROOT / "specfit" / "plugins", own="specfit.plugins") == []


def test_the_scan_finds_every_way_around_specfit_interfaces(tmp_path):
    (tmp_path / "bad.py").write_text(
        "import specfit\n"
        "import specfit.errors\n"
        "from specfit.registry import get_plugins\n"
        "from specfit.interfaces.bases import DrafterBase\n"
        "from specfit import compose, registry\n"
        "from specfit.interfaces import hookimpl\n"
        "\n"
        "def late():\n"
        "    from specfit.model.builtin import build_builtin\n"
        "    return specfit.build, specfit.validation.integer\n")
    assert outside_interfaces(tmp_path) == [
        "bad.py:2 specfit.errors", "bad.py:3 specfit.registry", "bad.py:4 specfit.interfaces.bases",
        "bad.py:5 specfit.registry", "bad.py:9 specfit.model.builtin", "bad.py:10 specfit.validation"]
    assert outside_interfaces(tmp_path, own="specfit.plugins") == [
        "bad.py:1 specfit", "bad.py:2 specfit.errors", "bad.py:3 specfit.registry",
        "bad.py:4 specfit.interfaces.bases", "bad.py:5 specfit.compose", "bad.py:5 specfit.registry",
        "bad.py:9 specfit.model.builtin", "bad.py:10 specfit.build", "bad.py:10 specfit.validation"]


def test_importing_specfit_interfaces_imports_neither_torch_nor_numba():
    """Its numba-heavy names (the search) are imported on first use; nothing it exports needs torch."""
    code = ("import sys, specfit.interfaces as i; heavy = {'torch', 'numba', 'transformers', 'scipy'} & set(sys.modules); "
            "print(sorted(heavy)); i.SearchProblem, i.MoESpec; print('torch' in sys.modules, 'numba' in sys.modules)")
    # MoESpec is plain data (no torch); the search is compiled with numba, imported on first use
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["[]", "False", "True"]
