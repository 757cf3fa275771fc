"""Prefix-cache block identity: a chained cryptographic digest, plus the block's own key as a guard.

A cached block is shared with any request whose prefix maps to the same key, so the key must not be
forgeable: Python's `hash()` of a tuple of ints is unkeyed and invertible, and prompts can be crafted to
collide with another user's blocks (vLLM's CVE-2025-25183). A block's digest is SHA-256 (or BLAKE2b
keyed with a per-process random key) over its parent's digest and its token ids; the first block chains
from a root that names the LoRA adapter (or none), so blocks computed under different weights never
meet.

The digest is not trusted alone. Equality also compares the block's tokens and its parent's digest, and
each key links to its parent's key object (`parent_key`): a prefix walk accepts a cached block only if
its parent key *is* the key of the block matched just before (KVCacheManager.get_computed_blocks). By
induction the whole token prefix then matches, so even a forged digest collision cannot share KV between
different prefixes; it can only cost a miss.
"""
from __future__ import annotations

import hashlib
import os
from array import array
from typing import Callable, Sequence

from common.config import HASH_ALGOS

DEFAULT_HASH_ALGO = HASH_ALGOS[0]


class BlockHash:
    """One full block's identity. Hashable as the digest's first 8 bytes; equal only when the digest, the
    parent's digest (the root, for a first block) and the token ids all agree. `parent_key`: the key of
    the block before it (None for a first block), compared by identity in a prefix walk."""
    __slots__ = ("digest", "parent", "tokens", "parent_key", "_h")

    def __init__(self, digest: bytes, parent: bytes, tokens: tuple[int, ...], parent_key: "BlockHash | None"):
        self.digest, self.parent, self.tokens, self.parent_key = digest, parent, tokens, parent_key
        self._h = int.from_bytes(digest[:8], "little", signed=True)

    def __hash__(self) -> int:
        return self._h

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BlockHash) and self.digest == other.digest and self.parent == other.parent
                and self.tokens == other.tokens)

    def __repr__(self) -> str:
        return f"BlockHash({self.digest[:6].hex()}, {len(self.tokens)} tokens)"


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo in ("sha256", "sha256_cbor"):
        return lambda data: hashlib.sha256(data).digest()
    if algo == "blake2b":
        key = os.urandom(32)
        return lambda data: hashlib.blake2b(data, key=key, digest_size=32).digest()
    raise ValueError(f"--prefix-caching-hash-algo {algo!r}: expected one of {', '.join(HASH_ALGOS)}")


class BlockHasher:
    """Computes chained block hashes with one algorithm (fixed for the scheduler's life)."""

    def __init__(self, algo: str = DEFAULT_HASH_ALGO):
        self.algo = algo
        self.digest = _digest_fn(algo)

    @staticmethod
    def root(lora_key: int | None) -> bytes:
        """What the first block chains from: empty for the base model, else the adapter's registration
        key (never reused by another adapter), as plain bytes that no digest collision can forge."""
        return b"" if lora_key is None else b"lora:%d" % lora_key

    def __call__(self, parent: "BlockHash | bytes", tokens: Sequence[int]) -> BlockHash:
        """The key of a block holding `tokens` after the block `parent` (or after a root's bytes)."""
        parent_key = parent if isinstance(parent, BlockHash) else None
        prefix = parent.digest if isinstance(parent, BlockHash) else parent
        toks = tuple(tokens)
        # fixed-width fields (a 1-byte parent length, 8 bytes a token) make the encoding unambiguous
        data = bytes((len(prefix),)) + prefix + array("q", toks).tobytes()
        return BlockHash(self.digest(data), prefix, toks, parent_key)
