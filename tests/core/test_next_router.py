"""The fitted next-layer router (``prefetch.source=fitted``): the raw router before any data, the
true map once the data determine it, samples paired only within complete passes."""

from __future__ import annotations

import pytest
import torch

from specfit.core.next_router import NextLayerRouter
from specfit.core.router_probe import Router

E, H, LAYERS = 8, 16, 3  # H = 2E: the two routers' logits span the whole input, so a linear map is learnable


def routers(bias: bool = False, seed: int = 0) -> list[Router]:
    g = torch.Generator().manual_seed(seed)
    return [Router(torch.randn(E, H, generator=g), torch.randn(E, generator=g) if bias else None, torch.nn.Identity())
            for _ in range(LAYERS)]


def top4(scores: torch.Tensor) -> torch.Tensor:
    return torch.topk(scores, 4, dim=-1).indices.sort(dim=-1).values


def test_before_any_data_it_is_the_raw_router_of_the_next_layer():
    for bias in (False, True):
        rs = routers(bias)
        nr = NextLayerRouter(rs)
        x = torch.randn(5, H)
        for layer in range(LAYERS - 1):
            raw = x @ rs[layer + 1].weight.T + (rs[layer + 1].bias if bias else 0)
            torch.testing.assert_close(nr.observe(layer, x), raw)
        assert nr.observe(LAYERS - 1, x) is None


def test_it_learns_the_map_between_layers_that_the_raw_router_misses():
    """Layer l+1's input is a fixed linear map of layer l's: after a few passes the fitted
    predictions pick layer l+1's top-4 exactly, where the raw router on layer l's input does not."""
    rs = routers()
    g = torch.Generator().manual_seed(1)
    maps = [torch.randn(H, H, generator=g) for _ in range(LAYERS - 1)]

    def pass_inputs(tokens: int) -> list[torch.Tensor]:
        xs = [torch.randn(tokens, H, generator=g)]
        for m in maps:
            xs.append(xs[-1] @ m)
        return xs

    nr = NextLayerRouter(rs, ridge=1e-6)
    for _ in range(40):  # AR-like passes of one token: buffered, then folded in
        for layer, x in enumerate(pass_inputs(1)):
            nr.observe(layer, x)
    nr.observe(0, pass_inputs(64)[0])  # a pass cut short: its first layer pairs with nothing
    for layer, x in enumerate(pass_inputs(64)):  # a long pass: folded in at once
        nr.observe(layer, x)
    # 32 folded in for the first fit, the long pass's 64 at once; the other 8 still buffered
    assert nr.samples == [32 + 64] * (LAYERS - 1)
    test = pass_inputs(200)
    for layer in range(LAYERS - 1):
        truth = top4(test[layer + 1] @ rs[layer + 1].weight.T)
        fitted = (top4(nr.observe(layer, test[layer])) == truth).float().mean().item()
        raw = (top4(test[layer] @ rs[layer + 1].weight.T) == truth).float().mean().item()
        assert fitted > 0.99 and raw < 0.6, (layer, fitted, raw)


def test_it_refits_each_time_its_samples_double():
    rs = routers()
    nr = NextLayerRouter(rs, first_fit=32)
    fits = []
    for _ in range(10):
        for layer in range(LAYERS):
            nr.observe(layer, torch.randn(40, H))
        fits.append(nr.fitted_at[0])
    assert fits == [40, 80, 80, 160, 160, 160, 160, 320, 320, 320]


@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-olmoe", "tiny-mixtral", "tiny-qwen3-next", "tiny-gpt-oss"])
def test_fitted_lookahead_keeps_ar_output_and_learns_on_every_builtin_family(family):
    """Every family's routers (gpt-oss's with a bias) feed the fit; prefetches are issued and used;
    greedy output is Hugging Face's."""
    from conftest import tiny_model

    from specfit import Engine
    from specfit.plugins.caches.lru import LRUCache
    from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher
    from specfit.plugins.selectors.none import NoDraftSelector

    prompt, n = [5, 17, 99, 3, 42, 8, 120, 77] * 5, 24
    attention = {"tiny-gpt-oss": {"attn_implementation": "eager"}}.get(family, {})
    with torch.no_grad():
        expected = tiny_model(family, **attention).generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                               do_sample=False)[0, len(prompt):].tolist()
    prefetcher = LookaheadPrefetcher()
    model = tiny_model(family, **attention)
    # the fewest slots (top-k): every step misses, so there is something to prefetch
    engine = Engine(model, cache=LRUCache(capacity=model.config.num_experts_per_tok), prefetcher=prefetcher,
                    device="cpu", selector=NoDraftSelector())
    out = engine.generate(prompt, max_new_tokens=n)
    assert out.token_ids == expected
    assert out.stats["prefetch_issued"] > 0 and out.stats["prefetch_used"] > 0
    assert prefetcher.source == "fitted" and min(prefetcher.fitted.fitted_at) > 0  # the prefill gave a fit

