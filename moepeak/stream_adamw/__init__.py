"""moepeak.stream_adamw: StreamAdamW, AdamW with fp32 master weights, exp_avg and exp_avg_sq in
host RAM, streamed through the GPU copy engines bucket by bucket.

API
---
``moepeak.StreamAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
weight_decay=1e-2, *, amsgrad=False, maximize=False, bucket_mb=64,
threads=None, isa=None, grad_slots=3, param_slots=2, overlap_backward=False,
clip_grad_norm=None, device_state=None, state_dtype=torch.float32,
rounding_seed=0)`` is a ``torch.optim.Optimizer`` with
the update of ``torch.optim.AdamW`` (decoupled weight decay, bias correction,
amsgrad and maximize as torch defines them). The keywords after ``maximize`` are
the schedule's options: ``opt.options`` is their StreamAdamWOptions (defaults and
checks, options.py); their byte formulas are ``moepeak.stream_adamw.sizes``.

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
  ``exp_avg``, ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq`` (CPU
  tensors of state_dtype, fp32 by default, shaped like the local param), the
  same keys as ``torch.optim.AdamW``; plus, for bf16/fp16 params only,
  ``master_param`` (the fp32 master), and with bf16 state ``rounding_seed``. Loading a ``torch.optim.AdamW``
  state dict works (the master is then initialised from the param); loading
  ours into ``torch.optim.AdamW`` works too (torch keeps ``master_param`` as
  an unused extra entry, cast to the param's dtype; drop it from the dict
  first to avoid that memory). For fp32 CUDA params the CPU master is always
  equal to the param and is rebuilt from it after a load.
- ``state_dtype=torch.bfloat16`` (opt-in): exp_avg, exp_avg_sq (and
  max_exp_avg_sq) of host params are bf16 in host RAM, the master stays fp32:
  8 instead of 12 bytes per bf16/fp16 (or fp32 CUDA) param, 4 instead of 8 per
  fp32 CPU param. Each step widens them to fp32, runs the fp32 update above
  (the new param is the one fp32 state would give from the same moments) and
  stores them back with stochastic rounding (unbiased, error < one bf16 ulp)
  from a counter hash of (seed, step, element index): the same bits on every
  ISA, thread count, bucket split, with or without overlap. The seed of param
  i (its place in param_groups over all groups) is ``rounding_seed + i``, kept
  in its state as ``rounding_seed`` (an int), so a resumed run rounds
  identically. state_dict: bf16 tensors under torch's keys (+ rounding_seed);
  loading fp32 moments (torch.optim.AdamW's dict, an fp32 StreamAdamW's) rounds
  them to the nearest bf16 (ties to even), loading bf16 moments into fp32 state
  widens them exactly; loading ours into torch.optim.AdamW works as before
  (torch casts the moments to the param's dtype and keeps rounding_seed as an
  unused entry). device_state params keep fp32 state on their device
  (torch's kernel). Any other state_dtype is refused, named.
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
exp_avg_sqs; moepeak/stream_adamw/op.py) does one step on flat lists; the
optimizer calls it.

Modules
-------
  options      StreamAdamWOptions: the schedule's options, their defaults and checks
  sizes        the byte formulas: state per param, device_state, pinned staging (public)
  optimizer    StreamAdamW: the step and its host jobs, the bucket plan it keeps, copies
  state        the per-param state: dtypes, creation after a host-room check, its checks
  checks       the argument checks (hyper-parameters, params and grads, state tensors)
  state_dict   state_dict / load_state_dict (torch.optim.AdamW's layout, DTensors)
  op           the op moepeak::stream_adamw (one step on flat lists)
  kernel       the CPU kernel's bindings and torch's scalar-tail model
  buckets      the bucket plans (layout, pinned slot rings)
  overlap      the updates during backward (overlap_backward=True)
  device       the device_state params, updated on their own device

Public face (exported here, for users): StreamAdamW (also moepeak.StreamAdamW),
StreamAdamWOptions, and the module moepeak.stream_adamw.sizes. Everything else is
internal to moepeak.stream_adamw.
"""
from . import sizes
from .optimizer import StreamAdamW
from .options import StreamAdamWOptions

__all__ = ["StreamAdamW", "StreamAdamWOptions", "sizes"]
