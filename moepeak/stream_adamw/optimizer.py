"""StreamAdamW, the optimizer (its contract: moepeak.stream_adamw's docstring): the param
groups, the step as host jobs of the op moepeak::stream_adamw (moepeak/stream_adamw/op.py)
over a pinned bucket plan (buckets.py), the device_state params (device.py), the updates
during backward (overlap.py), and copies (deepcopy, pickle). Its options are options.py,
its per-param state state.py, its argument checks checks.py, its state dict state_dict.py."""

from __future__ import annotations

import contextlib
import weakref

import torch

from .. import _C
from ..core.abi import DTYPE_CODES
from .buckets import PLAN_IDS, BucketPlan, register
from .checks import check_hyper, collect, local_shard
from .device import backward_tail, device_state_set, fused_update
from .kernel import torch_tail_model
from .op import stream_adamw, stream_adamw_step
from .options import StreamAdamWOptions
from .overlap import BackwardOverlap, side_stream
from .state import ParamStateMixin
from .state_dict import TORCH_GROUP_KEYS, StateDictMixin

_D = StreamAdamWOptions  # the defaults of the schedule keywords


class StreamAdamW(ParamStateMixin, StateDictMixin, torch.optim.Optimizer):
    """AdamW with its state in host RAM and a bucket-pipelined step (the contract is
    moepeak.stream_adamw's docstring). The schedule keywords become ``self.options``
    (a StreamAdamWOptions: their defaults and checks)."""

    backward_tail = staticmethod(backward_tail)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, amsgrad=False,
                 maximize=False, bucket_mb=_D.bucket_mb, threads=_D.threads, isa=_D.isa, grad_slots=_D.grad_slots,
                 param_slots=_D.param_slots, overlap_backward=_D.overlap_backward, clip_grad_norm=_D.clip_grad_norm,
                 device_state=_D.device_state, state_dtype=_D.state_dtype, rounding_seed=_D.rounding_seed,
                 _host_pipeline=_D.host_pipeline):
        check_hyper("lr", lr, betas, eps, weight_decay, amsgrad, maximize)
        self.options = StreamAdamWOptions(
            bucket_mb=bucket_mb, threads=threads, isa=isa, grad_slots=grad_slots, param_slots=param_slots,
            overlap_backward=overlap_backward, clip_grad_norm=clip_grad_norm, device_state=device_state,
            state_dtype=state_dtype, rounding_seed=rounding_seed, host_pipeline=_host_pipeline)
        self._isa = self.options.isa_code()
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, **TORCH_GROUP_KEYS)
        super().__init__(params, defaults)
        self._on_device = device_state_set(self.param_groups, self.options.device_state)
        self._devices = {}  # param -> device it had at its first step
        self._gpu_master = {}  # fp32 CUDA param -> its fp32 CPU master (always equal to the param)
        self._grad_dt = {}  # param -> dtype code of its last grad (for the plan's slot sizes)
        self.last_grad_norm = None  # total grad norm of the last step (clip_grad_norm mode)
        self._start_runtime(self.options.overlap_backward, overlap_enabled=True)

    def _start_runtime(self, overlap_backward, overlap_enabled):
        """What an optimizer owns besides its state and settings: the pinned bucket plan
        (made at the first CUDA step), the worker streams, the overlap hooks and worker,
        the pool threads it asked for. Built here for a new optimizer and for a copy
        (deepcopy, unpickling), never copied."""
        threads = self.options.threads or 0
        if threads > _C.get_num_threads():  # more than the pool keeps by default: give them back at death
            _THREAD_REQUESTS[id(self)] = threads
            weakref.finalize(self, _release_threads, id(self))
        self._plan = None
        self._plan_id = next(PLAN_IDS)
        self._tail = torch_tail_model()  # refreshed by every step(), used by hooks on autograd's threads
        self._streams = {}  # CUDA device -> the overlap worker's stream
        self._overlap = None
        if overlap_backward:
            params = [p for g in self.param_groups for p in g["params"]]
            self._overlap = BackwardOverlap(self, params, self.options.bucket_mb * (1 << 20), self._prepare_overlap,
                                            self._execute, immediate=self._on_device.__contains__)
            self._overlap.deferred = self.options.clip_grad_norm is not None
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
        state.update({k: self.__dict__[k] for k in _COPIED})
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
        for k, default in _COPIED.items():  # a state without them (torch's own keys only) gets the defaults
            if k not in self.__dict__:
                setattr(self, k, default())
        self._isa = min(self._isa, _C.cpu_best_isa())  # unpickled on another CPU: every ISA gives the same bits
        self._start_runtime(overlap_backward, overlap_enabled)

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
        entries = collect(self.param_groups, self._devices, skip=skip)  # raises before anything is modified
        clip = self.options.clip_grad_norm
        if clip is not None and entries:
            if skip:  # a param updated in backward cannot be clipped any more
                raise RuntimeError("moepeak.StreamAdamW: clip_grad_norm with params already updated in "
                                   "backward (set_overlap toggled mid-round?)")
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p, _, _, _ in entries], clip)
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
        entries = collect(self.param_groups, self._devices, only=set(params))
        return self._update_on_device_then_job(entries, overlapped=True)

    def _update_on_device_then_job(self, entries, overlapped):
        """Update the device_state params among entries where they live
        (device.fused_update) and return the host job of the
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
            fused_update(on_device, self.state, self.options.bucket_mb)
            if not torch.compiler.is_compiling():
                _bump_versions([lp for _, _, lp, _, _ in on_device])
        return job

    def _build_job(self, entries, overlapped):
        """The host job of entries: their state created and checked, their step counters
        advanced, the op's arguments, and (overlap, CUDA) the event it waits for."""
        self._create_host_state(entries)
        for group, p, lp, _, name in entries:  # every state tensor must fit its param before any pointer reaches C
            self._check_state(group, p, lp, name)
        steps = [self.state[p]["step"] for _, p, _, _, _ in entries]
        torch._foreach_add_(steps, 1.0)
        args = self._op_lists(entries) + (torch.stack(steps).tolist(),) + _hyper_lists(entries)
        kw = self._op_settings(entries)
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

    def _op_lists(self, entries):
        """The op's tensor lists: params (empty for an fp32 CPU param, its own master),
        grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (empty without amsgrad)."""
        out = ([], [], [], [], [], [])
        for group, p, lp, lg, _ in entries:
            st = self.state[p]
            row = (lp if (self._piped(lp) or lp.dtype != torch.float32) else _EMPTY, lg, self._master(p, lp),
                   st["exp_avg"], st["exp_avg_sq"], st["max_exp_avg_sq"] if group["amsgrad"] else _EMPTY)
            for lst, t in zip(out, row):
                lst.append(t)
        return out

    def _op_settings(self, entries) -> dict:
        """The op's keywords: the kernel's settings, the bucket plan and the rounding seeds."""
        o = self.options
        return dict(isa=self._isa, threads=o.threads or 0, bucket_mb=float(o.bucket_mb), grad_slots=o.grad_slots,
                    param_slots=o.param_slots, plan_id=self._plan_id, plan_index=self._cuda_plan(entries),
                    host_pipeline=o.host_pipeline, torch_threads=self._tail[0], torch_vlen=self._tail[1],
                    state_dtype=o.state_code, seeds=[self._rounding_seed(p) for _, p, _, _, _ in entries])

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
                lp = local_shard(p)
                if self._piped(lp) and lp.numel() > 0 and p not in self._on_device:
                    param_code = DTYPE_CODES.get(lp.dtype, 0)
                    layout.append((p, lp.numel(), self._grad_dt.get(p, param_code), param_code))
        if not layout:
            return None
        key = (tuple(x[1] for x in layout), tuple(x[2] for x in layout), tuple(x[3] for x in layout))
        if self._plan is None or self._plan.key != key:
            if self._overlap is not None:
                self._overlap.wait()  # no job of the round still runs on the old plan
            self._plan = None  # free the old pinned slots first
            o = self.options
            self._plan = register(self._plan_id, BucketPlan(key, local_shard(layout[0][0]).device, o.bucket_mb,
                                                            o.grad_slots, o.param_slots, host=o.host_pipeline))
        row = {p: i for i, (p, _, _, _) in enumerate(layout)}
        idx = [row[p] for _, p, lp, _, _ in entries if self._piped(lp) and lp.numel() > 0 and p not in self._on_device]
        return idx or None

    def pinned_bytes(self):
        """Pinned host bytes held by the bucket pipeline (0 before the first CUDA step)."""
        return 0 if self._plan is None else self._plan.pinned_bytes


_EMPTY = torch.empty(0)  # an absent tensor argument of the op (never written)
# Live optimizers that asked for more pool threads than the default: id -> threads. Process-wide
# because moepeak's C thread pool is: it is trimmed to the largest live request when one dies.
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


def _hyper_lists(entries):
    """The op's per-entry hyper-parameter lists: lrs, beta1s, beta2s, epss, weight_decays, maximizes."""
    groups = [e[0] for e in entries]
    return ([float(g["lr"]) for g in groups], [float(g["betas"][0]) for g in groups],
            [float(g["betas"][1]) for g in groups], [float(g["eps"]) for g in groups],
            [float(g["weight_decay"]) for g in groups], [bool(g["maximize"]) for g in groups])


# What a copy of the optimizer carries besides torch's keys, with the factory of the value
# an optimizer built with the defaults has.
_COPIED = dict(options=StreamAdamWOptions, _isa=_C.cpu_best_isa, last_grad_norm=lambda: None, _on_device=set,
               _devices=dict, _gpu_master=dict, _grad_dt=dict)


def _bump_versions(tensors):
    try:
        torch._C._increment_version(tensors)  # one call for the list (torch >= 2.5)
    except TypeError:
        for t in tensors:
            torch._C._increment_version(t)
