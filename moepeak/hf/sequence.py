"""Sequence parallelism from an existing engine (apply_moepeak(..., sequence_group=...)).

The seam every engine shares: each rank of the sequence group holds S = T/P tokens of the
same sequence (position_ids and pre-shifted shift_labels sharded with them, position_ids at
their global values), and only the attention function reaches across ranks. DeepSpeed
Ulysses (UlyssesSPAttentionHF) replaces the attention function by one that all-to-alls
sequence <-> heads around the real core; torch's context_parallel (accelerate's cp_size)
turns scaled_dot_product_attention into ring attention. Everything position-wise (norms,
projections, RoPE at global positions, router, experts, residuals, the tiles, SCO, the
expert exchange) runs on the local shard and is exact as it is. Four things must know the
sequence is split, and this module holds what they share:

- the tiled layer's call into the attention function (moepeak/hf/tiled.py): one head group
  when the function crosses ranks by heads (Ulysses checks it receives every head), the
  attention's keyword forward pre-hooks (accelerate's context-parallel hook) applied;
- the loss (moepeak/hf/loss.py): the rank's share of the sequence's loss, s_r = CE_sum_r / N
  + coef * A_r, N the sequence's label count (all ranks), A_r the rank's share of the router
  aux loss (sequence_aux_share). Summed over the ranks it is the one-process loss, value and
  gradient (docs/design.md section 3 has the argument);
- the gradient convention (SequenceOptions.loss): "mean" (DDP, FSDP2: gradients averaged over
  the ranks) backpropagates P * s_r, "sum" (a DeepSpeed engine: gradients summed over the
  sequence group) backpropagates s_r. Either way the loss value every rank returns is the
  sequence's loss;
- the batch (check_sequence_batch): position_ids present and alike in shape on every rank, no
  padding mask, and packed documents only where the core reads them from position_ids at
  full length (moepeak_varlen_sdpa or flash attention under Ulysses); refused alike on every
  rank otherwise, before any attention runs.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

# sequence_group="engine": the engine's own sequence-parallel group, read at each forward.
ENGINE = "engine"
SEQUENCE_LOSSES = ("mean", "sum")
# Attention functions that reach across ranks by heads (every head in one call), by module.
HEADS_CROSSING_MODULES = ("deepspeed.runtime.sequence_parallel",)
# The attention implementations that read document boundaries from position_ids themselves
# (beside moepeak's VARLEN_SDPA): transformers' flash attention and the hub's flash kernels.
DOCUMENT_AWARE_MARK = "flash"
AUTO_HEAD_GROUPS = "auto"  # attention_head_groups: the fewest whose full-length set fits the free GPU memory


@dataclasses.dataclass(frozen=True)
class SequenceOptions:
    """apply_moepeak's sequence-parallel options: the one home of their defaults and checks.

    group        None (no sequence parallelism), a torch.distributed ProcessGroup (the ranks
                 holding one sequence), or "engine": the engine's sequence-parallel group, read
                 at each forward (DeepSpeed's, once accelerate or the user has set it up; none
                 while the engine runs no sequence parallelism).
    loss         "mean": a rank backpropagates P * s_r, for engines that average gradients
                 over the ranks (DistributedDataParallel, FSDP2, average_gradients); "sum":
                 s_r, for engines that sum them over the sequence group (a DeepSpeed engine,
                 the Trainer with DeepSpeed sequence parallelism).
    head_groups  the tiled layer's attention head groups: None picks (1 when the attention
                 function crosses ranks by heads, else num_key_value_heads); an integer that
                 divides num_attention_heads and num_key_value_heads forces it; AUTO_HEAD_GROUPS
                 ("auto", without a sequence group only: every rank of one must make the same
                 calls) runs the fewest groups whose full-length set fits half the GPU memory
                 free at each layer's forward."""

    group: object = None
    loss: str = "mean"
    head_groups: Optional[int] = None

    def __post_init__(self):
        if self.group is not None and self.group != ENGINE and not _is_process_group(self.group):
            raise TypeError(f"moepeak.hf: sequence_group must be None, {ENGINE!r} or a torch.distributed "
                            f"ProcessGroup, got {type(self.group).__name__}")
        if self.loss not in SEQUENCE_LOSSES:
            raise ValueError(f"moepeak.hf: sequence_loss must be one of {SEQUENCE_LOSSES}, got {self.loss!r}")
        if self.group is None and self.loss != "mean":
            raise ValueError(f"moepeak.hf: sequence_loss={self.loss!r} needs sequence_group")
        hg = self.head_groups
        if hg == AUTO_HEAD_GROUPS:
            if self.group is not None:
                raise ValueError(f"moepeak.hf: attention_head_groups={AUTO_HEAD_GROUPS!r} measures free memory per "
                                 "rank, but every rank of sequence_group must make the same attention calls: give "
                                 "an integer or None")
        elif hg is not None and (isinstance(hg, bool) or not isinstance(hg, int) or hg < 1):
            raise ValueError(f"moepeak.hf: attention_head_groups must be a positive integer, {AUTO_HEAD_GROUPS!r} "
                             f"or None, got {hg!r}")

    def resolve_group(self):
        """The sequence group of this forward: None (no sequence parallelism, also for
        "engine" while the engine runs none) or a ProcessGroup of 2 ranks or more."""
        group = engine_sequence_group() if self.group == ENGINE else self.group
        if group is None or torch.distributed.get_world_size(group) < 2:
            return None
        return group

    def loss_scale(self, group) -> int:
        """What the rank's share is multiplied by before backward (the convention above)."""
        return torch.distributed.get_world_size(group) if self.loss == "mean" else 1


