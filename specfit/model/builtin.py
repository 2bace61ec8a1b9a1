"""Tiny MoE models built in code (seeded random weights): for tests and a first run without downloads.

Their weights are random, so their text is noise; they exercise every code path of the real
architectures (Qwen3-MoE, OLMoE, Mixtral, Qwen3-Next's hybrid linear attention, gpt-oss) in milliseconds.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from specfit.errors import ModelError


def _qwen3_moe(**overrides):
    from transformers import Qwen3MoeConfig

    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=2,
                norm_topk_prob=True, max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=False)
    return Qwen3MoeConfig(**{**args, **overrides})


def _olmoe(**overrides):
    from transformers import OlmoeConfig

    args = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, num_experts=16, num_experts_per_tok=2, norm_topk_prob=False,
                max_position_embeddings=4096, initializer_range=0.1, eos_token_id=None, bos_token_id=None)
    return OlmoeConfig(**{**args, **overrides})


def _mixtral(**overrides):
    from transformers import MixtralConfig

    args = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                max_position_embeddings=4096, initializer_range=0.1, eos_token_id=None, bos_token_id=None)
    return MixtralConfig(**{**args, **overrides})


def _qwen3_next(**overrides):
    """Gated DeltaNet (linear-attention) layers alternating with full attention; a gated shared expert."""
    from transformers import Qwen3NextConfig

    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, full_attention_interval=2,
                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, max_position_embeddings=4096, initializer_range=0.1,
                tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return Qwen3NextConfig(**{**args, **overrides})


def _gpt_oss(**overrides):
    """Sliding-window layers (a window of 8, so the tests' contexts pass it) alternating with full attention,
    attention sinks, expert biases and the clamped SwiGLU over interleaved gate/up columns."""
    from transformers import GptOssConfig

    args = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=False,
                eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return GptOssConfig(**{**args, **overrides})


#: Attention implementations a family supports for tree verification, when not both sdpa and eager
#: (gpt-oss's attention sinks are implemented by transformers' eager attention only).
ATTENTION_ONLY = {"tiny-gpt-oss": "eager"}

BUILTIN_CONFIGS: dict[str, Callable] = {
    "tiny-qwen3-moe": _qwen3_moe,
    "tiny-olmoe": _olmoe,
    "tiny-mixtral": _mixtral,
    "tiny-qwen3-next": _qwen3_next,
    "tiny-gpt-oss": _gpt_oss,
}


def builtin_config(name: str, **overrides):
    if name not in BUILTIN_CONFIGS:
        raise ModelError(f"model.builtin={name!r} is not one of {', '.join(BUILTIN_CONFIGS)}")
    return BUILTIN_CONFIGS[name](**overrides)


def build_builtin(
    name: str, seed: int = 0, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", **overrides
) -> nn.Module:
    from transformers import AutoModelForCausalLM

    only = ATTENTION_ONLY.get(name)
    if only is not None and attn_implementation != only:
        raise ModelError(f"model.attn_implementation={attn_implementation}: model.builtin={name} supports {only} "
                         f"attention only (set model.attn_implementation={only})")
    config = builtin_config(name, **overrides)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
