"""What `moepeak plan` reads off the machine it runs on when it is not told: the host's RAM
(/proc/meminfo) and a spill directory's free disk space (statvfs). Stdlib only.

Which RAM figure: MemAvailable (free memory plus what the kernel can reclaim without
swapping), the figure SCO's arena and StreamAdamW's state check before they allocate
(moepeak.core.host_memory), so the plan and the run's own guards agree. MemTotal would
count the kernel's, other processes' and unreclaimable memory as the run's. The machine
read is the one `moepeak plan` runs on, often not the one that trains: the report says
which machine it read, and --host-mem gives another machine's figure.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

from ..core import host_memory


@dataclass(frozen=True)
class HostRAM:
    available: int          # bytes: MemAvailable
    total: Optional[int]    # bytes: MemTotal (None if absent)
    machine: str            # the host name it was read on


def read_host_ram(path: Optional[str] = None) -> Optional[HostRAM]:
    """This machine's MemAvailable and MemTotal (bytes), or None where /proc/meminfo cannot
    be read (not Linux)."""
    path = path or host_memory.MEMINFO_PATH
    try:
        with open(path) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        avail = int(fields["MemAvailable"].split()[0]) * 1024
        total = int(fields["MemTotal"].split()[0]) * 1024 if "MemTotal" in fields else None
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return HostRAM(available=avail, total=total, machine=socket.gethostname() or "this machine")


def disk_free_bytes(directory: str) -> int:
    """Free bytes an unprivileged process can write in directory's filesystem (statvfs:
    f_bavail x f_frsize); ValueError naming the directory if it is not one."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a directory")
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class Machine:
    """The machine a report checks against (bytes): each GPU's memory, each host's RAM
    available (None: unknown, not checked) and spill space (None: no disk tier), how many
    GPUs share a host, and where the host and disk figures came from (for the report)."""
    gpu_bytes: float
    host_bytes: Optional[float] = None
    host_from: Optional[str] = None
    disk_bytes: Optional[float] = None
    disk_from: Optional[str] = None
    ranks_per_host: int = 1
