"""Owns every sequence's block table (device and host) on top of the block pool.

It answers "can this sequence get room for n more tokens?" and does the block bookkeeping for prefix
hits, copy-on-write after a fork, and swapping; the scheduler decides when.
"""
from __future__ import annotations

from scheduler.block_pool import BlockPool
from scheduler.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_host_blocks: int = 0):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.num_host_blocks = num_host_blocks
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}          # seq_id -> device block table
        self.host_tables: dict[str, list[int]] = {}     # seq_id -> host blocks of a swapped-out sequence
        self.num_hashed: dict[str, int] = {}   # leading blocks already registered in the prefix cache

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.host_free)

    def table(self, seq_id: str) -> list[int]:
        return self.tables.get(seq_id, [])

    def host_table(self, seq_id: str) -> list[int]:
        return self.host_tables.get(seq_id, [])

    def on_device(self) -> set[str]:
        """Sequences holding device blocks (a table, possibly empty)."""
        return set(self.tables)

    def swapped_out(self) -> set[str]:
        return set(self.host_tables)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Longest run of cached full blocks prefixing the sequence, never covering its last token."""
        if not self.enable_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        hits = []
        for h in seq.full_block_hashes(self.block_size, seq.num_tokens - 1):
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[int] = ()) -> tuple[list[tuple[int, int]], int] | None:
        """Make room to write tokens [num_computed, num_computed + num_new). Returns the copy-on-write
        (src, dst) pairs and the first table index that changed, or None if the pool is too small."""
        table = self.tables.setdefault(seq.seq_id, [])
        if computed_blocks:
            assert not table, "prefix hits are only taken by a sequence holding no blocks"
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        have = len(table) + len(computed_blocks)
        need_new = max(0, cdiv(end, self.block_size) - have)
        cow = [i for i in range(start // self.block_size, min(cdiv(end, self.block_size), len(table)))
               if self._must_copy(seq, table[i], i)]
        fresh_computed = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if need_new + len(cow) + fresh_computed > self.pool.num_free:
            if not table:
                del self.tables[seq.seq_id]
            return None
        first_changed = len(table)
        if computed_blocks:
            self.pool.incref(list(computed_blocks))
            table.extend(computed_blocks)
            self.num_hashed[seq.seq_id] = len(computed_blocks)
        copies = []
        if cow:
            new_ids = self.pool.allocate(len(cow))
            for i, dst in zip(cow, new_ids):
                copies.append((table[i], dst))
                self.pool.free([table[i]])
                table[i] = dst
            first_changed = cow[0]
            self.num_hashed[seq.seq_id] = min(self.num_hashed.get(seq.seq_id, 0), cow[0])
        table.extend(self.pool.allocate(need_new))
        return copies, first_changed

    def _must_copy(self, seq: Sequence, block_id: int, index: int) -> bool:
        """A block is copied before a write when others read it too, or when it is in the prefix cache
        and this sequence's tokens there differ from what its hash says (a fork of a fork that samples
        a new token inside a cached block): the original stays valid for everyone else."""
        block = self.pool.blocks[block_id]
        if block.ref_cnt > 1:
            return True
        if block.block_hash is None:
            return False
        hashes = seq.full_block_hashes(self.block_size, seq.num_tokens)
        return index >= len(hashes) or hashes[index] != block.block_hash

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that are now full of computed tokens in the prefix cache."""
        if not self.enable_caching or seq.seq_id not in self.tables:
            return
        table = self.tables[seq.seq_id]
        # an in-flight sample's id is not known yet: only blocks of known tokens can be hashed
        hashes = seq.full_block_hashes(self.block_size, min(seq.num_computed_tokens, seq.num_tokens))
        done = self.num_hashed.get(seq.seq_id, 0)
        for i in range(done, min(len(hashes), len(table))):
            self.pool.cache_block(table[i], hashes[i])
        self.num_hashed[seq.seq_id] = max(done, min(len(hashes), len(table)))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes into shared blocks copy first."""
        blocks = list(self.tables[parent.seq_id])
        self.pool.incref(blocks)
        self.tables[child.seq_id] = blocks
        self.num_hashed[child.seq_id] = self.num_hashed.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.seq_id, [])
        self.pool.free(table[::-1])
        self.num_hashed.pop(seq.seq_id, None)
        self.host_free.extend(self.host_tables.pop(seq.seq_id, []))

    # ---- swapping ------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self.table(seq.seq_id)) <= len(self.host_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        table = self.tables.pop(seq.seq_id)
        host = [self.host_free.pop() for _ in table]
        self.host_tables[seq.seq_id] = host
        self.pool.free(table[::-1])
        self.num_hashed.pop(seq.seq_id, None)
        return list(zip(table, host))

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = max(len(self.host_tables[seq.seq_id]),
                   cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size))
        return need <= self.pool.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        host = self.host_tables.pop(seq.seq_id)
        dev = self.pool.allocate(len(host))
        self.tables[seq.seq_id] = dev
        self.host_free.extend(host)
        return list(zip(host, dev))

    # ---- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's or the tables' accounting is broken, whatever happened
        before: used for tests, and cheap enough for a debugging run."""
        self.pool.check_invariants()
        owners = [0] * self.pool.num_blocks
        for seq_id, table in self.tables.items():
            _require(len(set(table)) == len(table), f"{seq_id} holds a block twice: {table}")
            for bid in table:
                owners[bid] += 1
        _require(owners == [self.pool.ref_count(b) for b in range(self.pool.num_blocks)],
                 "ref counts differ from the number of block tables holding each block")
        host_owned = [h for table in self.host_tables.values() for h in table]
        _require(len(host_owned) == len(set(host_owned)), "a host block is owned twice")
        _require(not set(host_owned) & set(self.host_free), "a host block is both free and owned")
        _require(sorted(host_owned + self.host_free) == list(range(self.num_host_blocks)), "a host block is lost")
        _require(not set(self.tables) & set(self.host_tables), "a sequence is both on device and swapped out")

    def check_all_free(self) -> None:
        """Nothing is held any more: every device and host block is back in its pool."""
        self.check_invariants()
        _require(not self.tables and not self.host_tables, f"tables left: {list(self.tables)} {list(self.host_tables)}")
        _require(self.pool.num_free == self.pool.num_blocks, "a device block is still referenced")
        _require(len(self.host_free) == self.num_host_blocks, "a host block is still held")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
