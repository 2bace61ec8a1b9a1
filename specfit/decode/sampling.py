"""Turning target logits into tokens: greedy, or sampling with temperature, top-k and top-p.

The warpers follow transformers' order and definitions (temperature, then top-k, then top-p), so a
run samples from the same distribution as ``model.generate(do_sample=True, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specfit.errors import ConfigError
from specfit.validation import integer, number


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next tokens are drawn: greedy (``temperature=0``, the default), else from
    the distribution at ``temperature``, then top-k, then top-p (as in HF), reproducibly from
    ``seed``. Speculative decoding keeps exactly this distribution (the acceptance rule)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        """Bad values fail here, naming the key, not as a NaN distribution or a torch error mid-run."""
        number("sampling.temperature", self.temperature, minimum=0)  # 0 is greedy
        if not 0 < number("sampling.top_p", self.top_p) <= 1:
            raise ConfigError(f"sampling.top_p={self.top_p!r} must be in (0, 1]")
        integer("sampling.top_k", self.top_k, minimum=0)  # 0 disables it
        integer("sampling.seed", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Target distributions and draws, reproducible from ``params.seed`` alone.

    The draw of output token ``j`` (0: the first generated token) uses one uniform number that is a
    function of (seed, j) only, not a shared generator's state. What a run drafted, verified or
    decoded before therefore changes nothing: a seeded generation gives the same tokens on a fresh
    or a reused engine, with any drafter, selector, cache or timing (given the same logits).
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        # output index of the token after the current draft root; the decode loop sets it each cycle
        self.position = 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a sample is drawn from, for 1-D float logits (on the CPU, float64)."""
        p = self.params
        scores = logits.detach().to("cpu", torch.float64)
        # shifted by the max first: a tiny temperature then sends the others to -inf, never inf - inf (NaN)
        scores = (scores - scores.max()) / p.temperature
        if p.top_k > 0:
            k = min(p.top_k, scores.numel())
            scores = scores.masked_fill(scores < torch.topk(scores, k).values[-1], -torch.inf)
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=False)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            remove = cumulative <= (1 - p.top_p)
            remove[-1] = False  # keep at least one token
            scores = scores.masked_fill(remove.scatter(0, order, remove), -torch.inf)
        return scores.softmax(-1)

    def uniform(self, index: int) -> float:
        """The uniform number in [0, 1) of output token ``index`` under this seed."""
        return float(np.random.default_rng([self.params.seed % 2**64, index]).random())

    def token(self, logits: torch.Tensor, index: int) -> int:
        """Output token ``index`` from the target's logits: the argmax, or an inverse-CDF draw."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = self.probs(logits)
        cdf = probs.cumsum(0)
        u = torch.tensor([self.uniform(index) * float(cdf[-1])], dtype=cdf.dtype)
        chosen = int(torch.searchsorted(cdf, u, right=True))
        if chosen >= probs.numel():  # round-off at the top end: the last token that can be drawn
            chosen = int(torch.nonzero(probs).max())
        return chosen
