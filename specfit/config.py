"""Structured configuration: the schema every Hydra config is checked against.

Each pluggable part is a config group (``drafter``, ``selector``, ``cost_model``, ``cache``,
``predictor``) whose options are the registered plugins' ``Config`` dataclasses, so a misspelled key
or a wrong type fails at composition. ``model`` and ``workload`` are plain groups with presets in
``conf/``. :func:`compose` is the programmatic entry point (Hydra's compose API).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from omegaconf import MISSING, DictConfig

from specfit.errors import ConfigError
# The plug-in groups' base configs live with the contracts (plug-ins import them from there);
# re-exported here for the main schema and existing imports.
from specfit.interfaces.configs import (  # noqa: F401
    COPY_KINDS,
    PLUGIN_BASES,
    AcceptanceConfig,
    CacheConfig,
    CostModelConfig,
    DrafterConfig,
    LinkConfig,
    PluginConfig,
    PredictorConfig,
    PrefetcherConfig,
    SelectorConfig,
)

from specfit.messages import one_line_config_error
from specfit.model.config import ModelConfig

CONFIG_MODULE = "specfit.conf"
CALIBRATION_MODES = ("auto", "off", "force")


# --------------------------------------------------------------------------- plain groups


@dataclass
class WorkloadConfig:
    """The prompts to decode; see :mod:`specfit.workloads` for the kinds."""

    name: str = "inline"
    kind: str = "inline"  # inline | prose | summary | gsm | jsonl | hf
    prompts: list[str] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    path: str | None = None  # kind=jsonl: one {"prompt": ...} or {"prompt_ids": [...]} per line
    dataset: str | None = None  # kind=hf: cnn_dailymail | gsm8k (a local copy)
    split: str = "test"
    data_dir: str | None = None  # prose/summary/gsm: default ../shared/data beside the repository
    num_prompts: int = 8
    prompt_chars: int = 600  # prose/summary: characters of context
    max_prompts: int | None = None
    seed: int = 0


@dataclass
class SamplingConfig:
    """temperature 0 is greedy; otherwise temperature, then top-k, then top-p (as in HF)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclass
class TraceConfig:
    """`specfit record` writes, `specfit replay` reads (docs/method.md section 7)."""

    path: str | None = None  # record: null writes trace/ in the run directory; replay: required
    overwrite: bool = False  # record: replace a trace already at trace.path


@dataclass
class ReplayConfig:
    # D, the drafting time charged per cycle, in the selector's vocabulary: measured (the trace's
    # drafting time up to the level the selector stopped at, plus predictor and selector time measured
    # in the replay; "recorded", its earlier name, is accepted) | modelled (c_draft0 + c_level * levels
    # from the calibration: the replay then depends on no clock)
    draft_time: str = "measured"
    warmup: int = 8  # measured time only: cycles first replayed with throwaway plugins (one-time costs)
    oracle: bool = True  # also replay selector=oracle per cache and cost model, the reference of every method
    # charge (and plan with) a named machine's constants instead of the trace's: time is then modelled
    # (draft_time too); names in specfit.types.cost_profiles, e.g. qwen3-30b-a3b-h200-pcie5
    cost_profile: str | None = None


