"""apply_moepeak's loss part: the *ForCausalLM.forward of a family in LOSS_FAMILIES computes
moepeak.linear_cross_entropy on the last hidden state in training with labels (no logits),
with transformers' semantics (shift, ignore_index, mean or sum / num_items_in_batch, the
router aux loss); causal_lm_loss is that loss on its own.

Under sequence parallelism (SequenceOptions with a group, moepeak/hf/sequence.py) the forward
checks the batch with the whole group first (check_sequence_batch) and returns the rank's
share of the sequence's loss (sequence_share): CE summed over the rank's pre-shifted
shift_labels / N (the sequence's label count, or num_items_in_batch when given) + coef * its
share of the router aux loss, times P under sequence_loss="mean"; the value returned is the
sequence's loss on every rank. A head whose weight is a dim-0 sharded DTensor (FSDP2's layout,
one mesh dimension) runs Ring-DTP over the mesh's group on the rank's tokens, the shard's
gradient averaged over it (the "mean" convention of every other gradient).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch

from .expert_parallel import group_mean_gradient
from .sequence import check_model_batch, sequence_aux_share, with_value

# apply_moepeak's loss options (**options) -> linear_cross_entropy's argument names
# (ce_ring: the ring of a vocab-sharded head, RingDTPOptions.ring)
LOSS_OPTIONS = {"ce_mode": "mode", "ce_chunk_tokens": "chunk_tokens", "ce_chunk_vocab": "chunk_vocab",
                "ce_ring": "ring"}


# *ForCausalLM classes whose forward was read for transformers 5.17: lm_head
# on the last hidden state, self.loss_function (ForCausalLMLoss), no logit
# scaling or softcap, and loss += router_aux_loss_coef * aux_loss when it
# computes aux_loss. A family is added by one entry after reading its forward.
LOSS_FAMILIES = {
    "Qwen3MoeForCausalLM": "router aux loss",
    "Qwen2MoeForCausalLM": "router aux loss",
    "Qwen3NextForCausalLM": "router aux loss",
    "MixtralForCausalLM": "router aux loss",
    "OlmoeForCausalLM": "router aux loss",
    "GptOssForCausalLM": "router aux loss",
    "DeepseekV3ForCausalLM": "no aux loss",
}


def patch_loss(model, options, report, sequence=None) -> bool:
    """Replaces the instance's forward (see the module docstring); True when it did. sequence:
    the SequenceOptions (None: no sequence parallelism)."""
    cls = type(model)
    if cls.__name__ not in LOSS_FAMILIES:
        report.left_alone.append(f"loss: {cls.__name__}.forward is not in moepeak.hf.LOSS_FAMILIES (its loss "
                                 "may scale or cap the logits); the model computes its own logits and loss")
        return False
    base = getattr(model, model.base_model_prefix, None)
    head = model.get_output_embeddings()
    if not isinstance(base, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
        report.left_alone.append(f"loss: {cls.__name__} has no base model {model.base_model_prefix!r} or no "
                                 "nn.Linear output embedding")
        return False
    original = cls.forward
    signature = inspect.signature(original)
    from ..ring_dtp import RingDTPOptions  # the loss's schedule, checked now (a bad value names its field)
    ce_options = {"options": RingDTPOptions(**{LOSS_OPTIONS[k]: v for k, v in options.items()})}

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        extra = dict(bound.arguments.pop("kwargs", {}))
        arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
        labels = arguments.get("labels")
        group = sequence.resolve_group() if sequence is not None and self.training else None
        with_loss = labels is not None and self.training
        if group is not None:
            refusal = None
            if with_loss and extra.get("shift_labels") is None:
                refusal = ("under sequence_group the loss needs shift_labels (the labels shifted left by one before "
                           "the sequence was split, as DeepSpeed's UlyssesSPDataLoaderAdapter and accelerate's context "
                           "parallelism provide them): labels shifted on a shard would lose each shard's last label")
            check_model_batch(self, arguments.get("position_ids"), arguments.get("attention_mask"), group, refusal)
        if not with_loss:
            return original(self, *args, **kwargs)
        return_dict = extra.pop("return_dict", getattr(self.config, "return_dict", True))
        arguments["labels"] = None
        # lm_head runs on no position: its input slice is empty.
        arguments["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=labels.device)
        captured = []
        hook = getattr(self, self.base_model_prefix).register_forward_hook(
            lambda mod, inp, out: captured.append(out[0]))
        head = self.get_output_embeddings()
        try:
            with _sharded_head_skipped(head):
                out = original(self, **arguments, **extra, return_dict=True)
        finally:
            hook.remove()
        fields = dict(out.items())
        if group is not None:
            fields.update(sequence_share(self, captured[-1], head, extra, out, group, sequence, ce_options))
        else:
            loss = causal_lm_loss(captured[-1], head, labels, num_items_in_batch=extra.get("num_items_in_batch"),
                                  ignore_index=extra.get("ignore_index", -100),
                                  shift_labels=extra.get("shift_labels"), **ce_options)
            aux = getattr(out, "aux_loss", None)
            if aux is not None:
                loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
            fields.update(loss=loss)
        fields.update(logits=None)
        out = type(out)(**fields)
        if group is not None:  # for SequenceParallelTrainerMixin: this loss is already the sequence's
            out.moepeak_sequence_loss = sequence.loss
        return out if return_dict else out.to_tuple()

    model.forward = types.MethodType(forward, model)
    report.patched.append(f"loss: {cls.__name__}.forward computes moepeak.linear_cross_entropy on the last "
                          f"hidden state in training with labels (no logits; {LOSS_FAMILIES[cls.__name__]})")
    return True


def sequence_share(model, hidden, head, extra, out, group, sequence, ce_options) -> dict:
    """The loss fields of a sequence-parallel forward (the module docstring): loss (value: the
    sequence's loss; gradient: the rank's share, times P under "mean") and, with the router aux
    loss, aux_loss likewise (the sequence's aux loss, this rank's share of its gradient)."""
    import torch.distributed as dist
    ignore_index = extra.get("ignore_index", -100)
    shift_labels = extra["shift_labels"]
    ce_sum = head_cross_entropy(hidden, head, shift_labels.to(hidden.device), "sum", ignore_index, ce_options)
    totals = torch.stack([(shift_labels != ignore_index).sum().to(torch.float64).to(ce_sum.device),
                          ce_sum.detach().to(torch.float64)])
    dist.all_reduce(totals, group=group)  # [labels, CE sum] of the whole sequence
    count = extra.get("num_items_in_batch")
    count = totals[0] if count is None else torch.as_tensor(count, dtype=torch.float64, device=ce_sum.device)
    share = ce_sum / count.to(ce_sum.dtype)
    value = totals[1] / count
    fields = {}
    if getattr(out, "aux_loss", None) is not None:
        coef = model.router_aux_loss_coef
        aux_share, aux = sequence_aux_share(out.router_logits, model.num_experts, model.num_experts_per_tok, group)
        share = share + coef * aux_share.to(share.device)
        value = value + coef * aux.to(value.device)
        fields["aux_loss"] = with_value(sequence.loss_scale(group) * aux_share, aux)
    fields["loss"] = with_value(sequence.loss_scale(group) * share, value.to(share.dtype))
    return fields


@contextlib.contextmanager
def _sharded_head_skipped(head: torch.nn.Linear):
    """The model's own forward runs lm_head on an empty slice (no logits); a head whose weight is
    a DTensor cannot take a plain tensor, so that call returns the empty logits directly."""
    if not _is_dtensor(head.weight):
        yield
        return
    head.forward = lambda hidden: hidden.new_zeros(*hidden.shape[:-1], head.out_features)
    try:
        yield
    finally:
        del head.forward


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _head_shard(weight):
    """(local dim-0 shard, the mesh's group) of a sharded head weight (FSDP2's layout)."""
    from torch.distributed.tensor import Shard
    placements = tuple(weight.placements)
    if weight.device_mesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(0):
        raise ValueError(f"moepeak.hf: a DTensor lm_head weight must be Shard(0) on a 1-D mesh (FSDP2's layout), got "
                         f"placements {placements} on a {weight.device_mesh.ndim}-D mesh")
    group = weight.device_mesh.get_group()
    return group_mean_gradient(weight.to_local(), group), group


def head_cross_entropy(hidden, lm_head: torch.nn.Linear, shift_labels, reduction: str, ignore_index: int,
                       ce_options: dict):
    """linear_cross_entropy of lm_head(hidden) against shift_labels, fp32: in the autocast dtype
    under autocast (as lm_head would run), else in the weight's dtype. A DTensor weight (dim-0
    vocab shards): Ring-DTP over the mesh's group, every rank's tokens against the whole
    vocabulary, the shard's gradient averaged over the group."""
    from ..ring_dtp import linear_cross_entropy
    weight, bias = lm_head.weight, lm_head.bias
    group = None
    if _is_dtensor(weight):
        if bias is not None:
            raise ValueError("moepeak.hf: a DTensor (vocab-sharded) lm_head must have no bias (Ring-DTP has none)")
        weight, group = _head_shard(weight)
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):  # lm_head would run in the autocast dtype
        dt = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    return linear_cross_entropy(hidden, weight, shift_labels, bias=bias, ignore_index=ignore_index,
                                reduction=reduction, group=group, **ce_options)


def causal_lm_loss(hidden, lm_head: torch.nn.Linear, labels, *, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, **ce_options):
    """transformers' ForCausalLMLoss(lm_head(hidden), labels, ...) without the logits.

    hidden [B, T, H]; labels [B, T] int (position t's label is predicted at
    t - 1: labels shift left by one and the last position gets ignore_index),
    or shift_labels [B, T] already shifted. Reduction: mean over non-ignored
    labels, or the sum / num_items_in_batch when that is given. fp32 result.
    A vocab-sharded head (lm_head.weight a Shard(0) DTensor): see head_cross_entropy.
    No label left (T = 1, every label ignored): NaN (0 / 0; num_items_in_batch = 0:
    the sum / 0) and zero gradients, as transformers' loss."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if num_items_in_batch is None:
        return head_cross_entropy(hidden, lm_head, shift_labels, "mean", ignore_index, ce_options)
    total = head_cross_entropy(hidden, lm_head, shift_labels, "sum", ignore_index, ce_options)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
