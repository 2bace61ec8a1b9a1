"""Sampling: the same warpers as transformers, and acceptance that keeps the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model
from scipy.stats import chisquare

from specfit import Engine
from specfit.decode import acceptance
from specfit.decode.acceptance import accept
from specfit.decode.sampling import Sampler, SamplingParams
from specfit.types.tree import VerifyBlock


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6)])
def test_warpers_match_transformers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)[0]
    ours = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)).probs(logits[0])
    torch.testing.assert_close(ours, expected)


def test_sampling_is_reproducible_with_a_seed():
    engine = Engine(tiny_model(), device="cpu")
    runs = [engine.generate([1, 2, 3], 16, SamplingParams(temperature=1.0, seed=s)).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-12])
def test_a_vanishing_temperature_samples_the_argmax(temperature):
    """logits / T overflows for a tiny T; shifted by the max first, the draw is the argmax, never NaN."""
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    sampler = Sampler(SamplingParams(temperature=temperature, seed=3))
    assert sampler.probs(logits).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert {sampler.token(logits, i) for i in range(20)} == {1}


def test_stop_token_ends_generation():
    free = Engine(tiny_model(), device="cpu").generate([1, 2, 3], 12).token_ids
    stop = free[4]
    first = free.index(stop)
    engine = Engine(tiny_model(), device="cpu", stop_token_ids=[stop])
    assert engine.generate([1, 2, 3], 12).token_ids == free[: first + 1]


# --------------------------------------------------------------------------- lossless acceptance

VOCAB = 6
TARGET = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0], [0.3, 1.5, 0.0, -0.3, 0.8, 0.1], [0.0] * 6])


def _block() -> VerifyBlock:
    # root -> candidates 3, 1, 3 (a duplicate token), 5; node "1" has a child 4
    return VerifyBlock(tokens=[0, 3, 1, 3, 5, 4], parents=[-1, 0, 0, 0, 0, 2], depths=[0, 1, 1, 1, 1, 2], nodes=[0, 1, 2, 3, 4])


def _first_token_counts(trials: int, seed: int) -> np.ndarray:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    block = _block()
    logits = torch.stack([TARGET[0]] * len(block))
    counts = np.zeros(VOCAB)
    for trial in range(trials):
        sampler.position = 2 * trial  # a fresh output position: independent draws
        a = accept(block, logits, sampler)
        counts[block.tokens[a.path[0]] if a.path else a.bonus] += 1
    return counts


def _second_token_counts_after_1(trials: int, seed: int) -> np.ndarray:
    """Given the first token is 1, the next must follow the target's distribution after node "1"."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    block = _block()
    logits = torch.stack([TARGET[0], TARGET[0], TARGET[1], TARGET[0], TARGET[0], TARGET[0]])
    counts = np.zeros(VOCAB)
    for trial in range(trials):
        sampler.position = 2 * trial
        a = accept(block, logits, sampler)
        tokens = [block.tokens[p] for p in a.path] + [a.bonus]
        if tokens[0] == 1:
            counts[tokens[1]] += 1
    return counts


def _p_value(counts: np.ndarray, probs: torch.Tensor) -> float:
    expected = probs.numpy() * counts.sum()
    return chisquare(counts, expected).pvalue


@pytest.fixture
def broken_acceptance(monkeypatch, request):
    """Swap in an acceptance rule that over-accepts drafted tokens (must be detected)."""
    if request.param:
        original = acceptance._drafted
        rng = np.random.default_rng(0)

        def over_accepting(block, candidates, token):  # takes the first candidate on a mismatch a third of the time
            found = original(block, candidates, token)
            return found if found is not None or not candidates or rng.random() > 1 / 3 else candidates[0]

        monkeypatch.setattr(acceptance, "_drafted", over_accepting)
    return request.param


@pytest.mark.parametrize("broken_acceptance", [False, True], indirect=True, ids=["exact", "broken"])
def test_tree_rejection_sampling_keeps_the_target_distribution(broken_acceptance):
    trials = 6000
    p = TARGET[0].double().softmax(-1)
    q = TARGET[1].double().softmax(-1)
    first = _p_value(_first_token_counts(trials, seed=1), p)
    second = _p_value(_second_token_counts_after_1(trials, seed=2), q)
    if broken_acceptance:
        assert min(first, second) < 1e-4  # the biased acceptor is caught
    else:
        assert min(first, second) > 1e-3
