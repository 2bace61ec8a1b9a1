"""Stored calibrations: one JSON file per setup under ``$SPECFIT_HOME/calibration``."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from specfit.calibrate.fingerprint import (
    _costs_part,
    cost_fingerprint,
    differing_keys,
    setup_hash,
)
from specfit.errors import ConfigError
from specfit.files import read_json_object
from specfit.types.costs import FIT_VERSION, POOR_FIT, CostConstants


def calibration_dir() -> Path:
    return Path(os.environ.get("SPECFIT_HOME", Path.home() / ".cache" / "specfit")) / "calibration"


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
