"""``kvlab serve``'s HTTP side: OpenAI's completions and chat completions (SSE streaming
included), ``/v1/models``, ``/health`` and Prometheus ``/metrics`` under vLLM's names, a
FastAPI app over :class:`~kvlab.serving.online.OnlineEngine` (the engine's one loop on its
own thread). Fields follow OpenAI's API and vLLM's extensions (``top_k``, ``ignore_eos``);
a field the engine does not implement is refused unless it asks for the neutral value.

Bad input never reaches the engine: malformed JSON, an unknown model, a prompt past the
context, ``max_tokens`` <= 0, an unsupported parameter each get a 4xx whose message names
the field, its value and what is allowed. A client that disconnects has its request
cancelled at once (its row freed before the next step)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvlab.engine.sampling import SamplingConfig
from kvlab.serving.online import Event, OnlineEngine, TokenLogprob
from kvlab.serving.prometheus import ServerMetrics

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# accepted only at the value that changes nothing (the engine has no such knob)
NEUTRAL = {"n": 1, "best_of": 1, "repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "min_tokens": 0, "logit_bias": None,
           "suffix": None, "response_format": None, "parallel_tool_calls": None,
           "tools": None, "tool_choice": None}  # fmt: skip
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream",
          "stream_options", "stop", "ignore_eos", "user", *NEUTRAL}  # fmt: skip
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "logprobs"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
MAX_LOGPROBS = 20


class BadRequest(Exception):
    """A request the server refuses: ``status``, the ``param`` at fault, the message."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_response(exc: BadRequest) -> JSONResponse:
    kind = "NotFoundError" if exc.status == 404 else "BadRequestError"
    body = {"message": exc.message, "type": kind, "param": exc.param, "code": exc.status}
    return JSONResponse({"error": body, "object": "error", **body}, status_code=exc.status)


@dataclass
class Server:
    """What the routes share: the engine, the tokenizer, the served name and context."""

    engine: OnlineEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    eos_ids: frozenset[int]
    created: int = field(default_factory=lambda: int(time.time()))


# ---- reading a request ----------------------------------------------------------------------
@dataclass
class Params:
    """A request's generation parameters, checked."""

    max_tokens: int
    sampling: SamplingConfig | None
    stop: list[str]
    eos_ids: frozenset[int] | None
    stream: bool
    include_usage: bool
    logprobs: int | None


async def read_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body is a JSON {type(body).__name__}; allowed: an object")
    return body


def check_fields(body: dict[str, Any], allowed: set[str], server: Server) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(
            f"unsupported parameter {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}",
            unknown[0],
        )
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral and value not in ({}, []):  # {}: no bias
            raise BadRequest(
                f"{name}={value!r} is not supported; allowed: {neutral!r} (or omit it)", name
            )
    model = body.get("model")
    if model is not None and model != server.model_name:
        raise BadRequest(
            f"model={model!r} does not exist; allowed: {server.model_name!r}", "model", 404
        )


def number(body: dict[str, Any], name: str, kind: type, default: Any, low=None, high=None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok or (low is not None and value < low) or (high is not None and value > high):
        limits = ((">=", low), ("<=", high))
        bounds = ", ".join(f"{sign} {bound}" for sign, bound in limits if bound is not None)
        raise BadRequest(f"{name}={value!r} is invalid; allowed: {kind.__name__} {bounds}", name)
    return kind(value)


def read_params(body: dict[str, Any], server: Server, prompt_len: int, chat: bool) -> Params:
    """The generation parameters of ``body`` for a prompt of ``prompt_len`` tokens."""
    room = server.max_model_len - prompt_len
    if room <= 0:
        raise BadRequest(
            f"the prompt has {prompt_len} tokens; allowed: fewer than the context of "
            f"{server.max_model_len} (--max-model-len)",
            "messages" if chat else "prompt",
        )
    name = "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
    default = room if chat else min(DEFAULT_MAX_TOKENS, room)
    max_tokens = number(body, name, int, default, low=1)
    if prompt_len + max_tokens > server.max_model_len:
        raise BadRequest(
            f"{name}={max_tokens} with a prompt of {prompt_len} tokens exceeds the context of "
            f"{server.max_model_len}; allowed: {name} <= {room}",
            name,
        )
    temperature = number(body, "temperature", float, 1.0, low=0.0)  # OpenAI's default
    top_p = number(body, "top_p", float, 1.0, low=0.0, high=1.0)
    if top_p == 0:
        raise BadRequest("top_p=0 is invalid; allowed: 0 < top_p <= 1", "top_p")
    top_k = number(body, "top_k", int, 0, low=-1)
    seed = number(body, "seed", int, 0)
    sampling = SamplingConfig(temperature, max(top_k, 0), top_p, seed)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest(f"stop={body.get('stop')!r} is invalid; allowed: a string or a list "
                         "of non-empty strings", "stop")  # fmt: skip
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream={stream!r} is invalid; allowed: true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest(f"stream_options={options!r} is invalid; allowed: "
                         "{'include_usage': bool}", "stream_options")  # fmt: skip
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos={ignore_eos!r} is invalid; allowed: true or false",
                         "ignore_eos")  # fmt: skip
    logprobs = _logprobs(body, chat)
    return Params(
        max_tokens, sampling, stop, frozenset() if ignore_eos else None, stream,
        bool(options.get("include_usage")), logprobs,
    )  # fmt: skip


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if not chat:
        return number(body, "logprobs", int, None, low=0, high=MAX_LOGPROBS)
    wanted = body.get("logprobs", False)
    if not isinstance(wanted, bool):
        raise BadRequest(f"logprobs={wanted!r} is invalid; allowed: true or false", "logprobs")
    top = number(body, "top_logprobs", int, 0, low=0, high=MAX_LOGPROBS)
    return top if wanted else None


