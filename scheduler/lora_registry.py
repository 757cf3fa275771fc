"""The adapters this engine serves, by name: those of `--lora-modules`, those loaded at run time over
HTTP, and those the offline API names in a LoRARequest.

Each registration gets a key that is never reused: the workers cache adapters by it and the prefix
cache hashes it into block identities, so an adapter unloaded and loaded again from another folder
under the same name can never be served stale weights or blocks. Unloading removes only the name;
sequences already running keep their `LoRAAdapter` and finish under it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from common.lora import AdapterInfo, LoRAError, LoRARequest, LoRATargets, read_adapter


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    name: str
    key: int                    # >= 1, unique for the engine's life; 0 means the base model
    path: str
    parent: str | None          # base_model_name of --lora-modules' JSON form (shown by /v1/models)
    info: AdapterInfo


class LoRARegistry:
    def __init__(self, enabled: bool, targets: LoRATargets, num_layers: int, max_rank: int):
        self.enabled = enabled
        self.targets, self.num_layers, self.max_rank = targets, num_layers, max_rank
        self.by_name: dict[str, LoRAAdapter] = {}
        self.requests: dict[str, int] = {}          # requests ever served per adapter name
        self._keys = itertools.count(1)

    def load(self, req: LoRARequest) -> LoRAAdapter:
        """Register a new adapter; LoRAError if LoRA is off, the name is taken or the folder does not fit."""
        self._require_enabled()
        if not req.lora_name:
            raise LoRAError("lora_name is required", param="lora_name")
        if req.lora_name in self.by_name:
            raise LoRAError(f"the LoRA adapter {req.lora_name!r} is already loaded (from "
                            f"{self.by_name[req.lora_name].path!r}); unload it first", param="lora_name")
        info = read_adapter(req.lora_path, self.targets, self.num_layers, self.max_rank)
        adapter = LoRAAdapter(req.lora_name, next(self._keys), req.lora_path, req.base_model_name, info)
        self.by_name[adapter.name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if self.by_name.pop(name, None) is None:
            raise LoRAError(f"the LoRA adapter {name!r} is not loaded", 404, "lora_name")

    def drop_key(self, key: int) -> LoRAAdapter | None:
        """Stop serving the adapter registered under `key` (a worker cannot load it), if it still is."""
        adapter = next((a for a in self.by_name.values() if a.key == key), None)
        if adapter is not None:
            del self.by_name[adapter.name]
        return adapter

    def resolve(self, req: LoRARequest | None) -> LoRAAdapter | None:
        """The adapter a request runs under. A name alone must be loaded (404 otherwise); a name with a
        folder (the offline API) is loaded on first use, and must keep naming the same folder."""
        if req is None:
            return None
        self._require_enabled()
        adapter = self.by_name.get(req.lora_name)
        if adapter is None:
            if not req.lora_path:
                raise LoRAError(f"The model `{req.lora_name}` does not exist.", 404, "model")
            adapter = self.load(req)
        elif req.lora_path and req.lora_path != adapter.path:
            raise LoRAError(f"the LoRA adapter {req.lora_name!r} is loaded from {adapter.path!r}, not "
                            f"{req.lora_path!r}; give each adapter its own name", param="lora_name")
        return adapter

    def count_request(self, adapter: LoRAAdapter) -> None:
        self.requests[adapter.name] = self.requests.get(adapter.name, 0) + 1

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise LoRAError("LoRA adapters are not enabled on this server; start it with --enable-lora",
                            param="model")
