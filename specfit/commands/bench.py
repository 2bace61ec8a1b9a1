"""``specfit bench`` (and ``specfit demo``): methods side by side on the same prompts.

Each method is a list of overrides (``method_presets``) composed on top of the job's config, per
workload. Engines are built once per (method, workload); prompts then run interleaved across
methods, ``repeats`` times, so drift of a shared machine spreads evenly over the methods. One JSON
line per run goes to the results file; the table reports means, with speedups against the
baseline (autoregressive decoding) and against vanilla EAGLE-3 without a cache.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from specfit.api import build
from specfit.commands.generate import prompts_of
from specfit.config import compose
from specfit.errors import ConfigError
from specfit.results import append_jsonl, comparison_table, mean_stats
from specfit.workloads import describe


def _config_name() -> str:
    return HydraConfig.get().job.config_name if HydraConfig.initialized() else "bench"


def method_config(cfg: DictConfig, method: str, workload: str | None, overrides: list[str]) -> DictConfig:
    """The config of one method: its preset on top of the job's overrides.

    An override applies to every method whose config has that key (``drafter.top_k=4`` changes
    the EAGLE-3 methods and leaves ``ar`` alone); :func:`check_overrides` makes sure each one
    applies to at least one method, so a typo is still an error.
    """
    if method not in cfg.method_presets:
        raise ConfigError(f"methods: {method!r} has no entry in method_presets (known: {', '.join(cfg.method_presets)})")
    base = ([f"workload={workload}"] if workload else []) + list(cfg.method_presets[method])
    try:
        return compose(overrides + base, config_name=_config_name())
    except ConfigError:
        usable = [o for o in overrides if _composes([o] + base)]
        return compose(usable + base, config_name=_config_name())


def _composes(overrides: list[str]) -> bool:
    try:
        compose(overrides, config_name=_config_name())
        return True
    except ConfigError:
        return False


def check_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    for o in overrides:
        if not any(_composes([o] + list(cfg.method_presets.get(m, []))) for m in cfg.methods):
            compose([o], config_name=_config_name())  # raises the error that names the key
            raise ConfigError(f"override {o!r} applies to none of the methods {list(cfg.methods)}")


def _progress(total: int):  # noqa: ANN202
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not sys.stderr.isatty())


def run(cfg: DictConfig, output_dir: Path, overrides: list[str]) -> list[dict[str, Any]]:
    if not cfg.methods:
        raise ConfigError("methods is empty: name the methods to compare, e.g. methods=[ar,eagle3,specfit]")
    check_overrides(cfg, overrides)
    workloads = list(cfg.workloads) or [None]
    rows: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    for workload in workloads:
        configs = {m: method_config(cfg, m, workload, overrides) for m in cfg.methods}
        any_cfg = next(iter(configs.values()))
        prompts = prompts_of(any_cfg)
        engines = {m: build(c) for m, c in configs.items()}
        about = describe(any_cfg.workload)
        per_method: dict[str, list[dict[str, Any]]] = {m: [] for m in engines}
        outputs: dict[int, dict[str, list[int]]] = {}
        with _progress(cfg.repeats * len(prompts) * len(engines)) as bar:
            for repeat in range(cfg.repeats):
                for i, prompt in enumerate(prompts):
                    for method, engine in engines.items():
                        out = engine.generate(prompt)
                        per_method[method].append(out.stats)
                        outputs.setdefault(i, {})[method] = out.token_ids
                        rows.append({"command": "bench", "method": method, **about, "prompt_index": i, "repeat": repeat,
                                     **out.stats, "config": OmegaConf.to_container(configs[method], resolve=True)})
                        bar.update()
        identical = all(len({tuple(v) for v in o.values()}) == 1 for o in outputs.values())
        summary = [{"method": m, **about, **mean_stats(s), "outputs_identical": identical} for m, s in per_method.items()]
        summaries += summary
        print(f"\nworkload {about['workload']} ({about['workload_split']}): {len(prompts)} prompts x {cfg.repeats} repeats, "
              f"{cfg.max_new_tokens} new tokens, "
              f"{'greedy' if cfg.sampling.temperature == 0 else f'sampling T={cfg.sampling.temperature}'}")
        print(comparison_table(summary, baseline=cfg.baseline))
        print(f"output tokens identical across methods: {'yes' if identical else 'NO'}")
    path = append_jsonl(output_dir / cfg.results_file, rows)
    append_jsonl(output_dir / "summary.jsonl", summaries)
    if any(r.get("h2d_emulated") for r in summaries):
        print("H2D times are EMULATED (cache.copy=emulated): each copy is charged the reference link's time.")
    print(f"results: {path}")
    return rows
