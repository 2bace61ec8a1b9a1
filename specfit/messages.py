"""One line from Hydra's and OmegaConf's multi-line errors: the part that names the key or value.

Its own module so that the registry (a plug-in's config) and :mod:`specfit.config` share it
without importing each other.
"""

from __future__ import annotations

import re
import sys
from typing import Any

_noted: set[str] = set()


def note_once(message: str) -> None:
    """``specfit: note: message`` on stderr, once per process (a bench builds one engine per method)."""
    if message not in _noted:
        _noted.add(message)
        print(f"specfit: note: {message}", file=sys.stderr)


def one_line_config_error(exc: BaseException) -> str:
    """Hydra's messages span lines and end in hints about HYDRA_FULL_ERROR; keep what names the problem."""
    seen = []
    err: BaseException | None = exc
    while err is not None:
        for line in str(err).splitlines():
            line = line.strip()
            if not line or line.startswith(_NOISE):
                continue
            line = _APPEND_HINT.sub("", line).strip()  # `+key=value` would now be refused too
            if line and line not in seen:
                seen.append(line)
        err = err.__cause__
    hint = _did_you_mean(exc)
    message = (" ".join(seen) or type(exc).__name__) + hint
    listed = re.search(r"override (\S+?)=(\S+) Invalid value assigned: \w+ is not a ListConfig", message)
    if listed:  # methods=ar for methods=[ar]
        key, value = listed.groups()
        message = f"{key}={value}: {key} takes a list: {key}=[{value}] (or [A,B,...])"
    owner = None if hint else _settings_of(exc)
    if owner is not None:  # not "Key 'objective' not in 'TopByPathProbSelectorConfig'": the plug-in the user chose
        message = re.sub(r"Key '[^']*' not in '[^']*'", owner, message)
    ambiguous = re.match(r"Ambiguous value for argument '([^'=]+)=(.*?)' 1\. ", message)
    if ambiguous:  # a comma: Hydra's three numbered readings, one of which is the user's
        key, value = ambiguous.groups()
        extra = "; a prompt can also come from prompt_file=PATH" if key == "prompt" else ""
        message = (f"{key}={value}: a comma is ambiguous: a list is {key}=[A,B], a sweep needs -m, and one "
                   f"string is quoted inside the shell's quotes: '{key}=\"...\"'{extra}")
    inner = re.search(r"no viable alternative at input '\[?([^']*=[^']*)'", message) if _is_parse_error(exc) else None
    if inner:  # key=[a=b]: a list entry holding '=' (an override in a method preset) needs its own quotes
        message = (f"cannot parse the list entry {inner.group(1)}...: an entry holding '=' is quoted inside the list, "
                   "the whole override inside the shell's quotes: 'key=[\"a=b\",\"c=d\"]' (a method preset: "
                   "'+method_presets.NAME=[\"selector=chain\",\"cache=lru\"]')")
    if _is_parse_error(exc) and "LexerNoViableAltException" in message:  # characters Hydra's grammar refuses
        message = message.replace("LexerNoViableAltException: ", "cannot parse ").split(" See https://")[0]
        message = message.removesuffix(" ^") + _quoting_hint(message)
    return message


def _quoting_hint(message: str) -> str:
    """How to quote the override that did not parse, with its own key (``prompt`` also has a file)."""
    text = message.partition("cannot parse ")[2]
    key = text.split("=", 1)[0].strip() if "=" in text else ""
    if not key or " " in key:
        key = "prompt"
    extra = "; a prompt can also come from prompt_file=PATH" if key == "prompt" else ""
    return (f" (quote a value that has spaces, non-ASCII or special characters inside the shell's quotes:"
            f" '{key}=\"...\"'{extra})")


def _typed_key(exc: BaseException | None) -> tuple[Any, str, str] | None:
    """(the node's dataclass, the key, its full key) of the first error in the chain that OmegaConf
    raised about a key of a typed node; None when there is none."""
    import dataclasses

    while exc is not None:
        schema, key = getattr(exc, "object_type", None), getattr(exc, "key", None)
        if dataclasses.is_dataclass(schema) and isinstance(key, str):
            return schema, key, str(getattr(exc, "full_key", None) or key)
        exc = exc.__cause__
    return None


def _did_you_mean(exc: BaseException | None) -> str:
    """For a misspelt key of a typed node (OmegaConf names the node's dataclass): the nearest field."""
    import dataclasses
    import difflib

    typed = _typed_key(exc)
    if typed is None:
        return ""
    schema, key, full = typed
    near = difflib.get_close_matches(key, [f.name for f in dataclasses.fields(schema)], n=1)
    if near and near[0] != key:  # a key that exists was given a bad value: nothing to suggest
        return f"; did you mean {full[: len(full) - len(key)]}{near[0]}?"
    return ""


# the groups whose config is the chosen plug-in's own (its ``name`` is the option: selector=eagle3);
# specfit.interfaces.protocols.KINDS, spelled here so this module imports nothing of specfit's
_PLUGIN_GROUPS = ("drafter", "selector", "cost_model", "predictor", "cache", "prefetch", "acceptance")


def _settings_of(exc: BaseException | None) -> str | None:
    """For a key the chosen plug-in's config does not have: which plug-in that is and what it has
    (``selector=eagle3 has no setting 'objective' (its settings: ...)``); None for other errors."""
    import dataclasses

    typed = _typed_key(exc)
    if typed is None:
        return None
    schema, key, full = typed
    fields = dataclasses.fields(schema)
    if key in {f.name for f in fields}:
        return None
    group = full[: len(full) - len(key)].rstrip(".")
    # a config's default name is the chosen option only for a plug-in's
    name = next((f.default for f in fields if f.name == "name" and isinstance(f.default, str)), None) \
        if group in _PLUGIN_GROUPS else None
    owner = f"{group}={name}" if group and name else (group or schema.__name__)
    settings = [f.name for f in fields if f.name != "name"]
    listed = f"its settings: {', '.join(settings)}" if settings else "it has no settings"
    return f"{owner} has no setting '{key}' ({listed})"


def _is_parse_error(exc: BaseException | None) -> bool:
    while exc is not None:
        if type(exc).__name__ == "OverrideParseException":
            return True
        exc = exc.__cause__
    return False


# lines of Hydra/OmegaConf messages that name no problem (the search path lists every provider)
_NOISE = ("full_key:", "object_type=", "reference_type=", "Set the environment", "Config search path",
          "provider=")
_APPEND_HINT = re.compile(r"\s*To append to your config use \+\S+")
