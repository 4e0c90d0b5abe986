"""Token ids -> streamed text: incremental detokenisation, stop strings, and the ``<think>`` split.

Pure string logic (no model, no HTTP), so the streamed and the non-streamed responses are built by the same code
and are equal by construction; tests compare both with ``tokenizer.decode`` of the whole completion.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Detokenizer:
    """Emits the text of each new token as soon as it is final.

    Decoding a window of the last few tokens, not each token alone: SentencePiece-style tokenizers drop a word's
    leading space when a token is decoded by itself, and byte-level ones need several tokens for one multi-byte
    character (``"\\ufffd"`` until then). ``prefix`` .. ``read`` is text already emitted, decoded again only as
    context for what follows.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character stays as ``"\\ufffd"``, as ``decode`` gives it)."""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):] if len(text) > len(before) else ""


def _held(pending: str, words: list[str]) -> int:
    """Length of the longest suffix of ``pending`` that is a proper prefix of one of ``words`` (it may still grow
    into one, so it must not be sent yet)."""
    best = 0
    for w in words:
        for k in range(min(len(w) - 1, len(pending)), best, -1):
            if pending.endswith(w[:k]):
                best = k
                break
    return best


class Assembler:
    """Splits generated text into ``content`` and ``reasoning_content`` deltas and applies stop strings.

    ``separate``: text between ``<think>`` (opened by the chat template at the end of the prompt, or by the model
    as its first output) and ``</think>`` goes to ``reasoning_content``, as DeepSeek's API returns it; otherwise
    everything is ``content`` (``inline``). Stop strings apply to the whole generated text; the text from a stop
    string on is never sent. Text that may be the start of a tag or of a stop string waits for the next delta.
    """

    def __init__(self, stop: list[str] | None = None, separate: bool = True, in_think: bool = False):
        self.stop = [s for s in (stop or []) if s]
        self.separate = separate
        self.in_think = separate and in_think
        self.started = False  # any text seen yet (a leading <think> only counts before that)
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(content, reasoning) ready to send after ``delta``; ``final`` flushes everything held back."""
        if self.stopped:
            return "", ""
        self.pending += delta
        if self.stop:
            hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.pending = self.pending[:min(hits)]
                self.stopped = final = True
        content, reasoning = [], []
        while self.pending:
            if self.separate and not self.started and not self.in_think:
                head = self.pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self.pending = head[len(THINK_OPEN):]
                    self.in_think = True
                    self.started = True
                    continue
                if not final and THINK_OPEN.startswith(head):
                    break  # may still become <think>
            self.started = True
            if self.in_think:
                i = self.pending.find(THINK_CLOSE)
                if i >= 0:
                    reasoning.append(self.pending[:i])
                    self.pending = self.pending[i + len(THINK_CLOSE):]
                    self.in_think = False
                    continue
            keep = 0 if final else _held(self.pending, self.stop + ([THINK_CLOSE] if self.in_think else []))
            out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            (reasoning if self.in_think else content).append(out)
            break
        return "".join(content), "".join(reasoning)


def prompt_opens_think(prompt: str) -> bool:
    """Whether the chat template left the assistant turn inside ``<think>`` (DeepSeek-R1 distills, QwQ)."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)
