"""The shared benchmark workload: which requests every system runs, loaded once and subset the same way.

Every row of the benchmark table must do identical work, so the workload is read from one fixed file
(`<repo>/../shared/bench/workload.jsonl`, see its README) and any subsetting (quick mode, `--limit`,
`--max-tokens-cap`) is a pure function of that file: the first N requests, max_tokens capped. Requests are
always run greedy with ignore_eos, so each produces exactly `max_tokens` tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# the first 24 requests of the shared workload, packaged for where the shared file is absent (a clean clone,
# the Docker image): the locust scenarios fall back to it
PACKAGED_WORKLOAD = Path(__file__).resolve().parent / "soak_workload.jsonl"
QUICK_LIMIT = 12          # --quick: the first 12 requests ...
QUICK_MAX_TOKENS = 32     # ... with max_tokens capped at 32


@dataclass(frozen=True)
class BenchRequest:
    """One workload request; `prompt_token_ids` are sent as-is (no chat template, no BOS)."""
    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    prompt: str = ""
    messages: list[dict] | None = None   # the same text as one chat user message (the locust chat task)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def default_workload_path() -> Path:
    """The shared workload next to the repository (resolved from this file, not the working directory)."""
    return (REPO_ROOT.parent / "shared" / "bench" / "workload.jsonl").resolve()


def load_workload(path: Path | str | None = None, limit: int | None = None,
                  max_tokens_cap: int | None = None) -> list[BenchRequest]:
    """Read the workload; keep the first `limit` requests and cap max_tokens, deterministically."""
    p = Path(path) if path else default_workload_path()
    if not p.is_file():
        raise FileNotFoundError(f"workload file {p} not found (pass --workload PATH)")
    out: list[BenchRequest] = []
    with p.open() as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            m = int(d["max_tokens"])
            if max_tokens_cap is not None:
                m = min(m, max_tokens_cap)
            out.append(BenchRequest(str(d["id"]), [int(t) for t in d["prompt_token_ids"]], m, d.get("prompt", ""),
                                    d.get("messages") or [{"role": "user", "content": d.get("prompt", "")}]))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"workload file {p} holds no requests")
    return out


def total_output_tokens(reqs: list[BenchRequest]) -> int:
    return sum(r.max_tokens for r in reqs)


def describe(reqs: list[BenchRequest]) -> str:
    """One line for the report header, so a table can be matched to the work it measured."""
    p = [r.prompt_tokens for r in reqs]
    return (f"{len(reqs)} requests, prompt tokens {sum(p)} (min {min(p)}, max {max(p)}), "
            f"output tokens {total_output_tokens(reqs)} (max_tokens {min(r.max_tokens for r in reqs)}-"
            f"{max(r.max_tokens for r in reqs)})")
