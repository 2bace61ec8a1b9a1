"""The cycle's verifier for live decoding, and the clock live timings are read from."""

from __future__ import annotations

import time
from typing import Any, Generator

import numpy as np
import torch

from specfit.decode.cycle import CycleTimes, Verdict, target_prob
from specfit.decode.sampling import Sampler
from specfit.interfaces import Drafter, guard
from specfit.model.target import PassOutput, Target
from specfit.offload.runtime import OffloadRuntime
from specfit.types.tree import DraftTree, VerifyBlock


class LiveVerifier:
    """The cycle's verifier for live decoding: the drafter grows the tree, the target (through the
    offload runtime) verifies it, and every time is the wall clock's.

    ``vocab``: the target's vocabulary (draft tokens must be its token ids); ``copies_overlap`` and
    ``stall_measured``: how the engine's copies are timed (:class:`Verdict`)."""

    measured = True

    def __init__(self, target: Target, runtime: OffloadRuntime, drafter: Drafter, device: torch.device, *,
                 vocab: int, copies_overlap: bool, stall_measured: bool) -> None:
        self.target, self.runtime, self.drafter, self.device = target, runtime, drafter, device
        self.vocab, self.copies_overlap, self.stall_measured = vocab, copies_overlap, stall_measured
        self._result: PassOutput | None = None
        self._prefix = 0

    @property
    def extra(self) -> dict[str, Any]:
        return {}

    def now(self) -> float:
        return device_now(self.device)

    def levels(self, tree: DraftTree) -> Generator[range, None, None]:
        return guard.drafted_levels(self.drafter, tree, self.vocab)

    def draft_seconds(self, levels: int, elapsed: float, overhead: float) -> float:
        return elapsed  # everything this cycle has spent so far

    def resident(self) -> np.ndarray:
        return self.runtime.resident()

    def arriving(self) -> np.ndarray | None:
        """Seconds until each expert is usable: the runtime tracks the copies in flight."""
        return self.runtime.arriving()

    def verify(self, block: VerifyBlock) -> Verdict:
        before = self.runtime.stats.copy()
        self._prefix = self.target.kv_len
        self._result = result = self.target.verify(block)
        during = self.runtime.stats.since(before)
        return Verdict(result.routing, during.misses, during.hits, [int(u) for u in during.union_sum],
                       during.h2d_seconds, during.h2d_stall_seconds, self.copies_overlap, self.stall_measured)

    def token_after(self, block: VerifyBlock, pos: int, sampler: Sampler) -> int:
        return sampler.token(self._result.logits[pos], sampler.position + block.depths[pos])

    def token_prob(self, block: VerifyBlock, pos: int, token: int, sampler: Sampler) -> float | None:
        return target_prob(self._result.logits[pos], token, sampler)

    def keep(self, block: VerifyBlock, path: list[int], bonus: int) -> list[int]:
        self.target.keep(self._prefix, [0] + path)
        return path

    def commit(self, tokens: list[int], kept: list[int], bonus: int) -> None:
        features = self._result.features
        if features is not None and kept != list(range(len(features))):  # rows of a tree pass; a plain pass keeps its one
            features = features[kept]
        guard.call("drafter", self.drafter, "commit", tokens, features, bonus)

    def argmax(self) -> list[int]:
        return self._result.logits.argmax(dim=-1).tolist()

    def times(self, measured: CycleTimes, levels: int, verified: int, verdict: Verdict, overhead: float) -> CycleTimes:
        return measured


def device_now(device: torch.device) -> float:
    """Wall clock, after the compute stream has finished its queued work (so timings are real).
    Not the whole device: a device-wide synchronize also waits for the copy stream, so every
    prefetch issued during drafting would land before drafting went on, overlapping nothing."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()
