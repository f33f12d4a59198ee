"""moepeak_varlen_sdpa: a transformers attention implementation for packed sequences that reads
the documents from position_ids and never builds a [T, T] mask.

    from moepeak.hf import register_varlen_sdpa
    register_varlen_sdpa()                     # once per process, before the model selects it
    model.set_attn_implementation("moepeak_varlen_sdpa")

A document starts where a position is not its predecessor + 1 (transformers' own rule,
masking_utils.find_packed_sequence_indices); causal scaled_dot_product_attention runs on each
document's rows, so no token attends across a document boundary, as the stock "sdpa" path
does with the packed mask transformers builds for it. Under DeepSpeed Ulysses the function is
the core behind the all-to-all: it receives every token of the sequence for its heads and the
position_ids gathered at full length, so the documents are the whole sequence's (the stock
"sdpa" core loses them there: Ulysses drops the mask and runs plain causal attention).

No mask function is registered for it, so transformers builds none; a padding mask is not
read (pack instead of padding). One host read per call (the document boundaries).

patch_attention_backend(model, choice, report): apply_moepeak's attention_backend for the
layers it does not tile: each decoder layer's self_attn runs, in training with grad (its
forward and its checkpoint recompute), under moepeak.tiled.attention_backend_context, so the
SDPA calls of its attention function ("sdpa", VARLEN_SDPA, Ulysses' core) take that backend
order ("auto": none when the layer passes a mask, see moepeak/tiled/attention.py); other
attention functions (eager, flash_attention_2, flex) make no SDPA call and are unaffected.
Eval and no_grad (generation) keep torch's own choice. Exact as the tiled core's: the backends
compute the same attention (moepeak/tiled/attention.py).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F

from ..tiled import attention_backend_context, attention_dtype, check_attention_backend, describe_attention_backend

VARLEN_SDPA = "moepeak_varlen_sdpa"


def document_spans(position_ids: torch.Tensor, T: int) -> List[List[Tuple[int, int]]]:
    """[(start, end)] of each document, per row of position_ids [B or 1, T]."""
    starts = torch.diff(position_ids.reshape(-1, T), dim=-1) != 1  # [rows, T - 1]: a document starts at t + 1
    spans = []
    for row in starts:
        cuts = [0] + (torch.nonzero(row).flatten() + 1).tolist() + [T]
        spans.append(list(zip(cuts[:-1], cuts[1:])))
    return spans


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None,
                          is_causal=None, sliding_window=None, **kwargs):
    """transformers' attention interface: query [B, hq, T, d], key/value [B, hkv, T, d]
    (hq a multiple of hkv) -> (out [B, T, hq, d], None). Causal within each document of
    position_ids [B or 1, T]; without position_ids the T tokens are one document."""
    if attention_mask is not None:
        raise ValueError(f"moepeak: {VARLEN_SDPA} reads the documents from position_ids and takes no attention_mask "
                         f"(got a {type(attention_mask).__name__}); pack the documents instead of padding them")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError(f"moepeak: {VARLEN_SDPA} is causal attention; this module asks for non-causal attention")
    if sliding_window is not None:
        raise ValueError(f"moepeak: {VARLEN_SDPA} has no sliding window (got sliding_window={sliding_window})")
    B, T = query.shape[0], query.shape[2]
    if position_ids is None:
        spans = [[(0, T)]] * B
    else:
        if position_ids.shape[-1] != T or position_ids.numel() not in (T, B * T):
            raise ValueError(f"moepeak: {VARLEN_SDPA} needs position_ids [B or 1, {T}] for {T} query tokens, got "
                             f"{tuple(position_ids.shape)}")
        spans = document_spans(position_ids, T)
        spans = spans * B if len(spans) == 1 else spans
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for b, row_spans in enumerate(spans):
        q, k, v = query[b:b + 1], key[b:b + 1], value[b:b + 1]
        parts = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], dropout_p=dropout,
                                                is_causal=True, scale=scaling, enable_gqa=gqa)
                 for s, e in row_spans]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if B == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def register_varlen_sdpa() -> None:
    """Registers VARLEN_SDPA in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)


def patch_attention_backend(model, choice, report) -> None:
    """Every decoder layer's self_attn (a module at .self_attn) runs under choice's SDPA backend
    order in training with grad (the module docstring); choice None / "torch": nothing changes."""
    choice = check_attention_backend(choice)
    attns = [m.self_attn for m in model.modules() if isinstance(getattr(m, "self_attn", None), torch.nn.Module)]
    if choice == "torch" or not attns:
        report.left_alone.append("attention_backend: " + (describe_attention_backend(choice) if attns else
                                                          "no decoder layer with a self_attn module"))
        return
    for attn in attns:
        own = attn.forward

        def forward(*args, _attn=attn, _own=own, **kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if not (_attn.training and torch.is_grad_enabled() and isinstance(hidden, torch.Tensor)):
                return _own(*args, **kwargs)
            masked = kwargs.get("attention_mask") is not None
            with attention_backend_context(choice, hidden.device, attention_dtype(hidden), masked=masked):
                return _own(*args, **kwargs)
        attn.forward = forward
    report.patched.append(f"attention_backend: {len(attns)} self_attn modules in training, and the tiled layers' "
                          f"attention core where tile_tokens is set: {describe_attention_backend(choice)}")


__all__ = ["VARLEN_SDPA", "varlen_sdpa_attention", "register_varlen_sdpa", "document_spans",
           "patch_attention_backend"]
