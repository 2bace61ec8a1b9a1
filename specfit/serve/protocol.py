"""What a request may say and what the server answers, in OpenAI's shapes.

A request body is parsed by hand (not by a pydantic model) so that every mistake is one
OpenAI-shaped error with its field named: ``{"error": {"message", "type", "param", "code"}}``.
Fields this server cannot honour (``n`` > 1, ``logprobs``, ``echo``, tools, penalties) are refused
with a message saying so; fields it does not know are ignored, as OpenAI's own API does with extra
client fields. No field names a file, a model path or a plug-in.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

MAX_STOP = 4  # stop strings per request, as OpenAI allows
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered to the client: ``status`` and OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, type="server_overloaded", code="server_overloaded",
                    headers={"Retry-After": str(retry_after)})


def deadline_exceeded(seconds: float) -> APIError:
    return APIError(504, f"the request did not finish within its deadline of {seconds:g} s (server.request_timeout, "
                    "counted from its arrival, the queue included); ask for fewer tokens or try again",
                    type="timeout_error", code="deadline_exceeded")


def internal(exc: BaseException) -> APIError:
    """A bug: its type and message, never a traceback (that goes to the server's log)."""
    return APIError(500, f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                    type="server_error", code="internal_error")


# --------------------------------------------------------------------------- the body


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or the error that says why it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"the request body is not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})",
                  code="invalid_encoding") from None
    if not text.strip():
        raise bad("the request body is empty: send a JSON object", code="invalid_json")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                  code="invalid_json") from None
    except RecursionError:
        raise bad("the request body is nested too deeply to parse", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    return body


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _wrong(key: str, expected: str, value: Any) -> APIError:
    return bad(f"'{key}' must be {expected}, got {_json_type(value)}", param=key, code="invalid_type")


def _integer(body: dict, key: str, default: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, float) and value.is_integer()):
        raise _wrong(key, "an integer", value)
    return int(value)


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong(key, "a number", value)
    value = float(value)
    if not math.isfinite(value):
        raise bad(f"'{key}' must be a finite number, got {value}", param=key, code="invalid_value")
    return value


