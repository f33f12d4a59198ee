"""apply_moepeak: moepeak's schedules into a transformers model instance, in place (the
contract is moepeak.hf's docstring). Checks the transformers version and the options,
then patches each part (experts.py, loss.py, checkpoint.py, norms.py, tiled.py) and
returns what it did (report.py's MoepeakReport).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..llep import LLEPOptions
from ..tiled import DEFAULT_ATTENTION_BACKEND, check_attention_backend
from ..tiled.sizes import FREE
from .attention import patch_attention_backend
from .autoplace import PLACEMENT_OPTIONS, install as install_placement
from .checkpoint import patch_checkpoint
from .experts import patch_experts
from .loss import LOSS_OPTIONS, patch_loss
from .norms import patch_final_norm, patch_layer_norms
from .report import MoepeakReport
from .sequence import AUTO_HEAD_GROUPS, SequenceOptions, install_batch_check
from .tiled import patch_tiled_layers

TESTED_TRANSFORMERS = ((5, 17), (6, 0))  # [lowest, first untested major)

# Options apply_moepeak accepts (**options) and where each goes (LOSS_OPTIONS: moepeak/hf/loss.py).
EXPERTS_OPTIONS = LLEPOptions.names()  # llep_moe's schedule options (moepeak/llep/options.py)
NORM_OPTIONS = ("norm_chunk_tokens",)
CHECKPOINT_OPTIONS = ("sco_config",)


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("moepeak.hf needs transformers: pip install 'moepeak[hf]'") from e
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    lo, hi = TESTED_TRANSFORMERS
    if not lo <= version < hi:
        raise ImportError(f"moepeak.hf supports transformers >= {lo[0]}.{lo[1]}, < {hi[0]} "
                          f"(found {transformers.__version__})")
    return transformers


def apply_moepeak(model, *, experts: bool = True, loss: bool = True, checkpoint: bool = True, group=None,
                  tile_tokens: Optional[int] = None, lean_norm: bool = True, sequence_group=None,
                  sequence_loss: str = "mean", attention_head_groups: Optional[int] = None,
                  attention_backend: Optional[str] = DEFAULT_ATTENTION_BACKEND, **options) -> MoepeakReport:
    """Put moepeak's schedules into a transformers model instance (in place);
    returns a MoepeakReport. See moepeak.hf's docstring for what each part does.

    group: a torch.distributed process group for expert parallelism (every
    rank calls apply_moepeak and every forward/backward together). Each rank
    runs its own batch; the gradients are those of the mean of the ranks'
    losses once the replicated parameters' are averaged: wrap the model in
    DistributedDataParallel(model, process_group=group) (it leaves the expert
    slices alone), or call average_gradients(model) after backward; clip with
    clip_grad_norm_(model, max_norm) (moepeak/hf/expert_parallel.py).
    options: for the experts, llep_moe's chunk_rows, alpha,
    min_tokens_per_gemm, imbalance_threshold, save_budget_mb, grouped_mm
    (moepeak.llep.LLEPOptions' fields); for the loss,
    ce_mode, ce_chunk_tokens, ce_chunk_vocab, ce_ring (linear_cross_entropy's mode,
    chunk_tokens, chunk_vocab, and ring for a vocab-sharded head); for the lean final norm, norm_chunk_tokens
    (moepeak.norms.rms_norm's chunk_tokens); for checkpointing, sco_config (a
    moepeak.SCOConfig); for the automatic placement (moepeak/hf/autoplace.py: SCO's keep_last
    and arena, tiles, from the GPU's free memory and the host's RAM at each longer step),
    auto_placement (False: off), gpu_budget_gib and host_budget_gib (instead of the measured).
    lean_norm: with loss, the final norm runs moepeak.norms.rms_norm; with checkpoint, the decoder
    layers' norms too (see moepeak.hf's docstring).
    tile_tokens: sequence-tiled decoder layers (see moepeak.hf's docstring; None: off).
    sequence_group: sequence parallelism from an existing engine (moepeak/hf/sequence.py): the
    ranks that each hold a shard of one sequence (a ProcessGroup), or "engine" (DeepSpeed's
    sequence-parallel group, read at each forward). group may be the same ranks (experts split
    over the sequence's ranks) or any other group.
    sequence_loss: "mean" (DDP, FSDP2, average_gradients: gradients averaged over the ranks) or
    "sum" (a DeepSpeed engine: summed over the sequence group); see SequenceOptions.
    attention_head_groups: the tiled layers' attention head groups (None: 1 when the attention
    function exchanges heads across ranks, DeepSpeed Ulysses, else num_key_value_heads; an integer
    forces a count; "auto", without sequence_group: the fewest groups, dividing num_key_value_heads,
    whose full-length set fits half the GPU memory free at each layer's forward).
    attention_backend: the SDPA backends the attention runs on in training, tiled or not
    (moepeak.tiled.ATTENTION_BACKENDS: "auto" = cuDNN first on Hopper for unmasked fp16/bf16, "cudnn",
    "flash", "efficient", "math" = that one only; "torch" or None, the default: torch's own choice)."""
    transformers = _transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"moepeak.hf: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if getattr(model, "_moepeak_hf", None) is not None:
        raise RuntimeError(f"moepeak.hf: apply_moepeak was already applied to this {type(model).__name__} "
                           "instance; apply it once, to a fresh model")
    known = EXPERTS_OPTIONS + tuple(LOSS_OPTIONS) + NORM_OPTIONS + CHECKPOINT_OPTIONS + PLACEMENT_OPTIONS
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"moepeak.hf: unknown option(s) {unknown}; expected some of {list(known)}")
    sequence = SequenceOptions(sequence_group, sequence_loss, attention_head_groups)
    check_attention_backend(attention_backend, "attention_backend")
    _check_head_groups(model.config, attention_head_groups, tile_tokens)
    report = MoepeakReport(type(model).__name__)
    if tile_tokens is not None:  # checked first: it may refuse the model's config
        # "auto": the tiled block picks the head groups from the free memory (SequenceOptions refused
        # it with a sequence group, whose ranks must make the same attention calls)
        auto_groups = attention_head_groups == AUTO_HEAD_GROUPS
        patch_tiled_layers(model, tile_tokens, report, head_groups=None if auto_groups else attention_head_groups,
                           head_group_budget=FREE if auto_groups else None, attention_backend=attention_backend)
    patch_attention_backend(model, attention_backend, report)
    if experts:
        patch_experts(model, group, {k: v for k, v in options.items() if k in EXPERTS_OPTIONS}, report)
    else:
        report.left_alone.append("experts: turned off (experts=False)")
        if group is not None:
            raise ValueError("moepeak.hf: group (expert parallelism) needs experts=True")
    loss_patched = loss and patch_loss(model, {k: v for k, v in options.items() if k in LOSS_OPTIONS}, report,
                                       sequence if sequence_group is not None else None)
    if sequence_group is not None:
        _patch_sequence(model, sequence, loss_patched, report)
    if loss:
        if lean_norm:
            patch_final_norm(model, options, report)
        else:
            report.left_alone.append("final norm: turned off (lean_norm=False)")
    else:
        report.left_alone.append("loss: turned off (loss=False)")
    if checkpoint:
        patch_checkpoint(model, options, report)
        if lean_norm:
            patch_layer_norms(model, options, report)
    else:
        report.left_alone.append("checkpoint: turned off (checkpoint=False)")
    # each training step placed on the GPU, host RAM (moepeak/hf/autoplace.py): explicit settings win
    install_placement(model, report, options=options, sco_config=options.get("sco_config"), tile_tokens=tile_tokens,
                      group=group, sequence=sequence if sequence_group is not None else None,
                      checkpoint=checkpoint and report.sco is not None)
    model._moepeak_hf = report
    return report


def _check_head_groups(config, head_groups, tile_tokens) -> None:
    if head_groups is None:
        return
    if tile_tokens is None:
        raise ValueError("moepeak.hf: attention_head_groups sets the tiled layers' head groups; it needs tile_tokens")
    if head_groups == AUTO_HEAD_GROUPS:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = (getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None))
    if any(h is not None and h % head_groups for h in heads):
        raise ValueError(f"moepeak.hf: attention_head_groups ({head_groups}) must divide num_attention_heads and "
                         f"num_key_value_heads {heads}")


def _patch_sequence(model, sequence: SequenceOptions, loss_patched: bool, report) -> None:
    """Sequence parallelism's parts outside the tiled layers: the batch check (in the replaced
    forward when the loss is patched, else before the base model's forward)."""
    if not loss_patched:
        install_batch_check(model, sequence)
        report.left_alone.append("sequence_group: the loss is not moepeak's (loss=False or its family's forward is "
                                 "not replaced): the model's own loss is that of the rank's tokens, not its share "
                                 "of the sequence's (see moepeak/hf/sequence.py)")
    what = "the engine's sequence-parallel group" if sequence.group == "engine" else \
        f"{torch.distributed.get_world_size(sequence.group)} ranks"
    report.patched.append(f"sequence_group: each rank holds a shard of one sequence ({what}); the batch is checked "
                          f"with the group, the loss is the rank's share (sequence_loss={sequence.loss!r})")
    report.sequence = sequence
