"""Ring-DTP's public API (exported by moepeak.ring_dtp): linear_cross_entropy and the
module RingDTPLinearCrossEntropy. The argument checks (every one before any work, each
naming the argument: the tensors' dtypes and devices, their shapes, the loss definition
here; the schedule's in RingDTPOptions), autocast, then one of: the single-device op
moepeak::ring_dtp_ce (moepeak/ring_dtp/ops.py), the rings over a group
(moepeak/ring_dtp/ring.py), or the gathered weight (ring="gather").
"""
from __future__ import annotations

import logging
import math
import operator
import threading
from typing import Optional

import torch
from torch import Tensor

from ..core.autograd import scale_grad
from ..core.ext import check_tensor, require_cuda_build
from . import blocks as B
from . import ops  # noqa: F401 (registers moepeak::ring_dtp_ce, called below through torch.ops)
from .group import agreed_options, refuse_on_group
from .labels import PENDING, check_labels
from .options import RingDTPOptions
from .ring import check_no_bias, gather_vocab_shards, ring_linear_cross_entropy
from .sched import REDUCTIONS

__all__ = ["linear_cross_entropy", "RingDTPLinearCrossEntropy"]

LOG = logging.getLogger("moepeak")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_FUSED_MODE_NAMES = ("fused", "fused_lowp")


def _int64(name, v) -> int:
    """v as a Python int in int64's range (what the op's schema and F.cross_entropy take)."""
    try:
        if isinstance(v, bool):
            raise TypeError
        v = operator.index(v)
    except TypeError:
        raise TypeError(f"moepeak: {name} must be an int, got {type(v).__name__}") from None
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise ValueError(f"moepeak: {name} must fit in int64 [-2^63, 2^63), got {v}")
    return v


def _canonical(t: Tensor) -> Tensor:
    """t with row-major strides: .contiguous(), and for a tensor torch calls contiguous
    although a size-1 dim has an odd stride (V = 1, H = 1, T = 1), a copy (a few elements:
    the dim is 1) so the kernels' leading dimensions are the row lengths."""
    if not t.is_contiguous():
        return t.contiguous()
    want, acc = [], 1
    for n in reversed(t.shape):
        want.append(acc)
        acc *= max(n, 1)
    if tuple(reversed(want)) == t.stride():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _autocast_inputs(hidden, weight, bias):
    """Under torch.autocast the projection runs in the autocast dtype, as F.linear's does:
    hidden, weight and bias are cast to it (differentiably). Outside autocast (or for a
    hidden that is no tensor: the checks refuse it): unchanged."""
    if not isinstance(hidden, Tensor):
        return hidden, weight, bias
    dev = hidden.device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return hidden, weight, bias
    dt = torch.get_autocast_dtype(dev)

    def cast(t):
        return t if not isinstance(t, Tensor) or not t.is_floating_point() or t.dtype == dt else t.to(dt)
    return cast(hidden), cast(weight), cast(bias)


# ---- the checks, each naming the argument; all run before any work -------------------------
def _check_dtypes_and_devices(hidden, weight, labels, bias) -> None:
    check_tensor("hidden", hidden, dtypes=_FLOAT_DTYPES)
    check_tensor("weight", weight, dtypes=_FLOAT_DTYPES, ndim=2, device=hidden.device)
    if weight.dtype != hidden.dtype:
        dn = lambda d: str(d).replace("torch.", "")  # noqa: E731
        raise TypeError(f"moepeak: weight dtype {dn(weight.dtype)} does not match hidden dtype "
                        f"{dn(hidden.dtype)}; weight must have dtype {dn(hidden.dtype)} (hidden's): cast one "
                        f"of them, e.g. hidden.to(weight.dtype)")
    # F.cross_entropy's target dtypes: int64 (and uint8); int32 is refused there as here.
    check_tensor("labels", labels, dtypes=(torch.int64, torch.uint8), device=hidden.device)
    if bias is not None:
        check_tensor("bias", bias, dtypes=(hidden.dtype,), ndim=1, device=hidden.device)
    if hidden.device.type == "cuda":
        require_cuda_build("linear_cross_entropy")
    elif hidden.device.type != "cpu":
        raise ValueError(f"moepeak: linear_cross_entropy supports cpu and cuda tensors, got {hidden.device}")


