"""Measuring a calibration: decode with cycles of every size, fit the constants, report the held-out error
(the model and its fit: :mod:`specfit.types.costs`)."""


from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from specfit.errors import ConfigError
from specfit.interfaces import Selection, SelectorBase
from specfit.progress import progress
from specfit.types.costs import CostConstants, fit_constants, percentage_errors
from specfit.types.stats import CycleRecord


class SizeSweepSelector(SelectorBase):
    """Verifies a random number of the best nodes after a random number of levels, so calibration
    sees cycles of every size (not registered as a plugin: it only serves calibration)."""

    name = "size_sweep"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self._stop_at = 1

    def select(self, tree: Any, ctx: Any) -> Any:
        if tree.depth == 1:
            self._stop_at = int(self.rng.integers(1, max(ctx.max_depth, 1) + 1))
        stop = tree.depth >= self._stop_at
        count = int(self.rng.integers(0, min(ctx.max_nodes, len(tree)) + 1)) if stop else 0
        return Selection(nodes=tree.top_by_path_prob(count), stop=stop)


def run_calibration(engine: Any, prompts: Sequence[Any], max_new_tokens: int, seed: int = 0,
                    held_out: float = 0.3) -> tuple[CostConstants, dict[str, Any]]:
    """Decode ``prompts`` with cycles of random size, fit the constants, report held-out error.

    The engine decodes with a :class:`SizeSweepSelector` for these calls only (``generate``'s
    ``selector``): its own selector is neither replaced nor touched."""
    sweep = SizeSweepSelector(seed)
    records: list[CycleRecord] = []
    link = stalled = 0.0  # the runs' link time and the part of it compute waited for
    with progress(len(prompts), "calibrate", unit="prompt") as bar:
        for prompt in prompts:
            out = engine.generate(prompt, max_new_tokens=max_new_tokens, selector=sweep)
            records += out.cycles
            link += float(out.stats.get("link_busy_seconds", 0.0))
            stalled += float(out.stats.get("h2d_stall_seconds", 0.0))
            bar.update()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(records))
    if len(records) < 8:
        raise ConfigError(f"calibration measured only {len(records)} cycles; give more or longer prompts "
                          "(max_new_tokens) so some can be held out")
    cut = int(len(records) * (1 - held_out))
    fit = [records[i] for i in order[:cut]]
    test = [records[i] for i in order[cut:]]
    overlap = engine.copies_overlap
    constants = fit_constants(fit, overlap=overlap)
    errors = percentage_errors(constants, test)
    report = {
        "cycles_fit": len(fit),
        "cycles_held_out": len(test),
        "cycle_time_ape_median": float(np.median(errors)),
        "cycle_time_ape_p90": float(np.quantile(errors, 0.9)),
    }
    if overlap:  # the share of the link's transfer time (prefetches included) that other work hid
        report["copy_overlap"] = float(1.0 - stalled / link) if link > 0 else 0.0
    return constants, report
