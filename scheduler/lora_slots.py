"""Which adapter occupies which of the workers' `--max-loras` slots: a least-recently-used table the
scheduler keeps, so the workers never decide anything and each step says only which slots change.

The scheduler admits a sequence only while the running sequences use at most max_loras distinct
adapters (`admits`), so every adapter of a step can have a slot: once the step is composed, each adapter
not resident evicts the least recently used adapter that the step does not use.
"""
from __future__ import annotations

from collections import OrderedDict

from scheduler.lora_registry import LoRAAdapter


class LoRASlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # adapter key -> slot, least recently used first
        self.num_loads = 0                                     # slot (re)fills sent to the workers

    def admits(self, adapter: LoRAAdapter | None, running_keys: set[int]) -> bool:
        """Whether a sequence under `adapter` may start running beside adapters `running_keys`; on yes its
        key joins the set."""
        if adapter is None or adapter.key in running_keys:
            return True
        if len(running_keys) >= self.max_loras:
            return False
        running_keys.add(adapter.key)
        return True

    def place(self, adapters: list[LoRAAdapter]) -> list[tuple[int, int, str]]:
        """Give every adapter of a step (all of them known: placing them one by one as sequences are
        emitted could evict an adapter that a later sequence of the same step needs) a slot. Returns the
        (slot, key, folder) loads to send, for the adapters that were not resident."""
        step = {a.key: a for a in adapters}
        for key in step.keys() & self.slot_of.keys():
            self.slot_of.move_to_end(key)
        loads = []
        for key, adapter in step.items():
            if key in self.slot_of:
                continue
            free = set(range(self.max_loras)) - set(self.slot_of.values())
            if free:
                slot = min(free)
            else:
                victim = next((k for k in self.slot_of if k not in step), None)
                if victim is None:
                    raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")
                slot = self.slot_of.pop(victim)
            self.slot_of[key] = slot
            loads.append((slot, key, adapter.path))
        self.num_loads += len(loads)
        return loads

    def forget(self, key: int) -> None:
        """The adapter is in no slot (a worker failed to load it): a later use loads it afresh."""
        self.slot_of.pop(key, None)
