"""SequenceGroup: birth of the n - 1 forked choices, aborting one choice or all, and when the group ends."""
from __future__ import annotations

import pytest
from common.sampling_params import SamplingParams
from scheduler.sequence import Sequence, Status
from scheduler.sequence_group import SequenceGroup

pytestmark = pytest.mark.unit


def group(n: int, seed: int | None = None) -> SequenceGroup:
    parent = Sequence(seq_id="r", request_id="r", index=0, prompt_token_ids=[1, 2, 3, 4, 5],
                      sampling_params=SamplingParams(n=n, seed=seed), max_tokens=8, eos_token_ids=frozenset(),
                      seed=seed)
    return SequenceGroup.create(parent, n)


def test_fork_shares_the_computed_prompt_or_waits() -> None:
    g = group(3, seed=10)
    assert g.pending_fork and g.num_seqs_brought(g.parent) == 3
    kids = g.fork(share_blocks=True)
    assert [k.seq_id for k in kids] == ["r#1", "r#2"] and [k.seed for k in kids] == [11, 12]
    assert all(k.num_computed_tokens == 4 and k.status is Status.RUNNING for k in kids)
    assert not g.pending_fork and g.num_seqs_brought(g.parent) == 1 and len(g.seqs) == 3
    waiting = group(2).fork(share_blocks=False)[0]
    assert waiting.num_computed_tokens == 0 and waiting.status is Status.WAITING


def test_abort_of_an_unborn_choice_and_of_the_unforked_parent() -> None:
    g = group(3)
    assert g.abort(2) == ([2], [])
    assert [k.index for k in g.fork(share_blocks=True)] == [1]      # choice 2 is never born
    g = group(3)
    dropped, live = g.abort(0)                                     # takes the unborn choices with it
    assert dropped == [1, 2] and live == [g.parent]


def test_group_finishes_when_no_choice_can_produce_more() -> None:
    g = group(2)
    kid = g.fork(share_blocks=True)[0]
    g.parent.status = Status.FINISHED
    assert not g.is_finished
    kid.status = Status.FINISHED
    assert g.is_finished
    unforked = group(3)
    unforked.parent.status = Status.FINISHED                        # its unborn choices can never be born
    assert unforked.is_finished and not unforked.pending_fork
