"""moepeak.titan.loss's component: a ChunkedLossWrapper whose loss is
moepeak.linear_cross_entropy (Ring-DTP) on the final hidden states, so the trainer skips
the lm_head and the [B, L, V] logits never exist (the contract: moepeak.titan's docstring)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss

from ..ring_dtp import RingDTPOptions, linear_cross_entropy


class RingDTPLoss(ChunkedLossWrapper):
    """Sum cross-entropy of lm_head(hidden) over the batch, divided by the
    global valid-token count, computed by moepeak.linear_cross_entropy without
    the [B, L, V] logits. Being a ChunkedLossWrapper, the trainer sets the
    lm_head on it and runs the model with _skip_lm_head=True."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        ring: str = RingDTPOptions.ring
        """Sharded head: "auto", "weights", "activations" or "gather" (linear_cross_entropy)."""
        mode: str = RingDTPOptions.mode
        """Unsharded head: linear_cross_entropy's schedule."""
        chunk_tokens: Optional[int] = RingDTPOptions.chunk_tokens
        chunk_vocab: Optional[int] = RingDTPOptions.chunk_vocab

    def __init__(self, config: Config, *, compile_config=None):
        if type(config.loss_fn) is not CrossEntropyLoss.Config:
            raise ValueError(f"moepeak.titan.loss computes cross-entropy; the inner loss "
                             f"{type(config.loss_fn).__qualname__} is not supported")
        self.num_chunks = 1
        self.loss_fn = None
        self.lm_head = None
        self.options = dict(ring=config.ring, mode=config.mode, chunk_tokens=config.chunk_tokens,
                            chunk_vocab=config.chunk_vocab)
        RingDTPOptions(**self.options)  # checked now: a bad value names its field

    def head_weight(self):
        """(weight, bias, group): the lm_head's weight as linear_cross_entropy
        takes it -- the whole [V, D] matrix, or this rank's dim-0 vocab shard
        [V/P, D] with the group of its 1-D mesh."""
        head = self.lm_head
        if head is None:
            raise RuntimeError("moepeak.titan.loss: the trainer did not set the lm_head (set_lm_head)")
        w, b = head.weight, getattr(head, "bias", None)
        if not hasattr(w, "placements"):
            return w, b, None
        from torch.distributed.tensor import Shard
        if w.device_mesh.ndim != 1 or tuple(w.placements) != (Shard(0),):
            raise NotImplementedError(f"moepeak.titan.loss: the lm_head weight must be whole or sharded on dim 0 "
                                      f"over a 1-D mesh (FSDP2); got placements {tuple(w.placements)} on a "
                                      f"{w.device_mesh.ndim}-D mesh")
        if b is not None:
            raise NotImplementedError("moepeak.titan.loss: a sharded lm_head with a bias is not supported")
        group = w.device_mesh.get_group()
        return w.to_local(), None, (group if w.device_mesh.size() > 1 else None)

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens=None, **loss_inputs):
        unknown = sorted(set(loss_inputs) - {"positions"})
        if unknown:
            raise ValueError(f"moepeak.titan.loss: unsupported loss inputs {unknown}")
        if hasattr(pred, "to_local"):
            raise NotImplementedError("moepeak.titan.loss: DTensor hidden states (tensor/sequence parallel "
                                      "loss) are not supported")
        w, b, group = self.head_weight()
        w = w.to(pred.dtype)
        b = b.to(pred.dtype) if b is not None else None
        opts = dict(self.options)
        if group is None:
            opts.pop("ring")
        else:
            opts.pop("mode")
        loss = linear_cross_entropy(pred, w, labels, bias=b, ignore_index=IGNORE_INDEX, reduction="sum", group=group,
                                    **opts)
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}
