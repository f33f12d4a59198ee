"""Packed-sequence training step of a Hugging Face Qwen3-MoE at >= 128k tokens: stock
transformers vs moepeak.hf.apply_moepeak(model, tile_tokens=8192), each against an fp32
reference of the same weights and documents; errors per parameter group, the ratio
moepeak/stock, peak memory and step time.

Input: one row of T tokens holding several documents of random lengths (uniform in
[T/32, T/6], the last cut to fill T), position_ids restarting at 0 per document, labels
= input_ids with the first token of each document ignored (-100), as TRL's padding-free
collator builds them. With attn_implementation="flex_attention" transformers turns the
packed position_ids into a document-causal BlockMask (masking_utils.
find_packed_sequence_indices, taken when attention_mask is None and there is no cache);
the script records the mask each arm's attention receives and checks it is document-
causal (block structure, and mask_mod on every pair near a boundary plus 100k random
pairs; on the CPU smoke run every pair): column mask_ok.

Model: the 2.0B demo shape of bench_hf.py (H 2048, 16/4 heads of 128, 16 experts top-4,
moe_intermediate 768, V 151936) with --layers decoder layers (default 4; 0.97B params),
random init, one set of bf16 weights shared by all arms.
  stock    bf16 params, flex attention, gradient_checkpointing_enable() (torch checkpoint),
           transformers' experts (grouped_mm), and transformers' ForCausalLMLoss on the
           lm_head logits of --loss-chunk tokens at a time, each chunk under torch checkpoint
           (the full [T, V] logits of 128k tokens would take ~200 GB with their fp32 copies).
  moepeak  bf16 params, flex attention, apply_moepeak(model, tile_tokens=--tile-tokens):
           sequence-tiled layers, llep_moe experts, SCO checkpointing, the loss without
           logits (Ring-DTP).
  fp32_ref the same weights in fp32, each document on its own (unpacked, positions 0..n-1,
           causal SDPA, torch checkpoint, the same chunked loss), gradients accumulated over
           the documents with the packed row's normalisation: exactly the packed step's
           math (documents do not interact under a document-causal mask, routing is per
           token, no aux loss), without relying on the packed-mask machinery at all.
A step is forward + backward from zero grads (no optimizer): --warmup untimed steps (flex
attention compiles in the first; none for fp32_ref, whose time is not a result), then one
timed step whose loss and gradients are compared. peak_gib = torch.cuda.max_memory_allocated
during the timed step (weights and grads included); step_s = its wall time (synchronized).
Errors: norm-wise relative error
(fp64) of the concatenated gradients of each group (embed, attention: q/k/v/o_proj,
router: mlp.gate, experts, norms: every RMSNorm weight, lm_head), and of the loss; the row
"moepeak/stock" holds moepeak's error / stock's for each. An OOM is a result, and so is
another error (status "error", the message in note, the traceback on stderr).

One H200 (transformers 5.17, torch 2.11), whole script < 4 min, progress on stdout:
  python benchmarks/bench_packed.py --out $OUT
  python benchmarks/bench_packed.py --out $OUT --T 262144 --layers 2
CPU smoke run (tests/test_bench_packed.py): python benchmarks/bench_packed.py --smoke --out /tmp/p
  (tiny config, T = 384; flex attention has no backward on CPU, so the steps use SDPA with
  the same packed-sequence mask and a separate no-grad flex forward checks the BlockMask;
  --dtypes bfloat16,float32 also runs both arms in fp32, equal to the reference up to
  rounding.)
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import traceback

import torch
from torch.utils.checkpoint import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's moepeak
sys.path.insert(0, HERE)
from _common import append_results, is_oom  # noqa: E402

GROUPS = ("embed", "attention", "router", "experts", "norms", "lm_head")
FIELDS = ["transformers", "arm", "dtype", "T", "docs", "layers", "tile_tokens", "attn", "status", "peak_gib",
          "step_s", "loss", "loss_err"] + [f"err_{g}" for g in GROUPS] + ["mask_ok", "note"]
# Qwen3-MoE 2.0B demo shape (bench_hf.FULL) less its layer count; TINY: the CPU smoke shape.
FULL = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=16, num_experts_per_tok=4)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)
START = time.time()


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def progress(msg):
    print(f"[{time.time() - START:6.1f} s] {msg}", flush=True)


def group_of(name: str) -> str:
    """The parameter group of a Qwen3-MoE parameter name (an unknown name is an error)."""
    if name == "model.embed_tokens.weight":
        return "embed"
    if name == "lm_head.weight":
        return "lm_head"
    if name.endswith("norm.weight"):  # input_/post_attention_layernorm, q_norm, k_norm, model.norm
        return "norms"
    if ".self_attn." in name and name.endswith("_proj.weight"):
        return "attention"
    if name.endswith("mlp.gate.weight"):
        return "router"
    if ".mlp.experts." in name:
        return "experts"
    raise ValueError(f"bench_packed: no group for parameter {name}")


# --------------------------------------------------------------------------- inputs
def document_lengths(T: int, seed: int):
    """Random lengths, uniform in [T/32, T/6] (at least 2), summing to T."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(2, T // 32), max(3, T // 6)
    lengths = []
    while sum(lengths) < T:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - T
    if lengths[-1] < 2:  # a one-token document has no label: fold it into the previous one
        lengths[-2] += lengths.pop()
    return lengths


