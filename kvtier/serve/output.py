"""One request's output, shared by both engines: its text as it streams (detokenized, stop strings, reasoning split), the finish ladder, and its events."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def safe_sink(req, event: tuple) -> None:
    """Hand ``event`` to the request's sink; a client's loop that is gone drops it."""
    try:
        req.sink(event)
    except Exception:  # the client's loop is gone
        log.debug("request %d: event dropped", req.id)


class RowOutput:
    """What one request has produced and how it ends (both engines' rows).

    :meth:`push` takes each drawn token and returns why the row ends with it, if it does (``stop``: an
    end-of-sequence token or a stop string; ``length``: ``max_tokens``; ``cancelled``; ``timeout``: its deadline);
    :meth:`finish` flushes the text and sends the ``done`` event with the engine's usage block."""

    def __init__(self, req, tokenizer, eos: set[int]) -> None:
        from .text import Assembler, Detokenizer

        self.req, self.eos = req, eos
        self.detok = Detokenizer(tokenizer)
        self.text = Assembler(req.stop, req.separate_reasoning, req.in_think)
        self.drawn = 0  # tokens drawn (an end-of-sequence token included): the usage's completion tokens
        self.done = False

    def push(self, tok: int, now: float, cancel_all: bool = False, logprobs=None) -> str | None:
        """Stream ``tok``'s text (and its :class:`~kvtier.sampling.TokenLogprobs`, when the request asked: with the
        token's own delta); the finish reason if the row ends with it, else None."""
        r = self.req
        self.drawn += 1
        if tok in self.eos and not r.ignore_eos:
            return "stop"
        # one delta per token, its text possibly empty (a piece of a UTF-8 character, text held back while it may
        # start a stop string): the stream's cadence is the decoding's, as vLLM's and OpenAI's streams are (clients
        # time every chunk: skipping empty ones read as gaps of two steps)
        self.send(self.detok.push(tok), every=True, logprobs=logprobs)
        if self.text.stopped:
            return "stop"
        if len(self.detok.ids) >= r.max_tokens:
            return "length"
        if r.cancelled or cancel_all:
            return "cancelled"
        if now > r.deadline:
            return "timeout"
        return None

    def send(self, piece: str, final: bool = False, every: bool = False, logprobs=None) -> None:
        """Feed ``piece`` to the text; a delta event with what comes out (``every``: even when nothing does).
        ``logprobs``: the token's, sent with its delta (a token whose text completes a stop string sends none: it
        is not part of the output)."""
        content, reasoning = self.text.feed(piece, final=final) if piece or final else ("", "")
        if content or reasoning or (every and not self.text.stopped):
            safe_sink(self.req, ("delta", content, reasoning, logprobs))

    def usage(self) -> dict:
        """The usage block's OpenAI part; the engine adds its ``kvtier`` part."""
        n = len(self.req.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": self.drawn, "total_tokens": n + self.drawn}

    def finish(self, reason: str, usage: dict) -> bool:
        """Flush the text (unless cancelled or cut by a stop string) and send ``done``; False if it had ended."""
        if self.done:
            return False
        self.done = True
        if reason != "cancelled" and not self.text.stopped:
            self.send(self.detok.flush(), final=True)
        safe_sink(self.req, ("done", reason, usage))
        return True

    def fail(self, status: int, message: str) -> bool:
        if self.done:
            return False
        self.done = True
        safe_sink(self.req, ("error", status, message))
        return True
