"""Shared helpers for the trainers: LR schedule, progress bars, JSONL logs, checkpoint state.

Kept free of heavy imports at module level (torch is imported inside functions).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

def warmup_cosine_lr(step: int, *, total_steps: int, warmup_steps: int, lr: float,
                     min_lr_ratio: float = 0.1) -> float:
    """Learning rate at ``step`` (0-based): linear warmup, then cosine decay to ``min_lr_ratio*lr``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def progress_bar(total: int, *, initial: int = 0, desc: str = "", unit: str = "step",
                 disable: bool | None = None) -> Any:
    """A tqdm bar on stderr, off when stderr is not a terminal (logs stay clean)."""
    from tqdm.auto import tqdm

    if disable is None:
        disable = not sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr,
                disable=disable, dynamic_ncols=True)


class JsonlLog:
    """Append-only JSON-lines log; each record gets a wall-clock ``time`` field."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, **record: Any) -> None:
        record.setdefault("time", round(time.time(), 3))
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=False) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open(encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically (temp file + rename), so a kill never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def join_documents(texts: Iterable[str], eos: str) -> str:
    """Concatenate documents with the end-of-text separator after each one."""
    return "".join(t + eos for t in texts)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states, for exact resumption from a checkpoint."""
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def truncate_log(log: JsonlLog, step: int) -> None:
    """Drop log records of steps after ``step`` (written after the last checkpoint, then lost)."""
    rows = [r for r in log.read() if r.get("step", 0) <= step]
    tmp = log.path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, log.path)


def read_text_files(paths: Sequence[str]) -> list[tuple[str, str]]:
    """(name, text) documents from .txt files and .jsonl files with a "text" field per line."""
    docs: list[tuple[str, str]] = []
    for p in paths:
        path = Path(p)
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as fh:
                for i, line in enumerate(fh):
                    if line.strip():
                        docs.append((f"{path.name}:{i}", json.loads(line)["text"]))
        else:
            docs.append((path.name, path.read_text(encoding="utf-8", errors="replace")))
    return docs
