"""`specjax serve`: an OpenAI-compatible HTTP server over the scheduler (Starlette + uvicorn).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`), `GET
/v1/models`, `GET /metrics` (Prometheus), `GET /health`, `GET /specjax/decisions` (the recent
scheduling decisions with their reasons). The same API under `/interactive/v1/...` and
`/batch/v1/...` gives its requests that latency class by default.

Latency class of a request: its `latency_class` field ("interactive" | "batch"; the openai client
sends it with `extra_body`), else the class configured for its API key (`Authorization: Bearer
KEY`, `api_keys` in the serving config), else the route's, else the configured default.

Responses follow OpenAI's shapes; `usage.specjax` carries the request's speculative statistics
(steps, MAL, acceptance, steps per K, queue time, time to first token, preemptions). Sampling
defaults are OpenAI's (temperature 1, top_p 1; `max_tokens` 16 for completions, the config's
`default_max_tokens` for chat); `top_k`, `ignore_eos` and `latency_class` are extensions. Bad
requests get a 400 with `{"error": {"message", "type", "param", "code"}}`; a client that
disconnects has its request cancelled, which frees its row before the next chunk.

Bad input never costs the other clients: a body over `max_request_bytes` (serving config,
default 4 MiB) is refused with a 413 before it is all read; JSON nested too deeply is a 400; and
JSON parsing, the chat template and tokenizing run in a worker thread, so `/health` and the
streams keep answering while a large prompt is tokenized. Message content is encoded as text:
control-token strings typed in a message never become control tokens (specjax/prompt_text.py).

Threads: HTTP handlers run on uvicorn's event loop; the scheduler thread owns the device and
calls back with tokens through `loop.call_soon_threadsafe`. Text is detokenized here,
incrementally (a partial UTF-8 character or a possible stop-string prefix is held back), and
stop strings end a request here (it is cancelled in the scheduler).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from specjax.errors import SpecjaxError, short_repr
from specjax.sampling import SamplingParams
from specjax.server.config import LATENCY_CLASSES
from specjax.server.metrics import CONTENT_TYPE
from specjax.server.scheduler import Request, Scheduler

UNSUPPORTED = {  # field -> value that means "off" (anything else is refused, not ignored)
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None,),
    "tools": (None,),
    "functions": (None,),
    "response_format": (None,),
}


class ApiError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}},
            status_code=self.status,
        )


# ---- request parsing ---------------------------------------------------------------------------


def _number(body: dict, name: str, default, lo=None, hi=None, integer=False, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise ApiError(f"'{name}' must be {'an integer' if integer else 'a number'}, got {short_repr(v)}", name)
    if v != v or v in (float("inf"), float("-inf")):
        raise ApiError(f"'{name}' must be finite, got {short_repr(v)}", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ApiError(f"'{name}' must be in {rng}, got {v!r}", name)
    return int(v) if integer else float(v)


def parse_sampling(body: dict, default_max: int | None) -> tuple[SamplingParams, list[str], bool]:
    """(sampling params, stop strings, whether max_tokens was given) from an OpenAI body."""
    for field, off in UNSUPPORTED.items():
        if field in body and body[field] not in off and body[field] != {} and body[field] != []:
            raise ApiError(f"'{field}' is not supported by this server", field, "unsupported_parameter")
    n = _number(body, "n", 1, integer=True)
    if n != 1:
        raise ApiError(f"only n=1 is supported, got {n}", "n", "unsupported_parameter")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _number(body, "top_k", 0, -1, integer=True)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, None, integer=True)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"'{name}' must be >= 1, got {max_tokens}", name)
    seed = _number(body, "seed", None, 0, 2**63 - 1, integer=True)  # None: a fresh stream per request
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise ApiError("'stop' must be a string or a list of at most 4 strings", "stop")
    if any(s == "" for s in stops):
        raise ApiError("'stop' strings must not be empty", "stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError("'ignore_eos' must be a boolean", "ignore_eos")
    given = max_tokens is not None
    sp = SamplingParams(
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        max_new_tokens=max_tokens if given else max(default_max or 1, 1),
        seed=None if seed is None else seed % 2**32,
        ignore_eos=ignore_eos,
    )
    return sp, stops, given


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ApiError(f"{where}: 'content' must be a string or a list of text parts", "messages")


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a 'role'", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant"):
            raise ApiError(f"messages[{i}]: unsupported role {m['role']!r}", "messages")
        out.append({"role": role, "content": _text_of(m.get("content"), f"messages[{i}]")})
    return out


def parse_prompt(body: dict, vocab: int):
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise ApiError("'prompt' must not be empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if any(t < 0 or t >= vocab for t in p):
            raise ApiError(f"'prompt' token ids must be in [0, {vocab})", "prompt")
        return p
    raise ApiError("'prompt' must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


# ---- text streaming ----------------------------------------------------------------------------


class TextStream:
    """Incremental detokenization with stop strings. `add(ids)` -> (new text, stop hit)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def _text(self) -> tuple[str, bool]:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return (text[: min(hits)], True) if hits else (text, False)

    def add(self, ids: list[int], final: bool = False) -> tuple[str, bool]:
        self.ids += ids
        text, hit = self._text()
        if not hit and not final:
            text = text.rstrip("\ufffd")  # a partial UTF-8 character: wait for its other bytes
            hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
            text = text[: max(len(text) - hold, len(self.sent))]  # could be the start of a stop string
        # Text already sent stays sent (byte-level BPE decoding only appends, so this is exact).
        delta = text[len(self.sent) :] if len(text) > len(self.sent) else ""
        self.sent += delta
        self.stopped = hit
        return delta, hit


