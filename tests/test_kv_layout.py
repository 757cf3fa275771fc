"""KV groups for sliding-window models (common/kv_layout.py): which layers share a block id, and the
most blocks one sequence can hold."""
from __future__ import annotations

import pytest

from common.kv_layout import KVCacheLayout, max_blocks_held

pytestmark = pytest.mark.unit
GEMMA3_27B = ([1024] * 5 + [None]) * 10 + [1024] * 2      # 52 windowed, 10 full layers


@pytest.mark.parametrize("windows,groups,size", [([None] * 4, 1, 4), ([8] * 4, 1, 4), ([8, None, 8], 3, 1),
                                                 ([8, None] * 3, 2, 3), (GEMMA3_27B, 7, 10)])
def test_layers_split_into_groups_of_one_window_kind(windows, groups, size):
    layout = KVCacheLayout.for_windows(windows)
    assert (layout.num_groups, layout.group_size) == (groups, size)
    seen = set()
    for layer, (g, slot) in enumerate(zip(layout.layer_group, layout.layer_slot)):
        assert layout.group_windows[g] == windows[layer] and 0 <= slot < size
        assert (g, slot) not in seen, "two layers share one cache slot of a group"
        seen.add((g, slot))
    assert layout.windowed == any(w is not None for w in windows)


def test_the_most_blocks_a_sequence_holds():
    # full groups hold every block; a windowed one the window behind a chunk plus the chunk
    assert max_blocks_held((None,), 100, 16, 512) == 7
    assert max_blocks_held((8, None), 100, 4, 4) == 25 + (-(-(8 - 1 + 4) // 4) + 1)
    assert max_blocks_held((8,), 10, 4, 512) == 3             # never more than the sequence's own blocks
