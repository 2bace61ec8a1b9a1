"""The router probe: all layers' folded routers in one matmul pick what each layer's norm and
router pick; a model whose routers cannot be folded (a bias) is probed layer by layer."""

import numpy as np
import torch
from conftest import tiny_model, tiny_model_with_scaled_norms

from specfit.offload.discovery import find_experts, moe_spec
from specfit.plugins._kit.router_probe import RouterProbe, _scores


def _per_layer(probe: RouterProbe, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        x = probe.embedding(torch.tensor(tokens))
        return torch.stack([torch.topk(_scores(r.norm(x), r.weight, r.bias), probe.k, dim=-1).indices
                            for r in probe.routers], dim=1).numpy()


def test_the_stacked_probe_picks_what_each_layer_picks():
    model = tiny_model_with_scaled_norms()  # a fold that drops the norms' scales is caught
    probe = RouterProbe(model, moe_spec(model, find_experts(model)))
    assert probe.stacked is not None
    tokens = list(range(model.config.vocab_size))
    got = np.stack(probe.experts(tokens))
    want = _per_layer(probe, tokens)
    assert got.shape == (len(tokens), probe.layers, probe.k)
    assert (np.sort(got, -1) == np.sort(want, -1)).all()


def test_routers_with_a_bias_are_probed_layer_by_layer():
    model = tiny_model("tiny-gpt-oss", attn_implementation="eager")
    probe = RouterProbe(model, moe_spec(model, find_experts(model)))
    assert probe.stacked is None  # a bias: scaling the input changes the top-k
    tokens = [3, 1, 4, 1, 5]
    assert (np.stack(probe.experts(tokens)) == _per_layer(probe, tokens)).all()
