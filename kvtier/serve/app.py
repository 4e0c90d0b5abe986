"""HTTP side of ``kvtier serve`` (imports fastapi: only loaded with the ``serve`` extra): OpenAI-compatible routes over an engine (:class:`~kvtier.serve.engine.EngineBase`).

``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true`` = server-sent events in OpenAI's chunk
format, ``data: [DONE]`` last), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Per-request cache settings ride in the body's ``kvtier`` object (``extra_body={"kvtier": {...}}`` in the
``openai`` client), validated as :func:`kvtier.make_cache` validates them. Errors are OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` with 400 (bad input), 401 (no or a wrong API key, when the server
has keys), 404 (unknown model), 413 (body over ``--max-body-bytes``), 429 (queue full, with ``Retry-After``), 503
(shutting down), 504 (timed out in the queue). The request and response bodies are pydantic models, so
``/openapi.json`` describes them.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import logging
import re
import time
import uuid
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import HTTPException, RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .engine import EngineBase, GenRequest, NeverFits, QueueFull, ShuttingDown
from .logprobs import TokenText, chat_content, completion_block

log = logging.getLogger(__name__)


@dataclass
class ServeSettings:
    """What the server enforces and defaults; validated on construction."""

    served_name: str
    policy: str = "tiered"
    params: dict = field(default_factory=dict)  # the server's default cache parameters (hbm_ratio, ...)
    # a request's max_tokens cap (--max-new-tokens); None: only the model's positions less the prompt (vLLM's rule:
    # the deadline and the KV budgets protect the server); the default of a request without max_tokens is that room
    max_new_tokens: Optional[int] = None
    max_prompt_tokens: Optional[int] = None
    position_limit: Optional[int] = None  # the model's max_position_embeddings
    request_timeout_s: float = 600.0
    reasoning: str = "separate"  # "separate": <think> text as reasoning_content; "inline": inside content
    retry_after_s: int = 1
    # who may call /v1/* (Bearer keys; none: anyone), and whether /metrics needs a key too; never shown in a repr
    api_keys: tuple = field(default=(), repr=False)
    protect_metrics: bool = False
    # bounds per request
    max_body_bytes: int = 1 << 20  # a larger body is refused with 413 before it is read
    max_messages: int = 512
    max_stop: int = 4  # OpenAI's limit
    max_stop_chars: int = 256
    max_stream_buffer: int = 1024  # deltas waiting for a client that does not read its stream; beyond, the row is cancelled
    # what a request that leaves a sampling field out gets (the model's generation_config and --default-*; any field
    # not here: OpenAI's default), and where they came from, for the startup line
    sampling_defaults: dict = field(default_factory=dict)
    sampling_source: str = "OpenAI's defaults"

    def __post_init__(self) -> None:
        from ..policies import validate_policy
        from ..sampling import OPENAI_DEFAULTS, SamplingParams

        unknown = sorted(set(self.sampling_defaults) - set(OPENAI_DEFAULTS))
        if unknown:
            raise ValueError(f"sampling defaults {unknown} are not sampling fields; known: {sorted(OPENAI_DEFAULTS)}")
        SamplingParams(**{**OPENAI_DEFAULTS, **self.sampling_defaults})

        self.full_params = validate_policy(self.policy, self.params)
        for name in ("max_new_tokens", "retry_after_s"):
            v = getattr(self, name)
            if v is None and name == "max_new_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-').removesuffix('-s')} must be an integer >= 1, got {v!r}")
        if self.max_prompt_tokens is not None and (not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens < 1):
            raise ValueError(f"--max-prompt-tokens must be an integer >= 1, got {self.max_prompt_tokens!r}")
        if not isinstance(self.request_timeout_s, (int, float)) or not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout_s!r}")
        if self.reasoning not in ("separate", "inline"):
            raise ValueError(f"--reasoning must be separate or inline, got {self.reasoning!r}")
        for name in ("max_body_bytes", "max_messages", "max_stop", "max_stop_chars", "max_stream_buffer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        self.api_keys = tuple(self.api_keys)
        for k in self.api_keys:  # the key itself is never echoed
            if not isinstance(k, str) or not k or k != k.strip() or any(c.isspace() or not c.isprintable() for c in k):
                raise ValueError("--api-key must be a non-empty printable string without spaces")
        if not isinstance(self.protect_metrics, bool):
            raise ValueError(f"--protect-metrics must be True or False, got {self.protect_metrics!r}")
        if self.protect_metrics and not self.api_keys:
            raise ValueError("--protect-metrics needs --api-key (or KVTIER_API_KEY)")

    def key_ok(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries one of the keys (compared in constant time, all of them)."""
        import hmac

        scheme, token = _bearer(authorization)
        hits = [hmac.compare_digest(token.encode(), k.encode()) for k in self.api_keys]
        return scheme.lower() == "bearer" and any(hits)


