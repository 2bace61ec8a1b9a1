"""The target model's forward passes: prefill, tree verification, and KV compaction.

The KV cache holds every committed token except the newest (the root of the next draft tree).
A verification pass appends the root and the chosen nodes with a tree mask (each node attends to
the prefix, its ancestors and itself) at positions ``prefix + depth``; afterwards only the root and
the accepted path are kept.

Every attention layer keeps a full cache indexed by absolute position, so that compaction moves
entries by position: a sliding-window layer (gpt-oss) gets a full cache too, and the window is
applied by its mask instead (the tree mask per layer type). Linear-attention layers (qwen3_next's
Gated DeltaNet) carry a recurrent state that a tree pass cannot roll back per token: such models
decode autoregressively only (drafter=none), refused at engine build otherwise.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer,
                                      get_layer_types_and_kwargs)

from specfit.model.features import HiddenStateTap, tap_for
from specfit.offload.runtime import OffloadRuntime
from specfit.types.tree import VerifyBlock
from specfit.errors import ModelError

TREE_ATTENTION = ("sdpa", "eager")


@dataclass
class PassOutput:
    logits: torch.Tensor  # float32 [tokens, vocab]
    features: torch.Tensor | None  # [tokens, len(feature_layers) * hidden] for the drafter
    routing: np.ndarray  # int [tokens, moe_layers, top_k], experts each token was routed to


class Target:
    """Wraps an offloaded HF causal LM for the decode loop."""

    def __init__(self, model: nn.Module, runtime: OffloadRuntime) -> None:
        self.model = model
        self.runtime = runtime
        self.device = runtime.device
        self._feature_layers: tuple[int, ...] = ()
        self._tap: HiddenStateTap | None = None
        self.cache: DynamicCache | None = None
        impl = getattr(model.config, "_attn_implementation", "eager")
        if impl not in TREE_ATTENTION:
            raise ModelError(f"model.attn_implementation={impl!r}: tree verification needs one of {TREE_ATTENTION}")
        self.attn_implementation = impl
        # transformers 5.2x renames `past_key_values` to `cache`; use whichever this model takes.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.layer_kinds = cache_layer_kinds(model)
        self.recurrent = "linear" in self.layer_kinds  # a state per layer that no tree pass can roll back
        self.sliding_window: int | None = None
        if "sliding" in self.layer_kinds:
            self.sliding_window = int(model.config.sliding_window)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """HF ``hidden_states`` indices each pass returns as the drafter's features (empty: none)."""
        return self._feature_layers

    @feature_layers.setter
    def feature_layers(self, indices: Sequence[int]) -> None:
        if self._tap is not None:
            self._tap.remove()
        self._feature_layers = tuple(indices)
        self._tap = tap_for(self.model, self._feature_layers)  # None: transformers' output_hidden_states

    @property
    def config(self):  # noqa: ANN201 - the HF config
        return self.model.config

    def check_drafter(self, name: str, depth: int) -> None:
        """At engine build: a drafter that proposes tokens needs tree verification, which a recurrent
        (linear-attention) layer cannot do exactly; refuse it here rather than mid-decode."""
        if self.recurrent and depth > 0:
            raise ModelError(f"drafter={name}: {type(self.model).__name__} has linear-attention layers, whose "
                             "recurrent state tree verification cannot roll back per token; use drafter=none "
                             "(autoregressive)")

    def reset(self) -> None:
        cache = DynamicCache(config=self.model.config)
        for i, kind in enumerate(self.layer_kinds):
            if kind == "sliding":  # every position stays, by position; the sliding mask applies the window
                cache.layers[i] = DynamicLayer()
        self.cache = cache

    @property
    def kv_len(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    def prefill(self, ids: Sequence[int]) -> PassOutput:
        """The prompt; only its last position's logits are kept (a long prompt's would be large)."""
        self.reset()
        input_ids = torch.tensor([list(ids)], device=self.device)
        return self._forward(input_ids, position_ids=None, mask=None, last_logits_only=True)

    def verify(self, block: VerifyBlock) -> PassOutput:
        if self.recurrent and len(block) > 1:  # refused at build (check_drafter); never corrupt the state
            raise ModelError(f"{type(self.model).__name__} has linear-attention layers: it verifies one token per pass")
        prefix = self.kv_len
        input_ids = torch.tensor([block.tokens], device=self.device)
        positions = torch.tensor([[prefix + d for d in block.depths]], device=self.device)
        mask = None if len(block) == 1 else self._tree_mask(prefix, block)
        return self._forward(input_ids, positions, mask)

    def keep(self, prefix: int, block_positions: Sequence[int]) -> None:
        """After verifying a block on top of ``prefix`` cached tokens, keep only these block positions.

        Moves the kept entries down in place and crops the rest: O(block), not O(context)."""
        kept = list(block_positions)
        if kept != list(range(len(kept))):
            src = torch.tensor([prefix + p for p in kept], device=self.device)
            dst = torch.arange(prefix, prefix + len(kept), device=self.device)
            for layer in self.cache.layers:
                layer.keys[..., dst, :] = layer.keys[..., src, :]
                layer.values[..., dst, :] = layer.values[..., src, :]
        drop = self.kv_len - (prefix + len(kept))
        if drop > 0:
            self.cache.crop(-drop)

    def _tree_mask(self, prefix: int, block: VerifyBlock) -> torch.Tensor | dict[str, torch.Tensor]:
        t = len(block)
        allowed = torch.ones(t, prefix + t, dtype=torch.bool)
        allowed[:, prefix:] = torch.from_numpy(block.ancestor_mask())
        if self.sliding_window is None:
            return self._mask_tensor(allowed)
        # transformers 5 models take a mask per layer type; a sliding layer also drops keys
        # `sliding_window` or more positions behind the query (as its causal mask does)
        depths = torch.tensor(list(block.depths))
        key_pos = torch.cat([torch.arange(prefix), prefix + depths])
        query_pos = prefix + depths
        in_window = (query_pos[:, None] - key_pos[None, :]) < self.sliding_window
        layer_types = getattr(self.model.config, "layer_types", None)
        if not layer_types:  # one kind of layer (Mixtral with a window): one mask
            return self._mask_tensor(allowed & in_window)
        masks = {"full_attention": self._mask_tensor(allowed),
                 "sliding_attention": self._mask_tensor(allowed & in_window)}
        return {kind: masks[kind] for kind in set(layer_types)}

    def _mask_tensor(self, allowed: torch.Tensor) -> torch.Tensor:
        allowed = allowed[None, None].to(self.device)
        if self.attn_implementation == "sdpa":
            return allowed
        dtype = self.model.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(~allowed, torch.finfo(dtype).min)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, mask: torch.Tensor | dict | None,
                 last_logits_only: bool = False) -> PassOutput:
        want_features, tap = bool(self.feature_layers), self._tap
        cached = self.kv_len
        if tap is not None:
            tap.clear()
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            # only the layers needed (a tap hooks just those; see specfit.model.features)
            output_hidden_states=sorted(set(self.feature_layers)) if want_features and tap is None else False,
            logits_to_keep=1 if last_logits_only else 0,
            **{self._cache_kwarg: self.cache},
        )
        logits = out.logits[0].float()
        # NaN/inf weights would otherwise decode garbage (argmax of NaN) and end quietly: one sync per pass
        if not bool(torch.isfinite(logits).all()):
            raise self._non_finite(cached, input_ids, position_ids, mask, last_logits_only)
        features = None
        if tap is not None:
            features = tap.features()
        elif want_features:
            features = torch.cat([out.hidden_states[i][0] for i in self.feature_layers], dim=-1)
        return PassOutput(logits=logits, features=features, routing=self.runtime.routing())

    def _non_finite(self, cached: int, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                    mask: torch.Tensor | dict | None, last_logits_only: bool) -> ModelError:
        """Name the module that first produced NaN/inf, by re-running the failed pass with hooks.

        Only on this error path: the hooks cost a sync per layer. The pass is rerun on the cache as
        it was before (the failed pass's entries are cropped), so it sees exactly the same inputs."""
        model = self.model
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
        watched: list[tuple[str, nn.Module]] = []
        if getattr(decoder, "embed_tokens", None) is not None:
            watched.append(("the token embeddings", decoder.embed_tokens))
        for i, layer in enumerate(getattr(decoder, "layers", ())):
            watched.append((f"decoder layer {i}", layer))
        if getattr(decoder, "norm", None) is not None:
            watched.append(("the final norm", decoder.norm))
        if model.get_output_embeddings() is not None:
            watched.append(("the output head", model.get_output_embeddings()))
        names = {id(m): n for n, m in model.named_modules()}
        first: list[str] = []

        def hook(label: str, module: nn.Module):  # noqa: ANN202
            def check(_module: nn.Module, _args: object, output: object) -> None:
                tensor = output[0] if isinstance(output, (tuple, list)) else output
                if not first and isinstance(tensor, torch.Tensor) and tensor.is_floating_point() \
                        and not bool(torch.isfinite(tensor).all()):
                    first.append(f"{label} ({names.get(id(module), type(module).__name__)})")
            return check

        handles = [m.register_forward_hook(hook(label, m)) for label, m in watched]
        try:
            if cached and self.recurrent:
                raise RuntimeError("a recurrent state cannot be cropped back: no rerun")
            if cached:
                self.cache.crop(cached - self.kv_len)  # (crop takes a negative count in this transformers)
            else:
                self.reset()
            self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                       logits_to_keep=1 if last_logits_only else 0, **{self._cache_kwarg: self.cache})
        except Exception:  # noqa: BLE001 - the diagnosis must not hide the error it diagnoses
            pass
        finally:
            for handle in handles:
                handle.remove()
        where = first[0] if first else "an unhooked module"
        source = getattr(model.config, "_name_or_path", "")  # the checkpoint directory, when loaded from one
        name = f"model.path={source}: {type(model).__name__}" if source else type(model).__name__
        return ModelError(f"{name} produced non-finite logits (NaN or inf): {where} first produced non-finite "
                          "values; check the checkpoint's weights (and model.dtype: float16 can overflow)")


def cache_layer_kinds(model: nn.Module) -> tuple[str, ...]:
    """Per decoder layer, the cache transformers gives it: "full" (keys and values by position),
    "sliding" (a window of them) or "linear" (a recurrent state). Anything else is refused."""
    layer_types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    kinds = []
    for layer_type, layer in zip(layer_types, DynamicCache(config=model.config).layers):
        if type(layer) is DynamicLayer:
            kinds.append("full")
        elif type(layer) is DynamicSlidingWindowLayer and layer_type == "sliding_attention":
            kinds.append("sliding")
        elif type(layer) is LinearAttentionLayer:
            kinds.append("linear")
        else:
            raise ModelError(f"{type(model).__name__} has {layer_type} layers ({type(layer).__name__} caches), which "
                             "specfit does not support (full, sliding-window and linear-attention layers are)")
    return tuple(kinds)
