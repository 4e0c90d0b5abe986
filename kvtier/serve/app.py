"""HTTP side of ``kvtier serve`` (imports fastapi: only loaded with the ``serve`` extra): OpenAI-compatible routes over an :class:`~kvtier.serve.engine.Engine`.

``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true`` = server-sent events in OpenAI's chunk
format, ``data: [DONE]`` last), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Per-request cache settings ride in the body's ``kvtier`` object (``extra_body={"kvtier": {...}}`` in the
``openai`` client), validated as :func:`kvtier.make_cache` validates them. Errors are OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` with 400 (bad input), 404 (unknown model), 429 (queue full,
with ``Retry-After``), 503 (shutting down), 504 (timed out in the queue).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .engine import Engine, GenRequest, QueueFull, ShuttingDown

log = logging.getLogger(__name__)


@dataclass
class ServeSettings:
    """What the server enforces and defaults; validated on construction."""

    served_name: str
    policy: str = "tiered"
    params: dict = field(default_factory=dict)  # the server's default cache parameters (hbm_ratio, ...)
    max_new_tokens: int = 512
    max_prompt_tokens: Optional[int] = None
    position_limit: Optional[int] = None  # the model's max_position_embeddings
    request_timeout_s: float = 600.0
    reasoning: str = "separate"  # "separate": <think> text as reasoning_content; "inline": inside content
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        from ..policies import validate_policy

        self.full_params = validate_policy(self.policy, self.params)
        for name in ("max_new_tokens", "retry_after_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-').removesuffix('-s')} must be an integer >= 1, got {v!r}")
        if self.max_prompt_tokens is not None and (not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens < 1):
            raise ValueError(f"--max-prompt-tokens must be an integer >= 1, got {self.max_prompt_tokens!r}")
        if not isinstance(self.request_timeout_s, (int, float)) or not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout_s!r}")
        if self.reasoning not in ("separate", "inline"):
            raise ValueError(f"--reasoning must be separate or inline, got {self.reasoning!r}")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _schemas():
    """The request bodies (pydantic, imported with the optional extra). Unknown top-level OpenAI fields are
    ignored as OpenAI ignores them; those kvtier cannot honour (``n`` > 1, ``logprobs``, tools) are errors."""
    from pydantic import BaseModel, ConfigDict, Field

    class TextPart(BaseModel):
        model_config = ConfigDict(extra="forbid")
        type: Literal["text"]
        text: str

    class Message(BaseModel):
        model_config = ConfigDict(extra="ignore")
        role: Literal["system", "developer", "user", "assistant"]
        content: Union[str, list[TextPart]]

    class StreamOptions(BaseModel):
        include_usage: bool = False

    class Common(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: Optional[str] = None
        max_tokens: Optional[int] = None
        temperature: float = Field(1.0, ge=0, le=2)
        top_p: float = Field(1.0, gt=0, le=1)
        stream: bool = False
        stream_options: Optional[StreamOptions] = None
        stop: Union[str, list[str], None] = None
        n: int = 1
        seed: Optional[int] = None
        logprobs: Optional[Any] = None
        kvtier: Optional[dict] = None

    class Chat(Common):
        messages: list[Message]
        max_completion_tokens: Optional[int] = None
        tools: Optional[list] = None

    class Completion(Common):
        prompt: str
        echo: bool = False

    return Chat, Completion


class Server:
    """Turns HTTP bodies into engine requests and engine events into OpenAI responses."""

    def __init__(self, engine: Engine, settings: ServeSettings):
        self.engine, self.s = engine, settings
        self.tok = engine.tokenizer
        self.draining = False
        self.created = int(time.time())
        self.counts: dict[tuple[str, int], int] = {}

    # ---- validation -----------------------------------------------------------------------------------
    def cache_settings(self, block: dict | None) -> tuple[str, dict]:
        """The request's policy and parameters: the server's defaults, or the ``kvtier`` block's. Naming a policy
        starts from that policy's defaults; without one the block overrides the server's parameters."""
        from ..policies import validate_policy
        from ..policies import POLICIES

        if block is None:
            return self.s.policy, dict(self.s.params)
        block = dict(block)
        policy = block.pop("policy", None)
        if policy is not None and policy not in POLICIES:
            raise APIError(400, f"kvtier.policy must be one of {', '.join(POLICIES)}, got {policy!r}", "kvtier.policy")
        params = block if policy is not None and policy != self.s.policy else {**self.s.params, **block}
        policy = policy or self.s.policy
        try:
            validate_policy(policy, params)
        except ValueError as e:
            bad = next((k for k in block if f"{k!r}" in str(e) or k in str(e)), None)
            raise APIError(400, f"kvtier: {e}", f"kvtier.{bad}" if bad else "kvtier") from None
        return policy, params

    def build(self, body, chat: bool) -> tuple[GenRequest, str]:
        """A validated engine request (its sink set later) and the prompt text."""
        if body.model is not None and body.model != self.s.served_name:
            raise APIError(404, f"model {body.model!r} is not served here; GET /v1/models lists {self.s.served_name!r}",
                           "model", "model_not_found")
        if body.n != 1:
            raise APIError(400, f"n must be 1 (one completion per request), got {body.n}", "n")
        if body.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", "logprobs")
        if chat:
            if body.tools:
                raise APIError(400, "tools are not supported", "tools")
            if not body.messages:
                raise APIError(400, "messages must hold at least one message", "messages")
            msgs = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                    for m in body.messages]
            if getattr(self.tok, "chat_template", None):
                prompt = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            else:
                prompt = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant: "
            limit_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            where = "messages"
        else:
            if body.echo:
                raise APIError(400, "echo is not supported", "echo")
            prompt, limit_name, max_tokens, where = body.prompt, "max_tokens", body.max_tokens, "prompt"
            if not prompt:
                raise APIError(400, "prompt must not be empty", "prompt")
        ids = self.tok(prompt, add_special_tokens=not chat).input_ids
        if not ids:
            raise APIError(400, f"{where} gives an empty prompt", where)
        if self.s.max_prompt_tokens and len(ids) > self.s.max_prompt_tokens:
            raise APIError(400, f"{where}: the prompt is {len(ids)} tokens; at most {self.s.max_prompt_tokens} "
                           "(--max-prompt-tokens)", where)
        room = (self.s.position_limit - len(ids)) if self.s.position_limit else None
        if room is not None and room < 1:
            raise APIError(400, f"{where}: the prompt is {len(ids)} tokens; the model has {self.s.position_limit} "
                           "positions", where)
        cap = min(self.s.max_new_tokens, room) if room is not None else self.s.max_new_tokens
        if max_tokens is None:
            max_tokens = cap
        elif isinstance(max_tokens, bool) or max_tokens < 1:
            raise APIError(400, f"{limit_name} must be an integer >= 1, got {max_tokens}", limit_name)
        elif max_tokens > cap:
            why = ("--max-new-tokens" if cap == self.s.max_new_tokens else
                   f"the model's {self.s.position_limit} positions minus the {len(ids)}-token prompt")
            raise APIError(400, f"{limit_name} must be <= {cap} ({why}), got {max_tokens}", limit_name)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not x for x in stop):
            raise APIError(400, "stop must be up to 4 non-empty strings", "stop")
        policy, params = self.cache_settings(body.kvtier)
        from .text import prompt_opens_think

        req = GenRequest(prompt_ids=list(ids), max_tokens=int(max_tokens), sink=lambda ev: None, policy=policy,
                         params=params, temperature=float(body.temperature), top_p=float(body.top_p), stop=stop,
                         seed=body.seed,
                         deadline=time.monotonic() + self.s.request_timeout_s,
                         separate_reasoning=self.s.reasoning == "separate" and chat,
                         in_think=chat and prompt_opens_think(prompt))
        return req, prompt

    # ---- responses --------------------------------------------------------------------------------------
    def count(self, endpoint: str, status: int) -> None:
        self.counts[(endpoint, status)] = self.counts.get((endpoint, status), 0) + 1

    def submit(self, req: GenRequest) -> asyncio.Queue:
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "server_error")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(ev, q=q, loop=loop):
            loop.call_soon_threadsafe(q.put_nowait, ev)

        req.sink = sink
        try:
            self.engine.submit(req)
        except QueueFull as e:
            raise APIError(429, f"too many requests: {e}; retry later", None, "rate_limit_error",
                           {"Retry-After": str(self.s.retry_after_s)}) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), None, "server_error") from None
        return q


def create_app(engine: Engine, settings: ServeSettings):
    """The FastAPI application (``engine`` is started on startup and shut down, gracefully, on shutdown)."""
    from contextlib import asynccontextmanager

    from .metrics import render_metrics

    Chat, Completion = _schemas()
    srv = Server(engine, settings)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        srv.draining = True
        await asyncio.to_thread(engine.shutdown, getattr(app.state, "grace_s", 10.0))

    app = FastAPI(title="kvtier", lifespan=lifespan)
    app.state.server = srv

    def error(e: APIError, endpoint: str) -> JSONResponse:
        srv.count(endpoint, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def _parse(request: Request, schema):
        try:
            raw = await request.body()
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        from pydantic import ValidationError

        try:
            return schema.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(x) for x in first.get("loc", ())) or None
            raise APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param) from None

    async def _handle(request: Request, chat: bool):
        endpoint = request.url.path
        try:
            body = await _parse(request, Chat if chat else Completion)
            req, _ = srv.build(body, chat)
            q = srv.submit(req)
        except APIError as e:
            return error(e, endpoint)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            srv.count(endpoint, 200)
            return StreamingResponse(_stream(srv, req, q, rid, chat, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, srv, req, q, rid, chat, endpoint)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.served_name, "object": "model", "created": srv.created,
                                            "owned_by": "kvtier"}]}

    @app.get("/health")
    async def health():
        status = 503 if srv.draining else 200
        return JSONResponse({"status": "draining" if srv.draining else "ok", "model": settings.served_name,
                             "queue": engine.queue_depth, "running": engine.running,
                             "device": str(engine.model.device),
                             "dtype": str(engine.model.dtype).removeprefix("torch.")}, status_code=status)

    @app.get("/metrics")
    async def metrics():
        text, ctype = render_metrics(srv)
        return PlainTextResponse(text, media_type=ctype)

    return app


def _chunk(srv: Server, rid: str, chat: bool, content: str = "", reasoning: str = "", finish: str | None = None,
           role: bool = False) -> dict:
    if chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if content or role:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": _openai_reason(finish)}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": _openai_reason(finish)}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": srv.s.served_name, "choices": [choice]}


def _openai_reason(reason: str | None) -> str | None:
    """OpenAI's clients know stop and length; a timeout ends like a length cut (the usage block says which)."""
    return None if reason is None else ("length" if reason == "timeout" else reason)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(srv: Server, req: GenRequest, q: asyncio.Queue, rid: str, chat: bool, include_usage: bool):
    """Server-sent events for one request; a client that goes away cancels its row (``finally``)."""
    try:
        if chat:
            yield _sse(_chunk(srv, rid, chat, role=True))
        while True:
            ev = await q.get()
            if ev[0] == "delta":
                yield _sse(_chunk(srv, rid, chat, ev[1], ev[2]))
            elif ev[0] == "done":
                usage = dict(ev[2], kvtier=dict(ev[2]["kvtier"], finish_reason=ev[1]))
                yield _sse(_chunk(srv, rid, chat, finish=ev[1]))
                if include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": int(time.time()), "model": srv.s.served_name, "choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
                return
            else:  # an error after the response started: OpenAI streams it as an error object
                yield _sse(APIError(ev[1], ev[2], None, "server_error").body())
                yield "data: [DONE]\n\n"
                return
    finally:
        srv.engine.cancel(req)  # no-op when the row already finished


