"""The disk tier's Python face over moepeak._C.spill_* (csrc/spill.h, the contract):

  HostBuffer   nbytes of 4096-aligned host memory, page-locked (for DMA to and from a
               GPU) or pageable, as a uint8 tensor
  SpillFile    an anonymous file in a directory (unlinked while open: a crash leaves
               nothing behind), O_DIRECT where the filesystem takes it, with asynchronous
               writes and reads between HostBuffers and 4096-aligned file offsets
  SpillFuture  one such request: done() polls, wait() blocks and raises its OSError

Room on the disk is checked before anything is queued: a file opened with a capacity, and
every write that makes the file longer, first compare the bytes it adds (plus those of
writes still in flight) with the filesystem's free space (statvfs) and raise OSError(ENOSPC)
naming the directory, the bytes needed and the bytes free. An I/O error of a request
(ENOSPC that another process caused, EIO) is raised by its wait() as an OSError with errno,
the byte range, the directory and its free space; the buffer still holds its bytes.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
from typing import Optional, Union

import torch

from .. import _C
from .host_memory import check_room

ALIGN = 4096  # the spill file's unit: buffer addresses, file offsets (csrc/spill.h MP_SPILL_ALIGN)
LOG = logging.getLogger("moepeak")
_BUFFERED_WARNED = set()  # directories already reported as refusing O_DIRECT (one warning each)


def round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still put on the filesystem of `directory`."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def aligned_view(base: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The first ALIGN-aligned nbytes of base (a uint8 tensor of at least nbytes + ALIGN - 1
    bytes), whatever base's own alignment: the slice starts at the first multiple of ALIGN at
    or after base's address."""
    start = (-base.data_ptr()) % ALIGN
    if base.numel() - start < nbytes:
        raise ValueError(f"moepeak: aligned_view: a base of {base.numel()} bytes at {base.data_ptr():#x} holds no "
                         f"{ALIGN}-aligned {nbytes} bytes (it needs nbytes + {ALIGN - 1})")
    return base[start:start + nbytes]


class HostBuffer:
    """nbytes (rounded up to 4096) of 4096-aligned host memory; .view is a uint8 tensor over it.

    Aligned by construction: ALIGN more bytes than needed are allocated and .view is the
    aligned slice of them (aligned_view), so the alignment holds whatever the allocator gives
    (cudaHostAlloc sub-allocates small pinned blocks at addresses that are not page aligned).
    pinned=True: page-locked (moepeak._C.host_alloc: needs the CUDA build and a GPU), checked
    against the host RAM left first; free() releases it (the view must not be used after).
    pinned=False: pageable, released with its last reference."""

    def __init__(self, nbytes: int, *, pinned: bool):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"moepeak: HostBuffer nbytes must be an int >= 1, got {nbytes!r}")
        self.nbytes, self.pinned, self.ptr = round_up(nbytes), pinned, 0
        self.allocated = allocated = self.nbytes + ALIGN  # host bytes taken: the view plus the alignment pad
        if pinned:
            check_room(allocated, "moepeak: SCO spill staging slot", "lower SCOConfig.spill_slots or the "
                       "boundary size", pinned=True)
            self.ptr = _C.host_alloc(allocated)
            base = torch.frombuffer((ctypes.c_uint8 * allocated).from_address(self.ptr), dtype=torch.uint8)
        else:
            base = torch.empty(allocated, dtype=torch.uint8)
        self.view = aligned_view(base, self.nbytes)

    @property
    def address(self) -> int:
        return self.view.data_ptr()

    def free(self) -> None:
        if self.ptr:
            self.view = None
            _C.host_free(self.ptr)
            self.ptr = 0


Buffer = Union[HostBuffer, torch.Tensor]


