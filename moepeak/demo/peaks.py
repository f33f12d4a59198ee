"""Measure the four peaks of the demo model, for its schedules and for the
same weights in plain PyTorch.

GPU (torch.cuda memory stats; each probe isolated, peak = max_memory_allocated
minus what was allocated before the probe, inputs included in the base):
  dispatch    forward + backward of layer 0's MoE on a [B, T, H] input
  vocab       forward + backward of the head + loss on a [B, T, H] input
  boundaries  memory kept alive by a forward through every block (the graph
              held for backward, without the head), after synchronising
  optimizer   the first optimizer step: device bytes it allocates and keeps
              (state) and its transient peak; plain AdamW keeps exp_avg and
              exp_avg_sq beside every parameter (2 x parameter bytes)
CPU (no allocator statistics): dispatch and vocab are the bytes of the tensors
autograd saves for backward (counted by saved_tensors_hooks, one count per
storage); boundaries are L*B*T*H*b (what torch checkpoint keeps; SCO keeps the
same bytes, in host memory either way on CPU); optimizer is the bytes of its
state tensors.
The plain column uses a copy of the same weights; an OOM there is reported as
"OOM" (the point of the schedule), never a crash.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .models import DenseMoE, PlainLMHead

GiB = 2 ** 30
# Why the boundaries and optimizer rows read 1.0x on CPU (the rows' "cpu_same"): these two
# schedules move bytes from GPU memory to host RAM, and a CPU run holds them in host RAM anyway.
CPU_SAME = {
    "boundaries": "SCO moves the checkpoint boundaries from GPU memory to pinned host RAM",
    "optimizer": "StreamAdamW keeps the optimizer state in host RAM instead of GPU memory",
}


class SavedBytes:
    """Sum of bytes of distinct storages autograd saves inside the context."""

    def __init__(self):
        self.seen, self.bytes = set(), 0

    def _pack(self, t):
        try:
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in self.seen:
                self.seen.add(key)
                self.bytes += st.nbytes()
        except (RuntimeError, NotImplementedError):
            self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _probe(fn, device):
    """Peak bytes above the allocation at entry (GPU) or saved bytes (CPU); 'OOM' on OOM."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            fn()
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return "OOM"
        return torch.cuda.max_memory_allocated(device) - base
    meter = SavedBytes()
    with meter:
        fn()
    return meter.bytes


def _moe_fwd_bwd(moe, x):
    def f():
        xx = x.detach().requires_grad_(True)
        y, _ = moe(xx)
        y.backward(torch.ones_like(y))
    return f


def _head_fwd_bwd(head, h, labels):
    def f():
        hh = h.detach().requires_grad_(True)
        head(hh, labels).backward()
    return f


def _plain_moe_like(moe, cfg, device, dtype):
    dense = DenseMoE(cfg.hidden, cfg.intermediate, cfg.experts, cfg.top_k,
                     norm_topk_prob=cfg.norm_topk_prob, device=device, dtype=dtype)
    with torch.no_grad():
        dense.router.weight.copy_(moe.router.weight)
        dense.w_gate_up.copy_(moe.w_gate_up)
        dense.w_down.copy_(moe.w_down)
    return dense


def _boundaries(model, ids, device, mode):
    """Bytes kept for backward by a forward through the blocks with checkpoint `mode`."""
    old = model.cfg.checkpoint
    model.cfg.checkpoint = mode
    if mode == "sco":
        model.use_sco()
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            try:
                out = model.hidden_states(ids)
                torch.cuda.synchronize(device)
                kept = torch.cuda.memory_allocated(device) - base - out.numel() * out.element_size()
            except torch.cuda.OutOfMemoryError:
                return "OOM"
            finally:
                out = None
                torch.cuda.empty_cache()
            return kept
        cfg = model.cfg
        return cfg.layers * ids.numel() * cfg.hidden * model.embed.weight.element_size()
    finally:
        model.cfg.checkpoint = old


