"""SCO: selective checkpoint offload of checkpoint boundaries.

With activation checkpointing each block keeps exactly one long-lived tensor:
its input (the hidden state, x_k: [.., T, H] x dtype), alive from the block's
forward until its backward, so L blocks hold L·T·H·b bytes on the GPU. SCO
moves exactly that tensor (never weights, never tensors saved outside
checkpointed blocks) into a slot of a pinned host arena and brings it back
just before the block recomputes (or, with the disk tier, writes the earliest ones to a
spill file). This module is sco_checkpoint (exported by moepeak.sco) and the checkpoint
mechanics; where a boundary waits and how it moves is the engine's
(moepeak/sco/engine.py), held by an SCOOffloader (moepeak/sco/offloader.py).

Checkpoint mechanics. torch's non-reentrant checkpoint keeps the block's
boundary input in its recompute closure, so the GPU input would stay alive
whatever we copy. sco_checkpoint therefore does what that checkpoint does,
except for the boundary:
  forward (grad enabled):
    1. rec = engine.offload(x): the boundary x (the first tensor positional
       argument, else the first tensor keyword argument) goes to its arena
       slot; from here only the engine references x, until its copy landed.
    2. Every other tensor positional argument is kept as a saved tensor of the
       autograd engine (as torch's checkpoint keeps its inputs), so an in-place
       change to it before backward raises torch's "modified by an inplace
       operation" error. Keyword arguments other than the boundary are held by
       reference (as torch's checkpoint holds them).
    3. fn(*args, **kwargs) runs once under saved-tensor hooks whose pack
       stores only an index (a _Holder): nothing fn saves is kept. The outer
       graph (and every hook FSDP2 put on it) is the graph of a plain forward.
  backward (the first unpack of one of the block's holders in a graph task):
    4. x' = engine.reload(rec) (waits on its load event, prefetches the previous
       block's input) the first time; x' is then held by the frame so a second
       backward (retain_graph=True) can replay again. fn is replayed on
       (x', the saved arguments) under enable_grad with the forward's CPU/CUDA
       RNG and autocast state, recording every saved tensor, and stops once the
       forward's count is reached (torch's early stop). Holder i returns
       recomputed tensor i of its graph task, once.
  create_graph=True: the unpacked tensors are re-attached to the forward graph
  by autograd itself (as for torch's checkpoint), so second-order terms flow.
  torch.compile: sco_checkpoint is never traced (a graph break); fn runs
  eagerly under the hooks in the forward as in the replay, so both save the
  same tensors (a compiled forward would save its AOT graph's instead).
Same ops on the same values in the same order => the saved tensors are
bitwise those of the forward, and so are all gradients (bitwise those of
torch.utils.checkpoint(use_reentrant=False)); FSDP2 composes the same way.
"""
from __future__ import annotations

import logging
import uuid
import weakref
from typing import Dict, Optional

import torch
import torch.utils.checkpoint as _tuc

from .engine import SCOEngine
from .offloader import SCOOffloader, default_offloader

try:  # the autograd engine's saved tensor (version-checked on unpack), as torch's checkpoint uses
    from torch._C._autograd import _make_saved_tensor
except ImportError:  # older torch: hold the argument by reference and check its version ourselves
    _make_saved_tensor = None
    logging.getLogger("moepeak").warning(
        "moepeak: this torch has no torch._C._autograd._make_saved_tensor: sco_checkpoint holds its tensor "
        "arguments by reference and checks their version counters itself")


def _autocast_state(device_type: str):
    try:
        return (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
                torch.is_autocast_cache_enabled())
    except (TypeError, AttributeError, RuntimeError):  # older torch: cuda / cpu only
        if device_type == "cpu":
            return (torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype(), torch.is_autocast_cache_enabled())
        return (torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype(), torch.is_autocast_cache_enabled())


class _StopReplay(Exception):
    """Raised by the replay's pack hook once fn has saved as many tensors as in
    the forward: the ops after the last save (typically the block's last GEMM
    and its residual add) only produce outputs nobody reads. A pack hook runs
    before the op's kernel, so the final Linear's GEMM is never launched
    (torch's non-reentrant checkpoint stops its recompute the same way)."""


class _Holder:
    """What the autograd graph stores instead of a saved tensor: (frame, index)."""

    __slots__ = ("frame", "idx", "__weakref__")

    def __init__(self, frame, idx):
        self.frame, self.idx = frame, idx


class _Kept:
    """A non-boundary tensor argument kept for the replay: an autograd saved
    tensor (unpack raises if the argument was modified in place since the
    forward), or, without torch's saved-tensor binding, the tensor and its
    version counter value at forward time."""

    __slots__ = ("saved", "tensor", "version")

    def __init__(self, t: torch.Tensor):
        if _make_saved_tensor is not None:
            self.saved, self.tensor, self.version = _make_saved_tensor(t, is_output=False), None, None
        else:
            self.saved, self.tensor, self.version = None, t, t._version

    def unpack(self) -> torch.Tensor:
        if self.saved is not None:
            return self.saved.unpack()
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: an argument of sco_checkpoint is at version {self.tensor._version}; expected "
                f"version {self.version} instead")
        return self.tensor


