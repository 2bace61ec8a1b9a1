"""Chat messages to the prompt text the model continues.

A tokenizer with a chat template (``tokenizer.chat_template``, as HF checkpoints ship it) renders
the messages with it and the generation prompt. A tokenizer without one (the shipped demo model,
trained on plain text) gets :data:`PLAIN_TEMPLATE`'s plain transcript::

    System: You are terse.
    User: Write a line of verse.
    Assistant:

one ``Role: content`` line per message, then ``Assistant:`` for the model to continue. The answer
is not cut at the next ``User:`` unless the request says so (``"stop": ["\\nUser:"]``).
"""

from __future__ import annotations

from typing import Any

PLAIN_TEMPLATE = "{Role}: {content}\\n per message, then 'Assistant:'"


def plain_transcript(messages: list[dict[str, str]]) -> str:
    """:data:`PLAIN_TEMPLATE` applied to ``messages``."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


def render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text of a chat: the tokenizer's template where it has one, else the plain transcript."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return plain_transcript(messages)
