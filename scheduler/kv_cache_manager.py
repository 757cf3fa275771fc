"""Owns every sequence's block table (device and host) on top of the block pool.

It answers "can this sequence get room for n more tokens?" and does the block bookkeeping for prefix
hits, copy-on-write after a fork, and swapping; the scheduler decides when.
"""
from __future__ import annotations

from scheduler.block_pool import BlockPool
from scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_host_blocks: int = 0):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.num_host_blocks = num_host_blocks
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}
        self.num_hashed: dict[str, int] = {}   # leading blocks already registered in the prefix cache

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def table(self, req_id: str) -> list[int]:
        return self.tables.get(req_id, [])

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Longest run of cached full blocks prefixing the request, never covering its last token."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        hits = []
        for h in req.full_block_hashes(self.block_size, req.num_tokens - 1):
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] = ()) -> tuple[list[tuple[int, int]], int] | None:
        """Make room to write tokens [num_computed, num_computed + num_new). Returns the copy-on-write
        (src, dst) pairs and the first table index that changed, or None if the pool is too small."""
        table = self.tables.setdefault(req.req_id, [])
        if computed_blocks:
            assert not table, "prefix hits are only taken by a sequence holding no blocks"
        start = req.num_computed_tokens
        end = start + num_new_tokens
        have = len(table) + len(computed_blocks)
        need_new = max(0, cdiv(end, self.block_size) - have)
        cow = [i for i in range(start // self.block_size, min(cdiv(end, self.block_size), len(table)))
               if self.pool.blocks[table[i]].ref_cnt > 1]
        fresh_computed = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if need_new + len(cow) + fresh_computed > self.pool.num_free:
            if not table:
                del self.tables[req.req_id]
            return None
        first_changed = len(table)
        if computed_blocks:
            self.pool.incref(list(computed_blocks))
            table.extend(computed_blocks)
            self.num_hashed[req.req_id] = len(computed_blocks)
        copies = []
        if cow:
            new_ids = self.pool.allocate(len(cow))
            for i, dst in zip(cow, new_ids):
                copies.append((table[i], dst))
                self.pool.free([table[i]])
                table[i] = dst
            first_changed = cow[0]
            self.num_hashed[req.req_id] = min(self.num_hashed.get(req.req_id, 0), cow[0])
        table.extend(self.pool.allocate(need_new))
        return copies, first_changed

    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks that are now full of computed tokens in the prefix cache."""
        if not self.enable_caching or req.req_id not in self.tables:
            return
        table = self.tables[req.req_id]
        # an in-flight sample's id is not known yet: only blocks of known tokens can be hashed
        hashes = req.full_block_hashes(self.block_size, min(req.num_computed_tokens, req.num_tokens))
        done = self.num_hashed.get(req.req_id, 0)
        for i in range(done, min(len(hashes), len(table))):
            self.pool.cache_block(table[i], hashes[i])
        self.num_hashed[req.req_id] = max(done, min(len(hashes), len(table)))

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; writes into shared blocks copy first."""
        blocks = list(self.tables[parent.req_id])
        self.pool.incref(blocks)
        self.tables[child.req_id] = blocks
        self.num_hashed[child.req_id] = self.num_hashed.get(parent.req_id, 0)

    def free(self, req: Request) -> None:
        table = self.tables.pop(req.req_id, [])
        self.pool.free(table[::-1])
        self.num_hashed.pop(req.req_id, None)
        self.host_free.extend(self.host_tables.pop(req.req_id, []))

    # ---- swapping ------------------------------------------------------------------------------
    def can_swap_out(self, req: Request) -> bool:
        return len(self.table(req.req_id)) <= len(self.host_free)

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        table = self.tables.pop(req.req_id)
        host = [self.host_free.pop() for _ in table]
        self.host_tables[req.req_id] = host
        self.pool.free(table[::-1])
        self.num_hashed.pop(req.req_id, None)
        return list(zip(table, host))

    def can_swap_in(self, req: Request, num_new_tokens: int) -> bool:
        need = max(len(self.host_tables[req.req_id]),
                   cdiv(req.num_computed_tokens + num_new_tokens, self.block_size))
        return need <= self.pool.num_free

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        host = self.host_tables.pop(req.req_id)
        dev = self.pool.allocate(len(host))
        self.tables[req.req_id] = dev
        self.host_free.extend(host)
        return list(zip(host, dev))
