"""The worker's adapters: every decoder Linear gets the LoRA method (layer.py) with `max_loras` empty
slots; the scheduler says, step by step, which adapter to put in which slot (SchedulerOutput.lora_loads),
and each step's rows carry their sequence's adapter key, mapped here to its slot.

Adapters read from disk stay in host memory (an LRU of `max_cpu_loras`), so a slot refilled with an
adapter used before costs a copy, not a file read.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from common.lora import LoRATargets
from gpu_worker.layers.linear import Linear
from gpu_worker.lora.adapter_weights import AdapterTensors, load_adapter_tensors
from gpu_worker.lora.delta import LoRABatch
from gpu_worker.lora.layer import LoRALinearMethod, LoRAStep

log = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, num_layers: int, max_loras: int, max_rank: int, max_cpu_loras: int,
                 device: torch.device, dtype: torch.dtype):
        self.num_layers, self.max_loras, self.max_rank = num_layers, max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.device, self.dtype = device, dtype
        self.step = LoRAStep()
        self.layers: dict[str, Linear] = {}
        self.targets: LoRATargets = {}
        for path, m in model.named_modules():
            if isinstance(m, Linear) and path.startswith("layers."):
                m.method = LoRALinearMethod(m.method, self.step)
                m.method.attach(m, max_loras, max_rank, device, dtype)
                self.layers[path] = m
                for shard, (lo, hi) in m.shard_ranges.items():
                    self.targets[f"{shard}_proj" if shard else path.rsplit(".", 1)[-1]] = (m.in_features, hi - lo)
        self.slot_of: dict[int, int] = {}                         # adapter key -> slot
        self.failed: set[int] = set()     # keys whose load failed: a step scheduled before the scheduler heard
                                          # may still carry their rows (keys are never reused)
        self.host: OrderedDict[int, AdapterTensors] = OrderedDict()

    def reset(self) -> None:
        """Empty every slot and the host copies: a restarted scheduler numbers its adapters from 1 again."""
        for slot in range(self.max_loras):
            for layer in self.layers.values():
                layer.method.fill_slot(layer, slot, {})
        self.slot_of.clear()
        self.failed.clear()
        self.host.clear()

    # ---- slots -------------------------------------------------------------------------------
    def load(self, loads: list[tuple[int, int, str]]) -> dict[int, str]:
        """Fill each (slot, key, folder): the adapter that held the slot is gone from it. An adapter this
        worker cannot read (its folder gone or different here) leaves the slot empty and is returned as
        {key: reason}: its rows run on the base model this step and the scheduler fails its requests."""
        failed: dict[int, str] = {}
        for slot, key, path in loads:
            try:
                tensors = self._host_copy(key, path)
            except Exception as e:      # LoRAError, or an unreadable file: never the whole step's fault
                log.error("LoRA adapter %d from %s cannot be loaded: %s", key, path, e)
                failed[key], tensors = f"the LoRA adapter could not be loaded on the worker: {e}", {}
            for old in [k for k, s in self.slot_of.items() if s == slot]:
                del self.slot_of[old]
            for module, layer in self.layers.items():
                layer.method.fill_slot(layer, slot, tensors.get(module, {}))
            if key not in failed:
                self.slot_of[key] = slot
        self.failed |= set(failed)
        return failed

    def _host_copy(self, key: int, path: str) -> AdapterTensors:
        if key in self.host:
            self.host.move_to_end(key)
            return self.host[key]
        tensors = load_adapter_tensors(path, self.targets, self.num_layers, self.max_rank, self.dtype)
        log.info("LoRA adapter %d read from %s", key, path)
        self.host[key] = tensors
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return tensors

    # ---- one step ----------------------------------------------------------------------------
    def begin_step(self, row_keys: torch.Tensor | None) -> None:
        """Point every adapted layer at this step's rows: `row_keys` [T] on the CPU, the adapter key of each
        row (0: the base model)."""
        if row_keys is None:
            self.step.batch = None
            return
        keys, inverse = torch.unique(row_keys, return_inverse=True)
        missing = [k for k in keys.tolist() if k and k not in self.slot_of and k not in self.failed]
        if missing:
            raise RuntimeError(f"adapters {missing} are in this step but in no slot (the scheduler sends a load first)")
        slot_by_key = torch.tensor([self.slot_of.get(k, -1) for k in keys.tolist()])
        self.step.batch = LoRABatch.build(slot_by_key[inverse], self.device)

    def end_step(self) -> None:
        self.step.batch = None
