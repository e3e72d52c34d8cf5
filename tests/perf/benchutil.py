"""Helpers the benchmarks share: the machine line they record and page-cache eviction."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def machine() -> str:
    """One line describing this machine and the date, for docs/benchmarks.md."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"nproc={os.cpu_count()}, {cpu}, kernel {platform.release()}, {time.strftime('%Y-%m-%d')}"


def evict(paths) -> None:
    """Drop ``paths`` from the page cache (fsync, then posix_fadvise DONTNEED), so the next read
    is cold."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