def _check_shapes(hidden, weight, labels, bias, sharded: bool) -> None:
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"moepeak: hidden must be [..., H] with H = weight.shape[1] = {weight.shape[1]}, "
                         f"got {tuple(hidden.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"moepeak: labels must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")
    if weight.shape[0] < 1 and not sharded:  # (a shard may be empty: FSDP2 cuts V = 5 for 4 ranks 2, 2, 1, 0;
        raise ValueError("moepeak: weight must have at least one vocab row")  # all-empty raises on every rank)
    if bias is not None and bias.shape[0] != weight.shape[0]:
        raise ValueError(f"moepeak: bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")


def _check_loss_definition(ignore_index, reduction, label_smoothing, z_loss, softcap) -> int:
    """Check the loss definition's keywords; returns ignore_index as an int64 Python int."""
    ignore_index = _int64("ignore_index", ignore_index)
    if reduction not in REDUCTIONS:
        raise ValueError(f"moepeak: reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:  # (NaN fails too)
        raise ValueError(f"moepeak: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not 0.0 <= z_loss < math.inf:
        raise ValueError(f"moepeak: z_loss must be finite and >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"moepeak: softcap must be None or > 0 (inf: no cap), got {softcap}")
    return ignore_index


def _check_labels_now(y: Tensor, V: int, ignore_index: int) -> None:
    """label_check="sync" on CUDA: one host sync, before any work."""
    bad = (y != ignore_index) & ((y < 0) | (y >= V))
    if bool(bad.any()):
        raise ValueError(f"moepeak: labels must be in [0, {V}) or ignore_index={ignore_index}; "
                         f"got {y[bad][:5].tolist()}")


_WARNED = set()
_WARNED_LOCK = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    """Log `message` through the "moepeak" logger the first time `key` comes in this process."""
    with _WARNED_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    LOG.warning(message)


def _note_unused_schedule(options: RingDTPOptions, reduction: str, on_group: bool) -> None:
    """A mode asked for that this call cannot run is replaced, and said so once."""
    if on_group and options.mode != "auto":
        _warn_once("mode-on-ring", f"moepeak: linear_cross_entropy(mode={options.mode!r}) with group and "
                   f"ring={options.ring!r}: the rings run their own exact order and do not use mode "
                   "(ring='gather' does)")
    elif options.mode in _FUSED_MODE_NAMES and reduction == "none":
        _warn_once("fused-none", f"moepeak: linear_cross_entropy(mode={options.mode!r}, reduction='none') runs "
                   "'vocab_outer': the fused modes make the gradients in forward, which needs one upstream "
                   "gradient for the whole loss")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Optional[Tensor] = None,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None, return_lse: bool = False,
                         group=None, options: Optional[RingDTPOptions] = None, ring: Optional[str] = None,
                         chunk_tokens: Optional[int] = None, chunk_vocab: Optional[int] = None,
                         mode: Optional[str] = None, transport=None, label_check: Optional[str] = None):
    """F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ...) without the logits.

    hidden [..., H], weight [V, H] (with `group`: this rank's dim-0 vocab shard),
    labels [...] int64. Returns loss ([] or labels.shape for reduction="none", fp32),
    and lse (labels.shape, fp32) when return_lse.
    The loss definition: ignore_index, reduction, label_smoothing, z_loss, softcap (F.cross_entropy's
    and the usual extras). The schedule: options (a RingDTPOptions; None: its defaults), and the
    keywords ring, chunk_tokens, chunk_vocab, mode, transport, label_check, each of which, when
    not None, replaces that field of options (RingDTPOptions has the defaults and the checks):
    mode: "auto" or a schedule of moepeak.ring_dtp's docstring ("fused", "fused_lowp",
    "vocab_outer", "vocab_outer_lowp", "token_outer"); all give the same loss and
    gradients up to rounding, and differ in speed, workspace and where they round
    (vocab_outer is the exact choice). chunk_tokens / chunk_vocab override the
    block sizes the workspace budget picks.
    group: `weight` is this rank's dim-0 vocab shard, the loss is that of this rank's tokens
    against the whole vocabulary, and the shard's gradient is that of the sum of the
    group's losses. ring: "weights" / "activations" circulate shards or tokens around the
    group (exact 4-GEMM order, `mode` not used; "auto" picks the one moving fewer bytes) and
    hold only a 1/P shard of what grows with the vocabulary; "gather" all-gathers the whole
    weight, runs the single-device op (`mode` applies) and sums each shard's gradient back
    at its owner: it holds 2 V H more elements than a ring, and the single-device op may
    take its 3-GEMM schedules where the rings take 4, so it is faster where those fit
    (benchmarks/RESULTS.md has the numbers). `ring` is checked with or without `group` (one
    of RINGS). Every rank of the group must pass the same ring, chunk sizes, ignore_index,
    reduction, label_smoothing, z_loss and softcap (moepeak.ring_dtp.group.AGREED), and call
    backward alike (the same create_graph): the first are checked, a difference raises a
    ValueError on every rank; an argument refused on one rank raises there, and a ValueError
    naming that rank on the others (none is left waiting).
    transport (with `group`): "auto" / "torch" (torch.distributed on the group), "nccl"
    (moepeak's NCCL-from-C transport, CUDA tensors; one communicator per group and
    device, created collectively on the first call and kept), or a moepeak Transport.
    label_check (CUDA labels; CPU labels are always checked before any work): "deferred"
    checks without a host sync, so a bad label gives a NaN loss and the ValueError comes at
    the latest from this call's backward (before any gradient is written), or from the next
    call or moepeak.check_labels(); "sync" checks before any work, at the cost of one host
    sync per call (single device; with `group`, every rank's labels are checked in the group's
    exchange, the call's one host sync, and a bad label raises on every rank).
    Under torch.autocast, hidden, weight and bias are cast to the autocast dtype (F.linear's
    behaviour); outside it their dtypes must match. softcap=inf is no cap. With
    create_graph=True the backward is built from torch ops over the whole [T, V] logits
    (the memory of the plain-PyTorch loss; with `group` also the whole weight, gathered), so
    second-order gradients are exact.
    """
    if isinstance(softcap, (int, float)) and softcap == math.inf:
        softcap = None  # an infinite cap is no cap
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    try:
        options = RingDTPOptions.resolve(options, ring=ring, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab,
                                         mode=mode, transport=transport, label_check=label_check)
        _check_dtypes_and_devices(hidden, weight, labels, bias)
        _check_shapes(hidden, weight, labels, bias, sharded=group is not None)
        ignore_index = _check_loss_definition(ignore_index, reduction, label_smoothing, z_loss, softcap)
        if group is not None:
            check_no_bias(bias)
            if PENDING:  # earlier calls' CUDA label flags: read here, before the exchange
                check_labels()
    except (TypeError, ValueError) as err:
        if group is None:
            raise
        # A rank raising alone would leave the others waiting in the group's first exchange:
        # it takes part, flagged, and every rank raises.
        refuse_on_group(err, group, _transport_of(options, transport),
                        (weight if isinstance(weight, Tensor) else hidden).device)
    on_ring = group is not None and options.ring != "gather"
    _note_unused_schedule(options, reduction, on_ring)
    lead = tuple(labels.shape)
    x = _canonical(hidden.reshape(-1, hidden.shape[-1]))
    y = _canonical(labels.reshape(-1).to(torch.int64))
    weight = _canonical(weight)
    bias = None if bias is None else _canonical(bias)
    if options.label_check == "sync" and group is None and y.device.type == "cuda":
        _check_labels_now(y, weight.shape[0], ignore_index)
    loss_definition = (ignore_index, reduction, label_smoothing, z_loss, softcap)
    if group is not None and not on_ring:  # ring="gather": the whole weight here, then the single-device op
        agreed = agreed_options(options, *loss_definition)
        weight, group = gather_vocab_shards(weight, group, agreed, options.transport, y, ignore_index), None
    if group is not None:
        loss, lse = ring_linear_cross_entropy(x, weight, y, group, ignore_index, reduction, label_smoothing, z_loss,
                                              softcap or 0.0, options)
    else:
        loss, lse = _single_device(x, weight, y, bias, loss_definition, options)
    if reduction == "none":
        loss = loss.reshape(lead)
    if return_lse:
        return loss, lse.detach().reshape(lead)
    return loss


def _transport_of(options, transport):
    """The transport a refusing rank joins the group's exchange with: the call's, where it is known."""
    if isinstance(options, RingDTPOptions):
        return options.transport
    return transport if transport is not None else RingDTPOptions.transport


def _single_device(x, weight, y, bias, loss_definition, options: RingDTPOptions):
    """(loss, lse) of the single-device op moepeak::ring_dtp_ce on x [T, H], weight [V, H]."""
    ignore_index, reduction, label_smoothing, z_loss, softcap = loss_definition
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))
    out = torch.ops.moepeak.ring_dtp_ce(x, weight, y, bias, ignore_index, REDUCTIONS[reduction],
                                        float(label_smoothing), float(z_loss), float(softcap or 0.0),
                                        *options.op_args(), grads)
    return out[0], B.lse_report(out[1], out[2])


