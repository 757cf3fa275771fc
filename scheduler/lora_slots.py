"""Which adapter occupies which of the workers' `--max-loras` slots: a least-recently-used table the
scheduler keeps, so the workers never decide anything and each step says only which slots change.

The scheduler admits a sequence only while the running sequences use at most max_loras distinct
adapters (`admits`), so every adapter of a step can have a slot: placing one evicts the least recently
used adapter that this step does not use.
"""
from __future__ import annotations

from collections import OrderedDict

from scheduler.lora_registry import LoRAAdapter


class LoRASlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # adapter key -> slot, least recently used first
        self.num_loads = 0                                     # slot (re)fills sent to the workers

    @staticmethod
    def admits(adapter: LoRAAdapter | None, running_keys: set[int], max_loras: int) -> bool:
        """Whether a sequence under `adapter` may start running beside adapters `running_keys`; on yes its
        key joins the set."""
        if adapter is None or adapter.key in running_keys:
            return True
        if len(running_keys) >= max_loras:
            return False
        running_keys.add(adapter.key)
        return True

    def place(self, adapter: LoRAAdapter, step_keys: set[int]) -> tuple[int, int, str] | None:
        """Give `adapter` a slot for this step (whose adapters so far are `step_keys`, which it joins).
        Returns the (slot, key, folder) load to send when the adapter was not resident already."""
        step_keys.add(adapter.key)
        if adapter.key in self.slot_of:
            self.slot_of.move_to_end(adapter.key)
            return None
        if len(self.slot_of) < self.max_loras:
            slot = min(set(range(self.max_loras)) - set(self.slot_of.values()))
        else:
            victim = next((k for k in self.slot_of if k not in step_keys), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")
            slot = self.slot_of.pop(victim)
        self.slot_of[adapter.key] = slot
        self.num_loads += 1
        return slot, adapter.key, adapter.path

    def forget(self, key: int) -> None:
        """The adapter is in no slot (a worker failed to load it): a later use loads it afresh."""
        self.slot_of.pop(key, None)
