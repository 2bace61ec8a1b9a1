"""A decode's prompt and where it must end besides ``max_new_tokens``: the prompt as token ids, the
target's context limit and its end-of-sequence tokens, read off its HF config, generation config
and tokenizer."""

from __future__ import annotations

from typing import Any

from torch import nn

from specfit.errors import ConfigError
from specfit.validation import integer, token_ids


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


def encode_prompt(prompt: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    """One prompt as token ids: text through the tokenizer (its own defaults, BOS where it adds one),
    ids checked (ints in the vocabulary, at least one); a list of prompts is refused."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, (str, list, tuple)) for p in prompt):
        raise ConfigError(f"prompt is a list of {len(prompt)} prompts: an engine decodes one prompt at a time "
                          "(offloaded experts are served at batch size 1); call generate (or stream) once per "
                          "prompt, or run `specfit bench` over a workload")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError("this model has no tokenizer: give the prompt as token ids (prompt_ids=[...])")
        # not verbose: a prompt past the model's length gets specfit's one-line error (check_prompt),
        # not also the tokenizer's warning
        prompt = tokenizer(prompt, verbose=False)["input_ids"]
    # ints only (no floats, bools, strings or nested lists), in the vocabulary, at least one
    return token_ids("prompt", prompt, vocab_size, allow_empty=False)
