"""Programmatic entry points: compose a config, build an engine from it."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from specfit.core.copy_engines import LinkSettings
from specfit.core.engine import Engine
from specfit.core.loading import load_target
from specfit.core.sampling import SamplingParams
from specfit.registry import get_plugins


def build(cfg: DictConfig) -> Engine:
    """An :class:`Engine` for a composed config: loads the model, builds every plugin by name."""
    plugins = get_plugins()
    loaded = load_target(OmegaConf.to_object(cfg.model))
    parts: dict[str, Any] = {}
    for kind in ("drafter", "selector", "cost_model", "predictor", "cache"):
        node = cfg.get(kind)
        parts[kind] = plugins[kind].create(node) if node is not None else None
    cache_cfg = cfg.cache
    sampling = SamplingParams(**OmegaConf.to_container(cfg.sampling))
    return Engine(
        loaded.model,
        tokenizer=loaded.tokenizer,
        copy=cache_cfg["copy"],
        link=LinkSettings(**OmegaConf.to_container(cache_cfg.link)),
        device=None if cfg.model.device == "auto" else cfg.model.device,
        sampling=sampling,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=list(cfg.stop_token_ids),
        ignore_eos=cfg.ignore_eos,
        info={"model": loaded.source},
        **parts,
    )
