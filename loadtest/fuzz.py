"""The long API fuzz (issue #14): tests/test_api_fuzz.py with many more examples per operation, on a
server of its own (the tiny random model), and its outcome saved under loadtest/results/.

    python -m loadtest.fuzz --examples 500            # ~25x the `make test` run

Same checks as in `make test`: schemathesis over /openapi.json (no 5xx; status code, content type and body
as documented; OpenAI error bodies), random JSON at both generation routes, and a request afterwards.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=500, help="hypothesis examples per API operation")
    p.add_argument("--out", type=Path, default=None, help="where to save the report (default: loadtest/results/)")
    args = p.parse_args(argv)
    out = args.out or REPO / "loadtest" / "results" / f"fuzz_{datetime.date.today()}.txt"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-show-statistics",
           "tests/test_api_fuzz.py"]
    env = {**os.environ, "PAGEDSERVE_FUZZ_EXAMPLES": str(args.examples)}
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    report = f"$ PAGEDSERVE_FUZZ_EXAMPLES={args.examples} {' '.join(cmd[2:])}\n\n{run.stdout}{run.stderr}"
    out.write_text(report)
    print(run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:])
    print(f"report: {out}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
