"""Waiting on conditions, not sleeps: tests poll what they can observe until it holds."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(check: Callable[[], object], timeout_s: float = 10.0, every_s: float = 0.02) -> bool:
    """Whether `check()` became true within `timeout_s` (polled every `every_s`)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True
