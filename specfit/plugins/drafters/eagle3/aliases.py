"""Other engines' names for the EAGLE-3 drafter's settings, resolved into specfit's own.

Users come with SGLang's or vLLM's flags; accepting them saves a translation step and a silent
mistake. Each alias maps to one of ``path`` / ``top_k`` / ``depth`` / ``total_tokens``:

- SGLang: ``eagle_topk`` -> ``top_k``, ``num_steps`` -> ``depth``, ``num_draft_tokens`` ->
  ``total_tokens`` + 1 (SGLang counts the root);
- vLLM: ``num_speculative_tokens`` -> ``depth`` (for an EAGLE chain it is the number of draft
  steps), and ``speculative_config``, vLLM's JSON (``{"method": "eagle3", "model": DIR,
  "num_speculative_tokens": 5}``): ``model`` -> ``path``, ``num_speculative_tokens`` -> ``depth``,
  ``method`` must be ``eagle`` or ``eagle3``; any other key is refused, none is ignored.

A value given twice (a field and an alias, or two aliases) must agree, else a ConfigError names
both keys. A field left at its default counts as not given.
"""

from __future__ import annotations

import json
from typing import Any

from specfit.interfaces import ConfigError, is_int

VLLM_KEYS = ("method", "model", "num_speculative_tokens")
VLLM_METHODS = ("eagle", "eagle3")


def vllm_speculative_config(value: Any) -> dict[str, Any]:
    """``drafter.speculative_config``: vLLM's JSON object (a string, or a mapping given with Hydra's
    syntax), checked key by key; empty when not given."""
    if value is None:
        return {}
    key = "drafter.speculative_config"
    try:
        data = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{key}: not JSON ({exc.msg}); on the command line a mapping needs no JSON quoting: "
                          f"'{key}={{num_speculative_tokens: 5}}'") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: a JSON object such as {{\"num_speculative_tokens\": 5}}, not {type(data).__name__}")
    for name, value in data.items():
        if name not in VLLM_KEYS:
            raise ConfigError(f"{key}: key {name!r} has no specfit equivalent (known: {', '.join(VLLM_KEYS)})")
        if name == "method" and value not in VLLM_METHODS:
            raise ConfigError(f"{key}: method {value!r} is not an EAGLE method ({', '.join(VLLM_METHODS)})")
        if name == "model" and not (isinstance(value, str) and value):
            raise ConfigError(f"{key}: model must be the head's directory (a string), not {json.dumps(value)}")
        if name == "num_speculative_tokens" and (not is_int(value) or value < 1):
            raise ConfigError(f"{key}: num_speculative_tokens must be an integer >= 1, not {json.dumps(value)}")
    return data


def resolve(field: str, value: Any, default: Any, aliases: dict[str, Any]) -> Any:
    """The value of ``drafter.<field>``: ``value``, or the one its given aliases agree on.

    ``aliases`` maps each alias key to the value it stands for (None: not given)."""
    given = {k: v for k, v in aliases.items() if v is not None}
    if value != default:
        given = {f"drafter.{field}": value, **given}
    if not given:
        return value
    (first, first_value), *others = given.items()
    for key, other in others:
        if other != first_value:
            if first == f"drafter.{field}":
                raise ConfigError(f"drafter.{field}={first_value} and its alias {_shown(key, other, field)} disagree")
            raise ConfigError(f"{_shown(first, first_value, field)} and {_shown(key, other, field)} disagree "
                              f"(both set drafter.{field})")
    return first_value


def _shown(key: str, value: Any, field: str) -> str:
    """An alias as the user wrote it (SGLang's num_draft_tokens counts the root)."""
    return f"{key}={value + 1}" if key == "drafter.num_draft_tokens" else f"{key}={value}"


def resolve_all(cfg: Any) -> None:
    """Resolve every alias of an ``Eagle3DrafterConfig`` into its own fields, in place."""
    vllm = vllm_speculative_config(cfg.speculative_config)
    defaults = type(cfg)
    cfg.path = resolve("path", cfg.path, defaults.path, {"drafter.speculative_config.model": vllm.get("model")})
    cfg.top_k = resolve("top_k", cfg.top_k, defaults.top_k, {"drafter.eagle_topk": cfg.eagle_topk})
    cfg.depth = resolve("depth", cfg.depth, defaults.depth, {
        "drafter.num_steps": cfg.num_steps,
        "drafter.num_speculative_tokens": cfg.num_speculative_tokens,
        "drafter.speculative_config.num_speculative_tokens": vllm.get("num_speculative_tokens"),
    })
    total = None if cfg.num_draft_tokens is None else cfg.num_draft_tokens - 1
    cfg.total_tokens = resolve("total_tokens", cfg.total_tokens, defaults.total_tokens,
                               {"drafter.num_draft_tokens": total})
