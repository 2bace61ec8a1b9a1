"""Programmatic entry points: compose a config, build an engine from it, calibrate its cost model."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from omegaconf import DictConfig, OmegaConf

from specfit.types.costs import FIT_VERSION, POOR_FIT, load_constants
from specfit.calibrate.fingerprint import acceptance_setup
from specfit.calibrate.store import (
    calibration_path,
    check_calibration_destination,
    save_constants,
    setup_differences,
    stored_fit_version,
    stored_poor_fit,
)
from specfit.calibrate.refine import ProvisionalRefiner
from specfit.calibrate.run import run_calibration
from specfit.calibrate.setup_state import note_state_file_setup
from specfit.types.link_profiles import LinkSettings
from specfit.decode.engine import EngineCore, default_device
from specfit.model.loading import LoadedModel, engine_copy, load_target, share_experts
from specfit.decode.sampling import SamplingParams
from specfit.calibrate.setup_state import attach_setup_state
from specfit.config import check_config, unused_setting_notes
from specfit.messages import note_once
from specfit.errors import ConfigError, ModelError, PluginError
from specfit.files import missing_directory
from specfit.registry import get_plugins
from specfit.validation import device_arg


class Engine(EngineCore):
    """An offloaded MoE target and its parts (:class:`~specfit.decode.engine.EngineCore`), with the
    registered defaults (:data:`DEFAULT_PARTS`: drafter ``none``, selector ``eagle3``, cache ``lru``)
    built for a drafter, selector or cache left out, as :func:`build` does for a config."""

    def __init__(self, model: Any, **parts: Any) -> None:
        defaults = default_parts(**{kind: parts.get(kind) for kind in DEFAULT_PARTS})
        super().__init__(model, **{**parts, **defaults})


def build(cfg: DictConfig, calibration_prompts: Sequence[Any] | None = None, calibrate_now: bool = True,
          check_prompts: Sequence[Any] = (), shared_target: LoadedModel | None = None) -> Engine:
    """An :class:`Engine` for a composed config: loads the model, builds every plugin by name.

    ``shared_target``: the config's model, loaded once with its experts in a shared store
    (:func:`load_shared_target`); the engine gets its own copy of the dense weights and reads the
    experts from that store instead of loading the model again.

    A cost model with ``calibration=auto`` gets this setup's stored constants, measured now (and
    stored) the first time (unless ``calibrate_now`` is false: `specfit calibrate` measures itself).
    ``check_prompts`` are the prompts a command will decode: each is checked (token ids, context
    limit) before any calibration, so a bad one fails in seconds, not after the other prompts ran.
    """
    _check_composed(cfg, "build()")
    for note in unused_setting_notes(cfg):
        note_once(note)
    parts = build_parts(cfg)  # before the model: fail fast
    if shared_target is not None:
        _check_shared_target(cfg, shared_target)
        loaded = engine_copy(shared_target)
    else:
        loaded = load_target(OmegaConf.to_object(cfg.model))
    if loaded.tokenizer is None:
        _check_prompts_are_ids(cfg)
    with _named_as_model_head(_drafter_head_from_model(cfg)):  # the head's fit to the target is checked at bind
        engine = _engine(cfg, loaded, parts)
    for i, prompt in enumerate(check_prompts):
        try:
            engine.check_prompt(prompt)
        except ConfigError as exc:  # which of the workload's prompts (a file's line, a dataset's row)
            if len(check_prompts) < 2:
                raise
            raise ConfigError(f"{_workload_name(cfg)}, prompt {i + 1} of {len(check_prompts)}: {exc}") from exc
    if calibrate_now:
        _attach_calibration(engine, calibration_prompts, cfg.get("calibration", "auto"))
    attach_setup_state(engine)  # the selector starts from what earlier engines of this setup learned
    note_state_file_setup(engine.selector, acceptance_setup(engine))
    return engine


def build_parts(cfg: DictConfig) -> dict[str, Any]:
    """Every plug-in a config names, each made with what it needs (a drafter the model's own head,
    a cost-aware selector its acceptance estimator), the registered defaults for a drafter,
    selector or cache left out; ``prefetcher`` None for ``prefetch=none``."""
    plugins = get_plugins()
    parts: dict[str, Any] = {}
    for kind in ("drafter", "selector", "cost_model", "predictor", "cache"):
        node = cfg.get(kind)
        if node is None:
            parts[kind] = None
        elif kind == "drafter":
            parts[kind] = _drafter_with_model_head(plugins[kind], node, cfg.model.get("draft_head"))
        elif kind == "selector":  # with the estimator the acceptance group names, for cost-aware selectors
            parts[kind] = build_selector(node, cfg.get("acceptance"))
        else:
            parts[kind] = plugins[kind].create(node)
    parts.update(default_parts(**{k: parts[k] for k in DEFAULT_PARTS}))
    prefetch_cfg = cfg.get("prefetch")  # none (the default) builds no prefetcher: runs stay as they were
    prefetcher = plugins["prefetch"].create(prefetch_cfg) if prefetch_cfg is not None else None
    parts["prefetcher"] = None if prefetcher is not None and prefetcher.name == "none" else prefetcher
    return parts


def _engine(cfg: DictConfig, loaded: LoadedModel, parts: dict[str, Any]) -> Engine:
    """The engine of a composed config over its loaded model, with its plug-ins."""
    cache_cfg = cfg.cache
    return Engine(
        loaded.model,
        tokenizer=loaded.tokenizer,
        copy=cache_cfg["copy"],
        link=LinkSettings(**OmegaConf.to_container(cache_cfg.link)) if cache_cfg["copy"] == "emulated" else None,
        device=None if cfg.model.device == "auto" else cfg.model.device,
        sampling=SamplingParams(**OmegaConf.to_container(cfg.sampling)),
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=list(cfg.stop_token_ids),
        ignore_eos=cfg.ignore_eos,
        max_model_len=cfg.model.get("max_model_len"),
        expert_compute=cfg.model.get("expert_compute", "auto"),
        info={"model": loaded.source, "draft_head": cfg.model.get("draft_head")},
        expert_store=loaded.expert_store,  # a streamed checkpoint's experts: their only host copy
        numerics=cfg.model.numerics,
        **parts,
    )


def load_shared_target(cfg: DictConfig) -> LoadedModel:
    """The model of a composed config, loaded once for several engines (``build(...,
    shared_target=)``): its experts in one host store, pinned when the engines run on a GPU."""
    _check_composed(cfg, "load_shared_target()")
    model_cfg = OmegaConf.to_object(cfg.model)
    device = default_device() if model_cfg.device == "auto" else device_arg(model_cfg.device, "model.device")
    return share_experts(load_target(model_cfg), pin=device.type == "cuda", settings=model_settings(cfg))


def model_settings(cfg: DictConfig) -> dict[str, Any]:
    """A config's `model` settings, plain (what a shared target is loaded for)."""
    return OmegaConf.to_container(cfg.model, resolve=True)  # type: ignore[return-value]


