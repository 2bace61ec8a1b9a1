"""The cost model's constants, their fit from measured cycles, and reading a stored calibration.

Measured per cycle (``CycleRecord``): verified nodes n, expert hits and misses of the pass, H2D
seconds, drafting and selection seconds, total seconds. The model (docs/method.md section 2):

    cycle = c0 + c_tok * (n + 1) + c_miss * misses + c_hit * hits + D,   D = drafting + selection

Fitted in parts so each constant is identified: H2D seconds per missed expert (c_copy) from the
copies, compute ``total - D - h2d = c0 + c_tok (n + 1) + c_hit (hits + misses)`` by non-negative
least squares, then ``c_miss = c_hit + c_copy``; ``D = c_draft0 + c_level * levels``. Both fits
leave out cycles that something else on the host slowed (:func:`robust_nnls`), and a calibration
that still predicts its held-out cycles poorly (:data:`POOR_FIT`) is not stored.

Under prefetch (issue 14) copies overlap drafting and compute, so the H2D seconds a cycle issued
are not what it waited. There the fit uses the overlap it observes: the seconds compute actually
blocked on copies (``h2d_stall_seconds``) take the place of the H2D seconds, so c_copy becomes an
effective miss cost, the visible stall per miss, and the compute fit is not charged for hidden
transfers. Without prefetch c_copy stays the copies' own time, but where the host measures the
waits (an emulated link) the compute fit still subtracts what the passes waited rather than what
they copied: a layer's pipelined rounds hide copies behind compute, and counting those as compute
time saved would make compute look faster than it is (the replay models that overlap itself).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specfit.errors import ConfigError
from specfit.files import read_json_object
from specfit.types.stats import CycleRecord, visible_copy_seconds, waited_copy_seconds


@dataclass
class CostConstants:
    c0: float  # seconds per cycle, fixed
    c_tok: float  # seconds per verified token (root included)
    c_miss: float  # seconds per expert used that was not resident (copy + compute)
    c_hit: float  # seconds per expert used that was resident (compute)
    c_level: float = 0.0  # seconds per draft level (drafting + selection)
    c_draft0: float = 0.0  # seconds of drafting before the first level (catching up on committed tokens)
    samples: int = 0
    source: str = ""
    # measured on a host too busy to trust (held-out error above POOR_FIT): used, refined from the
    # cycles of the runs that use it (a cost model refits online), and re-measured by `specfit calibrate`
    provisional: bool = False

    def cycle_seconds(self, verified: int, misses: int, hits: int, draft_seconds: float) -> float:
        return self.c0 + self.c_tok * (verified + 1) + self.c_miss * misses + self.c_hit * hits + draft_seconds

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostConstants:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients, exactly, by trying every support (few columns)."""
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y**2))
    for size in range(1, x.shape[1] + 1):
        for support in itertools.combinations(range(x.shape[1]), size):
            coef, *_ = np.linalg.lstsq(x[:, support], y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((x[:, support] @ coef - y) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(x.shape[1])
                best[list(support)] = coef
    return best


#: A calibration whose held-out median cycle-time error is above this is not trusted: an automatic
#: one serves its run only and is not stored, a stored one is measured again (a busy host, not the
#: setup, made its cycles slow; the fit's usual error on the demo pair is 15-30%).
POOR_FIT = 0.5


def robust_nnls(x: np.ndarray, y: np.ndarray, rounds: int = 3, z: float = 4.0,
                max_drop: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    """:func:`nnls` that leaves out samples slowed by something other than the setup: (coef, kept).

    Another process, a page-cache flush or a descheduled thread only ever adds time, so a few
    cycles of a calibration can take 10-100x their prediction; least squares then moves every
    constant towards them (measured: one calibration under load stored c0 137 ms for 8 ms passes).
    Each round refits without the samples whose time exceeds the fit by more than ``z`` robust
    standard deviations (median absolute deviation of the relative excess) and by at least half
    the prediction, leaving out at most ``max_drop`` of them, the slowest first."""
    keep = np.ones(len(y), dtype=bool)
    coef = nnls(x, y)
    floor = 0.1 * float(np.median(np.abs(y))) or 1e-12  # tiny predictions (no drafting) are not relative
    for _ in range(rounds):
        excess = (y - x @ coef) / np.maximum(x @ coef, floor)
        centre = float(np.median(excess[keep]))
        spread = 1.4826 * float(np.median(np.abs(excess[keep] - centre)))
        slow = excess > max(centre + z * spread, 0.5)
        most = int(max_drop * len(y))
        if slow.sum() > most:
            slow = np.zeros(len(y), dtype=bool)
            slow[np.argsort(-excess)[:most]] = True
        if np.array_equal(~slow, keep):
            break
        keep = ~slow
        coef = nnls(x[keep], y[keep])
    return coef, keep


def fit_constants(records: Sequence[CycleRecord], fallback_copy_seconds: float | None = None,
                  overlap: bool = False) -> CostConstants:
    """The constants from measured cycles (module docstring); ``overlap``: the copies were
    pipelined, fit the visible stall instead of the issued transfer time."""
    if len(records) < 4:
        raise ConfigError(f"calibration needs at least 4 measured cycles, got {len(records)}")
    n = np.array([r.verified for r in records], dtype=float)
    used = np.array([r.hits + r.misses for r in records], dtype=float)
    misses = np.array([r.misses for r in records], dtype=float)
    h2d = np.array([visible_copy_seconds(r, overlap) for r in records])
    waited = np.array([waited_copy_seconds(r, overlap) for r in records])
    draft = np.array([r.draft_seconds + r.select_seconds for r in records])
    total = np.array([r.total_seconds for r in records])
    compute = total - draft - waited
    (c0, c_tok, c_hit), kept = robust_nnls(np.stack([np.ones_like(n), n + 1, used], axis=1), compute)
    if misses[kept].sum() > 0:  # a cycle slowed by the host waited longer for its copies too
        c_copy = float(h2d[kept].sum() / misses[kept].sum())
    elif fallback_copy_seconds is not None:
        c_copy = fallback_copy_seconds
    else:
        c_copy = 0.0
    levels = np.array([r.levels for r in records], dtype=float)
    (c_draft0, c_level), _ = robust_nnls(np.stack([np.ones_like(levels), levels], axis=1), draft)
    return CostConstants(c0=float(c0), c_tok=float(c_tok), c_miss=float(c_hit + c_copy), c_hit=float(c_hit),
                         c_level=float(c_level), c_draft0=float(c_draft0), samples=len(records))


def percentage_errors(constants: CostConstants, records: Sequence[CycleRecord]) -> np.ndarray:
    """|predicted - measured| / measured cycle time, with the cycles' actual expert counts."""
    pred = np.array([constants.cycle_seconds(r.verified, r.misses, r.hits, r.draft_seconds + r.select_seconds)
                     for r in records])
    measured = np.array([r.total_seconds for r in records])
    return np.abs(pred - measured) / measured


#: Version of the fit that produced a stored calibration. A stored file of an older fit is measured
#: again when ``cost_model.calibration=auto`` finds it (a file named explicitly is used as it is).
#: 1: files without the field. 2 (2026-12-03): with an emulated link, the compute fit subtracts what
#: the passes waited, not what they copied (pipelined rounds hide copies: the old fit put c_hit
#: at 0.03 ms instead of 0.14 ms on the demo pair).
FIT_VERSION = 2


def load_constants(path: str | Path) -> CostConstants:
    """Stored constants; a file that is not one (bad bytes, bad JSON, missing or bad values) names itself."""
    path = Path(path).expanduser()
    where = f"cost_model.calibration={path}"
    if path.is_dir():
        raise ConfigError(f"{where}: is a directory; name the calibration file (a .json `specfit calibrate` wrote)")
    if not path.is_file():
        raise ConfigError(f"{where}: no such file (run `specfit calibrate` to make one)")
    data = read_json_object(path, where, ConfigError, "not a specfit calibration file")
    stored = data.get("constants")
    if not isinstance(stored, dict):
        raise ConfigError(f"{where}: no \"constants\" object; not a specfit calibration file")
    for name, field in CostConstants.__dataclass_fields__.items():
        if name in ("samples", "source", "provisional"):
            continue
        if name not in stored:
            if field.default is MISSING:
                raise ConfigError(f"{where}: constants.{name} is missing")
            continue
        value = stored[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{where}: constants.{name}={json.dumps(value)[:40]} must be a finite number >= 0")
    constants = CostConstants.from_json(stored)
    if isinstance(constants.samples, bool) or not isinstance(constants.samples, int):
        constants.samples = 0  # informative only: a bad count is not worth refusing the file for
    constants.source = str(path)
    constants.provisional = constants.provisional is True  # informative: anything else counts as trusted
    return constants
