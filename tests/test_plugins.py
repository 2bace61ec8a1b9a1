"""Plug-in discovery through entry points, and the errors a plugin author can run into."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import specfit
import specfit.interfaces
from specfit.errors import ConfigError, PluginError
from specfit import registry
from specfit.interfaces import CacheConfig, CostModelBase, CostModelConfig, SelectorBase, SelectorConfig
from specfit.registry import PluginEntry, Registry, get_plugins, register_plugin, reset_plugins

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
    monkeypatch.setattr(registry, "_IN_CODE", [])  # what register_plugin adds is forgotten afterwards
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
    """Found through its entry point; its decoding is tested by its own tests (test_example_plugin.py)."""
    install_example(site)
    entry = get_plugins()["cache"].get("fifo")
    assert (entry.distribution, entry.version) == ("specfit-fifo-cache", "1.2.3")
    cfg = specfit.compose(["model=tiny", "cache=fifo", "cache.capacity=3", "max_new_tokens=6"])
    assert type(cfg.cache).__name__ == "DictConfig" and cfg.cache.name == "fifo"
    cache = get_plugins()["cache"].create(cfg.cache)
    assert type(cache).__name__ == "FIFOCache" and cache.requested == (3, None)
    with pytest.raises(ConfigError, match="capacty"):
        specfit.compose(["model=tiny", "cache=fifo", "cache.capacty=3"])


def test_a_package_registered_in_code_is_loaded_once(site):
    """register_plugin loads an uninstalled package; installed too, its entry point's copy is the one."""
    install_example(site)
    import specfit_fifo_cache

    register_plugin(specfit_fifo_cache, "fifo_in_code")
    entry = get_plugins()["cache"].get("fifo")
    assert (entry.plugin, entry.distribution) == ("fifo_cache", "specfit-fifo-cache")


def test_broken_plugin_is_named_and_can_be_skipped(site, monkeypatch, capsys):
    install_fake_distribution(site, "broken-dist", {"broken": "broken_plugin"}, {"broken_plugin": "import nonexistent_module_xyz\n"})
    with pytest.raises(PluginError, match=r"plugin 'broken' \(broken-dist 1.2.3.*failed to load: ModuleNotFoundError"):
        get_plugins()
    reset_plugins()
    monkeypatch.setenv("SPECFIT_PLUGINS", "nothing_else")
    assert get_plugins()["cache"].get("lru")
    err = capsys.readouterr().err  # a name no package provides is said, with the names there are
    assert "SPECFIT_PLUGINS names nothing_else, which no installed plug-in package provides" in err
    assert "broken" in err
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

        class Config(CacheConfig):
            name: str = "bad"

    registry = Registry("cache")
    from specfit.registry import PluginEntry

    with pytest.raises(PluginError, match="cache plugin 'bad' .* lacks admit, admit_prefetch, begin_pass, bind, can_prefetch, preload, resident"):
        registry.add(PluginEntry("cache", "bad", NoAdmit, "test", "test", "0"))


def test_unknown_plugin_name_lists_the_known_ones():
    with pytest.raises(PluginError, match=r"unknown cache 'nope' \(registered: full, lru, none\)"):
        get_plugins()["cache"].get("nope")


def _add(kind: str, cls: type) -> Registry:
    registry = Registry(kind)
    registry.add(PluginEntry(kind, cls.name, cls, "test", "test", "0"))
    return registry


def test_a_selector_written_from_the_old_protocol_is_refused_naming_the_hooks_it_lacks():
    """chooses_among_likeliest, observe_time, requires, should_draft and takes_estimator are part of the contract
    (SelectorBase has defaults), checked on the class; acceptance_score, draft_time, estimator and gate too, on
    the object."""
    class OldStyle:
        name = "old_style"

        @dataclass
        class Config(SelectorConfig):
            name: str = "old_style"

        def bind(self, spec): ...

        def select(self, tree, ctx): ...

        def observe(self, tree, verified, accepted): ...

    with pytest.raises(PluginError, match=r"selector plugin 'old_style' .* lacks chooses_among_likeliest, observe_time, requires, should_draft, takes_estimator "
                                          r"\(subclass specfit.interfaces.SelectorBase .*specfit.interfaces.Selector\)"):
        _add("selector", OldStyle)

    OldStyle.requires, OldStyle.takes_estimator, OldStyle.chooses_among_likeliest = (), False, False
    OldStyle.should_draft = lambda self: True
    OldStyle.observe_time = lambda self, drafted, committed, seconds: None
    with pytest.raises(PluginError, match=r"selector 'old_style' \(.*OldStyle\) lacks acceptance_score, draft_time, "
                                          r"estimator, gate \(subclass specfit.interfaces.SelectorBase"):
        _add("selector", OldStyle).create(OldStyle.Config())

    class FromBase(SelectorBase):  # the base supplies them; select stays required
        name = "from_base"
        Config = OldStyle.Config

    with pytest.raises(PluginError, match="selector plugin 'from_base' .* lacks select"):
        _add("selector", FromBase)


