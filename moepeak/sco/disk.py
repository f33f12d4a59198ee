"""SCO's disk tier (SCOConfig.spill_dir): the boundaries that do not fit the host budget,
in an anonymous spill file (moepeak.core.spill.SpillFile), through a small ring of pinned
staging slots (SCOConfig.spill_slots, each one boundary's extent).

  forward   D2H into a free staging slot on the copy stream (CPU: a memcpy), then, once the
            copy is known complete, an asynchronous write of the slot to the boundary's
            offset in the file (write-behind). A slot is reused only once its write
            completed (and its D2H and its last H2D). The file's offsets are a bump pointer
            that rewinds with the arena: one step's disk boundaries, the earliest blocks.
  backward  read-ahead: loading a boundary reads it into a free slot (the prefetch depth of
            SCOConfig.prefetch, as for the host tier); once the read completed the H2D is
            enqueued on the load stream into a fresh device buffer (CPU: a copy into a new
            tensor). A boundary whose bytes are still in its slot is loaded from there.
Progress is made at every engine entry (pump: writes are submitted for D2Hs seen complete,
finished requests are collected, finished reads are landed); the host waits only when it
needs a slot that is still busy, or a read a reload needs now.

Errors: a boundary that does not fit the disk (statvfs) is refused at its offload with
OSError(ENOSPC) naming the directory and the bytes free, before anything is enqueued. A write
that fails later (ENOSPC caused by another process, EIO) loses nothing: the bytes stay in
their slot, which is kept for that boundary (its reload reads the slot), and the OSError is
raised by the next offload (a forward), never by a backward.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..core.spill import HostBuffer, SpillFile
from .sizes import spill_extent


class Stage:
    """One pinned staging slot. rec: the boundary whose bytes it holds (None: nothing);
    d2h_pending: a D2H into it may still run (its d2h_ev); unwritten: those bytes still
    need their write; write/read: a request in flight; h2d_pending: an H2D from it may
    still run (its h2d_ev); failed: its write failed, so it holds rec's only copy."""

    __slots__ = ("buf", "rec", "d2h_ev", "h2d_ev", "d2h_pending", "unwritten", "reserved", "write", "read",
                 "h2d_pending", "failed", "last_use")

    def __init__(self):
        self.buf: Optional[HostBuffer] = None
        self.rec = None
        self.d2h_ev = self.h2d_ev = 0
        self.d2h_pending = self.unwritten = self.h2d_pending = self.failed = False
        self.reserved = 0  # spill-file bytes reserved for the pending write (SpillFile.reserve)
        self.write = self.read = None
        self.last_use = -1

    @property
    def idle(self) -> bool:
        return not (self.d2h_pending or self.unwritten or self.write is not None or self.read is not None
                    or self.h2d_pending or self.failed)


