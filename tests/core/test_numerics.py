"""``model.numerics`` (issue 13, lossless in bf16): exact keeps the experts in bf16 and computes the
rest in float32, so speculative output is identical to autoregressive output; native is bf16
throughout; float32 models are the same under both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from drafters import ScriptedDrafter

import specfit
from specfit import Engine
from specfit.model.builtin import build_builtin
from specfit.types.costs import CostConstants
from specfit.model.checkpoint import stream_checkpoint
from specfit.model.numerics import apply_numerics
from specfit.errors import ConfigError
from specfit.plugins.caches.lru import LRUCache

ASSETS = Path(specfit.__file__).parent / "assets" / "demo"
PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]


def test_numerics_is_validated_in_one_line():
    with pytest.raises(ConfigError) as info:
        specfit.compose(["model=tiny", "model.numerics=fast"])
    assert str(info.value) == "model.numerics='fast' is not one of exact, native"
    with pytest.raises(ConfigError, match="model.numerics='fast'"):
        Engine(tiny_model(), device="cpu", numerics="fast")
    assert specfit.compose(["model=tiny"]).model.numerics == "exact"


def test_demo_pair_in_bf16_exact_speculative_output_is_ar_output():
    """The demo pair loaded in bf16 with numerics=exact: EAGLE-3 and SpecFit decode exactly AR's tokens
    on held-out prompts (bf16 experts, fp32 activations, norms, router and expert sum). The demo is
    shipped in bf16, so exact computes what its float32 load computes: the same tokens (native
    differs from them on the last prompt from its 13th token)."""
    prompts = [json.loads(line)["prompt"] for line in (ASSETS / "prompts.jsonl").read_text().splitlines()]
    prompts = [prompts[0], prompts[4]]
    base = ["model=demo", "model.dtype=bfloat16", "model.numerics=exact", "model.device=cpu", "cache=lru",
            "cache.capacity=8", "max_new_tokens=32"]
    methods = {"ar": ["drafter=none"], "eagle3": ["drafter=eagle3", "selector=eagle3"],
               "specfit": ["drafter=eagle3", "selector=specfit", "cost_model=union", "predictor=history"]}
    outputs = {}
    for name, overrides in methods.items():
        engine = specfit.build(specfit.compose([*base, *overrides]), calibrate_now=False)
        if engine.cost_model is not None:
            engine.cost_model.set_constants(CostConstants(c0=2e-3, c_tok=1e-4, c_miss=4e-4, c_hit=2e-5, c_level=5e-4))
        assert (engine.info["numerics"], engine.info["expert_dtype"], engine.info["dense_dtype"]) == \
            ("exact", "bfloat16", "float32")
        assert engine.runtime.spec.dtype == torch.bfloat16
        outputs[name] = [engine.generate(p).token_ids for p in prompts]
    assert outputs["eagle3"] == outputs["ar"]
    assert outputs["specfit"] == outputs["ar"]
    fp32 = specfit.build(specfit.compose([*base, "model.dtype=float32", "drafter=none"]))
    assert [fp32.generate(p).token_ids for p in prompts] == outputs["ar"]


def test_exact_upcasts_the_dense_weights_values_unchanged_native_keeps_bf16():
    native, native_store = stream_checkpoint(str(ASSETS / "target"), "bfloat16", numerics="native", device="cpu")
    exact, exact_store = stream_checkpoint(str(ASSETS / "target"), "bfloat16", numerics="exact", device="cpu")
    assert native_store.spec.dtype == exact_store.spec.dtype == torch.bfloat16
    dense = dict(exact.named_parameters())
    for name, p in native.named_parameters():
        if ".experts." in name:
            continue
        assert p.dtype == torch.bfloat16 and dense[name].dtype == torch.float32, name
        assert torch.equal(dense[name], p.float()), name
    engine = Engine(native, expert_store=native_store, device="cpu", numerics="native")
    assert (engine.info["expert_dtype"], engine.info["dense_dtype"]) == ("bfloat16", "bfloat16")


def test_float32_is_the_same_under_both():
    models = {n: stream_checkpoint(str(ASSETS / "target"), "float32", numerics=n, device="cpu") for n in ("exact", "native")}
    (a, sa), (b, sb) = models["exact"], models["native"]
    assert all(torch.equal(x, y) for x, y in zip(sa.layers, sb.layers))
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert x.dtype == y.dtype == torch.float32 and (x.is_meta or torch.equal(x, y)), name
    model = tiny_model()
    before = {n: p.clone() for n, p in model.named_parameters()}
    apply_numerics(model, "exact")
    assert all(torch.equal(p, before[n]) and p.dtype == torch.float32 for n, p in model.named_parameters())


def test_engine_applies_exact_to_a_module_model_after_offloading():
    """A bf16 model built in code: the runtime takes its experts in bf16, then the rest becomes fp32
    (the tied embedding stays tied); speculative decoding stays identical to AR."""
    def bf16(**kw):
        return build_builtin("tiny-qwen3-moe", dtype=torch.bfloat16, tie_word_embeddings=True, **kw)

    ar = Engine(bf16(), cache=LRUCache(capacity=4), device="cpu", numerics="exact")
    assert ar.runtime.spec.dtype == torch.bfloat16
    assert ar.model.lm_head.weight is ar.model.model.embed_tokens.weight
    assert {p.dtype for p in ar.model.parameters()} == {torch.float32}
    ref = PROMPT + ar.generate(PROMPT, max_new_tokens=24).token_ids
    spec = Engine(bf16(), cache=LRUCache(capacity=4), device="cpu", numerics="exact",
                  drafter=ScriptedDrafter(ref, vocab=256, branching=3, depth=4, miss=0.1))
    out = spec.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == ref[len(PROMPT):]
    assert out.stats["spec_decode_acceptance_length"] > 1.5
    native = Engine(bf16(), cache=LRUCache(capacity=4), device="cpu", numerics="native")
    assert {p.dtype for p in native.model.parameters()} == {torch.bfloat16}
