"""The drafter's features: chosen HF ``hidden_states`` of a target pass, read by hooks on only the
decoder layers that produce them.

``output_hidden_states=[...]`` gives the same tensors, but transformers then hooks every layer,
attention and router of the model (18 modules on the demo target, once asked: for good), and each
call of a hooked module takes torch's slow path. Measured on the demo pair (SpecFit with drafting
switched off against AR, 8 GSM prompts x 48 tokens, cProfile): the target's forward cost 0.29 ms a
token more with transformers' capture. A tap hooks the layers it needs (3 on the demo).

Indices follow transformers: 0 is the first decoder layer's input (the embeddings), i in 1..L-1 the
output of layer i-1, and L the decoder's final norm's output (transformers ties the last hidden
state to it). :func:`tap_for` builds a tap only where the model is of that plain shape; otherwise
the target asks transformers (``output_hidden_states``), which is always right.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn


class HiddenStateTap:
    """Forward hooks on the decoder layers (and final norm) whose outputs are the wanted features."""

    def __init__(self, layers: Sequence[nn.Module], norm: nn.Module | None, indices: Sequence[int]) -> None:
        self.indices = tuple(indices)
        self.captured: dict[int, torch.Tensor] = {}
        self.handles: list[Any] = []
        last = len(layers)
        for index in sorted(set(self.indices)):
            if index == 0:
                self.handles.append(layers[0].register_forward_pre_hook(self._keep_input(index), with_kwargs=True))
            elif index < last:
                self.handles.append(layers[index - 1].register_forward_hook(self._keep_output(index)))
            else:
                assert norm is not None, "tap_for builds a tap for index L only with a final norm"
                self.handles.append(norm.register_forward_hook(self._keep_output(index)))

    def _keep_input(self, index: int):  # noqa: ANN202 - a forward pre-hook
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.captured[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _keep_output(self, index: int):  # noqa: ANN202 - a forward hook
        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            self.captured[index] = output[0] if isinstance(output, tuple) else output
        return hook

    def clear(self) -> None:
        self.captured.clear()

    def features(self) -> torch.Tensor:
        """[tokens, len(indices) * hidden] of the pass just run (batch 1), in ``indices`` order."""
        try:
            parts = [self.captured[i][0] for i in self.indices]
        except KeyError as exc:
            raise RuntimeError(f"hidden state {exc.args[0]} was not captured by the last pass") from None
        self.captured.clear()
        return torch.cat(parts, dim=-1)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def tap_for(model: nn.Module, indices: Sequence[int]) -> HiddenStateTap | None:
    """A tap for ``indices`` when the model records its hidden states plainly (its decoder's
    ``_can_record_outputs["hidden_states"]`` is its decoder-layer class, with the layers in
    ``decoder.layers`` and, for index L, a final ``decoder.norm`` that transformers ties to the last
    hidden state); None otherwise (the caller uses ``output_hidden_states``)."""
    if not indices:
        return None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    recorded = getattr(type(decoder), "_can_record_outputs", None) or {}
    layer_class = recorded.get("hidden_states")
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or not isinstance(layer_class, type):
        return None
    if not all(isinstance(layer, layer_class) for layer in layers):
        return None
    config = decoder.config
    if getattr(config, "num_hidden_layers", None) != len(layers):
        return None
    last = len(layers)
    if any(not 0 <= i <= last for i in indices):
        return None
    norm = getattr(decoder, "norm", None)
    if last in indices and (not isinstance(norm, nn.Module) or getattr(config, "tie_last_hidden_states", None) is False):
        return None
    return HiddenStateTap(layers, norm, indices)
