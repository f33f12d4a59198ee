"""SCO checkpoint mechanics: sco_checkpoint and apply_sco (engine in sco.py).

Forward of one block (grad enabled):
  1. rec = engine.offload(x): x (the block's hidden-state input) goes to its
     arena slot; from here only the engine references x, until its copy landed.
  2. fn(*args, **kwargs) runs once, normally, under saved-tensor hooks whose
     pack stores only an index (a _Holder): nothing fn saves for backward is
     kept, just as in torch's non-reentrant checkpoint. The outer graph (and
     every hook FSDP2 put on it) is the graph of a plain forward.
Backward of the block (the first unpack of any of its holders):
  3. x' = engine.reload(rec) (waits on its load event; prefetches the previous
     block's input), x'.requires_grad = x.requires_grad, and fn is replayed on
     (x', other args) under enable_grad with the forward's CPU/CUDA RNG state
     and autocast state, under a pack hook that records every saved tensor in
     order; the replay stops as soon as the forward's count of saved tensors
     is reached (as torch's checkpoint early stop does: the last ops' outputs
     are not needed). Holder i then returns recomputed tensor i (once: it is
     dropped on unpack, so a second backward raises instead of recomputing
     stale data).
Same ops on the same values in the same order => the saved tensors are
bitwise those of the forward, and so are all gradients.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.utils.checkpoint as _tuc

from .sco import _DEFAULT, SCOConfig, _Engine


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
    and its residual add) only produce outputs nobody reads. torch's
    non-reentrant checkpoint stops its recompute the same way (early stop); a
    pack hook runs before the op's kernel, so e.g. the final Linear's GEMM is
    never launched. At T = 32k, H = 4096 that GEMM alone is ~6 ms per block."""


class _Holder:
    """What the autograd graph stores instead of a saved tensor: (frame, index)."""

    __slots__ = ("frame", "idx", "__weakref__")

    def __init__(self, frame, idx):
        self.frame, self.idx = frame, idx


class _Frame:
    """One sco_checkpoint call: everything needed to replay fn, except x."""

    def __init__(self, fn, args, kwargs, bidx, engine: _Engine, preserve_rng: bool):
        self.fn, self.kwargs, self.bidx, self.engine = fn, kwargs, bidx, engine
        self.args = list(args)
        self.args[bidx] = None  # x lives in the engine only
        self.rec = None
        self.n_packed = 0
        self.meta = []  # (shape, dtype) per saved tensor, checked after the replay
        self.recomputed: Optional[list] = None
        self.preserve = preserve_rng
        self.dev_type = args[bidx].device.type
        self.cpu_rng = torch.get_rng_state() if preserve_rng else None
        self.had_cuda = preserve_rng and torch.cuda.is_available() and torch.cuda.is_initialized()
        self.rng_devices, self.rng_states = (_tuc.get_device_states(*args) if self.had_cuda else ([], []))
        self.autocast = {d: _autocast_state(d) for d in {"cpu", self.dev_type}}

    # forward pack hook: keep nothing but the index
    def pack(self, t: torch.Tensor):
        h = _Holder(self, self.n_packed)
        self.n_packed += 1
        self.meta.append((t.shape, t.dtype))
        return h

    def unpack(self, h: _Holder):
        if torch.is_grad_enabled():  # backward with create_graph=True
            raise RuntimeError(
                "moepeak: double backward (create_graph=True) through an SCO-offloaded checkpoint boundary "
                "is not supported: the recomputed activations are detached"
            )
        if self.recomputed is None:
            self._replay()
        t = self.recomputed[h.idx]
        if t is None:
            raise RuntimeError(
                "moepeak: SCO saved tensor already used: backward through an offloaded checkpoint "
                "boundary a second time (retain_graph=True / double backward) is not supported"
            )
        self.recomputed[h.idx] = None
        return t

    def _replay(self):
        x = self.engine.reload(self.rec)  # raises the double-backward error if consumed
        x = x.detach().requires_grad_(self.rec.requires_grad)
        args = list(self.args)
        args[self.bidx] = x
        store = []

        def pack(t):
            store.append(t.detach())
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
                    self.fn(*args, **self.kwargs)
            except _StopReplay:
                pass
        if len(store) != self.n_packed or any(
            s.shape != m[0] or s.dtype != m[1] for s, m in zip(store, self.meta)
        ):
            raise RuntimeError(
                f"moepeak: sco_checkpoint's recompute saved {len(store)} tensors but the forward saved "
                f"{self.n_packed} (or shapes/dtypes differ): fn must run the same ops on every call"
            )
        self.recomputed = store
        self.args = self.kwargs = self.fn = None  # nothing more to replay


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


