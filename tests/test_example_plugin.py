"""docs/example-plugin passes its own tests, run as they are (the plugin guide promises it).

They run in this process (a second interpreter would spend seconds importing torch and
transformers again) with the package on ``sys.path``, uninstalled: its tests register it with
``specfit.register_plugin``. What they register is forgotten afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specfit import registry

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example-plugin"


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setattr(registry, "_IN_CODE", [])  # register_plugin's list, restored afterwards
    registry.reset_plugins()
    yield
    for name in [m for m in sys.modules if m.startswith("specfit_fifo_cache") or m == "test_fifo_cache"]:
        del sys.modules[name]
    registry.reset_plugins()


def test_the_example_plugin_passes_its_own_tests(example_on_path):
    tests = EXAMPLE / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == ["test_fifo_cache.py"]
    code = pytest.main([str(tests), "-q", "-p", "no:cacheprovider", "--rootdir", str(EXAMPLE), "-c",
                        str(EXAMPLE / "pyproject.toml")])
    assert code == pytest.ExitCode.OK
