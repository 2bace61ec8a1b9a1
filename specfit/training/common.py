"""Shared helpers for the trainers: LR schedule, progress bars, JSONL logs, checkpoint state.

Kept free of heavy imports at module level (torch is imported inside functions).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from specfit.messages import note_once


@dataclass
class FrozenTargetSettings:
    """Where and how a command that only runs the frozen target does so (distill-data, fit-probe)."""

    target_dtype: str = "float32"
    device: str = "cpu"
    threads: int = 2


def warmup_cosine_lr(step: int, *, total_steps: int, warmup_steps: int, lr: float,
                     min_lr_ratio: float = 0.1) -> float:
    """Learning rate at ``step`` (0-based): linear warmup, then cosine decay to ``min_lr_ratio*lr``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def progress_bar(total: int, *, initial: int = 0, desc: str = "", unit: str = "step",
                 disable: bool | None = None, every: int = 1) -> Any:
    """A tqdm bar on stderr on a terminal; otherwise one line per ``every`` steps (logs stay readable).
    ``disable``: None decides by the terminal, True shows nothing, False forces the bar."""
    from specfit.progress import progress

    return progress(total, desc, unit=unit, initial=initial, every=every, disable=disable)


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
    """Python, numpy and torch RNG states, for exact resumption from a checkpoint.

    Held as tensors and plain numbers only, so ``state.pt`` loads with ``torch.load(...,
    weights_only=True)``: a checkpoint is data, never code.
    """
    import torch

    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": {"version": int(version), "state": torch.tensor(mt, dtype=torch.int64),
                       "gauss_next": gauss},
            "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A trainer's ``state.pt``, loaded as data only (``weights_only=True``).

    A file holding anything but tensors and plain containers (a pickled object, which could run
    code while loading, or a checkpoint of an older specfit that pickled numpy state) is refused
    with one line naming it; nothing in it runs.
    """
    import pickle

    import torch

    from specfit.errors import ModelError

    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported [^.]*", str(exc))
        why = found.group(0) if found else "not tensors and plain data"
        raise ModelError(f"{path}: refused to load: loading it could run code ({why}); a checkpoint of an older "
                         f"specfit cannot be resumed safely: start without resume=true") from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise ModelError(f"{path}: not a readable trainer checkpoint ({type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''})") from exc
    if not isinstance(state, dict) or not {"model", "optimizer", "step", "rng", "config"} <= set(state):
        raise ModelError(f"{path}: not a specfit trainer checkpoint (missing model/optimizer/step/rng/config)")
    return state


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


# Trainer config fields that may be 0 (every other number must be positive); fractions in [0, 1).
_MAY_BE_ZERO = {"seed", "gsm_seed", "warmup_steps", "weight_decay", "router_aux_loss_coef", "grad_clip",
                "min_lr_ratio", "beta1", "beta2", "step_weight_decay", "gsm_per_template", "initializer_range",
                "eval_windows", "eval_prompts", "max_windows", "n_prompts", "gsm_share"}  # 0: no evaluation of that kind
_FRACTIONS = {"min_lr_ratio", "beta1", "beta2"}


def check_trainer_config(cfg: Any) -> None:
    """One line naming the key for a trainer setting that cannot train (a negative size, a NaN rate).

    Called from each trainer config's ``__post_init__``: the CLI builds the dataclass before training."""
    import dataclasses

    from specfit.errors import ConfigError

    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None or isinstance(value, (bool, str)) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            raise ConfigError(f"{f.name}={value} must be a finite number")
        if value < 0 or (value == 0 and f.name not in _MAY_BE_ZERO):
            raise ConfigError(f"{f.name}={value} must be {'>= 0' if f.name in _MAY_BE_ZERO else 'positive'}")
        if f.name in _FRACTIONS and value >= 1:
            raise ConfigError(f"{f.name}={value} must be in [0, 1)")
    top_k, experts = getattr(cfg, "num_experts_per_tok", None), getattr(cfg, "num_experts", None)
    if top_k is not None and experts is not None and top_k > experts:
        raise ConfigError(f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    for key in ("train_files", "eval_files"):  # named now, not after the target has loaded
        for name in getattr(cfg, key, None) or ():
            path = Path(str(name)).expanduser()
            if not path.is_file():
                raise ConfigError(f"{key}: {name}: {'is a directory, not a file' if path.exists() else 'no such file'}")
    trained = {Path(str(n)).expanduser().resolve() for n in getattr(cfg, "train_files", None) or ()}
    for name in getattr(cfg, "eval_files", None) or ():  # scores on training rows flatter the fit: say so
        if Path(str(name)).expanduser().resolve() in trained:
            note_once(f"eval_files: {name} is also in train_files, so the held-out figures are on training rows "
                      "(leave eval_files empty for the trainer's own held-out split)")