def _is_process_group(group) -> bool:
    import torch.distributed as dist
    return dist.is_available() and isinstance(group, dist.ProcessGroup)


def engine_sequence_group():
    """DeepSpeed's sequence-parallel group when DeepSpeed is imported and its sequence
    parallelism is set up (UlyssesSPAttentionHF.register_with_transformers, or accelerate's
    ParallelismConfig(sp_backend="deepspeed")), else None."""
    import sys
    state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if state is None:
        return None
    try:
        return state.get_sequence_parallel_group()
    except AssertionError:  # DeepSpeed's way of saying it is not initialised
        return None


def crosses_heads(interface) -> bool:
    """True when the attention function reaches across ranks by heads and so needs every head
    of the layer in one call (DeepSpeed Ulysses' wrapper)."""
    module = getattr(interface, "__module__", None) or ""
    return module.startswith(HEADS_CROSSING_MODULES)


def reads_documents(implementation: str) -> bool:
    """True when the attention implementation separates packed documents by position_ids."""
    from .attention import VARLEN_SDPA
    return implementation == VARLEN_SDPA or DOCUMENT_AWARE_MARK in implementation


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    """[P, *t.shape]: t of every rank of the group, in rank order (same shape on every rank)."""
    import torch.distributed as dist
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


def packed_documents(positions: torch.Tensor, in_rank_order: bool) -> bool:
    """True when the gathered positions [B, T] hold more than one document per row.
    in_rank_order: the ranks' shards put together in rank order are the sequence (Ulysses), so
    transformers' rule applies (a document starts where a position is not its predecessor + 1);
    otherwise (torch's context parallelism may permute chunks, e.g. head-tail) one document is
    a row whose sorted positions are consecutive."""
    row = positions if in_rank_order else positions.sort(dim=-1).values
    return bool((torch.diff(row, dim=-1) != 1).any())


def check_sequence_batch(position_ids, attention_mask, device, group, implementation: str,
                         gathers_sequence: bool, refusal: Optional[str] = None) -> None:
    """The batch of this rank's shard, checked together with every rank of the group (two
    collectives); a refusal raises a ValueError on every rank, before any attention (a rank
    refusing alone would leave the others waiting in the next collective).
    position_ids [B, S] (global positions) required, the same shape on every rank; a 2D
    attention_mask with a zero (padding) is refused (sequence-parallel batches are padding
    free); packed documents need a core that reads them from position_ids and an engine that
    hands it the whole sequence (gathers_sequence: Ulysses). refusal: this rank's own reason
    to refuse the call (None: none), raised here on every rank."""
    if position_ids is not None:
        shape = list(position_ids.shape) + [1] * max(0, 2 - position_ids.dim())
    else:
        shape = [0, 0]
    padded = attention_mask is not None and torch.is_tensor(attention_mask) and attention_mask.dim() == 2 \
        and bool((attention_mask == 0).any())
    header = torch.tensor(shape[:2] + [position_ids is not None, padded, refusal is not None], dtype=torch.int64,
                          device=device)
    headers = _gather(header, group).tolist()
    P = len(headers)
    refusing = [r for r, h in enumerate(headers) if h[4]]
    if refusal is not None:
        raise ValueError(f"moepeak.hf: {refusal}")
    if refusing:
        raise ValueError(f"moepeak.hf: rank(s) {refusing} of the sequence group refused this call (their error says "
                         "why); every rank raises")
    if any(not h[2] for h in headers):
        raise ValueError("moepeak.hf: under sequence_group every rank must pass position_ids [B, S] (the global "
                         "positions of its shard, as DeepSpeed's UlyssesSPDataLoaderAdapter and accelerate's "
                         f"context parallelism provide them); rank(s) {[r for r, h in enumerate(headers) if not h[2]]} "
                         "passed none")
    if any(h[:2] != headers[0][:2] for h in headers):
        raise ValueError(f"moepeak.hf: under sequence_group every rank's shard must have the same shape [B, S]; got "
                         f"{[tuple(h[:2]) for h in headers]} over the {P} ranks")
    if any(h[3] for h in headers):
        raise ValueError("moepeak.hf: under sequence_group a padding attention_mask (a 2D mask with zeros) is not "
                         "supported: sequence-parallel batches are padding-free (pack the documents and mark them "
                         "by position_ids)")
    positions = _gather(position_ids.reshape(shape[:2]).to(torch.int64), group)  # [P, B, S]
    positions = positions.permute(1, 0, 2).reshape(shape[0], P * shape[1])
    if not packed_documents(positions, in_rank_order=gathers_sequence):
        return
    if not reads_documents(implementation):
        raise ValueError(f"moepeak.hf: the batch packs several documents (position_ids restart) and the attention "
                         f"implementation {implementation!r} ignores them under sequence parallelism (DeepSpeed "
                         "Ulysses drops the mask, torch's context parallelism runs plain causal attention), so tokens "
                         "would attend across documents; use model.set_attn_implementation(\"moepeak_varlen_sdpa\") "
                         "(moepeak.hf.attention) or flash_attention_2/3, or do not pack")
    if not gathers_sequence:
        raise ValueError(f"moepeak.hf: the batch packs several documents and the attention function of "
                         f"{implementation!r} does not see the whole sequence (no engine that gathers it, such as "
                         "DeepSpeed Ulysses, is registered for it); packed documents under sequence parallelism need "
                         "one (torch's context parallelism does not support them)")


