"""The soak (issue #14): `pagedserve serve` under a headless locust run of `SoakUser` (loadtest/soak_locustfile.py)
for minutes, with the router's and the scheduler's resident memory sampled throughout.

    python -m loadtest.soak                                  # 10 minutes, 32 users, the default model
    python -m loadtest.soak --minutes 1 --users 8            # a quick look

The server gets a small waiting queue (--max-num-seqs 16, --max-waiting-requests 8), so 32 users overload
it past the waiting limit and some requests are shed with 429. Pass criteria, in the report:
  * no 5xx and no failure of any other kind (a malformed body answered otherwise than 400, a broken stream);
  * after the run, with every cancelled stream aborted, no request runs or waits and KV usage is 0%;
  * the router's and the scheduler's RSS at the end within 10% of their RSS after warm-up (the first 20%).
Works from a clean clone: the workload defaults to the shared one where it exists, else the packaged copy.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from loadtest.server import PagedServeServer
from loadtest.workload import PACKAGED_WORKLOAD, REPO_ROOT, default_workload_path

SERVER_FLAGS = ["--max-num-seqs", "16", "--max-waiting-requests", "8"]
WARMUP_FRACTION = 0.2
MAX_GROWTH = 0.10


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def children_by_role(pid: int) -> dict[str, int]:
    """serve's scheduler and (first) router, from their command lines."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    roles: dict[str, int] = {}
    for child in map(int, out):
        cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        for role in ("scheduler", "router"):
            if f" {role} " in f" {cmd} ":
                roles.setdefault(role, child)
    return roles


class MemorySampler(threading.Thread):
    """RSS of each named process every `every` seconds: [(seconds since start, {role: MB})]."""

    def __init__(self, pids: dict[str, int], every: float):
        super().__init__(daemon=True)
        self.pids, self.every, self.samples = pids, every, []
        self.done = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.done.is_set():
            self.samples.append((round(time.monotonic() - t0, 1), {r: rss_mb(p) for r, p in self.pids.items()}))
            self.done.wait(self.every)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pagedserve:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = out.get(name, 0.0) + float(value)
    return out


def metric(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.split("{")[0] == prefix or k.startswith(prefix + "{"))


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    """Metrics once nothing runs or waits and no KV block is held, over three scrapes (heartbeats)."""
    deadline, streak, m = time.monotonic() + timeout, 0, {}
    while time.monotonic() < deadline and streak < 3:
        m = scrape(url)
        idle = all(metric(m, "pagedserve:" + g) == 0 for g in ("num_requests_running", "num_requests_waiting",
                                                               "kv_cache_usage_perc"))
        streak = streak + 1 if idle else 0
        time.sleep(0.6)
    return m


def read_stats(prefix: str) -> tuple[list[dict], list[dict]]:
    with open(prefix + "_stats.csv") as f:
        stats = list(csv.DictReader(f))
    with open(prefix + "_failures.csv") as f:
        failures = list(csv.DictReader(f))
    return stats, failures


def growth(samples: list, role: str, duration: float) -> dict[str, float | None]:
    after = [(t, m[role]) for t, m in samples if m.get(role) is not None and t >= WARMUP_FRACTION * duration]
    if not after:
        return {"warm_mb": None, "end_mb": None, "max_mb": None, "growth": None}
    warm, end = after[0][1], after[-1][1]
    return {"warm_mb": round(warm, 1), "end_mb": round(end, 1), "max_mb": round(max(v for _, v in after), 1),
            "growth": round((end - warm) / warm, 4)}


