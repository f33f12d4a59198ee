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
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F

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


__all__ = ["VARLEN_SDPA", "varlen_sdpa_attention", "register_varlen_sdpa", "document_spans"]
