"""common.process.freeze_startup_heap: what the server processes (worker, scheduler, router) call once
loaded, so that full collections during steps skip their start-up heap."""
from __future__ import annotations

import gc

import pytest

from common.process import freeze_startup_heap

pytestmark = pytest.mark.unit


class Loaded:
    """Stands for a model or tokenizer object made before the freeze."""


def in_a_generation(obj: object) -> bool:
    return any(o is obj for g in range(3) for o in gc.get_objects(g))


def test_objects_alive_at_the_freeze_leave_the_collected_generations_and_later_garbage_is_still_collected():
    kept = Loaded()
    assert in_a_generation(kept)
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert not in_a_generation(kept)         # a full collection no longer walks it
        frozen = gc.get_freeze_count()
        cycle: list = [Loaded()]
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 2                 # the list and the object in it: made later, collected
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()                            # the rest of the test session collects as before
    assert in_a_generation(kept)
