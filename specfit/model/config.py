"""``model.*``: the target MoE model's settings (the config schema composes it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """The target MoE model: a local Hugging Face checkpoint or a model built in code."""

    path: str | None = None  # checkpoint directory (or hub id where a hub is reachable)
    builtin: str | None = None  # tiny-qwen3-moe | tiny-olmoe | tiny-mixtral | tiny-qwen3-next | tiny-gpt-oss (random, seeded)
    tokenizer: str | None = None  # defaults to ``path``
    dtype: str = "auto"  # auto (the checkpoint's own) | float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"  # sdpa | eager
    seed: int = 0  # weights of built-in models
    draft_head: str | None = None  # an EAGLE-3 head trained for this target: drafter=eagle3 uses it by default
    max_model_len: int | None = None  # context limit (prompt + output); null: the model's max_position_embeddings
    # exact: a bf16/fp16 model keeps its experts in that dtype and computes everything else in float32
    # (activations, norms, router, the expert sum): speculative output stays identical to AR's |
    # native: everything in model.dtype. The same for float32 models.
    numerics: str = "exact"
    # the routed experts' compute: auto (triton on CUDA when Triton imports, grouped otherwise) |
    # grouped (torch._grouped_mm over the slot pool) | loop (per expert: the reference) | triton
    expert_compute: str = "auto"
