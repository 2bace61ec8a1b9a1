"""Structured configuration: the schema every Hydra config is checked against.

Each pluggable part is a config group (``drafter``, ``selector``, ``cost_model``, ``cache``,
``predictor``) whose options are the registered plugins' ``Config`` dataclasses, so a misspelled key
or a wrong type fails at composition. ``model`` and ``workload`` are plain groups with presets in
``conf/``. :func:`compose` is the programmatic entry point (Hydra's compose API).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from omegaconf import MISSING, DictConfig

from specfit.core.link_profiles import DEFAULT_PROFILE
from specfit.errors import ConfigError
from specfit.validation import optional_integer

CONFIG_MODULE = "specfit.conf"
COPY_KINDS = ("triton", "torch", "emulated")  # cache.copy (specfit.core.copy_engines builds them)


# --------------------------------------------------------------------------- plugin group bases


@dataclass
class PluginConfig:
    """Every plugin config names its plugin; the registry, not ``_target_``, resolves it."""

    name: str = MISSING


@dataclass
class DrafterConfig(PluginConfig):
    pass


@dataclass
class SelectorConfig(PluginConfig):
    pass


@dataclass
class CostModelConfig(PluginConfig):
    pass


@dataclass
class PredictorConfig(PluginConfig):
    pass


@dataclass
class LinkConfig:
    """Emulated host-to-device link (``cache.copy=emulated``): explicit values override the profile."""

    profile: str | None = DEFAULT_PROFILE
    bandwidth_gbps: float | None = None
    latency_us: float | None = None
    ref_expert_bytes: int | None = None


@dataclass
class CacheConfig(PluginConfig):
    """Expert cache: a residency policy plus the slots and copy engine it runs on."""

    # device slots per MoE layer (experts); more than the layer has is clamped to all of them (a full
    # cache), as one capacity can then be swept over models with different expert counts
    capacity: int | None = None
    capacity_bytes: int | None = None  # alternative: device bytes for all layers' slots
    copy: str = "torch"  # triton | torch | emulated
    link: LinkConfig = field(default_factory=LinkConfig)

    def __post_init__(self) -> None:
        """Runs when the registry builds the cache (OmegaConf.to_object): values the schema cannot check."""
        optional_integer("cache.capacity", self.capacity, minimum=1)
        optional_integer("cache.capacity_bytes", self.capacity_bytes, minimum=1)
        if self.copy not in COPY_KINDS:
            raise ConfigError(f"unknown copy engine cache.copy={self.copy!r}; valid values: {', '.join(COPY_KINDS)}")
        if self.capacity is not None and self.capacity_bytes is not None:
            raise ConfigError("set cache.capacity or cache.capacity_bytes, not both")
        if self.copy == "emulated":  # the link's settings only matter to the emulated engine
            from dataclasses import asdict

            from specfit.core.copy_engines import LinkSettings

            link = self.link if isinstance(self.link, LinkConfig) else LinkConfig(**dict(self.link))
            try:
                LinkSettings(**asdict(link)).resolve()
            except (KeyError, ValueError) as exc:  # an unknown profile, a bandwidth <= 0
                raise ConfigError(" ".join(str(exc).strip("'\"").split())) from None


PLUGIN_BASES: dict[str, type[PluginConfig]] = {
    "drafter": DrafterConfig,
    "selector": SelectorConfig,
    "cost_model": CostModelConfig,
    "cache": CacheConfig,
    "predictor": PredictorConfig,
}


# --------------------------------------------------------------------------- plain groups


@dataclass
class ModelConfig:
    """The target MoE model: a local Hugging Face checkpoint or a model built in code."""

    path: str | None = None  # checkpoint directory (or hub id where a hub is reachable)
    builtin: str | None = None  # tiny-qwen3-moe | tiny-olmoe | tiny-mixtral (random weights, seeded)
    tokenizer: str | None = None  # defaults to ``path``
    dtype: str = "auto"  # auto (the checkpoint's own) | float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"  # sdpa | eager
    seed: int = 0  # weights of built-in models
    draft_head: str | None = None  # an EAGLE-3 head trained for this target: drafter=eagle3 uses it by default
    max_model_len: int | None = None  # context limit (prompt + output); null: the model's max_position_embeddings


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
    # D, the drafting time charged per cycle: recorded (the trace's time up to the level the selector
    # stopped at, plus predictor and selector time measured in the replay) | modelled (c_draft0 +
    # c_level * levels from the calibration: the replay then depends on no clock)
    draft_time: str = "recorded"
    warmup: int = 8  # recorded time only: cycles first replayed with throwaway plugins (one-time costs)
    oracle: bool = True  # also replay selector=oracle per cache and cost model, the reference of every method


@dataclass
class SpecfitConfig:
    model: ModelConfig = MISSING
    drafter: DrafterConfig = MISSING
    selector: SelectorConfig = MISSING
    cost_model: CostModelConfig | None = None
    cache: CacheConfig = MISSING
    predictor: PredictorConfig | None = None
    workload: WorkloadConfig = MISSING
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    prompt_file: str | None = None  # the prompt as UTF-8 text from a file ("-": standard input); no quoting needed
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    results_file: str = "results.jsonl"
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
    baseline: str = "ar"  # speedups are relative to this method (and to eagle3_nocache when present)
    trace: TraceConfig = field(default_factory=TraceConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
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


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose a config from the packaged conf/ tree and ``overrides`` (Hydra syntax).

    Loads plugins first so third-party config groups are known. Works inside a running Hydra app
    too (``specfit bench`` composes one config per method).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from specfit.registry import get_plugins

    get_plugins()
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"compose(overrides=...) takes a list of 'key=value' strings, got {overrides!r:.60}")
    try:
        if GlobalHydra.instance().is_initialized():
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
        else:
            with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
                cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    except Exception as exc:  # hydra/omegaconf raise many types; all are config mistakes here
        raise ConfigError(one_line_config_error(exc)) from exc
    check_config(cfg, relations=False)  # bench composes single overrides to see which methods they fit
    return cfg


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

    from specfit.core.sampling import SamplingParams
    from specfit.validation import integer, token_ids

    integer("max_new_tokens", cfg.max_new_tokens, minimum=1)
    integer("repeats", cfg.repeats, minimum=1)
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
    _check_workload(cfg.workload)
    _check_replay(cfg.replay)
    for kind in PLUGIN_BASES:
        node = cfg.get(kind)
        if node is not None:
            OmegaConf.to_object(node)  # the plugin config's own __post_init__ checks


def _check_relations(cfg: DictConfig) -> None:
    given = [k for k in ("prompt", "prompt_ids", "prompt_file") if cfg.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"give one of prompt, prompt_ids and prompt_file, not {' and '.join(given)}")
    if cfg.workload.kind == "jsonl" and cfg.workload.path is None:
        raise ConfigError("workload.kind=jsonl needs workload.path=FILE")
    for key, names in (("methods", list(cfg.methods)), ("baseline", [cfg.baseline])):
        for method in names:
            if method not in cfg.method_presets:
                raise ConfigError(f"{key}: {method!r} has no entry in method_presets "
                                  f"(known: {', '.join(cfg.method_presets)})")


def _check_workload(workload: DictConfig) -> None:
    from pathlib import Path

    from specfit.validation import choice, integer, optional_integer
    from specfit.workloads import KINDS

    choice("workload.kind", workload.kind, KINDS)
    integer("workload.num_prompts", workload.num_prompts, minimum=1)
    integer("workload.prompt_chars", workload.prompt_chars, minimum=1)
    optional_integer("workload.max_prompts", workload.max_prompts, minimum=1)
    if workload.path is not None and not Path(workload.path).expanduser().is_file():
        raise ConfigError(f"workload.path={workload.path}: no such file")  # its contents: when it is read


def _check_replay(replay: DictConfig) -> None:
    from specfit.validation import choice, integer

    choice("replay.draft_time", replay.draft_time, ("recorded", "modelled"))
    integer("replay.warmup", replay.warmup, minimum=0)


def one_line_config_error(exc: BaseException) -> str:
    """Hydra's messages span lines and end in hints about HYDRA_FULL_ERROR; keep what names the problem."""
    seen = []
    err: BaseException | None = exc
    while err is not None:
        for line in str(err).splitlines():
            line = line.strip()
            if not line or line.startswith(_NOISE):
                continue
            line = _APPEND_HINT.sub("", line).strip()  # `+key=value` would now be refused too
            if line and line not in seen:
                seen.append(line)
        err = err.__cause__
    message = (" ".join(seen) or type(exc).__name__) + _did_you_mean(exc)
    if _is_parse_error(exc) and "LexerNoViableAltException" in message:  # characters Hydra's grammar refuses
        message = message.replace("LexerNoViableAltException: ", "cannot parse ").split(" See https://")[0]
        message = message.removesuffix(" ^") + _QUOTING_HINT
    return message


