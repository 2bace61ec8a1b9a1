"""Reproducible runs: a sampling seed gives the same tokens on a fresh and on a reused engine, with
any method; and ``selector.draft_time=modelled`` makes every decision independent of the clock."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

import specfit
from specfit.decode import engine as engine_module
from specfit.decode import live as live_module
from specfit.decode.sampling import Sampler, SamplingParams

DEMO = Path(specfit.__file__).parent / "assets" / "demo"
PROMPT = json.loads((DEMO / "prompts.jsonl").read_text().splitlines()[0])["prompt"]
CONSTANTS = ["cost_model.c0=2e-3", "cost_model.c_tok=1e-4", "cost_model.c_miss=4e-4", "cost_model.c_hit=2e-5",
             "cost_model.c_level=1e-4"]
SAMPLING = SamplingParams(temperature=0.8, top_p=0.95, seed=11)


def build(method: str, *extra: str) -> specfit.Engine:
    presets = specfit.compose([]).method_presets
    overrides = ["model=demo", *presets[method], "cache.capacity=8", *extra]
    if "cost_model=union" in overrides:
        overrides += CONSTANTS
    return specfit.build(specfit.compose(overrides))


@pytest.fixture(scope="module")
def shared():
    """Engines reused across this module's tests (so they carry state from earlier generations)."""
    built: dict[str, specfit.Engine] = {}

    def get(method: str) -> specfit.Engine:
        if method not in built:
            built[method] = build(method)
        return built[method]

    return get


def test_a_draw_depends_on_the_seed_and_the_position_only():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    draws = [sampler.token(logits, j) for j in range(40)]
    sampler.token(logits * 2, 5)  # other draws in between change nothing
    assert [Sampler(SamplingParams(temperature=1.0, seed=3)).token(logits, j) for j in range(40)] == draws
    assert [sampler.token(logits, j) for j in range(40)] == draws
    assert len(set(draws)) > 5  # and they do vary with the position
    assert [Sampler(SamplingParams(temperature=1.0, seed=4)).token(logits, j) for j in range(40)] != draws


@pytest.mark.parametrize("method", ["eagle3", "specfit"])
def test_seeded_sampling_is_reproducible_on_fresh_and_reused_engines(shared, method):
    fresh = build(method).generate(PROMPT, 24, SAMPLING).token_ids
    engine = shared(method)
    other = engine.generate(PROMPT, 24, SamplingParams(temperature=0.8, top_p=0.95, seed=12)).token_ids
    first = engine.generate(PROMPT, 24, SAMPLING).token_ids  # a reused engine: cache, predictor and gate have state
    again = engine.generate(PROMPT, 24, SAMPLING).token_ids
    assert first == again == fresh != other


def test_seeded_sampling_gives_the_same_tokens_with_every_method(shared):
    outputs = {m: shared(m).generate(PROMPT, 24, SAMPLING) for m in ("ar", "eagle3", "chain")}
    assert outputs["eagle3"].stats["accepted_tokens"] > 0  # drafts were accepted while sampling
    assert outputs["ar"].token_ids == outputs["eagle3"].token_ids == outputs["chain"].token_ids


def _decisions(out) -> list[tuple]:
    return [(c.drafted, c.levels, c.verified, c.accepted, c.committed) for c in out.cycles]


@pytest.mark.parametrize(("draft_time", "independent"), [("modelled", True), ("measured", False)])
def test_modelled_draft_time_makes_decisions_independent_of_the_clock(monkeypatch, draft_time, independent):
    """The same run on a fast and on a slow machine (a scripted clock: every reading advances it by
    a fixed step): with modelled draft time, the specfit selector (draft gate included) decides
    exactly the same; with measured time it does not."""
    runs = []
    for step in (1e-5, 1e-1):
        ticks = itertools.count()
        clock = lambda device, step=step, ticks=ticks: step * next(ticks)  # noqa: E731
        monkeypatch.setattr(engine_module, "device_now", clock)  # the decode's times
        monkeypatch.setattr(live_module, "device_now", clock)  # the cycles' (the verifier's clock)
        engine = build("specfit", f"selector.draft_time={draft_time}")
        runs.append(_decisions(engine.generate(PROMPT, 32)))
    assert any(levels for _, levels, *_ in runs[0])  # it drafted
    assert (runs[0] == runs[1]) is independent
