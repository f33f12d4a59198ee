"""NcclTransport: the Transport interface (moepeak/core/transport.py) on NCCL called
from C (csrc/nccl.c), for CUDA tensors.

Setup: rank 0 of `group` creates an ncclUniqueId, it is broadcast over
`group` with torch.distributed, and every rank creates its own NCCL
communicator on its device. This communicator is moepeak's own: it is
independent of whatever backend `group` uses (gloo or nccl).

Streams (docs/design.md section 1): every operation runs on one dedicated comm
stream per transport, so the operations of the communicator execute in the
order they were issued (NCCL's rule: same order on every rank; the schedules
issue them identically by construction).
  * before an op: comm stream waits for torch's current stream (the producer
    of the send buffers and the last user of the receive buffers);
  * after an op: an event is recorded on the comm stream. send_recv and
    all_to_all_v return a Handle whose wait() makes the *then current* stream
    wait for that event (no host sync); all_gather and all_reduce_ make the
    current stream wait before returning (also no host sync).
  * every tensor an op touches is record_stream'ed on the comm stream and held
    by the Handle until wait(), so the caching allocator never hands its
    memory to someone else while NCCL may still read or write it.

Data movement (send/recv, all-to-all-v, all-gather) is done in bytes (ncclUint8
with count = numel * element_size), so every dtype moves, and sender and
receiver agree whenever their byte sizes agree. all_reduce_ is typed.

Shutdown: close() (call it on every rank) waits, bounded, for the comm stream,
then destroys the communicator; if the work does not finish in time or NCCL
reports an asynchronous error (a peer is gone), it aborts instead. The
destroy/abort itself runs on a daemon thread joined with a deadline, since
recent NCCL synchronises ranks even there. Garbage collection and interpreter
exit abort (with short deadlines) every transport still open, so neither ever
hangs.
"""
from __future__ import annotations

import atexit
import operator
import os
import threading
import time
import warnings
import weakref
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _C
from .abi import NCCL_DTYPE_CODES, NCCL_OPS, dtype_name
from .ext import HAS_CUDA_BUILD, check_tensor
from .process_groups import group_info
from .transport import Handle, Transport

# ncclDataType_t codes (moepeak.core.abi): bytes for data movement, the tensor's own dtype
# for all-reduce.
_NCCL_UINT8 = NCCL_DTYPE_CODES["uint8"]
_REDUCE_DTYPES = {dtype: NCCL_DTYPE_CODES[dtype_name(dtype)] for dtype in (
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64, torch.bfloat16)}
_REDUCE_OPS = NCCL_OPS
_NCCL_IN_PROGRESS = 7

