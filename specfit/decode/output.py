"""What a decode returns (:class:`GenerationOutput`) and what a streamed decode yields as it goes
(:class:`StreamEvent`): each cycle's committed tokens and their new text, as committed.

A speculative cycle commits one or more tokens at once, so one event carries all of them. Text is
detokenized incrementally the way vLLM and transformers' streamers do it: the new tokens are
decoded together with a few before them, and text is held back while it ends in an incomplete
UTF-8 sequence (U+FFFD), so a character split across tokens is never sent half.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from torch import nn

from specfit.offload.runtime import OffloadRuntime
from specfit.types.stats import CycleRecord


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated tokens (the prompt excluded)
    text: str | None  # decoded text, when the model has a tokenizer
    stats: dict[str, Any]  # the results.jsonl keys
    prompt_ids: list[int] = field(default_factory=list)
    cycles: list[CycleRecord] = field(default_factory=list)
    # "stop": a stop token ended it; "length": max_new_tokens or the context limit did (as vLLM reports it)
    finish_reason: str = "length"


@dataclass
class StreamEvent:
    """One step of a streamed decode: the prefill's first token, then one event per cycle.

    ``token_ids``: the tokens this step committed; ``text``: the text they add (None without a
    tokenizer); the last event has ``finish_reason`` ("stop" or "length") and ``output``, the whole
    :class:`~specfit.decode.engine.GenerationOutput` with the same stats ``generate`` returns."""

    token_ids: list[int]
    text: str | None
    finish_reason: str | None = None
    output: GenerationOutput | None = None


class IncrementalDetokenizer:
    """The text each new token adds (vLLM's prefix/read offsets): ``prefix`` marks where the last
    decoded window starts, ``read`` the tokens whose text has been handed out."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.prefix = self.read = 0

    def add(self, tokens: Sequence[int]) -> str:
        """The text that ``tokens`` (the output so far) adds to what was handed out before."""
        before, after = self._window(tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        self.prefix, self.read = self.read, len(tokens)
        return after[len(before):]

    def rest(self, tokens: Sequence[int]) -> str:
        """At the end: whatever is still held back (an incomplete character included)."""
        before, after = self._window(tokens)
        self.prefix = self.read = len(tokens)
        return after[len(before):] if len(after) > len(before) else ""

    def _window(self, tokens: Sequence[int]) -> tuple[str, str]:
        """The text of the window's handed-out tokens, and of the window with the new ones."""
        decode = self.tokenizer.decode
        return (decode(tokens[self.prefix:self.read], skip_special_tokens=True),
                decode(tokens[self.prefix:], skip_special_tokens=True))


def memory_info(runtime: OffloadRuntime, model: nn.Module) -> dict[str, int]:
    """Where the weights live: the experts' host store (shared: one copy for several engines, counted
    once however many report it), the device slot pool, and the dense rest."""
    dense = {id(t): t for t in (*model.parameters(), *model.buffers()) if not t.is_meta}  # tied weights once
    return {
        "expert_host_bytes": runtime.store.nbytes,
        "expert_store_shared": bool(runtime.store.shared),  # one host copy read by several engines (the bench)
        "expert_device_bytes": runtime.device_bytes,
        "dense_device_bytes": sum(t.numel() * t.element_size() for t in dense.values()),
    }