@dataclass
class ServerConfig:
    """`specfit serve` (docs/user-guide.md, "Serving"): where it listens and its limits; only that
    command composes it (serve.yaml), every other command has ``server: null``."""

    host: str = "127.0.0.1"  # loopback by default: 0.0.0.0 exposes the server to the network
    port: int = 8000  # 0: any free port (the one taken is printed)
    model_name: str = "specfit"  # the name clients give as "model" (GET /v1/models lists it)
    api_key: str | None = None  # set: /v1/* needs "Authorization: Bearer <api_key>", else 401
    max_waiting: int = 64  # requests queued behind the running one; beyond it: 503 with Retry-After
    request_timeout: float = 300.0  # seconds from arrival (queue included) before a request ends with an error
    max_body_bytes: int = 1_000_000  # a larger request body: 413
    shutdown_timeout: float = 10.0  # SIGTERM: seconds the running request may take to finish, then cancelled
    warmup: bool = True  # decode a few tokens before /health says ready
    log_level: str = "warning"  # uvicorn's: critical | error | warning | info | debug | trace

    def __post_init__(self) -> None:
        from specfit.validation import choice, integer, number

        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError(f"server.host={self.host!r} must be a host name or address (default 127.0.0.1)")
        port = integer("server.port", self.port, minimum=0)
        if port > 65535:
            raise ConfigError(f"server.port={port} is out of range: a TCP port is 0..65535 (0: any free port)")
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ConfigError("server.model_name is empty: name the model clients ask for (default specfit)")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ConfigError("server.api_key is empty: give a key, or null for none")
        integer("server.max_waiting", self.max_waiting, minimum=0)
        integer("server.max_body_bytes", self.max_body_bytes, minimum=1024)
        for key in ("request_timeout", "shutdown_timeout"):
            value = number(f"server.{key}", getattr(self, key), minimum=0)
            if not value > 0 or value == float("inf"):
                raise ConfigError(f"server.{key}={value!r} must be a positive number of seconds")
        choice("server.log_level", self.log_level, ("critical", "error", "warning", "info", "debug", "trace"))


@dataclass
class SpecfitConfig:
    model: ModelConfig = MISSING
    drafter: DrafterConfig = MISSING
    selector: SelectorConfig = MISSING
    cost_model: CostModelConfig | None = None
    cache: CacheConfig = MISSING
    predictor: PredictorConfig | None = None
    acceptance: AcceptanceConfig | None = None  # a_v for the cost-aware selectors; null: the selector's own (path_prob)
    prefetch: PrefetcherConfig | None = None  # expert prefetch (none | lookahead | draft | auto); null: none
    workload: WorkloadConfig = MISSING
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    prompt_file: str | None = None  # the prompt as UTF-8 text from a file ("-": standard input); no quoting needed
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    results_file: str = "results.jsonl"
    answers_dir: str | None = None  # bench/demo: also write Spec-Bench-style answers, one JSONL per method
    # bench/demo: skip the runs already in results_file with the same config; record: continue the
    # incomplete trace at trace.path (an interrupted run prints the exact command)
    resume: bool = False
    # Comparisons (`specfit demo`, `specfit bench`): named methods, each a list of overrides
    # (method_presets), run side by side on the same prompts of each workload in `workloads`
    # (empty: the config's own workload), interleaved, `repeats` times.
    methods: list[str] = field(default_factory=list)
    method_presets: dict[str, list[str]] = field(default_factory=dict)
    workloads: list[str] = field(default_factory=list)
    repeats: int = 1
    # untimed decodes of the first prompt by each engine before the timed runs, so that no method
    # pays one-time costs (compiling the search, a GPU's kernels and autotuning, first-touch of
    # memory) in another's place; the engines learn from them as from any decode. 0: none
    warmup: int = 1
    baseline: str = "ar"  # speedups are relative to this method (and to eagle3_nocache when present)
    trace: TraceConfig = field(default_factory=TraceConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    # the cost model's calibration for this setup: auto (the stored one; measured once, the first
    # time a setup that drafts needs one) | off (the stored one or none: never measures) | force
    # (measure it again now, in full, and store it)
    calibration: str = "auto"
    server: ServerConfig | None = None  # specfit serve only (conf/serve.yaml)
    verbose: bool = False  # errors with their full traceback (as HYDRA_FULL_ERROR=1 does), not one line


def asset_path(relative: str) -> str:
    """Absolute path of a file shipped inside the package (``${specfit.asset:demo/target}``)."""
    from pathlib import Path

    path = Path(__file__).resolve().parent / "assets" / relative
    if not path.exists():
        raise ConfigError(f"shipped asset {relative!r} is missing from this installation ({path})")
    return str(path)


def store_schemas(cs: Any) -> None:
    """Put the schema nodes into Hydra's ConfigStore and register resolvers (idempotent)."""
    from omegaconf import OmegaConf

    cs.store(name="specfit_schema", node=SpecfitConfig)
    OmegaConf.register_new_resolver("specfit.asset", asset_path, replace=True)


_STORED_FOR: Any = None  # the plugin set whose configs are in Hydra's ConfigStore


def store_configs() -> None:
    """Load the plugins and put every config node into Hydra's ConfigStore before it composes: the
    main schema, each plugin's ``Config`` as an option of its group, plugins' extra nodes. Once per
    plugin set (again after :func:`specfit.registry.reset_plugins`)."""
    global _STORED_FOR
    from hydra.core.config_store import ConfigStore

    from specfit.registry import get_plugins

    plugins = get_plugins()
    if plugins is not _STORED_FOR:
        cs = ConfigStore.instance()
        store_schemas(cs)
        plugins.store_configs(cs)
        _STORED_FOR = plugins


def override_key(override: str) -> str:
    """The key a Hydra override sets, adds (``+key=``) or deletes (``~key``): ``a.b`` of ``+a.b=1``."""
    return override.split("=", 1)[0].lstrip("+~")


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose a config from the packaged conf/ tree and ``overrides`` (Hydra syntax).

    Loads plugins first so third-party config groups are known. Works inside a running Hydra app
    too (``specfit bench`` composes one config per method).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    store_configs()
    if isinstance(overrides, (str, bytes, Mapping)) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"compose(overrides=...) takes a list of 'key=value' strings, got {overrides!r:.60}")
    _check_group_choices(overrides)
    try:
        if GlobalHydra.instance().is_initialized():
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
        else:
            with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
                cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    except Exception as exc:  # hydra/omegaconf raise many types; all are config mistakes here
        raise ConfigError(_unselected_group(exc, overrides, config_name) or _naming_unparsed(
            one_line_config_error(exc), exc, overrides)) from exc
    check_config(cfg, relations=False)  # bench composes single overrides to see which methods they fit
    _check_workload_overrides(cfg, overrides)
    return cfg


