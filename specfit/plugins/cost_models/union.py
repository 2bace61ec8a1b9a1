"""The expert-union cost model (docs/method.md section 2).

A cycle that verifies subtree S costs ``c0 + c_tok (|S| + 1) + sum_l [c_miss |U_l \\ R_l| +
c_hit |U_l & R_l|] + D``, where U_l is the union of the experts the root and S activate in layer
l, R_l the experts resident when verification starts, and D the time already spent drafting.
Cache-aware by default; ``cache_aware=false`` charges every expert c_miss.

With a pipelined runtime (issue 14) the selector also gets ``arriving`` [L, E], the seconds until
each expert is usable (0 resident, > 0 in flight, inf absent). An expert in flight counts with
R_l, charged c_hit plus what remains of its wait when its layer runs (``arrival_waits``); absent
(the default), the model is exactly the one above.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specfit.interfaces import (
    ConfigError,
    CostConstants,
    CostModelBase,
    CostModelConfig,
    DraftTree,
    SearchProblem,
    evaluate,
    fit_constants,
    integer,
    load_constants,
    number,
)


@dataclass
class UnionCostModelConfig(CostModelConfig):
    name: str = "union"
    cache_aware: bool = True
    calibration: str = "auto"  # auto: the stored calibration of this setup (made on first use) | a file path
    online: bool = False  # refit the constants from the last cycles as decoding goes (provisional ones always are)
    # explicit constants (seconds) override the calibrated ones
    c0: float | None = None
    c_tok: float | None = None
    c_miss: float | None = None
    c_hit: float | None = None
    c_level: float | None = None
    c_draft0: float | None = None

    def __post_init__(self) -> None:
        for key in OVERRIDES:
            if getattr(self, key) is not None:
                number(f"cost_model.{key}", getattr(self, key), minimum=0)
        if not isinstance(self.calibration, str) or not self.calibration:
            raise ConfigError(f"cost_model.calibration={self.calibration!r} must be auto or a file path")


OVERRIDES = ("c0", "c_tok", "c_miss", "c_hit", "c_level", "c_draft0")
REQUIRED = ("c0", "c_tok", "c_miss", "c_hit")


class UnionCostModel(CostModelBase):
    name = "union"
    Config = UnionCostModelConfig

    def __init__(self, cache_aware: bool = True, calibration: str = "auto", online: bool = False,
                 constants: CostConstants | None = None, refit_every: int = 16, window: int = 256,
                 **overrides: float | None) -> None:
        unknown = set(overrides) - set(OVERRIDES)
        if unknown:
            raise ConfigError(f"cost_model: unknown constants {sorted(unknown)}")
        calibration = "auto" if calibration is None else os.fspath(calibration) if isinstance(
            calibration, os.PathLike) else calibration
        UnionCostModelConfig(calibration=calibration, **overrides)  # built in code: the config's checks too
        integer("cost_model refit_every", refit_every, minimum=1)
        integer("cost_model window", window, minimum=1)
        self.cache_aware = cache_aware
        self.calibration = calibration
        self.online = online
        self.overrides = {k: v for k, v in overrides.items() if k in OVERRIDES and v is not None}
        self._constants: CostConstants | None = None
        self.refit_every, self._recent = refit_every, deque(maxlen=window)
        self._seen = 0
        if constants is not None:
            self.set_constants(constants)

    def bind(self, spec: Any) -> None:
        """A calibration file named in code (``UnionCostModel(calibration=FILE)`` given to an Engine) is
        loaded here, as ``specfit.build`` loads it; one that does not exist yet may be where
        ``specfit calibrate`` stores the constants, so it is named only when they are needed."""
        super().bind(spec)
        if not self.calibrated and self.calibration != "auto" and Path(self.calibration).expanduser().exists():
            try:
                self.set_constants(load_constants(self.calibration))
            except ConfigError:  # damaged or old: `specfit calibrate` may be about to replace it
                pass  # (constants names the file and its fault when they are needed)

    @classmethod
    def from_config(cls, cfg: UnionCostModelConfig) -> UnionCostModel:
        return cls(cache_aware=cfg.cache_aware, calibration=cfg.calibration, online=cfg.online,
                   **{k: getattr(cfg, k) for k in OVERRIDES})

    # ------------------------------------------------------------------ constants

    def set_constants(self, constants: CostConstants) -> None:
        values = {**constants.to_json(), **self.overrides}
        for key in OVERRIDES:
            value = values.get(key, 0.0)
            if not (np.isfinite(value) and value >= 0):
                raise ConfigError(f"cost_model.{key}={value} must be a finite number of seconds >= 0")
        self._constants = CostConstants.from_json(values)

    @property
    def constants(self) -> CostConstants:
        if self._constants is None:
            if self.calibrated:  # all four constants given
                self.set_constants(CostConstants(c0=0.0, c_tok=0.0, c_miss=0.0, c_hit=0.0, source="config"))
            elif self.calibration != "auto":  # the file bind could not load: loads it now, or names its fault
                self.set_constants(load_constants(self.calibration))
            else:
                raise ConfigError("cost_model=union is not calibrated: run `specfit calibrate`, set "
                                  "cost_model.calibration=FILE, or give cost_model.c0/c_tok/c_miss/c_hit")
        return self._constants

    @property
    def calibrated(self) -> bool:
        """Constants are known: set, loaded, or all four given in the config."""
        return self._constants is not None or set(REQUIRED) <= set(self.overrides)

    # ------------------------------------------------------------------ predictions

    def problem(self, tree: DraftTree, accept: np.ndarray, resident: np.ndarray, draft_seconds: float,
                arriving: np.ndarray | None = None) -> SearchProblem:
        """The selection instance for ``tree`` (docs/method.md sections 2-3); ``arriving`` (optional,
        float [L, E] from the runtime) makes experts in flight hits plus their remaining wait."""
        c = self.constants
        layers, k = self.spec.num_layers, self.spec.top_k
        if tree.root_experts is None or (tree.experts is None and len(tree)):
            raise ConfigError("the union cost model needs predicted experts for the root and every node: "
                              "set predictor=history (or another predictor that fills tree.root_experts and tree.experts)")
        node_experts = tree.experts[: len(tree)] if tree.experts is not None else np.zeros((0, layers, k), np.int32)
        root = tree.root_experts
        wait = None
        if arriving is not None and self.cache_aware:
            resident, wait = arrival_waits(c, resident, arriving)
        return SearchProblem(
            parents=tree.parents_array(),
            accept=accept,
            node_experts=node_experts,
            root_experts=root,
            resident=resident if self.cache_aware else np.zeros_like(resident),
            c0=c.c0,
            c_tok=c.c_tok,
            c_miss=c.c_miss,
            c_hit=c.c_hit if self.cache_aware else c.c_miss,
            draft_time=draft_seconds,
            wait=wait,
        )

    def predict(self, tree: DraftTree, nodes: Sequence[int], resident: np.ndarray, draft_seconds: float,
                arriving: np.ndarray | None = None) -> float:
        """T(S) of verifying ``nodes``, in seconds (a convenience for analysis: not part of the
        CostModel contract, which the core uses through ``problem``)."""
        mask = np.zeros(len(tree), dtype=bool)
        mask[list(nodes)] = True
        problem = self.problem(tree, np.zeros(len(tree)), resident, draft_seconds, arriving=arriving)
        return evaluate(problem, mask)[1]

    def observe(self, record: Any) -> None:
        """Online refit (``online=true``, and always while the constants are provisional): re-estimate
        only what the recent cycles identify.

        A window of similar cycles cannot separate c0, c_tok and c_hit, and one without misses says
        nothing about copies; refitting those from it would make copies look free and the
        selector's trees swing. So compute constants are refitted only when the window varies in
        both tree size and experts used, the copy cost only after enough misses, and drafting
        costs are kept from the calibration. A cycle whose copies overlapped other work (prefetch,
        ``record.copies_overlap``) is fitted by the stall it measured, as the calibration does.
        """
        if not (self.online or self._constants is not None and self._constants.provisional):
            return  # refits online when asked, and always while its constants are provisional
        self._recent.append(record)
        self._seen += 1
        if self._seen % self.refit_every or len(self._recent) < 8:
            return
        window = list(self._recent)
        old = self.constants
        fitted = fit_constants(window, fallback_copy_seconds=old.c_miss - old.c_hit)
        sizes = np.array([[r.verified, r.hits + r.misses] for r in window], dtype=float)
        varied = np.linalg.matrix_rank(np.column_stack([np.ones(len(window)), sizes]), tol=1e-9) == 3
        enough_misses = sum(r.misses for r in window) >= 32
        c0, c_tok, c_hit = (fitted.c0, fitted.c_tok, fitted.c_hit) if varied else (old.c0, old.c_tok, old.c_hit)
        c_copy = (fitted.c_miss - fitted.c_hit) if enough_misses else (old.c_miss - old.c_hit)
        self._constants = CostConstants(c0=c0, c_tok=c_tok, c_miss=c_hit + c_copy, c_hit=c_hit, c_level=old.c_level,
                                        c_draft0=old.c_draft0, samples=len(window), source="online",
                                        provisional=old.provisional)


def arrival_waits(c: CostConstants, resident: np.ndarray, arriving: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(usable, wait): which experts count as hits, and the seconds each still makes its layer wait.

    An expert is usable if resident or in flight (``arriving`` finite). Layer l (of L) of the
    verification pass is taken to start ``l / L x (c0 + c_tok)`` after selection, the share of a
    root-only pass's fixed work before it (a lower bound: it leaves out the earlier layers' expert
    compute, so waits are not underestimated); an expert arriving later makes the layer wait the
    difference. A wait never exceeds one copy (c_miss - c_hit): a copy issued when the layer runs
    would queue behind it on the same link, so an expert in flight never costs more than a miss.
    """
    arriving = np.asarray(arriving, dtype=np.float64)
    if arriving.shape != np.shape(resident):
        raise ValueError(f"arriving has shape {arriving.shape}, expected {np.shape(resident)} (layers, experts)")
    if np.any(np.isnan(arriving)) or np.any(arriving < 0):
        raise ValueError("arriving must hold seconds >= 0 (inf for an absent expert)")
    usable = np.asarray(resident, dtype=bool) | np.isfinite(arriving)
    layers = arriving.shape[0]
    starts = np.arange(layers, dtype=np.float64)[:, None] * ((c.c0 + c.c_tok) / max(layers, 1))
    remaining = np.where(usable, np.nan_to_num(arriving, posinf=0.0) - starts, 0.0)
    return usable, np.clip(remaining, 0.0, max(c.c_miss - c.c_hit, 0.0))