async def _whole(request, srv: Server, req: GenRequest, q: asyncio.Queue, rid: str, chat: bool, endpoint: str):
    """A non-streamed response; if the client disconnects while waiting, its row is cancelled."""

    content, reasoning = [], []
    try:
        while True:
            try:
                ev = await asyncio.wait_for(q.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    srv.engine.cancel(req)
                    srv.count(endpoint, 499)
                    return JSONResponse({}, status_code=499)
                continue
            if ev[0] == "delta":
                content.append(ev[1])
                reasoning.append(ev[2])
                continue
            if ev[0] == "error":
                e = APIError(ev[1], ev[2], None, "server_error" if ev[1] >= 500 else "invalid_request_error")
                srv.count(endpoint, e.status)
                return JSONResponse(e.body(), status_code=e.status)
            reason, usage = ev[1], dict(ev[2], kvtier=dict(ev[2]["kvtier"], finish_reason=ev[1]))
            break
    finally:
        srv.engine.cancel(req)
    text, thought = "".join(content), "".join(reasoning)
    if chat:
        message: dict = {"role": "assistant", "content": text}
        if req.separate_reasoning:
            message["reasoning_content"] = thought or None
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _openai_reason(reason)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _openai_reason(reason)}
        obj = "text_completion"
    srv.count(endpoint, 200)
    return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": srv.s.served_name,
                         "choices": [choice], "usage": usage})
