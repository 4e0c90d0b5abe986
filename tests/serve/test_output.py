"""RowOutput, the one finish ladder both engines use: end of sequence, stop strings, max_tokens, a client that left,
the deadline; the text flushed at the end (not after a cancel or a stop string); one ending only; and each token's
own text and bytes as the logprobs blocks name it."""

from __future__ import annotations

from kvtier.models import byte_tokenizer
from kvtier.serve.engine import GenRequest
from kvtier.serve.output import RowOutput


def _out(**kw):
    events = []
    req = GenRequest(prompt_ids=[1, 2], max_tokens=kw.pop("max_tokens", 50), sink=events.append, **kw)
    tok = byte_tokenizer()
    return RowOutput(req, tok, {tok.eos_token_id}), events, tok


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_the_ladder():
    out, ev, tok = _out()
    assert [out.push(t, 0.0) for t in _ids(tok, "hi")] == [None, None]
    assert out.push(tok.eos_token_id, 0.0) == "stop" and out.drawn == 3
    out, ev, tok = _out(stop=["lo"])
    reasons = [out.push(t, 0.0) for t in _ids(tok, "hello")]
    assert reasons[-2:] == [None, "stop"] or "stop" in reasons
    out, ev, tok = _out(max_tokens=3)
    assert [out.push(t, 0.0) for t in _ids(tok, "abc")] == [None, None, "length"]
    out, ev, tok = _out(ignore_eos=True, max_tokens=2)
    assert out.push(tok.eos_token_id, 0.0) is None  # decoded through, not sent
    out, ev, tok = _out(deadline=5.0)
    assert out.push(_ids(tok, "a")[0], 6.0) == "timeout"
    out, ev, tok = _out()
    out.req.cancel()
    assert out.push(_ids(tok, "a")[0], 0.0) == "cancelled"
    out, ev, tok = _out()
    assert out.push(_ids(tok, "a")[0], 0.0, cancel_all=True) == "cancelled"


def test_finish_flushes_once_and_fail_after_it_is_a_no_op():
    out, ev, tok = _out()
    for t in _ids(tok, "ok"):
        out.push(t, 0.0)
    assert out.finish("length", {"x": 1}) and not out.finish("stop", {})
    assert not out.fail(500, "late")
    assert ev[-1] == ("done", "length", {"x": 1})
    assert "".join(e[1] for e in ev if e[0] == "delta") == "ok"
    assert out.usage() == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    out, ev, tok = _out()
    assert out.fail(503, "gone") and ev == [("error", 503, "gone")] and not out.finish("stop", {})


def test_a_tokens_text_and_bytes_are_its_own():
    """logprobs blocks name each token by its own bytes: byte-level BPE pieces map back through GPT-2's alphabet (a
    piece of a character keeps its bytes), SentencePiece's '▁' is a space and '<0xE4>' one byte, special tokens
    are empty as the text leaves them out."""
    from kvtier.models import byte_tokenizer
    from kvtier.serve.logprobs import TokenText

    tok = byte_tokenizer()
    text = TokenText(tok)
    ids = tok("naïve 思考").input_ids
    assert text.byte_level and b"".join(bytes(text(i)[1]) for i in ids).decode() == "naïve 思考"
    assert text(tok.eos_token_id) == ("", []) and text(tok.convert_tokens_to_ids("<|im_start|>")) == ("", [])

    class _SP:  # a SentencePiece tokenizer's surface: pieces, no byte-level decoder
        all_special_ids = [0]
        pieces = {0: "<eos>", 1: "\u2581hello", 2: "<0xE4>", 3: "\u00e9t\u00e9"}

        def convert_ids_to_tokens(self, i):
            return self.pieces.get(i)

    sp = TokenText(_SP())
    assert not sp.byte_level
    assert [sp(i) for i in (0, 1, 2, 3, 9)] == [("", []), (" hello", list(b" hello")), ("\ufffd", [0xE4]),
                                              ("\u00e9t\u00e9", list("\u00e9t\u00e9".encode())), ("", [])]