def _address(buffer: Buffer, nbytes: int, what: str) -> int:
    view = buffer.view if isinstance(buffer, HostBuffer) else buffer
    if not isinstance(view, torch.Tensor) or view.device.type != "cpu" or not view.is_contiguous():
        raise TypeError(f"moepeak: SpillFile.{what} buffer must be a HostBuffer or a contiguous CPU tensor, got "
                        f"{type(buffer).__name__}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 1 <= nbytes <= view.numel() * view.element_size():
        raise ValueError(f"moepeak: SpillFile.{what} nbytes must be an int in [1, {view.numel() * view.element_size()}]"
                         f" (the buffer's bytes), got {nbytes!r}")
    return view.data_ptr()


def _check_offset(offset: int, what: str) -> None:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset % ALIGN:
        raise ValueError(f"moepeak: SpillFile.{what} offset must be an int >= 0 and a multiple of {ALIGN}, "
                         f"got {offset!r}")


class SpillFuture:
    """One asynchronous request of a SpillFile. wait() blocks until it is done, once (later
    calls return, or raise the same error); the buffer must stay untouched until then."""

    __slots__ = ("file", "ticket", "buffer", "growth", "error", "waited")

    def __init__(self, file: "SpillFile", ticket: int, buffer: Buffer, growth: int):
        self.file, self.ticket, self.buffer, self.growth = file, ticket, buffer, growth
        self.error: Optional[OSError] = None
        self.waited = False

    def done(self) -> bool:
        return self.waited or _C.spill_poll(self.file.handle, self.ticket)

    def wait(self) -> None:
        if not self.waited:
            self.waited = True
            try:
                _C.spill_wait(self.file.handle, self.ticket)
            except OSError as e:
                self.error = self.file.describe(e)
            finally:
                self.file.unlanded -= self.growth
                self.buffer = None
        if self.error is not None:
            raise self.error


class SpillFile:
    """An anonymous spill file in `directory` (see the module docstring).

    capacity: bytes reserved at open (fallocate), refused first when the filesystem has
    less free. threads: its I/O threads. direct: -1 O_DIRECT where the filesystem takes it
    (else buffered, reported once through logging.getLogger("moepeak")), 0 never, 1 always."""

    def __init__(self, directory, capacity: int = 0, *, threads: int = 4, direct: int = -1):
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            kind = FileNotFoundError if not os.path.exists(self.directory) else NotADirectoryError
            code = errno.ENOENT if kind is FileNotFoundError else errno.ENOTDIR
            raise kind(code, "moepeak: the spill directory is not a directory", self.directory)
        self.unlanded = 0  # bytes by which writes in flight may still lengthen the file on disk
        self.extent = 0
        self.handle, self.closed = None, False
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"moepeak: SpillFile capacity must be an int >= 0, got {capacity!r}")
        self._refuse(round_up(capacity), f"a spill file of {capacity} bytes")
        self.handle = _C.spill_open(self.directory, capacity, threads=threads, direct=direct)
        self.extent = round_up(capacity)  # bytes the file may hold without taking more of the disk
        info = _C.spill_info(self.handle)
        self.direct = bool(info["direct"])
        if not self.direct and direct == -1 and self.directory not in _BUFFERED_WARNED:
            _BUFFERED_WARNED.add(self.directory)
            LOG.warning("moepeak: the filesystem of %s refuses O_DIRECT: the spill file runs buffered (through "
                        "the page cache)", self.directory)

    def _refuse(self, grow: int, what: str) -> None:
        free = free_bytes(self.directory) - self.unlanded
        if grow > free:
            raise OSError(errno.ENOSPC, f"moepeak: {what} needs {grow} more bytes on the filesystem of the spill "
                          f"directory, which has {max(free, 0)} bytes free (after the writes in flight); free "
                          "space there, pick another spill_dir or raise host_budget_bytes. Nothing was written.",
                          self.directory)

    def reserve(self, end: int, what: str = "the spill file") -> int:
        """Make room for the file to hold `end` bytes: raise OSError(ENOSPC) naming the directory
        and its free space when the filesystem cannot take what that adds (beyond what the file
        may hold already, less what writes in flight may still add); else count those bytes as
        taken and return them. Pass them to the write() that fills them (reserved=), or to
        release() if none will."""
        growth = max(round_up(end) - self.extent, 0)
        if growth:
            self._refuse(growth, what)
            self.extent += growth
            self.unlanded += growth
        return growth

    def release(self, reserved: int) -> None:
        """Bytes reserve() counted that no write will land after all."""
        self.unlanded -= reserved

    def describe(self, e: OSError) -> OSError:
        """e (from moepeak._C) with the directory's free space added to its message."""
        try:
            free = f"{free_bytes(self.directory)} bytes free"
        except OSError:
            free = "free space unknown"
        return type(e)(e.errno, f"{e.strerror} ({self.directory}: {free})", self.directory)

    def write(self, buffer: Buffer, nbytes: int, offset: int, *, reserved: int = 0) -> SpillFuture:
        """Queue buffer[:nbytes] -> file[offset:offset + nbytes]; offset a multiple of 4096.
        reserved: bytes reserve() counted for this range, released when the write lands."""
        addr = _address(buffer, nbytes, "write")
        _check_offset(offset, "write")
        handle = self._open_handle()
        growth = self.reserve(offset + nbytes, f"writing bytes [{offset}, {offset + nbytes}) of the spill file")
        try:
            ticket = _C.spill_submit_write(handle, addr, nbytes, offset)
        except BaseException:
            self.release(growth)
            raise
        return SpillFuture(self, ticket, buffer, growth + reserved)

    def read(self, buffer: Buffer, nbytes: int, offset: int) -> SpillFuture:
        """Queue file[offset:offset + nbytes] -> buffer[:nbytes] (bytes a write put there)."""
        addr = _address(buffer, nbytes, "read")
        _check_offset(offset, "read")
        ticket = _C.spill_submit_read(self._open_handle(), addr, nbytes, offset)
        return SpillFuture(self, ticket, buffer, 0)

    def _open_handle(self):
        if self.handle is None or self.closed:
            raise ValueError(f"moepeak: the spill file in {self.directory} is closed")
        return self.handle

    def info(self) -> dict:
        """moepeak._C.spill_info: direct, dir, threads, written_end, in_flight."""
        return _C.spill_info(self._open_handle())

    def close(self) -> None:
        """Wait for the requests in flight, then close the file (its space is freed). Idempotent;
        futures still held can be waited on afterwards."""
        if self.handle is not None:
            _C.spill_close(self.handle)
        self.closed = True