def packed_inputs(lengths, vocab, seed, device):
    """input_ids, position_ids, labels: [1, T] each, documents back to back."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[pos == 0] = -100  # no document predicts the next one's first token
    return ids.to(device), pos.to(device), labels.to(device)


# --------------------------------------------------------------------------- the mask check
class MaskSpy:
    """Wraps the registered attention function `name` and keeps the attention_mask of its
    first call while armed (the layer-0 mask of the step: transformers builds one mask per
    forward and every layer gets it)."""

    def __init__(self, name):
        import transformers
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        self.original, self.mask, self.armed = ALL_ATTENTION_FUNCTIONS[name], None, False

        def spy(module, query, key, value, attention_mask=None, **kwargs):
            if self.armed and self.mask is None:
                self.mask = attention_mask
            return self.original(module, query, key, value, attention_mask, **kwargs)

        transformers.AttentionInterface.register(name, spy)

    def take(self):
        mask, self.mask, self.armed = self.mask, None, False
        return mask


def expected_mask(q, kv, doc_of):
    return (kv <= q) & (doc_of[q] == doc_of[kv])


def check_document_causal(mask, lengths, every_pair: bool):
    """(ok, detail): `mask` (a flex BlockMask or a [1, 1, T, T] boolean mask) allows exactly
    the pairs kv <= q within one document."""
    from torch.nn.attention.flex_attention import BlockMask
    if mask is None:
        return False, "no mask reached attention (full causal: documents attend across boundaries)"
    device = mask.kv_num_blocks.device if isinstance(mask, BlockMask) else mask.device
    T = sum(lengths)
    doc_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    if every_pair:
        q, kv = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
    else:  # pairs around every boundary + random pairs
        starts = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)[:-1]), device=device)
        near = (starts[:, None] + torch.arange(-64, 64, device=device)[None, :]).flatten().clamp(0, T - 1)
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.cat([near.repeat_interleave(near.numel()), torch.randint(0, T, (100_000,), generator=g).to(device)])
        kv = torch.cat([near.repeat(near.numel()), torch.randint(0, T, (100_000,), generator=g).to(device)])
    want = expected_mask(q, kv, doc_of)
    if isinstance(mask, BlockMask):
        zero = torch.zeros((), dtype=torch.long, device=device)
        got = mask.mask_mod(zero, zero, q, kv).bool()
        if not torch.equal(got, want):
            return False, f"BlockMask.mask_mod: {(got != want).sum().item()} of {want.numel()} pairs differ"
        bq, bk = mask.BLOCK_SIZE
        blocks = mask.to_dense()[0, 0].bool()  # [q blocks, kv blocks]: any allowed pair in the block
        nq, nk = blocks.shape
        first = doc_of[torch.arange(nq, device=device) * bq]
        last = doc_of[(torch.arange(nq, device=device) * bq + bq - 1).clamp(max=T - 1)]
        i, j = torch.arange(nq, device=device)[:, None], torch.arange(nk, device=device)[None, :]
        block_want = (j * bk <= i * bq + bq - 1) & (first[j] <= last[i]) & (first[i] <= last[j])
        if not torch.equal(blocks, block_want):
            return False, f"BlockMask blocks: {(blocks != block_want).sum().item()} of {nq * nk} differ"
        return True, f"BlockMask {nq}x{nk} blocks"
    dense = mask[0, 0].bool() if mask.dtype == torch.bool else mask[0, 0] == 0  # additive float: 0 allowed
    got = dense[q, kv]
    if not torch.equal(got, want):
        return False, f"dense mask: {(got != want).sum().item()} of {want.numel()} pairs differ"
    return True, f"dense {tuple(mask.shape)} mask"


# --------------------------------------------------------------------------- models and steps
def build_model(shape, layers, dtype, device, attn, weights=None):
    """Qwen3MoeForCausalLM in `dtype` with `weights` (a state dict) loaded, else seeded
    random init with random routers (transformers initialises them to zero)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**shape, num_hidden_layers=layers, max_position_embeddings=1 << 20,
                         tie_word_embeddings=False, use_cache=False, attn_implementation=attn)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        if weights is None:
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0, cfg.initializer_range)
        else:
            model.load_state_dict(weights)
    model.train()
    return model


