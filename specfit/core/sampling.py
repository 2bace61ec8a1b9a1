"""Turning target logits into tokens: greedy, or sampling with temperature, top-k and top-p.

The warpers follow transformers' order and definitions (temperature, then top-k, then top-p), so a
run samples from the same distribution as ``model.generate(do_sample=True, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfit.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"sampling.top_k={self.top_k} must be >= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Target distributions and draws, with a seeded generator for reproducible runs."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu").manual_seed(params.seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a sample is drawn from, for 1-D float logits (on the CPU, float64)."""
        p = self.params
        scores = logits.detach().to("cpu", torch.float64) / p.temperature
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

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def next_token(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return int(torch.argmax(logits))
        return self.draw(self.probs(logits))
