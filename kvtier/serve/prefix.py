"""The server's prefix cache: the K/V of prompts' whole blocks, keyed by a chained hash of their tokens and a tenant's salt, kept in host memory under a byte limit, least recently used dropped first.

A prompt is cut into blocks of ``block`` tokens; block ``i``'s key hashes the key of block ``i - 1``, the salt and
its own token ids, so one key names one whole prefix (as vLLM's automatic prefix caching keys its blocks). When a
request starts, the longest run of its leading blocks that the store holds is copied into its new cache
(:meth:`kvtier.cache.tiered.KVTierCache.load_prompt`) and only the rest of its prompt is prefilled; at least one
token is always prefilled (the first token's logits). After a row's prompt is in, its blocks that the store lacks
are copied out of its cache (:meth:`~kvtier.cache.tiered.KVTierCache.prompt_kv`), and again when it finishes
(prompt and answer, for the next turn of a chat) if its cache never quantized or destroyed a token.

Rows copy what they take: dropping a block never touches a running request. A chain is dropped from its end
first (a hit refreshes its blocks last to first), so a prefix is never kept without the blocks before it being
the likelier to stay.

The salt isolates tenants: a request's salt is derived from its API key and its ``cache_salt`` field, so one key
never hits another's prefixes (no tenant can time-probe another's prompts).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

#: Tokens per block (vLLM's default block size); a prompt shorter than one block is never stored.
BLOCK_TOKENS = 16
#: Host bytes the store may hold by default (``--prefix-cache-host-bytes``).
DEFAULT_HOST_BYTES = 1 << 30


def salt_of(api_key: str | None, cache_salt: str | None) -> bytes:
    """A request's salt: its API key's digest (the key is never kept) and its ``cache_salt``; b"" for neither."""
    if not api_key and not cache_salt:
        return b""
    h = hashlib.sha256()
    for part in (api_key or "", cache_salt or ""):
        b = part.encode()
        h.update(len(b).to_bytes(8, "little") + b)
    return h.digest()


def block_keys(tokens: list[int], parent: bytes = b"", block: int = BLOCK_TOKENS) -> list[bytes]:
    """One key per whole block of ``tokens`` (a partial last block has none): key ``i`` hashes key ``i - 1`` and
    block ``i``'s token ids; the first block's ``parent`` is the sequence's salt, or, to continue a chain, the key
    of the block before ``tokens``."""
    keys = []
    for s in range(0, len(tokens) - block + 1, block):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens[s : s + block]))
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class PrefixConfig:
    """The prefix cache's settings (``kvtier serve --prefix-cache/--no-prefix-cache``, ``--prefix-cache-host-bytes``,
    ``--prefix-block-tokens``)."""

    enabled: bool = True
    host_bytes: int = DEFAULT_HOST_BYTES
    block: int = BLOCK_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"prefix_cache (--prefix-cache) must be True or False, got {self.enabled!r}")
        for name, v in (("prefix_cache_host_bytes (--prefix-cache-host-bytes)", self.host_bytes),
                        ("prefix_block_tokens (--prefix-block-tokens)", self.block)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


class PrefixStore:
    """Blocks of K/V by key, least recently used first, at most ``host_bytes`` of them.

    A block is a (L, 2, H, block, D) tensor: every layer's K and V of its tokens. Counters: ``queried_tokens``
    (prompt tokens looked up), ``hit_tokens`` (of them found), ``evicted_blocks``, ``stored_blocks``."""

    def __init__(self, host_bytes: int = DEFAULT_HOST_BYTES, block: int = BLOCK_TOKENS) -> None:
        PrefixConfig(True, host_bytes, block)  # the one check of the numbers
        self.host_bytes, self.block = host_bytes, block
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # oldest use first
        self.bytes = 0
        self.queried_tokens = self.hit_tokens = self.evicted_blocks = self.stored_blocks = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, keys: list[bytes], tokens: int) -> int:
        """Tokens of a ``tokens``-token prompt (whose block keys are ``keys``) that the store holds, from its start,
        in whole blocks, leaving at least one token to prefill. Counts nothing (see :meth:`take`)."""
        n = self.missing(keys)
        while n and n * self.block >= tokens:
            n -= 1
        return n * self.block

    def take(self, keys: list[bytes], n_tokens: int, prompt_tokens: int) -> torch.Tensor | None:
        """The K/V of the first ``n_tokens`` (a :meth:`match`), (L, 2, H, n_tokens, D), a new tensor; counts the
        lookup (``prompt_tokens`` queried, ``n_tokens`` hit) and refreshes the blocks (last to first: a chain's end
        is dropped before its start). None for 0 tokens."""
        self.queried_tokens += prompt_tokens
        nb = n_tokens // self.block
        if nb == 0:
            return None
        self.hit_tokens += nb * self.block
        for k in reversed(keys[:nb]):
            self.blocks.move_to_end(k)
        return torch.cat([self.blocks[k] for k in keys[:nb]], dim=3)

    def missing(self, keys: list[bytes]) -> int:
        """Index of the first of ``keys`` the store lacks (``len(keys)``: it holds them all)."""
        for i, k in enumerate(keys):
            if k not in self.blocks:
                return i
        return len(keys)

    def put(self, keys: list[bytes], first: int, kv: torch.Tensor) -> int:
        """Store blocks ``first``, ``first + 1``, ... of ``keys`` from ``kv`` (L, 2, H, n, D), the K/V of those
        blocks' tokens in order (n a multiple of the block size); blocks already held are kept as they are.
        Drops the least recently used blocks to stay within ``host_bytes``; a prefix too large for the store
        keeps its leading blocks that fit. Returns the blocks stored."""
        nb = kv.shape[3] // self.block
        size = kv[:, :, :, : self.block].numel() * kv.element_size()
        nb = min(nb, self.host_bytes // size)  # (more would drop this chain's own first blocks)
        stored = 0
        for j in range(nb):
            key = keys[first + j]
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            piece = kv[:, :, :, j * self.block : (j + 1) * self.block]
            t = torch.empty(piece.shape, dtype=piece.dtype, device="cpu").copy_(piece)  # its own, contiguous
            while self.bytes + size > self.host_bytes:
                self._evict_one()
            self.blocks[key] = t
            self.bytes += size
            stored += 1
        self.stored_blocks += stored
        # the blocks were refreshed or added first to last; refresh them last to first, as a hit does (all of them,
        # those held before included: a chain's end goes before its start)
        for key in reversed(keys[first : first + nb]):
            self.blocks.move_to_end(key)
        return stored

    def _evict_one(self) -> None:
        _, t = self.blocks.popitem(last=False)
        self.bytes -= t.numel() * t.element_size()
        self.evicted_blocks += 1

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0


__all__ = ["BLOCK_TOKENS", "DEFAULT_HOST_BYTES", "PrefixConfig", "PrefixStore", "block_keys", "salt_of"]