def test_the_cost_model_contract_is_what_the_core_uses():
    class PredictOnly:  # the contract as it was once declared: bind, predict, observe
        name = "predict_only"

        @dataclass
        class Config(CostModelConfig):
            name: str = "predict_only"

        def bind(self, spec): ...

        def predict(self, tree, nodes, resident, draft_seconds): ...

        def observe(self, record): ...

    with pytest.raises(PluginError, match="cost_model plugin 'predict_only' .* lacks problem, set_constants"):
        _add("cost_model", PredictOnly)

    class Minimal(CostModelBase):
        name = "minimal"

        @dataclass
        class Config(CostModelConfig):
            name: str = "minimal"

    model = _add("cost_model", Minimal).create(Minimal.Config())
    assert model.calibration == "auto" and not model.calibrated
    with pytest.raises(specfit.errors.ConfigError, match="cost_model=minimal is not calibrated"):
        model.constants
    with pytest.raises(specfit.errors.ConfigError, match="cost_model=minimal builds no selection problems"):
        model.problem(None, None, None, 0.0)


def test_a_config_field_the_constructor_does_not_take_is_refused_at_registration():
    """A misspelt parameter would otherwise make its key a silent no-op."""
    class Typo:
        name = "typo"

        @dataclass
        class Config(CacheConfig):
            name: str = "typo"
            ways: int = 4

        def __init__(self, capacty=None, capacity_bytes=None, ways=4): ...

        bind = preload = begin_pass = admit = resident = admit_prefetch = lambda self, *a: None
        can_prefetch = False

    with pytest.raises(PluginError, match=r"cache plugin 'typo': config field cache.capacity of .*Config is not a "
                                          r"parameter of .*Typo\(\)"):
        _add("cache", Typo)
    Typo.__init__ = lambda self, capacity=None, capacity_bytes=None, ways=4: setattr(self, "ways", ways)
    built = _add("cache", Typo).create(Typo.Config(ways=8))  # cache.copy/link go to specfit.build instead
    assert built.ways == 8


def test_an_object_lacking_an_attribute_is_refused_before_it_is_bound():
    class NoLimits:
        name = "no_limits"

        @dataclass
        class Config(specfit.interfaces.DrafterConfig):
            name: str = "no_limits"

        bind = feature_layers = start = draft = commit = lambda self, *a: None

    with pytest.raises(PluginError, match=r"drafter 'no_limits' \(.*NoLimits\) lacks depth, path, "
                                          r"probe_left_unused, top_k, total_tokens"):
        _add("drafter", NoLimits).create(NoLimits.Config())


def test_from_config_reads_every_field_of_the_builtins():
    """Built-ins built by from_config (not checked at registration) must read every key of their config."""
    plugins = get_plugins()
    checked = 0
    for entry in plugins.entries():
        if getattr(entry.cls, "from_config", None) is None:
            continue
        read: set[str] = set()

        class Tracking(entry.cls.Config):
            def __getattribute__(self, key):
                read.add(key)
                return object.__getattribute__(self, key)

        Tracking.__name__ = entry.cls.Config.__name__
        try:
            entry.cls.from_config(Tracking())
        except specfit.errors.SpecfitError:
            pass  # a built-in that needs more (a head path) has read its keys by then
        fields = {f.name for f in dataclasses.fields(entry.cls.Config)} - {"name"}
        assert fields <= read, f"{entry.kind} {entry.name} ignores {sorted(fields - read)}"
        checked += 1
    assert checked >= 2  # the eagle3 drafter and the union cost model


def test_plugin_authors_import_everything_from_specfit_interfaces():
    import specfit.interfaces as interfaces

    for name in interfaces.__all__:
        assert getattr(interfaces, name) is not None, name
    assert set(interfaces.CONSUMED_ELSEWHERE["cache"]) == {"copy", "link"}
    assert {"copy", "link"} <= {f.name for f in dataclasses.fields(interfaces.CacheConfig)}
    assert interfaces.ACCEPTED_KEY == "trace_accepted"