def measure(model, cfg, opt_kind, opt, data, B, T, device, opt_meas) -> List[Dict]:
    dtype = model.embed.weight.dtype
    g = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(B, T, cfg.hidden, generator=g) * 0.5).to(device=device, dtype=dtype)
    ids, labels = data.batch(0, B, T, device=device)
    rows = []
    moe = model.layers[0].moe
    m_moe = _probe(_moe_fwd_bwd(moe, x), device)
    if cfg.moe == "dense":
        p_moe = m_moe
    else:
        p_moe = _probe(_moe_fwd_bwd(_plain_moe_like(moe, cfg, device, dtype), x), device)
    rows.append({"peak": "dispatch", "moepeak": m_moe, "plain": p_moe,
                 "what": f"MoE fwd+bwd, {B * T} tokens, top-{cfg.top_k} of {cfg.experts}"})
    m_voc = _probe(_head_fwd_bwd(model.head, x, labels), device)
    if cfg.head == "plain":
        p_voc = m_voc
    else:
        ph = PlainLMHead(cfg.hidden, cfg.vocab_size, device=device, dtype=dtype)
        with torch.no_grad():
            ph.weight.copy_(model.head.weight)
        p_voc = _probe(_head_fwd_bwd(ph, x, labels), device)
        del ph
    rows.append({"peak": "vocab", "moepeak": m_voc, "plain": p_voc,
                 "what": f"head+CE fwd+bwd, {B * T} x {cfg.vocab_size} logits"})
    del x
    m_b = _boundaries(model, ids, device, cfg.checkpoint)
    p_b = m_b if cfg.checkpoint != "sco" else _boundaries(model, ids, device, "torch")
    rows.append({"peak": "boundaries", "moepeak": m_b, "plain": p_b,
                 "what": f"forward kept for backward, {cfg.layers} blocks"
                         + ("" if device.type == "cuda" else " (L*B*T*H*b)"),
                 "cpu_same": CPU_SAME["boundaries"] if device.type == "cpu" and cfg.checkpoint == "sco" else None})
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    plain_opt = 2 * pbytes
    if device.type == "cuda" and opt_meas:
        m_opt = opt_meas["step_peak"]
    else:
        m_opt = _state_bytes(opt, device)
    if opt_kind == "torch":
        plain_opt = m_opt
    rows.append({"peak": "optimizer", "moepeak": m_opt, "plain": plain_opt,
                 "what": "first step: device bytes (state + transient)" if device.type == "cuda"
                 else "state tensors' bytes",
                 "cpu_same": CPU_SAME["optimizer"] if device.type == "cpu" and opt_kind == "stream" else None})
    return rows


def _state_bytes(opt, device) -> int:
    n = 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.device.type == device.type:
                n += v.numel() * v.element_size()
    return n


def _fmt(v) -> str:
    if isinstance(v, str):
        return v
    if v is None:
        return "-"
    return f"{v / 2 ** 20:10.1f} MiB" if v < GiB else f"{v / GiB:10.2f} GiB"


def format_table(rows, cfg, tokens, device) -> str:
    settings = (f"moe={cfg.moe} head={cfg.head} checkpoint={cfg.checkpoint}")
    out = [f"\nmeasured peaks on {device} ({tokens} tokens per step; {settings}):",
           f"{'peak':<12}{'this run':>16}{'plain PyTorch':>16}  {'ratio':>6}  how"]
    for r in rows:
        m, p = r["moepeak"], r["plain"]
        ratio = f"{p / m:6.1f}x" if isinstance(m, int) and isinstance(p, int) and m > 0 else "     -"
        out.append(f"{r['peak']:<12}{_fmt(m):>16}{_fmt(p):>16}  {ratio}  {r['what']}")
    for r in rows:
        m, p = r["moepeak"], r["plain"]
        if r.get("cpu_same") and isinstance(m, int) and isinstance(p, int) and m > 0 and round(p / m, 1) == 1.0:
            out.append(f"note: {r['peak']} 1.0x: {r['cpu_same']}; on CPU both runs hold them in host RAM "
                       f"already, so there is nothing to save")
    return "\n".join(out)