def _check_composed(cfg: Any, caller: str) -> None:
    """``cfg`` is what specfit.compose() returns, and still passes its checks."""
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{caller} takes the config specfit.compose() returns, got {type(cfg).__name__}")
    missing = [key for key in ("model", "sampling", "cache", "max_new_tokens") if key not in cfg]
    if missing:
        raise ConfigError(f"{caller} takes the config specfit.compose() returns; this one lacks {', '.join(missing)}")
    check_config(cfg)  # a config changed after compose() gets the same checks


def _check_shared_target(cfg: DictConfig, shared: LoadedModel) -> None:
    """A shared target serves configs with the `model` settings it was loaded with, and no other;
    its model is a template that no Engine has taken (a copy of a taken one would copy its runtime,
    the whole expert store with it)."""
    from specfit.offload.layer import OffloadedExperts

    if not isinstance(shared, LoadedModel) or shared.settings is None:
        raise ConfigError(f"shared_target={shared!r:.60} must come from specfit.api.load_shared_target")
    if any(isinstance(m, OffloadedExperts) for m in shared.model.modules()):
        raise ModelError("shared_target's model was given to an Engine directly; leave the shared target's model "
                         "alone and build each engine with build(cfg, shared_target=...)")
    settings = model_settings(cfg)
    differ = sorted(k for k in set(settings) | set(shared.settings) if settings.get(k) != shared.settings.get(k))
    if differ:
        key = differ[0]
        raise ConfigError(f"shared_target was loaded with model.{key}={shared.settings.get(key)!r}, this config has "
                          f"model.{key}={settings.get(key)!r}: load one for these settings")


