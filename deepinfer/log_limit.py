"""Rate-limited log lines: one line per kind of event per interval, with a count of the rest.

A failure that repeats every step (a bad disk, a request that keeps failing) must show in the
log without filling it: the first occurrence of a kind is logged (with its traceback when
asked), then at most one line per ``interval_s`` saying how many were suppressed meanwhile.
Thread-safe: the engine thread and the tier writer threads share instances.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # kind -> time of its last line
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``msg % args`` unless a line of ``kind`` went out less than ``interval_s`` ago.
        True if the line was written."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return False
            self._last[kind] = now
            skipped = self._suppressed.pop(kind, 0)
        if skipped:
            msg += f" ({skipped} more like this in the last {self.interval_s:g}s not logged)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, kind, msg, *args)

    def error(self, kind: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        return self.log(logging.ERROR, kind, msg, *args, exc_info=exc_info)
