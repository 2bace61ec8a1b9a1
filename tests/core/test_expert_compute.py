"""Expert compute over the slot pool: grouped and Triton against the per-expert loop (the reference)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from specfit import Engine
from specfit.offload.copy.factory import make_copy_engine
from specfit.offload.compute.factory import check_expert_compute, resolve, triton_available
from specfit.offload.discovery import find_experts, moe_spec
from specfit.offload.runtime import OffloadRuntime
from specfit.errors import ConfigError, ModelError
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache

H, I, E, K, T = 32, 16, 8, 2, 6


class Experts(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H, generator=g).to(dtype) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(E, H, I, generator=g).to(dtype) * 0.3)
        self.act_fn = nn.SiLU()


class Holder(nn.Module):
    """A model as the runtime sees one: experts modules in numbered layers and a config with top-k."""

    def __init__(self, experts: list[nn.Module], top_k: int = K) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_experts_per_tok=top_k)
        self.layers = nn.ModuleList([nn.ModuleDict({"experts": m}) for m in experts])


def runtime(experts: nn.Module, compute: str, cache=None, top_k: int = K) -> OffloadRuntime:  # noqa: ANN001
    return OffloadRuntime(Holder([copy.deepcopy(experts)], top_k), cache or FullCache(), make_copy_engine("torch", "cpu"),
                          "cpu", compute=compute)


def routing(tokens: int = T, experts: int = E, top_k: int = K, seed: int = 1, distinct: int | None = None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    if distinct is not None:  # only the first `distinct` experts are ever chosen
        logits[:, distinct:] = -1e9
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)
    return index, weights


def run(rt: OffloadRuntime, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return rt.run_layer(0, hidden, index, weights.to(hidden.dtype), nn.SiLU())


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def hidden_states(dtype: torch.dtype = torch.float32, tokens: int = T) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(2)).to(dtype)


# ---------------------------------------------------------------------------------------------- grouped


@pytest.mark.parametrize("distinct", [2, 5, E])
def test_grouped_equals_loop_bitwise_in_float32(distinct):
    experts, hidden = Experts(), hidden_states()
    index, weights = routing(distinct=distinct)
    loop = run(runtime(experts, "loop"), hidden, index, weights)
    grouped = run(runtime(experts, "grouped"), hidden, index, weights)
    assert grouped.dtype == torch.float32 and grouped.shape == (T, H)
    assert torch.equal(grouped, loop)


def test_grouped_matches_a_direct_computation():
    experts, hidden = Experts(), hidden_states()
    index, weights = routing()
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(K):
            e = int(index[t, j])
            gate, up = (hidden[t] @ experts.gate_up_proj[e].T).chunk(2)
            want[t] += weights[t, j] * ((nn.functional.silu(gate) * up) @ experts.down_proj[e].T)
    got = run(runtime(experts, "grouped"), hidden, index, weights)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)


def test_rounds_give_the_result_of_one_round():
    """Two slots for a union of up to eight experts: several admission rounds, the same output."""
    experts, hidden = Experts(), hidden_states(tokens=12)
    index, weights = routing(tokens=12)
    assert index.unique().numel() > 2
    full = run(runtime(experts, "loop"), hidden, index, weights)
    for compute in ("loop", "grouped"):
        rt = runtime(experts, compute, cache=LRUCache(capacity=2))
        assert torch.equal(run(rt, hidden, index, weights), full), compute
        assert rt.stats.misses == index.unique().numel()  # each expert loaded once, over several rounds


def test_bfloat16_rounds_do_not_change_the_result():
    """The top-k sum runs in float32 and is rounded once: how experts split into rounds cannot matter."""
    experts, hidden = Experts(torch.bfloat16), hidden_states(torch.bfloat16, tokens=12)
    index, weights = routing(tokens=12)
    full = run(runtime(experts, "grouped"), hidden, index, weights)
    assert full.dtype == torch.bfloat16
    for compute in ("loop", "grouped"):
        assert torch.equal(run(runtime(experts, compute, cache=LRUCache(capacity=2)), hidden, index, weights), full)


def test_bfloat16_sum_is_rounded_once():
    experts, hidden = Experts(torch.bfloat16), hidden_states(torch.bfloat16)
    index, weights = routing()
    got = run(runtime(experts, "grouped"), hidden, index, weights.bfloat16())
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(K):
            e = int(index[t, j])
            gate, up = nn.functional.linear(hidden[t:t + 1], experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, experts.down_proj[e])
            want[t] += y[0].float() * weights.bfloat16()[t, j].float()
    assert torch.equal(got, want.to(torch.bfloat16))


def test_bfloat16_slots_under_float32_activations():
    """numerics=exact: bf16 weights, fp32 hidden states: computed in fp32 on the upcast weights."""
    experts, hidden = Experts(torch.bfloat16), hidden_states()
    index, weights = routing()
    upcast = copy.deepcopy(experts).float()
    reference = run(runtime(upcast, "loop"), hidden, index, weights)
    for compute in ("loop", "grouped"):
        rt = runtime(experts, compute, cache=LRUCache(capacity=4))
        assert rt.slots[0].dtype == torch.bfloat16
        got = run(rt, hidden, index, weights)
        assert got.dtype == torch.float32
        assert torch.equal(got, reference), compute


def test_grouped_falls_back_where_grouped_mm_refuses():
    """float64 is refused by torch._grouped_mm: the padded-bmm fallback computes the same."""
    experts, hidden = Experts().double(), hidden_states(torch.float64)
    index, weights = routing()
    torch.testing.assert_close(run(runtime(experts, "grouped"), hidden, index, weights),
                               run(runtime(experts, "loop"), hidden, index, weights), rtol=1e-12, atol=1e-12)


def test_op_count_is_constant_in_the_number_of_experts():
    experts, hidden = Experts(), hidden_states(tokens=16)
    counts = {}
    for compute in ("loop", "grouped"):
        for distinct in (2, E):
            index, weights = routing(tokens=16, distinct=distinct)
            rt = runtime(experts, compute)
            run(rt, hidden, index, weights)  # warm
            with Ops() as ops:
                run(rt, hidden, index, weights)
            counts[compute, distinct] = ops.names
    assert len(counts["grouped", 2]) == len(counts["grouped", E]) < 40
    assert len(counts["loop", E]) > len(counts["loop", 2]) + 20  # the counter sees the loop grow
    for names in (counts["grouped", 2], counts["grouped", E]):
        # no host syncs beyond reading the routing: no .item()/.tolist() scalars, no nonzero
        assert not {"_local_scalar_dense", "nonzero", "item"} & set(names)


# ---------------------------------------------------------------------------------------------- gpt-oss


def gpt_oss_experts(seed: int = 0) -> nn.Module:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                          swiglu_limit=1.5)  # a low limit: the probes below hit the clamps
    config._experts_implementation = "eager"
    module = GptOssExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


@pytest.mark.parametrize("compute", ["loop", "grouped"])
def test_gpt_oss_experts_match_transformers(compute):
    module, hidden = gpt_oss_experts(), hidden_states()
    index, weights = routing()
    with torch.no_grad():
        want = module(hidden, index, weights)
    rt = runtime(module, compute, cache=LRUCache(capacity=3))
    assert rt.spec.layout.bias and rt.spec.layout.activation == "clamped_swiglu" and rt.spec.layout.limit == 1.5
    torch.testing.assert_close(run(rt, hidden, index, weights), want, rtol=1e-5, atol=1e-5)


def test_gpt_oss_grouped_equals_loop_bitwise():
    module, hidden = gpt_oss_experts(), hidden_states()
    index, weights = routing()
    assert torch.equal(run(runtime(module, "grouped"), hidden, index, weights),
                       run(runtime(module, "loop"), hidden, index, weights))


def test_an_unknown_gate_activation_is_refused_naming_the_module():
    module = gpt_oss_experts()

    class Odd(type(module)):  # gpt-oss's shapes and biases, another activation
        def _apply_gate(self, gate_up):  # noqa: ANN001, ANN202
            return torch.relu(gate_up[..., ::2]) * gate_up[..., 1::2]

    module.__class__ = Odd
    with pytest.raises(ModelError, match=r"experts module layers\.0\.experts \(Odd\) uses a custom gate activation"):
        find_experts(Holder([module]))
    module.__class__ = type(gpt_oss_experts())
    module.alpha = 2.5  # the clamped SwiGLU with other constants than the ones the layout would record
    assert moe_spec(Holder([module])).layout.alpha == 2.5


def test_ungated_experts_are_refused():
    module = Experts()
    module.has_gate = False
    with pytest.raises(ModelError, match=r"layers\.0\.experts .*ungated experts"):
        moe_spec(Holder([module]))


# ---------------------------------------------------------------------------------------------- triton


def _triton_interpreted():
    if not triton_available():
        pytest.skip("triton is not installed")
    from specfit.offload.compute.triton import interpreting

    if not interpreting():
        pytest.skip("TRITON_INTERPRET is not set (tests/conftest.py sets it)")


@pytest.mark.parametrize("case", ["silu", "gpt-oss", "bf16-slots", "rounds"])
def test_triton_interpreted_matches_loop(case):
    _triton_interpreted()
    experts = gpt_oss_experts() if case == "gpt-oss" else Experts(torch.bfloat16 if case == "bf16-slots" else torch.float32)
    hidden = hidden_states(tokens=20 if case == "rounds" else T)
    index, weights = routing(tokens=hidden.shape[0])
    cache = (lambda: LRUCache(capacity=2)) if case == "rounds" else FullCache
    reference = run(runtime(experts, "loop", cache=cache()), hidden, index, weights)
    got = run(runtime(experts, "triton", cache=cache()), hidden, index, weights)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_triton_rows_do_not_depend_on_the_rest_of_the_pass():
    """Batch invariance: a token computed alone equals the same token in a pass of eight (the kernel's
    reduction order is fixed; here under the interpreter, on CUDA a check for scripts/gpu_check.sh)."""
    _triton_interpreted()
    experts, hidden = Experts(), hidden_states(tokens=8)
    index, weights = routing(tokens=8)
    whole = run(runtime(experts, "triton"), hidden, index, weights)
    rt = runtime(experts, "triton")
    alone = torch.cat([run(rt, hidden[t:t + 1], index[t:t + 1], weights[t:t + 1]) for t in range(8)])
    assert torch.equal(whole, alone)


def test_triton_block_table_covers_every_row_once():
    from specfit.offload.compute.triton import block_m, block_table

    import numpy as np

    counts = np.array([0, 3, 40, 0, 17, 1])
    starts = np.cumsum(counts) - counts
    bm = block_m(counts)
    assert bm == 64 and block_m(np.array([1, 8])) == 16 and block_m(np.array([20])) == 32
    table = block_table(counts, starts, 16)
    covered = []
    for slot, start, end in zip(table["block_slot"], table["block_start"], table["block_end"]):
        assert starts[slot] <= start < end == starts[slot] + counts[slot]
        covered += [(slot, p) for p in range(start, min(start + 16, end))]
    assert sorted(p for _, p in covered) == list(range(counts.sum()))


def test_triton_on_cpu_without_the_interpreter_is_a_config_error(monkeypatch):
    if not triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="model.expert_compute=triton needs a CUDA device"):
        runtime(Experts(), "triton")


# ---------------------------------------------------------------------------------------------- selection


def test_auto_is_grouped_on_cpu_and_bad_names_are_config_errors():
    assert resolve("auto", torch.device("cpu")) == "grouped"
    assert check_expert_compute("loop") == "loop"
    with pytest.raises(ConfigError, match=r"model.expert_compute='fast' is not one of auto, grouped, loop, triton"):
        check_expert_compute("fast")


def test_engine_reports_its_expert_compute(make_model):
    engine = Engine(make_model(), device="cpu", expert_compute="loop")
    assert engine.info["expert_compute"] == "loop"
    assert Engine(make_model(), device="cpu").info["expert_compute"] == "grouped"


@pytest.mark.parametrize("arch", ["tiny-qwen3-moe", "tiny-olmoe", "tiny-mixtral"])
@pytest.mark.parametrize("compute", ["loop", "grouped"])
def test_greedy_equals_transformers_with_each_compute(arch, compute):
    """fp32 greedy identity with HF generate holds for the reference loop and the grouped compute alike
    (tests/core/test_autoregressive.py covers every cache with the default, auto)."""
    from conftest import tiny_model

    prompt = [5, 17, 99, 3, 42, 8, 120, 77]
    with torch.no_grad():
        reference = tiny_model(arch).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                              min_new_tokens=12)[0, len(prompt):].tolist()
    engine = Engine(tiny_model(arch), cache=LRUCache(capacity=3), device="cpu", expert_compute=compute)
    assert engine.generate(prompt, max_new_tokens=12).token_ids == reference
