"""``specfit record``: decode greedily and write a trace of every position for ``specfit replay``."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specfit.api import build
from specfit.commands.generate import prompts_of
from specfit.commands.bench import resume_command
from specfit.errors import ConfigError
from specfit.files import check_results_file
from specfit.results import append_jsonl
from specfit.trace.format import (
    META_FILE, TraceError, TraceWriter, check_destination, config_difference, load_trace, spec_to_json,
)
from specfit.trace.record import record

# config keys a resumed recording may change: where it writes, and the switch itself
_RESUME_IGNORES = ("resume", "trace", "results_file")


def run(cfg: DictConfig, output_dir: Path) -> dict[str, Any]:
    """Record the prompts; each sequence is on disk as soon as it is recorded, meta.json last.

    With ``resume=true`` an incomplete trace at ``trace.path`` (an interrupted recording of the same
    config) is continued from its last complete sequence. Ctrl-C prints the command that does so.
    """
    if cfg.sampling.temperature != 0:
        raise ConfigError("specfit record needs greedy decoding (sampling.temperature=0): under sampling the "
                          "output depends on the selector, so no trace replays exactly")
    if cfg.resume and cfg.trace.overwrite:
        raise ConfigError("resume=true continues the trace at trace.path and trace.overwrite=true replaces it: "
                          "give one")
    path = check_destination(cfg.trace.path or output_dir / "trace", bool(cfg.trace.overwrite), bool(cfg.resume))
    results = check_results_file(output_dir / cfg.results_file)
    if cfg.resume and (path / META_FILE).is_file() and not cfg.trace.overwrite:
        trace = load_trace(path)
        # as for an incomplete trace (TraceWriter.resume): a different config there is an error
        differs = trace.meta.config is not None and config_difference(  # None: saved by the API, no config
            trace.meta.config, OmegaConf.to_container(cfg, resolve=True), _RESUME_IGNORES)
        if differs:
            raise TraceError(f"trace.path={path}: the complete trace there was recorded with another config "
                             f"({differs} differs): resume with the same settings, or set trace.overwrite=true "
                             f"to record afresh")
        print(f"trace: {path} is already complete ({len(trace.sequences)} sequences): nothing to resume")
        return {"command": "record", "trace": str(path), "sequences": len(trace.sequences)}
    prompts = prompts_of(cfg)
    engine = build(cfg, calibration_prompts=prompts, check_prompts=prompts)
    config = OmegaConf.to_container(cfg, resolve=True)
    spec = spec_to_json(engine.spec)
    writer = TraceWriter(path)
    if cfg.resume and not cfg.trace.overwrite:
        done = writer.resume(config, spec, ignore=_RESUME_IGNORES)
        print(f"resume: {len(done)} of {len(prompts)} sequences are already in {path}; recording the other "
              f"{len(prompts) - len(done)}", file=sys.stderr)
    else:
        writer.start(config, spec, overwrite=bool(cfg.trace.overwrite))
        done = []
    completed = len(done)

    def saved(i: int, seq: Any) -> None:
        nonlocal completed
        writer.add(i, seq)
        completed = i + 1

    start = time.perf_counter()
    try:
        trace = record(engine, prompts, config=config, done=done, on_sequence=saved)
    except KeyboardInterrupt:
        resume = resume_command(output_dir, replace={"trace.path": str(path)}, drop=("trace.overwrite",))
        print(f"specfit: interrupted: {completed} of {len(prompts)} sequences are saved in {path} (an incomplete "
              f"trace); resume with: {resume}", file=sys.stderr, flush=True)
        raise
    seconds = time.perf_counter() - start
    writer.finish(trace)
    nodes = sum(len(s.node_token) for s in trace.sequences)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    positions = trace.positions
    print(f"trace: {path}")
    print(f"{len(trace.sequences)} sequences, {positions} positions, {nodes / max(positions, 1):.1f} recorded nodes "
          f"per position, {size / 1e6:.2f} MB, recorded in {seconds:.1f}s"
          + (f" ({len(done)} sequences from the interrupted recording)" if done else "")
          + ("" if trace.meta.constants else " (no cost constants: replays need cost_model.calibration=FILE "
                                                 "or cost_model.c0/c_tok/c_miss/c_hit)"))
    print(f"replay it: specfit replay trace.path={path} selector=specfit predictor=history cache=lru cache.capacity=N")
    for note in trace.notes:  # e.g. no drafted nodes (drafter=none): every selector equals the oracle
        print(f"note: {note}")
    row = {"command": "record", "trace": str(path), "sequences": len(trace.sequences), "positions": positions,
           "recorded_nodes": nodes, "bytes": size, "record_seconds": seconds, "drafter": trace.meta.drafter,
           "cost_constants": trace.meta.constants, "config": config}
    append_jsonl(results, [row])
    return row
