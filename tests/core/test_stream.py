"""Engine.stream: each cycle's committed tokens as they are committed, the same output and stats
as generate, cancellation that leaves the engine as after a finished decode, text streamed whole."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from drafters import ScriptedDrafter

import specfit
from specfit import Engine, SamplingParams, StreamEvent
from specfit.decode.output import IncrementalDetokenizer
from specfit.errors import ConfigError
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.cost_models.union import UnionCostModel
from specfit.plugins.predictors.history import HistoryPredictor
from specfit.plugins.selectors.specfit import SpecFitSelector
from specfit.types.costs import CostConstants

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
CONSTANTS = CostConstants(c0=2e-3, c_tok=1e-4, c_miss=4e-4, c_hit=2e-5, c_level=1e-4)


def reference(n: int = 40) -> list[int]:
    with torch.no_grad():
        out = tiny_model().generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0].tolist()


def engines() -> dict[str, Engine]:
    ref = reference()
    return {
        "ar": Engine(tiny_model(), cache=LRUCache(capacity=3), device="cpu"),
        "eagle3": Engine(tiny_model(), cache=LRUCache(capacity=3), drafter=ScriptedDrafter(ref, vocab=256, seed=1),
                         device="cpu"),
        "specfit": Engine(tiny_model(), cache=LRUCache(capacity=3), drafter=ScriptedDrafter(ref, vocab=256, seed=1),
                          selector=SpecFitSelector(draft_gate=False, draft_time="modelled"), cost_model=UnionCostModel(constants=CONSTANTS),
                          predictor=HistoryPredictor(), device="cpu"),
    }


TIMES = ("seconds", "tokens_per_second", "throughput", "_ms", "tpot", "ttft", "latency")


def _untimed(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if not any(t in k for t in TIMES)}


@pytest.mark.parametrize("method", ["ar", "eagle3", "specfit"])
def test_the_stream_commits_what_generate_does_with_the_same_stats(method):
    streamed, generated = engines()[method], engines()[method]
    events = list(streamed.stream(PROMPT, max_new_tokens=24))
    out = generated.generate(PROMPT, max_new_tokens=24)
    assert all(isinstance(e, StreamEvent) for e in events)
    assert [t for e in events for t in e.token_ids] == out.token_ids == reference()[len(PROMPT):][:24]
    assert events[0].token_ids == out.token_ids[:1]  # the prefill's token comes alone, first
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    final = events[-1].output
    assert events[-1].finish_reason == final.finish_reason == out.finish_reason
    assert final.token_ids == out.token_ids and len(final.cycles) == len(out.cycles)
    assert _untimed(final.stats) == _untimed(out.stats)
    if method != "ar":  # a cycle that accepts a draft commits several tokens in one event
        assert max(len(e.token_ids) for e in events) > 1
        assert len(events) - 2 == len(out.cycles)  # the prefill's event, one per cycle, the closing one


def test_cancelling_a_stream_leaves_the_engine_as_after_a_finished_decode():
    engine = engines()["specfit"]
    fresh = engines()["specfit"]
    expected = fresh.generate(PROMPT, max_new_tokens=20)
    stream = engine.stream([7, 7, 31, 2], max_new_tokens=30)
    taken = [next(stream), next(stream)]
    assert taken[0].token_ids and taken[1].token_ids
    stream.close()  # the client went away: cancelled at the cycle boundary
    assert not engine.runtime._unsettled  # every copy settled: nothing in flight for the next decode
    with pytest.raises(StopIteration):
        next(stream)
    after = engine.generate(PROMPT, max_new_tokens=20)
    assert after.token_ids == expected.token_ids
    assert after.stats["num_prompt_tokens"] == len(PROMPT) and len(after.cycles) == after.stats["cycles"]
    abandoned = engine.stream([7, 7, 31, 2], max_new_tokens=30)
    next(abandoned)
    assert engine.generate(PROMPT, max_new_tokens=20).token_ids == expected.token_ids  # cancels the open one
    with pytest.raises(StopIteration):
        next(abandoned)


def test_a_sampled_stream_draws_what_generate_draws():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    streamed = [t for e in engines()["specfit"].stream(PROMPT, 16, params) for t in e.token_ids]
    assert streamed == engines()["specfit"].generate(PROMPT, 16, params).token_ids


def test_stream_checks_its_arguments_before_decoding():
    engine = engines()["ar"]
    with pytest.raises(ConfigError, match="max_new_tokens"):
        engine.stream(PROMPT, max_new_tokens=0)  # raised at the call, not at the first next()
    with pytest.raises(ConfigError, match="a list of 2 prompts: an engine decodes one prompt at a time"):
        engine.stream([[1, 2], [3, 4]])
    with pytest.raises(ConfigError, match="a list of 2 prompts"):
        engine.generate(["Hello", "world"])


def test_the_demo_text_streams_whole():
    engine = specfit.build(specfit.compose(["model=demo", "drafter=eagle3", "selector=eagle3"]))
    events = list(engine.stream("Question: Tom has 3 apples and buys 5 more. How many apples?\nAnswer:",
                                max_new_tokens=40))
    assert "".join(e.text for e in events) == events[-1].output.text
    assert sum(bool(e.text) for e in events) > 3  # text arrives as it is committed, not at the end


class _Bytes:
    """A byte-level tokenizer: token i is byte i, so a multi-byte character spans tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_character_split_across_tokens_is_held_back_until_whole():
    ids = list("né €".encode())  # é is 2 bytes, € 3
    text, sent = IncrementalDetokenizer(_Bytes()), []
    for i in range(1, len(ids) + 1):
        sent.append(text.add(ids[:i]))
    sent.append(text.rest(ids))
    assert "".join(sent) == "né €" and "\ufffd" not in "".join(sent)
    assert sent[1] == "" and sent[2] == "é"  # the first byte of é alone sends nothing
