"""A pool of fixed-size KV blocks with reference counts and a prefix-cache index.

Freed blocks keep their hash and stay findable until they are reused: the free queue is ordered
least-recently-freed first, so allocation evicts the coldest cached block.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from scheduler.block_hash import BlockHash


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id (a hit compares the tokens too)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise MemoryError(f"asked for {n} blocks, {len(self.free_queue)} free")
        ids = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            blk = self.blocks[bid]
            if blk.block_hash is not None:
                if self.cached.get(blk.block_hash) == bid:
                    del self.cached[blk.block_hash]
                blk.block_hash = None
            blk.ref_cnt = 1
            ids.append(bid)
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Take another reference, reviving a cached block from the free queue if needed."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0:
                del self.free_queue[bid]
            blk.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each. Pass a sequence's blocks tail first so its tail is evicted first."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_cnt <= 0:
                raise RuntimeError(f"block {bid} freed more often than it was taken")
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if not self.enable_caching:
                    blk.block_hash = None
                self.free_queue[bid] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a full, computed block findable by its chained hash (first writer wins)."""
        if not self.enable_caching:
            return
        blk = self.blocks[block_id]
        if blk.block_hash is None:
            blk.block_hash = block_hash
            self.cached.setdefault(block_hash, block_id)

    # ---- read-only views ----------------------------------------------------------------------
    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self.blocks[block_id].block_hash

    def is_free(self, block_id: int) -> bool:
        return block_id in self.free_queue

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order: the next allocation takes the first."""
        return list(self.free_queue)

    def cached_block_ids(self) -> set[int]:
        """Blocks findable by their hash (in use or free)."""
        return set(self.cached.values())

    def check_invariants(self) -> None:
        """Raise AssertionError if reference counts, the free queue or the hash index disagree."""
        refs = [b.ref_cnt for b in self.blocks]
        if any(r < 0 for r in refs):
            raise AssertionError(f"negative reference counts: {refs}")
        if set(self.free_queue) != {b.block_id for b in self.blocks if b.ref_cnt == 0}:
            raise AssertionError("the free queue differs from the blocks nobody references")
        for h, bid in self.cached.items():
            if self.blocks[bid].block_hash != h:
                raise AssertionError(f"block {bid} is indexed under hash {h} but carries {self.blocks[bid].block_hash}")

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        for blk in self.blocks:
            blk.block_hash = None
