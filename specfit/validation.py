"""Checks of single values at the boundary (config schemas, the API), each failing with one line.

Every check names the config key (or API argument) it was given, so the message says what to fix.
They raise :class:`ConfigError`, a ``ValueError`` too: callers of the API may catch either.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from specfit.errors import ConfigError


def is_int(value: Any) -> bool:
    """A real integer: bools are ints in Python but never a count, an id or a seed here."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    try:  # numpy / torch integer scalars
        import numpy as np

        return isinstance(value, np.integer)
    except ImportError:  # pragma: no cover - numpy is a dependency
        return False


def is_count(value: Any) -> bool:
    """A finite number >= 0 read from a saved state (JSON): a decayed count, seconds; never a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def integer(key: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as an int, at least ``minimum``."""
    if not is_int(value):
        raise ConfigError(f"{key}={value!r} must be an integer")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}")
    return value


def optional_integer(key: str, value: Any, minimum: int | None = None) -> int | None:
    return None if value is None else integer(key, value, minimum)


def number(key: str, value: Any, minimum: float | None = None, maximum: float | None = None,
           above: float | None = None) -> float:
    """A finite real number in range (``above``: strictly greater than)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not _is_numpy_number(value):
        raise ConfigError(f"{key}={value!r} must be a number")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key}={value} must be <= {maximum}")
    if above is not None and value <= above:
        raise ConfigError(f"{key}={value} must be > {above}")
    return value


def choice(key: str, value: Any, choices: Iterable[str]) -> str:
    choices = list(choices)
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")
    return value


def token_ids(key: str, values: Any, vocab_size: int | None = None, allow_empty: bool = True) -> list[int]:
    """A flat sequence of token ids: ints (no floats, bools, strings, bytes or nested lists) in the vocabulary."""
    if isinstance(values, (str, bytes, bytearray)) or not _is_sequence(values):
        raise ConfigError(f"{key} must be a list of token ids (integers), got {_short(values)}")
    if hasattr(values, "tolist") and getattr(values, "shape", None) is not None:
        values = values.tolist()  # a 1-D tensor or array
    out = []
    for i, value in enumerate(values):
        if not is_int(value):
            raise ConfigError(f"{key}[{i}]={_short(value)} is not a token id (an integer)")
        out.append(int(value))
    if not out and not allow_empty:
        raise ConfigError(f"{key} is empty")
    if vocab_size is not None:
        bad = [t for t in out if not 0 <= t < vocab_size]
        if bad:
            raise ConfigError(f"{key}: token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
    return out


def _is_sequence(values: Any) -> bool:
    if isinstance(values, Sequence):
        return True
    try:  # a ListConfig, a 1-D tensor or array
        from omegaconf import ListConfig

        if isinstance(values, ListConfig):
            return True
    except ImportError:  # pragma: no cover
        pass
    shape = getattr(values, "shape", None)
    return shape is not None and len(shape) == 1 and hasattr(values, "tolist")


def _is_numpy_number(value: Any) -> bool:
    try:
        import numpy as np

        return isinstance(value, (np.integer, np.floating))
    except ImportError:  # pragma: no cover
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_collection(value: Any) -> bool:
    """Iterable items (a list, tuple, set, array), not a string (whose letters would pass as items)."""
    return not isinstance(value, (str, bytes)) and hasattr(value, "__iter__")


def device_arg(device: Any, key: str = "device") -> Any:
    """A torch.device from ``model.device`` / ``Engine(device=...)``, or a ConfigError naming ``key``."""
    import torch

    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise ConfigError(f"{key}={device!r} must be a string such as cpu, cuda or cuda:0")
    try:
        out = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"{key}={device!r} is not a torch device (cpu, cuda, cuda:N, ...)") from None
    if out.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}={device!r}: no CUDA device is available (torch {torch.__version__})")
    return out
