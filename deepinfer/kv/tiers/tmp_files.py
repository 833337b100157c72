"""The temporary files of L3 writes in progress: their names, and whether one was abandoned.

A writer writes ``.KEY.HOST.PID.TID.tmp`` next to its page file and renames it into place, so
a reader never sees a partial file. A temp file whose writer died (on this host), or that is
older than a limit (another host's, in a shared directory), is left over and can go.
"""

from __future__ import annotations

import os
import re
import socket
import threading

_TMP_RE = re.compile(r"\.([0-9a-f]{2,256})\.(.+)\.([0-9]+)\.([0-9]+)\.tmp")  # key, host, pid, tid
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def tmp_name(key: str) -> str:
    """This thread's temp file name for a write of ``key``."""
    return f".{key}.{_HOST}.{os.getpid()}.{threading.get_ident()}.tmp"


def stale_tmp(name: str, age_s: float, max_age_s: float) -> bool:
    """A temp file nobody will finish: its writer (on this host) is dead, or it is old."""
    m = _TMP_RE.fullmatch(name)
    if m is not None and m.group(2) == _HOST:
        pid = int(m.group(3))
        return pid != os.getpid() and not _pid_alive(pid)
    return age_s > max_age_s  # another host's writer (shared directory) or unknown


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True