def completion_prompts(body: dict[str, Any], server: Server) -> list[list[int]]:
    """``prompt``: a string, a list of token ids, or a list of either (a batch)."""
    prompt = body.get("prompt")
    bad = BadRequest(
        f"prompt={_short(prompt)} is invalid; allowed: a non-empty string, a list of token "
        "ids, or a list of those",
        "prompt",
    )
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise bad
    out = []
    vocab = len(server.tokenizer)
    for p in prompts:
        if isinstance(p, str) and p:
            out.append(server.tokenizer(p)["input_ids"])
        elif isinstance(p, list) and p and all(_is_id(t) for t in p):
            if max(p) >= vocab or min(p) < 0:
                raise BadRequest(f"prompt token ids must lie in [0, {vocab})", "prompt")
            out.append(list(p))
        else:
            raise bad
    return out


def chat_prompt(body: dict[str, Any], server: Server) -> list[int]:
    """``messages`` through the model's chat template, ready for the assistant's turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    turns = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # OpenAI's content parts: text only
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise BadRequest(f"messages[{i}].content has a part that is not text; "
                                 "allowed: text parts", "messages")  # fmt: skip
            content = "".join(parts)
        if not (
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)
        ):
            raise BadRequest(f"messages[{i}]={_short(m)} is invalid; allowed: "
                             "{'role': str, 'content': str}", "messages")  # fmt: skip
        turns.append({"role": m["role"], "content": content})
    if getattr(server.tokenizer, "chat_template", None) is None:
        raise BadRequest(f"model {server.model_name!r} has no chat template; allowed: "
                         "/v1/completions", "messages")  # fmt: skip
    try:
        text = server.tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                    tokenize=False)  # fmt: skip
    except Exception as exc:  # the template's own checks (roles, order)
        raise BadRequest(f"messages cannot be rendered by the chat template: {exc}",
                         "messages") from None  # fmt: skip
    return server.tokenizer(text, add_special_tokens=False)["input_ids"]


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- running one prompt --------------------------------------------------------------------
class Detokenizer:
    """Text of a growing list of tokens, handed out as deltas. A stop string cuts the text
    where it begins, so the last ``len(longest stop) - 1`` characters are held back until
    the run ends (they may begin one); so is a character whose UTF-8 bytes are not all
    decoded yet."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max(map(len, stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0  # characters handed out
        self.stopped = False

    def add(self, tokens: list[int], final: bool) -> str:
        """The text the run's ``tokens`` add (``final``: the run ends with them)."""
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cuts = [at for at in (text.find(s) for s in self.stop) if at >= 0]
        if cuts:
            text, self.stopped = text[: min(cuts)], True
        end = len(text)
        if not (final or self.stopped):
            end = len(text.rstrip("\ufffd")) - self.hold
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent : end], end
        return delta


@dataclass
class Choice:
    """One prompt's run: its events as they come, its text, finish and token counts."""

    index: int
    prompt: list[int]
    params: Params
    server: Server
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    text: Detokenizer | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    handle: Any = None
    text_all: str = ""  # the whole text, once run to its end (not streamed)

    @property
    def tokens(self) -> list[int]:
        """The tokens generated so far."""
        return self.text.tokens if self.text is not None else []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.text = Detokenizer(self.server.tokenizer, self.params.stop)

        def post(event: Event) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(self.events.put_nowait, event)

        p = self.params
        self.handle = self.server.engine.submit(
            self.prompt, p.max_tokens, post, p.sampling, p.eos_ids, p.logprobs
        )

    async def deltas(self) -> AsyncIterator[tuple[str, list[TokenLogprob]]]:
        """Text deltas (and the log-probabilities of their tokens) until the run ends."""
        while self.finish is None:
            event: Event = await self.events.get()
            if event.error:
                raise RuntimeError(event.error)
            new_logprobs = event.logprobs or []
            self.logprobs += new_logprobs
            delta = self.text.add(event.tokens, final=event.finish is not None)
            if self.text.stopped:
                self.finish = "stop"
                self.server.engine.cancel(self.handle)
            elif event.finish:
                self.finish = event.finish
            if delta or new_logprobs or self.finish:
                yield delta, new_logprobs

    def cancel(self) -> None:
        if self.handle is not None and self.finish is None:
            self.server.engine.cancel(self.handle)
            self.finish = "abort"


