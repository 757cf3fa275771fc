"""Checkpoints whose linear weights are stored quantized, split over several tensors per layer (AWQ,
GPTQ, FP8): the loader reads `config.json`'s `quantization_config` into a CheckpointFormat and
reassembles each layer's parts (`q_proj.qweight`, `q_proj.qzeros`, `q_proj.scales`, ...) into one
QuantizedTensor named `q_proj.weight`, so the rest of loading sees one tensor per weight, as with GGUF.
The Linear method then keeps it packed, or expands it to fp32 (`--quantization none`, the reference).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from gpu_worker.quantization.packed import GroupQuant, QuantizedTensor


class CheckpointFormat:
    """One quantized checkpoint format: which tensor suffixes make up a layer's weight and how they
    become one QuantizedTensor. `markers` are the suffixes only a quantized layer has."""
    method: str
    markers: tuple[str, ...]
    parts: tuple[str, ...]
    required: tuple[str, ...] = ()

    def build(self, prefix: str, parts: dict[str, torch.Tensor]) -> QuantizedTensor:
        raise NotImplementedError

    def assemble(self, names: Iterable[str], tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Pass `tensors` through, replacing each quantized layer's parts (all of them are among `names`)
        by one `<layer>.weight` QuantizedTensor as soon as its last part has been read."""
        split = [n.rpartition(".")[::2] for n in names]
        quantized = {p for p, s in split if s in self.markers}
        expected: dict[str, set[str]] = {}
        for prefix, suffix in split:
            if prefix in quantized and suffix in self.parts:
                expected.setdefault(prefix, set()).add(suffix)
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            prefix, _, suffix = name.rpartition(".")
            if suffix not in expected.get(prefix, ()):
                yield name, tensor
                continue
            got = pending.setdefault(prefix, {})
            got[suffix] = tensor
            if set(got) == expected[prefix]:
                missing = [p for p in self.required if p not in got]
                if missing:
                    raise ValueError(f"checkpoint layer {prefix!r} has no {', '.join(missing)} "
                                     f"({self.method} stores {', '.join(self.required)})")
                yield f"{prefix}.weight", self.build(prefix, pending.pop(prefix))
        if pending:
            prefix, got = next(iter(pending.items()))
            raise ValueError(f"checkpoint tensors {sorted(expected[prefix] - set(got))} of {prefix} were listed but never read")


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], why: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} ({why})")


def expect_dtype(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in dtypes:
        raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}, expected "
                         f"{' or '.join(str(d) for d in dtypes)}")


def unpack_int32(packed: torch.Tensor, bits: int, axis: int) -> np.ndarray:
    """Values of `bits` each, packed lowest bits first into int32 words along `axis` (0 or 1)."""
    p = packed.numpy().astype(np.int32)
    shifts = np.arange(32 // bits, dtype=np.int32) * bits
    mask = (1 << bits) - 1
    if axis == 0:
        return ((p[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, p.shape[1]).astype(np.uint8)
    return ((p[:, :, None] >> shifts) & mask).reshape(p.shape[0], -1).astype(np.uint8)


class ZeroPointTensor(QuantizedTensor):
    """Integer weights with per-group fp scales and integer zero points, AWQ's and GPTQ's shared model:
    w[n, k] = scales[g(k), n] * (q[n, k] - zeros[g(k), n]), where g(k) = g_idx[k] (GPTQ act-order) or
    k // group."""

    def __init__(self, q: np.ndarray, zeros: np.ndarray, scales: torch.Tensor, group: int,
                 g_idx: np.ndarray | None = None):
        self.q, self.zeros, self.group = q, zeros.astype(np.float32), group     # q: [N, K]; zeros: [G, N]
        self.scales = scales.float().numpy()                                   # [G, N]
        k = q.shape[1]
        self.g_idx = None if g_idx is None or np.array_equal(g_idx, np.arange(k) // group) else g_idx
        self.shape = tuple(q.shape)

    def groups(self) -> GroupQuant:
        scale, offset = self.scales.T, -(self.scales * self.zeros).T       # exact: fp16 scales, small ints
        if self.g_idx is None:
            return GroupQuant(self.q, np.ascontiguousarray(scale), np.ascontiguousarray(offset), self.group)
        perm = np.argsort(self.g_idx, kind="stable")
        counts = np.bincount(self.g_idx, minlength=self.scales.shape[0])
        if counts.min() != counts.max():
            raise ValueError(f"act-order groups of unequal sizes {counts.min()}..{counts.max()}")
        return GroupQuant(np.ascontiguousarray(self.q[:, perm]), np.ascontiguousarray(scale),
                          np.ascontiguousarray(offset), int(counts[0]), perm)

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx if self.g_idx is not None else np.arange(self.shape[1]) // self.group
        w = (self.q.T.astype(np.float32) - self.zeros[g]) * self.scales[g]          # [K, N]
        return torch.from_numpy(np.ascontiguousarray(w.T))


def read_checkpoint_format(qconfig: dict[str, Any] | None) -> CheckpointFormat | None:
    """The format a `quantization_config` describes, or None for an unquantized checkpoint."""
    if not qconfig:
        return None
    from gpu_worker.quantization.awq import AWQFormat
    from gpu_worker.quantization.fp8 import FP8Format
    from gpu_worker.quantization.gptq import GPTQFormat
    formats = {"awq": AWQFormat, "gptq": GPTQFormat, "fp8": FP8Format}
    method = str(qconfig.get("quant_method", "")).lower()
    if method not in formats:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; "
                         f"expected one of {', '.join(formats)}")
    return formats[method].from_config(qconfig)
