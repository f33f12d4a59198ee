"""Host RAM checks before moepeak fills large host buffers.

On Linux an allocation past the RAM that is left does not fail where it is made:
page-locked memory (SCO's arena) fails late or not at all, and pageable memory
(StreamAdamW's state, zero-filled) gets the process killed by the OOM killer
minutes into a run, with no message. These checks turn that into a MemoryError
raised before the buffer exists, naming the buffer, the bytes asked for and the
bytes available.

What counts as available: /proc/meminfo's MemAvailable (free memory plus what the
kernel can reclaim without swapping) for page-locked buffers, which cannot be
swapped; MemAvailable + SwapFree for pageable ones. Where /proc/meminfo cannot be
read (not Linux), no check is made. A container's cgroup memory limit is not read (its
usage counts reclaimable page cache, which would refuse buffers that fit): under a limit
below the host's RAM the check is loose, never falsely strict.
"""
from __future__ import annotations

from typing import Optional, Tuple

MEMINFO_PATH = "/proc/meminfo"


def available_bytes(pinned: bool) -> Optional[int]:
    """Bytes a new host buffer can take now (see the module docstring), or None if unknown."""
    try:
        with open(MEMINFO_PATH) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = int(fields["MemAvailable"].split()[0])
        if not pinned:
            kib += int(fields.get("SwapFree", "0 kB").split()[0])
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return kib * 1024


def check_room(nbytes: int, what: str, remedy: str, *, pinned: bool) -> None:
    """Raise MemoryError if a host buffer of nbytes would not fit in the host RAM left.

    what names the buffer ("moepeak: SCO arena chunk"), remedy says what the caller can change."""
    if nbytes <= 0:
        return
    avail = available_bytes(pinned)
    if avail is not None and nbytes > avail:
        kind = "page-locked" if pinned else "host"
        raise MemoryError(f"{what}: needs {nbytes / 2**30:.2f} GiB of {kind} memory, but this host has "
                          f"{avail / 2**30:.2f} GiB available ({MEMINFO_PATH} MemAvailable"
                          f"{'' if pinned else ' + SwapFree'}); {remedy}. Nothing was allocated.")


def device_room(device) -> Tuple[float, float]:
    """What automatic placement measures on a CUDA device: (GPU bytes a step may use: free + what
    torch already reserved, the host's available RAM for pinned buffers, 0 if unknown)."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    host = available_bytes(pinned=True)
    return float(free + torch.cuda.memory_reserved(device)), float(host or 0)


def placement_room(model) -> Optional[Tuple[float, float]]:
    """device_room of the CUDA device the model's parameters are on (moepeak.hf and
    moepeak.titan); None where they are not on one."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cuda":
        return None
    return device_room(p.device)