# groups whose default is no option at all, so ``~group`` leaves a valid config
_REMOVABLE_GROUPS = ("cost_model", "predictor", "acceptance")


@functools.cache
def _config_groups() -> frozenset[str]:
    """The config groups: the plug-in kinds and the folders of the packaged conf/ tree."""
    return frozenset({*PLUGIN_BASES, *(d.name for d in (Path(__file__).parent / "conf").iterdir() if d.is_dir())})


def _check_group_choices(overrides: Sequence[str]) -> None:
    """A config group takes one option: a list (``prefetch=[lookahead,draft]``; Hydra merges options
    of one config class silently, so ``workload=[prose,gsm]`` ran gsm alone) or null is one line."""
    groups = _config_groups()
    for override in overrides:
        key, eq, value = override.partition("=")
        if not eq or key.startswith(("+", "~")) or key not in groups:
            continue
        value = value.strip()
        if value.startswith("["):
            hint = {"prefetch": " (prefetch=auto combines lookahead and draft)",
                    "workload": " (several workloads: workloads=[...], in specfit bench)"}.get(key, "")
            raise ConfigError(f"{override}: {key} takes one option, not a list{hint}")
        if value == "null":
            drop = ""
            if key in _REMOVABLE_GROUPS:
                drop = f" or drop the group with ~{key}"
            elif key == "prefetch":
                drop = " (prefetch=none turns prefetch off)"
            raise ConfigError(f"{override}: {key} is a group of options: choose one ({key}=NAME; `specfit plugins` "
                              f"lists them){drop}")


def _check_workload_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """The workload keys given here fit the workload: ``workload.kind`` does not contradict the
    workload named beside it (``workload=prose workload.kind=gsm`` would label GSM prompts prose),
    and a key its kind does not read is refused rather than ignored. A bench's ``workloads=[...]``
    list is checked over the whole list (specfit.commands.bench)."""
    from omegaconf import OmegaConf

    if OmegaConf.get_type(cfg) is not SpecfitConfig or cfg.workloads:
        return
    given = given_overrides(overrides)
    workload = cfg.workload
    chosen = given.get("workload", "").partition("=")[2]
    preset = Path(__file__).parent / "conf" / "workload" / f"{chosen}.yaml"
    own = OmegaConf.load(preset).get("kind") if "workload.kind" in given and preset.is_file() else None
    if own is not None and own != workload.kind:
        raise ConfigError(f"workload.kind={workload.kind} contradicts workload={chosen} (kind {own}): drop "
                          f"workload.kind, or name a workload of kind {workload.kind}")
    if workload.kind == "inline":  # a prompt beside workload keys is its own error (cli)
        return
    unread = unread_workload_key(given, [workload.kind])
    if unread is not None:
        override, readers = unread
        raise ConfigError(f"{override} does not apply to workload={workload.name} (kind {workload.kind}): only "
                          f"kind={' or '.join(readers)} reads it")


