"""Long prompts: the EAGLE-3 head's KV buffer grows to any length, and the engine keeps every
generation inside the target's context limit (refusing prompts that do not fit, stopping with
finish_reason="length" at the limit) with output identical to autoregressive decoding."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model

import specfit
from specfit import Engine
from specfit.decode.limits import context_limit
from specfit.errors import ConfigError
from specfit.plugins.drafters.eagle3.head import KVBuffer

DEMO = Path(specfit.__file__).parent / "assets" / "demo"
CONTEXT = 2048  # the demo target's max_position_embeddings
METHODS = ["ar", "eagle3", "eagle3_nocache", "specfit", "chain", "greedy", "prefix", "ar_prefetch", "specfit_prefetch"]
# explicit cost constants: nothing is calibrated (measured) while testing
CONSTANTS = ["cost_model.c0=2e-3", "cost_model.c_tok=1e-4", "cost_model.c_miss=4e-4", "cost_model.c_hit=2e-5",
             "cost_model.c_level=1e-4"]
NEW_TOKENS = 12


def test_kv_buffer_grows_past_twice_its_capacity():
    kv = KVBuffer(kv_heads=2, head_dim=3, dtype=torch.float32, device=torch.device("cpu"))
    capacity = kv.k.shape[1]
    blocks = [torch.randn(2, n, 3) for n in (5, 3 * capacity, 1, capacity + 7, 1)]  # one block alone is > 2x capacity
    for block in blocks:
        kv.append(block, -block)
    expected = torch.cat(blocks, dim=1)
    assert kv.length == expected.shape[1] and kv.k.shape[1] >= kv.length
    torch.testing.assert_close(kv.k[:, : kv.length], expected)
    torch.testing.assert_close(kv.v[:, : kv.length], -expected)
    kv.crop(10)
    kv.append(blocks[0], blocks[0])
    torch.testing.assert_close(kv.k[:, :15], torch.cat([expected[:, :10], blocks[0]], dim=1))


# --------------------------------------------------------------------------- the demo pair, every method


@pytest.fixture(scope="module")
def engines():
    """One engine per method, built on first use and shared by every test of this module."""
    from hydra.core.global_hydra import GlobalHydra

    built: dict[str, Engine] = {}

    def get(method: str) -> Engine:
        if method not in built:
            GlobalHydra.instance().clear()
            presets = specfit.compose([]).method_presets
            overrides = ["model=demo", *presets[method], "cache.capacity=8"]
            if "cost_model=union" in overrides:
                overrides += CONSTANTS
            GlobalHydra.instance().clear()
            built[method] = specfit.build(specfit.compose(overrides))
        return built[method]

    return get


def demo_prompts() -> list[str]:
    """The demo's shipped prompts (held-out prose and GSM), as text."""
    return [json.loads(line)["prompt"] for line in (DEMO / "prompts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def long_text_ids(engines):
    """Real text (the demo prompts, repeated) of at least a full context: drafts are long and accepted."""
    tokenizer = engines("ar").tokenizer
    prompts = demo_prompts()
    ids = tokenizer("\n\n".join(prompts))["input_ids"]
    return (ids * (CONTEXT // len(ids) + 1))[:CONTEXT]


@pytest.fixture(scope="module")
def ar_outputs(engines, long_text_ids):
    return {n: engines("ar").generate(long_text_ids[:n], max_new_tokens=NEW_TOKENS) for n in (600, 2000, CONTEXT - 10)}


@pytest.mark.parametrize("prompt_tokens", [600, 2000])
def test_long_prompts_decode_as_transformers_generate(long_text_ids, ar_outputs, prompt_tokens):
    """The reference every method above is held to, AR through the offloaded runtime, is itself HF's
    greedy ``generate`` on the same weights (float32, as model=demo loads them) at long prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    prompt = torch.tensor([long_text_ids[:prompt_tokens]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[0, prompt_tokens:].tolist() == ar_outputs[prompt_tokens].token_ids


@contextmanager
def watched_verification(engine: Engine):
    """Record (prefix length, deepest block depth) of every verification pass."""
    passes: list[tuple[int, int]] = []
    original = engine.target.verify

    def verify(block):
        passes.append((engine.target.kv_len, max(block.depths)))
        return original(block)

    engine.target.verify = verify
    try:
        yield passes
    finally:
        del engine.target.verify


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("prompt_tokens", [600, 2000])
def test_long_prompts_decode_as_autoregressive(engines, long_text_ids, ar_outputs, method, prompt_tokens):
    out = engines(method).generate(long_text_ids[:prompt_tokens], max_new_tokens=NEW_TOKENS)
    assert out.token_ids == ar_outputs[prompt_tokens].token_ids
    assert len(out.token_ids) == NEW_TOKENS and out.finish_reason == "length" == out.stats["finish_reason"]
    if method == "eagle3":
        # the drafts were used: a long-context drafter state is right. At 2000 tokens only because the
        # head attends within the 256-token windows it was trained on (attention_window: it accepted
        # 0 of 12 attending to all 2000, docs/model-card.md)
        assert out.stats["accepted_tokens"] > 0
    if method.endswith("_prefetch"):  # the fitted look-ahead learned from the long prefill and prefetched
        assert out.stats["prefetch_used"] > 0 and min(engines(method).prefetcher.lookahead.fitted.fitted_at) > 0


@pytest.mark.parametrize("method", METHODS)
def test_generation_stops_at_the_context_limit(engines, long_text_ids, ar_outputs, method):
    engine = engines(method)
    prompt = long_text_ids[: CONTEXT - 10]
    with watched_verification(engine) as passes:
        out = engine.generate(prompt, max_new_tokens=NEW_TOKENS + 20)
    assert out.token_ids == ar_outputs[CONTEXT - 10].token_ids[:10]
    assert len(prompt) + len(out.token_ids) == CONTEXT and out.finish_reason == "length"
    assert all(prefix + depth < CONTEXT for prefix, depth in passes)  # no token verified past the limit
    sequence = len(prompt) + 1
    for cycle in out.cycles:  # the drafter grew no level whose tokens would lie past the limit
        assert cycle.levels <= CONTEXT - sequence
        sequence += cycle.committed
    if method in ("eagle3", "chain"):  # static selectors draft full depth: the limit must have cut a tree
        assert any(c.levels < engine.drafter.depth for c in out.cycles if c.levels)


def test_prompt_that_fills_the_context(engines, long_text_ids):
    engine = engines("eagle3")
    out = engine.generate(long_text_ids[: CONTEXT - 1], max_new_tokens=8)
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    with pytest.raises(ConfigError, match=f"prompt has {CONTEXT} tokens, but the context limit is {CONTEXT} .*max_position_embeddings"):
        engine.generate(long_text_ids[:CONTEXT], max_new_tokens=8)


def test_a_text_prompt_past_the_context_gets_one_error_not_the_tokenizers_warning(engines):
    """specfit checks the limit itself (one line naming it); the tokenizer must not warn first
    ("Token indices sequence length is longer than ... will result in indexing errors")."""
    engine = engines("ar")
    prompts = demo_prompts()
    text = "\n\n".join(prompts * 20)
    flag = "sequence-length-is-longer-than-the-specified-maximum"  # set whenever transformers would warn
    engine.tokenizer.deprecation_warnings.pop(flag, None)
    with pytest.raises(ConfigError, match="but the context limit is 2048"):
        engine.generate(text, max_new_tokens=8)
    assert flag not in engine.tokenizer.deprecation_warnings


# --------------------------------------------------------------------------- the limit's settings


def test_max_model_len_override():
    engine = Engine(tiny_model(), device="cpu", max_model_len=40)
    assert engine.max_model_len == 40
    assert len(engine.generate(list(range(1, 31)), max_new_tokens=64).token_ids) == 10
    with pytest.raises(ConfigError, match="prompt has 40 tokens, but the context limit is 40 .model.max_model_len=40"):
        engine.generate(list(range(1, 41)), max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"model.max_model_len=8192 exceeds the model's context limit 4096"):
        Engine(tiny_model(), device="cpu", max_model_len=8192)
    with pytest.raises(ConfigError, match="model.max_model_len"):
        Engine(tiny_model(), device="cpu", max_model_len=0)
    assert Engine(tiny_model(), device="cpu").max_model_len == 4096


def test_rope_scaling_extends_the_native_limit_as_vllm_derives_it():
    def limit(**rope):
        return context_limit(SimpleNamespace(max_position_embeddings=40960, rope_parameters=rope or None))

    assert limit() == 40960
    assert limit(rope_type="default", rope_theta=1e6) == 40960
    assert limit(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768) == 131072
    assert limit(rope_type="linear", factor=2.0) == 81920
    assert limit(rope_type="llama3", factor=8.0) == 40960


def test_max_model_len_from_the_config():
    engine = specfit.build(specfit.compose(["model.builtin=tiny-qwen3-moe", "model.device=cpu", "model.max_model_len=32"]))
    out = engine.generate(list(range(1, 29)), max_new_tokens=16)
    assert len(out.token_ids) == 4 and out.stats["finish_reason"] == "length"


def test_finish_reason_stop():
    free = Engine(tiny_model(), device="cpu").generate([1, 2, 3], 12)
    stop = free.token_ids[4]
    out = Engine(tiny_model(), device="cpu", stop_token_ids=[stop]).generate([1, 2, 3], 12)
    assert out.token_ids[-1] == stop and out.finish_reason == "stop" == out.stats["finish_reason"]
    assert free.finish_reason == "length"
