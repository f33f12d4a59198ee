"""The SCO engine of one device: where each boundary waits (its tier), the copy and load
streams, the events. moepeak/sco/checkpoint.py decides *which* tensor is a boundary and
*when* it is needed; this module moves it. The arena is moepeak/sco/arena.py, the disk
tier moepeak/sco/disk.py, the copy ops moepeak/sco/ops.py.

Tiers (placement at each boundary's forward; the boundary needed first in backward stays
closest): "device" (sco_keep_on_gpu: the last keep_last blocks), "host" (an arena slot),
"disk" (the spill file, SCOConfig.spill_dir). With the disk tier on, a boundary goes to the
host when it and the boundaries expected after it in this step fit host_budget_bytes, else
to disk: the newest that fit stay in host RAM, the earliest go to disk. Expected after it:
as many as the previous step offloaded (the first step, or the one after a reconfigure: the
offloader's blocks_per_step, from the num_blocks apply_sco and moepeak.hf set; unknown:
none, so the first step fills the host first).

Schedule (compute = torch's current stream):
  forward block k:  copy stream waits on compute (event), D2H x_k -> its slot (arena or
                    staging), records copy_ev[k]; x_k is referenced until copy_ev[k] is
                    known complete (polled) or compute waits on it; with more than W
                    copies in flight compute waits on copy_ev[k-W] and drops x_{k-W}.
  backward block k: (first reload) if x_k was not prefetched, load it now; compute waits
                    on load_ev[k]; then prefetch x_{k-1..k-depth} on the load stream into
                    torch.empty buffers allocated on compute (load waits on compute and on
                    copy_ev); inside a DeferredPrefetch the prefetch waits for its start().
  next iteration:   arena slots are handed out by a bump pointer that rewinds when no
                    boundary is live; the first copy after a rewind waits on the load
                    stream's last event (a slot is never overwritten before its previous
                    H2D read it).
GPU working set ~ (kept + recomputing + prefetch depth + W) boundaries, flat in L.
The host and device tiers never block the host between free() calls: no event/stream
synchronize, no pinned allocation once the arena is sized, events come from a pool (the
GPU test counts these calls); the disk tier waits for its own I/O (disk.py). Every CUDA
entry point runs under bound(), which binds the device's primary context for both cudarts
on the calling thread (autograd's device thread included). On CPU tensors the same
bookkeeping runs; a host-tier boundary is the caller's tensor itself.

In-place changes: a boundary modified in place after its block's forward is refused at
backward with torch's "modified by an inplace operation" error, as torch's checkpoint does,
whenever the engine can see it: on the host (CPU) and device tiers it holds an alias sharing
the tensor's version counter; on the others it keeps a weak reference to the caller's
tensor, so the change is seen while that tensor is alive. Once it is freed (and no alias of
it is held here) a change through another view cannot be seen; the recompute then uses the
bytes copied at the forward, the forward's values, so the gradients stay those of the
forward.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from typing import List

import torch

from ..core.ext import current_stream_handle, require_cuda_build
from .arena import Arena
from .deferral import open_deferral
from .disk import DiskTier
from .ops import sco_offload, sco_reload
from .sizes import slot_bytes

COUNTERS = ("offloads", "offloaded_bytes", "kept", "reloads", "prefetches", "compute_waits", "max_in_flight",
            "discarded", "arena_chunks", "events_created", "max_host_bytes", "spilled", "spilled_bytes",
            "spill_reads", "spill_read_bytes", "staging_allocs", "spill_errors")


class Boundary:
    """One block input held by the engine. tier: device | host | disk; state: kept |
    offloaded | loading | loaded | consumed."""

    __slots__ = ("seq", "shape", "dtype", "device", "requires_grad", "nbytes", "tier", "slot", "state", "gpu",
                 "cpu", "buf", "copy_ev", "load_ev", "version", "held", "watch", "spill_offset", "stage")

    def __init__(self, seq: int, x: torch.Tensor):
        self.seq, self.shape, self.dtype, self.device = seq, x.shape, x.dtype, x.device
        self.requires_grad = x.requires_grad
        self.nbytes = x.numel() * x.element_size()
        self.tier = self.slot = self.stage = None
        self.state = "new"
        self.gpu = self.cpu = self.buf = None
        self.copy_ev = self.load_ev = 0
        self.spill_offset = 0
        self.version = x._version
        self.held = None  # an alias sharing x's version counter, while the engine holds one
        self.watch = weakref.ref(x)

    @property
    def live(self) -> bool:
        return self.state != "consumed"

    def check_version(self) -> None:
        """Raise torch's error if the boundary was modified in place since its forward."""
        t = self.held if self.held is not None else self.watch()
        if t is not None and t._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.type()} {list(self.shape)}], the input (boundary) of a block under sco_checkpoint, is at "
                f"version {t._version}; expected version {self.version} instead. Hint: do not modify a block's "
                "input in place before its backward (torch.utils.checkpoint refuses this too).")


