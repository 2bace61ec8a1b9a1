"""The MoE layers' routers, found once, and the router probe: each layer's router applied to an
estimate of a token's state before the target runs.

The router of layer l scores experts from the residual stream after that layer's attention,
normalised by its ``post_attention_layernorm``. The probe's estimate of that state is the token's
input embedding under layer l's norm: close for the first layers, an approximation deeper down,
but specific to the token and available with no history. Results are cached per token.

Where every layer's norm is an RMSNorm and no router has a bias, the norms' scales fold into the
routers (:func:`fold_norm`) and the probe is one matmul and one top-k for all layers at once,
instead of a norm, a matmul and a top-k per layer: on the demo target (6 layers, 8 unseen tokens
a call) 350 us per call became 90. The lookahead prefetcher folds the same way, one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from specfit.interfaces import ModelError, MoESpec


@dataclass
class Router:
    """One MoE layer's router weight (and bias), the norm in front of it, and the two folded."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    norm: nn.Module  # the layer's post_attention_layernorm
    folded: torch.Tensor | None = None  # weight x the norm's scale, when the norm may be folded (see fold_norm)


def find_router(block: nn.Module, layer: nn.Module, where: str, who: str) -> Router:
    """A MoE block's router (``gate``, or gpt-oss's ``router``) and its layer's norm; a model of
    another shape is a ModelError naming ``who`` asked and ``where``."""
    router = getattr(block, "gate", None)
    if router is None:
        router = getattr(block, "router", None)
    norm = getattr(layer, "post_attention_layernorm", None)
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or norm is None:
        raise ModelError(f"{who}: cannot find the router (gate) and post_attention_layernorm of {where}")
    bias = getattr(router, "bias", None)
    return Router(weight, bias if isinstance(bias, torch.Tensor) else None, norm)


def moe_routers(model: nn.Module, spec: MoESpec, who: str) -> tuple[list[nn.Module], list[Router]]:
    """The decoder layer and the router of every MoE layer, in the runtime's layer order."""
    layers, routers = [], []
    for name in spec.module_names:
        block_name = name.rpartition(".")[0]
        layer = model.get_submodule(block_name.rpartition(".")[0])
        layers.append(layer)
        routers.append(find_router(model.get_submodule(block_name), layer, block_name, who))
    return layers, routers


def fold_norm(router: Router, hidden_size: int) -> torch.Tensor | None:
    """The router's weight with the norm's per-channel scale folded in, when that gives the same
    picks: the norm is a positive per-token factor times ``x * scale`` (RMSNorm; checked on probe
    rows) and the router has no bias, so top-k of ``x @ (weight * scale).T`` is top-k of
    ``norm(x) @ weight.T`` up to rounding (a prediction either way). One matmul instead of the
    norm's five ops; None when the norm is of another form."""
    scale = getattr(router.norm, "weight", None)
    if router.bias is not None or not isinstance(scale, torch.Tensor) or tuple(scale.shape) != (hidden_size,):
        return None
    probe = torch.randn(4, hidden_size, generator=torch.Generator().manual_seed(0)).to(scale.device)
    with torch.no_grad():
        normed = router.norm(probe.to(scale.dtype)).float()
        unscaled = probe * scale.float()
        factor = (normed * unscaled).sum(-1) / (unscaled * unscaled).sum(-1).clamp_min(1e-30)
        if not bool((factor > 0).all()) or not torch.allclose(normed, factor[:, None] * unscaled, rtol=1e-2, atol=1e-5):
            return None
        return (router.weight.float() * scale.float()).to(router.weight.dtype)


class RouterProbe:
    def __init__(self, model: nn.Module, spec: MoESpec) -> None:
        self.k, self.layers = spec.top_k, spec.num_layers
        self.embedding = model.get_input_embeddings()
        _, self.routers = moe_routers(model, spec, "router probe")
        folded = [fold_norm(r, spec.hidden_size) for r in self.routers]
        # all layers' folded routers stacked, [layers * experts, hidden] in float32 (a CPU's bf16
        # matmul is slow; the picks are a prediction): one matmul for every layer; None: per layer
        self.stacked = torch.cat(folded).float() if all(f is not None for f in folded) else None
        self._cache: dict[int, np.ndarray] = {}

    @torch.inference_mode()
    def experts(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """int32 [layers, top_k] per token: the experts each layer's router picks for the probe."""
        missing = [t for t in dict.fromkeys(tokens) if t not in self._cache]
        if missing:
            x = self.embedding(torch.tensor(missing, device=self.embedding.weight.device))
            if self.stacked is not None:
                scores = (x.to(self.stacked.dtype) @ self.stacked.T).view(len(missing), self.layers, -1)
                picks = torch.topk(scores, self.k, dim=-1).indices
            else:
                picks = torch.stack([torch.topk(_scores(r.norm(x), r.weight, r.bias), self.k, dim=-1).indices
                                     for r in self.routers], dim=1)
            for t, e in zip(missing, picks.cpu().numpy().astype(np.int32)):
                self._cache[t] = e
        return [self._cache[t] for t in tokens]


def _scores(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    scores = x.to(weight.dtype) @ weight.T
    return (scores if bias is None else scores + bias).float()
