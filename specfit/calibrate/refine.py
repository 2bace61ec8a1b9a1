"""A provisional calibration refined by the runs that use it.

A calibration measured on a busy host predicts its held-out cycles poorly (:data:`POOR_FIT`). It is
stored all the same, marked provisional, so no run of the setup blocks on a full calibration
again: the cost model refits a provisional fit online from each run's timed cycles, and this
listener stores the refined constants at the end of every decode that refined them, trusted once
they predict that decode's cycles within :data:`POOR_FIT`. ``specfit calibrate`` (or
``calibration=force``) measures the setup again in full.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from specfit.calibrate.store import save_constants
from specfit.types.costs import POOR_FIT, percentage_errors
from specfit.types.stats import CycleRecord

WINDOW = 256  # the decode's last cycles the refined constants are judged on


class ProvisionalRefiner:
    """An engine listener: keeps a decode's cycles and stores what the cost model refined of a
    provisional calibration when the decode ends."""

    def __init__(self, engine: Any, path: Path) -> None:
        self.engine, self.path = engine, path
        self.cycles: deque[CycleRecord] = deque(maxlen=WINDOW)

    def cycle_ended(self, record: CycleRecord) -> None:
        self.cycles.append(record)

    def decode_ended(self) -> None:
        constants = self.engine.cost_model.constants
        cycles, self.cycles = list(self.cycles), deque(maxlen=WINDOW)
        if not constants.provisional or constants.source != "online" or len(cycles) < 8:
            return  # nothing refined yet (or trusted already): the stored fit stays as it is
        error = float(np.median(percentage_errors(constants, cycles)))
        trusted = error <= POOR_FIT
        stored = dataclasses.replace(constants, provisional=not trusted, source=str(self.path))
        report = {"cycle_time_ape_median": error, "refined_from_cycles": len(cycles), "provisional": not trusted}
        try:
            save_constants(self.path, stored, self.engine, report)
        except OSError as exc:
            print(f"specfit: could not store the refined calibration {self.path}: {exc.strerror or exc}", file=sys.stderr)
            return
        if trusted:
            print(f"specfit: the provisional calibration {self.path}, refined from this run's cycles, now predicts "
                  f"them within {error:.0%}: stored as trusted", file=sys.stderr)
            self.engine.cost_model.set_constants(stored)  # trusted from now on: no longer refitted
