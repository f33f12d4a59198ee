"""moepeak.hf's norms: the Hugging Face RMSNorm modules whose forward moepeak.norms.rms_norm
computes op for op (LEAN_NORMS), and apply_moepeak's patches that route the final norm and
the decoder layers' norms through it (the instance's forward is replaced; module tree and
state_dict keys unchanged)."""
from __future__ import annotations


# RMSNorm classes whose forward (transformers 5.17) is, op for op, moepeak.norms.rms_norm's,
# with its multiply_in_fp32 flag: False: weight * (x.float() * rsqrt(x.float().pow(2).mean(-1) +
# variance_epsilon)).to(x.dtype); True (GptOssRMSNorm): the weight multiplies before the cast.
# (Gemma-style norms use 1 + weight and are not here.)
LEAN_NORMS = {"Qwen3MoeRMSNorm": False, "Qwen2MoeRMSNorm": False, "MixtralRMSNorm": False, "OlmoeRMSNorm": False,
              "DeepseekV3RMSNorm": False, "GptOssRMSNorm": True}


def _norm_chunk(options):
    chunk = options.get("norm_chunk_tokens")  # None: moepeak.norms.default_chunk_rows(H) per norm
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"moepeak.hf: norm_chunk_tokens must be a positive integer, got {chunk!r}")
    return chunk


def _lean_forward(norm, chunk):
    """Replace this instance's forward with moepeak.norms.rms_norm (same forward, bitwise)."""
    from ..norms import rms_norm

    def forward(hidden_states, _norm=norm, _fp32=LEAN_NORMS[type(norm).__name__]):
        return rms_norm(hidden_states, _norm.weight, _norm.variance_epsilon, chunk_tokens=chunk,
                        multiply_in_fp32=_fp32)
    norm.forward = forward


def _is_lean_candidate(norm):
    return type(norm).__name__ in LEAN_NORMS and isinstance(getattr(norm, "variance_epsilon", None), float)


def patch_final_norm(model, options, report):
    base = getattr(model, model.base_model_prefix, None)
    norm = getattr(base, "norm", None)
    kind = type(norm).__name__
    if not _is_lean_candidate(norm):
        report.left_alone.append(f"final norm: {kind} is not in moepeak.hf.LEAN_NORMS; its eager forward and "
                                 "backward run")
        return
    chunk = _norm_chunk(options)
    _lean_forward(norm, chunk)
    report.patched.append(f"final norm: {model.base_model_prefix}.norm ({kind}) runs moepeak.norms.rms_norm "
                          f"(same forward; backward saves x and rstd only, in chunks of "
                          f"{f'{chunk} tokens' if chunk else 'moepeak.norms.default_chunk_rows(H) rows'})")


def patch_layer_norms(model, options, report):
    """The decoder layers' RMSNorms (input / post-attention, per-head q/k norms): what a
    checkpointed layer's recompute saves for backward shrinks from fp32 copies of their
    inputs to the inputs themselves and an fp32 rstd."""
    layers = [m for m in model.modules() if hasattr(m, "input_layernorm") and hasattr(m, "post_attention_layernorm")]
    norms = [m for layer in layers for m in layer.modules() if _is_lean_candidate(m)]
    others = sorted({type(m).__name__ for layer in layers for m in layer.modules()
                     if "RMSNorm" in type(m).__name__ and not _is_lean_candidate(m)})
    if others:
        report.left_alone.append(f"layer norms: {others} not in moepeak.hf.LEAN_NORMS; their eager forward "
                                 "and backward run")
    if not norms:
        return
    chunk = _norm_chunk(options)
    for norm in norms:
        _lean_forward(norm, chunk)
    kinds = sorted({type(m).__name__ for m in norms})
    report.patched.append(f"layer norms: {len(norms)} {'/'.join(kinds)} modules in {len(layers)} decoder layers "
                          f"run moepeak.norms.rms_norm (same forward; the recompute saves x and rstd only)")


__all__ = ["LEAN_NORMS", "patch_final_norm", "patch_layer_norms"]
