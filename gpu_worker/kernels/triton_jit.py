"""The one place Triton is imported and kernels are jitted, for every Triton kernel module.

Triton is optional: CPU-only deployments never launch a kernel, so importing a kernel module must work
without it (`triton` and `tl` are then None and `jitted` raises). Tests on a CPU turn the interpreter on
(TRITON_INTERPRET=1) after modules are imported, and triton.jit reads the mode when it wraps a function,
so kernels are wrapped on first launch and kept per mode. Importing triton itself before the
interpreter is switched on breaks the interpreter's kernels (measured: every interpreted test fails),
so code on the CPU path imports the kernel modules only where they run.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
    IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - exercised only where triton is missing/broken
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    IMPORT_ERROR = exc

_JITTED: dict[tuple[Callable, bool], Any] = {}


def interpret_mode() -> bool:
    """Whether triton.jit would build for the interpreter now."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def jitted(fn: Callable, user: str) -> Any:
    """`fn` jitted for the current mode (cached); `user` names the feature in the error without Triton."""
    if triton is None:
        raise RuntimeError(f"{user} needs triton: {IMPORT_ERROR!r}")
    key = (fn, interpret_mode())
    if key not in _JITTED:
        _JITTED[key] = triton.jit(fn)
    return _JITTED[key]
