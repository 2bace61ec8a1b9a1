"""What a calibration (or a selector's learned state) depends on: the setup's fingerprint and its hash."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

from specfit.files import head_weights_digest


def setup_fingerprint(engine: Any) -> dict[str, Any]:
    """What the constants depend on: model, dtype, device, cache, copy engine, drafter, machine.

    ``model_head`` is the model's own EAGLE-3 head (``model.draft_head``); a drafter that uses it
    has it as its ``path``, recorded as ``head: null``; ``weights`` tells heads at one path apart."""
    model_head = engine.info.get("draft_head")
    head = engine.drafter.path
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
                    "top_k": engine.drafter.top_k, "head": None if head == model_head else head,
                    "model_head": model_head,
                    # a head retrained in place (the same path) is another setup: its acceptance differs,
                    # so the gate and estimator state stored for the old one must not carry over
                    **({"weights": weights} if weights else {}),
                    # a head's acceptance probe left unused (drafter.acceptance_probe=false) is another
                    # setup: the estimator state stored with its logits must not carry over
                    **({"acceptance_probe": False} if engine.drafter.probe_left_unused else {})},
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


def differing_keys(stored: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The top-level keys in which two setup descriptions differ (one missing counts), sorted."""
    return [key for key in sorted(set(stored) | set(here)) if stored.get(key) != here.get(key)]
