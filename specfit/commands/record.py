"""``specfit record``: decode greedily and write a trace of every position for ``specfit replay``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specfit.api import build
from specfit.commands.generate import prompts_of
from specfit.errors import ConfigError
from specfit.results import append_jsonl
from specfit.trace.format import check_destination
from specfit.trace.record import record


def run(cfg: DictConfig, output_dir: Path) -> dict[str, Any]:
    if cfg.sampling.temperature != 0:
        raise ConfigError("specfit record needs greedy decoding (sampling.temperature=0): under sampling the "
                          "output depends on the selector, so no trace replays exactly")
    path = check_destination(cfg.trace.path or output_dir / "trace", bool(cfg.trace.overwrite))
    prompts = prompts_of(cfg)
    engine = build(cfg, calibration_prompts=prompts)
    config = OmegaConf.to_container(cfg, resolve=True)
    start = time.perf_counter()
    trace = record(engine, prompts, config=config)
    seconds = time.perf_counter() - start
    trace.save(path, overwrite=bool(cfg.trace.overwrite))
    nodes = sum(len(s.node_token) for s in trace.sequences)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    positions = trace.positions
    print(f"trace: {path}")
    print(f"{len(trace.sequences)} sequences, {positions} positions, {nodes / max(positions, 1):.1f} recorded nodes "
          f"per position, {size / 1e6:.2f} MB, recorded in {seconds:.1f}s"
          + ("" if trace.meta.constants else " (no cost constants: replays need cost_model.calibration=FILE "
                                                 "or cost_model.c0/c_tok/c_miss/c_hit)"))
    print(f"replay it: specfit replay trace.path={path} selector=specfit predictor=history cache=lru cache.capacity=N")
    row = {"command": "record", "trace": str(path), "sequences": len(trace.sequences), "positions": positions,
           "recorded_nodes": nodes, "bytes": size, "record_seconds": seconds, "drafter": trace.meta.drafter,
           "cost_constants": trace.meta.constants, "config": config}
    append_jsonl(output_dir / cfg.results_file, [row])
    return row