_LIVE: "weakref.WeakSet[NcclTransport]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _load_nccl() -> None:
    """Open libnccl (csrc/nccl.c: the copy torch loaded, the loader path,
    $MOEPEAK_NCCL_LIB); failing those, the NCCL pip wheel's or torch/lib's copy."""
    try:
        _C.nccl_load()
        return
    except RuntimeError as first:
        err = first
    cands = [os.path.join(os.path.dirname(torch.__file__), "lib", "libnccl.so.2")]
    try:
        import nvidia.nccl  # the nvidia-nccl-cu* wheel torch depends on
        cands += [os.path.join(p, "lib", "libnccl.so.2") for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    for path in cands:
        if os.path.exists(path):
            _C.nccl_load(path)  # raises with every place tried
            return
    raise err


def nccl_available() -> Optional[str]:
    """None when NcclTransport can be created here, else what is missing."""
    missing = []
    if not HAS_CUDA_BUILD:
        missing.append("a CUDA build of moepeak._C (it was built without nvcc or with MOEPEAK_CUDA=0; "
                       "rebuild with nvcc on PATH)")
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        _load_nccl()
    except RuntimeError as e:
        missing.append(f"the NCCL library ({e})")
    return "; ".join(missing) if missing else None


class NcclHandle(Handle):
    """An in-flight NCCL operation: wait() orders the current stream after it."""

    def __init__(self, transport: "NcclTransport", event: torch.cuda.Event, tensors: List[torch.Tensor]):
        super().__init__()
        self._transport = transport  # keeps the communicator alive until wait()
        self._event = event
        self._tensors = tensors

    def wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream(self._transport.device).wait_event(self._event)
        self._event = None
        self._tensors = []
        self._transport = None


def normalize_counts(name: str, counts, world_size: int) -> List[int]:
    """Per-rank row counts as a list of ints >= 0, one per rank."""
    if isinstance(counts, torch.Tensor):
        if counts.device.type != "cpu":
            raise ValueError(f"moepeak: {name} must be a CPU tensor or a sequence of ints (reading a "
                             f"{counts.device.type} tensor would sync the host), got device {counts.device}")
        if counts.dim() != 1 or counts.is_floating_point() or counts.is_complex():
            raise ValueError(f"moepeak: {name} must be a 1-D integer tensor, got {counts.dtype} "
                             f"shape {tuple(counts.shape)}")
        counts = counts.tolist()
    try:
        out = [operator.index(c) for c in counts]
    except TypeError:
        raise TypeError(f"moepeak: {name} must be a sequence of ints, got {counts!r}") from None
    if len(out) != world_size:
        raise ValueError(f"moepeak: {name} must have one count per rank ({world_size}), got {len(out)}")
    for i, c in enumerate(out):
        if c < 0:
            raise ValueError(f"moepeak: {name}[{i}] must be >= 0, got {c}")
    return out


class NcclTransport(Transport):
    """Transport over moepeak's own NCCL communicator on `device` (CUDA)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None):
        self._comm = None  # set last: a half-built transport holds nothing to release
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"moepeak: NcclTransport moves CUDA tensors only, got device={device}; "
                             "use backend='torch' (torch.distributed, e.g. gloo) for CPU tensors")
        missing = nccl_available()
        if missing:
            raise RuntimeError(f"moepeak: NcclTransport cannot run here; it needs {missing}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("moepeak: NcclTransport needs torch.distributed initialized (to broadcast the "
                               "NCCL unique id over the group); call torch.distributed.init_process_group first")
        info = group_info(group)
        self.group, self.rank, self.world_size = info.group, info.rank, info.world_size
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

        with torch.cuda.device(device):
            uid = [_C.nccl_get_unique_id() if self.rank == 0 else None]
            dist.broadcast_object_list(uid, src=info.global_ranks[0], group=self.group)
            if not isinstance(uid[0], bytes):
                raise RuntimeError(f"moepeak: the NCCL unique id broadcast from rank 0 arrived as {type(uid[0])}")
            # Blocks (GIL released) until every rank of the group has joined.
            self._comm = _C.nccl_comm_init(uid[0], self.world_size, self.rank, device.index)
            self._stream = torch.cuda.Stream(device=device)
            self._pre = torch.cuda.Event()   # current stream -> comm stream
            self._post = torch.cuda.Event()  # comm stream -> current stream, for ops waited at once
        self.nccl_version = _C.nccl_loaded()[0]
        with _LIVE_LOCK:
            _LIVE.add(self)

    # ---- plumbing ----------------------------------------------------------
    def _comm_or_raise(self):
        if self._comm is None:
            raise RuntimeError("moepeak: this NcclTransport was closed")
        return self._comm

    def _tensor(self, name: str, t, dtypes=None) -> torch.Tensor:
        return check_tensor(name, t, device=self.device, contiguous=True, dtypes=dtypes)

    def _peer(self, name: str, p) -> int:
        p = operator.index(p)
        if not 0 <= p < self.world_size:
            raise ValueError(f"moepeak: {name} must be a rank in [0, {self.world_size}), got {p}")
        return p

    def _run(self, fn, tensors: List[torch.Tensor], event: Optional[torch.cuda.Event] = None) -> torch.cuda.Event:
        """Enqueue fn(comm, stream_int) on the comm stream after the current
        stream's work; return an event recorded after it (a fresh one unless
        `event` is given). The `_pre` event is reused: once the comm stream's
        wait on it is enqueued, re-recording it cannot affect that wait."""
        comm = self._comm_or_raise()
        cur = torch.cuda.current_stream(self.device)
        self._pre.record(cur)
        self._stream.wait_event(self._pre)
        fn(comm, self._stream.cuda_stream)
        event = event if event is not None else torch.cuda.Event()
        event.record(self._stream)
        for t in tensors:
            t.record_stream(self._stream)
        return event

    # ---- the interface -----------------------------------------------------
    def send_recv(self, send, dst, recv, src) -> Handle:
        self._tensor("send", send)
        self._tensor("recv", recv)
        dst, src = self._peer("dst", dst), self._peer("src", src)
        sbytes, rbytes = send.numel() * send.element_size(), recv.numel() * recv.element_size()
        ev = self._run(lambda comm, s: _C.nccl_send_recv(comm, send.data_ptr(), sbytes, dst, recv.data_ptr(),
                                                         rbytes, src, _NCCL_UINT8, s), [send, recv])
        return NcclHandle(self, ev, [send, recv])

    def all_to_all_v(self, send, send_counts: Sequence[int], recv, recv_counts: Sequence[int]) -> Handle:
        self._tensor("send", send)
        self._tensor("recv", recv)
        if send.dim() == 0 or recv.dim() == 0:
            raise ValueError("moepeak: all_to_all_v send and recv must have a row dimension (dim 0)")
        if send.dtype != recv.dtype or send.shape[1:] != recv.shape[1:]:
            raise ValueError(f"moepeak: all_to_all_v send and recv rows must match: send {send.dtype} "
                             f"{tuple(send.shape)}, recv {recv.dtype} {tuple(recv.shape)}")
        sc = normalize_counts("send_counts", send_counts, self.world_size)
        rc = normalize_counts("recv_counts", recv_counts, self.world_size)
        if sum(sc) != send.shape[0]:
            raise ValueError(f"moepeak: send_counts sum to {sum(sc)} rows but send has {send.shape[0]}")
        if sum(rc) != recv.shape[0]:
            raise ValueError(f"moepeak: recv_counts sum to {sum(rc)} rows but recv has {recv.shape[0]}")
        row = send[0].numel() * send.element_size() if send.shape[0] else \
            recv[0].numel() * recv.element_size() if recv.shape[0] else 0
        sb, rb = [c * row for c in sc], [c * row for c in rc]
        ev = self._run(lambda comm, s: _C.nccl_all_to_all_v(comm, send.data_ptr(), sb, recv.data_ptr(), rb,
                                                            _NCCL_UINT8, s), [send, recv])
        return NcclHandle(self, ev, [send, recv])

    def all_gather(self, out, inp) -> None:
        self._tensor("inp", inp)
        self._tensor("out", out)
        if out.dtype != inp.dtype or out.dim() != inp.dim() + 1 or out.shape[0] != self.world_size \
                or out.shape[1:] != inp.shape:
            raise ValueError(f"moepeak: all_gather out must be [{self.world_size}, *{tuple(inp.shape)}] of "
                             f"{inp.dtype}, got {tuple(out.shape)} of {out.dtype}")
        nbytes = inp.numel() * inp.element_size()
        if nbytes == 0:
            return
        ev = self._run(lambda comm, s: _C.nccl_all_gather(comm, inp.data_ptr(), out.data_ptr(), nbytes,
                                                          _NCCL_UINT8, s), [inp, out], self._post)
        torch.cuda.current_stream(self.device).wait_event(ev)

    def all_reduce_(self, t, op: str = "sum") -> None:
        self._tensor("t", t, dtypes=_REDUCE_DTYPES)
        if op not in ("sum", "max", "min"):
            raise ValueError(f"moepeak: all_reduce op must be one of ['max', 'min', 'sum'], got {op!r}")
        if t.numel() == 0:
            return
        code, opc = _REDUCE_DTYPES[t.dtype], _REDUCE_OPS[op]
        ev = self._run(lambda comm, s: _C.nccl_all_reduce(comm, t.data_ptr(), t.data_ptr(), t.numel(), code,
                                                          opc, s), [t], self._post)
        torch.cuda.current_stream(self.device).wait_event(ev)

    # ---- health and shutdown -----------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether close() has released the communicator."""
        return self._comm is None

    def check(self) -> None:
        """Raise RuntimeError if NCCL reported an asynchronous error (e.g. a peer died)."""
        code, msg = _C.nccl_comm_async_error(self._comm_or_raise())
        if code not in (0, _NCCL_IN_PROGRESS):
            raise RuntimeError(f"moepeak: NCCL communicator failed asynchronously: {msg} (ncclResult {code})")

    def close(self, timeout: float = 60.0, abort: bool = False) -> None:
        """Release the communicator; call it on every rank, like
        destroy_process_group (ncclCommDestroy is collective in recent NCCL).

        Waits up to `timeout` s for the work already issued, then destroys the
        communicator; aborts instead if that work did not finish, if NCCL
        reported an asynchronous error, or if abort=True. The release runs in a
        daemon thread joined with a deadline, so close() returns even when a
        peer never joins it (a warning says so). Idempotent."""
        comm, self._comm = self._comm, None
        if comm is None:
            return
        with _LIVE_LOCK:
            _LIVE.discard(self)
        deadline = time.monotonic() + timeout
        try:
            done = torch.cuda.Event()
            done.record(self._stream)
            while not done.query():
                code, _ = _C.nccl_comm_async_error(comm)
                if code not in (0, _NCCL_IN_PROGRESS) or time.monotonic() > deadline:
                    abort = True
                    break
                time.sleep(1e-3)
        except Exception:  # CUDA already torn down, or a sticky error: do not block
            abort = True
        release_communicator(comm, abort, max(5.0, deadline - time.monotonic()))

    def __del__(self):
        # Garbage collection is not coordinated across ranks: never the
        # collective destroy here, and never block for long.
        try:
            self.close(timeout=5.0, abort=True)
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._comm is None else f"NCCL {self.nccl_version}"
        return f"NcclTransport(rank={self.rank}, world_size={self.world_size}, device={self.device}, {state})"


def release_communicator(comm: int, abort: bool, timeout: float) -> None:
    """ncclCommDestroy/ncclCommAbort (GIL released in C) on a daemon thread,
    joined for at most `timeout` s: a peer that never arrives, or an abort that
    waits on one, cannot hang this process (a stuck thread is abandoned)."""
    errors = []

    def run():
        try:
            _C.nccl_comm_destroy(comm, abort)
        except Exception as e:  # reported below
            errors.append(e)

    th = threading.Thread(target=run, name="moepeak-nccl-release", daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        warnings.warn(f"moepeak: NCCL communicator {'abort' if abort else 'destroy'} did not finish within "
                      f"{timeout:.0f}s (a peer did not call close()?); abandoning it", RuntimeWarning)
    elif errors:
        warnings.warn(f"moepeak: releasing the NCCL communicator failed: {errors[0]}", RuntimeWarning)


@atexit.register
def _close_all_at_exit() -> None:
    # Registered after torch's import, so it runs before torch's own teardown.
    with _LIVE_LOCK:
        live = list(_LIVE)
    for t in live:
        try:
            t.close(timeout=5.0, abort=True)
        except Exception:
            pass
