"""Apply each MoE layer's own router to an estimate of a token's state, before the target runs.

The router of layer l scores experts from the residual stream after that layer's attention,
normalised by its ``post_attention_layernorm``. The probe's estimate of that state is the token's
input embedding under layer l's norm: close for the first layers, an approximation deeper down,
but specific to the token and available with no history. Results are cached per token.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from specfit.core.moe import MoESpec
from specfit.errors import ModelError


class RouterProbe:
    def __init__(self, model: nn.Module, spec: MoESpec) -> None:
        self.k = spec.top_k
        self.embedding = model.get_input_embeddings()
        self.routers, self.biases, self.norms = [], [], []
        for name in spec.module_names:
            block_name = name.rpartition(".")[0]
            layer_name = block_name.rpartition(".")[0]
            block, layer = model.get_submodule(block_name), model.get_submodule(layer_name)
            router = getattr(block, "gate", None)
            if router is None:
                router = getattr(block, "router", None)  # gpt-oss's name
            norm = getattr(layer, "post_attention_layernorm", None)
            if router is None or not isinstance(getattr(router, "weight", None), torch.Tensor) or norm is None:
                raise ModelError(f"router probe: cannot find the router (gate) and post_attention_layernorm of {block_name}")
            self.routers.append(router.weight)
            self.biases.append(getattr(router, "bias", None))  # gpt-oss's router has one
            self.norms.append(norm)
        self._cache: dict[int, np.ndarray] = {}

    @torch.inference_mode()
    def experts(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """int32 [layers, top_k] per token: the experts each layer's router picks for the probe."""
        missing = [t for t in dict.fromkeys(tokens) if t not in self._cache]
        if missing:
            x = self.embedding(torch.tensor(missing, device=self.embedding.weight.device))
            picks = [torch.topk(_scores(norm(x), w, b), self.k, dim=-1).indices
                     for w, b, norm in zip(self.routers, self.biases, self.norms)]
            for t, e in zip(missing, torch.stack(picks, dim=1).cpu().numpy().astype(np.int32)):
                self._cache[t] = e
        return [self._cache[t] for t in tokens]


def _scores(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    scores = x.to(weight.dtype) @ weight.T
    return (scores if bias is None else scores + bias).float()
