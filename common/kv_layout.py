"""How a model's layers share the KV block pool when some layers have sliding windows.

Full-attention layers need every block of a sequence; a windowed layer only the blocks that reach into
its window, so its older blocks can go back to the pool. Layers are therefore split into *groups* of
at most `group_size` layers, each group of one window kind (vLLM's hybrid allocator does the same): a
block id is a slab holding one block of K/V for each slot of a group, so one pool of equal-sized blocks
serves every group, and a group's blocks are freed on its own schedule.

A sequence's block table on the wire is one flat list, the groups interleaved per logical block:
entry i * num_groups + g is group g's block for positions [i * block_size, (i + 1) * block_size).
Every group grows in step (each layer writes every token's K/V); only the windowed groups' entries
are freed early, and become NULL_BLOCK. With one group (any model without windows) the table is
the plain block table.
"""
from __future__ import annotations

from dataclasses import dataclass

NULL_BLOCK = -1     # a windowed group's entry whose block was freed (never read: outside every window)


@dataclass(frozen=True)
class KVCacheLayout:
    group_windows: tuple[int | None, ...]    # per group: its layers' window (None: full attention)
    layer_group: tuple[int, ...]             # per layer: its group
    layer_slot: tuple[int, ...]              # per layer: its index in the group (its cache tensor)
    group_size: int                          # cache tensors: the layers one block id holds

    @classmethod
    def for_windows(cls, windows: list[int | None]) -> "KVCacheLayout":
        """Groups as large as the smallest window kind's layer count, each kind's layers taken in order.
        Where the counts do not divide, a kind's last group is short and its block ids carry unused
        slots (Gemma 3 27B: 10 full and 52 windowed layers make 7 groups of 10, 8 slots of 70 idle);
        groups of the counts' gcd would waste nothing but make 31 groups, each a table per sequence
        to build every step."""
        kinds: dict[int | None, list[int]] = {}
        for layer, w in enumerate(windows):
            kinds.setdefault(w, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        group_windows: list[int | None] = []
        layer_group, layer_slot = [0] * len(windows), [0] * len(windows)
        for w, layers in kinds.items():
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    layer_group[layer], layer_slot[layer] = len(group_windows), slot
                group_windows.append(w)
        return cls(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.group_windows)



def max_blocks_held(group_windows: tuple[int | None, ...], num_tokens: int, block_size: int, max_chunk: int) -> int:
    """The most block ids one sequence of `num_tokens` holds at once: every block in a full group; in a
    windowed group the window behind a step's first token plus the step's chunk."""
    full = -(-num_tokens // block_size)
    return sum(full if w is None else min(full, -(-(w - 1 + max_chunk) // block_size) + 1) for w in group_windows)
