"""The hybrid and sliding-window families: Qwen3-Next (Gated DeltaNet linear attention + full
attention) and gpt-oss (sliding-window + full attention, attention sinks, expert biases, clamped
SwiGLU). fp32 greedy output equals HF generate's for every cache; tree verification where it can
be exact, a one-line refusal at engine build where it cannot. Both families are documented as
supported (``SUPPORTED``, the user guide's list), so nothing here skips: a family the offload
runtime stops implementing fails every case that needs it (all of this runs on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model
from drafters import ScriptedDrafter

from specfit import Engine
from specfit.model.target import Target, cache_layer_kinds
from specfit.types.moe import SUPPORTED
from specfit.types.tree import VerifyBlock
from specfit.errors import ModelError
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache
from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77, 1, 2, 3, 4]  # longer than tiny-gpt-oss's window of 8
CACHES = {"lru": lambda: LRUCache(capacity=3), "none": lambda: NoCache(), "full": lambda: FullCache()}
ATTENTION = {"tiny-qwen3-next": "sdpa", "tiny-gpt-oss": "eager"}
FAMILIES = {"tiny-qwen3-next": "Qwen3-Next", "tiny-gpt-oss": "gpt-oss"}  # as SUPPORTED names them
_REFERENCE: dict[str, list[int]] = {}


def model(name: str) -> torch.nn.Module:
    return tiny_model(name, attn_implementation=ATTENTION[name])


def reference(name: str, n: int = 24) -> list[int]:
    """HF generate's greedy continuation (prompt included), with transformers' own caches."""
    if name not in _REFERENCE:
        with torch.no_grad():
            out = model(name).generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _REFERENCE[name] = out[0].tolist()
    return _REFERENCE[name]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_is_documented_as_supported_and_offloads(name):
    """Supported means the engine builds over it (gpt-oss: expert biases, clamped SwiGLU), never a skip."""
    assert FAMILIES[name] in SUPPORTED
    engine = Engine(model(name), cache=FullCache(), device="cpu")
    assert engine.spec.num_layers == 4


# ---------------------------------------------------------------------------------------- qwen3-next


def test_qwen3_next_cache_layers_are_linear_and_full():
    assert cache_layer_kinds(model("tiny-qwen3-next")) == ("linear", "full", "linear", "full")


@pytest.mark.parametrize("cache", list(CACHES))
def test_qwen3_next_autoregressive_matches_hf_generate(cache):
    ref = reference("tiny-qwen3-next")
    engine = Engine(model("tiny-qwen3-next"), cache=CACHES[cache](), device="cpu")
    assert engine.spec.num_layers == 4  # every decoder layer's experts are offloaded, linear or not
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == ref[len(PROMPT):]
    assert (out.stats["expert_cache_misses"] == 0) == (cache == "full")


@pytest.mark.parametrize("drafter", [lambda ref: Eagle3Drafter(top_k=3, depth=3, total_tokens=8),
                                     lambda ref: ScriptedDrafter(ref, vocab=256, depth=2)], ids=["eagle3", "scripted"])
def test_qwen3_next_refuses_speculation_at_engine_build(drafter):
    with pytest.raises(ModelError) as info:
        Engine(model("tiny-qwen3-next"), cache=LRUCache(capacity=3), drafter=drafter(reference("tiny-qwen3-next")),
               device="cpu")
    message = str(info.value)
    assert "\n" not in message
    assert "linear-attention" in message and "drafter=none" in message and "Qwen3NextForCausalLM" in message


def test_qwen3_next_target_refuses_a_tree_pass():
    """Even called directly, a multi-token block must not silently advance the recurrent state."""
    target = Target(model("tiny-qwen3-next"), _NoRouting())
    with torch.no_grad():
        target.prefill(PROMPT)
        with pytest.raises(ModelError, match="one token per pass"):
            target.verify(VerifyBlock(tokens=[1, 2], parents=[-1, 0], depths=[0, 1], nodes=[0, 1]))


# ---------------------------------------------------------------------------------------- gpt-oss


class _NoRouting:
    """The runtime as Target sees it, for checking attention and KV handling without offloading."""

    device = torch.device("cpu")

    def routing(self) -> np.ndarray:
        return np.zeros((0, 0, 0), dtype=np.int64)


def _full_logits(m: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return m(input_ids=torch.tensor([ids])).logits[0, -1]


def test_gpt_oss_cache_is_full_by_position_and_tree_mask_applies_the_window():
    """Tree verification over sliding-window layers with sinks equals a plain forward of each path,
    also after a non-first branch was kept (compaction by position) and past the window."""
    m = model("tiny-gpt-oss")
    target = Target(m, _NoRouting())
    assert target.layer_kinds == ("sliding", "full", "sliding", "full") and target.sliding_window == 8
    context = PROMPT[:-1]
    with torch.no_grad():
        target.prefill(context)
        assert {type(layer).__name__ for layer in target.cache.layers} == {"DynamicLayer"}
        root = PROMPT[-1]
        block = VerifyBlock(tokens=[root, 10, 20, 30, 40, 50], parents=[-1, 0, 0, 2, 3, 4], depths=[0, 1, 1, 2, 3, 4],
                            nodes=[0, 1, 2, 3, 4, 5])
        prefix = target.kv_len
        out = target.verify(block)
        paths = [[root], [root, 10], [root, 20], [root, 20, 30], [root, 20, 30, 40], [root, 20, 30, 40, 50]]
        for i, path in enumerate(paths):
            assert torch.allclose(out.logits[i], _full_logits(m, context + path), atol=1e-4), i
        target.keep(prefix, [0, 2, 3, 4, 5])
        context = context + paths[-1]
        out = target.verify(VerifyBlock(tokens=[60, 61, 62], parents=[-1, 0, 1], depths=[0, 1, 2], nodes=[0, 1, 2]))
        for i, path in enumerate([[60], [60, 61], [60, 61, 62]]):
            assert torch.allclose(out.logits[i], _full_logits(m, context + path), atol=1e-4), i
        # the window matters here: without it in the mask, the deepest node's logits differ
        target.sliding_window = 10**6
        target.prefill(PROMPT[:-1])
        wrong = target.verify(block)
        assert not torch.allclose(wrong.logits[5], _full_logits(m, PROMPT[:-1] + paths[-1]), atol=1e-2)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sliding_window_on_every_layer_verifies_trees_exactly(attn):
    """A model without layer_types whose every layer slides (Mixtral with a window): one windowed tree mask."""
    tiny = tiny_model("tiny-mixtral", attn_implementation=attn, sliding_window=6)
    with torch.no_grad():
        ref = tiny.generate(torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0].tolist()
    engine = Engine(tiny_model("tiny-mixtral", attn_implementation=attn, sliding_window=6), cache=LRUCache(capacity=3),
                    device="cpu", drafter=ScriptedDrafter(ref, vocab=256, branching=3, depth=3))
    assert engine.target.layer_kinds == ("sliding",) * 4
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == ref[len(PROMPT):]
    assert out.stats["spec_decode_acceptance_length"] > 1.5


def test_gpt_oss_builtin_needs_eager_attention():
    with pytest.raises(ModelError, match="model.attn_implementation=sdpa: model.builtin=tiny-gpt-oss supports eager"):
        tiny_model("tiny-gpt-oss")


@pytest.mark.parametrize("cache", list(CACHES))
def test_gpt_oss_autoregressive_matches_hf_generate(cache):
    ref = reference("tiny-gpt-oss")
    engine = Engine(model("tiny-gpt-oss"), cache=CACHES[cache](), device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == ref[len(PROMPT):]


@pytest.mark.parametrize("cache", list(CACHES))
def test_gpt_oss_tree_verification_matches_hf_generate(cache):
    ref = reference("tiny-gpt-oss")
    random_head = Engine(model("tiny-gpt-oss"), cache=CACHES[cache](), device="cpu",
                         drafter=Eagle3Drafter(top_k=3, depth=3, total_tokens=8))
    assert random_head.generate(PROMPT, max_new_tokens=16).token_ids == ref[len(PROMPT):][:16]
    scripted = Engine(model("tiny-gpt-oss"), cache=CACHES[cache](), device="cpu",
                      drafter=ScriptedDrafter(ref, vocab=256, branching=3, depth=3, seed=7))
    out = scripted.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == ref[len(PROMPT):]
    assert out.stats["spec_decode_acceptance_length"] > 1.5  # paths were accepted, so compaction ran


# ---------------------------------------------------------------------------------------- checkpoints


def test_qwen3_next_checkpoint_streams_and_decodes_like_hf(tmp_path):
    from specfit.model.config import ModelConfig
    from specfit.model.loading import load_target

    model("tiny-qwen3-next").save_pretrained(tmp_path)
    loaded = load_target(ModelConfig(path=str(tmp_path), device="cpu"))
    engine = Engine(loaded.model, cache=LRUCache(capacity=3), device="cpu", expert_store=loaded.expert_store)
    assert engine.generate(PROMPT, max_new_tokens=24).token_ids == reference("tiny-qwen3-next")[len(PROMPT):]


def test_gpt_oss_bf16_checkpoint_runs_speculation_identical_to_ar(tmp_path):
    """From bf16 weights (numerics=exact: experts stay bf16, the rest computes in float32): AR equals
    HF generate of the same weights in float32, and tree verification equals AR."""
    from specfit.model.config import ModelConfig
    from specfit.model.loading import load_target

    model("tiny-gpt-oss").to(torch.bfloat16).save_pretrained(tmp_path)
    fp32 = model("tiny-gpt-oss").to(torch.bfloat16).to(torch.float32)
    with torch.no_grad():
        expected = fp32.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    expected = expected[0, len(PROMPT):].tolist()
    cfg = ModelConfig(path=str(tmp_path), device="cpu", attn_implementation="eager")
    outputs = {}
    for name, drafter in (("ar", None), ("eagle3", Eagle3Drafter(top_k=3, depth=3, total_tokens=8)),
                          ("scripted", ScriptedDrafter(PROMPT + expected, vocab=256, branching=3, depth=3, seed=3))):
        loaded = load_target(cfg)
        assert loaded.expert_store.layers[0].dtype == torch.bfloat16
        engine = Engine(loaded.model, cache=LRUCache(capacity=3), device="cpu", expert_store=loaded.expert_store,
                        drafter=drafter)
        outputs[name] = engine.generate(PROMPT, max_new_tokens=16).token_ids
    assert outputs == {"ar": expected, "eagle3": expected, "scripted": expected}


def test_gpt_oss_checkpoint_with_sdpa_is_refused_naming_the_key(tmp_path):
    from specfit.model.config import ModelConfig
    from specfit.model.loading import load_target

    model("tiny-gpt-oss").save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"^model.attn_implementation=sdpa: GptOssForCausalLM \(model_type 'gpt_oss'\) "
                                         r"does not support sdpa attention in transformers; "
                                         r"set model.attn_implementation=eager$"):
        load_target(ModelConfig(path=str(tmp_path), device="cpu"))


@pytest.mark.parametrize("predictor", ["history", "router_probe"])
def test_gpt_oss_specfit_selector_matches_hf_generate(predictor):
    """SpecFit's cost-aware selection on gpt-oss (its router is `mlp.router`, with a bias)."""
    from specfit.types.costs import CostConstants
    from specfit.plugins.cost_models.union import UnionCostModel
    from specfit.plugins.predictors.history import HistoryPredictor
    from specfit.plugins.predictors.router_probe import RouterProbePredictor
    from specfit.plugins.selectors.specfit import SpecFitSelector

    ref = reference("tiny-gpt-oss")
    constants = CostConstants(c0=2e-3, c_tok=1e-5, c_miss=1e-5, c_hit=1e-6, c_level=1e-4)  # cheap misses: verify trees
    engine = Engine(model("tiny-gpt-oss"), cache=LRUCache(capacity=3), device="cpu",
                    drafter=ScriptedDrafter(ref, vocab=256, branching=3, depth=3, miss=0.1), selector=SpecFitSelector(),
                    cost_model=UnionCostModel(constants=constants),
                    predictor={"history": HistoryPredictor, "router_probe": RouterProbePredictor}[predictor]())
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == ref[len(PROMPT):]
    assert out.stats["spec_decode_acceptance_length"] > 1.0  # some drafted tokens were accepted
