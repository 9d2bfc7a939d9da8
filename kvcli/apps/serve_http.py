"""The HTTP side of `kvcli serve`: an OpenAI-compatible ASGI app (starlette) over the Engine of kvcli/apps/serve.py.

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions (JSON, or server-sent events with "stream": true:
`chat.completion.chunk` objects, then `data: [DONE]`), POST /v1/completions (the same, `text_completion`).
A request may choose its compression in a body field of its own (as llama-server takes its own fields):

    "kvcli": {"policy": "snapkv", "budget": 256, "policy_args": {"window": 32}}

the server's flags are the defaults; "policy": "full" answers from the whole restored cache. Every answer carries
what the request cost in "kvcli" (prefix_reused_tokens, prefilled_tokens, document_read_tokens, kv_bytes, ...).

One model, several requests in flight: each request goes to the model thread's queue (kvcli/apps/serve_decode.py,
`Scheduler`), which admits it between decode steps while it fits and decodes up to --parallel answers together, one
batch per token; the event loop keeps answering (/health, errors, other clients' streams) meanwhile. A client that
leaves stops its generation at the next step and frees its sequences (streaming: the stream is cancelled, and
`request.is_disconnected()` is asked between tokens; non-streaming: asked every quarter second while it waits); one
that leaves while queued is never begun. Errors are OpenAI's error bodies:
400 (malformed JSON, JSON nested deeper than MAX_DEPTH, a string holding an escaped lone surrogate, a NUL in a
text, unknown model, a bad parameter, a prompt too long), 401 (no or a wrong key when --api-key is set), 404, 405,
413 (a body above --max-body-bytes), 500 (a bug of ours: logged, the server goes on). Before an error answer, the
rest of a body still being sent is read and dropped (bounded: DrainBeforeError), so the client reads the answer.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import sys
import threading
import time
import traceback
import uuid
from dataclasses import replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvcli.apps.serve import BadRequest, Choice, Engine
from kvcli.apps.serve_decode import Scheduler
from kvcli.drivers.reselect import WINDOW_MODES
from kvcli.errors import KvcliError
from kvcli.policies import parse_policy_args


MAX_DEPTH = 100                 # arrays and objects within each other in a request body (400 deeper)
DRAIN_MAX_BYTES = 64 << 20      # a refused body is read and dropped up to this many bytes (or 4x the limit) ...
DRAIN_SECONDS = 30.0            # ... and for this long at most; past either the connection is closed
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(e: ApiError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    # ASCII JSON: a message quoting what a client sent cannot fail to encode
    return Response(json.dumps(e.body()), status_code=e.status, headers=headers, media_type="application/json")


# ---------------------------------------------------------------------------------- request bodies
def _where(path: tuple) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out or "the body"


def _unicode(text: str, path: tuple, what: str = "") -> None:
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise ApiError(400, f"{what}{_where(path)} holds an escaped lone surrogate \\u{ord(bad.group()):04x} (at "
                            f"character {bad.start()}), which is not valid Unicode: send text as UTF-8 (or a "
                            "surrogate pair)", code="invalid_unicode", param=str(path[0]) if path else None)


def _no_nul(text: str, where: str, param: str) -> str:
    at = text.find("\0")
    if at >= 0:
        raise ApiError(400, f"{where} holds a NUL character (\\u0000, at character {at}): kvcli serve does not pass it "
                            "to the model's tokenizer", code="invalid_text", param=param)
    return text


def parse_json(data: bytes):
    """The body's JSON, refused (400) when it is not JSON, is nested deeper than MAX_DEPTH, or holds a string that is
    not Unicode text (an escaped lone surrogate, "\\udcff": no tokenizer takes it). Walked without recursion, so
    that nothing after it recurses deeper than MAX_DEPTH into a request."""
    try:
        body = json.loads(data)
    except RecursionError:   # the C scanner's recursion guard, some hundreds of levels deep
        raise ApiError(400, f"the body is nested deeper than {MAX_DEPTH} levels of arrays and objects",
                       code="invalid_json") from None
    except ValueError as e:   # UnicodeDecodeError (not UTF-8) too
        if "integer string conversion" in str(e):   # Python's own guard, not the client's concern
            raise ApiError(400, f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits",
                           code="invalid_json") from None
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if isinstance(body, str):
        _unicode(body, ())
    stack = [(body, ())] if isinstance(body, (dict, list)) else []
    while stack:
        v, path = stack.pop()
        if len(path) >= MAX_DEPTH:
            raise ApiError(400, f"the body is nested deeper than {MAX_DEPTH} levels of arrays and objects",
                           code="invalid_json", param=str(path[0]))
        for k, x in v.items() if isinstance(v, dict) else enumerate(v):
            if isinstance(k, str):
                _unicode(k, path, "a key in ")
            if isinstance(x, str):
                _unicode(x, (*path, k))
            elif isinstance(x, (dict, list)):
                stack.append((x, (*path, k)))
    return body


def _number(body: dict, name: str, lo: float, hi: float, integer: bool = False):
    v = body.get(name)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or (isinstance(v, float) and not math.isfinite(v)) or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"'{name}' must be {kind} in [{lo}, {hi}], got {json.dumps(v)[:40]}", param=name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > 16 or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of at most 16 strings", param="stop")
    return [s for s in stops if s]


def _policy_args(v) -> dict:
    if not isinstance(v, dict):
        raise ApiError(400, "'kvcli.policy_args' must be an object", param="kvcli")
    items = []
    for k, x in v.items():
        if isinstance(x, bool):
            x = "true" if x else "false"
        elif isinstance(x, list):
            x = ",".join(str(y) for y in x)
        elif not isinstance(x, (str, int, float)):
            raise ApiError(400, f"'kvcli.policy_args.{k}' must be a string, a number or a list", param="kvcli")
        items.append(f"{k}={x}")
    try:
        return parse_policy_args(items)
    except KvcliError as e:
        raise ApiError(400, str(e), param="kvcli") from None


def parse_choice(body: dict, defaults: Choice) -> Choice:
    """The request's compression and sampling over the server's defaults (400 for a bad value)."""
    c = defaults
    ext = body.get("kvcli")
    if ext is not None:
        if not isinstance(ext, dict) or set(ext) - {"policy", "budget", "policy_args", "cite", "window_from"}:
            raise ApiError(400, "'kvcli' must be an object with 'policy', 'budget', 'policy_args', 'cite' and/or "
                           "'window_from'", param="kvcli")
        if not isinstance(ext.get("cite", False), bool):
            raise ApiError(400, "'kvcli.cite' must be true or false", param="kvcli")
        if ext.get("window_from", c.window_from) not in WINDOW_MODES:
            raise ApiError(400, f"'kvcli.window_from' must be one of {', '.join(WINDOW_MODES)}", param="kvcli")
        policy = ext.get("policy", c.policy)
        if not isinstance(policy, str) or not policy:
            raise ApiError(400, "'kvcli.policy' must be a policy name (kvcli policies lists them)", param="kvcli")
        policy = policy.lower()
        # the flags' --policy-arg belong to the flags' policy: another policy starts from its own defaults
        args = _policy_args(ext["policy_args"]) if "policy_args" in ext else \
            (c.policy_args if policy == c.policy else {})
        budget = ext.get("budget", c.budget)
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ApiError(400, "'kvcli.budget' must be a positive integer", param="kvcli")
        c = replace(c, policy=policy, budget=None if policy == "full" else budget, policy_args=args,
                    cite=ext.get("cite", False), window_from=ext.get("window_from", c.window_from))
    if not isinstance(body.get("ignore_eos", False), bool):
        raise ApiError(400, "'ignore_eos' must be true or false", param="ignore_eos")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", 1, 100000, integer=True)
    n = _number(body, "n", 1, 1, integer=True)   # one answer per request
    del n
    if body.get("logprobs") or body.get("echo") or body.get("best_of", 1) not in (1, None):
        raise ApiError(400, "logprobs, echo and best_of are not supported by kvcli serve", param="logprobs")
    s = c.sampling
    changes = {}
    for name, (lo, hi, integer, field) in {
            "temperature": (0.0, 2.0, False, "temperature"), "top_p": (0.0, 1.0, False, "top_p"),
            "top_k": (0, 1 << 20, True, "top_k"), "min_p": (0.0, 1.0, False, "min_p"),
            "seed": (0, 2 ** 32 - 2, True, "seed"), "presence_penalty": (-2.0, 2.0, False, "presence_penalty"),
            "frequency_penalty": (-2.0, 2.0, False, "frequency_penalty"),
            "repeat_penalty": (0.01, 10.0, False, "repeat_penalty")}.items():
        v = _number(body, name, lo, hi, integer)
        if v is not None:
            changes[field] = v
    try:
        sampling = replace(s, **changes).validate()
    except KvcliError as e:
        raise ApiError(400, str(e)) from None
    return replace(c, max_tokens=max_tokens or c.max_tokens, sampling=sampling, stop=_stop(body),
                   ignore_eos=body.get("ignore_eos", False))


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}] needs a 'role' (system, user, assistant)", param="messages")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported", param="messages")
            content = "".join(_no_nul(p["text"], f"messages[{i}].content[{j}].text", "messages")
                              for j, p in enumerate(content))
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}] needs a 'content' string", param="messages")
        _no_nul(content, f"messages[{i}].content", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def parse_prompt(body: dict) -> str:
    p = body.get("prompt")
    where = "prompt"
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p, where = p[0], "prompt[0]"
    if not isinstance(p, str) or not p:
        raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    return _no_nul(p, where, "prompt")


# ---------------------------------------------------------------------------------- the app
class Server:
    def __init__(self, engine: Engine, *, api_key: str | None = None, max_body_bytes: int = 16 << 20,
                 aliases: tuple[str, ...] = (), log=None):
        self.engine, self.api_key, self.max_body_bytes = engine, api_key, max_body_bytes
        self.names = {engine.model_id, *aliases}
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.scheduler = Scheduler(engine, self.log)   # the model thread
        self.started = int(time.time())

    @property
    def waiting(self) -> int:
        """Requests queued, not begun yet."""
        return self.scheduler.waiting

    # ------------------------------------------------------------------ plumbing
    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if given != f"Bearer {self.api_key}":
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error",
                           "invalid_api_key")

    async def _body(self, request: Request) -> dict:
        """The request's JSON object (400 when it is not one); 413 above --max-body-bytes (the rest of the body is
        read and dropped before the 413 goes out: DrainBeforeError)."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise ApiError(413, f"the request body is {int(length)} bytes, above this server's limit of "
                                f"{self.max_body_bytes} (kvcli serve --max-body-bytes)", code="request_too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body_bytes:
                raise ApiError(413, f"the request body is above this server's limit of {self.max_body_bytes} bytes "
                                    "(kvcli serve --max-body-bytes)", code="request_too_large")
        # parsed and checked off the event loop: a body of many small values takes a while to walk
        body = await asyncio.get_running_loop().run_in_executor(None, parse_json, data)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or model not in self.names):
            raise ApiError(400, f"unknown model '{str(model)[:80]}': this server serves "
                                f"{' or '.join(sorted(self.names))}", code="model_not_found", param="model")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise ApiError(400, "'stream' must be true or false", param="stream")
        return body

    async def _prepare(self, choice: Choice, tokenize, *args) -> list[int]:
        """Render and tokenize (off the event loop, beside a decoding request), checked against the context."""
        loop = asyncio.get_running_loop()
        try:
            prompt = await loop.run_in_executor(None, tokenize, *args)
            self.engine.check_length(prompt, choice)
        except BadRequest as e:
            raise ApiError(400, str(e), code=e.code, param=e.param) from None
        return prompt

    async def _run(self, request: Request, prompt, choice: Choice, on_text=None, cancel: threading.Event = None):
        """Queue the request for the model thread and wait for its answer (None: its client left before its turn);
        a client gone stops it (`cancel`) at its next decode step."""
        cancel = cancel or threading.Event()
        fut = asyncio.wrap_future(self.scheduler.submit(prompt, choice, on_text, cancel.is_set))
        try:
            while not (await asyncio.wait({fut}, timeout=0.25))[0]:
                if await request.is_disconnected():
                    cancel.set()
        except BaseException:   # cancelled (the client left a stream): it stops at its next step, or is never begun
            cancel.set()
            raise
        return fut.result()

    def _timed(self, route: str, answer, started: float, choice: Choice) -> None:
        if answer is None:
            self.log(f"{route}: client left before its turn")
            return
        s = answer.stats
        self.log(f"{route}: {s['prompt_tokens']} prompt tokens ({s['prefix_reused_tokens']} restored, "
                 f"{s['prefilled_tokens']} prefilled, {s['document_read_tokens']} read), "
                 f"{answer.completion_tokens} generated, {choice.policy}"
                 f"{'' if choice.budget is None else f' @ {choice.budget}'}, "
                 f"{time.perf_counter() - started:.2f}s, {answer.finish_reason}")

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: Request):
        return JSONResponse({"status": "ok", "model": self.engine.model_id, "requests": self.engine.requests,
                             "waiting": self.waiting, "decoding": self.scheduler.decoding,
                             "parallel": self.engine.parallel, **self.engine.store.stats()})

    async def models(self, request: Request):
        self._auth(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.engine.model_id, "object": "model", "created": self.started, "owned_by": "kvcli",
             "meta": {"n_ctx": self.engine.n_ctx, "n_ctx_train": self.engine.session.n_ctx_train,
                      "policy": self.engine.defaults.policy, "budget": self.engine.defaults.budget}}]})

    async def chat(self, request: Request):
        return await self._complete(request, chat=True)

    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool):
        self._auth(request)
        started = time.perf_counter()
        body = await self._body(request)
        choice = parse_choice(body, self.engine.defaults)
        try:
            self.engine.check(choice)
        except BadRequest as e:
            raise ApiError(400, str(e), param=e.param) from None
        if chat:
            prompt = await self._prepare(choice, self.engine.chat_prompt, parse_messages(body))
        else:
            prompt = await self._prepare(choice, self.engine.completion_prompt, parse_prompt(body))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        route = "chat" if chat else "completion"
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            return StreamingResponse(self._stream(request, prompt, choice, rid, chat, usage, started, route),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        answer = await self._run(request, prompt, choice)
        self._timed(route, answer, started, choice)
        if answer is None:
            return JSONResponse({}, status_code=499)
        obj = "chat.completion" if chat else "text_completion"
        item = {"index": 0, "finish_reason": answer.finish_reason, "logprobs": None}
        if chat:
            item["message"] = {"role": "assistant", "content": answer.text}
        else:
            item["text"] = answer.text
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": self.engine.model_id,
                             "choices": [item], "usage": _usage(answer), "kvcli": answer.stats,
                             **({} if answer.citations is None else {"citations": answer.citations})})

    async def _stream(self, request, prompt, choice, rid, chat, include_usage, started, route):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict | None = None, text: str | None = None, finish=None, **extra) -> str:
            item = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                item["delta"] = delta or {}
            else:
                item["text"] = text or ""
            return _sse({"id": rid, "object": obj, "created": created, "model": self.engine.model_id,
                         "choices": [item], **extra})

        def on_text(piece: str) -> None:   # in the model thread
            loop.call_soon_threadsafe(queue.put_nowait, piece)

        async def produce():
            try:
                answer = await self._run(request, prompt, choice, on_text, cancel)
                self._timed(route, answer, started, choice)   # here: also when the stream was cancelled
                queue.put_nowait(("done", answer))
            except BaseException as e:   # noqa: BLE001 (handed to the stream, which reports it)
                queue.put_nowait(("error", e))

        task = asyncio.ensure_future(produce())
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            while True:
                item = await queue.get()
                if isinstance(item, str):
                    if await request.is_disconnected():
                        cancel.set()
                        break
                    yield chunk({"content": item}, text=item)
                    continue
                kind, value = item
                if kind == "error":
                    err = value if isinstance(value, ApiError) else _as_api_error(value, self.log)
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"
                    return
                if value is None:
                    return
                yield chunk({}, finish=value.finish_reason, kvcli=value.stats,
                            **({} if value.citations is None else {"citations": value.citations}))
                if include_usage:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": self.engine.model_id,
                                "choices": [], "usage": _usage(value)})
                yield "data: [DONE]\n\n"
                return
        finally:
            if not task.done():   # the client left mid-answer: stop the generation at its next token
                cancel.set()
                self.log(f"{route}: client left: generation stopped")


