"""What a selector learned, kept per setup so that the next engine of the same setup starts from it.

A draft gate that must first find out whether drafting pays loses on short outputs: every new
engine pays the cycles it needs to learn. So the gate's decayed statistics and the acceptance
estimator's state (:meth:`AcceptanceEstimator.state`) are stored beside the calibration, in the
same folder (``<hash>.selector.json``), and a new engine built by :func:`specfit.build` loads them.
The hash is of the whole setup (:func:`specfit.calibrate.fingerprint.setup_fingerprint`); the
calibration's leaves out the head's weight values and its probe's use, which costs do not depend on.

The file holds sections, so selectors and estimators of one setup share it without overwriting
each other::

    {"acceptance": {"learned": {...}, "calibrated": {...}},
     "gate": {"specfit/path_prob/measured": {...}, "greedy/learned/measured": {...}}}

The gate is keyed by selector, estimator and ``draft_time``. Only selectors with ``draft_time=measured``
(the default) keep state: with ``modelled`` every decision depends on the run's inputs alone, and
a fresh engine must decide as any other would, so it starts from nothing. Saving
merges into the file and writes it atomically (:func:`specfit.files.write_atomic`) when a decode
ends, at most every ``interval`` seconds, and once more when the selector is dropped or the process
ends; never between two cycles of a decode, where its file system calls (two fsyncs: milliseconds,
more on a loaded disk) would stall the next token. When the file is written never changes a decision. Trace replay never reads or writes it: a
replay starts from scratch, so it stays exact and repeatable.
"""

from __future__ import annotations

import json
import sys
import time
import weakref
from pathlib import Path
from typing import Any

from specfit.calibrate.fingerprint import setup_fingerprint, setup_hash
from specfit.calibrate.store import calibration_dir
from specfit.errors import ConfigError
from specfit.messages import note_once

SAVE_INTERVAL = 2.0  # the least seconds between two saves (each at the end of a decode)


def state_path(engine: Any) -> Path:
    """``<calibration dir>/<setup hash>.selector.json``, the hash of the whole setup: a head or probe
    retrained in place keeps its calibration but not what the gate and estimator learned of the old one."""
    return calibration_dir() / f"{setup_hash(setup_fingerprint(engine))}.selector.json"


class StateKeeper:
    """Loads and saves one selector's gate and estimator sections of a setup's state file.

    It holds the gate and the estimator, never the selector, so a finalizer can save them after
    the selector is gone."""

    def __init__(self, path: Path, gate_key: str, gate: Any, estimator: Any, interval: float = SAVE_INTERVAL) -> None:
        self.path, self.gate_key, self.gate, self.estimator = path, gate_key, gate, estimator
        self.interval = interval
        self._last_save = time.monotonic()
        self.dirty = False  # a cycle ran since the last save
        # an estimator reading a file the user named (acceptance.state_file=FILE) keeps that file's model
        self.owns_estimator = estimator.state_file == "auto" and estimator.state() is not None

    def read(self) -> dict[str, Any]:
        """The stored sections; an unreadable or damaged file counts as none (it is rewritten)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def load(self) -> bool:
        """Start the gate and the estimator from the stored state; whether any was found."""
        data = self.read()
        found = False
        gate = data.get("gate", {}).get(self.gate_key) if isinstance(data.get("gate"), dict) else None
        if self.gate is not None and isinstance(gate, dict):
            self.gate.load_state(gate)
            found = True
        sections = data.get("acceptance") if isinstance(data.get("acceptance"), dict) else {}
        stored = sections.get(self.estimator.name)
        if self.owns_estimator and isinstance(stored, dict):
            self.estimator.load_state(stored)
            found = True
        return found

    def cycle_ended(self, record: Any = None) -> None:
        """A cycle finished: there is something to save (at the end of the decode)."""
        self.dirty = True

    def decode_ended(self) -> None:
        """A decode ended: save when ``interval`` seconds passed since the last save."""
        if self.dirty and time.monotonic() - self._last_save >= self.interval:
            self.save()

    def save(self) -> None:
        """Merge this selector's sections into the file, atomically. A failure is one line on
        stderr, never an error: decoding does not depend on it."""
        from specfit.files import write_atomic

        if not self.dirty:
            return
        self._last_save, self.dirty = time.monotonic(), False
        data = self.read()
        if self.gate is not None:
            data.setdefault("gate", {})[self.gate_key] = self.gate.state()
        if self.owns_estimator:
            data.setdefault("acceptance", {})[self.estimator.name] = self.estimator.state()
        try:
            write_atomic(self.path, json.dumps(data, indent=1) + "\n")
        except OSError as exc:
            print(f"specfit: could not save the selector's state to {self.path}: {exc.strerror or exc}", file=sys.stderr)
        except (TypeError, ValueError) as exc:  # a plug-in estimator's state() that is not JSON
            print(f"specfit: acceptance '{self.estimator.name}' state() is not JSON ({exc}); not saved", file=sys.stderr)


def attach_setup_state(engine: Any) -> StateKeeper | None:
    """Start ``engine``'s selector from this setup's stored state and keep saving what it learns.

    Only selectors with a draft gate or an acceptance estimator (the cost-aware ones) have state;
    others are left alone (None). So is a selector with ``draft_time=modelled``: its decisions are
    meant to depend on its inputs alone (the same run decides the same anywhere), which state
    carried over from earlier runs would break; it starts fresh."""
    selector = engine.selector
    estimator = selector.estimator
    if estimator is None or not selector.takes_estimator or selector.draft_time != "measured":
        return None
    # what drafting earns depends on what is verified: the selector and its estimator name the gate's section
    keeper = StateKeeper(state_path(engine), f"{selector.name}/{estimator.name}/{selector.draft_time}",
                         selector.gate, estimator)
    if keeper.gate is None and not keeper.owns_estimator:
        return None
    keeper.load()
    engine.add_listener(keeper)  # told of each cycle and decode: saves at a decode's end
    weakref.finalize(selector, keeper.save)
    return keeper


def note_state_file_setup(selector: Any, here: dict[str, Any] | None) -> None:
    """An acceptance model the user named (``acceptance.state_file=FILE``) that was fitted on a
    trace of another target or head (``here``: this run's :func:`specfit.calibrate.fingerprint.acceptance_setup`,
    None when unknown) is used as given, but never silently: its estimates are about that setup."""
    from pathlib import Path

    from specfit.calibrate.fingerprint import differing_keys
    from specfit.files import read_json_object

    source = selector.estimator.state_file if selector.estimator is not None else "auto"
    if here is None or source == "auto" or not isinstance(source, str) or not Path(source).expanduser().is_file():
        return  # a missing file or a directory: the estimator's own load names it, with its hint
    stored = read_json_object(Path(source).expanduser(), f"acceptance.state_file={source}", ConfigError).get("setup")
    if not isinstance(stored, dict):
        return  # fitted on a trace that did not record its setup (before 2026-12-07): nothing to compare
    differs = differing_keys(stored, here)
    if differs:
        verb = "differ" if len(differs) > 1 else "differs"
        note_once(f"acceptance.state_file={source} was fitted on a trace of another setup (its "
                  f"{' and '.join(differs)} {verb} from this run's); its model is used as given")