def given_overrides(overrides: Sequence[str]) -> dict[str, str]:
    """Each key given a value, with its override (the last, which applies, for a key given twice)."""
    return {override_key(o): o for o in overrides if "=" in o and not o.startswith("~")}


def unread_workload_key(given: Mapping[str, str], kinds: Sequence[str]) -> tuple[str, tuple[str, ...]] | None:
    """The first ``workload.*`` override of ``given`` (from :func:`given_overrides`) that no workload of
    ``kinds`` reads, with the kinds that do; None when each is read."""
    for key, readers in WORKLOAD_KEY_KINDS.items():
        override = given.get(f"workload.{key}")
        if override is not None and not set(kinds) & set(readers):
            return override, readers
    return None


def _unselected_group(exc: BaseException, overrides: Sequence[str], config_name: str) -> str | None:
    """``group.key=value`` for a plug-in group that is null here (``acceptance``, ``cost_model``
    without a cost-aware method): name the key and the choice it needs, not OmegaConf's
    "Unexpected type for root: NoneType". Which groups are null is found by composing again with
    the group choices alone (only on this error path)."""
    if "Unexpected type for root: NoneType" not in str(exc):
        return None
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    choices = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0]]
    try:
        if GlobalHydra.instance().is_initialized():
            base = hydra_compose(config_name=config_name, overrides=choices)
        else:
            with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
                base = hydra_compose(config_name=config_name, overrides=choices)
    except Exception:  # noqa: BLE001 - the choices themselves are wrong: Hydra's own message says so
        return None
    for override in overrides:
        key = override_key(override)
        group = key.split(".", 1)[0]
        if "." in key and group in PLUGIN_BASES and base.get(group) is None:
            return (f"{key}: no {group} plug-in is selected in this config, so it has no settings; "
                    f"choose one first, e.g. {group}=NAME {override} (`specfit plugins` lists the names)")
    return None