class DiskTier:
    def __init__(self, engine):
        self.engine, self.cfg = engine, engine.cfg
        self.file: Optional[SpillFile] = None
        self.stages: List[Stage] = [Stage() for _ in range(self.cfg.spill_slots)]
        self.next_offset = 0
        self.errors: List[OSError] = []  # failed writes not yet reported
        self.uses = 0

    # -- slots --------------------------------------------------------------
    def _event_done(self, ev: int, block: bool) -> bool:
        if block:
            self.engine.ext.event_synchronize(ev)
            return True
        return self.engine.ext.event_query(ev)

    def _advance(self, st: Stage, block: bool) -> None:
        """Move st's pending work on as far as it goes without waiting (block=False), or to
        the end (block=True)."""
        rec = st.rec
        if st.d2h_pending and self._event_done(st.d2h_ev, block):
            st.d2h_pending = False
        if st.unwritten and (rec is None or not rec.live):
            self._drop_write(st)  # the boundary is gone: its bytes are not needed any more
        if st.unwritten and not st.d2h_pending:
            st.write = self.file.write(st.buf, rec.nbytes, rec.spill_offset, reserved=st.reserved)
            st.unwritten, st.reserved = False, 0
        if st.write is not None and (block or st.write.done()):
            write, st.write = st.write, None
            try:
                write.wait()
            except OSError as e:
                self.engine.counts["spill_errors"] += 1
                if rec is not None and rec.live and rec.stage is st:
                    st.failed = True  # the slot keeps the boundary's only copy
                    self.errors.append(e)
        if st.read is not None and (block or st.read.done()):
            self._finish_read(st)
        if st.h2d_pending and self._event_done(st.h2d_ev, block):
            st.h2d_pending = False
        if st.failed and (rec is None or not rec.live):
            st.failed = False

    def _drop_write(self, st: Stage) -> None:
        if st.unwritten:
            self.file.release(st.reserved)
            st.unwritten, st.reserved = False, 0

    def _finish_read(self, st: Stage) -> None:
        read, st.read = st.read, None
        read.wait()  # an unreadable spill file raises here: the boundary is lost with it
        rec = st.rec
        if rec is not None and rec.live and rec.stage is st and rec.buf is None:
            self._land(st)

    def _land(self, st: Stage) -> None:
        """st holds rec's bytes: start their copy into rec.buf."""
        rec, eng = st.rec, self.engine
        host = st.buf.view[:rec.nbytes]
        if eng.is_cuda:
            eng.copy_in(rec, host, st.d2h_ev if st.d2h_pending else 0)
            eng.ext.event_record(st.h2d_ev, eng.load_stream.cuda_stream)
            st.h2d_pending = True
            rec.state = "loading"
        else:
            buf = torch.empty(rec.shape, dtype=rec.dtype)
            buf.view(-1).view(torch.uint8).copy_(host)
            rec.buf, rec.state = buf, "loaded"

    def _acquire(self, extent: int, use: str) -> Optional[Stage]:
        """A slot of >= extent bytes, free for new bytes, for `use`: "write" (forward), "read"
        (a reload needs it now) or "read_ahead". With none free, waits for the least recently
        used busy one; a read-ahead never waits for a slot whose read is still to be used, and
        gets None when that is all there is. A slot whose write fails while waited for is kept
        (it holds its boundary's only copy): a write raises that error, a read tries the next."""
        for st in self.stages:
            self._advance(st, block=False)
        free = [st for st in self.stages if st.idle]
        while not free:
            busy = [st for st in self.stages if not st.failed and not (use == "read_ahead" and st.read is not None)]
            if not busy:
                if use == "read_ahead":
                    return None
                raise self.errors[0] if self.errors and use == "write" else RuntimeError(
                    f"moepeak: SCO spill: all {len(self.stages)} staging slots hold a boundary whose write to "
                    f"{self.cfg.spill_dir} failed; raise SCOConfig.spill_slots or free space there")
            st = min(busy, key=lambda s: s.last_use)
            self._advance(st, block=True)
            if st.idle:
                free = [st]
            elif use == "write":
                self.pump(raise_errors=True)
        st = min(free, key=lambda s: (s.rec is not None and s.rec.live, s.last_use))
        if st.rec is not None and st.rec.stage is st:
            st.rec.stage = None  # its bytes are on disk: the slot was only a cache of them
        st.rec = None
        if st.buf is None or st.buf.nbytes < extent:
            if st.buf is not None:
                st.buf.free()
            st.buf = None
            st.buf = HostBuffer(extent, pinned=self.engine.is_cuda)
            self.engine.counts["staging_allocs"] += 1
            if self.engine.is_cuda and not st.d2h_ev:
                st.d2h_ev, st.h2d_ev = self.engine.event(), self.engine.event()
        st.last_use, self.uses = self.uses, self.uses + 1
        return st

    # -- engine entry points ------------------------------------------------
    def pump(self, raise_errors: bool) -> None:
        """Progress without waiting; raise_errors: report the first failed write (forward)."""
        for st in self.stages:
            self._advance(st, block=False)
        if raise_errors and self.errors:
            first = self.errors[0]
            self.errors.clear()  # one report for the failures seen so far
            raise first

    def offload(self, rec, x) -> None:
        """rec (a boundary of x) goes to disk: staged now, written behind."""
        if self.file is None:
            self.file = SpillFile(self.cfg.spill_dir, threads=self.cfg.spill_threads)
        extent = spill_extent(rec.nbytes)
        st = self._acquire(extent, "write")
        st.reserved = self.file.reserve(self.next_offset + rec.nbytes, f"spilling a boundary of {rec.nbytes} bytes")
        rec.spill_offset, rec.stage, st.rec = self.next_offset, st, rec
        self.next_offset += extent
        eng = self.engine
        if eng.is_cuda:
            eng.copy_out(rec, x, st.buf.view[:rec.nbytes])
            eng.ext.event_record(st.d2h_ev, eng.copy_stream.cuda_stream)
            st.d2h_pending = True
        else:
            st.buf.view[:rec.nbytes].copy_(x.reshape(-1).view(torch.uint8))
        st.unwritten = True
        self._advance(st, block=False)  # CPU: the write starts now
        eng.counts["spilled"] += 1
        eng.counts["spilled_bytes"] += rec.nbytes
        eng.log.append(("spill", rec.seq, rec.spill_offset))

    def load(self, rec) -> bool:
        """Start bringing rec back: from its slot if its bytes are still there, else a read
        into a free slot (False: none free now; the reload will load it itself)."""
        return self._load_now(rec, ahead=True)

    def _load_now(self, rec, ahead: bool = False) -> bool:
        if rec.stage is not None:
            self._drop_write(rec.stage)  # it comes back from here: no need to write it any more
            self._land(rec.stage)
            return True
        st = self._acquire(spill_extent(rec.nbytes), "read_ahead" if ahead else "read")
        if st is None:
            return False
        st.rec, rec.stage = rec, st
        st.read = self.file.read(st.buf, rec.nbytes, rec.spill_offset)
        rec.state = "loading"
        self.engine.counts["spill_reads"] += 1
        self.engine.counts["spill_read_bytes"] += rec.nbytes
        return True

    def finish(self, rec) -> None:
        """A reload needs rec now: start its load if no slot was free for it before, and wait
        for its read if it is still in flight."""
        if rec.state == "offloaded":
            self._load_now(rec)
        st = rec.stage
        if rec.buf is None and st is not None and st.read is not None:
            self._finish_read(st)
        if rec.buf is None:
            raise RuntimeError(f"moepeak: SCO spill: boundary {rec.seq} was not loaded (internal error)")

    def forget(self, rec) -> None:
        """rec was consumed or discarded: its slot (if any) holds nothing needed any more."""
        st = rec.stage
        if st is not None:
            self._drop_write(st)
            st.failed = False
            rec.stage = None

    def rewind(self) -> None:
        """A new step: file offsets start over, once every request of the last one finished
        (a new write must not overlap an old one in flight)."""
        for st in self.stages:
            if st.write is not None or st.read is not None:
                self._advance(st, block=True)
        self.errors.clear()  # failures of boundaries that are all gone now
        self.next_offset = 0

    def stats(self) -> dict:
        return dict(staging_bytes=sum(st.buf.allocated for st in self.stages if st.buf is not None),
                    spill_file_bytes=self.file.extent if self.file is not None else 0,
                    spill_direct=self.file.direct if self.file is not None else None)

    def close(self) -> None:
        for st in self.stages:
            self._advance(st, block=True)
        if self.file is not None:
            self.file.close()
            self.file = None
        for st in self.stages:
            if st.buf is not None:
                st.buf.free()
                st.buf = None
            for ev in (st.d2h_ev, st.h2d_ev):  # waited for above: idle, back to the engine's pool
                if ev:
                    self.engine.events.append(ev)
            st.d2h_ev = st.h2d_ev = 0