def chunked_lm_loss(model, hidden, labels, n_items, chunk):
    """transformers' ForCausalLMLoss (sum / num_items_in_batch) over token chunks of the
    lm_head logits, each chunk under torch checkpoint. hidden [N, H]; labels [N], already
    shifted (hidden[i] predicts labels[i])."""
    def chunk_loss(h, y):
        return model.loss_function(logits=model.lm_head(h), labels=None, shift_labels=y,
                                   vocab_size=model.config.vocab_size, num_items_in_batch=n_items)
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(chunk_loss, hidden[s:s + chunk], labels[s:s + chunk], use_reentrant=False)
    return total


def stock_step(model, ids, pos, labels, chunk):
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    y = labels[0, 1:]
    loss = chunked_lm_loss(model, hidden[0, :-1], y, (y != -100).sum(), chunk)
    loss.backward()
    return loss.detach()


def moepeak_step(model, ids, pos, labels, chunk):
    loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach()


def reference_step(model, ids, labels, lengths, chunk):
    """Each document alone (positions 0..n-1, causal), fp32; the loss normalised by the
    packed row's label count, so the summed gradients are those of the packed step."""
    y_all = labels[0, 1:]
    n_items = (y_all != -100).sum()
    total, start = 0.0, 0
    for n in lengths:
        doc_ids, doc_labels = ids[:, start:start + n], labels[0, start + 1:start + n]
        hidden = model.model(input_ids=doc_ids, use_cache=False).last_hidden_state
        loss = chunked_lm_loss(model, hidden[0, :-1], doc_labels, n_items, chunk)
        loss.backward()
        total += loss.item()
        start += n
    return torch.tensor(total, dtype=torch.float64)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_arm(arm, dtype, args, shape, weights, inputs, lengths, spy, device):
    """(row, {"loss", "grads": {name: grad on the CPU}}) of one arm's timed step; (row, None)
    when the step failed (out of memory, or an error: status and note say which)."""
    ids, pos, labels = inputs
    attn = "sdpa" if arm == "fp32_ref" or device == "cpu" else "flex_attention"
    model = build_model(shape, args.layers, dtype, device, attn, weights)
    note = ""
    if arm == "moepeak":
        from moepeak.hf import apply_moepeak
        report = apply_moepeak(model, tile_tokens=args.tile_tokens)
        note = "; ".join(line for line in report.left_alone)[:300]
    else:
        model.gradient_checkpointing_enable()

    def step():
        if arm == "fp32_ref":
            return reference_step(model, ids, labels, lengths, args.loss_chunk)
        fn = moepeak_step if arm == "moepeak" else stock_step
        return fn(model, ids, pos, labels, args.loss_chunk)

    row = dict(arm=arm, dtype=dtype_name(dtype), T=ids.shape[1], docs=len(lengths),
               layers=args.layers, tile_tokens=args.tile_tokens if arm == "moepeak" else "", attn=attn, note=note)
    warmup = 0 if arm == "fp32_ref" else args.warmup  # the reference's time is not a result
    try:
        for i in range(warmup):
            progress(f"{arm} {row['dtype']}: warm-up step {i + 1}")
            step()
            model.zero_grad(set_to_none=True)
        sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        progress(f"{arm} {row['dtype']}: timed step")
        spy.armed = arm != "fp32_ref"
        t0 = time.perf_counter()
        loss = step()
        sync(device)
        step_s = time.perf_counter() - t0
        mask = spy.take()
    except Exception as e:  # an OOM is a result; another error is recorded too, so the other arms still run
        status, note = ("oom", "") if is_oom(e) else ("error", f"{type(e).__name__}: {e}"[:400])
        if status == "error":
            traceback.print_exc()
        del e
        spy.take()
        model = None  # free now (the timing closures still name them)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        return dict(row, status=status, note=note or row["note"]), None
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    row.update(status="ok", peak_gib=f"{peak:.2f}", step_s=f"{step_s:.3f}", loss=f"{loss.item():.6f}")
    if arm != "fp32_ref":
        ok, detail = check_document_causal(mask, lengths, every_pair=device == "cpu")
        row["mask_ok"] = ok
        row["note"] = "; ".join(x for x in (detail, note) if x)
    grads = {n: p.grad.detach().to("cpu") for n, p in model.named_parameters() if p.grad is not None}
    model = None  # free now (the timing closures still name them)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row, dict(loss=loss.double().cpu(), grads=grads)


