"""The SCO engine: the pinned host arena, the copy and load streams, the
events, and the two byte-copy ops (moepeak::sco_offload, moepeak::sco_reload).
moepeak/sco/checkpoint.py decides *which* tensor is a boundary and *when* it is needed;
this module moves it.

Schedule (one engine per device and SCOConfig; compute = torch's current stream):
  forward block k:  copy stream waits on compute (event), D2H x_k -> slot k,
                    records copy_ev[k]; x_k is referenced until copy_ev[k] is
                    known complete (polled) or compute waits on it; with more
                    than W copies in flight compute waits on copy_ev[k-W] and
                    drops x_{k-W} (its memory is reused only by later compute work).
  backward block k: (first reload) if x_k was not prefetched, load it now;
                    compute waits on load_ev[k]; then prefetch x_{k-1..k-depth}
                    on the load stream into torch.empty buffers allocated on
                    compute (load waits on compute and on copy_ev); inside a
                    DeferredPrefetch the prefetch waits for its start().
  next iteration:   slots are handed out by a bump pointer that rewinds when no
                    boundary is live; the first copy after a rewind waits on
                    the load stream's last event (a slot is never overwritten
                    before its previous H2D read it).
GPU working set ~ (kept + recomputing + prefetch depth + W) boundaries, flat in L.
Never blocks the host between free() calls: no event/stream synchronize, no
pinned allocation once the arena is sized, events come from a pool (the GPU
test counts these calls). Every CUDA entry point runs under _bound(), which
binds the device's primary context for both cudarts on the calling thread
(autograd's device thread included).
On CPU tensors the same slot bookkeeping runs with nothing to copy.

Arena layout: chunks of pinned bytes (uint8 [nbytes] each); a slot is
(chunk index, byte offset), offsets aligned to _ALIGN bytes.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
from typing import List

import torch

from .. import _C
from ..core.ext import current_stream_handle, require_cuda_build
from ..core.host_memory import check_room



def use_extension(ext) -> object:
    """Testing hook (moepeak.testing.sco_extension): the engine makes its extension calls
    on ext in place of moepeak._C from now on; returns the one it used before."""
    global _C
    previous, _C = _C, ext
    return previous


_ALIGN = 512  # slot alignment in the arena (bytes): keeps every slot DMA-friendly

_DEFERRAL = threading.local()  # .open: the DeferredPrefetch collecting on this thread, or None


class DeferredPrefetch:
    """Holds back the prefetch that a reload starts, from `collect()` until `start()`.

    A reload normally enqueues the previous boundaries' H2D at once, so the prefetched
    buffers are allocated while the reloaded block's backward runs. A caller whose
    backward peaks soon after its boundary is reloaded (the sequence-tiled block: its
    attention core's backward) opens this around the reload and starts the prefetch once
    that peak has passed, so the prefetched boundary is not part of it. Reloads on this
    thread inside collect() queue their prefetch; start() issues the queue (once; later
    calls do nothing). A prefetch never started is not lost: the next reload loads that
    boundary itself (the same bytes, only not overlapped)."""

    __slots__ = ("queue", "_outer")

    def __init__(self):
        self.queue: list = []  # (engine, seq of the reloaded boundary)

    @contextlib.contextmanager
    def collect(self):
        self._outer = getattr(_DEFERRAL, "open", None)
        _DEFERRAL.open = self
        try:
            yield self
        finally:
            _DEFERRAL.open = self._outer

    def start(self) -> None:
        queue, self.queue = self.queue, []
        for engine, seq in queue:
            with engine._bound() if engine.is_cuda else contextlib.nullcontext():
                engine._prefetch_before(seq)

# ---------------------------------------------------------------------------
# Ops. Both copy raw bytes of a contiguous tensor; host is a uint8 [nbytes]
# CPU view of an arena slot. CUDA: async on torch's current stream (the caller
# orders it with events). CPU: a plain copy. They mutate their destination,
# and torch refuses register_autograd for mutating ops: gradients flow through
# sco_checkpoint's recompute, never through these copies.
# ---------------------------------------------------------------------------
def _check_pair(src_name, src, dst_name, dst):
    for n, t in ((src_name, src), (dst_name, dst)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moepeak: {n} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"moepeak: {n} must be contiguous, got strides {t.stride()}")
    nb_s = src.numel() * src.element_size()
    nb_d = dst.numel() * dst.element_size()
    if nb_s != nb_d:
        raise ValueError(f"moepeak: {src_name} has {nb_s} bytes but {dst_name} has {nb_d}")
    return nb_s


def _copy_bytes(op: str, src: torch.Tensor, dst: torch.Tensor, dev: torch.device, nbytes: int,
                host: torch.Tensor) -> None:
    """The body of both ops: `host` must be CPU; a CUDA side copies async on the
    current stream (moepeak's copy engine), a CPU pair copies bytes in place."""
    if host.device.type != "cpu":
        raise ValueError(f"moepeak: host must be a CPU tensor, got {host.device}")
    if dev.type == "cuda":
        require_cuda_build(op)
        _C.sco_copy(dst.data_ptr(), src.data_ptr(), nbytes, current_stream_handle(dev), 0, 0)
    elif nbytes:
        dst.view(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))


@torch.library.custom_op("moepeak::sco_offload", mutates_args=("host",))
def sco_offload(x: torch.Tensor, host: torch.Tensor) -> None:
    """Copy x's bytes into host (CPU, pinned for CUDA x), async on the current stream."""
    _copy_bytes("sco_offload", src=x, dst=host, dev=x.device, nbytes=_check_pair("x", x, "host", host), host=host)


@sco_offload.register_fake
def _(x, host):
    return None


@torch.library.custom_op("moepeak::sco_reload", mutates_args=("out",))
def sco_reload(host: torch.Tensor, out: torch.Tensor) -> None:
    """Copy host's bytes into out (a tensor of the boundary's shape), async on the current stream."""
    _copy_bytes("sco_reload", src=host, dst=out, dev=out.device, nbytes=_check_pair("host", host, "out", out),
                host=host)


@sco_reload.register_fake
def _(host, out):
    return None



class _Arena:
    """Pinned host chunks (CUDA) or virtual offsets (CPU), handed out by a bump
    pointer that rewinds when no slot is live. Slot = (chunk index, offset)."""

    def __init__(self, cfg, pinned: bool, counts: collections.Counter):
        self.cfg, self.pinned, self.counts = cfg, pinned, counts
        self.chunks: List[list] = []  # [ptr, nbytes, ctypes buffer, uint8 tensor view]
        self.cur, self.off = 0, 0
        self.cap = cfg.max_arena_bytes if cfg.grow else cfg.arena_bytes
        if cfg.arena_bytes:
            self._add_chunk(cfg.arena_bytes)

    @property
    def nbytes(self) -> int:
        return sum(c[1] for c in self.chunks)

    def _add_chunk(self, n: int) -> None:
        if self.pinned:
            check_room(n, "moepeak: SCO arena chunk", "each checkpoint boundary held by SCO takes tokens x hidden "
                       "x element bytes of it per block: shorten the sequence, split it over more ranks, or "
                       "checkpoint fewer blocks with SCO", pinned=True)
            ptr = _C.sco_arena_alloc(n)  # MemoryError naming the size on failure
            buf = (ctypes.c_uint8 * n).from_address(ptr)
            view = torch.frombuffer(buf, dtype=torch.uint8)
        else:
            ptr, buf, view = 0, None, None
        self.chunks.append([ptr, n, buf, view])
        self.counts["arena_chunks"] += 1  # cudaHostAlloc: slow, blocking; never in steady state

    def rewind(self) -> None:
        self.cur, self.off = 0, 0

    def take(self, nbytes: int):
        need = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        while self.cur < len(self.chunks):
            if self.off + need <= self.chunks[self.cur][1]:
                slot = (self.cur, self.off)
                self.off += need
                return slot
            self.cur, self.off = self.cur + 1, 0
        grow = max(need, self.cfg.grow_bytes if self.cfg.grow else 0)
        if not self.cfg.grow or (self.cap is not None and self.nbytes + grow > self.cap):
            if self.cap is not None and self.cfg.grow and self.nbytes + need <= self.cap:
                grow = need  # fits when growing by exactly what is needed
            else:
                raise RuntimeError(
                    f"moepeak: SCO arena too small and cannot grow: a boundary of {nbytes} bytes does not fit "
                    f"(arena {self.nbytes} bytes in use this iteration, cap "
                    f"{self.cap if self.cap is not None else 'none'}, grow={self.cfg.grow}); raise "
                    "SCOConfig.arena_bytes / max_arena_bytes. Nothing was kept on the GPU instead."
                )
        self._add_chunk(grow)
        self.cur, self.off = len(self.chunks) - 1, need
        return (self.cur, 0)

    def view(self, slot, nbytes: int) -> torch.Tensor:
        c, off = slot
        return self.chunks[c][3][off:off + nbytes]

    def free(self) -> None:
        while self.chunks:
            ptr = self.chunks.pop()[0]
            if ptr:
                _C.sco_arena_free(ptr)
        self.rewind()


class _Boundary:
    """One block input held by the engine. state: kept | offloaded | loading | loaded | consumed."""

    __slots__ = ("seq", "shape", "dtype", "device", "requires_grad", "nbytes", "slot",
                 "state", "gpu", "cpu", "buf", "copy_ev", "load_ev")

    def __init__(self, seq, x):
        self.seq, self.shape, self.dtype, self.device = seq, x.shape, x.dtype, x.device
        self.requires_grad = x.requires_grad
        self.nbytes = x.numel() * x.element_size()
        self.slot = None
        self.state = "new"
        self.gpu = self.cpu = self.buf = None
        self.copy_ev = self.load_ev = 0


_COUNTERS = ("offloads", "offloaded_bytes", "kept", "reloads", "prefetches", "compute_waits",
             "max_in_flight", "discarded", "arena_chunks", "events_created")


class SCOEngine:
    """The arena, streams and events of one SCOConfig on one device."""

    def __init__(self, cfg, device: torch.device):
        self.cfg, self.device = cfg, device
        self.is_cuda = device.type == "cuda"
        self.counts = collections.Counter({k: 0 for k in _COUNTERS})
        self.events: List[int] = []  # pool of idle events (moepeak runtime handles)
        if self.is_cuda:
            require_cuda_build("sco_checkpoint")
            with self._bound():
                # the arena first: a host that cannot hold it refuses before any event exists
                self.arena = _Arena(cfg, pinned=True, counts=self.counts)  # arena_bytes allocated now
                self.copy_stream = torch.cuda.Stream(device)
                self.load_stream = torch.cuda.Stream(device)
                self.ready_ev = self._event()  # re-recorded on compute before each side-stream use
                self.load_tail_ev = self._event()  # last event on the load stream
        else:
            self.arena = _Arena(cfg, pinned=False, counts=self.counts)
        self.live: "collections.OrderedDict[int, _Boundary]" = collections.OrderedDict()
        self.inflight: "collections.deque[_Boundary]" = collections.deque()
        self.seq = 0
        self.loads_pending_rewind = False
        self.log: List[tuple] = []  # (what, seq, ...) for schedule tests; cleared on rewind
        # Test knob: GPU cycles of torch.cuda._sleep enqueued on the side stream
        # before every copy, so a missing event shows up as wrong numbers.
        self.delay_cycles = 0

    # -- helpers ------------------------------------------------------------
    @contextlib.contextmanager
    def _bound(self):
        """Make this engine's device current for torch's cudart *and* moepeak's
        own (statically linked) cudart on the calling thread, restoring torch's
        device on exit. Each runtime keeps its own per-thread current device,
        and on a fresh thread (autograd's device thread runs our backward) no
        context may be bound yet: torch's guard skips cudaSetDevice when its
        device already matches, so nothing would bind the primary context
        before a cuBLAS call. cudaSetDevice through moepeak binds it (CUDA >= 12),
        which also keeps event_create on the right device."""
        with torch.cuda.device(self.device):
            _C.set_device(self.device.index)
            yield

    def _event(self) -> int:
        """An event from the pool (events are reused: none are created in steady state)."""
        if self.events:
            return self.events.pop()
        self.counts["events_created"] += 1
        return _C.event_create()  # callers hold _bound()

    def _compute(self) -> int:
        return current_stream_handle(self.device)

    def _drop_gpu(self, rec: _Boundary, wait: bool) -> None:
        """Drop rec's reference to its GPU input. wait=True: compute waits on the
        copy first (so a later compute allocation reusing it comes after the copy)."""
        if rec.gpu is None:
            return
        if wait:
            _C.stream_wait_event(self._compute(), rec.copy_ev)
        rec.gpu = None
        try:
            self.inflight.remove(rec)
        except ValueError:
            pass

    def _poll(self) -> None:
        while self.inflight and _C.event_query(self.inflight[0].copy_ev):
            self.inflight.popleft().gpu = None

    # -- forward ------------------------------------------------------------
    def offload(self, x: torch.Tensor, keep: bool) -> _Boundary:
        """Block forward starts: x goes to a slot (or stays, keep=True)."""
        with self._bound() if self.is_cuda else contextlib.nullcontext():
            return self._offload(x, keep)

    def _offload(self, x: torch.Tensor, keep: bool) -> _Boundary:
        rec = _Boundary(self.seq, x)
        self.seq += 1
        if not self.live:  # a new iteration: every slot is free again
            self.arena.rewind()
            self.log.clear()
            self.loads_pending_rewind = self.is_cuda
        if keep:
            rec.state, rec.gpu = "kept", x
            self.counts["kept"] += 1
            self.live[rec.seq] = rec
            self.log.append(("keep", rec.seq))
            return rec
        rec.slot = self.arena.take(rec.nbytes)  # raises before anything is enqueued
        if self.is_cuda:
            self._offload_cuda(rec, x)
        else:
            rec.cpu = x  # already in host memory: nothing to copy
        rec.state = "offloaded"
        self.counts["offloads"] += 1
        self.counts["offloaded_bytes"] += rec.nbytes
        self.counts["max_in_flight"] = max(self.counts["max_in_flight"], len(self.inflight))
        self.live[rec.seq] = rec
        self.log.append(("offload", rec.seq, rec.slot))
        return rec

    def _offload_cuda(self, rec: _Boundary, x: torch.Tensor) -> None:
        """Enqueue x's D2H into rec's slot; never blocks the host. x stays
        referenced (rec.gpu) until its copy is known complete: _poll sees the
        event done, or compute was made to wait on it (W rule / reload)."""
        self._poll()
        xc = x.contiguous()
        host = self.arena.view(rec.slot, rec.nbytes)
        rec.copy_ev = self._event()
        cs = self.copy_stream.cuda_stream
        _C.event_record(self.ready_ev, self._compute())
        _C.stream_wait_event(cs, self.ready_ev)  # x is produced
        if self.loads_pending_rewind:  # slots were last read by the previous iteration's loads
            _C.stream_wait_event(cs, self.load_tail_ev)
            self.loads_pending_rewind = False
        with torch.cuda.stream(self.copy_stream):
            if self.delay_cycles:
                torch.cuda._sleep(self.delay_cycles)
            torch.ops.moepeak.sco_offload(xc, host)
        _C.event_record(rec.copy_ev, cs)
        rec.gpu = xc  # alive until copy_ev completes
        self.inflight.append(rec)
        while len(self.inflight) > self.cfg.max_in_flight:
            self._drop_gpu(self.inflight[0], wait=True)
            self.counts["compute_waits"] += 1

    # -- backward -----------------------------------------------------------
    def _load(self, rec: _Boundary) -> None:
        """Start bringing rec back (H2D on the load stream, or nothing on CPU)."""
        if self.is_cuda:
            buf = torch.empty(rec.shape, dtype=rec.dtype, device=self.device)  # on compute
            rec.load_ev = self._event()
            ls = self.load_stream.cuda_stream
            _C.event_record(self.ready_ev, self._compute())
            _C.stream_wait_event(ls, self.ready_ev)  # buf's previous users are done
            _C.stream_wait_event(ls, rec.copy_ev)  # the D2H landed in the slot
            with torch.cuda.stream(self.load_stream):
                if self.delay_cycles:
                    torch.cuda._sleep(self.delay_cycles)
                torch.ops.moepeak.sco_reload(self.arena.view(rec.slot, rec.nbytes), buf)
            _C.event_record(rec.load_ev, ls)
            _C.event_record(self.load_tail_ev, ls)
            rec.buf = buf
            rec.state = "loading"
        else:
            rec.buf, rec.cpu = rec.cpu, None
            rec.state = "loaded"

    def reload(self, rec: _Boundary) -> torch.Tensor:
        """Block rec.seq's backward starts (before its recompute is enqueued):
        return its input, then enqueue the prefetch of the previous ones, so
        their H2D overlaps this block's recompute and backward. Compute waits
        only on rec's own load event, right before rec's replay."""
        with self._bound() if self.is_cuda else contextlib.nullcontext():
            return self._reload(rec)

    def _reload(self, rec: _Boundary) -> torch.Tensor:
        if rec.state == "consumed":
            raise RuntimeError(
                "moepeak: SCO boundary already consumed: backward through an offloaded checkpoint "
                "boundary a second time (retain_graph=True / double backward) is not supported"
            )
        if self.is_cuda:
            self._poll()
        if rec.state == "kept":
            x, rec.gpu = rec.gpu, None
            self.log.append(("reload", rec.seq, "kept"))
        else:
            if rec.state == "offloaded":
                self._load(rec)
                self.log.append(("load", rec.seq))
            if self.is_cuda:
                _C.stream_wait_event(self._compute(), rec.load_ev)
                self._drop_gpu(rec, wait=False)  # compute is now after load, which is after the copy
            x, rec.buf = rec.buf, None
            self.counts["reloads"] += 1
            self.log.append(("reload", rec.seq))
        self._release(rec)
        deferral = getattr(_DEFERRAL, "open", None)
        if deferral is not None:
            deferral.queue.append((self, rec.seq))
        else:
            self._prefetch_before(rec.seq)
        return x

    def _prefetch_before(self, seq: int) -> None:
        """Load the `prefetch` most recent live boundaries before seq still on the host."""
        todo = [r for r in reversed(self.live.values()) if r.seq < seq and r.state == "offloaded"]
        for r in todo[: self.cfg.prefetch]:
            self._load(r)
            self.counts["prefetches"] += 1
            self.log.append(("prefetch", r.seq))

    def _release(self, rec: _Boundary) -> None:
        for ev in (rec.copy_ev, rec.load_ev):
            if ev:
                self.events.append(ev)
        rec.copy_ev = rec.load_ev = 0
        rec.state = "consumed"
        self.live.pop(rec.seq, None)

    def discard(self, rec: _Boundary) -> None:
        """The block's graph died without a backward (or fn raised): free its slot safely."""
        if rec.state == "consumed":
            return
        if self.is_cuda:
            with self._bound():
                if rec.gpu is not None and rec.copy_ev:
                    self._drop_gpu(rec, wait=True)
                if rec.buf is not None and rec.load_ev:
                    _C.stream_wait_event(self._compute(), rec.load_ev)
        rec.gpu = rec.buf = rec.cpu = None
        self._release(rec)
        self.counts["discarded"] += 1

    @staticmethod
    def empty_stats() -> dict:
        """stats() of an engine that has seen nothing (every counter present, 0)."""
        d = {k: 0 for k in _COUNTERS}
        d.update(live=0, gpu_held=0, arena_bytes=0, log=[])
        return d

    def stats(self) -> dict:
        d = dict(self.counts)
        held = {id(r) for r in self.live.values() if r.gpu is not None or r.buf is not None}
        held |= {id(r) for r in self.inflight if r.gpu is not None}  # discarded but copy not yet seen done
        d.update(live=len(self.live), gpu_held=len(held), arena_bytes=self.arena.nbytes, log=list(self.log))
        return d

    def free(self) -> None:
        if self.live:
            raise RuntimeError(f"moepeak: SCO arena cannot be freed: {len(self.live)} boundaries are still live")
        if self.is_cuda:  # explicit teardown: the one place SCO blocks the host
            with self._bound():
                torch.cuda.current_stream(self.device).synchronize()
                self.copy_stream.synchronize()
                self.load_stream.synchronize()
                self.inflight.clear()
                self.arena.free()
        else:
            self.arena.free()

