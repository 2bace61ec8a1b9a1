"""The plugin registry: pluggy loads plugins, each kind's registry maps names to classes.

Built-in plugins register first under ``specfit.builtin.*`` names, then third-party packages from
the entry-point group ``specfit``. Environment switches:

- ``SPECFIT_DISABLE_PLUGIN_AUTOLOAD=1``: load no third-party entry points;
- ``SPECFIT_PLUGINS=a,b``: load only the entry points named ``a`` and ``b``.

:func:`register_plugin` adds a plugin module in code (an uninstalled package's own tests).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as metadata
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

import pluggy

from specfit.version import __version__
from specfit.messages import one_line_config_error
from specfit.errors import ConfigError, PluginError, SpecfitError
from specfit.interfaces import hookspecs
from specfit.interfaces.configs import CONSUMED_ELSEWHERE, PLUGIN_BASES
from specfit.interfaces.contracts import check_plugin_instance, remedy
from specfit.interfaces.protocols import KINDS
from specfit.interfaces.contracts import contract

ENTRY_POINT_GROUP = "specfit"

BUILTIN_MODULES = {
    "specfit.builtin.drafters": "specfit.plugins.drafters",
    "specfit.builtin.selectors": "specfit.plugins.selectors",
    "specfit.builtin.cost_models": "specfit.plugins.cost_models",
    "specfit.builtin.caches": "specfit.plugins.caches",
    "specfit.builtin.predictors": "specfit.plugins.predictors",
    "specfit.builtin.acceptance": "specfit.plugins.acceptance",
    "specfit.builtin.prefetchers": "specfit.plugins.prefetchers",
}

# kind -> name of the hook that registers it
HOOKS = {
    "drafter": "register_drafters",
    "selector": "register_selectors",
    "cost_model": "register_cost_models",
    "cache": "register_expert_caches",
    "predictor": "register_predictors",
    "acceptance": "register_acceptance_estimators",
    "prefetch": "register_prefetchers",
}


@dataclass(frozen=True)
class PluginEntry:
    kind: str
    name: str
    cls: type
    plugin: str  # the pluggy plugin (module) that registered it
    distribution: str
    version: str

    def as_dict(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "name": self.name,
            "class": f"{self.cls.__module__}.{self.cls.__qualname__}",
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
        }


def check_plugin_class(kind: str, cls: Any) -> None:
    """Reject a class that does not fulfil its kind's contract, naming what is missing.

    Methods and class attributes of the kind's Protocol are checked here; attributes a plug-in may
    set in ``__init__`` (a drafter's ``depth``) are checked on the object the registry builds.
    """
    if not inspect.isclass(cls):
        raise PluginError(f"{kind} plugin must be registered as a class, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise PluginError(f"{kind} plugin {cls.__qualname__} needs a class attribute `name` (an identifier)")
    missing = sorted({m for m in contract(kind).on_class if not hasattr(cls, m)}
                     | set(getattr(cls, "__abstractmethods__", ())))
    if missing:
        raise PluginError(f"{kind} plugin '{name}' ({cls.__qualname__}) lacks {', '.join(missing)} "
                          f"({remedy(kind)})")
    config = getattr(cls, "Config", None)
    base = PLUGIN_BASES[kind]
    if not (inspect.isclass(config) and dataclasses.is_dataclass(config) and issubclass(config, base)):
        raise PluginError(
            f"{kind} plugin '{name}' needs `Config`, a dataclass subclassing specfit.interfaces.{base.__name__}"
        )
    default = {f.name: f.default for f in dataclasses.fields(config)}.get("name")
    if default != name:
        raise PluginError(f"{kind} plugin '{name}': its Config's `name` default is {default!r}, expected {name!r}")
    constructor_arguments(kind, cls, [f.name for f in dataclasses.fields(config)])


def constructor_arguments(kind: str, cls: type, fields: list[str]) -> list[str]:
    """The config fields the registry passes to ``cls(...)``: all of them, except ``name`` (the
    registry's) and those :data:`~specfit.interfaces.CONSUMED_ELSEWHERE` reads. A field the
    constructor does not take is an error, not a key silently ignored. A class with ``from_config``
    receives the whole config instead (and nothing is checked here)."""
    if getattr(cls, "from_config", None) is not None:
        return []
    passed = [f for f in fields if f != "name" and f not in CONSUMED_ELSEWHERE[kind]]
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return passed
    unknown = [f for f in passed if f not in params]
    if unknown:
        raise PluginError(
            f"{kind} plugin '{cls.name}': config field{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(f'{kind}.{f}' for f in unknown)} of {cls.Config.__qualname__} "
            f"{'are not parameters' if len(unknown) > 1 else 'is not a parameter'} of {cls.__qualname__}() "
            f"(a misspelt parameter? a key must reach the plugin; or define from_config(cfg))"
        )
    return passed + (["name"] if "name" in params else [])


class Registry:
    """Name -> class for one kind of plugin; duplicates are errors naming both sources."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entries: dict[str, PluginEntry] = {}

    def add(self, entry: PluginEntry) -> None:
        check_plugin_class(self.kind, entry.cls)
        old = self.entries.get(entry.name)
        if old is not None and old.cls is not entry.cls:
            raise PluginError(
                f"{self.kind} '{entry.name}' is registered twice: by {old.plugin} ({old.distribution} {old.version}) "
                f"and by {entry.plugin} ({entry.distribution} {entry.version})"
            )
        self.entries[entry.name] = entry

    def get(self, name: str) -> PluginEntry:
        try:
            return self.entries[name]
        except KeyError:
            known = ", ".join(sorted(self.entries)) or "none"
            raise PluginError(f"unknown {self.kind} '{name}' (registered: {known})") from None

    def create(self, cfg: Any, **given: Any) -> Any:
        """Build the plugin named by ``cfg.name`` from its config (a DictConfig or dataclass);
        ``given``: further constructor arguments the composition root supplies (a cost-aware
        selector's ``estimator``).

        Every field reaches the plugin (see :func:`constructor_arguments`), and the object is checked
        against its kind's contract before anyone binds it. A bad value raises :class:`ConfigError`
        naming the key (the config's ``__post_init__`` or the plugin's constructor); a plugin that
        cannot be built from its own config, a PluginError.
        """
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            try:
                cfg = OmegaConf.to_object(cfg)  # runs the Config's __post_init__ checks
            except SpecfitError:
                raise
            except ValueError as exc:  # a third-party Config's own check
                raise ConfigError(f"{self.kind}: {_one_line(exc)}") from exc
            except Exception as exc:  # an omegaconf error: a missing or mistyped value
                raise ConfigError(f"{self.kind}: {one_line_config_error(exc)}") from exc
        name = getattr(cfg, "name", None)
        if not isinstance(name, str):
            raise PluginError(f"a {self.kind} config needs a `name` (a registered {self.kind}), "
                              f"got {type(cfg).__name__}")
        entry = self.get(name)
        if not isinstance(cfg, entry.cls.Config):
            raise PluginError(
                f"{self.kind}.name={cfg.name!r} but the {self.kind} config is {type(cfg).__name__}; "
                f"select the plugin with {self.kind}={cfg.name}"
            )
        from_config = getattr(entry.cls, "from_config", None)
        passed = constructor_arguments(self.kind, entry.cls, [f.name for f in dataclasses.fields(cfg)])
        try:
            if from_config is not None:
                part = from_config(cfg, **given)
            else:
                part = entry.cls(**{k: getattr(cfg, k) for k in passed}, **given)
        except SpecfitError:
            raise
        except ValueError as exc:
            raise ConfigError(f"{self.kind} '{entry.name}': {_one_line(exc)}") from exc
        except TypeError as exc:
            raise PluginError(f"{self.kind} '{entry.name}' cannot be built from its config: {_one_line(exc)}") from exc
        check_plugin_instance(self.kind, part)
        return part


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class Plugins:
    """All registries plus the pluggy manager that filled them."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("specfit")
        self.pm.add_hookspecs(hookspecs)
        self.registries = {kind: Registry(kind) for kind in KINDS}
        self._sources: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)

    def __getitem__(self, kind: str) -> Registry:
        return self.registries[kind]

    def entries(self) -> list[PluginEntry]:
        return [e for kind in KINDS for e in sorted(self.registries[kind].entries.values(), key=lambda e: e.name)]

    def register_module(self, module: object, name: str, distribution: str, version: str) -> None:
        try:
            self.pm.register(module, name=name)
        except ValueError as exc:
            raise PluginError(f"plugin '{name}' ({distribution}): {exc}") from exc
        self._sources[name] = (distribution, version)

    def load(self) -> None:
        for name, module in BUILTIN_MODULES.items():
            self.register_module(importlib.import_module(module), name, "specfit", __version__)
        for ep, dist, version in _entry_points():
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin must not look like a specfit bug
                raise PluginError(
                    f"plugin '{ep.name}' ({dist} {version}, entry point {ep.value}) failed to load: "
                    f"{type(exc).__name__}: {exc}. Uninstall or fix it, or skip it with "
                    f"SPECFIT_PLUGINS=<allowed names> or SPECFIT_DISABLE_PLUGIN_AUTOLOAD=1"
                ) from exc
            self.register_module(module, ep.name, dist, version)
        for module, name in _IN_CODE:
            if not self.pm.is_registered(module):  # installed too: its entry point registered it already
                self.register_module(module, name, IN_CODE, "")
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.pm.get_name(exc.plugin) or repr(exc.plugin)
            raise PluginError(f"plugin '{name}' implements an unknown hook: {exc}") from exc
        self._collect()

    def _collect(self) -> None:
        """Call every plugin's register hooks, remembering which plugin registered what."""
        for kind, hook_name in HOOKS.items():
            for impl in self._impls(hook_name):
                dist, version = self._sources.get(impl.plugin_name, ("unknown", ""))

                def register(cls: type, _impl=impl, _dist=dist, _version=version, _kind=kind) -> None:
                    name = getattr(cls, "name", None)
                    self.registries[_kind].add(PluginEntry(_kind, name, cls, _impl.plugin_name, _dist, _version))

                self._call(impl, register=register)

    def _impls(self, hook_name: str) -> list[Any]:
        order = list(self._sources)  # registration order: built-ins first
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        return sorted(impls, key=lambda i: order.index(i.plugin_name) if i.plugin_name in order else len(order))

    def _call(self, impl: Any, **kwargs: Any) -> None:
        try:
            impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(f"plugin '{impl.plugin_name}' failed in {impl.function.__name__}: {type(exc).__name__}: {exc}") from exc

    def store_configs(self, cs: Any) -> None:
        """Make every registered plugin a Hydra option of its group, plus plugins' extra config nodes
        (:func:`specfit.config.store_configs` adds the main schema)."""
        for entry in self.entries():
            cs.store(group=entry.kind, name=entry.name, node=entry.cls.Config)
        for impl in self._impls("register_configs"):
            self._call(impl, config_store=cs)


def _entry_points() -> list[tuple[metadata.EntryPoint, str, str]]:
    if os.environ.get("SPECFIT_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower() in ("1", "true", "yes", "on"):
        return []
    allowed = os.environ.get("SPECFIT_PLUGINS")
    allow = {n.strip() for n in allowed.split(",") if n.strip()} if allowed is not None else None
    found = []
    installed = metadata.entry_points(group=ENTRY_POINT_GROUP)
    for ep in installed:
        if allow is not None and ep.name not in allow:
            continue
        dist = ep.dist.name if ep.dist is not None else "unknown"
        version = ep.dist.version if ep.dist is not None else ""
        found.append((ep, dist, version))
    unknown = sorted((allow or set()) - {ep.name for ep in installed} - {name for _, name in _IN_CODE})
    if unknown:  # a misspelt name would otherwise load nothing without a word
        names = ", ".join(sorted({ep.name for ep in installed})) or "none"
        print(f"specfit: SPECFIT_PLUGINS names {', '.join(unknown)}, which no installed plug-in package "
              f"provides (installed entry points: {names})", file=sys.stderr)
    return found


_PLUGINS: Plugins | None = None
_IN_CODE: list[tuple[object, str]] = []  # plugin modules given to register_plugin, in order
IN_CODE = "registered in code"  # their distribution, as `specfit plugins` lists it


def register_plugin(module: object, name: str | None = None) -> None:
    """Load a plugin module as its entry point would, without installing its package (its tests, a
    notebook). ``name`` is the plugin's name in errors (default: the module's). Takes effect from the
    next :func:`get_plugins`; the environment switches do not filter it."""
    if all(m is not module for m, _ in _IN_CODE):
        _IN_CODE.append((module, name or getattr(module, "__name__", repr(module))))
    reset_plugins()


def get_plugins() -> Plugins:
    """The process-wide plugin set, loaded on first use (idempotent: multirun jobs share it).

    Hydra learns of their configs from :func:`specfit.config.store_configs`."""
    global _PLUGINS
    if _PLUGINS is None:
        plugins = Plugins()
        plugins.load()
        _PLUGINS = plugins
    return _PLUGINS


def reset_plugins() -> None:
    """Forget loaded plugins (tests, or after installing a plugin package in-process)."""
    global _PLUGINS
    _PLUGINS = None