def _graph_task_id() -> int:
    gid = torch._C._current_graph_task_id()
    return gid if gid != -1 else uuid.uuid4().int  # unpack outside a backward: a one-off id


class _Frame:
    """One sco_checkpoint call: everything needed to replay fn.

    args: the positional arguments with the boundary slot None and every other
    tensor a _Kept; kwargs: keyword arguments (boundary key None when the
    boundary came by keyword). x: the boundary once reloaded (None before the
    first backward). recomputed: graph task id -> [n_packed] saved tensors of
    that task's replay (entries set to None as they are handed out)."""

    def __init__(self, fn, args, kwargs, where, engine: SCOEngine, preserve_rng: bool, boundary: torch.Tensor):
        self.fn, self.where, self.engine = fn, where, engine
        self.args = [_Kept(a) if isinstance(a, torch.Tensor) and i != where else a for i, a in enumerate(args)]
        self.kwargs = dict(kwargs)
        if isinstance(where, int):
            self.args[where] = None  # x lives in the engine only
        else:
            self.kwargs[where] = None
        self.rec = None
        self.x = None
        self.n_packed = 0
        self.meta = []  # (shape, dtype) per saved tensor, checked after each replay
        self.recomputed: Dict[int, list] = {}
        self.preserve = preserve_rng
        self.dev_type = boundary.device.type
        self.cpu_rng = torch.get_rng_state() if preserve_rng else None
        self.had_cuda = preserve_rng and torch.cuda.is_available() and torch.cuda.is_initialized()
        tensors = [a for a in args if isinstance(a, torch.Tensor)] or [boundary]
        self.rng_devices, self.rng_states = (_tuc.get_device_states(*tensors) if self.had_cuda else ([], []))
        self.autocast = {d: _autocast_state(d) for d in {"cpu", self.dev_type}}

    # forward pack hook: keep nothing but the index
    def pack(self, t: torch.Tensor):
        h = _Holder(self, self.n_packed)
        self.n_packed += 1
        self.meta.append((t.shape, t.dtype))
        return h

    def unpack(self, h: _Holder):
        gid = _graph_task_id()
        store = self.recomputed.get(gid)
        if store is None:
            store = self.recomputed[gid] = self._replay()
        t = store[h.idx]
        if t is None:
            raise RuntimeError(
                "moepeak: sco_checkpoint: a saved tensor was unpacked twice in one backward (torch's checkpoint "
                "refuses this too: read ctx.saved_tensors once)")
        store[h.idx] = None
        return t

    def _inputs(self):
        if self.x is None:
            self.x = self.engine.reload(self.rec)  # detached: the engine holds no graph
        # A boundary without grad goes to fn as the very tensor the engine gave back (the
        # caller's own object on CPU and when kept on the GPU, as torch's checkpoint replays
        # with its inputs; a fresh buffer once it went through the arena).
        x = self.x.detach().requires_grad_(True) if self.rec.requires_grad else self.x
        args = [a.unpack() if isinstance(a, _Kept) else a for a in self.args]
        kwargs = dict(self.kwargs)
        if isinstance(self.where, int):
            args[self.where] = x
        else:
            kwargs[self.where] = x
        return args, kwargs

    def _replay(self) -> list:
        args, kwargs = self._inputs()
        store = []

        def pack(t):
            # torch's rule: a saved tensor that requires grad comes back detached, any
            # other is handed to backward as the same object (ctx.saved_tensors identity)
            store.append(t.detach() if t.requires_grad else t)
            if len(store) == self.n_packed:
                raise _StopReplay  # every saved tensor is back: the rest of fn is wasted work
            return None

        def unpack(_):
            raise RuntimeError("moepeak: SCO's recompute graph is never backpropagated")

        with torch.random.fork_rng(devices=self.rng_devices, enabled=self.preserve), torch.enable_grad():
            if self.preserve:
                torch.set_rng_state(self.cpu_rng)
                if self.had_cuda:
                    _tuc.set_device_states(self.rng_devices, self.rng_states)
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack), _autocast_ctx(self.autocast):
                    self.fn(*args, **kwargs)
            except _StopReplay:
                pass
        self._check_replay(store)
        return store

    def _check_replay(self, store: list) -> None:
        """The replay must save what the forward saved: as many tensors, each of the same
        shape and dtype (torch's checkpoint checks the same); say exactly what differs."""
        what = None
        if len(store) != self.n_packed:
            what = f"the recompute saved {len(store)} tensors but the forward saved {self.n_packed}"
        else:
            for i, (t, (shape, dtype)) in enumerate(zip(store, self.meta)):
                if t.shape != shape or t.dtype != dtype:
                    what = (f"saved tensor {i} of {self.n_packed} was {_describe(shape, dtype)} in the forward "
                            f"but {_describe(t.shape, t.dtype)} in the recompute")
                    break
        if what is not None:
            raise RuntimeError(f"moepeak: sco_checkpoint: {what}; fn must run the same ops on the same "
                               "shapes and dtypes on every call (its recompute replays the forward)")


