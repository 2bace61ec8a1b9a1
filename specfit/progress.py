"""Progress of the steps that take more than a few seconds (bench runs, training, calibration).

On a terminal a tqdm bar on stderr; otherwise (a log file, a pipe, CI) one plain line per step on
stderr, or per ``every`` steps for loops of thousands (training logs every ``log_every`` steps),
so a log shows how far a job got without a carriage-return bar smeared over it.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def progress(total: int, desc: str, *, unit: str = "step", initial: int = 0, every: int = 1,
             disable: bool | None = None) -> Any:
    """A bar on a terminal, else :class:`LineProgress`; ``disable=True``: neither, ``False``: a bar always.

    Both support ``update(n)``, ``set_postfix(**values)``, ``close()`` and ``with``."""
    if disable is None and not sys.stderr.isatty():
        return LineProgress(total, desc, unit=unit, initial=initial, every=every)
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, disable=bool(disable),
                dynamic_ncols=True)


class LineProgress:
    """One line on stderr per ``every`` steps (and at the last): ``desc: 3/8 runs, 12 s [postfix]``."""

    def __init__(self, total: int, desc: str, *, unit: str = "step", initial: int = 0, every: int = 1) -> None:
        self.total, self.desc, self.unit, self.n, self.every = total, desc, unit, initial, max(1, every)
        self.postfix = ""
        self.start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n // self.every > (self.n - n) // self.every or self.n >= self.total:  # crossed a multiple
            seconds = time.perf_counter() - self.start
            print(f"{self.desc}: {self.n}/{self.total} {self.unit}s, {seconds:.0f} s{self.postfix}",
                  file=sys.stderr, flush=True)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = " " + " ".join(f"{k}={v}" for k, v in values.items()) if values else ""

    def close(self) -> None:
        pass

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
