"""The FastAPI app: OpenAI's completion, chat and model routes, /health and /metrics.

:func:`create_app` takes a built engine and the server's settings (``server.*``); the engine is
decoded by the app's :class:`~specfit.serve.worker.Worker` thread, started with the app (its
lifespan) and stopped with it. Every error a client can cause is OpenAI-shaped, with its status;
a bug is a 500 with one line, its traceback in the server's log only.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specfit.config import ServerConfig
from specfit.decode.sampling import SamplingParams
from specfit.errors import ConfigError
from specfit.serve import protocol
from specfit.serve.chat import render
from specfit.serve.metrics import ServerMetrics
from specfit.serve.protocol import APIError, GenerationRequest, bad
from specfit.serve.worker import Delta, Done, Failed, Job, Worker

log = logging.getLogger("specfit.serve")

POLL_SECONDS = 0.5  # how often a waiting non-streamed request looks for its client having left
DEADLINE_GRACE = 0.25  # the worker ends a late request at its cycle boundary; the relay waits this much more


class _Gone(Exception):
    """The client disconnected: nothing to answer."""


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def create_app(engine: Any, settings: ServerConfig | None = None) -> FastAPI:
    """The server's app for ``engine`` (built already); ``settings``: ``server.*`` (defaults without)."""
    settings = settings or ServerConfig()
    metrics = ServerMetrics(settings.model_name)
    worker = Worker(engine, metrics, settings.max_waiting, settings.shutdown_timeout, settings.warmup)
    tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None  # the engine's is its thread's
    tokenizer_lock = threading.Lock()
    models = [settings.model_name]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.stop, settings.shutdown_timeout + 2)

    app = FastAPI(title="specfit serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.settings = worker, metrics, settings

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = {404: f"no route {request.url.path} (routes: /v1/completions, /v1/chat/completions, /v1/models, "
                        "/health, /metrics)",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(APIError(exc.status_code, message, type=kind, code=str(exc.status_code)))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("specfit serve: %s %s failed", request.method, request.url.path)
        return error_response(protocol.internal(exc))

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "a valid API key is required: Authorization: Bearer <server.api_key>",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        limit = settings.max_body_bytes
        too_big = APIError(413, f"the request body is over {limit} bytes (server.max_body_bytes)",
                           code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise too_big
            chunks.append(piece)
        return b"".join(chunks)

    def encode(req: GenerationRequest) -> list[int]:
        """The prompt's token ids, checked against the vocabulary and the context."""
        key = "messages" if req.kind == "chat" else "prompt"
        if isinstance(req.prompt, list):
            ids = req.prompt
        elif tokenizer is None:
            raise bad("this model has no tokenizer: give the prompt as token ids (\"prompt\": [1, 2, 3]); chat "
                      "needs a tokenizer", param=key, code="no_tokenizer")
        else:
            with tokenizer_lock:
                if req.kind == "chat":
                    text = render(tokenizer, req.messages)
                    special = not getattr(tokenizer, "chat_template", None)  # a template writes its own BOS
                    ids = tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"]
                else:  # as the engine encodes a text prompt, so that `specfit generate prompt=...` matches
                    ids = tokenizer(req.prompt, verbose=False)["input_ids"]
        try:
            return engine.check_prompt(list(ids))
        except ConfigError as exc:
            message = str(exc).replace("shorten the prompt", "shorten it").replace("prompt=", f"{key}=")
            code = "context_length_exceeded" if "context limit" in message else "invalid_value"
            raise bad(message, param=key, code=code) from None

    def max_tokens_for(req: GenerationRequest, prompt_tokens: int) -> int:
        limit = engine.max_model_len
        room = None if limit is None else limit - prompt_tokens
        if req.max_tokens is None:
            return engine.max_new_tokens if room is None else min(engine.max_new_tokens, room)
        if room is not None and req.max_tokens > room:
            raise bad(f"max_tokens={req.max_tokens} is past the context: the prompt has {prompt_tokens} tokens and "
                      f"the context limit is {limit}, so at most {room} new tokens", param="max_tokens",
                      code="context_length_exceeded")
        return req.max_tokens

    def sampling_for(req: GenerationRequest) -> SamplingParams:
        base = engine.sampling  # the config's sampling.*: the defaults of every request
        try:
            return SamplingParams(temperature=base.temperature if req.temperature is None else req.temperature,
                                  top_p=base.top_p if req.top_p is None else req.top_p,
                                  top_k=base.top_k if req.top_k is None else req.top_k,
                                  seed=base.seed if req.seed is None else req.seed)
        except ConfigError as exc:
            raise bad(str(exc).replace("sampling.", ""), code="invalid_value") from None

    async def next_item(job: Job, request: Request | None) -> Any:
        """The job's next event; ``request`` (not streamed): also watch for its client leaving."""
        while True:
            remaining = job.deadline + DEADLINE_GRACE - time.monotonic()
            if remaining <= 0:
                job.cancel("deadline")
                raise protocol.deadline_exceeded(job.timeout)
            try:
                return await asyncio.wait_for(job.events.get(), min(remaining, POLL_SECONDS))
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    job.cancel("abort")
                    raise _Gone() from None

    async def collect(job: Job, req: GenerationRequest, request: Request) -> Response:
        parts: list[str] = []
        try:
            while True:
                item = await next_item(job, request)
                if isinstance(item, Failed):
                    raise item.error
                parts.append(item.text)
                if isinstance(item, Done):
                    use = protocol.usage(item.prompt_tokens, item.completion_tokens)
                    return JSONResponse(protocol.response(req, "".join(parts), item.all_token_ids,
                                                         item.finish_reason, use, item.stats))
        except _Gone:
            return Response(status_code=499)
        finally:
            job.cancel("abort")  # no-op once it is done

    async def events(job: Job, req: GenerationRequest) -> AsyncIterator[str]:
        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        first = True
        try:
            while True:
                try:
                    item = await next_item(job, None)
                except APIError as exc:
                    yield sse(exc.body())
                    break
                if isinstance(item, Failed):
                    yield sse(item.error.body())
                    break
                if isinstance(item, Delta):
                    yield sse(protocol.chunk(req, item.text, item.token_ids, first=first))
                    first = False
                    continue
                yield sse(protocol.chunk(req, item.text, item.token_ids, item.finish_reason, first=first))
                if req.include_usage:
                    yield sse(protocol.usage_chunk(req, protocol.usage(item.prompt_tokens, item.completion_tokens)))
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel("abort")  # the client left mid-stream (the task is cancelled): at the next cycle boundary

    async def generation(request: Request, kind: str) -> Response:
        authorize(request)
        body = protocol.parse_json(await read_body(request))
        req = protocol.parse_chat(body, models) if kind == "chat" else protocol.parse_completion(body, models)
        ids = await asyncio.to_thread(encode, req)
        job = Job(ids, max_tokens_for(req, len(ids)), sampling_for(req), req.stop, settings.request_timeout,
                  asyncio.get_running_loop())
        worker.submit(job)
        if req.stream:
            return StreamingResponse(events(job, req), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(job, req, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, "chat")

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "specfit", "max_model_len": engine.max_model_len}
            for name in models]})

    @app.get("/health")
    async def health() -> Response:
        state = worker.state()
        body: dict[str, Any] = {"status": state, "running": int(worker.running is not None),
                                "waiting": worker.waiting()}
        if worker.failure:
            body["error"] = worker.failure
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