def _describe(shape, dtype) -> str:
    return f"shape {tuple(shape)} dtype {dtype}"


class _autocast_ctx:
    def __init__(self, states):
        self.ctxs = [torch.autocast(device_type=d, enabled=e, dtype=dt, cache_enabled=c)
                     for d, (e, dt, c) in states.items()]

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctxs):
            c.__exit__(*exc)
        return False


# Never traced by torch.compile (a graph break): fn must run eagerly under SCO's saved-tensor
# hooks, in the forward and in the replay alike, so that both save the same tensors one for one;
# a compiled forward would hand the hooks the activations of its AOT graph instead, which the
# eager replay in backward does not save.
@torch.compiler.disable
def sco_checkpoint(fn, *args, use_reentrant: Optional[bool] = None, preserve_rng_state: bool = True,
                   sco_offloader: Optional[SCOOffloader] = None, sco_keep_on_gpu: bool = False,
                   sco_block_from_end: Optional[int] = None, **kwargs):
    """torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs),
    with the block's boundary input (its first tensor positional argument, the
    hidden state, or, when no positional argument is a tensor, its first
    tensor keyword argument) kept in a pinned host arena slot between forward
    and backward.

    Other tensor positional arguments are kept as autograd saved tensors, as
    torch does (an in-place change before backward raises); keyword arguments
    are held by reference. Under torch.no_grad() fn just runs (nothing saved,
    nothing offloaded). sco_offloader: the SCOOffloader whose arena (and spill
    file) holds the boundary and whose stats() count it (None: default_offloader(),
    SCOConfig's defaults). sco_keep_on_gpu=True keeps the input on the GPU (the
    last block); or sco_block_from_end=n (0: the last block) leaves it to the
    offloader's current keep_last (SCOOffloader.keeps(n), which follows
    SCOOffloader.reconfigure between steps). backward(retain_graph=True) followed by a second backward and
    create_graph=True work as with torch's checkpoint. Gradients are bitwise
    those of torch's non-reentrant checkpoint on the same fn, and backward gets
    the saved tensors torch's would: one that requires grad detached, any other
    as the same object (the boundary only while it stays where it was: on CPU,
    or kept on the GPU; after the arena, a fresh tensor of the same values).
    Under torch.compile the call is a graph break: fn runs eagerly (a compiled
    fn passed in stays compiled, in the forward and in the replay).
    """
    if "sco_config" in kwargs:
        raise TypeError("moepeak: sco_checkpoint takes sco_offloader=moepeak.SCOOffloader(config), the runtime "
                        "that holds the arena and the statistics, not sco_config= (a config holds neither)")
    if use_reentrant:
        raise ValueError("moepeak: sco_checkpoint implements use_reentrant=False semantics only")
    if not callable(fn):
        raise TypeError(f"moepeak: sco_checkpoint fn must be callable, got {type(fn).__name__}")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    where = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
    if where is None:
        where = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    if where is None:
        raise TypeError("moepeak: sco_checkpoint needs a tensor argument, positional or keyword (the block's "
                        "hidden-state input)")
    x = args[where] if isinstance(where, int) else kwargs[where]
    if x.layout != torch.strided:
        raise TypeError(f"moepeak: sco_checkpoint boundary input must be a dense tensor, got layout {x.layout}")
    offloader = sco_offloader if sco_offloader is not None else default_offloader()
    if not isinstance(offloader, SCOOffloader):
        raise TypeError(f"moepeak: sco_offloader must be a moepeak.SCOOffloader, got {type(offloader).__name__}")
    if sco_block_from_end is not None:
        if isinstance(sco_block_from_end, bool) or not isinstance(sco_block_from_end, int) or sco_block_from_end < 0:
            raise ValueError(f"moepeak: sco_block_from_end must be an int >= 0 (0: the last block), got "
                             f"{sco_block_from_end!r}")
        if sco_keep_on_gpu:
            raise ValueError("moepeak: sco_checkpoint takes sco_keep_on_gpu or sco_block_from_end, not both")
        sco_keep_on_gpu = offloader.keeps(sco_block_from_end)
    engine = offloader.engine(x.device)
    frame = _Frame(fn, args, kwargs, where, engine, preserve_rng_state, x)
    frame.rec = engine.offload(x, keep=sco_keep_on_gpu)  # raises (arena full, disk full) before fn runs
    rec = frame.rec
    try:
        with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
            out = fn(*args, **kwargs)
    except BaseException:
        engine.discard(rec)
        raise
    # The slot is freed when the block's graph dies, backward or not.
    weakref.finalize(frame, _discard_quietly, engine, rec)
    return out


def _discard_quietly(engine, rec):
    try:
        engine.discard(rec)
    except Exception:  # interpreter shutdown: CUDA may be gone already
        pass
