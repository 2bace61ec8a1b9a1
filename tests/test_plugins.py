"""Plug-in discovery through entry points, and the errors a plugin author can run into."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_model

import specfit
from specfit.errors import PluginError
from specfit.registry import Registry, get_plugins, reset_plugins

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example-plugin"


def install_fake_distribution(site: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """Make ``dist`` visible to importlib.metadata from ``site`` (what pip install would do)."""
    info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[specfit]\n{lines}\n")
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A temporary site directory on sys.path, plugins reloaded before and after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SPECFIT_PLUGINS", raising=False)
    monkeypatch.delenv("SPECFIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    reset_plugins()
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith(("specfit_fifo_cache", "broken_plugin", "dup_plugin"))]:
        del sys.modules[name]
    reset_plugins()


def install_example(site: Path) -> None:
    install_fake_distribution(site, "specfit-fifo-cache", {"fifo_cache": "specfit_fifo_cache"}, {})
    (site / "specfit_fifo_cache").symlink_to(EXAMPLE / "specfit_fifo_cache")


def test_builtins_are_listed():
    names = {(e.kind, e.name) for e in get_plugins().entries()}
    assert {("cache", "lru"), ("cache", "none"), ("cache", "full"), ("drafter", "none"), ("selector", "eagle3")} <= names


def test_third_party_cache_used_through_a_plain_override(site):
    install_example(site)
    entry = get_plugins()["cache"].get("fifo")
    assert (entry.distribution, entry.version) == ("specfit-fifo-cache", "1.2.3")
    cfg = specfit.compose(["model=tiny", "cache=fifo", "cache.capacity=3", "max_new_tokens=6"])
    assert type(cfg.cache).__name__ == "DictConfig" and cfg.cache.name == "fifo"
    engine = specfit.build(cfg)
    assert type(engine.runtime.policy).__name__ == "FIFOCache"
    reference = specfit.Engine(tiny_model(), device="cpu").generate([1, 2, 3], max_new_tokens=6).token_ids
    out = engine.generate([1, 2, 3])
    assert out.token_ids == reference and out.stats["expert_cache_misses"] > 0
    with pytest.raises(specfit.config.ConfigError, match="capacty"):
        specfit.compose(["model=tiny", "cache=fifo", "cache.capacty=3"])


def test_broken_plugin_is_named_and_can_be_skipped(site, monkeypatch):
    install_fake_distribution(site, "broken-dist", {"broken": "broken_plugin"}, {"broken_plugin": "import nonexistent_module_xyz\n"})
    with pytest.raises(PluginError, match=r"plugin 'broken' \(broken-dist 1.2.3.*failed to load: ModuleNotFoundError"):
        get_plugins()
    reset_plugins()
    monkeypatch.setenv("SPECFIT_PLUGINS", "nothing_else")
    assert get_plugins()["cache"].get("lru")
    reset_plugins()
    monkeypatch.delenv("SPECFIT_PLUGINS")
    monkeypatch.setenv("SPECFIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert get_plugins()["cache"].get("lru")


def test_duplicate_names_are_errors_naming_both(site):
    source = """
        from dataclasses import dataclass

        import specfit
        from specfit.plugins.caches.none import NoCache

        class Other(NoCache):
            name = "lru"

            @dataclass
            class Config(NoCache.Config):
                name: str = "lru"

        @specfit.hookimpl
        def register_expert_caches(register):
            register(Other)
    """
    install_fake_distribution(site, "dup-dist", {"dup": "dup_plugin"}, {"dup_plugin": source})
    with pytest.raises(PluginError, match=r"cache 'lru' is registered twice: by specfit.builtin.caches .* and by dup \(dup-dist 1.2.3\)"):
        get_plugins()


def test_unknown_hook_is_named(site):
    source = """
        import specfit

        @specfit.hookimpl
        def register_widgets(register):
            pass
    """
    install_fake_distribution(site, "dup-dist", {"dup": "dup_plugin"}, {"dup_plugin": source})
    with pytest.raises(PluginError, match="plugin 'dup' implements an unknown hook"):
        get_plugins()


def test_protocol_is_checked():
    class NoAdmit:
        name = "bad"

        class Config(specfit.config.CacheConfig):
            name: str = "bad"

    registry = Registry("cache")
    from specfit.registry import PluginEntry

    with pytest.raises(PluginError, match="cache plugin 'bad' .* lacks admit, begin_pass, bind, preload, resident"):
        registry.add(PluginEntry("cache", "bad", NoAdmit, "test", "test", "0"))


def test_unknown_plugin_name_lists_the_known_ones():
    with pytest.raises(PluginError, match=r"unknown cache 'nope' \(registered: full, lru, none\)"):
        get_plugins()["cache"].get("nope")