def _boolean(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong(key, "true or false", value)
    return value


# --------------------------------------------------------------------------- requests


@dataclass
class GenerationRequest:
    """A completion or chat request, checked; ``prompt`` is text or token ids (chat: the rendered text)."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = 0


def parse_completion(body: dict[str, Any], models: list[str]) -> GenerationRequest:
    """POST /v1/completions: ``prompt`` is a string, token ids, or a list of one of them."""
    req = _common(body, "completion", models)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required: a string or an array of token ids", param="prompt", code="missing_field")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise bad(f"'prompt' holds {len(prompt)} prompts: this server decodes one prompt per request (batch size "
                      "1: offloaded experts); send one request per prompt", param="prompt", code="unsupported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", param="prompt", code="invalid_value")
        req.prompt = prompt
    elif isinstance(prompt, list):
        if not prompt:
            raise bad("'prompt' is an empty array: give text or at least one token id", param="prompt",
                      code="invalid_value")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("'prompt' as an array must hold integer token ids (or be a list of one string)",
                      param="prompt", code="invalid_type")
        req.prompt = list(prompt)
    else:
        raise _wrong("prompt", "a string or an array of token ids", prompt)
    for key, why in (("echo", "echoing the prompt"), ("logprobs", "log probabilities")):
        if body.get(key) not in (None, False, 0):
            raise bad(f"'{key}' is not supported by specfit serve ({why})", param=key, code="unsupported")
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' (insertion) is not supported by specfit serve", param="suffix", code="unsupported")
    best_of = _integer(body, "best_of")
    if best_of is not None and best_of != 1:
        raise bad(f"best_of={best_of} is not supported: one completion per request (batch size 1)",
                  param="best_of", code="unsupported")
    return req


def parse_chat(body: dict[str, Any], models: list[str]) -> GenerationRequest:
    """POST /v1/chat/completions: ``messages``, each a role and text content."""
    req = _common(body, "chat", models)
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required: an array of {role, content}", param="messages", code="missing_field")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of {role, content}", param="messages", code="invalid_type")
    for i, message in enumerate(messages):
        key = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _wrong(key, "an object with role and content", message)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"'{key}.role' must be one of {', '.join(ROLES)}, got {role!r:.40}", param=f"{key}.role",
                      code="invalid_value")
        req.messages.append({"role": role, "content": _content(message.get("content"), f"{key}.content")})
    max_completion = _integer(body, "max_completion_tokens")
    if max_completion is not None:
        if req.max_tokens is not None and req.max_tokens != max_completion:
            raise bad("'max_tokens' and 'max_completion_tokens' disagree: give one", param="max_completion_tokens")
        _at_least_one("max_completion_tokens", max_completion)
        req.max_tokens = max_completion
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad("'logprobs' is not supported by specfit serve", param="logprobs", code="unsupported")
    for key in ("tools", "functions"):
        if body.get(key):
            raise bad(f"'{key}' (tool calling) is not supported by specfit serve", param=key, code="unsupported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("'response_format' other than {\"type\": \"text\"} is not supported", param="response_format",
                  code="unsupported")
    return req


def _content(content: Any, key: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: text only
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"'{key}' parts must be {{\"type\": \"text\", \"text\": ...}} (no images or audio)",
                          param=key, code="unsupported")
            texts.append(part["text"])
        return "".join(texts)
    raise _wrong(key, "a string or an array of text parts", content)


def _at_least_one(key: str, value: int) -> None:
    if value < 1:
        raise bad(f"'{key}' must be at least 1, got {value}", param=key, code="invalid_value")


def _common(body: dict[str, Any], kind: str, models: list[str]) -> GenerationRequest:
    model = body.get("model")
    if model is None:
        raise bad(f"'model' is required (this server serves {', '.join(models)})", param="model",
                  code="missing_field")
    if not isinstance(model, str):
        raise _wrong("model", "a string", model)
    if model not in models:
        raise APIError(404, f"the model {model!r:.80} does not exist here; this server serves {', '.join(models)} "
                       "(GET /v1/models)", param="model", code="model_not_found")
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise bad(f"n={n} is not supported: specfit serve returns one choice per request (the offloaded engine "
                  "decodes at batch size 1); send n requests instead", param="n", code="unsupported")
    req = GenerationRequest(kind=kind, model=model, id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-"
                            f"{uuid.uuid4().hex}", created=int(time.time()))
    req.max_tokens = _integer(body, "max_tokens")
    if req.max_tokens is not None:
        _at_least_one("max_tokens", req.max_tokens)
    req.temperature = _number(body, "temperature")
    if req.temperature is not None and req.temperature < 0:
        raise bad(f"'temperature' must be >= 0 (0 is greedy), got {req.temperature}", param="temperature",
                  code="invalid_value")
    req.top_p = _number(body, "top_p")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {req.top_p}", param="top_p", code="invalid_value")
    req.top_k = _integer(body, "top_k")
    if req.top_k == -1:  # vLLM's extension, where -1 means off
        req.top_k = 0
    elif req.top_k is not None and req.top_k < 0:
        raise bad(f"'top_k' must be >= 0 (0: off), got {req.top_k}", param="top_k", code="invalid_value")
    req.seed = _integer(body, "seed")
    for key in ("presence_penalty", "frequency_penalty"):
        value = _number(body, key)
        if value not in (None, 0.0):
            raise bad(f"'{key}' is not supported by specfit serve (give 0 or leave it out)", param=key,
                      code="unsupported")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported by specfit serve", param="logit_bias", code="unsupported")
    req.stop = _stop(body.get("stop"))
    req.stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not req.stream:
            raise bad("'stream_options' is only allowed with stream=true", param="stream_options")
        if not isinstance(options, dict):
            raise _wrong("stream_options", "an object", options)
        req.include_usage = _boolean(options, "include_usage")
    return req


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _wrong("stop", "a string or an array of strings", stop)
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' holds {len(stops)} strings; at most {MAX_STOP}", param="stop", code="invalid_value")
    if any(not s for s in stops):
        raise bad("'stop' strings must not be empty", param="stop", code="invalid_value")
    return stops


# --------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(req: GenerationRequest, text: str, token_ids: list[int], finish_reason: str,
             use: dict[str, int], stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole answer of a request without ``stream``; ``token_ids`` (vLLM's name) and ``specfit``
    (the decode's own stats, when it ran to its end) are specfit's extensions."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason, "token_ids": token_ids}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "token_ids": token_ids}
        obj = "text_completion"
    out = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice],
           "usage": use}
    if stats is not None:
        out["specfit"] = stats
    return out


def chunk(req: GenerationRequest, text: str | None, token_ids: list[int], finish_reason: str | None = None,
          first: bool = False) -> dict[str, Any]:
    """One server-sent event of a streamed answer (one per committed cycle)."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": token_ids}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": token_ids}
        obj = "text_completion"
    out = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: GenerationRequest, use: dict[str, int]) -> dict[str, Any]:
    """stream_options.include_usage: the last chunk before [DONE], no choices, the usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [], "usage": use}
