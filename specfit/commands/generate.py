"""``specfit generate``: decode one prompt, print the text and a stats line, append results.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specfit.api import build
from specfit.errors import ConfigError
from specfit.results import append_jsonl, stats_line


def prompts_of(cfg: DictConfig) -> list[str | list[int]]:
    """The prompts a config asks for: ``prompt_ids`` / ``prompt``, else the workload's."""
    if cfg.prompt_ids is not None and cfg.prompt is not None:
        raise ConfigError("give prompt or prompt_ids, not both")
    if cfg.prompt_ids is not None:
        return [list(cfg.prompt_ids)]
    if cfg.prompt is not None:
        return [str(cfg.prompt)]
    from specfit.workloads import load_workload

    prompts = load_workload(cfg.workload)
    if not prompts:
        raise ConfigError("no prompt: set prompt=\"...\", prompt_ids=[...] or a workload with prompts")
    return prompts


def run(cfg: DictConfig, output_dir: Path) -> list[dict[str, Any]]:
    engine = build(cfg)
    rows = []
    config = OmegaConf.to_container(cfg, resolve=True)
    for prompt in prompts_of(cfg):
        out = engine.generate(prompt)
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
        print(stats_line(out.stats))
        rows.append({"command": "generate", "prompt": prompt, "output_ids": out.token_ids, "text": out.text,
                     **out.stats, "config": config})
    path = append_jsonl(output_dir / cfg.results_file, rows)
    print(f"results: {path}")
    return rows