# The plug-ins an engine gets when neither the config nor the caller names one: no drafting (plain
# autoregressive decoding), EAGLE's selector, an LRU expert cache of the default capacity.
DEFAULT_PARTS = {"drafter": "none", "selector": "eagle3", "cache": "lru"}


def default_parts(**given: Any) -> dict[str, Any]:
    """``given`` (drafter, selector, cache instances), each None replaced by the registered default
    of :data:`DEFAULT_PARTS`, built with its default settings. ``Engine`` calls it for the parts a
    caller leaves out, ``build`` for those a config leaves out."""
    plugins = get_plugins()
    return {kind: given.get(kind) if given.get(kind) is not None else plugins[kind].get(name).cls()
            for kind, name in DEFAULT_PARTS.items()}


def _drafter_with_model_head(plugin: Any, node: DictConfig, head: str | None) -> Any:
    """The drafter, given the model's own head where its ``path`` is left null; an error about that
    head's contents names ``model.draft_head``, the key the user set, not the ``drafter.path`` it became."""
    with_head = _with_model_head(node, head)
    if with_head is node:
        return plugin.create(node)
    with _named_as_model_head(head):
        return plugin.create(with_head)


def _drafter_head_from_model(cfg: DictConfig) -> str | None:
    """``model.draft_head`` where it became the drafter's ``path`` (see :func:`_with_model_head`), else None."""
    node, head = cfg.get("drafter"), cfg.model.get("draft_head")
    return head if node is not None and _with_model_head(node, head) is not node else None


@contextmanager
def _named_as_model_head(head: str | None) -> Iterator[None]:
    """A ModelError about the drafter's ``path`` that is the model's own head (``head``; None: it is
    not) names ``model.draft_head``, the key the user set; the head's errors name the path as
    ``load_head`` resolved it (~ expanded), when the drafter is made or when it binds to the target."""
    try:
        yield
    except ModelError as exc:
        if head is None:
            raise
        message = str(exc)
        for spelled in dict.fromkeys((str(head), str(Path(head).expanduser()))):
            message = message.replace(f"drafter.path={spelled}", f"model.draft_head={head}")
        if message == str(exc):
            raise
        raise ModelError(message) from None


def _with_model_head(node: DictConfig, head: str | None) -> DictConfig:
    """The drafter's config, its ``path`` set to the model's own EAGLE-3 head (``model.draft_head``)
    when it has a ``path`` key left null: the head reaches the drafter as its own setting."""
    if not head or "path" not in node or node.path is not None:
        return node
    if OmegaConf.to_object(node).path is not None:  # set by an alias (speculative_config.model)
        return node
    if not Path(head).expanduser().is_dir():  # named by its own key, not as the drafter.path it becomes
        raise ConfigError(f"model.draft_head={head}: {missing_directory(head)} (an EAGLE-3 head is a directory: "
                          "config.json and weights)")
    node = node.copy()
    node.path = head
    return node


def _workload_name(cfg: DictConfig) -> str:
    """The workload as the user named it: its file where it has one."""
    workload = cfg.get("workload")
    if not workload:
        return "prompts"
    path = workload.get("path")
    return f"workload.path={path}" if path else f"workload={workload.get('name', 'inline')}"