# ---- the app -----------------------------------------------------------------------------------


class Api:
    def __init__(self, sched: Scheduler, model, served_name: str):
        self.sched, self.model, self.name = sched, model, served_name
        self.created = int(time.time())
        self.cfg = sched.cfg

    # -- helpers

    async def read_body(self, request: HttpRequest) -> bytes:
        """The request body, refused (413) beyond `max_request_bytes` before it is all read."""
        limit = self.cfg.max_request_bytes
        too_big = ApiError(
            f"request body larger than this server's limit of {limit} bytes", code="request_too_large", status=413
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def body(self, raw: bytes) -> dict:
        try:
            body = json.loads(raw)
        except UnicodeDecodeError:
            raise ApiError("request body is not UTF-8 text", code="invalid_json") from None
        except json.JSONDecodeError as e:
            raise ApiError(
                f"malformed JSON body: {e.msg} (line {e.lineno}, column {e.colno})", code="invalid_json"
            ) from None
        except RecursionError:
            raise ApiError("JSON body nested too deeply", code="invalid_json") from None
        except ValueError as e:  # e.g. an integer of more digits than Python converts
            raise ApiError(f"invalid JSON body: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError("'model' is required (see GET /v1/models)", "model")
        if model != self.name:
            raise ApiError(
                f"model {short_repr(model)} is not served here; available: {self.name!r}", "model", "model_not_found"
            )
        return body

    def latency_class(self, request: HttpRequest, body: dict) -> str:
        cls = body.get("latency_class")
        if cls is not None:
            if cls not in LATENCY_CLASSES:
                raise ApiError(
                    f"'latency_class' must be one of {', '.join(LATENCY_CLASSES)}, got {short_repr(cls)}",
                    "latency_class",
                )
            return cls
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if key in self.cfg.api_keys:
            return self.cfg.api_keys[key]
        return request.scope.get("specjax_class") or self.cfg.default_class

    def make_request(self, request, body, ids: list[int], sp: SamplingParams, given: bool) -> Request:
        ctx = self.sched.engine.max_seq_len
        if len(ids) >= ctx:
            raise ApiError(
                f"the prompt has {len(ids)} tokens; this server's context is {ctx} tokens",
                "messages" if "messages" in body else "prompt",
                "context_length_exceeded",
            )
        if len(ids) + sp.max_new_tokens > ctx:
            if given:
                raise ApiError(
                    f"prompt of {len(ids)} tokens + max_tokens {sp.max_new_tokens} exceeds this "
                    f"server's context of {ctx} tokens",
                    "max_tokens",
                    "context_length_exceeded",
                )
            sp = dataclasses.replace(sp, max_new_tokens=ctx - len(ids))
        return Request(ids, sp, self.latency_class(request, body))

    # -- routes

    async def completions(self, request: HttpRequest) -> Response:
        return await self._handle(request, chat=False)

    async def chat(self, request: HttpRequest) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: HttpRequest, chat: bool) -> Response:
        try:
            raw = await self.read_body(request)
            # JSON parsing, templating and tokenizing cost CPU in proportion to the body (seconds
            # for megabytes): in a worker thread, so the event loop keeps serving other clients.
            req, stream, include_usage, stops = await run_in_threadpool(self._prepare, request, raw, chat)
        except ApiError as e:
            return e.response()
        except SpecjaxError as e:  # sampling values out of range
            return ApiError(str(e)).response()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req.on_event = lambda kind, payload: loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))
        try:
            self.sched.submit(req)
        except ValueError as e:
            return ApiError(str(e)).response()
        except RuntimeError as e:
            return ApiError(str(e), status=503, type="server_error").response()
        text = TextStream(self.model.tokenizer, stops)
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + req.id, "created": int(time.time()), "model": self.name}
        if stream:
            gen = self._stream(request, req, queue, text, meta, chat, include_usage)
            return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._complete(request, req, queue, text, meta, chat)

    def _prepare(self, request: HttpRequest, raw: bytes, chat: bool) -> tuple[Request, bool, bool, list[str]]:
        """(request, stream, include_usage, stop strings) of a body; raises ApiError / SpecjaxError."""
        from specjax.prompts import encode_prompt

        try:
            body = self.body(raw)
            if chat:
                prompt = parse_messages(body)
                sp, stops, given = parse_sampling(body, self.cfg.default_max_tokens)
            else:
                prompt = parse_prompt(body, self.model.config.vocab_size)
                sp, stops, given = parse_sampling(body, 16)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise ApiError("'stream' must be a boolean", "stream")
            opts = body.get("stream_options") or {}
            if not isinstance(opts, dict):
                raise ApiError("'stream_options' must be an object", "stream_options")
            try:
                ids = encode_prompt(self.model, prompt, raw=not chat)
            except SpecjaxError as e:
                raise ApiError(str(e), "messages" if chat else "prompt") from None
            except RecursionError:
                raise
            except Exception as e:  # a chat template that rejects these messages; a tokenizer failure
                what = "cannot apply the chat template" if chat else "cannot tokenize the prompt"
                raise ApiError(
                    f"{what}: {type(e).__name__}: {first_line(e)}", "messages" if chat else "prompt"
                ) from None
            return self.make_request(request, body, ids, sp, given), stream, bool(opts.get("include_usage")), stops
        except RecursionError:
            raise ApiError("request nested too deeply", code="invalid_json") from None

    async def _events(
        self, request: HttpRequest, req: Request, queue: asyncio.Queue, text: TextStream, poll_disconnect: bool
    ):
        """(delta text, finish_reason or None) until the request ends; cancels it on disconnect or
        a stop string. Streaming responses do not poll: Starlette cancels their generator when
        the client goes away (its `finally` cancels the request)."""
        checked = time.monotonic()
        while True:
            try:
                kind, payload = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                kind = None
            if poll_disconnect and time.monotonic() - checked >= 0.5:
                checked = time.monotonic()
                if await request.is_disconnected():
                    self.sched.cancel(req.id)
                    raise ConnectionError("client disconnected")
            if kind is None:
                continue
            if kind == "tokens":
                delta, hit = text.add(payload)
                if hit:
                    self.sched.cancel(req.id, "stop")
                    yield delta, "stop"
                    return
                if delta:
                    yield delta, None
            else:  # done
                if req.finish_reason == "error":
                    raise RuntimeError(req.error or "generation failed")
                if req.finish_reason == "cancelled":
                    raise ConnectionError("cancelled")
                delta, hit = text.add([], final=True)
                yield delta, "stop" if hit else req.finish_reason
                return

    def usage(self, req: Request, text: TextStream) -> dict:
        n_out = len(text.ids)
        return {
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": n_out,
            "total_tokens": len(req.prompt_ids) + n_out,
            "specjax": req.stats(self.sched.engine.drafter_name),
        }

    async def _complete(self, request, req, queue, text, meta, chat) -> Response:
        parts, finish = [], None
        try:
            async for delta, finish in self._events(request, req, queue, text, poll_disconnect=True):
                parts.append(delta)
        except ConnectionError:
            return Response(status_code=499)
        except RuntimeError as e:
            return ApiError(str(e), status=500, type="server_error").response()
        content = "".join(parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return JSONResponse({**meta, "object": obj, "choices": [choice], "usage": self.usage(req, text)})

    async def _stream(self, request, req, queue, text, meta, chat, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish, role=False) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice]})}\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, None, role=True)
            async for delta, finish in self._events(request, req, queue, text, poll_disconnect=False):
                if delta or finish:
                    yield chunk(delta, finish)
            finished = True
            if include_usage:
                yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': self.usage(req, text)})}\n\n"
            yield "data: [DONE]\n\n"
        except ConnectionError:
            finished = True
        except RuntimeError as e:
            finished = True
            err = {"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}
            yield f"data: {json.dumps(err)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream (the generator was closed)
                self.sched.cancel(req.id)

    async def models(self, request: HttpRequest) -> Response:
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "specjax"}
        if "model_id" in request.path_params:
            if request.path_params["model_id"] != self.name:
                return ApiError(
                    f"model {request.path_params['model_id']!r} is not served here",
                    "model",
                    "model_not_found",
                    status=404,
                ).response()
            return JSONResponse(card)
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(self, request: HttpRequest) -> Response:
        return PlainTextResponse(self.sched.metrics.render(), media_type=CONTENT_TYPE)

    async def health(self, request: HttpRequest) -> Response:
        ok = self.sched.alive
        body = {
            "status": "ok" if ok else "unavailable",
            "model": self.name,
            "running": sum(r is not None for r in self.sched.slots),
            "queued": self.sched.queue_depth(),
            "k": self.sched.k,
            "bucket": self.sched.bucket,
            "speculation": self.sched.monitor.snapshot(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def decisions(self, request: HttpRequest) -> Response:
        return JSONResponse({"decisions": self.sched.log.recent()})


def build_app(sched: Scheduler, model, served_name: str) -> Starlette:
    api = Api(sched, model, served_name)

    def with_class(handler, cls):
        async def h(request):
            request.scope["specjax_class"] = cls
            return await handler(request)

        return h

    routes = [
        Route("/health", api.health),
        Route("/metrics", api.metrics),
        Route("/specjax/decisions", api.decisions),
        Route("/v1/models", api.models),
        Route("/v1/models/{model_id:path}", api.models),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
    ]
    for cls in LATENCY_CLASSES:
        routes += [
            Route(f"/{cls}/v1/completions", with_class(api.completions, cls), methods=["POST"]),
            Route(f"/{cls}/v1/chat/completions", with_class(api.chat, cls), methods=["POST"]),
            Route(f"/{cls}/v1/models", api.models),
        ]

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(
            f"{request.method} {request.url.path}: {exc.detail}", code=code, status=exc.status_code
        ).response()

    async def internal_error(request, exc: Exception):
        return ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error").response()

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})


class ServerThread:
    """uvicorn in a background thread on 127.0.0.1 (tests, the load bench). `port=0`: a free one."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > timeout or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def run(sched: Scheduler, model, served_name: str, host: str, port: int, log_level: str = "info") -> Any:
    """Serve until interrupted (the CLI's `specjax serve`)."""
    import uvicorn

    app = build_app(sched, model, served_name)
    uvicorn.run(app, host=host, port=port, log_level=log_level, lifespan="off")
