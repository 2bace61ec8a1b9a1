"""The fitted next-layer router (``prefetch.source=fitted``): the raw router before any data, the
true map once the data determine it, samples paired only within complete passes."""

from __future__ import annotations

import pytest
import torch

from specfit.plugins._kit.next_router import NextLayerRouter
from specfit.plugins._kit.router_probe import Router

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
    rs = routers(bias=True)
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
        truth = top4(test[layer + 1] @ rs[layer + 1].weight.T + rs[layer + 1].bias)
        fitted = (top4(nr.observe(layer, test[layer])) == truth).float().mean().item()
        raw = (top4(test[layer] @ rs[layer + 1].weight.T + rs[layer + 1].bias) == truth).float().mean().item()
        assert fitted > 0.99 and raw < 0.6, (layer, fitted, raw)


@pytest.mark.parametrize("bias", [False, True])
def test_a_decode_step_predicts_with_the_fit_folded_in_as_a_long_pass_does_with_its_features(bias):
    """Short passes predict with one matmul (the fit folded into the projection), long passes with
    the features they compute to learn: the two agree, before and after fits."""
    rs = routers(bias=bias)
    nr = NextLayerRouter(rs, first_fit=8, batch=16)
    g = torch.Generator().manual_seed(3)
    for step in range(30):
        tokens = 20 if step % 5 == 0 else 1  # long passes (folded at once) among decode steps (buffered)
        xs = [torch.randn(tokens, H, generator=g) for _ in range(LAYERS)]
        for layer, x in enumerate(xs):
            got = nr.observe(layer, x)
            if layer + 1 < LAYERS:
                logits = torch.cat([x @ rs[layer + 1].weight.T, x @ rs[layer].weight.T], 1)
                if bias:
                    logits += torch.cat([rs[layer + 1].bias, rs[layer].bias])
                torch.testing.assert_close(got, logits @ nr.weight[layer] + nr.bias[layer], rtol=1e-4, atol=1e-4)
    assert min(nr.fitted_at) > 0 and nr.samples[0] == 6 * 20 + 16  # the buffered decode steps folded in batches


def test_it_refits_a_pair_when_its_samples_double_one_pair_a_pass():
    """Refits come when a pair's samples have doubled (at most every max_interval samples), and
    no pass refits more than one pair: no pass pays for all of them."""
    rs = [routers()[0]] * 4  # four layers: three pairs
    nr = NextLayerRouter(rs, first_fit=32, max_interval=400)
    history = []
    for _ in range(40):
        before = list(nr.fitted_at)
        for layer in range(4):
            nr.observe(layer, torch.randn(40, H))
        changed = [i for i in range(3) if nr.fitted_at[i] != before[i]]
        assert len(changed) <= 1
        for i in changed:
            assert nr.fitted_at[i] >= min(2 * max(before[i], 1), before[i] + 400) - 80  # due, then its turn came
        history.append(list(nr.fitted_at))
    fits = [sorted({h[i] for h in history}) for i in range(3)]
    assert all(len(f) >= 5 for f in fits), fits  # every pair refits, again and again
    assert all(b - a <= 400 + 3 * 40 for f in fits for a, b in zip(f[1:], f[2:])), fits  # the interval is capped


def test_a_pass_that_skips_a_layer_pairs_nothing_across_the_gap():
    rs = [routers()[0]] * 3
    nr = NextLayerRouter(rs)
    nr.observe(0, torch.randn(64, H))
    nr.observe(2, torch.randn(64, H))  # layer 1 never came: layer 0's features pair with nothing
    assert nr.samples == [0, 0]
    nr.observe(0, torch.randn(64, H))
    nr.observe(1, torch.randn(64, H))  # a long pass folds each pair as its next layer arrives
    assert nr.samples == [64, 0]
    for _ in range(3):  # short passes: buffered, counted once complete (a cut one is overwritten)
        nr.observe(0, torch.randn(4, H))
        nr.observe(1, torch.randn(4, H))
    nr.observe(0, torch.randn(4, H))
    nr.observe(1, torch.randn(4, H))
    nr.observe(2, torch.randn(4, H))
    assert nr._rows == 4