class RingDTPLinearCrossEntropy(torch.nn.Module):
    """lm_head + cross-entropy in one module: holds `.weight` [V, H] (the name an
    lm_head uses, so checkpoints load) and `.bias` when bias=True.
    forward(hidden, labels) -> loss (and lse with return_lse=True).

    Sharded weight (FSDP2 layout): `shard_(mesh)` makes `.weight` a Shard(0)
    DTensor; forward then uses weight.to_local() as this rank's ring shard and
    the mesh's group (no all-gather of the full weight happens, unless ring="gather"). Under
    `fully_shard(model, mesh=mesh, ignored_params={head.weight})` FSDP2 leaves
    that weight to the ring (without ignored_params FSDP2 would all-gather it
    before forward; the result is still right, through the single-device op).
    With grad_average=True (default) the shard's gradient is the mean over the
    group's ranks, as FSDP2/DDP reduce gradients; False gives the sum.
    Tied embeddings: assign `module.weight = emb.weight` (unsharded).
    The loss definition and the schedule (options and its keywords): as linear_cross_entropy's,
    checked here; `.options` is the resolved RingDTPOptions."""

    def __init__(self, hidden_size: int, vocab_size: int, *, bias: bool = False, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: Optional[float] = None, group=None, options: Optional[RingDTPOptions] = None,
                 ring: Optional[str] = None, chunk_tokens: Optional[int] = None, chunk_vocab: Optional[int] = None,
                 mode: Optional[str] = None, grad_average: bool = True, transport=None,
                 label_check: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        self.options = RingDTPOptions.resolve(options, ring=ring, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab,
                                              mode=mode, transport=transport, label_check=label_check)
        _check_loss_definition(ignore_index, reduction, label_smoothing, z_loss, softcap)
        self.loss_definition = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                                    z_loss=z_loss, softcap=softcap)
        fk = {"device": device, "dtype": dtype}
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size, **fk))
        self.bias = torch.nn.Parameter(torch.empty(vocab_size, **fk)) if bias else None
        self.group = group
        self.grad_average = grad_average
        self.reset_parameters()

    def shard_(self, mesh) -> "RingDTPLinearCrossEntropy":
        """Make .weight a dim-0 sharded DTensor on the 1-D `mesh` (FSDP2's layout)."""
        from torch.distributed.tensor import Shard, distribute_tensor  # noqa: WPS433
        if self.bias is not None:
            raise ValueError("moepeak: shard_() supports bias=False only (the ring has no bias)")
        self.weight = torch.nn.Parameter(distribute_tensor(self.weight.detach(), mesh, [Shard(0)]))
        return self

    def reset_parameters(self) -> None:
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's init
        if self.bias is not None:
            bound = 1 / math.sqrt(self.hidden_size)
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, hidden: Tensor, labels: Tensor, return_lse: bool = False):
        w, b = self.weight, self.bias
        group = self.group
        if hasattr(w, "to_local"):  # FSDP2 / DTensor: this rank's dim-0 shard is the ring shard
            w, group = self._local_shard(w, group)
            b = b.to_local() if b is not None and hasattr(b, "to_local") else b
        if group is not None and self.grad_average:
            w = scale_grad(w, mul=1.0 / torch.distributed.get_world_size(group))  # average the ring's summed dW
        return linear_cross_entropy(hidden, w, labels, bias=b, group=group, return_lse=return_lse,
                                    options=self.options, **self.loss_definition)

    @staticmethod
    def _local_shard(w, group):
        """(local dim-0 shard, its group) of a DTensor weight; no all-gather. The gradient
        flows back through to_local() into the DTensor's own Shard(0) gradient."""
        from torch.distributed.tensor import Shard  # noqa: WPS433 (torch >= 2.4)
        pl = tuple(w.placements)
        if w.device_mesh.ndim != 1 or len(pl) != 1 or not (isinstance(pl[0], Shard) and pl[0].dim == 0):
            raise ValueError(f"moepeak: a DTensor weight must be Shard(0) on a 1-D mesh (FSDP2's layout), "
                             f"got placements {pl} on a {w.device_mesh.ndim}-D mesh")
        return w.to_local(), (group if group is not None else w.device_mesh.get_group())

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, bias={self.bias is not None}"