def check_model_batch(model, position_ids, attention_mask, group, refusal: Optional[str] = None) -> None:
    """check_sequence_batch for a transformers model's forward: its attention implementation,
    and whether the function registered under that name hands the core the whole sequence."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    implementation = model.config._attn_implementation
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, None)
    device = position_ids.device if torch.is_tensor(position_ids) else next(model.parameters()).device
    if device.type == "cpu" and torch.distributed.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    check_sequence_batch(position_ids, attention_mask, device, group, implementation, crosses_heads(interface),
                         refusal)


def install_batch_check(model, options: SequenceOptions) -> None:
    """For a model whose forward apply_moepeak does not replace (loss=False, or a family outside
    LOSS_FAMILIES): check_model_batch runs before the base model's forward in training."""
    base = getattr(model, model.base_model_prefix, model)

    def check(module, args, kwargs):
        group = options.resolve_group() if module.training else None
        if group is not None:
            check_model_batch(model, kwargs.get("position_ids"), kwargs.get("attention_mask"), group)

    base.register_forward_pre_hook(check, with_kwargs=True)


def sequence_label_count(shift_labels: torch.Tensor, group, ignore_index: int = -100) -> torch.Tensor:
    """The number of labels that are not ignore_index over every rank of the group ([] fp64)."""
    import torch.distributed as dist
    n = (shift_labels != ignore_index).sum().to(torch.float64)
    if group is not None:
        dist.all_reduce(n, group=group)
    return n


def router_statistics(router_logits, num_experts: int, top_k: int):
    """(top-k counts [E], routing-probability sums [E] with their gradient, rows []) over
    the layers' router logits (each [rows, E]), as transformers' load_balancing_loss_func
    forms them without an attention mask: softmax in the logits' dtype, top-k of it, the
    probabilities summed in fp32."""
    logits = list(router_logits)
    device = logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = 0
    for layer_logits in logits:
        p = torch.softmax(layer_logits.to(device), dim=-1)
        _, chosen = torch.topk(p, top_k, dim=-1)
        counts = counts.scatter_add(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=device))
        probs = probs + p.float().sum(dim=0)
        rows += p.shape[0]
    return counts, probs, rows


def sequence_aux_share(router_logits, num_experts: int, top_k: int, group):
    """(A_r, aux): this rank's share of transformers' router aux loss (load_balancing_loss_func
    without an attention mask) over the whole sequence, and that loss's value (detached).

    The loss is E * sum_e (count_e / rows) * (prob_e / rows) over all ranks' rows: a product of
    two sums over tokens, not a sum of per-rank terms. The counts carry no gradient, so with
    the counts and rows all-reduced (one collective) A_r = E * sum_e (count_e / rows) *
    (prob_r,e / rows) sums over the ranks to the loss, in value and gradient. group None: the
    one-process loss itself."""
    import torch.distributed as dist
    counts, probs, rows = router_statistics(router_logits, num_experts, top_k)
    stats = torch.cat([counts.to(torch.float64), probs.detach().to(torch.float64),
                       torch.tensor([rows], dtype=torch.float64, device=counts.device)])
    if group is not None:
        dist.all_reduce(stats, group=group)
    E = num_experts
    all_counts, all_probs, all_rows = stats[:E], stats[E:2 * E], stats[2 * E]
    per_expert = (all_counts / all_rows).to(torch.float32)
    share = E * (per_expert * (probs / all_rows.to(torch.float32))).sum()
    aux = (E * (all_counts / all_rows * (all_probs / all_rows)).sum()).to(torch.float32)
    return share, aux


def with_value(grad_source: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A tensor whose value is `value` and whose gradient is that of grad_source."""
    return grad_source + (value.to(grad_source.dtype) - grad_source.detach())


__all__ = ["SequenceOptions", "ENGINE", "SEQUENCE_LOSSES", "engine_sequence_group", "crosses_heads",
           "reads_documents", "packed_documents", "check_sequence_batch", "check_model_batch",
           "install_batch_check", "sequence_label_count",
           "router_statistics", "sequence_aux_share", "with_value"]
