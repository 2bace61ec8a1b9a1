"""Calibrating the cycle-time cost model from measured cycles, and storing the constants.

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

import functools
import hashlib
import itertools
import json
import math
import os
import platform
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specfit.offload.copy.engines import waits_measured
from specfit.types.stats import CycleRecord, visible_copy_seconds, waited_copy_seconds
from specfit.errors import ConfigError
from specfit.files import read_json_object
from specfit.progress import progress
from specfit.interfaces import Selection, SelectorBase


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


# --------------------------------------------------------------------------- storage


def calibration_dir() -> Path:
    return Path(os.environ.get("SPECFIT_HOME", Path.home() / ".cache" / "specfit")) / "calibration"


def setup_fingerprint(engine: Any) -> dict[str, Any]:
    """What the constants depend on: model, dtype, device, cache, copy engine, drafter, machine.

    ``model_head`` is the model's own EAGLE-3 head (``model.draft_head``); a drafter that uses it
    has it as its ``path``, recorded as ``head: null``; ``weights`` tells heads at one path apart."""
    model_head = engine.info.get("draft_head")
    head = getattr(engine.drafter, "path", None)
    weights = head_weights_digest(head if head and head != "random" else None)
    return {
        "model": str(engine.info.get("model", type(engine.model).__name__)),
        "dtype": str(engine.spec.dtype),
        "device": str(engine.device),
        "cache": engine.runtime.policy.name,
        "slots_per_layer": engine.runtime.slots_per_layer,
        "copy_engine": engine.copy_engine.describe(),
        # constants fitted under prefetch differ (the overlap); without it the fingerprint, and so
        # the stored calibration's name, is as before
        **({"prefetch": engine.info["prefetch"]} if engine.info.get("prefetch", "none") != "none" else {}),
        # numerics=exact over half-precision experts computes in float32: other timings, so another
        # file; where dense and expert dtypes agree the fingerprint is as before
        **({"dense_dtype": engine.info["dense_dtype"]}
           if engine.info.get("dense_dtype", engine.info.get("expert_dtype")) != engine.info.get("expert_dtype") else {}),
        # drafting costs depend on the drafter's settings, not only on its kind
        "drafter": {"name": engine.drafter.name, "depth": engine.drafter.depth, "total_tokens": engine.drafter.total_tokens,
                    "top_k": getattr(engine.drafter, "top_k", None), "head": None if head == model_head else head,
                    "model_head": model_head,
                    # a head retrained in place (the same path) is another setup: its acceptance differs,
                    # so the gate and estimator state stored for the old one must not carry over
                    **({"weights": weights} if weights else {}),
                    # a head's acceptance probe left unused (drafter.acceptance_probe=false) is another
                    # setup: the estimator state stored with its logits must not carry over
                    **({"acceptance_probe": False} if getattr(engine.drafter, "probe_left_unused", False) else {})},
        "machine": {"node": platform.node(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count()},
    }


def acceptance_setup(engine: Any) -> dict[str, Any]:
    """The part of :func:`setup_fingerprint` a drafted node's acceptance depends on: the target
    and the drafter's head (its weights, whether its probe is used), not the cache, link or machine.
    A trace records it; ``specfit fit-acceptance`` copies it into the model it writes, so an engine
    loading that model on another setup says so."""
    fingerprint = setup_fingerprint(engine)
    drafter = {k: _resolved(v) if k in ("head", "model_head") else v for k, v in fingerprint["drafter"].items()
               if k not in ("depth", "total_tokens", "top_k")}
    return json.loads(json.dumps({"model": _resolved(fingerprint["model"]), "drafter": drafter}, default=str))


def _resolved(name: Any) -> Any:
    """A path as an absolute one (``runs/t`` and ``/work/runs/t`` are one model); names that are not
    paths on this machine (``builtin:demo``, ``random``, another machine's path) as they are."""
    if isinstance(name, str) and name and Path(name).expanduser().exists():
        return str(Path(name).expanduser().resolve())
    return name


# what a drafter's section of the fingerprint holds that its costs do not depend on: the head's
# weight values (a head retrained in place costs the same) and whether its acceptance probe is used
ACCEPTANCE_ONLY = ("weights", "acceptance_probe")


def cost_fingerprint(engine: Any) -> dict[str, Any]:
    """What the cost constants depend on: :func:`setup_fingerprint` less what only acceptance
    depends on (:data:`ACCEPTANCE_ONLY`). Fitting or retraining a head, or a probe, then keeps its
    calibration (measured for minutes); the gate's and the estimator's state, which
    :func:`setup_fingerprint` keys, start again."""
    fingerprint = setup_fingerprint(engine)
    fingerprint["drafter"] = _costs_part(fingerprint["drafter"])
    return fingerprint


def _costs_part(drafter: dict[str, Any]) -> dict[str, Any]:
    """A drafter's fingerprint less what only acceptance depends on (:data:`ACCEPTANCE_ONLY`)."""
    return {k: v for k, v in drafter.items() if k not in ACCEPTANCE_ONLY}


def setup_hash(fingerprint: dict[str, Any]) -> str:
    """16 hex digits naming a fingerprint's files under :func:`calibration_dir`."""
    return hashlib.sha1(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]


def head_weights_digest(directory: str | None, skip: Sequence[str] = ()) -> str | None:
    """A short digest of a head directory's weight files (but the names in ``skip``), or None (no
    directory, no weights).

    Each file's size and its first and last MiB, so a head of gigabytes is not read whole on every
    build; a retrained head of the same shape differs in both. Cached per (path, size, mtime)."""
    if not directory:
        return None
    folder = Path(directory).expanduser()
    try:
        files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.name not in skip)
        stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    except OSError:
        return None
    return _digest(str(folder.resolve()), stamp) if files else None


