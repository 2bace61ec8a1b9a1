"""The experts' only host copy: one ``[num_experts, expert_numel]`` tensor per MoE layer.

Every expert is one canonical row (:func:`specfit.types.moe.row_parts`: gate_up [2I, H] with the
gate rows first, down [H, I], then the biases when the layout has them), whatever the checkpoint's
orientation; copy engines move whole rows into device slots and the compute kernels read slots in
that one layout. A checkpoint loader writes tensors part by part (:meth:`HostExpertStore.write`)
and asks :meth:`HostExpertStore.missing` what it never wrote; built-in and in-memory models are
moved in with :meth:`HostExpertStore.from_modules`, which frees each module's weights as it goes,
so peak host memory stays about one layer above the store.

On CUDA the store is pinned (``pin=True``) so copies are true asynchronous DMA; when pinning fails
(no CUDA, a locked-memory limit) the store stays pageable and says so in one warning line.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import nn

from specfit.types.moe import MoESpec, row_parts
from specfit.offload.discovery import expert_layout
from specfit.errors import ModelError

#: What :meth:`HostExpertStore.write` accepts, and the units :meth:`HostExpertStore.missing` tracks.
PARTS = ("gate", "up", "gate_up", "down", "gate_up_bias", "down_bias")
_UNITS = {"gate": ("gate",), "up": ("up",), "gate_up": ("gate", "up"), "down": ("down",),
          "gate_up_bias": ("gate_up_bias",), "down_bias": ("down_bias",)}


def canonical(part: str, tensor: torch.Tensor, *, transposed: bool = False, interleaved: bool = False) -> torch.Tensor:
    """A checkpoint's ``gate_up``/``down`` (or bias) tensor in the store's orientation.

    ``transposed``: weights stored [.., in, out] (transformers' ``is_transposed``, gpt-oss);
    ``interleaved``: gate and up alternate along the output dimension (``is_concatenated=False``:
    gate = columns 0, 2, 4..., up = 1, 3, 5...). Works on one expert or a stack of them.
    """
    if transposed and part in ("gate_up", "down", "gate", "up"):
        tensor = tensor.transpose(-1, -2)
    if interleaved and part == "gate_up":  # [.., 2I, H]: gate rows first
        tensor = torch.cat((tensor[..., 0::2, :], tensor[..., 1::2, :]), dim=-2)
    elif interleaved and part == "gate_up_bias":  # [.., 2I]
        tensor = torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1)
    return tensor


class HostExpertStore:
    """The experts' only host copy, in canonical rows (see the module docstring)."""

    def __init__(self, spec: MoESpec, pin: bool = False, *, _allocate: bool = True) -> None:
        self.spec = spec
        self.pinned = False  # every layer allocated in pinned memory (a failure part-way leaves it False)
        # read by several engines (specfit.model.loading.share_experts): none may drop a layer's host copy
        self.shared = False
        self._pin = pin
        self._parts = row_parts(spec)
        self._units = ["gate", "up", "down"] + (["gate_up_bias", "down_bias"] if spec.layout.bias else [])
        self._written = np.zeros((spec.num_layers, spec.num_experts, len(self._units)), dtype=bool)
        self.layers: list[torch.Tensor] = [self._allocate() for _ in range(spec.num_layers if _allocate else 0)]

    def _allocate(self) -> torch.Tensor:
        shape = (self.spec.num_experts, self.spec.expert_numel)
        if self._pin:
            try:
                tensor = torch.empty(shape, dtype=self.spec.dtype, pin_memory=True)
                self.pinned = True
                return tensor
            except RuntimeError as exc:
                self._pin = self.pinned = False  # the layers after this one are pageable
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                print(f"specfit: warning: the host expert store is not pinned, copies will be slower ({reason})",
                      file=sys.stderr)
        return torch.empty(shape, dtype=self.spec.dtype)

    # ------------------------------------------------------------------ writing

    def write(self, layer: int, experts: int | slice, part: str, tensor: torch.Tensor) -> None:
        """Write one part of one expert (``experts`` an int) or of a stack (a slice, ``tensor`` [n, ...]).

        Shapes are canonical (see :func:`canonical` to get there); values are cast to the store's dtype.
        """
        spec = self.spec
        if part not in PARTS or (part.endswith("_bias") and not spec.layout.bias):
            allowed = [p for p in PARTS if spec.layout.bias or not p.endswith("_bias")]
            raise ModelError(f"expert store layer {layer}: unknown part {part!r} (expected one of {', '.join(allowed)})")
        if not 0 <= layer < spec.num_layers:
            raise ModelError(f"expert store: layer {layer} is outside 0..{spec.num_layers - 1} (part {part})")
        offset, shape = self._span(part)
        if isinstance(experts, slice):
            ids = range(spec.num_experts)[experts]
            want: tuple[int, ...] = (len(ids), *shape)
        else:
            if not 0 <= int(experts) < spec.num_experts:
                raise ModelError(f"expert store layer {layer} {part}: expert {experts} is outside 0..{spec.num_experts - 1}")
            ids, want = range(int(experts), int(experts) + 1), shape
        if tuple(tensor.shape) != want:
            raise ModelError(f"expert store layer {layer} {part}: got shape {list(tensor.shape)}, expected {list(want)}")
        numel = int(np.prod(shape))
        rows = self.layers[layer][ids.start:ids.stop:ids.step, offset:offset + numel]
        rows.unflatten(1, shape).copy_(tensor.detach().reshape(len(ids), *shape))  # strided sources: no temporary
        for unit in _UNITS[part]:
            self._written[layer, ids.start:ids.stop:ids.step, self._units.index(unit)] = True

    def _span(self, part: str) -> tuple[int, tuple[int, ...]]:
        """(offset, shape) of ``part`` inside a row; gate and up are the two halves of gate_up."""
        if part in ("gate", "up"):
            offset, (two_i, h) = self._parts["gate_up"]
            half = two_i // 2
            return offset + (half * h if part == "up" else 0), (half, h)
        return self._parts[part]

    def missing(self, limit: int | None = None) -> list[str]:
        """Parts never written, e.g. ``"layer 3 expert 17 up"`` (at most ``limit`` of them)."""
        found = []
        for layer, expert, unit in zip(*np.nonzero(~self._written)):
            found.append(f"layer {layer} expert {expert} {self._units[unit]}")
            if limit is not None and len(found) >= limit:
                break
        return found

    # ------------------------------------------------------------------ size and release

    @property
    def nbytes(self) -> int:
        """Host bytes held (0 for layers released after a full preload)."""
        return sum(t.numel() * t.element_size() for t in self.layers if t is not None)

    def release(self, layer: int) -> None:
        """Drop a layer's host copy (its experts live in device slots only from now on); a shared store
        keeps it, since the other engines still copy from it."""
        if not self.shared:
            self.layers[layer] = None  # type: ignore[call-overload]

    # ------------------------------------------------------------------ from modules

    @classmethod
    def from_modules(cls, experts: list[tuple[str, nn.Module]], spec: MoESpec, pin: bool = False) -> HostExpertStore:
        """The store of in-memory experts modules (built-in models, ``from_pretrained`` models).

        Layer by layer: the layer's host tensor is allocated, the module's weights are normalised
        into it, and the module's tensors are moved to the meta device (freed), so the peak is
        about one layer above the store.
        """
        if len(experts) != spec.num_layers:
            raise ModelError(f"expert store: {len(experts)} experts modules for a spec of {spec.num_layers} layers")
        store = cls(spec, pin, _allocate=False)
        every = slice(None)
        for layer, (name, module) in enumerate(experts):
            expert_layout(name, module)  # refuses what it cannot compute, naming the module
            store.layers.append(store._allocate())
            transposed = bool(getattr(module, "is_transposed", False))
            interleaved = not getattr(module, "is_concatenated", True)
            attrs = {"gate_up": "gate_up_proj", "down": "down_proj"}
            if spec.layout.bias:
                attrs |= {"gate_up_bias": "gate_up_proj_bias", "down_bias": "down_proj_bias"}
            with torch.no_grad():
                for part, attr in attrs.items():
                    tensor = getattr(module, attr)
                    if tensor.is_meta:
                        raise ModelError(f"experts module {name}: {attr} has no data (meta device); pass the loader's store")
                    if part == "gate_up" and interleaved:  # strided views: no de-interleaved temporary
                        weight = canonical(part, tensor, transposed=transposed)
                        store.write(layer, every, "gate", weight[:, 0::2, :])
                        store.write(layer, every, "up", weight[:, 1::2, :])
                    else:
                        store.write(layer, every, part, canonical(part, tensor, transposed=transposed, interleaved=interleaved))
            module.to("meta")  # free its weights now: the store holds the only host copy
        return store
