"""apply_moepeak's loss part: the *ForCausalLM.forward of a family in LOSS_FAMILIES computes
moepeak.linear_cross_entropy on the last hidden state in training with labels (no logits),
with transformers' semantics (shift, ignore_index, mean or sum / num_items_in_batch, the
router aux loss); causal_lm_loss is that loss on its own.
"""
from __future__ import annotations

import functools
import inspect
import types

import torch

# apply_moepeak's loss options (**options) -> linear_cross_entropy's argument names
LOSS_OPTIONS = {"ce_mode": "mode", "ce_chunk_tokens": "chunk_tokens", "ce_chunk_vocab": "chunk_vocab"}


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


def patch_loss(model, options, report):
    cls = type(model)
    if cls.__name__ not in LOSS_FAMILIES:
        report.left_alone.append(f"loss: {cls.__name__}.forward is not in moepeak.hf.LOSS_FAMILIES (its loss "
                                 "may scale or cap the logits); the model computes its own logits and loss")
        return
    base = getattr(model, model.base_model_prefix, None)
    head = model.get_output_embeddings()
    if not isinstance(base, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
        report.left_alone.append(f"loss: {cls.__name__} has no base model {model.base_model_prefix!r} or no "
                                 "nn.Linear output embedding")
        return
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
        if labels is None or not self.training:
            return original(self, *args, **kwargs)
        return_dict = extra.pop("return_dict", getattr(self.config, "return_dict", True))
        arguments["labels"] = None
        # lm_head runs on no position: its input slice is empty.
        arguments["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=labels.device)
        captured = []
        hook = getattr(self, self.base_model_prefix).register_forward_hook(
            lambda mod, inp, out: captured.append(out[0]))
        try:
            out = original(self, **arguments, **extra, return_dict=True)
        finally:
            hook.remove()
        loss = causal_lm_loss(captured[-1], self.get_output_embeddings(), labels,
                              num_items_in_batch=extra.get("num_items_in_batch"),
                              ignore_index=extra.get("ignore_index", -100),
                              shift_labels=extra.get("shift_labels"), **ce_options)
        aux = getattr(out, "aux_loss", None)
        if aux is not None:
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        fields = dict(out.items())
        fields.update(loss=loss, logits=None)
        out = type(out)(**fields)
        return out if return_dict else out.to_tuple()

    model.forward = types.MethodType(forward, model)
    report.patched.append(f"loss: {cls.__name__}.forward computes moepeak.linear_cross_entropy on the last "
                          f"hidden state in training with labels (no logits; {LOSS_FAMILIES[cls.__name__]})")


def causal_lm_loss(hidden, lm_head: torch.nn.Linear, labels, *, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, **ce_options):
    """transformers' ForCausalLMLoss(lm_head(hidden), labels, ...) without the logits.

    hidden [B, T, H]; labels [B, T] int (position t's label is predicted at
    t - 1: labels shift left by one and the last position gets ignore_index),
    or shift_labels [B, T] already shifted. Reduction: mean over non-ignored
    labels, or the sum / num_items_in_batch when that is given. fp32 result.
    No label left (T = 1, every label ignored): NaN (0 / 0; num_items_in_batch = 0:
    the sum / 0) and zero gradients, as transformers' loss."""
    from ..ring_dtp import linear_cross_entropy
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    weight, bias = lm_head.weight, lm_head.bias
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):  # lm_head would run in the autocast dtype
        dt = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    shift_labels = shift_labels.to(hidden.device)
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden, weight, shift_labels, bias=bias, ignore_index=ignore_index,
                                    reduction="mean", **ce_options)
    total = linear_cross_entropy(hidden, weight, shift_labels, bias=bias, ignore_index=ignore_index,
                                 reduction="sum", **ce_options)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
