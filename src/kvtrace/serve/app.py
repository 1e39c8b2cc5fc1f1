"""The HTTP side of ``kvtrace serve``: Starlette routes over a ``Worker`` (the model thread), run by uvicorn.

    POST /v1/chat/completions   chat, rendered with the artifact's chat template; SSE with "stream": true
    POST /v1/completions        a plain prompt (text or token ids); SSE with "stream": true
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok", slots, active, queued}; never needs the API key
    GET  /metrics               Prometheus text

Handlers check a request completely (JSON, field types, prompt + max_tokens against max_seq_len) before it
is queued: a bad request is a 4xx in OpenAI's error shape and never reaches the model thread. A full queue
is a 429. A client that disconnects, streaming or not, has its job cancelled, which frees its slot at the
model thread's next turn. Anything unexpected is answered as a 500 in the same error shape (the server
keeps running); bad input never is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvtrace._errors import CacheOverflowError, UsageError
from kvtrace.runtime.slots import SlotEngine, SlotEvent
from kvtrace.serve import protocol
from kvtrace.serve.metrics import Metrics
from kvtrace.serve.protocol import ApiError, Prompted, Renderer
from kvtrace.serve.tools import read_answer
from kvtrace.serve.worker import Done, Job, QueueFull, Worker

__all__ = ["MAX_BODY_BYTES", "ServeConfig", "make_app", "serve"]

MAX_BODY_BYTES = 4 << 20  # a prompt of a few hundred thousand tokens; larger bodies are refused (413)


@dataclass(frozen=True)
class ServeConfig:
    model: str  # the id /v1/models lists and responses name
    api_key: str | None = None
    max_queue: int = 64


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


def _error(e: ApiError) -> Any:
    return _json(e.status, protocol.error_body(str(e), type_=e.type, param=e.param, code=e.code))


def _usage(done: Done) -> dict[str, Any]:
    return protocol.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)


def make_app(engine: SlotEngine, renderer: Renderer, config: ServeConfig) -> Any:
    """The Starlette application; its lifespan starts and stops the model thread that owns ``engine``."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    metrics = Metrics(n_slots=engine.n_slots)
    worker = Worker(engine, metrics, max_queue=config.max_queue)
    metrics._gauges.update({
        "queue_depth": ("requests waiting for a slot", lambda: worker.queued),
        "active_slots": ("conversation slots generating", lambda: worker.running),
        "slots": ("conversation slots in the batched cache", lambda: engine.n_slots),
    })

    def answered(endpoint: str, status: int) -> None:
        metrics.inc("requests_total", endpoint=endpoint, status=str(status))

    def authorized(request: Request) -> bool:
        if config.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), config.api_key.encode())

    async def read_body(request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(f"the request body is {declared} bytes; at most {MAX_BODY_BYTES} are accepted", status=413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(f"the request body is over {MAX_BODY_BYTES} bytes, the most accepted", status=413)
            chunks.append(chunk)
        return protocol.parse_json(b"".join(chunks))

    def generation(endpoint: str, parse: Callable[[dict[str, Any], Renderer, str], Prompted], chat: bool) -> Callable:
        async def handler(request: Request) -> Any:
            try:
                if not authorized(request):
                    raise ApiError("missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                                   "key the server was started with (--api-key)", status=401, code="invalid_api_key")
                body = await read_body(request)
                prompted = parse(body, renderer, config.model)
                try:
                    engine.check(prompted.request)
                except CacheOverflowError as e:
                    raise ApiError(str(e), param="messages" if chat else "prompt",
                                   code="context_length_exceeded") from None
                except UsageError as e:
                    raise ApiError(str(e)) from None
                job = Job(prompted.request, asyncio.get_running_loop())
                try:
                    worker.submit(job)
                except QueueFull as e:
                    raise ApiError(str(e), status=429, type_="rate_limit_exceeded", code="queue_full") from None
            except ApiError as e:
                answered(endpoint, e.status)
                return _error(e)
            answered(endpoint, 200)
            rid = protocol.new_id("chatcmpl" if chat else "cmpl")
            if prompted.stream:
                return StreamingResponse(_stream(job, prompted, rid, chat), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await _complete(request, job, prompted, rid, chat)

        return handler

    async def _complete(request: Request, job: Job, prompted: Prompted, rid: str, chat: bool) -> Any:
        async def watch() -> None:  # the body is read: the next message is the client leaving
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancel()
            worker.wake()

        watcher = asyncio.create_task(watch())
        parts: list[str] = []
        scored: list[protocol.Scored] = []  # where the request asked for logprobs
        score = renderer.scorer()
        try:
            while True:
                item = await job.events.get()
                if isinstance(item, SlotEvent):
                    parts.append(item.text)
                    if item.logprobs is not None:
                        scored.append(score(item.token, item.logprobs))
                    continue
                done: Done = item
                if job.cancelled:
                    return _json(499, protocol.error_body("the client disconnected"))
                if done.error:
                    return _json(500, protocol.error_body(done.error, type_="server_error"))
                text = "".join(parts)
                if prompted.tools is not None:  # the answer is tool-call JSON: read it back
                    content, calls = read_answer(text)
                    return _json(200, protocol.chat_response(rid, prompted.model, content, done.finish, _usage(done),
                                                             tool_calls=calls))
                build = protocol.chat_response if chat else protocol.completion_response
                lp = logprobs_of(scored, chat) if prompted.request.logprobs is not None else None
                return _json(200, build(rid, prompted.model, text, done.finish, _usage(done), lp))
        except asyncio.CancelledError:
            job.cancel()
            worker.wake()
            raise
        finally:
            watcher.cancel()

    def logprobs_of(items: list[protocol.Scored], chat: bool, offset: int = 0) -> dict[str, Any]:
        return protocol.chat_logprobs(items) if chat else protocol.completion_logprobs(items, offset)

    async def _stream(job: Job, prompted: Prompted, rid: str, chat: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        model = prompted.model
        finished = False
        pending: list[protocol.Scored] = []  # tokens scored since the last chunk (their text may be held back)
        offset = 0  # completions: the text_offset of the next token
        score = renderer.scorer()

        def chunk(text: str) -> bytes:
            nonlocal pending, offset
            lp = logprobs_of(pending, chat, offset) if pending else None
            if lp is not None and not chat:
                offset += sum(len(s) for s in lp["tokens"])
            pending = []
            return protocol.sse(protocol.chat_chunk(rid, model, created, {"content": text}, logprobs_=lp) if chat
                                else protocol.completion_chunk(rid, model, created, text, logprobs_=lp))

        held: list[str] | None = [] if prompted.tools is not None else None  # tool-call JSON: read back at the end
        try:
            if chat:  # an answer that may call tools has no content unless it turns out to be text
                first = {"role": "assistant", "content": None if held is not None else ""}
                yield protocol.sse(protocol.chat_chunk(rid, model, created, first))
            while True:
                item = await job.events.get()
                if isinstance(item, SlotEvent):
                    if item.logprobs is not None:
                        pending.append(score(item.token, item.logprobs))
                    if held is not None:
                        held.append(item.text)
                    elif item.text:
                        yield chunk(item.text)
                    continue
                done: Done = item
                finished = True
                if done.error:
                    yield protocol.sse(protocol.error_body(done.error, type_="server_error"))
                    break
                if pending:  # scored tokens whose text never came (held back, then cut by a stop string)
                    yield chunk("")
                reason = protocol.finish_reason(done.finish)
                if held is not None:  # one delta: the calls, or the answer's text
                    content, calls = read_answer("".join(held))
                    delta = ({"tool_calls": [c.openai(i) for i, c in enumerate(calls)]} if calls
                             else {"content": content})
                    reason = "tool_calls" if calls else reason
                    yield protocol.sse(protocol.chat_chunk(rid, model, created, delta))
                yield protocol.sse(protocol.chat_chunk(rid, model, created, {}, reason) if chat
                                   else protocol.completion_chunk(rid, model, created, "", reason))
                if prompted.include_usage:
                    u = _usage(done)
                    yield protocol.sse(protocol.chat_chunk(rid, model, created, {}, usage_=u, choices=False) if chat
                                       else protocol.completion_chunk(rid, model, created, "", usage_=u, choices=False))
                break
            yield protocol.sse("[DONE]")
        finally:
            if not finished:  # the client went away (or the server is stopping): free the slot
                job.cancel()
                worker.wake()

    def tokens_route(endpoint: str) -> Callable:
        async def handler(request: Request) -> Any:
            try:
                if not authorized(request):
                    raise ApiError("missing or wrong API key (Authorization: Bearer <key>)", status=401,
                                   code="invalid_api_key")
                body = await read_body(request)
                out = (protocol.tokenize(body, renderer, engine.max_seq_len) if endpoint == "tokenize"
                       else protocol.detokenize(body, renderer, engine.vocab_size))
            except ApiError as e:
                answered(endpoint, e.status)
                return _error(e)
            answered(endpoint, 200)
            return _json(200, out)

        return handler

    async def models(request: Request) -> Any:
        if not authorized(request):
            answered("models", 401)
            return _error(ApiError("missing or wrong API key (Authorization: Bearer <key>)", status=401,
                                   code="invalid_api_key"))
        answered("models", 200)
        return _json(200, {"object": "list", "data": [
            {"id": config.model, "object": "model", "created": 0, "owned_by": "kvtrace"}]})

    async def health(request: Request) -> Any:
        return _json(200, {"status": "ok", "model": config.model, "slots": engine.n_slots,
                           "active": worker.running, "queued": worker.queued, "max_seq_len": engine.max_seq_len})

    async def metrics_route(request: Request) -> Any:
        if not authorized(request):
            return _error(ApiError("missing or wrong API key (Authorization: Bearer <key>)", status=401,
                                   code="invalid_api_key"))
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException) -> Any:
        what = {404: "not found", 405: "method not allowed"}.get(exc.status_code, exc.detail)
        return _json(exc.status_code, protocol.error_body(
            f"{request.method} {request.url.path}: {what}. Endpoints: POST /v1/chat/completions, POST /tokenize, POST "
            "/detokenize, POST "
            "/v1/completions, GET /v1/models, GET /health, GET /metrics"))

    async def server_error(request: Request, exc: Exception) -> Any:
        return _json(500, protocol.error_body(f"internal error: {type(exc).__name__}: {exc}", type_="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        worker.start()
        # llguidance's view of the tokenizer (~0.3 s for 49k tokens), built beside the first requests rather than
        # inside the first one with a response_format or tools, which would hold up every stream meanwhile
        threading.Thread(target=renderer.warm, name="kvtrace-grammar-warm", daemon=True).start()
        try:
            yield
        finally:
            worker.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", generation("chat", protocol.chat_request, True), methods=["POST"]),
            Route("/v1/completions", generation("completions", protocol.completion_request, False), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokens_route("tokenize"), methods=["POST"]),
            Route("/detokenize", tokens_route("detokenize"), methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.worker, app.state.metrics, app.state.engine = worker, metrics, engine
    return app


def app_for(artifact: Any, *, max_seq_len: int | None = None, api_key: str | None = None, max_queue: int = 64,
            model: str | None = None, prefill_chunk: int | None = None, prefix_cache: bool = True) -> Any:
    """The application serving a loaded ``Artifact`` (its slots, tokenizer and chat template);
    ``prefill_chunk``: prompt tokens per prefill call between decode steps (None: whole prompts);
    ``prefix_cache``: freed slots keep their conversations for prompts that begin alike (``SlotEngine``)."""
    m = artifact.manifest
    tok = artifact.tokenizer()
    if tok is None:
        raise UsageError(f"{artifact.path} has no tokenizer, so it cannot be served over text; export it from a model "
                         "source that has one")
    engine = artifact.slot_engine(max_seq_len=max_seq_len, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache)
    temperature = m.generation.get("temperature") or 0.0
    renderer = Renderer(tok, m.chat_template, m.bos_id, m.eos_ids, temperature=float(temperature))
    name = model or m.model_name or artifact.path.stem
    return make_app(engine, renderer, ServeConfig(model=name, api_key=api_key, max_queue=max_queue))


def serve(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
          on_ready: Callable[[str], None] | None = None) -> None:
    """Run ``app`` with uvicorn until interrupted (Ctrl-C or SIGTERM); ``on_ready(url)`` once it listens.

    The model loop runs on this (the calling) thread — the one that loaded the programs, see ``serve.worker`` —
    and uvicorn's event loop on a thread of its own; Ctrl-C / SIGTERM stop the model loop (every request in
    flight is answered "shutting down"), then uvicorn shuts down."""
    try:
        import uvicorn
    except ImportError as e:
        raise UsageError("kvtrace serve needs uvicorn and starlette: pip install 'kvtrace[serve]'") from e

    worker: Worker = app.state.worker
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    if on_ready is not None:
        startup = server.startup

        async def announce(sockets: Any = None) -> None:
            await startup(sockets=sockets)
            if server.started:
                on_ready(f"http://{host}:{port}")

        server.startup = announce  # type: ignore[method-assign]
    failed: list[BaseException] = []

    def http() -> None:
        try:
            server.run()
        except BaseException as e:  # handed to the calling thread, raised there
            failed.append(e)
        finally:
            worker.stop()  # the server is gone (shut down, or it never started): end the model loop

    worker.hold()  # the lifespan must not start a model thread: this thread is it
    thread = threading.Thread(target=http, name="kvtrace-http", daemon=True)
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    on_term = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None  # as Ctrl-C does
    try:
        thread.start()
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, on_term)
        server.should_exit = True
        thread.join()
    if failed and isinstance(failed[0], OSError):
        e = failed[0]
        raise UsageError(f"could not listen on {host}:{port} ({e.strerror or e}); pick another --port") from e
    if failed and not isinstance(failed[0], SystemExit):
        raise failed[0]
    if not server.started:
        raise UsageError(f"could not start the server on {host}:{port} (is the port in use?); pick another --port")
