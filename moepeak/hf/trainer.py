"""SequenceParallelTrainerMixin: the transformers Trainer's loss under DeepSpeed sequence
parallelism (accelerate ParallelismConfig(sp_size=P, sp_backend="deepspeed")), exact with the
router aux loss.

    class MoepeakTrainer(SequenceParallelTrainerMixin, transformers.Trainer): pass
    class MoepeakSFTTrainer(SequenceParallelTrainerMixin, trl.SFTTrainer): pass

The stock loss there (transformers.integrations.deepspeed.deepspeed_sp_compute_loss) weighs
each rank's model loss by its label count, which is exact for the cross-entropy but weighs the
aux loss, computed by each rank on its own tokens, by those counts too (not the one-process
aux loss: a product of two means over all tokens; a rank without a valid label drops its aux
term). The mixin returns instead, on every rank, a loss whose value is the sequence's loss and
whose gradient is the rank's share s_r (moepeak/hf/sequence.py), which DeepSpeed sums over the
sequence group:
- a model after apply_moepeak(model, sequence_group="engine", ...) computes s_r in its forward
  (sequence_loss "sum" is taken as is; "mean" is divided by P);
- any other forward (its own loss: the local mean CE plus coef * its local aux loss) gets
  s_r = CE_r * n_r / N + coef * A_r from its outputs' loss, aux_loss and router_logits.
Outside DeepSpeed sequence parallelism, and in evaluation, the next class's compute_loss
runs. The mixin comes first in the bases (it calls the model itself under sequence
parallelism, so with TRL's SFTTrainer that trainer's own metrics are not logged for those
steps). DeepSpeed reduces every parameter over its data-parallel group, so expert slices
(apply_moepeak(group=...)) are refused here. ZeRO-3 on deepspeed < 0.20.2 averages rather than
sums over the sequence group; the gradient is then scaled by P, as transformers does.
"""
from __future__ import annotations

import torch

from .expert_parallel import expert_slices
from .sequence import engine_sequence_group, sequence_aux_share, sequence_label_count, with_value


class SequenceParallelTrainerMixin:
    """compute_loss for transformers.Trainer (and subclasses) under DeepSpeed sequence
    parallelism; see the module docstring."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        pc = getattr(self.accelerator, "parallelism_config", None)
        if not (pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled and self.model.training):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        group = engine_sequence_group()
        if group is None:
            raise RuntimeError("moepeak.hf: DeepSpeed sequence parallelism is enabled but its sequence-parallel group "
                               "is not set up (accelerate sets it up when the Trainer prepares the model)")
        slices = expert_slices(self.model)
        if slices:
            raise ValueError(f"moepeak.hf: a DeepSpeed engine reduces every parameter over its data-parallel group; "
                             f"expert slices ({len(slices)}, from apply_moepeak(group=...)) cannot live in it: apply "
                             "moepeak without group under the Trainer's DeepSpeed sequence parallelism")
        inputs = dict(inputs)
        if "labels" not in inputs and "shift_labels" in inputs:  # DeepSpeed's loader adapter drops labels
            inputs["labels"] = inputs["shift_labels"]
        inputs.setdefault("use_cache", False)
        outputs = model(**inputs)
        P = torch.distributed.get_world_size(group)
        convention = getattr(outputs, "moepeak_sequence_loss", None)
        if convention is not None:  # moepeak's forward: value the sequence's loss, gradient s_r (x P for "mean")
            loss = outputs.loss if convention == "sum" else with_value(outputs.loss / P, outputs.loss.detach())
        else:
            loss = self._sequence_share_from_outputs(outputs, inputs["shift_labels"], group)
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
        if is_deepspeed_zero3_enabled() and _deepspeed_averages_sequence_gradients():
            loss = with_value(loss * P, loss.detach())
        return (loss, outputs) if return_outputs else loss

    def _sequence_share_from_outputs(self, outputs, shift_labels, group):
        """s_r from a forward that computed its own loss on the rank's tokens (value: the
        sequence's loss, all-reduced)."""
        import torch.distributed as dist
        model = self.accelerator.unwrap_model(self.model)
        config = model.config.get_text_config()
        coef = getattr(config, "router_aux_loss_coef", 0.0)
        aux = getattr(outputs, "aux_loss", None)
        ce_mean = outputs.loss.float()
        if aux is not None and coef:
            ce_mean = ce_mean - coef * aux.float()
        n_local = (shift_labels != -100).sum()
        total = sequence_label_count(shift_labels, group)
        share = torch.where(n_local > 0, ce_mean, torch.zeros_like(ce_mean)) * n_local / total.to(ce_mean.dtype)
        if aux is not None and coef:
            experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts")
            aux_share, _ = sequence_aux_share(outputs.router_logits, experts, config.num_experts_per_tok, group)
            share = share + coef * aux_share
        value = share.detach().clone()
        dist.all_reduce(value, group=group)
        return with_value(share, value)


def _deepspeed_averages_sequence_gradients() -> bool:
    """deepspeed < 0.20.2: ZeRO-3 averages gradients over the sequence group (deepspeedai/DeepSpeed#8854)."""
    import deepspeed
    from packaging import version
    return version.parse(deepspeed.__version__) < version.parse("0.20.2")


__all__ = ["SequenceParallelTrainerMixin"]
