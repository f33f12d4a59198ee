"""StreamAdamW: AdamW with fp32 master weights, exp_avg and exp_avg_sq in
host RAM, streamed through the GPU copy engines bucket by bucket.

API
---
``moepeak.StreamAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
weight_decay=1e-2, *, amsgrad=False, maximize=False, bucket_mb=64,
threads=None, isa=None, grad_slots=3, param_slots=2, overlap_backward=False,
clip_grad_norm=None, device_state=None)`` is a ``torch.optim.Optimizer`` with
the update of ``torch.optim.AdamW`` (decoupled weight decay, bias correction,
amsgrad and maximize as torch defines them).

- Parameters may be CUDA tensors (fp32, bf16 or fp16) or CPU tensors. On
  CUDA, params and grads stay on the GPU; the optimizer's fp32 state lives on
  the CPU. One ``step()`` is a pipeline over buckets of ``bucket_mb`` MiB of
  fp32 master weights (large tensors are split, small ones packed):
  D2H grads of bucket i+1 || CPU AdamW of bucket i || H2D params of bucket i-1,
  through ``grad_slots`` + ``param_slots`` pinned slots allocated once. It adds
  no GPU memory (copies go straight between the grads/params and the pinned
  slots). ``step()`` may be called right after ``backward()`` without a
  synchronize: it orders its copy streams after torch's current stream, and
  makes the current stream wait for the last H2D copy, so the next forward sees
  the new parameters. When ``step()`` returns every grad has been read, so
  ``zero_grad()`` may free them at once.
- CPU parameters are updated in place with no copies (the same C kernel).
- ``device_state``: some of the params (e.g. ``[model.embed.weight]``) whose
  state (fp32 master for bf16/fp16 params, exp_avg, exp_avg_sq, step) stays on
  their own device, updated there by torch's fused AdamW kernel on the current
  stream: 12 bytes per element of device memory (8 for fp32 params) for no
  host traffic. Meant for the params whose gradients are final last in
  backward (the input embedding, the first blocks), whose host updates
  ``overlap_backward`` could not hide: ``StreamAdamW.backward_tail(
  model.parameters(), max_bytes)`` picks the leading params that fit.
  Bitwise ``torch.optim.AdamW(fused=True)`` on that device (on the CPU also
  the host update; a GPU's kernel may round the last bit differently from
  the host's); state_dict keys unchanged (its tensors on the param's device).
- The CPU kernel is C (AVX-512 / AVX2 / scalar, chosen at run time or forced
  with ``isa='avx512'|'avx2'|'scalar'``), runs on moepeak's pthread pool with
  ``threads`` threads (None: all CPUs of the process), GIL released.
- Exactness: the fp32 update is bitwise the one of
  ``torch.optim.AdamW(fused=True)`` on CPU (same scalar casts, same fused
  multiply-adds, and torch's scalar-tail rounding emulated; see
  csrc/adamw_kernels.c). For CUDA params the master/state follow the same
  arithmetic; the bf16/fp16 param is the master rounded to nearest even.
- State (``state_dict()``) per parameter: ``step`` (0-d float32 CPU tensor),
  ``exp_avg``, ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq`` (fp32 CPU
  tensors shaped like the local param), the same keys as ``torch.optim.AdamW``; plus, for bf16/fp16 params
  only, ``master_param`` (the fp32 master). Loading a ``torch.optim.AdamW``
  state dict works (the master is then initialised from the param); loading
  ours into ``torch.optim.AdamW`` works too (torch keeps ``master_param`` as
  an unused extra entry, cast to the param's dtype; drop it from the dict
  first to avoid that memory). For fp32 CUDA params the CPU master is always
  equal to the param and is rebuilt from it after a load.
- LR schedulers (lr is read from ``param_groups`` every step), grad clipping
  before ``step()``, ``zero_grad()``, params with ``grad is None`` (skipped)
  and FSDP2 DTensor params (updated through their local shards) work.
- ``copy.deepcopy`` and ``pickle`` work as for ``torch.optim.AdamW``: state,
  param_groups and every setting travel; the pinned slots, streams, overlap
  hooks and worker are built anew by the copy (with overlap_backward only
  between rounds: after ``step()``, not between ``backward()`` and it).
- A param of a dtype other than float32, bfloat16 or float16 is refused when
  it is given (constructor, ``add_param_group``), named as below.
- Errors name the parameter (``param_groups[g]['params'][i]``): sparse or
  complex grads/params, unsupported dtypes, non-contiguous tensors, a param
  whose device changed between steps, bad lr/eps/betas/weight_decay, state
  tensors of another size. Every check runs before any parameter of the
  update (the step, or one overlap bucket) is touched.

Overlap with backward (``overlap_backward=True``, an explicit opt-in)
--------------------------------------------------------------------
A post-accumulate-grad hook on every param (FSDP2 calls them on the sharded
param after its reduce-scatter) marks the param's grad final; once
``bucket_mb`` MiB of fp32 params are final they are updated as one job on a
worker thread (on CUDA: D2H, CPU AdamW, H2D on the optimizer's streams,
after an event recorded on the stream that produced the grads), while
autograd goes on. ``step()`` submits the last partial bucket, waits for the
worker, updates any param with a grad whose hook did not fire, and makes the
current stream wait for every H2D copy of the round, so the next forward
sees the new params. Same bits as without overlap (and as
``torch.optim.AdamW(fused=True)`` on CPU). What differs from torch's
``backward(); step()``, and how to use it:

- Params change during backward, as soon as their own grads are final
  (nothing of autograd reads them after that). A later hook or a
  ``retain_graph`` second backward sees the new values.
- Hyper-parameters are read when a param's update runs: the lr of the step
  in progress is the one in ``param_groups`` during its backward, so an LR
  scheduler stepped after ``step()`` (torch's order) gives torch's lrs;
  changing lr between ``backward()`` and ``step()`` reaches only the params
  not yet updated. The ``step`` counter of a param advances in its hook.
- Gradient accumulation: run every micro-batch but the last inside
  ``with opt.accumulate():`` (hooks then only let grads accumulate); the
  last backward, outside it, updates. A param whose grad becomes final twice
  before ``step()`` makes backward raise (this catches a forgotten
  ``accumulate()``). FSDP2's ``set_requires_gradient_sync(False)`` also works
  (no reduce-scatter, so no hook).
- Gradient clipping needs the global norm before any update, so
  ``clip_grad_norm=max_norm`` defers: the hooks update nothing and
  ``step()`` runs ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (grads
  clipped in place, as torch does; the total norm is ``opt.last_grad_norm``)
  and then the full update: bitwise torch's clip + fused AdamW, with no
  overlap. Clipping by hand between ``backward()`` and ``step()`` is too
  late with overlap on; use this argument (it also works without overlap).
- Modifying grads between ``backward()`` and ``step()`` (scaling,
  all-reduce by hand) likewise reaches only params not yet updated.
- ``zero_grad()`` first waits for the worker; ``set_overlap(False)`` turns
  the in-backward updates off (every update in ``step()``);
  ``overlap_stats()`` counts params updated from hooks.
- ``state_dict()`` / ``load_state_dict()`` are unchanged (call them between
  steps). Dropping the optimizer removes its hooks.

The torch op ``moepeak::stream_adamw`` (mutating: params, masters, exp_avgs,
exp_avg_sqs; moepeak/stream_adamw_op.py) does one step on flat lists; the
optimizer calls it.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from . import _C
from .core.ext import HAS_CUDA_BUILD
from .core.host_memory import check_room
from .stream_adamw_device import HOST_ROOM_REMEDY, backward_tail, device_state_set, fused_update, \
    host_state_bytes_to_create, moment_keys
from .stream_adamw_op import (DTYPE_CODES, ISA_CODES, PLAN_IDS, PLANS, BucketPlan, check_hyper, stream_adamw,
                              stream_adamw_step, torch_tail_model)
from .stream_adamw_overlap import BackwardOverlap, side_stream

_STATE_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _local(t):
    """The local shard of a DTensor (FSDP2), else t itself."""
    if t is not None and hasattr(t, "_local_tensor") and type(t).__name__ == "DTensor":
        return t._local_tensor
    return t


class StreamAdamW(torch.optim.Optimizer):
    """AdamW with fp32 state in host RAM and a bucket-pipelined step (the
    contract is this module's docstring)."""

    backward_tail = staticmethod(backward_tail)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, amsgrad=False,
                 maximize=False, bucket_mb=64, threads=None, isa=None, grad_slots=3, param_slots=2,
                 overlap_backward=False, clip_grad_norm=None, device_state=None, _host_pipeline=False):
        check_hyper("lr", lr, betas, eps, weight_decay, amsgrad, maximize)
        if not isinstance(overlap_backward, bool):
            raise TypeError(f"moepeak.StreamAdamW: overlap_backward must be a bool, got {overlap_backward!r}")
        if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
            raise ValueError(f"moepeak.StreamAdamW: clip_grad_norm must be None or a float > 0, got {clip_grad_norm!r}")
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"moepeak.StreamAdamW: bucket_mb must be > 0, got {bucket_mb!r}")
        if grad_slots < 2 or param_slots < 1:
            raise ValueError(f"moepeak.StreamAdamW: need grad_slots >= 2 and param_slots >= 1, got "
                             f"{grad_slots}, {param_slots}")
        if threads is not None and not (isinstance(threads, int) and 1 <= threads <= 256):
            raise ValueError(f"moepeak.StreamAdamW: threads must be None or an int in [1, 256], got {threads!r}")
        best = _C.cpu_best_isa()
        if isa is None:
            self._isa = best
        else:
            code = ISA_CODES.get(isa, isa)
            if not isinstance(code, int) or code not in (0, 1, 2):
                raise ValueError(f"moepeak.StreamAdamW: isa must be one of {sorted(ISA_CODES)} or None, got {isa!r}")
            if code > best:
                raise ValueError(f"moepeak.StreamAdamW: isa={isa!r} is not supported by this CPU "
                                 f"(best: {[k for k, v in ISA_CODES.items() if v == best][0]})")
            self._isa = code
        self._threads = threads or 0
        # testing hook: CPU params go through the bucket pipeline (memcpy copies)
        self._host_pipeline = bool(_host_pipeline)
        self._bucket_mb = float(bucket_mb)
        self._slots = (int(grad_slots), int(param_slots))
        # The keys torch.optim.AdamW's groups carry; fused=True: the kernel is bitwise
        # torch's fused one, so a torch AdamW loaded from our state_dict runs that kernel too.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, **_TORCH_GROUP_KEYS)
        super().__init__(params, defaults)
        self._on_device = device_state_set(self.param_groups, device_state)
        self._devices = {}  # param -> device it had at its first step
        self._gpu_master = {}  # fp32 CUDA param -> its fp32 CPU master (always equal to the param)
        self._grad_dt = {}  # param -> dtype code of its last grad (for the plan's slot sizes)
        self._clip = None if clip_grad_norm is None else float(clip_grad_norm)
        self.last_grad_norm = None  # total grad norm of the last step (clip_grad_norm mode)
        self._start_runtime(overlap_backward, overlap_enabled=True)

    def _start_runtime(self, overlap_backward, overlap_enabled):
        """What an optimizer owns besides its state and settings: the pinned bucket plan
        (made at the first CUDA step), the worker streams, the overlap hooks and worker,
        the pool threads it asked for. Built here for a new optimizer and for a copy
        (deepcopy, unpickling), never copied."""
        if self._threads > _C.get_num_threads():  # more than the pool keeps by default: give them back at death
            _THREAD_REQUESTS[id(self)] = self._threads
            weakref.finalize(self, _release_threads, id(self))
        self._plan = None
        self._plan_id = next(PLAN_IDS)
        self._tail = torch_tail_model()  # refreshed by every step(), used by hooks on autograd's threads
        self._streams = {}  # CUDA device -> the overlap worker's stream
        self._overlap = None
        if overlap_backward:
            params = [p for g in self.param_groups for p in g["params"]]
            self._overlap = BackwardOverlap(self, params, self._bucket_mb * (1 << 20), self._prepare_overlap,
                                            self._execute, immediate=self._on_device.__contains__)
            self._overlap.deferred = self._clip is not None
            self._overlap.enabled = overlap_enabled

    def add_param_group(self, param_group):
        """torch's add_param_group, refusing (before the group is added) a param of a
        dtype the kernel does not update, as the constructor does."""
        if isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]
            if not isinstance(params, set):  # torch refuses sets itself
                # a generator is read here once; torch normalizes the group's list in place too
                params = param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
                gi = len(self.param_groups)
                for pi, p in enumerate(params):
                    if isinstance(p, torch.Tensor) and p.dtype not in DTYPE_CODES:
                        raise TypeError(
                            f"moepeak.StreamAdamW: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}, "
                            f"dtype {p.dtype}): StreamAdamW updates float32, bfloat16 and float16 params only; "
                            "cast the model (e.g. model.float()) or leave this param out of the optimizer")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ copy / pickle
    def __getstate__(self):
        """torch's (defaults, state, param_groups) plus this optimizer's settings; the
        runtime (_start_runtime) is rebuilt by __setstate__. With overlap_backward, only
        between rounds: a copy taken after some params were updated in backward would
        not know which ones step() must skip."""
        ov = self._overlap
        if ov is not None:
            ov.wait()
            if ov.done or ov.pending:
                raise RuntimeError(
                    "moepeak.StreamAdamW: cannot copy or pickle an overlap_backward optimizer between backward() "
                    f"and step() ({len(ov.done)} params already updated in this round); call step() first")
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in _SETTINGS})
        state["_overlap_backward"] = ov is not None
        state["_overlap_enabled"] = ov.enabled if ov is not None else True
        return state

    def __setstate__(self, state):
        # Two callers: a copy being built (deepcopy, unpickling: an empty object), and torch's
        # load_state_dict on this live optimizer (state and param_groups only: the runtime stays).
        copying = "_plan_id" not in self.__dict__
        state = dict(state)
        overlap_backward = state.pop("_overlap_backward", False)
        overlap_enabled = state.pop("_overlap_enabled", True)
        super().__setstate__(state)
        if not copying:
            return
        for k, default in _SETTINGS.items():  # a state without them (torch's own keys only) gets the defaults
            if k not in self.__dict__:
                setattr(self, k, default() if callable(default) else default)
        self._isa = min(self._isa, _C.cpu_best_isa())  # unpickled on another CPU: every ISA gives the same bits
        self._start_runtime(overlap_backward, overlap_enabled)

    # ------------------------------------------------------------------ checks
    def _collect(self, only=None, skip=()):
        """Validate every param with a grad (nothing is touched on failure);
        return [(group, param, local param, local grad, name)]. only: a set of
        params to restrict to; skip: params to leave out."""
        out = []
        for gi, group in enumerate(self.param_groups):
            check_hyper(f"param_groups[{gi}]['lr']", group["lr"], group["betas"], group["eps"],
                         group["weight_decay"], group.get("amsgrad", False), group.get("maximize", False))
            for pi, p in enumerate(group["params"]):
                if p.grad is None or (only is not None and p not in only) or p in skip:
                    continue
                name = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}, dtype {p.dtype})"
                lp, lg = _local(p), _local(p.grad)
                if p.grad.is_sparse or lg.layout != torch.strided:
                    raise TypeError(f"moepeak.StreamAdamW: {name} has a sparse grad; StreamAdamW needs dense grads")
                if lp.is_complex() or lg.is_complex():
                    raise TypeError(f"moepeak.StreamAdamW: {name}: complex params/grads are not supported")
                if lp.dtype not in DTYPE_CODES or lg.dtype not in DTYPE_CODES:
                    raise TypeError(f"moepeak.StreamAdamW: {name}: param and grad must be float32, bfloat16 or "
                                    f"float16, got {lp.dtype} and {lg.dtype}")
                if lg.shape != lp.shape:
                    raise ValueError(f"moepeak.StreamAdamW: {name}: grad shape {tuple(lg.shape)} != param shape")
                if not lp.is_contiguous() or not lg.is_contiguous():
                    raise ValueError(f"moepeak.StreamAdamW: {name}: param and grad must be contiguous")
                if lg.device != lp.device:
                    raise ValueError(f"moepeak.StreamAdamW: {name}: grad on {lg.device} but param on {lp.device}")
                if lp.device.type not in ("cpu", "cuda"):
                    raise ValueError(f"moepeak.StreamAdamW: {name}: params must be on cpu or cuda, got {lp.device}")
                if lp.is_cuda and not HAS_CUDA_BUILD:
                    raise RuntimeError(f"moepeak.StreamAdamW: {name} is on CUDA but moepeak._C was built without "
                                       "CUDA; rebuild with nvcc on PATH")
                seen = self._devices.get(p)
                if seen is not None and seen != lp.device:
                    raise ValueError(f"moepeak.StreamAdamW: {name} moved from {seen} to {lp.device} between steps; "
                                     "create the optimizer after moving the model")
                out.append((group, p, lp, lg, name))
        cuda_devs = {lp.device for _, _, lp, _, _ in out if lp.is_cuda}
        if len(cuda_devs) > 1:
            raise ValueError(f"moepeak.StreamAdamW: CUDA params must all be on one device, got {sorted(map(str, cuda_devs))}")
        return out

    # ------------------------------------------------------------------ state
    def _state_device(self, p, lp):
        """Where p's state lives: its own device for device_state params, else the CPU."""
        return lp.device if p in self._on_device else torch.device("cpu")

    def _init_state(self, group, p, lp):
        st = self.state[p]
        dev = self._state_device(p, lp)
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=dev)
        for k in moment_keys(group):
            if k not in st:
                st[k] = torch.zeros(lp.shape, dtype=torch.float32, device=dev)
        if lp.dtype != torch.float32 and "master_param" not in st:
            st["master_param"] = lp.detach().to(dev, torch.float32, copy=True).contiguous()
        if p in self._on_device:
            self._devices.setdefault(p, lp.device)
            return
        if lp.dtype == torch.float32 and self._piped(lp) and p not in self._gpu_master:
            self._gpu_master[p] = lp.detach().to("cpu", copy=True).contiguous()
        self._devices.setdefault(p, lp.device)

    def _check_state(self, group, p, lp, name):
        """The state tensors the kernel will read and write must be fp32,
        contiguous, on the CPU and of the param's numel (a param whose .data
        was replaced, a replaced exp_avg/exp_avg_sq, a loaded state of another
        size all end here)."""
        st = self.state[p]
        dev = self._state_device(p, lp)
        held = [(k, st.get(k)) for k in moment_keys(group)]
        if lp.dtype != torch.float32:
            held.append(("master_param", st.get("master_param")))
        elif self._piped(lp) and p not in self._on_device:
            held.append(("the fp32 master copy", self._gpu_master.get(p)))
        if p in self._on_device:
            held.append(("step", st.get("step")))
        for key, t in held:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"moepeak.StreamAdamW: {name}: state '{key}' must be a tensor, got {type(t).__name__}")
            if key == "step":
                if t.numel() != 1 or t.dtype != torch.float32 or t.device != dev:
                    raise TypeError(f"moepeak.StreamAdamW: {name}: state 'step' must be a float32 scalar on {dev} "
                                    f"(device_state), got {t.dtype} of {t.numel()} elements on {t.device}")
                continue
            if t.numel() != lp.numel():
                raise RuntimeError(
                    f"moepeak.StreamAdamW: {name}: size mismatch: state '{key}' has {t.numel()} elements "
                    f"(shape {tuple(t.shape)}) but the param has {lp.numel()} (shape {tuple(lp.shape)}); "
                    "was the param's .data replaced or a state_dict of another model loaded?")
            if t.dtype != torch.float32 or t.device != dev or not t.is_contiguous():
                where = "CPU" if p not in self._on_device else f"{dev} (device_state)"
                raise TypeError(f"moepeak.StreamAdamW: {name}: state '{key}' must be a contiguous float32 {where} "
                                f"tensor, got {t.dtype} on {t.device} (contiguous={t.is_contiguous()})")

    def _master(self, p, lp):
        if lp.dtype != torch.float32:
            return self.state[p]["master_param"]
        if self._piped(lp):
            return self._gpu_master[p]
        return lp

    def _piped(self, lp):
        return lp.is_cuda or self._host_pipeline

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """Update every param with a grad. With overlap_backward, the params
        whose updates ran during backward are skipped: this submits the last
        partial bucket, waits for the worker, updates what is left (params
        whose hook did not fire, e.g. grads set by hand) and orders the
        current CUDA stream after every H2D copy of the round."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ov = self._overlap
        if ov is not None:
            ov.flush()
            ov.wait()
        self._tail = torch_tail_model()
        skip = ov.done if ov is not None else ()
        entries = self._collect(skip=skip)  # raises before anything is modified
        if self._clip is not None and entries:
            if skip:  # a param updated in backward cannot be clipped any more
                raise RuntimeError("moepeak.StreamAdamW: clip_grad_norm with params already updated in "
                                   "backward (set_overlap toggled mid-round?)")
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p, _, _, _ in entries], self._clip)
        job = self._update_on_device_then_job(entries, overlapped=False)
        if job is not None:
            self._execute(job)
        for dev, stream in self._streams.items():  # the worker's H2D copies before the next forward
            torch.cuda.current_stream(dev).wait_stream(stream)
        if ov is not None:  # only on success: a retried step() must not update a param twice
            ov.end_round()
        return loss

    def _prepare_overlap(self, params):
        """BackwardOverlap's prepare: the job for params whose grads just
        became final (runs in autograd's thread, from the hook); device_state
        params among them are updated here, on the current stream."""
        return self._update_on_device_then_job(self._collect(only=set(params)), overlapped=True)

    def _update_on_device_then_job(self, entries, overlapped):
        """Update the device_state params among entries where they live
        (stream_adamw_device.fused_update) and return the host job of the
        others (None if none). Every state check of both kinds runs before
        either is touched."""
        host = [e for e in entries if e[1] not in self._on_device]
        on_device = [e for e in entries if e[1] in self._on_device]
        for group, p, lp, _, _ in on_device:
            self._init_state(group, p, lp)
        for group, p, lp, _, name in on_device:
            self._check_state(group, p, lp, name)
        job = self._build_job(host, overlapped) if host else None  # the host entries' checks
        if on_device:
            fused_update(on_device, self.state, self._bucket_mb)
            if not torch.compiler.is_compiling():
                _bump_versions([lp for _, _, lp, _, _ in on_device])
        return job

    def _build_job(self, entries, overlapped):
        """State init/checks, step counters advanced, and the op's arguments."""
        check_room(host_state_bytes_to_create(entries, self.state, self._piped, self._gpu_master),
                   f"moepeak.StreamAdamW: the optimizer state of {len(entries)} params", HOST_ROOM_REMEDY, pinned=False)
        for group, p, lp, _, _ in entries:
            self._init_state(group, p, lp)
        for group, p, lp, _, name in entries:  # every state tensor must fit its param before any pointer reaches C
            self._check_state(group, p, lp, name)
        steps = [self.state[p]["step"] for _, p, _, _, _ in entries]
        torch._foreach_add_(steps, 1.0)
        step_vals = torch.stack(steps).tolist()
        params, grads, masters, ms, vs, vmaxs = [], [], [], [], [], []
        lrs, b1s, b2s, epss, wds, maxs = [], [], [], [], [], []
        plan_index = self._cuda_plan(entries)
        for group, p, lp, lg, _ in entries:
            st = self.state[p]
            params.append(lp if (self._piped(lp) or lp.dtype != torch.float32) else _EMPTY)
            grads.append(lg)
            masters.append(self._master(p, lp))
            ms.append(st["exp_avg"])
            vs.append(st["exp_avg_sq"])
            vmaxs.append(st["max_exp_avg_sq"] if group["amsgrad"] else _EMPTY)
            lrs.append(float(group["lr"]))
            b1s.append(float(group["betas"][0]))
            b2s.append(float(group["betas"][1]))
            epss.append(float(group["eps"]))
            wds.append(float(group["weight_decay"]))
            maxs.append(bool(group["maximize"]))
        args = (params, grads, masters, ms, vs, vmaxs, step_vals, lrs, b1s, b2s, epss, wds, maxs)
        kw = dict(isa=self._isa, threads=self._threads, bucket_mb=self._bucket_mb, grad_slots=self._slots[0],
                  param_slots=self._slots[1], plan_id=self._plan_id, plan_index=plan_index,
                  host_pipeline=self._host_pipeline, torch_threads=self._tail[0], torch_vlen=self._tail[1])
        cuda_dev = next((lp.device for _, _, lp, _, _ in entries if lp.is_cuda), None)
        ready = None
        if overlapped and cuda_dev is not None:  # grads final / params free once the current stream gets here
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(cuda_dev))
            if cuda_dev not in self._streams:
                self._streams[cuda_dev] = side_stream(cuda_dev)
        compiling = torch.compiler.is_compiling()
        if not compiling:  # what the op's dispatcher would do for the params (autograd's in-place check)
            _bump_versions([lp for _, _, lp, _, _ in entries])
        return dict(args=args, kw=kw, compiling=compiling, device=cuda_dev, ready=ready,
                    plan=self._plan)  # the job keeps its plan (pinned slots) alive

    def _execute(self, job):
        """Run one job: on the caller's stream (step()), or on the worker's
        stream after the hook's event (overlap)."""
        fn = stream_adamw if job["compiling"] else stream_adamw_step
        if job["ready"] is None:
            fn(*job["args"], **job["kw"])
            return
        stream = self._streams[job["device"]]
        with torch.cuda.device(job["device"]), torch.cuda.stream(stream):
            stream.wait_event(job["ready"])
            fn(*job["args"], **job["kw"])
            # The job's H2D copies may still be running (only this stream waits for them until
            # step()); a param freed before step() (e.g. after an OOM in backward) must not have
            # its memory handed out again before they finish.
            for p in job["args"][0]:
                if p.is_cuda:
                    p.record_stream(stream)

    # ------------------------------------------------------------------ overlap API
    def accumulate(self):
        """Context manager for gradient accumulation with overlap_backward:
        backward passes inside it only accumulate grads; the update of each
        param runs during the first backward outside it (the last
        micro-batch). Without overlap_backward it does nothing."""
        if self._overlap is None:
            return contextlib.nullcontext()
        return self._overlap.accumulate()

    def set_overlap(self, enabled):
        """Turn the in-backward updates of overlap_backward on or off (off:
        step() does every update, as without overlap_backward). Takes effect
        at the next hook; an error without overlap_backward=True."""
        if self._overlap is None:
            raise RuntimeError("moepeak.StreamAdamW.set_overlap: the optimizer was built without overlap_backward=True")
        self._overlap.enabled = bool(enabled)

    def overlap_stats(self):
        """{'enabled', 'params_in_backward', 'jobs_done', 'last_round'}: since
        construction (0 without overlap_backward), params handed to the worker
        after their hook fired (updated during backward, or, for the last
        partial bucket, by step()) and worker jobs finished; and the jobs of
        the last completed step() round, in order, as (elements, submitted,
        started, finished) with time.perf_counter() times: how much of the
        update ran after a given moment (e.g. the end of backward)."""
        ov = self._overlap
        return dict(enabled=ov is not None, params_in_backward=ov.params_in_backward if ov else 0,
                    jobs_done=ov.jobs_done if ov else 0, last_round=list(ov.last_round) if ov else [])

    def zero_grad(self, set_to_none=True):
        """torch's zero_grad, after the overlap worker has read every grad
        it was handed."""
        if self._overlap is not None:
            self._overlap.wait()
        super().zero_grad(set_to_none=set_to_none)

    def _cuda_plan(self, entries):
        """Keep one bucket plan over EVERY non-empty CUDA param of the
        optimizer (so a param whose grad is None this step, e.g. an expert
        that got no tokens, does not force new pinned slots); return, for the
        CUDA entries of this step in order, their rows in the plan."""
        for _, p, _, lg, _ in entries:
            self._grad_dt[p] = DTYPE_CODES[lg.dtype]
        layout = []
        for group in self.param_groups:
            for p in group["params"]:
                lp = _local(p)
                if self._piped(lp) and lp.numel() > 0 and p not in self._on_device:
                    layout.append((p, lp.numel(), self._grad_dt.get(p, DTYPE_CODES.get(lp.dtype, 0)), DTYPE_CODES.get(lp.dtype, 0)))
        if not layout:
            return None
        key = (tuple(x[1] for x in layout), tuple(x[2] for x in layout), tuple(x[3] for x in layout))
        if self._plan is None or self._plan.key != key:
            if self._overlap is not None:
                self._overlap.wait()  # no job of the round still runs on the old plan
            self._plan = None  # free the old pinned slots first
            self._plan = BucketPlan(key, _local(layout[0][0]).device, self._bucket_mb, *self._slots,
                               host=self._host_pipeline)
            PLANS[self._plan_id] = self._plan
        row = {p: i for i, (p, _, _, _) in enumerate(layout)}
        idx = [row[p] for _, p, lp, _, _ in entries if self._piped(lp) and lp.numel() > 0 and p not in self._on_device]
        return idx or None

    def pinned_bytes(self):
        """Pinned host bytes held by the bucket pipeline (0 before the first CUDA step)."""
        return 0 if self._plan is None else self._plan.pinned_bytes

    # ------------------------------------------------------------------ state_dict
    def state_dict(self):
        """torch's layout. The state of an FSDP2 (DTensor) param lives in host RAM
        as a plain tensor of the *local shard's* shape; here it is returned as a
        DTensor with the param's mesh, placements, global shape and stride, so
        torch.distributed.checkpoint saves every rank's shard (a plain tensor
        would be taken for a replicated one and only one rank's copy kept).
        self.state is not changed (the per-param dicts are copied)."""
        sd = super().state_dict()
        idx_param = {}
        for g, sg in zip(self.param_groups, sd["param_groups"]):
            idx_param.update(zip(sg["params"], g["params"]))
        for idx, st in list(sd["state"].items()):
            p = idx_param.get(idx)
            if p is None or type(p).__name__ != "DTensor":
                continue
            from torch.distributed.tensor import DTensor
            lshape = tuple(_local(p).shape)
            st = dict(st)
            for k in _STATE_TENSORS:
                v = st.get(k)
                if torch.is_tensor(v) and type(v).__name__ != "DTensor" and v.dim() > 0 \
                        and tuple(v.shape) == lshape:
                    st[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
            sd["state"][idx] = st
        return sd

    def load_state_dict(self, state_dict):
        """Accepts our own state dicts and torch.optim.AdamW's, with state
        tensors as DTensors (this rank's shard is taken) or plain local-shard
        tensors. The fp32 tensors are kept on the CPU in fp32 (torch's loader
        would cast them to the param's dtype and device)."""
        saved_groups = state_dict["param_groups"]
        id_map = {}
        for g, ng in zip(saved_groups, self.param_groups):
            for pid, p in zip(g["params"], ng["params"]):
                id_map[pid] = p
        for pid, st in state_dict["state"].items():  # sizes first: nothing is loaded on a mismatch
            p = id_map.get(pid)
            for k in _STATE_TENSORS:
                t = _local(st.get(k)) if p is not None else None
                if torch.is_tensor(t) and t.numel() != _local(p).numel() and not (
                        k == "master_param" and _local(p).dtype == torch.float32):
                    raise RuntimeError(
                        f"moepeak.StreamAdamW.load_state_dict: size mismatch for state {pid} ('{k}'): "
                        f"{t.numel()} elements (shape {tuple(t.shape)}) but the param has {_local(p).numel()} "
                        f"(shape {tuple(_local(p).shape)})")
        kept, light = {}, {}
        for pid, st in state_dict["state"].items():
            kept[pid] = {k: st[k] for k in _STATE_TENSORS if k in st}
            light[pid] = {k: v for k, v in st.items() if k not in _STATE_TENSORS}
        super().load_state_dict({"state": light, "param_groups": saved_groups})
        self._gpu_master.clear()
        self._plan = None
        for pid, tensors in kept.items():
            p = id_map.get(pid)
            if p is None:
                continue
            st = self.state[p]
            lp = _local(p)
            dev = self._state_device(p, lp)
            if "step" in st:
                # a copy: the loaded dict's step tensor must not advance with this optimizer
                st["step"] = torch.as_tensor(st["step"]).detach().to(dev, torch.float32, copy=True).reshape(())
            for k, t in tensors.items():
                t = _local(t)
                if k == "master_param" and lp.dtype == torch.float32:
                    continue  # an fp32 param is its own master
                st[k] = t.detach().to(dev, torch.float32, copy=True).reshape(lp.shape).contiguous()
        for group in self.param_groups:  # groups saved by torch carry their own keys; ours need these
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            for k, v in _TORCH_GROUP_KEYS.items():
                group[k] = v  # this optimizer always runs its own (fused-equivalent) kernel


_EMPTY = torch.empty(0)
# live optimizers that asked for more pool threads than the default: id -> threads
_THREAD_REQUESTS = {}


def _release_threads(key):
    """An optimizer with threads= above the default died: trim the process-wide
    pool to what the remaining requests (or the default) need."""
    _THREAD_REQUESTS.pop(key, None)
    need = max([_C.get_num_threads(), *_THREAD_REQUESTS.values()])
    try:
        _C.pool_trim(need - 1)  # the calling thread runs one range itself
    except Exception:  # interpreter shutdown
        pass
_TORCH_GROUP_KEYS = dict(foreach=None, capturable=False, differentiable=False, fused=True,
                         decoupled_weight_decay=True)
# What a copy of the optimizer carries besides torch's keys, with the value (or the
# factory of the value) of an optimizer built with the defaults.
_SETTINGS = dict(_isa=_C.cpu_best_isa, _threads=0, _host_pipeline=False, _bucket_mb=64.0, _slots=(3, 2),
                 _clip=None, last_grad_norm=None, _on_device=set, _devices=dict, _gpu_master=dict, _grad_dt=dict)


def _bump_versions(tensors):
    try:
        torch._C._increment_version(tensors)  # one call for the list (torch >= 2.5)
    except TypeError:
        for t in tensors:
            torch._C._increment_version(t)
