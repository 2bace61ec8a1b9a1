"""``specfit demo``: decode the same prompts with several methods and print the comparison.

Each method is a list of overrides (``method_presets``) composed on top of the job's config; the
model is rebuilt per method because building an engine installs its cache into the model.
Methods run prompt by prompt in turn (interleaved), so drift of a shared machine spreads evenly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from specfit.api import build
from specfit.commands.generate import prompts_of
from specfit.config import compose
from specfit.errors import ConfigError
from specfit.results import append_jsonl, comparison_table, mean_stats


def method_configs(cfg: DictConfig, overrides: list[str]) -> dict[str, DictConfig]:
    configs = {}
    for method in cfg.methods:
        if method not in cfg.method_presets:
            raise ConfigError(f"methods: {method!r} has no entry in method_presets (known: {', '.join(cfg.method_presets)})")
        configs[method] = compose(overrides + list(cfg.method_presets[method]), config_name=_config_name())
    return configs


def _config_name() -> str:
    return HydraConfig.get().job.config_name if HydraConfig.initialized() else "demo"


def run(cfg: DictConfig, output_dir: Path, overrides: list[str]) -> list[dict[str, Any]]:
    if not cfg.methods:
        raise ConfigError("methods is empty: name the methods to compare, e.g. methods=[ar_lru,ar_nocache]")
    configs = method_configs(cfg, overrides)
    prompts = prompts_of(cfg)
    engines = {m: build(c) for m, c in configs.items()}
    per_method: dict[str, list[dict[str, Any]]] = {m: [] for m in engines}
    rows = []
    outputs: dict[int, dict[str, list[int]]] = {}
    for repeat in range(cfg.repeats):
        for i, prompt in enumerate(prompts):
            for method, engine in engines.items():
                out = engine.generate(prompt)
                per_method[method].append(out.stats)
                outputs.setdefault(i, {})[method] = out.token_ids
                rows.append({"command": "compare", "method": method, "prompt_index": i, "repeat": repeat,
                             **out.stats, "config": OmegaConf.to_container(configs[method], resolve=True)})
    summary = [{"method": m, **mean_stats(s)} for m, s in per_method.items()]
    path = append_jsonl(output_dir / cfg.results_file, rows)
    print(comparison_table(summary))
    identical = all(len({tuple(v) for v in o.values()}) == 1 for o in outputs.values())
    sampling = "greedy" if cfg.sampling.temperature == 0 else f"sampling T={cfg.sampling.temperature}"
    print(f"\n{len(prompts)} prompts x {cfg.repeats} repeats, {cfg.max_new_tokens} new tokens, {sampling}; "
          f"output tokens identical across methods: {'yes' if identical else 'NO'}")
    if any(r.get("h2d_emulated") for r in summary):
        print("H2D times are EMULATED (cache.copy=emulated): each copy is charged the reference link's time.")
    print(f"results: {path}")
    return rows