def sco_checkpoint(fn, *args, use_reentrant: Optional[bool] = None, preserve_rng_state: bool = True,
                   sco_config: Optional[SCOConfig] = None, sco_keep_on_gpu: bool = False, **kwargs):
    """torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs),
    with the block's boundary input (its first tensor positional argument, the
    hidden state) kept in a pinned host arena slot between forward and backward.

    Other tensor arguments are held by reference, as torch does (they are
    shared across blocks: masks, rotary tables). Under torch.no_grad() fn just
    runs (nothing saved, nothing offloaded). sco_keep_on_gpu=True keeps the
    input on the GPU (the last block). Gradients are bitwise those of torch's
    non-reentrant checkpoint on the same fn.
    """
    if use_reentrant:
        raise ValueError("moepeak: sco_checkpoint implements use_reentrant=False semantics only")
    if not callable(fn):
        raise TypeError(f"moepeak: sco_checkpoint fn must be callable, got {type(fn).__name__}")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    bidx = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
    if bidx is None:
        raise TypeError("moepeak: sco_checkpoint needs a tensor positional argument (the block's hidden-state input)")
    x = args[bidx]
    if x.layout != torch.strided:
        raise TypeError(f"moepeak: sco_checkpoint boundary input must be a dense tensor, got layout {x.layout}")
    cfg = sco_config if sco_config is not None else _DEFAULT
    if not isinstance(cfg, SCOConfig):
        raise TypeError(f"moepeak: sco_config must be an SCOConfig, got {type(cfg).__name__}")
    engine = cfg.engine(x.device)
    frame = _Frame(fn, args, kwargs, bidx, engine, preserve_rng_state)
    rec = engine.offload(x.detach(), keep=sco_keep_on_gpu)  # raises (arena full) before fn runs
    rec.requires_grad = x.requires_grad
    frame.rec = rec
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


def apply_sco(model: torch.nn.Module, blocks, config: Optional[SCOConfig] = None):
    """Checkpoint-and-offload each decoder block of `model` (in place).

    blocks: a list/tuple of modules, an nn.ModuleList, or a module class (all
    submodules of that class, in registration order). Each block's forward is
    wrapped so that in training with grad enabled it runs under
    sco_checkpoint; in eval or under no_grad it runs as is (no offload). The
    module tree and state_dict keys are unchanged, so fully_shard (FSDP2) can
    be applied to the blocks before or after. Returns model.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"moepeak: apply_sco model must be an nn.Module, got {type(model).__name__}")
    if isinstance(blocks, type):
        mods = [m for m in model.modules() if isinstance(m, blocks)]
    elif isinstance(blocks, torch.nn.Module) and not isinstance(blocks, torch.nn.ModuleList):
        mods = [blocks]
    else:
        mods = list(blocks)
    if not mods:
        raise ValueError(f"moepeak: apply_sco found no blocks matching {blocks!r}")
    for m in mods:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"moepeak: apply_sco blocks must be nn.Modules, got {type(m).__name__}")
        if getattr(m, "_moepeak_sco", None) is not None:
            raise ValueError(f"moepeak: apply_sco already applied to block {type(m).__name__}")
    cfg = config if config is not None else _DEFAULT
    for i, m in enumerate(mods):
        keep = cfg.keep_last and i == len(mods) - 1
        orig = m.forward

        def forward(*a, _orig=orig, _keep=keep, _ref=weakref.ref(m), **k):
            mod = _ref()
            if mod is None or not mod.training or not torch.is_grad_enabled():
                return _orig(*a, **k)
            return sco_checkpoint(_orig, *a, sco_config=cfg, sco_keep_on_gpu=_keep, **k)

        m.forward = forward
        m._moepeak_sco = cfg
    return model
