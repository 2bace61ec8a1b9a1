"""The EAGLE-3 draft head: Llama-style decoder layers over [embedding ; fused target features].

Weight names follow the public layout (EAGLE-3, SpecForge, SGLang): ``fc``, ``midlayer.*`` (the
first layer), ``layers.<i>.*`` (further layers, when ``num_hidden_layers`` > 1), ``norm``,
``lm_head``, ``d2t`` and ``t2d``; optionally ``embed_tokens`` and ``fc_norm.<i>`` / ``input_norm``.
A head without ``embed_tokens`` or ``lm_head`` uses the target's (as vLLM does).

One step maps (hidden h_t, token x_{t+1}) at position t to a new hidden, whose logits predict
x_{t+2}; h_t is ``fc`` of the target's features for committed tokens (several layers' hidden
states, or only the last one when ``use_aux_hidden_state`` is false), and the head's own previous
output inside the draft tree. The first layer reads [norm(embedding) ; norm(h)] (2H wide); further
layers are plain pre-norm decoder layers over H (vLLM's ``llama_eagle3`` and ``speculators``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specfit.interfaces import ModelError


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"
    fc_bias: bool = False
    # the target layers whose hidden states are fused; HF ``hidden_states`` index = id + aux_layer_offset
    # (SGLang / SpecForge count layer outputs: offset 1; vLLM / speculators count layer inputs: offset 0)
    aux_layer_ids: list[int] | None = None
    aux_layer_offset: int = 1
    num_hidden_layers: int = 1
    use_aux_hidden_state: bool = True  # False: no fc, the head reads the target's last hidden state
    fc_norm: bool = False  # an RMSNorm on each fused feature before fc (EAGLE-3.1: SpecForge, speculators)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc (speculators)
    norm_before_residual: bool = False  # the first layer's residual is the normed hidden, not the raw one
    norm_output: bool = True  # SpecForge's flag: the final norm before lm_head (False: none)
    feed_normed: bool = False  # speculators' norm_output: the normed hidden is also what the next step reads
    qk_norm: bool = False  # Qwen3 decoder layers (speculators' qwen3 layer config): RMSNorm on each head's q and k
    # the longest window of positions the head was trained on (specfit's trainer writes its seq_len);
    # drafting attends to at most this many latest positions (see Eagle3Head.forward). None: unknown
    attention_window: int | None = None

    @property
    def num_aux(self) -> int:
        """How many target hidden states the head fuses (1: the last, when use_aux_hidden_state is false)."""
        if not self.use_aux_hidden_state:
            return 1
        return len(self.aux_layer_ids) if self.aux_layer_ids else 3


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, in_features: int) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(in_features, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(in_features, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(in_features, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The first layer (``first``) attends over [embedding ; hidden] (2H) and has a ``hidden_norm``;
    later ones are plain pre-norm Llama layers over H."""

    def __init__(self, cfg: Eagle3Config, first: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, (2 if first else 1) * cfg.hidden_size)
        self.mlp = MLP(cfg)


MidLayer = DecoderLayer  # the public name of the first layer's weights (``midlayer.*``)