@functools.lru_cache(maxsize=32)
def _digest(folder: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha1()
    for name, size, _ in stamp:
        h.update(f"{name}:{size}".encode())
        with open(Path(folder) / name, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 1 << 20:  # the last MiB, or what the first left (a file of 1-2 MiB is read whole)
                fh.seek(max(1 << 20, size - (1 << 20)))
                h.update(fh.read())
    return h.hexdigest()[:12]


#: Version of the fit that produced a stored calibration. A stored file of an older fit is measured
#: again when ``cost_model.calibration=auto`` finds it (a file named explicitly is used as it is).
#: 1: files without the field. 2 (2026-12-03): with an emulated link, the compute fit subtracts what
#: the passes waited, not what they copied (pipelined rounds hide copies: the old fit put c_hit
#: at 0.03 ms instead of 0.14 ms on the demo pair).
FIT_VERSION = 2


def stored_fit_version(path: Path) -> int | None:
    """The fit version of a stored calibration: 1 when it does not say, None when the file cannot
    be read as JSON (``load_constants`` then says what is wrong with it)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    version = data.get("fit_version", 1) if isinstance(data, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def stored_poor_fit(path: Path) -> float | None:
    """The held-out median cycle-time error a stored calibration reports, when above
    :data:`POOR_FIT` (a host busy while it measured); None when it is trusted, was kept on purpose
    (``specfit calibrate`` stores what it measures) or does not say."""
    try:
        report = json.loads(Path(path).read_text())["report"]
        error = report["cycle_time_ape_median"]
        if report.get("kept_despite_error"):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if isinstance(error, bool) or not isinstance(error, (int, float)) or not math.isfinite(error):
        return None
    return float(error) if error > POOR_FIT else None


def setup_differences(path: str | Path, engine: Any) -> list[str]:
    """The top-level setup keys (model, cache, drafter, machine, ...) in which the calibration file
    ``path`` was measured on another setup than ``engine``'s; [] when they agree or it records none."""
    stored = read_json_object(Path(path).expanduser(), f"cost_model.calibration={path}", ConfigError).get("setup")
    if not isinstance(stored, dict):
        return []
    here = json.loads(json.dumps(cost_fingerprint(engine), default=str))
    if isinstance(stored.get("drafter"), dict):  # a file stored before the split kept them
        stored = {**stored, "drafter": _costs_part(stored["drafter"])}
    return differing_keys(stored, here)


def differing_keys(stored: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The top-level keys in which two setup descriptions differ (one missing counts), sorted."""
    return [key for key in sorted(set(stored) | set(here)) if stored.get(key) != here.get(key)]


def calibration_path(engine: Any) -> Path:
    return calibration_dir() / f"{setup_hash(cost_fingerprint(engine))}.json"


def save_constants(path: Path, constants: CostConstants, engine: Any, report: dict[str, Any]) -> Path:
    """Store a calibration atomically: a run killed while saving leaves the old file or none."""
    from specfit.files import write_atomic

    data = {"constants": constants.to_json(), "setup": cost_fingerprint(engine), "report": report,
            "fit_version": FIT_VERSION}
    return write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def check_calibration_destination(path: Path) -> Path:
    """Refuse an unwritable calibration file before any measuring starts (one line naming it)."""
    from specfit.files import check_writable

    return check_writable(path, "SPECFIT_HOME", label=f"calibration file {path} (under $SPECFIT_HOME, default "
                                                      f"~/.cache/specfit)")


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
        if name in ("samples", "source"):
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
    return constants


# --------------------------------------------------------------------------- measuring


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
    overlap = pipelined(engine)
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


def pipelined(engine: Any) -> bool:
    """Copies overlap other work and their stall is measured on the host: a prefetcher over the
    emulated link or a CUDA engine with a measuring timing (with ``timing="none"`` a CUDA engine
    waits on events without a host sync, so its stall is not seen)."""
    prefetcher = getattr(engine, "prefetcher", None)
    return (prefetcher is not None and getattr(prefetcher, "name", "none") != "none"
            and waits_measured(engine.copy_engine))