class SCOEngine:
    """The arena, streams, events and spill file of one SCOOffloader on one device.
    ext: moepeak._C, or a stand-in with its functions (moepeak.testing.sco_extension)."""

    def __init__(self, cfg, device: torch.device, ext, blocks_per_step=None):
        self.cfg, self.device, self.ext = cfg, device, ext
        self.is_cuda = device.type == "cuda"
        self.counts = collections.Counter({k: 0 for k in COUNTERS})
        self.events: List[int] = []  # pool of idle events (moepeak runtime handles)
        if self.is_cuda:
            require_cuda_build("sco_checkpoint")
        # the arena first, outside bound(): a host that cannot hold arena_bytes refuses before
        # any call into ext (set_device included), so nothing is pinned and no event exists
        self.arena = Arena(cfg, pinned=self.is_cuda, counts=self.counts, ext=ext)
        if self.is_cuda:
            with self.bound():
                self.arena.reserve()  # arena_bytes pinned now
                self.copy_stream = torch.cuda.Stream(device)
                self.load_stream = torch.cuda.Stream(device)
                self.ready_ev = self.event()  # re-recorded on compute before each side-stream use
                self.load_tail_ev = self.event()  # last event on the load stream
        else:
            self.arena.reserve()
        self.disk = DiskTier(self) if cfg.spills else None
        self.live: "collections.OrderedDict[int, Boundary]" = collections.OrderedDict()
        self.inflight: "collections.deque[Boundary]" = collections.deque()
        self.seq = 0
        self.step_offloads = 0  # boundaries sent off the device in this step (host or disk)
        self.expected = blocks_per_step or 0  # how many the previous step sent (the placement's forecast)
        self.loads_pending_rewind = False
        self.log: List[tuple] = []  # (what, seq, ...) for schedule tests; cleared on rewind
        self.placement: List[tuple] = []  # (seq, tier) of this step's boundaries
        # Test knob: GPU cycles of torch.cuda._sleep enqueued on the side stream
        # before every copy, so a missing event shows up as wrong numbers.
        self.delay_cycles = 0
        self.unusable = ""  # why this engine must be made anew (a reconfigure that could not be undone)

    def set_extension(self, ext) -> None:
        self.ext = self.arena.ext = ext

    # -- helpers ------------------------------------------------------------
    @contextlib.contextmanager
    def bound(self):
        """Make this engine's device current for torch's cudart *and* moepeak's
        own (statically linked) cudart on the calling thread, restoring torch's
        device on exit. Each runtime keeps its own per-thread current device,
        and on a fresh thread (autograd's device thread runs our backward) no
        context may be bound yet: torch's guard skips cudaSetDevice when its
        device already matches, so nothing would bind the primary context
        before a cuBLAS call. cudaSetDevice through moepeak binds it (CUDA >= 12),
        which also keeps event_create on the right device. A no-op on CPU."""
        if not self.is_cuda:
            yield
            return
        with torch.cuda.device(self.device):
            self.ext.set_device(self.device.index)
            yield

    def event(self) -> int:
        """An event from the pool (events are reused: none are created in steady state)."""
        if self.events:
            return self.events.pop()
        self.counts["events_created"] += 1
        return self.ext.event_create()  # callers hold bound()

    def compute(self) -> int:
        return current_stream_handle(self.device)

    def _drop_gpu(self, rec: Boundary, wait: bool) -> None:
        """Drop rec's reference to its GPU input. wait=True: compute waits on the
        copy first (so a later compute allocation reusing it comes after the copy)."""
        if rec.gpu is None:
            return
        if wait:
            self.ext.stream_wait_event(self.compute(), rec.copy_ev)
        rec.gpu = None
        try:
            self.inflight.remove(rec)
        except ValueError:
            pass

    def _poll(self) -> None:
        while self.inflight and self.ext.event_query(self.inflight[0].copy_ev):
            self.inflight.popleft().gpu = None

    # -- copies (CUDA) ------------------------------------------------------
    def copy_out(self, rec: Boundary, x: torch.Tensor, host: torch.Tensor) -> None:
        """Enqueue x's D2H into `host` on the copy stream; never blocks the host. x stays
        referenced (rec.gpu) until its copy is known complete: _poll sees the event done,
        or compute was made to wait on it (W rule / reload)."""
        self._poll()
        xc = x.contiguous()
        rec.copy_ev = self.event()
        cs = self.copy_stream.cuda_stream
        self.ext.event_record(self.ready_ev, self.compute())
        self.ext.stream_wait_event(cs, self.ready_ev)  # x is produced
        if self.loads_pending_rewind:  # slots were last read by the previous iteration's loads
            self.ext.stream_wait_event(cs, self.load_tail_ev)
            self.loads_pending_rewind = False
        with torch.cuda.stream(self.copy_stream):
            if self.delay_cycles:
                torch.cuda._sleep(self.delay_cycles)
            sco_offload(xc, host)
        self.ext.event_record(rec.copy_ev, cs)
        rec.gpu = xc  # alive until copy_ev completes
        self.inflight.append(rec)
        while len(self.inflight) > self.cfg.max_in_flight:
            self._drop_gpu(self.inflight[0], wait=True)
            self.counts["compute_waits"] += 1

    def copy_in(self, rec: Boundary, host: torch.Tensor, after_ev: int) -> None:
        """Enqueue the H2D of `host` into a fresh device buffer (rec.buf, allocated on
        compute) on the load stream, after compute's work so far and after after_ev (the
        copy that filled host); records rec.load_ev."""
        buf = torch.empty(rec.shape, dtype=rec.dtype, device=self.device)  # on compute
        rec.load_ev = self.event()
        ls = self.load_stream.cuda_stream
        self.ext.event_record(self.ready_ev, self.compute())
        self.ext.stream_wait_event(ls, self.ready_ev)  # buf's previous users are done
        if after_ev:
            self.ext.stream_wait_event(ls, after_ev)
        with torch.cuda.stream(self.load_stream):
            if self.delay_cycles:
                torch.cuda._sleep(self.delay_cycles)
            sco_reload(host, buf)
        self.ext.event_record(rec.load_ev, ls)
        self.ext.event_record(self.load_tail_ev, ls)
        rec.buf = buf

    # -- forward ------------------------------------------------------------
    def offload(self, x: torch.Tensor, keep: bool) -> Boundary:
        """Block forward starts: x goes to its tier (or stays, keep=True). Raises (arena full,
        no room on disk, an earlier spill write failed) before anything of x is enqueued."""
        with self.bound():
            return self._offload(x, keep)

    def _new_step(self) -> None:
        """No boundary is live: a new step starts, every slot is free again."""
        if self.step_offloads:
            self.expected = self.step_offloads
        self.step_offloads = 0
        if self.disk is not None:
            self.disk.rewind()
        self.arena.rewind()
        self.log.clear()
        self.placement.clear()
        self.loads_pending_rewind = self.is_cuda

    def _place(self, nbytes: int) -> str:
        """host or disk (see the module docstring)."""
        if self.disk is None:
            return "host"
        after = max(self.expected - self.step_offloads - 1, 0)
        room = self.cfg.host_budget_bytes - self.arena.used
        return "host" if self.arena.fits(nbytes) and slot_bytes(nbytes) * (1 + after) <= room else "disk"

    def _offload(self, x: torch.Tensor, keep: bool) -> Boundary:
        if self.disk is not None:
            self.disk.pump(raise_errors=True)  # a failed spill write is reported before anything new
        if not self.live:
            self._new_step()
        # x itself when it needs no grad (on CPU, or kept, the replay sees that very object:
        # torch's identity); a detached alias otherwise, so the engine holds no graph.
        xd = x.detach() if x.requires_grad else x
        rec = Boundary(self.seq, x)
        if keep:
            rec.tier, rec.state, rec.gpu, rec.held = "device", "kept", xd, xd
            self.counts["kept"] += 1
            self.log.append(("keep", rec.seq))
        else:
            rec.tier = self._place(rec.nbytes)
            if rec.tier == "host":
                self._offload_host(rec, xd)
            else:
                self.disk.offload(rec, xd)  # raises (no room on disk) before anything is enqueued
            rec.state = "offloaded"
            self.step_offloads += 1
            self.counts["offloads"] += 1
            self.counts["offloaded_bytes"] += rec.nbytes
            self.counts["max_in_flight"] = max(self.counts["max_in_flight"], len(self.inflight))
        self.seq += 1
        self.live[rec.seq] = rec
        self.placement.append((rec.seq, rec.tier))
        return rec

    def _offload_host(self, rec: Boundary, x: torch.Tensor) -> None:
        rec.slot = self.arena.take(rec.nbytes)  # raises before anything is enqueued
        self.counts["max_host_bytes"] = max(self.counts["max_host_bytes"], self.arena.used)
        if self.is_cuda:
            self.copy_out(rec, x, self.arena.view(rec.slot, rec.nbytes))
        else:
            rec.cpu = rec.held = x  # already in host memory: nothing to copy
        self.log.append(("offload", rec.seq, rec.slot))

    # -- backward -----------------------------------------------------------
    def _load(self, rec: Boundary) -> bool:
        """Start bringing rec back (H2D on the load stream, a disk read, or nothing on CPU);
        False when the disk tier has no staging slot free for it now."""
        if rec.tier == "disk":
            return self.disk.load(rec)
        if self.is_cuda:
            self.copy_in(rec, self.arena.view(rec.slot, rec.nbytes), rec.copy_ev)  # after the D2H landed
            rec.state = "loading"
        else:
            rec.buf, rec.cpu = rec.cpu, None
            rec.state = "loaded"
        return True

    def reload(self, rec: Boundary) -> torch.Tensor:
        """Block rec.seq's backward starts (before its recompute is enqueued):
        return its input, then enqueue the prefetch of the previous ones, so
        their loads overlap this block's recompute and backward. Compute waits
        only on rec's own load event, right before rec's replay."""
        with self.bound():
            return self._reload(rec)

    def _reload(self, rec: Boundary) -> torch.Tensor:
        if rec.state == "consumed":
            raise RuntimeError(
                "moepeak: SCO boundary already consumed: backward through an offloaded checkpoint "
                "boundary a second time (retain_graph=True / double backward) is not supported"
            )
        rec.check_version()
        if self.is_cuda:
            self._poll()
        if self.disk is not None:
            self.disk.pump(raise_errors=False)
        if rec.state == "kept":
            x, rec.gpu = rec.gpu, None
            self.log.append(("reload", rec.seq, "kept"))
        else:
            if rec.state == "offloaded":
                self._load(rec)
                self.log.append(("load", rec.seq))
            if rec.tier == "disk":
                self.disk.finish(rec)  # its read done and its bytes on their way to rec.buf
            if self.is_cuda:
                self.ext.stream_wait_event(self.compute(), rec.load_ev)
                self._drop_gpu(rec, wait=False)  # compute is now after load, which is after the copy
            x, rec.buf = rec.buf, None
            self.counts["reloads"] += 1
            self.log.append(("reload", rec.seq))
        self._release(rec)
        deferral = open_deferral()
        if deferral is not None:
            deferral.queue.append((self, rec.seq))
        else:
            self._prefetch_before(rec.seq)
        return x

    def prefetch_before(self, seq: int) -> None:
        """Start the prefetch a reload of boundary `seq` would have (DeferredPrefetch.start)."""
        with self.bound():
            self._prefetch_before(seq)

    def _prefetch_before(self, seq: int) -> None:
        """Load the `prefetch` most recent live boundaries before seq still offloaded."""
        todo = [r for r in reversed(self.live.values()) if r.seq < seq and r.state == "offloaded"]
        for r in todo[: self.cfg.prefetch]:
            if self._load(r):
                self.counts["prefetches"] += 1
                self.log.append(("prefetch", r.seq))

    def _release(self, rec: Boundary) -> None:
        for ev in (rec.copy_ev, rec.load_ev):
            if ev:
                self.events.append(ev)
        rec.copy_ev = rec.load_ev = 0
        rec.state = "consumed"
        rec.held = None
        self.live.pop(rec.seq, None)
        if self.disk is not None and rec.tier == "disk":
            self.disk.forget(rec)

    def discard(self, rec: Boundary) -> None:
        """The block's graph died without a backward (or fn raised): free its slot safely."""
        if rec.state == "consumed":
            return
        if self.is_cuda:
            with self.bound():
                if rec.gpu is not None and rec.copy_ev:
                    self._drop_gpu(rec, wait=True)
                if rec.buf is not None and rec.load_ev:
                    self.ext.stream_wait_event(self.compute(), rec.load_ev)
        rec.gpu = rec.buf = rec.cpu = None
        self._release(rec)
        self.counts["discarded"] += 1

    # -- statistics and teardown -------------------------------------------
    @staticmethod
    def empty_stats() -> dict:
        """stats() of an engine that has seen nothing (every counter present, 0)."""
        d = {k: 0 for k in COUNTERS}
        d.update(live=0, gpu_held=0, arena_bytes=0, host_bytes=0, staging_bytes=0, spill_file_bytes=0,
                 spill_direct=None, log=[], placement=[])
        return d

    def stats(self) -> dict:
        """Counters since the engine was made; live, gpu_held, host_bytes (arena bytes this
        step), arena_bytes (pinned), the disk tier's staging_bytes, spill_file_bytes and
        spill_direct (None before the file exists); log and placement ((seq, tier) per
        boundary) of the current or last step."""
        d = dict(self.counts)
        held = {id(r) for r in self.live.values() if r.gpu is not None or r.buf is not None}
        held |= {id(r) for r in self.inflight if r.gpu is not None}  # discarded but copy not yet seen done
        d.update(live=len(self.live), gpu_held=len(held), arena_bytes=self.arena.nbytes, host_bytes=self.arena.used,
                 log=list(self.log), placement=list(self.placement))
        d.update(self.disk.stats() if self.disk is not None else
                 dict(staging_bytes=0, spill_file_bytes=0, spill_direct=None))
        return d

    def free(self) -> None:
        if self.live:
            raise RuntimeError(f"moepeak: SCO arena cannot be freed: {len(self.live)} boundaries are still live")
        with self.bound():
            self._release_resources()

    def _release_resources(self) -> None:
        """Free the arena and close the disk tier (no boundary live; caller holds bound())."""
        if self.is_cuda:  # explicit teardown: the one place SCO blocks the host
            torch.cuda.current_stream(self.device).synchronize()
            self.copy_stream.synchronize()
            self.load_stream.synchronize()
            self.inflight.clear()
        if self.disk is not None:
            self.disk.close()
        self.arena.free()

    def _make_resources(self, cfg, step: list) -> None:
        """The arena (arena_bytes reserved now) and the disk tier of cfg (caller holds bound());
        step[0] names the field being honoured when it raises (MemoryError: pinned memory short)."""
        self.cfg, self.disk = cfg, None
        step[:] = [f"arena_bytes={cfg.arena_bytes}"]
        self.arena = Arena(cfg, pinned=self.is_cuda, counts=self.counts, ext=self.ext)
        self.arena.reserve()
        step[:] = [f"spill_dir={cfg.spill_dir!r}"]
        self.disk = DiskTier(self) if cfg.spills else None

    def reconfigure(self, cfg, blocks_per_step) -> None:
        """Run to cfg from the next boundary on (no boundary live: SCOOffloader.reconfigure
        checks). Only max_in_flight, prefetch and keep_last changed: nothing else to do; any
        other field: the arena and the disk tier are released and made anew to cfg.

        All or nothing: if cfg's arena cannot be made (its arena_bytes of pinned memory, the
        one allocation made here), the previous config's arena and disk tier are made again
        (their memory was just freed) and the error names the field; the engine runs as
        before. If even that fails, self.unusable says why and the error says the engine must
        be made anew (SCOOffloader drops it; its next use makes a fresh one)."""
        soft = ("max_in_flight", "prefetch", "keep_last")
        if dataclasses.replace(cfg, **{f: getattr(self.cfg, f) for f in soft}) != self.cfg:
            old = self.cfg
            with self.bound():
                self._release_resources()
                step = []
                try:
                    self._make_resources(cfg, step)
                except Exception as e:
                    why = (f"moepeak: SCOOffloader.reconfigure: SCOConfig.{step[0]} could not be honoured on "
                           f"{self.device}")
                    try:
                        self._make_resources(old, [])
                    except Exception as again:
                        self.unusable = (f"{why} ({e}), and the previous config's arena could not be made again "
                                         f"({again}): this engine holds no arena and must be made anew")
                        raise _retold(e, self.unusable) from e
                    raise _retold(e, f"{why}: {e}; nothing changed: the previous config runs on") from e
        self.cfg = self.arena.cfg = cfg
        if blocks_per_step is not None:
            self.expected = blocks_per_step  # the next step's forecast, for the disk tier's placement
        self.step_offloads = 0


def _retold(e: Exception, message: str) -> Exception:
    """e's kind (MemoryError, OSError with its errno) with message; RuntimeError for any other."""
    if isinstance(e, OSError):
        return OSError(e.errno, message)
    return MemoryError(message) if isinstance(e, MemoryError) else RuntimeError(message)
