"""What a benchmark run measured and how it is shown: per-request token timestamps in, one table out.

Every system records the same raw facts — when each request was handed to it and when each of its output
tokens appeared — so that TTFT and inter-token latency mean the same thing on every row:
  * TTFT = first token time - submit time (submit = when that request was given to the system, so a
    request that waits in a queue pays for it, as a real client would);
  * ITL  = gaps between consecutive token arrivals of one request (for HTTP, between stream chunks).
Throughput is output tokens (each request's own max_tokens) over the wall time of the whole run.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BASELINE = "hf-1"
LLAMA_CPP = "llamacpp"    # the prefix of llama-server's rows (loadtest/llama_cpp.py)
# The issue's floor-derived ceiling for this model on the reference machine, in output tokens/s; the
# pagedserve rows report which fraction of it they reach.
ISSUE_CEILING_TOK_S = 162.0


@dataclass
class RequestTiming:
    request_id: str
    submitted: float                     # perf_counter() when the request was handed to the system
    token_times: list[float]             # perf_counter() at each output token (or stream chunk)
    output_tokens: int                   # tokens this request produced (must equal its max_tokens)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.submitted if self.token_times else None

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class SystemResult:
    """One row of the table. `error` set means the row could not run and prints as n/a."""
    system: str
    wall_s: float = 0.0
    timings: list[RequestTiming] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    is_pagedserve: bool = False

    @classmethod
    def failed(cls, system: str, reason: str, is_pagedserve: bool = False) -> "SystemResult":
        return cls(system, error=reason, is_pagedserve=is_pagedserve)

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.timings)

    def summary(self) -> dict[str, Any]:
        if self.error is not None:
            return {"system": self.system, "error": self.error, "notes": self.notes}
        ttfts = [t.ttft for t in self.timings if t.ttft is not None]
        itls = [x for t in self.timings for x in t.itls()]
        wall = max(self.wall_s, 1e-9)
        return {
            "system": self.system,
            "requests": len(self.timings),
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "requests_per_s": len(self.timings) / wall,
            "output_tokens_per_s": self.output_tokens / wall,
            "ttft_p50_ms": _pct(ttfts, 50) * 1e3,
            "ttft_p99_ms": _pct(ttfts, 99) * 1e3,
            "itl_p50_ms": _pct(itls, 50) * 1e3,
            "itl_p99_ms": _pct(itls, 99) * 1e3,
            "notes": self.notes,
        }


def short_error(e: BaseException, n: int = 300) -> str:
    """An exception as an n/a row's reason."""
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= n else s[:n] + "..."


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def with_ratios(rows: list[SystemResult]) -> list[dict[str, Any]]:
    """Summaries plus `vs_hf1` (tok/s over the HF one-at-a-time row), `vs_llamacpp` (over llama-server's
    best row, at whichever concurrency it did best) and, for pagedserve rows, the fraction of the issue's
    162 tok/s ceiling."""
    sums = [r.summary() for r in rows]
    base = next((s for s in sums if s["system"] == BASELINE and "error" not in s), None)
    llama = [s["output_tokens_per_s"] for s in sums if s["system"].startswith(LLAMA_CPP) and "error" not in s]
    for r, s in zip(rows, sums):
        if "error" in s:
            continue
        s["vs_hf1"] = s["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None
        s["vs_llamacpp"] = s["output_tokens_per_s"] / max(llama) if llama else None
        s["of_issue_ceiling"] = s["output_tokens_per_s"] / ISSUE_CEILING_TOK_S if r.is_pagedserve else None
    return sums


_COLS = [("system", 16, "s"), ("reqs", 5, "d"), ("req/s", 7, ".2f"), ("out tok/s", 10, ".1f"),
         ("TTFT p50", 9, ".0f"), ("TTFT p99", 9, ".0f"), ("ITL p50", 8, ".1f"), ("ITL p99", 8, ".1f"),
         ("vs hf-1", 8, ".2f"), ("vs l.cpp", 8, ".2f"), ("of 162", 7, ".0%"), ("wall s", 8, ".1f")]
_KEYS = ["system", "requests", "requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
         "itl_p50_ms", "itl_p99_ms", "vs_hf1", "vs_llamacpp", "of_issue_ceiling", "wall_s"]


def format_table(sums: list[dict[str, Any]]) -> str:
    """A fixed-width table; latencies in milliseconds."""
    head = " ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w, _) in enumerate(_COLS))
    lines = [head, "-" * len(head)]
    for s in sums:
        if "error" in s:
            lines.append(f"{s['system']:<{_COLS[0][1]}} n/a ({s['error']})")
            continue
        cells = []
        for i, ((_, w, fmt), key) in enumerate(zip(_COLS, _KEYS)):
            v = s.get(key)
            if i == 0:
                cells.append(f"{v:<{w}}")
            elif v is None or (isinstance(v, float) and math.isnan(v)):
                cells.append(f"{'-':>{w}}")
            else:
                cells.append(f"{v:>{w}{fmt}}")
        lines.append(" ".join(cells))
    lines.append("latencies in ms; TTFT from when each request was handed to the system; 'vs l.cpp' = out "
                 "tok/s / llama-server's best row; 'of 162' = out tok/s / the issue's 162 tok/s ceiling")
    for s in sums:
        for n in s.get("notes") or []:
            lines.append(f"  [{s['system']}] {n}")
    return "\n".join(lines)


def write_json(path: Path | str, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def print_and_save(payload: dict[str, Any], path: Path | str | None) -> None:
    """A small benchmark's result: printed, and written to `path` when one is given."""
    print(json.dumps(payload, indent=1, default=_jsonable))
    if path:
        write_json(path, payload)


def _jsonable(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
