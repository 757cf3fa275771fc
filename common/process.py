"""Process plumbing shared by every pagedserve process: logging set-up and dying with the parent."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s", stream=sys.stderr)


def die_with_parent() -> None:
    """Get SIGTERM when the parent dies (Linux), and poll as a fallback, so no child outlives `serve`."""
    parent = os.getppid()
    if parent <= 1:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                os._exit(1)
            time.sleep(1)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