def usage(choices: list[Choice]) -> dict[str, int]:
    prompt = sum(len(c.prompt) for c in choices)
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def completion_logprobs(
    server: Server, logprobs: list[TokenLogprob], prompt: list[TokenLogprob] | None,
    first: int | None,
) -> dict[str, Any]:  # fmt: skip
    """OpenAI's legacy ``logprobs`` object: the echoed prompt's (its first token has none)
    and then the generated tokens'."""
    tok = server.tokenizer
    entries: list[TokenLogprob | None] = ([None] if first is not None else []) + (prompt or [])
    entries += logprobs
    ids = ([first] if first is not None else []) + [e.token for e in entries if e is not None]
    strings = [tok.decode([t]) for t in ids]
    offsets, at = [], 0
    for s in strings:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": strings,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [
            None if e is None else {tok.decode([t]): lp for t, lp in e.top} for e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(server: Server, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    tok = server.tokenizer
    return {"content": [
        {"token": tok.decode([e.token]), "logprob": e.logprob,
         "top_logprobs": [{"token": tok.decode([t]), "logprob": lp} for t, lp in e.top]}
        for e in logprobs
    ]}  # fmt: skip


async def prompt_logprobs(server: Server, prompt: list[int], top: int) -> list[TokenLogprob]:
    """The prompt's own log-probabilities (``echo`` with ``logprobs``), on the engine's
    thread between steps."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    server.engine.score(prompt, top, lambda out: loop.call_soon_threadsafe(done.set_result, out))
    out = await done
    if isinstance(out, Exception):
        raise RuntimeError(f"scoring the prompt failed: {out}")
    return out


async def until_done_or_gone(request: Request, work: asyncio.Task) -> bool:
    """Wait for ``work``; False (``work`` cancelled) when the client disconnects first."""
    while not work.done():
        if await request.is_disconnected():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return False
        await asyncio.wait({work}, timeout=0.1)
    return True


# ---- the app -------------------------------------------------------------------------------
def create_app(server: Server, run_engine: bool = True) -> FastAPI:
    """The FastAPI app serving ``server``; ``run_engine``: the app starts the engine's loop
    on a thread of its own and stops it with the app (``kvlab serve`` runs the loop on the
    main thread itself)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if run_engine:
            server.engine.start()
        yield
        if run_engine:
            await asyncio.to_thread(server.engine.stop)

    app = FastAPI(title="kvlab", lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(BadRequest(f"{type(exc).__name__}: {exc}", None, 500))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if server.engine.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": server.model_name, "object": "model", "created": server.created,
                "owned_by": "kvlab", "root": server.model_name,
                "max_model_len": server.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request)
        check_fields(body, COMPLETION_FIELDS, server)
        prompts = completion_prompts(body, server)
        params = [read_params(body, server, len(p), chat=False) for p in prompts]
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise BadRequest(f"echo={echo!r} is invalid; allowed: true or false", "echo")
        if params[0].stream and echo:
            raise BadRequest("echo=true with stream=true is not supported; allowed: one of "
                             "them", "echo")  # fmt: skip
        check_budget(server, prompts, params)
        pairs = enumerate(zip(prompts, params, strict=True))
        choices = [Choice(i, p, q, server) for i, (p, q) in pairs]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": server.model_name}  # fmt: skip
        if params[0].stream:
            return sse(request, choices, head, completion_chunk)
        scored = None
        if echo and params[0].logprobs is not None:
            top = params[0].logprobs
            scored = [await prompt_logprobs(server, c.prompt, top) for c in choices]
        finished = await run_all(request, choices)
        if not finished:
            return Response(status_code=499)
        out = []
        for c in choices:
            text = c.text_all
            item = {"index": c.index, "text": text, "finish_reason": c.finish,
                    "logprobs": None}  # fmt: skip
            if echo:
                item["text"] = server.tokenizer.decode(c.prompt) + text
            if c.params.logprobs is not None:
                item["logprobs"] = completion_logprobs(
                    server, c.logprobs, scored[c.index] if scored else None,
                    c.prompt[0] if echo else None,
                )  # fmt: skip
            out.append(item)
        return JSONResponse(head | {"choices": out, "usage": usage(choices)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await read_body(request)
        check_fields(body, CHAT_FIELDS, server)
        prompt = chat_prompt(body, server)
        params = read_params(body, server, len(prompt), chat=True)
        check_budget(server, [prompt], [params])
        choices = [Choice(0, prompt, params, server)]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": server.model_name}  # fmt: skip
        if params.stream:
            chunk_head = head | {"object": "chat.completion.chunk"}
            return sse(request, choices, chunk_head, chat_chunk)
        if not await run_all(request, choices):
            return Response(status_code=499)
        c = choices[0]
        message = {"role": "assistant", "content": c.text_all}
        item = {"index": 0, "message": message, "finish_reason": c.finish, "logprobs": None}
        if params.logprobs is not None:
            item["logprobs"] = chat_logprobs(server, c.logprobs)
        return JSONResponse(head | {"choices": [item], "usage": usage(choices)})

    return app


def check_budget(server: Server, prompts: list[list[int]], params: list[Params]) -> None:
    """Refuse a request the KV budget cannot hold even alone (it would wait forever)."""
    for prompt, p in zip(prompts, params, strict=True):
        need = server.engine.request_bytes(len(prompt) + p.max_tokens)
        if need > server.engine.idle_free_bytes:
            raise BadRequest(
                f"a prompt of {len(prompt)} tokens with max_tokens={p.max_tokens} needs {need} "
                f"bytes of KV cache and the server's budget holds {server.engine.idle_free_bytes}"
                "; allowed: a shorter request",
                "max_tokens",
            )


async def run_all(request: Request, choices: list[Choice]) -> bool:
    """Run every choice to its end; False when the client went away first (each choice's
    request cancelled)."""

    async def drain(c: Choice) -> None:
        parts = []
        async for delta, _ in c.deltas():
            parts.append(delta)
        c.text_all = "".join(parts)

    for c in choices:
        c.start()
    work = asyncio.ensure_future(asyncio.gather(*(drain(c) for c in choices)))
    try:
        if await until_done_or_gone(request, work):
            work.result()  # an engine error surfaces as a 500
            return True
        return False
    finally:
        for c in choices:
            c.cancel()


def sse(request: Request, choices: list[Choice], head: dict[str, Any], chunk) -> Response:
    """A Server-Sent Events stream of ``chunk(head, choice, delta, logprobs, first)``
    bodies, then usage (when asked) and ``[DONE]``; a disconnect cancels the requests."""

    async def bodies(c: Choice) -> AsyncIterator[dict[str, Any]]:
        first = True
        try:
            async for delta, logprobs in c.deltas():
                yield chunk(head, c, delta, logprobs, first)
                first = False
        except Exception as exc:  # an engine error ends the stream with it
            yield {"error": {"message": str(exc), "code": 500}}

    async def merged() -> AsyncIterator[dict[str, Any]]:
        """Every choice's bodies as they come (n > 1)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            async for body in bodies(c):
                await queue.put(body)
            await queue.put(None)

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        open_choices = len(choices)
        try:
            while open_choices:
                body = await queue.get()
                if body is None:
                    open_choices -= 1
                    continue
                yield body
        finally:  # a client gone mid-stream leaves no pump waiting on its events
            for task in tasks:
                task.cancel()

    async def events() -> AsyncIterator[str]:
        for c in choices:
            c.start()
        try:  # one choice (the common case) streams straight from its events
            async for body in bodies(choices[0]) if len(choices) == 1 else merged():
                yield f"data: {json.dumps(body)}\n\n"
            if choices[0].params.include_usage:
                yield f"data: {json.dumps(head | {'choices': [], 'usage': usage(choices)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # a client gone mid-stream: its requests leave the engine at once
            for c in choices:
                c.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


def completion_chunk(head, c: Choice, delta: str, logprobs, first: bool) -> dict[str, Any]:
    item = {"index": c.index, "text": delta, "finish_reason": c.finish, "logprobs": None}
    if c.params.logprobs is not None:
        item["logprobs"] = completion_logprobs(c.server, logprobs, None, None)
    return head | {"choices": [item]}


def chat_chunk(head, c: Choice, delta: str, logprobs, first: bool) -> dict[str, Any]:
    message = {"role": "assistant", "content": delta} if first else {"content": delta}
    item = {"index": c.index, "delta": message, "finish_reason": c.finish, "logprobs": None}
    if c.params.logprobs is not None:
        item["logprobs"] = chat_logprobs(c.server, logprobs)
    return head | {"choices": [item]}