def _check_prompts_are_ids(cfg: DictConfig) -> None:
    """Text prompts need a tokenizer: say so now, not after minutes of calibration and engine builds."""
    if cfg.prompt_ids is not None:
        return
    key = "prompt" if cfg.prompt is not None else "prompt_file" if cfg.get("prompt_file") is not None else None
    if key is None and (cfg.workload.kind != "inline" or cfg.workload.prompts):
        from specfit.workloads import load_workload

        if any(isinstance(p, str) for p in load_workload(cfg.workload)):
            key = f"workload={cfg.workload.name}"
    if key is not None:
        raise ConfigError(f"{key}: text prompts need a tokenizer and this model has none; give token ids "
                          f"(prompt_ids=[...]) or a model with a tokenizer (model.tokenizer=DIR for a checkpoint)")


def _attach_calibration(engine: Engine, prompts: Sequence[Any] | None, mode: str = "auto") -> None:
    """The cost model's constants for ``engine``'s setup: a file the config names, else the setup's
    stored calibration, else (``mode`` auto) one measured now, once, and stored, whatever its error:
    a fit judged poor (a busy host) is marked provisional and refined by the runs that use it
    (:mod:`specfit.calibrate.refine`). ``force`` measures again in full; ``off`` never measures. A
    setup whose drafter never drafts needs no constants (nothing is selected) and is not measured."""
    model = engine.cost_model
    if model is None:
        return
    # the constants reach the cost model through its set_constants, the one hook that changes a part
    # after it is built (CostModel's contract)
    if _named_calibration(engine, model) or (model.calibrated and mode != "force"):
        return
    path = calibration_path(engine)
    if mode != "force" and path.is_file() and _load_stored(engine, model, path, older_too=mode == "off"):
        return
    if engine.drafter.depth == 0 and mode != "force":
        return  # no draft tree is ever selected from: the constants would go unused
    if mode == "off":
        raise ConfigError(f"calibration=off, and this setup has no stored calibration ({path}): run `specfit "
                          "calibrate` (or calibration=auto measures it once), or give cost_model.c0/c_tok/c_miss/c_hit")
    print(f"specfit: calibrating the cost model for this setup, once (stored in {path}; `specfit calibrate` or "
          "calibration=force measures it again)", file=sys.stderr)
    constants, _ = calibrate(engine, prompts, path=path)
    model.set_constants(constants)
    if constants.provisional:
        engine.add_listener(ProvisionalRefiner(engine, path))


def _named_calibration(engine: Engine, model: Any) -> bool:
    """A calibration file the config names (``cost_model.calibration=FILE``): loaded, and said so
    when it was measured on another setup. False when it names none."""
    source = model.calibration
    if source in ("auto", None):
        return False
    if not model.calibrated:
        model.set_constants(load_constants(source))  # a cost model that does not load its file when bound
    if model.constants.source != str(Path(source).expanduser()):
        return model.calibrated
    differs = setup_differences(source, engine)
    if differs:  # allowed (planning with another machine's constants), but never silently
        note_once(f"cost_model.calibration={source} was measured on another setup (its {', '.join(differs)} "
                  f"differ from this run's); its constants are used as given")
    return True


def _load_stored(engine: Engine, model: Any, path: Path, older_too: bool = False) -> bool:
    """This setup's stored calibration into ``model``; False when it is of an older fit (measured
    again; ``older_too``: used all the same, as ``calibration=off`` asks). A provisional one is
    used, said once, and refined from this run's cycles."""
    version = stored_fit_version(path)
    if version is not None and version < FIT_VERSION and not older_too:
        print(f"specfit: the stored calibration {path} was fitted by an older specfit (fit version {version} < "
              f"{FIT_VERSION}); measuring it again", file=sys.stderr)
        return False
    try:
        constants = load_constants(path)
    except ConfigError as exc:  # damaged: named as this setup's stored file, not a key the user set
        why = str(exc).removeprefix(f"cost_model.calibration={path}: ")
        raise ConfigError(f"the stored calibration of this setup, {path} (cost_model.calibration=auto, under "
                          f"$SPECFIT_HOME), is damaged: {why}; delete it to measure again, or run "
                          "`specfit calibrate`") from None
    poor = stored_poor_fit(path)
    if poor is not None and not constants.provisional:  # stored before provisional fits were kept: one of them
        constants.provisional = True
    model.set_constants(constants)
    if constants.provisional:
        note_once(f"the stored calibration {path} is provisional (measured on a busy host"
                  f"{f', held-out error {poor:.0%}' if poor is not None else ''}): used, and refined from this "
                  "run's cycles; `specfit calibrate` on a quiet host measures it again")
        engine.add_listener(ProvisionalRefiner(engine, path))
    return True