def test_a_pass_begun_where_a_cut_one_stopped_pairs_nothing_with_it():
    """A pass cut after layer 0, then another whose first call is layer 1 (as the runtime's layer
    listener could see after an error mid-pass): its rows are not paired with the cut pass's."""
    rs = routers()
    for rows in (5, 40):  # buffered and long passes
        nr = NextLayerRouter(rs)
        nr.observe(0, torch.randn(rows, H))
        nr.observe(1, torch.randn(rows + 2, H))  # another pass's tokens at the expected layer
        nr.observe(2, torch.randn(rows + 2, H))
        assert nr.samples == [0, 0] and nr._rows == 0


def test_one_nan_does_not_spoil_the_fit_and_one_layer_is_refused():
    rs = routers()
    nr = NextLayerRouter(rs, ridge=1e-6)
    bad = torch.randn(64, H)
    bad[3, 5] = float("nan")
    for layer in range(LAYERS):
        nr.observe(layer, bad)
    for _ in range(3):
        for layer in range(LAYERS):
            nr.observe(layer, torch.randn(64, H))
    assert all(torch.isfinite(w).all() for w in nr.weight) and min(nr.fitted_at) > 0
    with pytest.raises(ValueError, match="two MoE layers"):
        NextLayerRouter(rs[:1])


@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-olmoe", "tiny-mixtral", "tiny-qwen3-next", "tiny-gpt-oss"])
def test_fitted_lookahead_keeps_ar_output_and_predicts_the_next_layer_on_every_builtin_family(family):
    """Every family's routers (gpt-oss's with a bias) feed the fit; the fitted predictions of layer
    l+1 (made at layer l) pick its experts at least twice as often as chance; prefetches are
    issued and used; greedy output is Hugging Face's."""
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
    k = model.config.num_experts_per_tok
    experts = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    # the fewest slots (top-k): every step misses, so there is something to prefetch
    engine = Engine(model, cache=LRUCache(capacity=k), prefetcher=prefetcher, device="cpu", selector=NoDraftSelector())
    predicted, hits = {}, []
    observe, run_layer = prefetcher.fitted.observe, engine.runtime.run_layer

    def recording_observe(layer, hidden):
        scores = observe(layer, hidden)
        if scores is not None:
            predicted[layer + 1] = torch.topk(scores, k, dim=-1).indices
        return scores

    def scoring_run_layer(layer, hidden, top_k_index, top_k_weights, act_fn):
        guess = predicted.pop(layer, None)
        if guess is not None and top_k_index.shape[0] == 1:  # a decode step's one token
            hits.append(len(set(guess[0].tolist()) & set(top_k_index[0].tolist())) / k)
        return run_layer(layer, hidden, top_k_index, top_k_weights, act_fn)

    prefetcher.fitted.observe, engine.runtime.run_layer = recording_observe, scoring_run_layer
    out = engine.generate(prompt, max_new_tokens=n)
    assert out.token_ids == expected
    assert out.stats["prefetch_issued"] > 0 and out.stats["prefetch_used"] > 0
    assert min(prefetcher.fitted.fitted_at) > 0  # the prefill gave a fit
    assert len(hits) > n and sum(hits) / len(hits) >= 2 * k / experts, (sum(hits) / len(hits), k / experts)


def test_a_single_moe_layer_falls_back_to_own():
    from conftest import tiny_model

    from specfit import Engine
    from specfit.plugins.caches.lru import LRUCache
    from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher
    from specfit.plugins.selectors.none import NoDraftSelector

    prompt = [5, 17, 99, 3]
    with torch.no_grad():
        expected = tiny_model(num_hidden_layers=1).generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                                            do_sample=False)[0, len(prompt):].tolist()
    prefetcher = LookaheadPrefetcher()
    engine = Engine(tiny_model(num_hidden_layers=1), cache=LRUCache(capacity=2), prefetcher=prefetcher, device="cpu",
                    selector=NoDraftSelector())
    assert engine.generate(prompt, max_new_tokens=8).token_ids == expected
    # the gate's pass start, the token table's ids, the layer's pre-hook and the early one
    assert not hasattr(prefetcher, "fitted") and len(prefetcher.handles) == 4