def _usage(answer) -> dict:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _as_api_error(e: BaseException, log) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, BadRequest):
        return ApiError(400, str(e), code=e.code, param=e.param)
    if isinstance(e, KvcliError):
        return ApiError(400, str(e))
    log("internal error: " + "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip())
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


class DrainBeforeError:
    """ASGI middleware: before an error answer (4xx, 5xx) goes out while the client is still sending its body (a 413,
    a 401, a 404 or 405 of a POST), the rest of the body is read and dropped, so that the client reads the answer. A
    connection closed with its body unread is reset (uvicorn closes it after the answer when the client asked for
    "Connection: close", as urllib does), and the client's send fails before it reads anything. Bounded: up to
    DRAIN_MAX_BYTES (or 4x the body limit) in DRAIN_SECONDS; a body declared larger, or one a client holds back
    until "100 Continue", is not read (the connection is then closed)."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.cap = app, max(DRAIN_MAX_BYTES, 4 * max_body_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"received": False, "done": False}

        async def receive_():
            message = await receive()
            state["received"] = True
            state["done"] = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def send_(message):
            if message["type"] == "http.response.start" and message["status"] >= 400 and not state["done"]:
                await self._drain(scope, receive_, state)
            await send(message)

        await self.app(scope, receive_, send_)

    async def _drain(self, scope, receive, state) -> None:
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if (length.isdigit() and int(length) > self.cap) or (
                not state["received"] and headers.get(b"expect", b"").lower() == b"100-continue"):
            return
        n = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DRAIN_SECONDS):
                while not state["done"] and n <= self.cap:
                    n += len((await receive()).get("body", b""))


def create_app(server: Server) -> Starlette:
    """The ASGI app: the routes, every failure as an OpenAI error body."""

    def guarded(handler):
        async def endpoint(request: Request):
            try:
                return await handler(request)
            except ClientDisconnect:
                return JSONResponse({}, status_code=499)
            except Exception as e:   # noqa: BLE001 (the server never dies of a request)
                return _error_response(_as_api_error(e, server.log))
        return endpoint

    async def http_error(request: Request, exc: HTTPException):
        return _error_response(ApiError(exc.status_code, exc.detail or "error",
                                        "not_found_error" if exc.status_code == 404 else "invalid_request_error"))

    routes = [Route("/health", guarded(server.health), methods=["GET"]),
              Route("/v1/models", guarded(server.models), methods=["GET"]),
              Route("/v1/chat/completions", guarded(server.chat), methods=["POST"]),
              Route("/v1/completions", guarded(server.completions), methods=["POST"])]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.scheduler.close()   # the flights end as cancelled, the queue is dropped

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan,
                     middleware=[Middleware(DrainBeforeError, max_body_bytes=server.max_body_bytes)])