def calibrate(engine: Engine, prompts: Sequence[Any] | None = None, max_new_tokens: int = 48,
              path: Path | None = None, seed: int = 0, trust_poor: bool = False) -> tuple[Any, dict[str, Any]]:
    """Measure the cost constants of ``engine``'s setup on ``prompts`` and store them.

    Without prompts, a few seeded random token sequences are used: the constants are about time
    per token, per expert hit and per miss, not about the text. Constants that predict the held-out
    cycles poorly (a busy host) are stored as provisional, with a note (``trust_poor``: as
    trusted, what `specfit calibrate` asks for)."""
    path = check_calibration_destination(path or calibration_path(engine))  # before measuring
    if not prompts:
        rng = np.random.default_rng(seed)
        vocab = engine.model.config.vocab_size
        prompts = [rng.integers(0, vocab, size=24).tolist() for _ in range(4)]
    constants, report = run_calibration(engine, prompts, max_new_tokens, seed)
    constants.source = str(path)
    poor = report["cycle_time_ape_median"] > POOR_FIT
    if poor and not trust_poor:
        constants.provisional = report["provisional"] = True
        note_once(f"this calibration predicts its held-out cycle times poorly (median error "
                  f"{report['cycle_time_ape_median']:.0%}): the host was probably busy. It is stored as provisional: "
                  f"runs use it and refine it from their own cycles; `specfit calibrate` on a quiet host measures again")
    elif poor:
        report["kept_despite_error"] = True  # asked for (specfit calibrate): trusted as measured
    report["path"] = str(save_constants(path, constants, engine, report))
    return constants, report


def build_selector(node: Any, acceptance: Any = None, note: bool = True) -> Any:
    """The selector a config's ``selector`` group names (``node``), given at construction the
    acceptance estimator its ``acceptance`` group names (``acceptance``: that group's config, or
    None: the selector's own ``selector.acceptance``, default ``path_prob``). A selector that takes
    no estimator (eagle3, chain, none, oracle) ignores the group, and says so on stderr unless
    ``note`` is False (a second build of the same config, e.g. a replay's warmup).

    ``selector.acceptance=NAME`` is the earlier spelling of ``acceptance=NAME`` and still works;
    given both, they must agree."""
    plugins = get_plugins()
    cls = plugins["selector"].get(node.name).cls
    if not cls.takes_estimator:
        if acceptance is not None and note:  # say so: a state_file given there is not read either
            note_once(f"acceptance={acceptance.get('name')} is not used by selector={node.name} "
                      "(only the cost-aware selectors, such as specfit, use acceptance estimates)")
        return plugins["selector"].create(node)
    own = node.get("acceptance", "path_prob")
    if acceptance is None:
        try:
            estimator = plugins["acceptance"].get(own).cls()
        except PluginError as exc:
            raise ConfigError(f"selector.acceptance={own!r}: {exc}") from None
    else:
        estimator = plugins["acceptance"].create(acceptance)
        if own not in ("path_prob", estimator.name):
            raise ConfigError(f"selector.acceptance={own} and acceptance={estimator.name} disagree "
                              f"(selector.acceptance is the earlier name of acceptance=...; give one)")
    return plugins["selector"].create(node, estimator=estimator)