def errors(result, ref, device):
    """{loss_err, err_<group>}: norm-wise relative errors (fp64, on `device`) against the reference."""
    out = {"loss_err": abs(result["loss"].item() - ref["loss"].item()) / abs(ref["loss"].item())}
    for group in GROUPS:
        names = [n for n in ref["grads"] if group_of(n) == group]
        missing = [n for n in names if n not in result["grads"]]
        if missing:
            raise RuntimeError(f"bench_packed: no gradient for {missing}")
        diff2 = ref2 = 0.0
        for n in names:
            want = ref["grads"][n].to(device, torch.float64)
            diff2 += ((result["grads"][n].to(device, torch.float64) - want) ** 2).sum().item()
            ref2 += (want ** 2).sum().item()
        out[f"err_{group}"] = math.sqrt(diff2) / (math.sqrt(ref2) if ref2 > 0 else 1.0)
    return out


def flex_mask_smoke(shape, args, weights, inputs, lengths):
    """CPU: flex attention has no backward there; a no-grad flex forward of the stock model
    shows the BlockMask transformers builds from the packed position_ids."""
    spy = MaskSpy("flex_attention")
    model = build_model(shape, args.layers, torch.float32, "cpu", "flex_attention", weights)
    spy.armed = True
    with torch.no_grad():
        model.model(input_ids=inputs[0], position_ids=inputs[1], use_cache=False)
    return check_document_causal(spy.take(), lengths, every_pair=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=131072, help="tokens in the packed row")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 2.0B shape")
    ap.add_argument("--tile-tokens", type=int, default=8192)
    ap.add_argument("--loss-chunk", type=int, default=8192, help="tokens per lm_head chunk of stock and fp32_ref")
    ap.add_argument("--dtypes", default="bfloat16", help="comma list of the arms' dtypes (bfloat16, float32)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per arm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder of packed.csv")
    ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU (T 384, 2 layers, tile 64)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.T, args.layers, args.tile_tokens, args.loss_chunk = 384, 2, 64, 100
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
    if any(d not in (torch.bfloat16, torch.float32) for d in dtypes):
        ap.error(f"--dtypes: bfloat16 and/or float32, got {args.dtypes!r}")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32 proper
        torch.backends.cudnn.allow_tf32 = False
    import transformers
    shape = TINY if args.smoke else FULL
    lengths = document_lengths(args.T, args.seed)
    inputs = packed_inputs(lengths, shape["vocab_size"], args.seed, device)
    progress(f"T={args.T} in {len(lengths)} documents ({min(lengths)}..{max(lengths)} tokens), "
             f"{args.layers} layers, {device}")
    base = build_model(shape, args.layers, torch.float32, device, "sdpa")
    weights = {k: v.to(torch.bfloat16).cpu() for k, v in base.state_dict().items()}  # the arms' one weight set
    del base
    spy = MaskSpy("sdpa" if device == "cpu" else "flex_attention")
    rows, results = [], {}
    for dtype in dtypes:
        for arm in ("stock", "moepeak"):
            row, results[arm, dtype] = run_arm(arm, dtype, args, shape, weights, inputs, lengths, spy, device)
            rows.append(row)
    ref_row, ref = run_arm("fp32_ref", torch.float32, args, shape, weights, inputs, lengths, spy, device)
    ref_row["note"] = "each document alone, unpacked, causal SDPA, fp32"
    if args.smoke:
        ok, detail = flex_mask_smoke(shape, args, weights, inputs, lengths)
        ref_row.update(mask_ok=ok, note=ref_row["note"] + f"; no-grad flex forward of stock: {detail}")
    rows.append(ref_row)
    if ref is not None:
        for dtype in dtypes:
            errs = {}
            for arm in ("stock", "moepeak"):
                if results[arm, dtype] is not None:
                    errs[arm] = errors(results[arm, dtype], ref, device)
                    next(r for r in rows if r["arm"] == arm and r["dtype"] == dtype_name(dtype)).update(
                        {k: f"{v:.3e}" for k, v in errs[arm].items()})
            if len(errs) == 2:
                ratio = {k: (errs["moepeak"][k] / errs["stock"][k] if errs["stock"][k] > 0 else float("inf"))
                         for k in errs["stock"]}
                rows.append(dict({k: f"{v:.3f}" for k, v in ratio.items()}, arm="moepeak/stock",
                                 dtype=dtype_name(dtype), T=args.T, docs=len(lengths), layers=args.layers,
                                 status="ratio", note="loss_err and err_* columns: moepeak's error / stock's"))
    info = dict(transformers=transformers.__version__)
    append_results(args.out, "packed", [dict(info, **r) for r in rows], fields=FIELDS)
    progress(f"rows appended to {os.path.join(args.out, 'packed.csv')}")
    cols = ["arm", "dtype", "status", "peak_gib", "step_s", "loss_err"] + [f"err_{g}" for g in GROUPS] + ["mask_ok"]
    print(" ".join(f"{c:>13s}" for c in cols))
    for r in rows:
        print(" ".join(f"{str(r.get(c, '')):>13s}" for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
