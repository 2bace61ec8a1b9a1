"""Workloads: the prompts a job decodes (inline lists or a JSONL file)."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from specfit.errors import ConfigError


def load_workload(cfg: DictConfig) -> list[str | list[int]]:
    prompts: list[str | list[int]] = [list(p) for p in cfg.prompt_ids] + [str(p) for p in cfg.prompts]
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not path.is_file():
            raise ConfigError(f"workload.path={cfg.path}: no such file")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"workload.path={cfg.path} line {n}: not JSON ({exc.msg})") from exc
            if "prompt_ids" in row:
                prompts.append([int(t) for t in row["prompt_ids"]])
            elif "prompt" in row:
                prompts.append(str(row["prompt"]))
            else:
                raise ConfigError(f"workload.path={cfg.path} line {n}: needs a 'prompt' or 'prompt_ids' field")
    if cfg.max_prompts is not None:
        prompts = prompts[: cfg.max_prompts]
    return prompts
