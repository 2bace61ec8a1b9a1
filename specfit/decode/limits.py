"""Where a decode must end besides ``max_new_tokens``: the target's context limit and its
end-of-sequence tokens, read off its HF config, generation config and tokenizer."""

from __future__ import annotations

from typing import Any

from torch import nn

from specfit.errors import ConfigError
from specfit.validation import integer


def context_limit(config: Any, override: int | None = None) -> int | None:
    """The most tokens (prompt + output) the target holds: ``max_position_embeddings`` of its config,
    or a smaller ``override`` (``model.max_model_len``, as in vLLM); None when neither is known."""
    native = native_context(config)
    if override is None:
        return native
    integer("model.max_model_len", override, minimum=2)  # a prompt token and a new one
    if native is not None and override > native:
        raise ConfigError(f"model.max_model_len={override} exceeds the model's context limit {native} "
                          f"(max_position_embeddings, with its RoPE scaling)")
    return override


def native_context(config: Any) -> int | None:
    """``max_position_embeddings``, extended by a RoPE scaling factor as vLLM derives it (YaRN:
    ``original_max_position_embeddings x factor``; linear and dynamic: ``max_position_embeddings x factor``)."""
    native = getattr(config, "max_position_embeddings", None)
    if not isinstance(native, int) or isinstance(native, bool) or native <= 0:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict) or not isinstance(rope.get("factor"), (int, float)):
        return native
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", "su", "longrope", "llama3"):
        return native
    base = rope.get("original_max_position_embeddings", native) if kind == "yarn" else native
    return int(base * rope["factor"])


def eos_ids(model: nn.Module, tokenizer: Any) -> set[int]:
    """The end-of-sequence token ids the model's generation config, its config and the tokenizer name."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids |= set(eos) if isinstance(eos, (list, tuple, set)) else {int(eos)}
    return ids
