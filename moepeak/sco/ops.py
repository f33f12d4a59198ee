"""SCO's two byte-copy ops, moepeak::sco_offload and moepeak::sco_reload.

Both copy the raw bytes of a contiguous tensor to or from `host`, a uint8 [nbytes] CPU view
of an arena or staging slot. CUDA: async on torch's current stream (the engine orders it
with events). CPU: a plain copy. They mutate their destination, and torch refuses
register_autograd for mutating ops: gradients flow through sco_checkpoint's recompute,
never through these copies.
"""
from __future__ import annotations

import torch

from .. import _C
from ..core.ext import current_stream_handle, require_cuda_build


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