def run(args: argparse.Namespace) -> dict:
    duration = args.minutes * 60
    workload = args.workload or (default_workload_path() if default_workload_path().exists() else PACKAGED_WORKLOAD)
    with PagedServeServer(SERVER_FLAGS + args.server_flag) as srv:
        pids = children_by_role(srv.proc.pid)
        sampler = MemorySampler(pids, args.sample_every)
        sampler.start()
        before = scrape(srv.url)
        with tempfile.TemporaryDirectory() as tmp:
            prefix = os.path.join(tmp, "soak")
            env = {**os.environ, "LOADTEST_WORKLOAD": str(workload), "LOADTEST_MAX_TOKENS": str(args.max_tokens)}
            cmd = [sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadtest" / "soak_locustfile.py"),
                   "--headless", "-u", str(args.users), "-r", str(args.users), "-t", f"{int(duration)}s",
                   "--host", srv.url, "--csv", prefix, "--only-summary", "--stop-timeout", "120"]
            lc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
            if not os.path.exists(prefix + "_stats.csv"):
                raise RuntimeError(f"locust wrote no statistics (exit {lc.returncode}): {lc.stderr[-2000:]}")
            stats, failures = read_stats(prefix)
        idle = wait_idle(srv.url)
        sampler.done.set()
        sampler.join()
    rows = {f"{r['Type']} {r['Name']}": {k: r[k] for k in ("Request Count", "Failure Count", "50%", "90%", "99%")}
            for r in stats}
    fives = sum(int(f["Occurrences"]) for f in failures if "HTTP 5" in f["Error"])
    aborted = sum(v - before.get(k, 0.0) for k, v in idle.items()
                  if k.startswith("pagedserve:request_success_total{") and 'finished_reason="abort"' in k)
    report = {
        "date": str(datetime.date.today()), "minutes": args.minutes, "users": args.users,
        "server_flags": SERVER_FLAGS + args.server_flag, "workload": str(workload), "max_tokens_cap": args.max_tokens,
        "locust_rc": lc.returncode, "rows": rows, "failures": failures, "num_5xx": fives,
        "num_failures": sum(int(f["Occurrences"]) for f in failures),
        "aborted_requests": aborted,
        "after": {g: metric(idle, "pagedserve:" + g) for g in ("num_requests_running", "num_requests_waiting",
                                                               "kv_cache_usage_perc")},
        "memory": {role: growth(sampler.samples, role, duration) for role in pids},
        "memory_samples": sampler.samples,
    }
    report["passed"] = (fives == 0 and report["num_failures"] == 0 and not any(report["after"].values())
                        and all(m["growth"] is not None and m["growth"] <= MAX_GROWTH
                                for m in report["memory"].values()))
    if lc.returncode not in (0, 1):     # locust exits 1 when any request failed: the report says which
        report["locust_stderr"] = lc.stderr[-3000:]
    return report


def table(r: dict) -> str:
    lines = [f"soak {r['date']}: {r['minutes']} min, {r['users']} users, server {' '.join(r['server_flags'])}, "
             f"max_tokens <= {r['max_tokens_cap']}", "",
             f"{'row':<36} {'count':>7} {'fail':>5} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}"]
    for name, row in r["rows"].items():
        lines.append(f"{name:<36} {row['Request Count']:>7} {row['Failure Count']:>5} {row['50%']:>8} "
                     f"{row['90%']:>8} {row['99%']:>8}")
    lines += ["", f"5xx: {r['num_5xx']}   failures: {r['num_failures']}   aborted (cancelled) requests: "
                  f"{r['aborted_requests']:.0f}",
              f"after the run: running {r['after']['num_requests_running']:.0f}, waiting "
              f"{r['after']['num_requests_waiting']:.0f}, KV usage {100 * r['after']['kv_cache_usage_perc']:.1f}%"]
    for role, m in r["memory"].items():
        lines.append(f"{role} RSS: {m['warm_mb']} MB after warm-up, {m['end_mb']} MB at the end (max {m['max_mb']}), "
                     f"growth {100 * (m['growth'] or 0):+.1f}%")
    for f in r["failures"][:10]:
        lines.append(f"failure: {f['Method']} {f['Name']}: {f['Error'][:160]} x{f['Occurrences']}")
    lines.append(f"passed: {r['passed']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64, help="cap each request's max_tokens")
    p.add_argument("--workload", type=Path, default=None)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--server-flag", action="append", default=[], help="one more `pagedserve serve` argument")
    p.add_argument("--out", type=Path, default=None, help="report path stem (default loadtest/results/soak_DATE)")
    args = p.parse_args(argv)
    report = run(args)
    stem = args.out or REPO_ROOT / "loadtest" / "results" / f"soak_{report['date']}"
    Path(f"{stem}.json").write_text(json.dumps(report, indent=1))
    Path(f"{stem}.txt").write_text(table(report) + "\n")
    print(table(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