def _naming_unparsed(message: str, exc: BaseException, overrides: Sequence[str]) -> str:
    """A parse error that does not say which override it is about ("mismatched input '='") names it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from specfit.messages import _is_parse_error

    if not _is_parse_error(exc):
        return message
    for override in overrides:
        try:
            OverridesParser.create().parse_overrides([override])
        except Exception:  # noqa: BLE001 - this one does not parse
            if override.partition("=")[0].lstrip("+~") not in message:
                reason = message.split(" See https://")[0]
                value = override.partition("=")[2]
                hint = " (a value holding '=' or spaces is quoted: key='a=b')" if "=" in value or " " in value else ""
                return f"cannot parse {override!r}: {reason}{hint}"
            return message
    return message


# --------------------------------------------------------------------------- checks after composition


def check_config(cfg: DictConfig, relations: bool = True) -> None:
    """What composition lets through: keys added with ``+`` or removed with ``~``, and values.

    Hydra's ``+key=value`` adds a key even to a typed node, where it would be silently ignored (or
    break deep inside); every value of the main config is checked here, before any model is built.
    Plugin configs run their own ``__post_init__`` checks. ``relations``: also the checks that
    involve several keys (methods and method_presets, prompt and prompt_ids).
    """
    from omegaconf import OmegaConf

    _check_keys(cfg, "")
    if not isinstance(cfg, DictConfig) or OmegaConf.get_type(cfg) is not SpecfitConfig:
        return  # the trainers' configs: their dataclasses check themselves
    try:
        _check_values(cfg)
        if relations:
            _check_relations(cfg)
    except ConfigError:
        raise
    except Exception as exc:  # an interpolation that does not resolve, a value of the wrong type
        raise ConfigError(one_line_config_error(exc)) from exc


def _check_keys(node: Any, prefix: str) -> None:
    import dataclasses
    import difflib

    from omegaconf import OmegaConf

    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        fields = {f.name: f for f in dataclasses.fields(schema)}
        for key in node.keys():
            if key not in fields:
                near = difflib.get_close_matches(str(key), list(fields), n=1)
                hint = f"; did you mean {prefix}{near[0]}?" if near else ""
                raise ConfigError(f"unknown config key '{prefix}{key}' ({schema.__name__} has no such field{hint}); "
                                  f"`specfit <command> --cfg job` lists the keys")
        for name, f in fields.items():
            if name not in node and "None" not in str(f.type):
                raise ConfigError(f"config key '{prefix}{name}' is required (was it removed with ~{prefix}{name}?)")
    for key in node.keys():
        if not OmegaConf.is_missing(node, key) and not OmegaConf.is_interpolation(node, key):
            _check_keys(node[key], f"{prefix}{key}.")


def _check_values(cfg: DictConfig) -> None:
    from omegaconf import OmegaConf

    from specfit.decode.sampling import SamplingParams
    from specfit.model.numerics import check_numerics
    from specfit.offload.compute.factory import check_expert_compute
    from specfit.validation import choice, integer, token_ids

    integer("max_new_tokens", cfg.max_new_tokens, minimum=1)
    choice("calibration", cfg.calibration, CALIBRATION_MODES)
    integer("repeats", cfg.repeats, minimum=1)
    integer("warmup", cfg.warmup, minimum=0)
    if not str(cfg.results_file or "").strip():
        raise ConfigError("results_file is empty: name the file the rows go to (default results.jsonl, in the run "
                          "folder)")
    if cfg.prompt_ids is not None:
        token_ids("prompt_ids", cfg.prompt_ids, allow_empty=False)
    token_ids("stop_token_ids", cfg.stop_token_ids)
    if cfg.prompt_file not in (None, "-"):  # read when the prompts are; a missing file fails before any model
        from pathlib import Path

        path = Path(cfg.prompt_file).expanduser()
        if path.is_dir():
            raise ConfigError(f"prompt_file={cfg.prompt_file} is a directory, not a text file")
        if not path.is_file():
            raise ConfigError(f"prompt_file={cfg.prompt_file}: no such file")
    SamplingParams(**OmegaConf.to_container(cfg.sampling))
    check_numerics(cfg.model.numerics)
    check_expert_compute(cfg.model.expert_compute)
    _check_workload(cfg.workload)
    _check_replay(cfg.replay)
    if cfg.get("server") is not None:
        OmegaConf.to_object(cfg.server)  # ServerConfig's own checks (port range, limits)
    for kind in PLUGIN_BASES:
        node = cfg.get(kind)
        if node is not None:
            OmegaConf.to_object(node)  # the plugin config's own __post_init__ checks


TAKES_ALL_PROMPTS = ("inline", "jsonl")  # workload kinds that take every prompt they hold: no num_prompts


def num_prompts_unused(num_prompts: int, applies_to: str) -> ConfigError:
    """The error for a workload.num_prompts that would do nothing for ``applies_to``."""
    return ConfigError(f"workload.num_prompts={num_prompts} does not apply to {applies_to}; "
                       f"use workload.max_prompts={num_prompts}")


def _check_relations(cfg: DictConfig) -> None:
    given = [k for k in ("prompt", "prompt_ids", "prompt_file") if cfg.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"give one of prompt, prompt_ids and prompt_file, not {' and '.join(given)}")
    if cfg.workload.kind == "jsonl" and cfg.workload.path is None:
        raise ConfigError("workload.kind=jsonl needs workload.path=FILE")
    # a num_prompts given for a workload that takes every prompt it holds would do nothing (only a value
    # other than the default can be told apart from no value at all; a bench's list: specfit.commands.bench)
    if (cfg.workload.kind in TAKES_ALL_PROMPTS and not cfg.workloads
            and cfg.workload.num_prompts != WorkloadConfig.num_prompts):
        raise num_prompts_unused(cfg.workload.num_prompts, f"workload.kind={cfg.workload.kind} (it takes all its prompts)")
    for key, names in (("methods", list(cfg.methods)), ("baseline", [cfg.baseline])):
        for method in names:
            if method not in cfg.method_presets:
                raise ConfigError(f"{key}: {method!r} has no entry in method_presets "
                                  f"(known: {', '.join(cfg.method_presets)})")


# the workload keys only some kinds read (specfit.workloads); prompts, prompt_ids and max_prompts apply to all
WORKLOAD_KEY_KINDS = {
    "path": ("jsonl",),
    "dataset": ("hf",),
    "split": ("hf",),
    "data_dir": ("prose", "summary", "gsm"),
    "prompt_chars": ("prose", "summary"),
    "seed": ("prose", "summary", "gsm", "hf"),
}


def _check_workload(workload: DictConfig) -> None:
    from specfit.validation import choice, integer, optional_integer
    from specfit.workloads import KINDS

    choice("workload.kind", workload.kind, KINDS)
    integer("workload.num_prompts", workload.num_prompts, minimum=1)
    integer("workload.prompt_chars", workload.prompt_chars, minimum=1)
    optional_integer("workload.max_prompts", workload.max_prompts, minimum=1)
    if workload.path is not None and Path(workload.path).expanduser().is_dir():
        raise ConfigError(f"workload.path={workload.path}: is a directory, not a JSON-lines file")
    if workload.path is not None and not Path(workload.path).expanduser().is_file():
        raise ConfigError(f"workload.path={workload.path}: no such file")  # its contents: when it is read


def _check_replay(replay: DictConfig) -> None:
    from specfit.validation import choice, integer

    choice("replay.draft_time", replay.draft_time, ("measured", "modelled", "recorded"))  # recorded: measured
    integer("replay.warmup", replay.warmup, minimum=0)
    if replay.cost_profile is not None:
        from specfit.types.cost_profiles import cost_profile

        cost_profile(replay.cost_profile)


def unused_setting_notes(cfg: DictConfig) -> list[str]:
    """Settings this config gives that change nothing in its run, each as one sentence.

    Not errors: a sweep or a bench's methods may set them for the runs where they apply. But a
    user who sets them for this run should hear that they do nothing here."""
    notes = []
    cache, drafter = cfg.get("cache"), cfg.get("drafter")
    drafting = drafter is not None and drafter.name != "none"
    if cache is not None and cache.get("copy") != "emulated" and dict(cache.link) != dict(LinkConfig().__dict__):
        notes.append(f"cache.link sets the emulated link, which only cache.copy=emulated charges; "
                     f"cache.copy={cache.get('copy')} copies over the real link, so cache.link is unused")
    if cache is not None and cache.name == "full" and (cache.capacity is not None or cache.capacity_bytes is not None):
        key = "cache.capacity" if cache.capacity is not None else "cache.capacity_bytes"
        notes.append(f"cache=full gives every expert a slot, so {key} is unused")
    prefetch = cfg.get("prefetch")
    if prefetch is not None and prefetch.name != "none" and cache is not None and cache.name == "full":
        notes.append(f"cache=full holds every expert, so prefetch={prefetch.name} has nothing to copy")
    if prefetch is not None and prefetch.name == "draft" and not drafting:
        notes.append("prefetch=draft prefetches while drafting, and this run drafts nothing (drafter=none): "
                     "no prefetches; prefetch=lookahead or auto prefetch in plain decoding")
    if prefetch is not None and prefetch.name in ("draft", "auto") and drafting and cfg.get("predictor") is None:
        part = ("it prefetches nothing" if prefetch.name == "draft"
                else "its draft half prefetches nothing (the look-ahead still does)")
        notes.append(f"prefetch={prefetch.name} copies the experts a predictor expects for the drafted nodes, and no "
                     f"predictor is set: {part}; set predictor=history")
    selector = cfg.get("selector")
    if drafting and selector is not None and selector.name == "none":
        notes.append(f"selector=none never drafts, so drafter={drafter.name} is unused (plain decoding)")
    sampling = cfg.sampling
    if sampling.temperature == 0 and (sampling.top_k != 0 or sampling.top_p != 1.0):
        keys = [k for k, unset in (("sampling.top_k", sampling.top_k == 0), ("sampling.top_p", sampling.top_p == 1.0))
                if not unset]
        notes.append(f"{' and '.join(keys)} {'shape' if len(keys) > 1 else 'shapes'} sampling, and "
                     "sampling.temperature=0 decodes greedily, so it is unused")
    return notes