def _bearer(authorization: str | None) -> tuple[str, str]:
    """An ``Authorization`` header's scheme and token (empty strings where missing)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme, token.strip()


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _schemas(settings: ServeSettings):
    """Request and response bodies (pydantic, imported with the optional extra), bounded by ``settings``; they are what
    ``/openapi.json`` publishes. Unknown top-level OpenAI fields are ignored as OpenAI ignores them; those kvtier
    cannot honour (``n`` > 1, ``prompt_logprobs``, tools, ``echo``) are errors named in the message."""
    from pydantic import BaseModel, ConfigDict, Field

    from ..sampling import MAX_LOGPROBS

    long_text = Field(max_length=1 << 22)  # a message or prompt of up to 4 Mi characters (the body limit binds first)

    class TextPart(BaseModel):
        model_config = ConfigDict(extra="forbid")
        type: Literal["text"]
        text: str = long_text

    class Message(BaseModel):
        model_config = ConfigDict(extra="ignore")
        role: Literal["system", "developer", "user", "assistant"]
        content: Union[str, list[TextPart]] = Field(max_length=1 << 22)

    class StreamOptions(BaseModel):
        include_usage: bool = False

    class CacheBlock(BaseModel):
        """Per-request cache settings: a policy (its defaults) or overrides of the server's; any other key is a
        parameter of the policy, checked as ``kvtier.make_cache`` checks it."""
        model_config = ConfigDict(extra="allow")
        policy: Optional[str] = Field(None, max_length=64)
        hbm_ratio: Optional[float] = Field(None, ge=0, le=1)
        evict_ratio: Optional[float] = Field(None, ge=0, le=1)
        quant_ratio: Optional[float] = Field(None, ge=0, le=1)
        budget_ratio: Optional[float] = Field(None, gt=0, le=1)
        budget_tokens: Optional[int] = Field(None, ge=1)

    stop_item = Field(min_length=1, max_length=settings.max_stop_chars)

    class Common(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: Optional[str] = Field(None, max_length=512)
        max_tokens: Optional[int] = Field(None, ge=1)
        temperature: float = Field(1.0, ge=0, le=2)
        top_p: float = Field(1.0, gt=0, le=1)
        stream: bool = False
        stream_options: Optional[StreamOptions] = None
        stop: Union[Annotated[str, stop_item], Annotated[list[Annotated[str, stop_item]],
                                                          Field(max_length=settings.max_stop)], None] = None
        n: int = 1
        seed: Optional[int] = Field(None, ge=-(1 << 63), lt=1 << 64)
        # vLLM's: requests share cached prefixes only with requests of the same API key and the same cache_salt
        cache_salt: Optional[str] = Field(None, min_length=1, max_length=1024)
        ignore_eos: bool = False  # vLLM's extension: decode through end-of-sequence tokens up to max_tokens (load tests)
        min_tokens: Optional[int] = Field(None, ge=0)  # vLLM's extension: no end of sequence before this many tokens
        # sampling beyond temperature and top_p (vLLM's names and ranges; checked by SamplingParams: a bad value is a
        # 400 naming the field; the penalties need the continuous scheduler)
        presence_penalty: Optional[float] = None
        frequency_penalty: Optional[float] = None
        repetition_penalty: Optional[float] = None
        top_k: Optional[int] = None
        min_p: Optional[float] = None
        # fields that would change the output and are not honoured: a value other than the inert one is a 400
        # naming the field (UNHONOURED); user, metadata, store and the like change nothing and are ignored
        logit_bias: Optional[dict] = None
        response_format: Optional[Any] = None
        best_of: Optional[int] = None
        prompt_logprobs: Optional[Any] = None
        guided_json: Optional[Any] = None
        guided_regex: Optional[Any] = None
        guided_choice: Optional[Any] = None
        guided_grammar: Optional[Any] = None
        structured_outputs: Optional[Any] = None
        stop_token_ids: Optional[list] = None
        bad_words: Optional[list] = None
        kvtier: Optional[CacheBlock] = None

    class Chat(Common):
        messages: list[Message] = Field(min_length=1, max_length=settings.max_messages)
        # each token's log-probability (kvtier serve --logprobs-mode: raw_logprobs or processed_logprobs), and with
        # top_logprobs that many likeliest alternatives at each position
        logprobs: Optional[bool] = None
        top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
        max_completion_tokens: Optional[int] = Field(None, ge=1)
        tools: Optional[list] = None
        tool_choice: Optional[Any] = None
        functions: Optional[list] = None
        function_call: Optional[Any] = None

    class Completion(Common):
        prompt: str = Field(min_length=1, max_length=1 << 22)
        logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's, and this many alternatives'
        top_logprobs: Optional[int] = None  # a chat field: here a 400 that says to send logprobs: k
        echo: bool = False
        suffix: Optional[str] = None

    # ---- responses (documented; the routes build plain dicts of these shapes) ----
    class ErrorDetail(BaseModel):
        message: str
        type: str
        param: Optional[str] = None
        code: Union[int, str, None] = None

    class ErrorBody(BaseModel):
        error: ErrorDetail

    class PromptTokensDetails(BaseModel):
        cached_tokens: int  # prompt tokens the prefix cache gave (not computed again)

    class Usage(BaseModel):
        model_config = ConfigDict(extra="allow")
        prompt_tokens: int
        completion_tokens: int
        total_tokens: int
        prompt_tokens_details: Optional[PromptTokensDetails] = None
        kvtier: Optional[dict] = None  # tier tokens, peak device KV, bytes moved, finish reason

    class TopLogprob(BaseModel):
        token: str
        logprob: float  # -9999.0: a token the sampling settings left out (processed_logprobs)
        bytes: Optional[list[int]] = None

    class TokenLogprob(TopLogprob):
        top_logprobs: list[TopLogprob]

    class ChatLogprobs(BaseModel):
        content: Optional[list[TokenLogprob]] = None
        refusal: Optional[list[TokenLogprob]] = None

    class TextLogprobs(BaseModel):
        tokens: list[str]
        token_logprobs: list[float]
        top_logprobs: list[dict[str, float]]
        text_offset: list[int]

    class AssistantMessage(BaseModel):
        role: Literal["assistant"]
        content: str
        reasoning_content: Optional[str] = None

    class ChatChoice(BaseModel):
        index: int
        message: AssistantMessage
        logprobs: Optional[ChatLogprobs] = None
        finish_reason: Optional[str] = None

    class ChatCompletion(BaseModel):
        id: str
        object: Literal["chat.completion"]
        created: int
        model: str
        choices: list[ChatChoice]
        usage: Usage

    class TextChoice(BaseModel):
        index: int
        text: str
        logprobs: Optional[TextLogprobs] = None
        finish_reason: Optional[str] = None

    class TextCompletion(BaseModel):
        id: str
        object: Literal["text_completion"]
        created: int
        model: str
        choices: list[TextChoice]
        usage: Usage

    class ModelCard(BaseModel):
        id: str
        object: Literal["model"]
        created: int
        owned_by: str

    class ModelList(BaseModel):
        object: Literal["list"]
        data: list[ModelCard]

    class Health(BaseModel):
        status: Literal["ok", "draining"]
        model: str
        queue: int
        running: int
        device: str
        dtype: str

    return SimpleNamespace(Chat=Chat, Completion=Completion, ErrorBody=ErrorBody, ChatCompletion=ChatCompletion,
                           TextCompletion=TextCompletion, ModelList=ModelList, Health=Health)


class Server:
    """Turns HTTP bodies into engine requests and engine events into OpenAI responses."""

    def __init__(self, engine: EngineBase, settings: ServeSettings):
        self.engine, self.s = engine, settings
        self.tok = engine.tokenizer
        self.token_text = TokenText(self.tok)  # token ids -> their texts and bytes in logprobs blocks
        self.draining = False
        self.created = int(time.time())
        self.counts: dict[tuple[str, int], int] = {}
        self.peak_buffered = 0  # the most deltas any one response had waiting (bounded by --max-stream-buffer)
        self._outboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _Outbox
        self.stream_cuts = 0  # rows cancelled because their client stopped reading

    # ---- validation -----------------------------------------------------------------------------------
    def cache_settings(self, block: dict | None) -> tuple[str, dict]:
        """The request's policy and parameters: the server's defaults, or the ``kvtier`` block's. Naming a policy
        starts from that policy's defaults; without one the block overrides the server's parameters."""
        from ..policies import POLICIES, validate_policy

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
        logprobs = self.logprobs_asked(body, chat)
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
        caps = [c for c in (self.s.max_new_tokens, room) if c is not None]
        cap = min(caps) if caps else None
        if max_tokens is None:
            max_tokens = cap if cap is not None else UNBOUNDED_DEFAULT_MAX_TOKENS
        elif isinstance(max_tokens, bool) or max_tokens < 1:
            raise APIError(400, f"{limit_name} must be an integer >= 1, got {max_tokens}", limit_name)
        elif cap is not None and max_tokens > cap:
            why = ("--max-new-tokens" if cap == self.s.max_new_tokens else
                   f"the model's {self.s.position_limit} positions minus the {len(ids)}-token prompt")
            raise APIError(400, f"{limit_name} must be <= {cap} ({why}), got {max_tokens}", limit_name)
        for name, inert in _unhonoured(body):
            raise APIError(400, f"{name} is not supported by kvtier serve (it would change the output; send "
                           f"{inert} or leave it out)", name)
        min_tokens = body.min_tokens or 0
        if min_tokens > max_tokens:
            raise APIError(400, f"min_tokens must be <= {limit_name} ({max_tokens}), got {min_tokens}", "min_tokens")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > self.s.max_stop or any(not x or len(x) > self.s.max_stop_chars for x in stop):
            raise APIError(400, f"stop must be up to {self.s.max_stop} non-empty strings of at most "
                           f"{self.s.max_stop_chars} characters", "stop")
        block = body.kvtier.model_dump(exclude_unset=True) if body.kvtier is not None else None
        policy, params = self.cache_settings(block)
        from .text import prompt_opens_think

        # a field the request leaves out (or sends null) takes the server's default: the model's or OpenAI's
        sent = {k for k in body.model_fields_set if getattr(body, k) is not None}
        sampling = {k: getattr(body, k) if k in sent else self.s.sampling_defaults.get(k, getattr(body, k))
                    for k in ("temperature", "top_p", *SAMPLING_FIELDS)}
        sampling = {k: v for k, v in sampling.items() if v is not None}
        penalties = [k for k in ("presence_penalty", "frequency_penalty") if sampling.get(k)] + (
            ["repetition_penalty"] if sampling.get("repetition_penalty", 1) != 1 else [])
        if penalties and not self.engine.penalties:
            raise APIError(400, f"{penalties[0]} is not supported by --scheduler static (it would change the output; "
                           "use --scheduler continuous, the default)", penalties[0])
        req = GenRequest(prompt_ids=list(ids), max_tokens=int(max_tokens), sink=lambda ev: None, policy=policy,
                         params=params, stop=stop, seed=body.seed, ignore_eos=bool(body.ignore_eos), min_tokens=int(min_tokens),
                         logprobs=logprobs,
                         deadline=time.monotonic() + self.s.request_timeout_s,
                         separate_reasoning=self.s.reasoning == "separate" and chat,
                         in_think=chat and prompt_opens_think(prompt), **sampling)
        try:
            req.sampling()
        except ValueError as e:
            name = next((k for k in ("temperature", "top_p", *SAMPLING_FIELDS) if str(e).startswith(k)), "temperature")
            raise APIError(400, str(e), name) from None
        return req, prompt

    def prefix_salt(self, authorization: str | None, cache_salt: str | None) -> bytes:
        """The request's prefix-cache salt (:func:`kvtier.serve.prefix.salt_of`): its API key where the server has
        keys (the route checked it), and its ``cache_salt``."""
        from .prefix import salt_of

        key = _bearer(authorization)[1] if self.s.api_keys else None
        return salt_of(key, cache_salt)

    def logprobs_asked(self, body, chat: bool) -> int | None:
        """How many alternatives each token's logprobs carry (None: the request asks for no logprobs). Chat:
        ``logprobs: true`` and ``top_logprobs`` (which needs it), as OpenAI's; completions: ``logprobs: k``."""
        if chat:
            if not body.logprobs and body.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            k = (body.top_logprobs or 0) if body.logprobs else None
        else:
            if body.top_logprobs:
                raise APIError(400, "top_logprobs is a chat completions field; /v1/completions takes logprobs: k "
                               "(each token's log-probability and its k likeliest alternatives)", "top_logprobs")
            k = body.logprobs
        if k is not None and not self.engine.logprobs:
            raise APIError(400, "logprobs is not supported by --scheduler static (it has no sampling step of its "
                           "own; use --scheduler continuous, the default)", "logprobs")
        return k

    # ---- responses --------------------------------------------------------------------------------------
    def logprobs_block(self, req: GenRequest, chat: bool, entries: list, offset: int = 0) -> dict | None:
        """A choice's ``logprobs``: OpenAI's block for ``entries`` (the tokens' TokenLogprobs), None when the
        request asked for none."""
        if req.logprobs is None:
            return None
        if chat:
            return {"content": chat_content(entries, self.token_text), "refusal": None}
        return completion_block(entries, self.token_text, offset)

    def count(self, endpoint: str, status: int) -> None:
        self.counts[(endpoint, status)] = self.counts.get((endpoint, status), 0) + 1

    def submit(self, req: GenRequest) -> asyncio.Queue:
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "server_error")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        limit, cut = self.s.max_stream_buffer, [False]

        def put(ev):
            # on the event loop: a client that does not read its stream lets deltas pile up here; past the bound the
            # row is cancelled (its cache is freed when its batch ends) and nothing more is queued
            if cut[0]:
                return
            if q.qsize() >= limit:
                cut[0] = True
                self.stream_cuts += 1
                self.engine.cancel(req)
                q.put_nowait(("error", 408, f"the client read too slowly: more than {limit} deltas waited to be "
                                            "sent (--max-stream-buffer); the request was cancelled"))
                return
            q.put_nowait(ev)
            self.peak_buffered = max(self.peak_buffered, q.qsize())

        box = self._outboxes.get(loop)
        if box is None:
            box = self._outboxes[loop] = _Outbox(loop)

        def sink(ev, box=box):  # on the engine thread
            box.send(put, ev)

        req.sink = sink
        try:
            self.engine.submit(req)
        except QueueFull as e:
            raise APIError(429, f"too many requests: {e}; retry later", None, "rate_limit_error",
                           {"Retry-After": str(self.s.retry_after_s)}) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), None, "server_error") from None
        except NeverFits as e:
            raise APIError(400, str(e), "max_tokens" if self.engine.cfg.on_pressure == "queue" else "messages",
                           "invalid_request_error") from None
        return q