def _did_you_mean(exc: BaseException | None) -> str:
    """For a misspelt key of a typed node (OmegaConf names the node's dataclass): the nearest field."""
    import dataclasses
    import difflib

    while exc is not None:
        schema, key = getattr(exc, "object_type", None), getattr(exc, "key", None)
        if dataclasses.is_dataclass(schema) and isinstance(key, str):
            near = difflib.get_close_matches(key, [f.name for f in dataclasses.fields(schema)], n=1)
            if near:
                full = str(getattr(exc, "full_key", None) or key)
                return f"; did you mean {full[: len(full) - len(key)]}{near[0]}?"
        exc = exc.__cause__
    return ""


def _is_parse_error(exc: BaseException | None) -> bool:
    while exc is not None:
        if type(exc).__name__ == "OverrideParseException":
            return True
        exc = exc.__cause__
    return False


# lines of Hydra/OmegaConf messages that name no problem (the search path lists every provider)
_NOISE = ("full_key:", "object_type=", "reference_type=", "Set the environment", "Config search path",
          "provider=")
_QUOTING_HINT = (" (quote a value that has spaces, non-ASCII or special characters inside the shell's quotes:"
                 " 'prompt=\"...\"'; a prompt can also come from prompt_file=PATH)")
_APPEND_HINT = re.compile(r"\s*To append to your config use \+\S+")
