"""The EAGLE-3 draft head: one Llama-style decoder layer over [embedding ; fused target features].

Weight names follow the public layout (EAGLE-3, SpecForge, SGLang): ``fc``, ``midlayer.*``,
``norm``, ``lm_head``, ``d2t`` and ``t2d``, and an optional ``embed_tokens`` (else the target's).
One step maps (hidden h_t, token x_{t+1}) at position t to a new hidden, whose logits predict
x_{t+2}; h_t is ``fc`` of three target layers' features for committed tokens, and the head's own
previous output inside the draft tree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specfit.errors import ModelError

UNSUPPORTED_FLAGS = ("norm_before_residual", "fc_norm", "use_aux_norm", "parallel_drafting")


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
    # SGLang/SpecForge convention: the outputs of these target layers (HF hidden_states index i + 1)
    aux_layer_ids: list[int] | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> Eagle3Config:
        """Parse a public head's config.json, rejecting variants this head does not implement."""
        for flag in UNSUPPORTED_FLAGS:
            if raw.get(flag):
                raise ModelError(f"{source}: EAGLE-3 variant flag {flag}={raw[flag]!r} is not supported")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ModelError(f"{source}: num_hidden_layers={raw['num_hidden_layers']}; only one-layer EAGLE-3 heads are supported")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in raw]
        if missing:
            raise ModelError(f"{source}: missing {', '.join(missing)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelError(f"{source}: hidden_act={raw['hidden_act']!r}; the EAGLE-3 head implements silu only")
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        eagle = raw.get("eagle_config") or {}
        aux = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        rope = raw.get("rope_parameters")
        if not rope:
            rope = dict(raw.get("rope_scaling") or {})
            rope.setdefault("rope_type", rope.pop("type", "default"))
            rope["rope_theta"] = float(raw.get("rope_theta", 10000.0))
        return cls(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),  # honour head_dim (Qwen3 heads set it)
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope_parameters=rope,
            hidden_act=str(raw.get("hidden_act", "silu")),
            fc_bias=bool(raw.get("bias", False)),
            aux_layer_ids=list(aux) if aux else None,
        )

    def to_hf(self) -> dict[str, Any]:
        """config.json in the public layout (loadable by SGLang / vLLM as LlamaForCausalLMEagle3)."""
        d = asdict(self)
        rope = d.pop("rope_parameters")
        aux = d.pop("aux_layer_ids")
        d["bias"] = d.pop("fc_bias")
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "rope_theta": rope["rope_theta"],
            "rope_scaling": None if rope.get("rope_type", "default") == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
            **d,
            **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}} if aux else {}),
        }


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
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h2, hd = 2 * cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h2, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(h2, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h2, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, cfg.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)


class KVBuffer:
    """The head's own KV cache: [kv_heads, positions, head_dim], grown on demand, cropped after drafting."""

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


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, target_embedding: nn.Embedding | None = None) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None  # own embedding, when the checkpoint has one
        object.__setattr__(self, "_target_embedding", target_embedding)  # shared, not owned
        rope_cfg = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                               head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                               rope_parameters=dict(cfg.rope_parameters))
        self.rotary = LlamaRotaryEmbedding(rope_cfg)

    # ------------------------------------------------------------------ pieces

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

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Fused target features [T, 3 * target_hidden] -> head hidden [T, hidden]."""
        return self.fc(features)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of head outputs."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ------------------------------------------------------------------ one step

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: projected target features or the head's own outputs
        tokens: torch.Tensor,  # [T] target token ids
        positions: torch.Tensor,  # [T]
        kv: KVBuffer | None = None,
        mask: torch.Tensor | None = None,  # bool [T, kv.length + T] (True = attend); None: causal
    ) -> torch.Tensor:
        layer, attn = self.midlayer, self.midlayer.self_attn
        t = hidden.shape[0]
        x = torch.cat([layer.input_layernorm(self.embed(tokens)), layer.hidden_norm(hidden)], dim=-1)
        q = attn.q_proj(x).view(t, attn.heads, attn.head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(t, attn.kv_heads, attn.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(t, attn.kv_heads, attn.head_dim).transpose(0, 1)
        cos, sin = self.rotary(x[None], positions[None])
        q, k = _rope(q, cos[0], sin[0]), _rope(k, cos[0], sin[0])
        if kv is not None:
            kv.append(k, v)
            k, v = kv.k[:, : kv.length], kv.v[:, : kv.length]
        if mask is None:
            past = k.shape[1] - t
            mask = torch.ones(t, k.shape[1], dtype=torch.bool, device=x.device).tril(past)
        rep = attn.heads // attn.kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), attn_mask=mask)
        h = hidden + attn.o_proj(out.transpose(0, 1).reshape(t, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