class _Outbox:
    """Events from the engine thread on their way to one event loop, which is woken once per batch of them (a
    step's tokens for 32 clients: one wake-up, not 32), each handed to its response's queue in the order sent."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.scheduled = False

    def send(self, put, ev) -> None:  # on the engine thread
        self.items.append((put, ev))
        if not self.scheduled:  # read after the append: a drain that has begun will take the event
            self.scheduled = True
            try:
                self.loop.call_soon_threadsafe(self.drain)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self.scheduled = False
                self.items.clear()

    def drain(self) -> None:  # on the event loop
        self.scheduled = False  # before taking: an event appended from now on schedules another drain
        while self.items:
            put, ev = self.items.popleft()
            put(ev)


class _BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the body is larger than {limit} bytes (--max-body-bytes)")


class _BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes gets 413 — at once when its Content-Length says so (nothing of it
    is read), else as soon as the bytes read pass the limit."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            e = APIError(413, str(_BodyTooLarge(self.limit).detail), None, "invalid_request_error")
            return await JSONResponse(e.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b"")) if msg.get("type") == "http.request" else 0
            if seen > self.limit:
                raise _BodyTooLarge(self.limit)
            return msg

        return await self.app(scope, limited, send)


def create_app(engine: EngineBase, settings: ServeSettings):
    """The FastAPI application (``engine`` is started on startup and shut down, gracefully, on shutdown)."""
    from contextlib import asynccontextmanager

    from fastapi.security import HTTPBearer

    from .metrics import render_metrics

    S = _schemas(settings)
    srv = Server(engine, settings)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        srv.draining = True
        await asyncio.to_thread(engine.shutdown, getattr(app.state, "grace_s", 10.0))

    app = FastAPI(title="kvtier", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible completions decoded with a kvtier cache. Errors are OpenAI's error "
                              "object; `kvtier` in a request body sets that request's cache.")
    app.state.server = srv
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)

    def error(e: APIError, endpoint: str) -> JSONResponse:
        srv.count(endpoint, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error(e, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # 404/405 of unknown routes, 413 of a long body
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error(APIError(e.status_code, str(e.detail), None, kind, dict(e.headers or {})), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors() or [{}]
        # a union (stop: a string or a list) reports one error per branch; the one that is not "wrong type" is the
        # one that says what is wrong, and the branch tags ("list[constrained-str]") are not field names
        first = next((x for x in errors if not str(x.get("type", "")).endswith("_type")), errors[0])
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not re.search(r"[\[\-]", str(x))]
        if first.get("type") == "json_invalid":
            msg, param = f"the body is not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})", None
        elif not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
            msg, param = "the body must be a JSON object", None
        else:
            param = ".".join(loc) or None
            msg = f"{param or 'body'}: {first.get('msg', 'invalid')}"
        return error(APIError(400, msg, param), request.url.path)

    bearer = HTTPBearer(auto_error=False, description="one of the server's --api-key values")

    async def require_key(request: Request, _=Depends(bearer)):
        if not settings.key_ok(request.headers.get("authorization")):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'", None,
                           "invalid_request_error", {"WWW-Authenticate": "Bearer"})

    keyed = [Depends(require_key)] if settings.api_keys else []
    err = {"model": S.ErrorBody}
    failures = {400: {**err, "description": "bad input, named in error.param"}, 404: {**err, "description": "unknown model"},
                413: {**err, "description": "body larger than --max-body-bytes"},
                429: {**err, "description": "the wait list is full (Retry-After)"},
                503: {**err, "description": "shutting down"}, 504: {**err, "description": "timed out in the queue"}}
    if settings.api_keys:
        failures[401] = {**err, "description": "missing or wrong API key"}

    def completion_responses(model):
        return {200: {"model": model, "description": "the completion; with stream=true, server-sent events",
                      "content": {"text/event-stream": {"schema": SSE_EVENT}}}, **failures}

    async def _handle(request: Request, body, chat: bool):
        endpoint = request.url.path
        try:
            req, _ = srv.build(body, chat)
            req.prefix_salt = srv.prefix_salt(request.headers.get("authorization"), body.cache_salt)
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

    def completion_route(path: str, schema, response, chat: bool, name: str):
        async def endpoint(request: Request, body):
            return await _handle(request, body, chat=chat)

        # the body's model is built per server (its bounds are the settings'), so the signature is given as objects:
        # this module's string annotations could not name it
        endpoint.__signature__ = inspect.Signature([
            inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
            inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=schema)])
        endpoint.__name__ = name
        app.add_api_route(path, endpoint, methods=["POST"], dependencies=keyed, responses=completion_responses(response),
                          name=name)

    completion_route("/v1/chat/completions", S.Chat, S.ChatCompletion, True, "chat_completions")
    completion_route("/v1/completions", S.Completion, S.TextCompletion, False, "completions")

    @app.get("/v1/models", dependencies=keyed, response_model=S.ModelList,
             responses={k: v for k, v in failures.items() if k == 401})
    async def models():
        return {"object": "list", "data": [{"id": settings.served_name, "object": "model", "created": srv.created,
                                            "owned_by": "kvtier"}]}

    @app.get("/health", response_model=S.Health, responses={503: {"model": S.Health, "description": "draining"}})
    async def health():
        status = 503 if srv.draining else 200
        return JSONResponse({"status": "draining" if srv.draining else "ok", "model": settings.served_name,
                             "queue": engine.queue_depth, "running": engine.running,
                             "device": str(engine.model.device),
                             "dtype": str(engine.model.dtype).removeprefix("torch.")}, status_code=status)

    @app.get("/metrics", dependencies=keyed if settings.protect_metrics else [],
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text"},
                        **({401: failures[401]} if settings.protect_metrics else {})})
    async def metrics():
        text, ctype = render_metrics(srv)
        return PlainTextResponse(text, media_type=ctype)

    return app


# One server-sent event of a stream, as OpenAPI 3.0/3.1 describe a text/event-stream item (3.2's itemSchema): its
# data is a JSON chunk (chat.completion.chunk or text_completion, or an error object), then the literal [DONE]
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk (the response's shape with a delta), or [DONE]"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}

# Sampling fields beyond temperature and top_p, as GenRequest names them (None in a body: the inert default)
SAMPLING_FIELDS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")

# What a request sent without it would get; a request without max_tokens on a model whose positions are unknown
UNBOUNDED_DEFAULT_MAX_TOKENS = 4096

# Fields kvtier does not honour that would change the output: (name, whether a value is inert, the inert value as
# the message names it). The sampling controls (temperature, top_p, top_k, min_p, the penalties) are honoured.
UNHONOURED = (
    ("logit_bias", lambda v: not v, "{}"),
    ("response_format", lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"), '{"type": "text"}'),
    ("best_of", lambda v: v is None or v == 1, "1"),
    ("prompt_logprobs", lambda v: not v, "null"),
    ("guided_json", lambda v: v is None, "null"),
    ("guided_regex", lambda v: v is None, "null"),
    ("guided_choice", lambda v: v is None, "null"),
    ("guided_grammar", lambda v: v is None, "null"),
    ("structured_outputs", lambda v: v is None, "null"),
    ("stop_token_ids", lambda v: not v, "[]"),
    ("bad_words", lambda v: not v, "[]"),
    ("tool_choice", lambda v: v is None or v == "none", '"none"'),
    ("functions", lambda v: not v, "[]"),
    ("function_call", lambda v: v is None or v == "none", '"none"'),
    ("suffix", lambda v: not v, '""'),
)


def _unhonoured(body):
    """(name, the inert value as a message names it) of each field of ``body`` (chat or completion: each has its own
    fields) set to a value kvtier would not honour."""
    for name, inert, shown in UNHONOURED:
        if hasattr(body, name) and not inert(getattr(body, name)):
            yield name, shown


def _version() -> str:
    from .. import __version__

    return __version__


def _chunk(srv: Server, rid: str, chat: bool, content: str = "", reasoning: str = "", finish: str | None = None,
           role: bool = False, logprobs: dict | None = None) -> dict:
    if chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if content or role or not reasoning:  # a token without text still says so: content ""
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": _openai_reason(finish)}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": content, "logprobs": logprobs, "finish_reason": _openai_reason(finish)}
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
        # the role goes out with the first token (as vLLM's first chunk), not before the prefill: the field's
        # clients time their first chunk as the time to the first token
        role = chat
        offset = 0  # completions' text_offset: the text of the tokens sent so far
        while True:
            ev = await q.get()
            if ev[0] == "delta":
                entries = [ev[3]] if ev[3] is not None else []
                lp = srv.logprobs_block(req, chat, entries, offset)
                if entries:
                    offset += len(srv.token_text(ev[3].token)[0])
                yield _sse(_chunk(srv, rid, chat, ev[1], ev[2], role=role, logprobs=lp))
                role = False
            elif ev[0] == "done":
                usage = dict(ev[2], kvtier=dict(ev[2]["kvtier"], finish_reason=ev[1]))
                if role:  # no text at all: the role, then the end
                    yield _sse(_chunk(srv, rid, chat, role=True))
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

    content, reasoning, entries = [], [], []
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
                if ev[3] is not None:
                    entries.append(ev[3])
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
        choice = {"index": 0, "message": message, "logprobs": srv.logprobs_block(req, chat, entries),
                  "finish_reason": _openai_reason(reason)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": srv.logprobs_block(req, chat, entries),
                  "finish_reason": _openai_reason(reason)}
        obj = "text_completion"
    srv.count(endpoint, 200)
    return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": srv.s.served_name,
                         "choices": [choice], "usage": usage})
