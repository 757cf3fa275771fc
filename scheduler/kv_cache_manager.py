"""Owns every sequence's block table (device and host) on top of the block pool.

It answers "can this sequence get room for n more tokens?" and does the block bookkeeping for prefix
hits, copy-on-write after a fork, and swapping; the scheduler decides when.

A model with sliding-window layers has several KV groups (common/kv_layout.py): a table holds one block
per group for each logical block, interleaved, and a windowed group's blocks that lie wholly before
the window of a sequence's next token are freed as it grows (their entries become NULL_BLOCK), so its
KV use stays bounded by the window. Such models run without prefix caching.
"""
from __future__ import annotations

from common.kv_layout import NULL_BLOCK
from scheduler.block_hash import DEFAULT_HASH_ALGO, BlockHasher
from scheduler.block_pool import BlockPool
from scheduler.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _held(table: list[int]) -> list[int]:
    return [b for b in table if b != NULL_BLOCK]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_host_blocks: int = 0,
                 group_windows: tuple[int | None, ...] = (None,), hash_algo: str = DEFAULT_HASH_ALGO):
        self.block_size = block_size
        self.hasher = BlockHasher(hash_algo)
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        windowed = any(w is not None for w in self.group_windows)
        self.pool = BlockPool(num_blocks, enable_caching and not windowed)
        self.num_host_blocks = num_host_blocks
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}          # seq_id -> device block table
        self.host_tables: dict[str, list[int]] = {}     # seq_id -> host blocks of a swapped-out sequence
        self.num_hashed: dict[str, int] = {}   # leading blocks already registered in the prefix cache
        self.num_released: dict[str, list[int]] = {}   # per group: leading logical blocks freed (windows)

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
        hits: list[int] = []
        prev = None
        for h in seq.full_block_hashes(self.block_size, seq.num_tokens - 1, self.hasher):
            bid = self.pool.lookup(h)
            # equal digest, parent digest and tokens; and chained to the very block matched before, so
            # the whole prefix matches (a colliding digest upstream cannot pass: block_hash.py)
            if bid is None or (stored := self.pool.block_hash(bid)).parent_key is not prev:
                break
            hits.append(bid)
            prev = stored
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
        self._release_outside_windows(seq.seq_id, table, start if seq.kv_keep_from is None
                                      else min(start, seq.kv_keep_from))
        g = self.num_groups
        have = len(table) // g + len(computed_blocks)
        need_new = max(0, cdiv(end, self.block_size) - have) * g
        cow = [i for i in range(start // self.block_size * g, min(cdiv(end, self.block_size) * g, len(table)))
               if table[i] != NULL_BLOCK and self._must_copy(seq, table[i], i)]
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
            seq.adopt_cached_keys([self.pool.block_hash(b) for b in computed_blocks])
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

    def _release_outside_windows(self, seq_id: str, table: list[int], start: int) -> None:
        """Free each windowed group's blocks wholly before the window of token `start`, the first this
        step computes (or the first one a fork will compute): no query of this step or a later one
        reads them."""
        g, bs = self.num_groups, self.block_size
        released = self.num_released.setdefault(seq_id, [0] * g)
        for group, w in enumerate(self.group_windows):
            if w is None:
                continue
            upto = min(len(table) // g, max(0, (start - w + 1) // bs))
            for j in range(released[group] * g + group, upto * g, g):
                if table[j] != NULL_BLOCK:
                    self.pool.free([table[j]])
                    table[j] = NULL_BLOCK
            released[group] = max(released[group], upto)

    def blocks_held(self, seq_id: str) -> list[int]:
        """Per group, the blocks a sequence holds now (its table less the released entries)."""
        table = self.table(seq_id)
        return [len(_held(table[group::self.num_groups])) for group in range(self.num_groups)]

    def _must_copy(self, seq: Sequence, block_id: int, index: int) -> bool:
        """A block is copied before a write when others read it too, or when it is in the prefix cache
        and this sequence's tokens there differ from what its hash says (a fork of a fork that samples
        a new token inside a cached block): the original stays valid for everyone else."""
        block = self.pool.blocks[block_id]
        if block.ref_cnt > 1:
            return True
        if block.block_hash is None:
            return False
        hashes = seq.full_block_hashes(self.block_size, seq.num_tokens, self.hasher)
        return index >= len(hashes) or hashes[index] != block.block_hash

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that are now full of computed tokens in the prefix cache."""
        if not self.enable_caching or seq.seq_id not in self.tables:
            return
        table = self.tables[seq.seq_id]
        # an in-flight sample's id is not known yet: only blocks of known tokens can be hashed
        hashes = seq.full_block_hashes(self.block_size, min(seq.num_computed_tokens, seq.num_tokens), self.hasher)
        done = self.num_hashed.get(seq.seq_id, 0)
        for i in range(done, min(len(hashes), len(table))):
            self.pool.cache_block(table[i], hashes[i])
        self.num_hashed[seq.seq_id] = max(done, min(len(hashes), len(table)))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes into shared blocks copy first."""
        blocks = list(self.tables[parent.seq_id])
        self.pool.incref(_held(blocks))
        self.tables[child.seq_id] = blocks
        self.num_hashed[child.seq_id] = self.num_hashed.get(parent.seq_id, 0)
        # the prompt's keys are the parent's very objects, so blocks the child caches later chain to them;
        # only the blocks whose tokens the child really has (a child may hold a shorter prefix: a key for
        # [1, 2, 3, 4] adopted by a child holding [1, 2, 3] would later name its [1, 2, 3, x] block)
        n = min(parent.num_prompt_tokens, child.num_tokens) // self.block_size
        upto = n * self.block_size
        shared = parent.block_hashes[:n]
        if shared and child.all_token_ids[:upto] == parent.all_token_ids[:upto]:
            child.adopt_cached_keys(shared)
        self.num_released[child.seq_id] = list(self.num_released.get(parent.seq_id, [0] * self.num_groups))

    def free(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.seq_id, [])
        self.pool.free(_held(table)[::-1])
        self.num_hashed.pop(seq.seq_id, None)
        self.num_released.pop(seq.seq_id, None)
        self.host_free.extend(_held(self.host_tables.pop(seq.seq_id, [])))

    # ---- swapping ------------------------------------------------------------------------------
    # Released entries stay NULL_BLOCK on the host and back: only held blocks move.
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(_held(self.table(seq.seq_id))) <= len(self.host_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        table = self.tables.pop(seq.seq_id)
        host = [NULL_BLOCK if b == NULL_BLOCK else self.host_free.pop() for b in table]
        self.host_tables[seq.seq_id] = host
        self.pool.free(_held(table)[::-1])
        self.num_hashed.pop(seq.seq_id, None)
        return [(d, h) for d, h in zip(table, host) if d != NULL_BLOCK]

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        host = self.host_tables[seq.seq_id]
        grow = max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(host) // self.num_groups)
        return len(_held(host)) + grow * self.num_groups <= self.pool.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        host = self.host_tables.pop(seq.seq_id)
        dev = iter(self.pool.allocate(len(_held(host))))
        self.tables[seq.seq_id] = [NULL_BLOCK if h == NULL_BLOCK else next(dev) for h in host]
        self.host_free.extend(_held(host))
        return [(h, d) for h, d in zip(host, self.tables[seq.seq_id]) if h != NULL_BLOCK]

    # ---- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's or the tables' accounting is broken, whatever happened
        before: used for tests, and cheap enough for a debugging run."""
        self.pool.check_invariants()
        owners = [0] * self.pool.num_blocks
        for seq_id, table in self.tables.items():
            held = _held(table)
            _require(len(set(held)) == len(held), f"{seq_id} holds a block twice: {table}")
            _require(len(table) % self.num_groups == 0, f"{seq_id}'s table is not whole logical blocks: {table}")
            for bid in held:
                owners[bid] += 1
        _require(owners == [self.pool.ref_count(b) for b in range(self.pool.num_blocks)],
                 "ref counts differ from the number of block tables holding each block")
        host_owned = [h for table in self.host_tables.values() for h in _held(table)]
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
