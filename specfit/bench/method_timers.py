"""Wall-clock timers wrapped around methods of built objects, for the scripts that time parts of a
decode in one process (``scripts/lookahead_cost.py``, ``scripts/draft_level_cost.py``)."""

from __future__ import annotations

import collections
import time
from typing import Any, Callable


class MethodTimers:
    """Seconds and calls per label, summed over every call of the wrapped methods."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Replace ``owner.name`` by a timed wrapper counting under ``label`` (about a microsecond a call)."""
        fn: Callable[..., Any] = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