class KVBuffer:
    """One layer's KV cache: [kv_heads, positions, head_dim], grown on demand, cropped after drafting."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.empty(kv_heads, 256, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        if self.length + n > self.k.shape[1]:
            self._grow(self.length + n)
        self.k[:, self.length : self.length + n] = k
        self.v[:, self.length : self.length + n] = v
        self.length += n

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def _grow(self, needed: int) -> None:
        """Reallocate to at least ``needed`` positions, doubling so appends stay amortised O(1)."""
        capacity = self.k.shape[1]
        while capacity < needed:
            capacity *= 2
        heads, _, dim = self.k.shape
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(heads, capacity, dim)
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)


class HeadCache:
    """The KV caches of every layer of a head; all hold the same positions."""

    def __init__(self, layers: list[KVBuffer]) -> None:
        self.layers = layers

    @property
    def length(self) -> int:
        return self.layers[0].length

    def crop(self, length: int) -> None:
        for kv in self.layers:
            kv.crop(length)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, target_embedding: nn.Embedding | None = None) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.cfg = cfg
        features = cfg.num_aux * cfg.target_hidden_size
        self.fc = nn.Linear(features, cfg.hidden_size, bias=cfg.fc_bias) if cfg.use_aux_hidden_state else None
        self.input_norm = RMSNorm(features, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
                        if cfg.fc_norm else None)
        self.midlayer = DecoderLayer(cfg, first=True)
        # further layers keep their public index: layers.1, layers.2, ...
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, first=False) for i in range(1, cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None  # own embedding, when the checkpoint has one
        object.__setattr__(self, "_target_embedding", target_embedding)  # shared, not owned
        object.__setattr__(self, "_target_lm_weight", None)  # the target's lm_head rows, when lm_head is None
        rope_cfg = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                               head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                               rope_parameters=dict(cfg.rope_parameters))
        self.rotary = LlamaRotaryEmbedding(rope_cfg)

    # ------------------------------------------------------------------ the target's shared tensors

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self._target_embedding
        if table is None:
            raise ModelError("the EAGLE-3 head has no embed_tokens and no target embedding was given")
        return table(tokens)

    def set_target_embedding(self, embedding: nn.Embedding) -> None:
        if embedding.weight.shape[1] != self.cfg.hidden_size and self.embed_tokens is None:
            raise ModelError(f"the target's embedding width {embedding.weight.shape[1]} differs from the head's "
                             f"hidden_size {self.cfg.hidden_size}, and the head has no embed_tokens of its own")
        object.__setattr__(self, "_target_embedding", embedding)

    def set_target_lm_head(self, lm_head: nn.Module) -> None:
        """Use the target's output rows of the draft vocabulary (a head saved without ``lm_head``).

        Draft token i is target token i + d2t[i] (all of them for a full-vocabulary head, which then
        shares the target's weight); the rows are cast to the head's dtype once, here."""
        weight = getattr(lm_head, "weight", None)
        if weight is None or weight.dim() != 2 or weight.shape[1] != self.cfg.hidden_size:
            shape = None if weight is None else tuple(weight.shape)
            raise ModelError(f"the EAGLE-3 head has no lm_head and the target's output head (weight {shape}) does not "
                             f"map its hidden_size {self.cfg.hidden_size} to the vocabulary")
        dtype = self.midlayer.self_attn.q_proj.weight.dtype
        if self.cfg.draft_vocab_size == weight.shape[0] and not bool(self.d2t.any()):
            rows = weight.detach()
        else:
            ids = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
            rows = weight.detach()[ids.to(weight.device)]
        object.__setattr__(self, "_target_lm_weight", rows.to(dtype))

    # ------------------------------------------------------------------ pieces

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Fused target features [T, num_aux * target_hidden] -> head hidden [T, hidden]."""
        if self.fc is None:  # use_aux_hidden_state: false, the target's last hidden state as it is
            return features
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of head outputs."""
        if self.cfg.norm_output and not self.cfg.feed_normed:  # fed-back outputs are normed already
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self._target_lm_weight is None:
            raise ModelError("the EAGLE-3 head has no lm_head and no target output head was given")
        return F.linear(hidden, self._target_lm_weight)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def new_cache(self, dtype: torch.dtype, device: torch.device) -> HeadCache:
        """Empty KV caches, one per layer."""
        return HeadCache([KVBuffer(self.cfg.num_key_value_heads, self.cfg.head_dim, dtype, device)
                          for _ in range(self.cfg.num_hidden_layers)])

    # ------------------------------------------------------------------ one step

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: projected target features or the head's own outputs
        tokens: torch.Tensor,  # [T] target token ids
        positions: torch.Tensor,  # [T]
        kv: KVBuffer | HeadCache | None = None,  # a KVBuffer only for a one-layer head
        mask: torch.Tensor | None = None,  # bool [T, kv.length + T] (True = attend); None: causal
        window: int | None = None,  # causal only: each position attends to at most this many latest ones
        last_only: bool = False,  # causal only: return the last position's output alone, [1, hidden]
    ) -> torch.Tensor:
        """One step over ``T`` new positions.

        ``last_only``: the caller reads the last position's output alone (the drafter catching up on
        committed tokens). In a one-layer head a position's keys and values depend on its own input
        only, so the earlier positions just add theirs to the cache; their attention and MLP, which
        nothing reads, are not computed (a gate's probe after 50 skipped cycles catches up on 50
        positions, a first draft on the whole prompt).

        ``window``: a head trained on windows of N tokens has never seen a query attend further back
        than N positions; past that its attention drifts and acceptance falls (the demo head,
        trained on 256-token windows: 2 of 48 new tokens accepted after a 2,000-token prompt, 31
        with a 256-token window, as after a 300-token one). A causal step then attends to the
        latest ``window`` positions only (a band, as a sliding-window model), which also bounds its
        cost; a tree step's ``mask`` is the caller's to cut (the drafter does)."""
        caches = kv.layers if isinstance(kv, HeadCache) else [kv] * self.cfg.num_hidden_layers
        if len(caches) != self.cfg.num_hidden_layers or (self.cfg.num_hidden_layers > 1 and isinstance(kv, KVBuffer)):
            raise ValueError(f"a head with {self.cfg.num_hidden_layers} layers needs one KV cache per layer "
                             "(Eagle3Head.new_cache)")
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.cfg.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(self.embed(tokens).to(hidden.dtype)), normed], dim=-1)
        cos, sin = self.rotary(x[None], positions[None])
        cos, sin = cos[0], sin[0]
        keys = None
        if last_only and len(x) > 1 and mask is None and caches[0] is not None and self.cfg.num_hidden_layers == 1:
            # every position's keys in one projection, as the full step computes them (the cache is
            # bit for bit the same); the earlier ones go to the cache, the last one's to its query
            k, v = self._keys(layer, x, cos, sin)
            caches[0].append(k[:, :-1], v[:, :-1])
            keys = (k[:, -1:], v[:, -1:])
            x, residual, cos, sin = x[-1:], residual[-1:], cos[-1:], sin[-1:]
        h = residual + self._attend(layer, x, cos, sin, caches[0], mask, window, keys)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        for layer, cache in zip(self.layers.values(), caches[1:]):
            h = h + self._attend(layer, layer.input_layernorm(h), cos, sin, cache, mask, window)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if last_only:
            h = h[-1:]
        return self.norm(h) if self.cfg.feed_normed else h

    @staticmethod
    def _keys(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys (normalised per head where the layer does, rotated) and values for ``x``."""
        attn, t = layer.self_attn, x.shape[0]
        k = attn.k_proj(x).view(t, attn.kv_heads, attn.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(t, attn.kv_heads, attn.head_dim).transpose(0, 1)
        if hasattr(attn, "k_norm"):  # Qwen3 layers normalise each head's key before rotary
            k = attn.k_norm(k)
        return _rope(k, cos, sin), v

    @staticmethod
    def _attend(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: KVBuffer | None, mask: torch.Tensor | None, window: int | None = None,
                keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Self-attention of one layer (its output projection included) over its cache and ``x``;
        ``keys``: the keys and values of ``x`` where the caller computed them already."""
        attn, t = layer.self_attn, x.shape[0]
        q = attn.q_proj(x).view(t, attn.heads, attn.head_dim).transpose(0, 1)
        if hasattr(attn, "q_norm"):  # Qwen3 layers normalise each head's query and key before rotary
            q = attn.q_norm(q)
        q = _rope(q, cos, sin)
        k, v = keys if keys is not None else Eagle3Head._keys(layer, x, cos, sin)
        if kv is not None:
            kv.append(k, v)
            k, v = kv.k[:, : kv.length], kv.v[:, : kv.length]
        if mask is None:
            mask, first = causal_mask(t, k.shape[1], window, x.device)
            k, v = k[:, first:], v[:, first:]
        rep = attn.heads // attn.kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), attn_mask=mask)
        return attn.o_proj(out.transpose(0, 1).reshape(t, -1))


def causal_mask(queries: int, keys: int, window: int | None, device: torch.device) -> tuple[torch.Tensor, int]:
    """The mask of the last ``queries`` of ``keys`` positions attending causally, each to at most
    ``window`` latest positions (itself included; None: all before it), and the first key any of
    them attends to: keys before it are cut, not computed and masked."""
    past = keys - queries
    first = 0 if window is None else max(past - window + 1, 0)
    mask = torch.ones(queries, keys - first, dtype=torch.bool, device=device).tril(past - first)
    if window is not None:
        mask &= ~torch.ones_like(mask).tril(past - first - window)
    return mask, first


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
