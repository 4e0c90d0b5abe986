"""OpenAI's logprobs blocks (chat's ``content`` entries, completions' four lists) from the engine's per-token :class:`~kvtier.sampling.TokenLogprobs`."""

from __future__ import annotations

import math
import re
from functools import lru_cache

# JSON has no -inf: a token the sampling settings left out (processed_logprobs) is sent with this value, as vLLM does
FLOOR = -9999.0


def _value(lp: float) -> float:
    return lp if math.isfinite(lp) else FLOOR


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte -> the byte (bytes that
    print as themselves keep their character; the others are shifted past 255, in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """Each token id's text and UTF-8 bytes as a logprobs block names them (OpenAI's ``token`` and ``bytes``): the
    bytes are the token's own (a byte-level BPE token that holds part of a character has those bytes; its text is
    them decoded with replacement characters; a special token, which the text leaves out, is ``""`` with no bytes),
    cached per id."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}  # (all_special_ids misses added special ones)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or []) | {
            i for i, t in added.items() if getattr(t, "special", False)}
        self._memo: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._memo.get(token)
        if hit is None:
            hit = self._memo[token] = self._text(token)
        return hit

    def _text(self, token: int) -> tuple[str, list[int]]:
        piece = self.tok.convert_ids_to_tokens(token)
        if piece is None:  # an id past the tokenizer's table (a model with a padded vocabulary)
            return "", []
        if token in self.special:  # the text leaves special tokens out (skip_special_tokens): so does the block, as vLLM's
            return "", []
        if self.byte_level:
            table = _byte_level_table()
            data = bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
        else:  # SentencePiece: '▁' is a space, '<0xE4>' a byte (byte fallback)
            m = _BYTE_PIECE.fullmatch(piece)
            data = bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        return data.decode("utf-8", errors="replace"), list(data)


def chat_content(entries: list, text: TokenText) -> list[dict]:
    """Chat's ``logprobs.content``: one entry per token (its text, logprob, bytes and ``top_logprobs``)."""
    out = []
    for e in entries:
        t, b = text(e.token)
        tops = []
        for tok, lp in e.top:
            tt, tb = text(tok)
            tops.append({"token": tt, "logprob": _value(lp), "bytes": tb})
        out.append({"token": t, "logprob": _value(e.logprob), "bytes": b, "top_logprobs": tops})
    return out


def completion_block(entries: list, text: TokenText, offset: int = 0) -> dict:
    """Completions' ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (each a dict of the likeliest
    tokens' texts and the drawn token's, as OpenAI's legacy API and vLLM give) and ``text_offset`` (each token's
    start in the completion's text, counting from ``offset``)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        t, _ = text(e.token)
        tokens.append(t)
        lps.append(_value(e.logprob))
        top: dict[str, float] = {}
        for tok, lp in e.top:  # tokens of one text (pieces of characters, special tokens) keep the likeliest's value
            top.setdefault(text(tok)[0], _value(lp))
        top[t] = _value(e.logprob)  # and the drawn token's text its own
        tops.append(top)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
