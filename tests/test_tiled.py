"""moepeak.tiled: the sequence-tiled block equals the untiled block (forward, input and
weight gradients), composes with checkpointing/SCO, trains identically, and keeps its
position-wise working set O(tile)."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.utils.checkpoint as torch_ckpt

from moepeak.tiled import TiledBlock, tiled_block
from moepeak.demo.tiled import demo_block_spec
from tiled_blocks import LiveBytes, RefBlock, linear_causal_core


def _grads(block, x, y, gy):
    return torch.autograd.grad(y, [x] + list(block.parameters()), gy, allow_unused=True)


def _run(block, x, gy, tile=None, head_groups=None):
    """[y, dx, *weight grads]; tiled when `tile` is given (head_groups: override the spec's)."""
    x = x.detach().requires_grad_(True)
    if tile is None:
        y = block(x)
    else:
        spec = demo_block_spec(block, x)
        if head_groups is not None:
            spec = dataclasses.replace(spec, head_groups=head_groups)
        y = tiled_block(x, spec, tile)
    return [y.detach()] + list(_grads(block, x, y, gy))


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("T,tile", [(37, 5), (37, 1), (37, 16), (37, 37), (37, 64), (1, 1), (1, 8), (32, 8)])
def test_demo_block_fp32_matches_untiled(T, tile):
    blk = RefBlock()
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(1))
    gy = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(2))
    want, got, ungrouped = _run(blk, x, gy), _run(blk, x, gy, tile), _run(blk, x, gy, tile, head_groups=1)
    names = ["y", "dx"] + [n for n, _ in blk.named_parameters()]
    for name, w, g, u in zip(names, want, got, ungrouped):
        if tile >= T:  # one tile, one core call: the untiled ops in the untiled order
            assert torch.equal(w, u), name
        # the core per kv-head group: the SDPA kernel's own blocking may change (1e-7 on CPU)
        for t in (g, u):
            assert _max_err(w, t) <= 1e-5 * max(w.abs().max().item(), 1e-3), (name, _max_err(w, t))


@pytest.mark.parametrize("T,tile", [(48, 7), (48, 16), (1, 4)])
def test_demo_block_bf16_within_twice_plain_error(T, tile):
    blk64 = RefBlock(dtype=torch.float64)
    blk16 = RefBlock(dtype=torch.bfloat16)
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(3))
    gy = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(4))
    ref = _run(blk64, x.double(), gy.double())
    plain = _run(blk16, x.bfloat16(), gy.bfloat16())
    tiled = _run(blk16, x.bfloat16(), gy.bfloat16(), tile)
    names = ["y", "dx"] + [n for n, _ in blk16.named_parameters()]
    for name, r, p, t in zip(names, ref, plain, tiled):
        e_plain, e_tiled = _max_err(p, r), _max_err(t, r)
        # docs/design.md's rule: at most 2x plain PyTorch's own error at the same dtype (plus one
        # bf16 ulp of the tensor's scale, for tensors plain bf16 happens to get exact)
        assert e_tiled <= 2 * e_plain + 2 ** -8 * r.abs().max().item(), (name, e_tiled, e_plain)


def test_real_demo_block_if_present():
    models = None
    for mod in ("moepeak.demo.models", "moepeak.models"):
        try:
            models = __import__(mod, fromlist=["Block"])
            break
        except ImportError:
            continue
    if models is None or not hasattr(models, "Block"):
        pytest.skip("moepeak's demo model is not importable")
    cfg = models.MoEConfig(hidden=32, heads=4, kv_heads=2, experts=4, top_k=2, intermediate=24,
                           moe="dense", head="plain", checkpoint="none")
    blk = models.Block(cfg, models.Rotary(cfg.head_dim, cfg.rope_theta))
    blk.load_state_dict(RefBlock().state_dict())
    x = torch.randn(1, 29, 32, generator=torch.Generator().manual_seed(5))
    gy = torch.randn(1, 29, 32, generator=torch.Generator().manual_seed(6))
    want, got, one = _run(blk, x, gy), _run(blk, x, gy, 6), _run(blk, x, gy, 29, head_groups=1)
    for w, g, o in zip(want, got, one):
        assert torch.equal(w, o)
        assert _max_err(w, g) <= 1e-5 * max(w.abs().max().item(), 1e-3)


def _counting_spec(blk, x, counts):
    s = demo_block_spec(blk, x)

    def post(x_t, o_t):
        counts["post"] += 1
        return s.post_attn(x_t, o_t)

    def core(q, k, v):
        counts["core"] += 1
        return s.attn_core(q, k, v)
    return dataclasses.replace(s, post_attn=post, attn_core=core)


@pytest.mark.parametrize("ckpt", ["torch", "sco", "none"])
def test_checkpoint_composition_replays_nothing_but_the_boundary(ckpt):
    """Under torch's checkpoint or sco_checkpoint the replay stops at the boundary: each
    tile's post-attention part runs twice (forward, backward) and the core twice per head group."""
    import moepeak
    blk = RefBlock()
    x = torch.randn(1, 20, 32, generator=torch.Generator().manual_seed(7))
    gy = torch.randn(1, 20, 32, generator=torch.Generator().manual_seed(8))
    want = _run(blk, x, gy)
    counts = {"post": 0, "core": 0}
    xg = x.clone().requires_grad_(True)
    fn = lambda t: tiled_block(t, _counting_spec(blk, t, counts), 6)  # noqa: E731
    cfg = None
    if ckpt == "torch":
        y = torch_ckpt.checkpoint(fn, xg, use_reentrant=False)
    elif ckpt == "sco":
        cfg = moepeak.SCOOffloader()
        y = moepeak.sco_checkpoint(fn, xg, sco_offloader=cfg)
    else:
        y = fn(xg)
    got = [y.detach()] + list(_grads(blk, xg, y, gy))
    assert counts == {"post": 2 * 4, "core": 2 * blk.attn.nkv}
    for w, g in zip(want, got):
        assert _max_err(w, g) <= 1e-5 * max(w.abs().max().item(), 1e-3)
    if cfg is not None:
        cfg.free()


def test_no_grad_forward_and_module_wrapper():
    blk = RefBlock()
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        want = blk(x)
        got = TiledBlock(blk, 4, demo_block_spec)(x)
    assert _max_err(want, got) <= 1e-5 * want.abs().max().item()


def test_bad_arguments():
    blk = RefBlock()
    x = torch.randn(1, 8, 32)
    spec = demo_block_spec(blk, x)
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match="tile_tokens"):
            tiled_block(x, spec, bad)
    with pytest.raises(TypeError, match="TiledBlockSpec"):
        tiled_block(x, object(), 4)
    with pytest.raises(TypeError, match="floating-point"):
        tiled_block(torch.ones(1, 8, 32, dtype=torch.long), spec, 4)
    with pytest.raises(ValueError, match="no tokens"):
        tiled_block(torch.randn(1, 0, 32), spec, 4)
    with pytest.raises(ValueError, match="seq_dim"):
        tiled_block(x, dataclasses.replace(spec, seq_dim=5), 4)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="extras"):
            tiled_block(x, dataclasses.replace(spec, extras=bad), 4)
    with pytest.raises(ValueError, match="post_attn must return"):  # declares a side output, returns none
        tiled_block(x, dataclasses.replace(spec, extras=1), 4)


# --------------------------------------------------------------------------- training

class TinyLM(torch.nn.Module):
    def __init__(self, tile=None, V=50, H=32):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.embed = torch.nn.Embedding(V, H)
        self.blocks = torch.nn.ModuleList([RefBlock(seed=1), RefBlock(seed=2)])
        self.head = torch.nn.Linear(H, V, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(V, H, generator=g))
            self.head.weight.copy_(torch.randn(V, H, generator=g) / H ** 0.5)
        self.tile = tile

    def forward(self, ids, labels):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x) if self.tile is None else tiled_block(x, demo_block_spec(b, x), self.tile)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_three_training_steps_match_untiled():
    ids = torch.randint(0, 50, (2, 3, 24), generator=torch.Generator().manual_seed(12))
    runs = []
    for tile in (None, 7):
        m = TinyLM(tile)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            loss = m(ids[0], ids[1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append((losses, [p.detach().clone() for p in m.parameters()]))
    (l0, p0), (l1, p1) = runs
    assert l0 == pytest.approx(l1, rel=1e-5, abs=1e-6)
    assert l0[2] < l0[0]  # it trained
    for a, b in zip(p0, p1):
        assert _max_err(a, b) <= 1e-4 * max(a.abs().max().item(), 1e-3)


# --------------------------------------------------------------------------- memory

def _backward_peak(T, run, H=64, tile=32):
    blk = RefBlock(H=H, nh=4, nkv=2, E=4, K=2, I=64, core=linear_causal_core)
    x = torch.randn(1, T, H, requires_grad=True)
    gy = torch.randn(1, T, H)
    y = run(blk, x, tile)
    mode = LiveBytes()
    with mode:
        torch.autograd.backward(y, gy)
    return mode.peak


def _core_peak(T, H=64, nh=4, nkv=2):
    """Live bytes of the attention core's part of the tiled backward, alone: q, k, v and dout
    per head group, every group's graph built (its saved state and out), then each group's
    backward in turn, its inputs, out and dout freed as its dq, dk, dv are kept."""
    d, G = H // nh, nkv
    mode = LiveBytes()
    with mode:
        groups = [[torch.randn(1, n // G, T, d).requires_grad_(True) for n in (nh, nkv, nkv)] for _ in range(G)]
        douts = [torch.randn(1, nh // G, T, d) for _ in range(G)]
        outs = [linear_causal_core(*g) for g in groups]
        grads = []
        for i in range(G):
            grads.append(torch.autograd.grad(outs[i], groups[i], douts[i]))
            outs[i] = groups[i] = douts[i] = None
        del outs, grads
    return mode.peak


def test_position_wise_transient_is_per_tile():
    """The full-length tensors of the tiled backward are the documented list and no more:
    doubling T at a fixed tile grows the backward's peak live bytes by at most the attention
    core's part (q, k, v, dout, every head group's saved state and out, the backward one
    group at a time: _core_peak) plus dx, x, grad_y and the RoPE tables (x, grad_y and the
    tables count once an op first touches them). Measured 0.3-0.7 of a [T, H] fp32 row below
    that sum, so one more full-length [T, H] tensor fails it. torch's checkpoint grows by more."""
    H, T, tile = 64, 1024, 64
    tiled = lambda b, x, t: tiled_block(x, demo_block_spec(b, x), t)  # noqa: E731
    ckpt = lambda b, x, t: torch_ckpt.checkpoint(b, x, use_reentrant=False)  # noqa: E731
    per_token = lambda f: (_backward_peak(2 * T, f, tile=tile) - _backward_peak(T, f, tile=tile)) / T  # noqa: E731
    core = (_core_peak(2 * T) - _core_peak(T)) / T
    row = H * 4  # one fp32 [T, H] row
    rope = 2 * (H // 4) * 4  # cos, sin [T, d] fp32
    listed = core + 3 * row + rope  # + dx, x, grad_y [T, H]
    grow_tiled, grow_ckpt = per_token(tiled), per_token(ckpt)
    assert grow_tiled <= listed + 0.25 * row, (grow_tiled / row, listed / row)
    assert grow_ckpt > listed + row, (grow_ckpt / row, listed / row)
    # and at fixed T, a 4x larger tile costs only O(tile) more
    small, big = _backward_peak(256, tiled, tile=16), _backward_peak(256, tiled, tile=64)
    assert big - small <= 48 * 64 * row, ((big - small) / row)


# --------------------------------------------------------------------------- Hugging Face Qwen3-MoE

def _qwen3_layer(dtype, attn_impl, seed=0):
    tf = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
    cfg = tf.Qwen3MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                            num_experts_per_tok=2, vocab_size=64, output_router_logits=False)
    cfg._attn_implementation = attn_impl
    torch.manual_seed(seed)
    layer = hf.Qwen3MoeDecoderLayer(cfg, layer_idx=0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = p.shape[-1] ** -0.5
            p.copy_((1.0 + 0.3 * torch.randn(p.shape)) if "norm" in name else torch.randn(p.shape) * scale)
    rope = hf.Qwen3MoeRotaryEmbedding(cfg)
    return layer.to(dtype), rope, cfg


def _run_hf(layer, rope, x, gy, tile=None, mask=None, head_groups=None):
    from moepeak.hf.tiled import hf_moe_layer_spec
    x = x.detach().requires_grad_(True)
    pos = torch.arange(x.shape[1]).unsqueeze(0)
    pe = rope(x, pos)
    if tile is None:
        y = layer(x, attention_mask=mask, position_embeddings=pe)
    else:
        spec = hf_moe_layer_spec(layer, x, attention_mask=mask, position_embeddings=pe)
        if head_groups is not None:
            spec = dataclasses.replace(spec, head_groups=head_groups)
        y = tiled_block(x, spec, tile)
    return [y.detach()] + list(torch.autograd.grad(y, [x] + list(layer.parameters()), gy))


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("T,tile", [(23, 4), (23, 23), (1, 3)])
def test_qwen3_moe_layer_fp32(attn_impl, T, tile):
    layer, rope, cfg = _qwen3_layer(torch.float32, attn_impl)
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(21))
    gy = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(22))
    mask = None
    if attn_impl == "eager":  # eager attention takes the additive causal mask
        mask = torch.full((T, T), float("-inf")).triu(1).view(1, 1, T, T).expand(2, 1, T, T)
    want, got = _run_hf(layer, rope, x, gy, None, mask), _run_hf(layer, rope, x, gy, tile, mask)
    ungrouped = _run_hf(layer, rope, x, gy, tile, mask, head_groups=1)
    for name, w, g, u in zip(["y", "dx"] + [n for n, _ in layer.named_parameters()], want, got, ungrouped):
        if tile >= T:  # one tile, one core call: bitwise
            assert torch.equal(w, u), name
        for t in (g, u):
            assert _max_err(w, t) <= 1e-5 * max(w.abs().max().item(), 1e-3), (name, _max_err(w, t))


@pytest.mark.parametrize("T,tile", [(40, 6), (40, 16)])
def test_qwen3_moe_layer_bf16_within_twice_plain_error(T, tile):
    l64, rope, _ = _qwen3_layer(torch.float64, "sdpa")
    l16, _, _ = _qwen3_layer(torch.bfloat16, "sdpa")
    x = torch.randn(1, T, 32, generator=torch.Generator().manual_seed(23))
    gy = torch.randn(1, T, 32, generator=torch.Generator().manual_seed(24))
    ref = _run_hf(l64, rope, x.double(), gy.double())
    plain = _run_hf(l16, rope, x.bfloat16(), gy.bfloat16())
    tiled = _run_hf(l16, rope, x.bfloat16(), gy.bfloat16(), tile)
    for name, r, p, t in zip(["y", "dx"] + [n for n, _ in l16.named_parameters()], ref, plain, tiled):
        e_plain, e_tiled = _max_err(p, r), _max_err(t, r)
        assert e_tiled <= 2 * e_plain + 2 ** -8 * r.abs().max().item(), (name, e_tiled, e_plain)


@pytest.mark.parametrize("T,tile", [(23, 4), (23, 23), (1, 3)])
def test_hf_layer_router_logits_side_output(T, tile):
    """return_router_logits: the tiled layer's router logits [B*T, E] equal the untiled router's
    (batch-major rows), and a loss on y and on the logits gives the untiled gradients: the
    logits' gradient goes back through the tiled recompute into x and every weight."""
    from moepeak.hf.tiled import tiled_hf_moe_layer_forward
    layer, rope, _ = _qwen3_layer(torch.float32, "sdpa")
    x0 = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(25))
    gy = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(26))
    gl = torch.randn(2 * T, 4, generator=torch.Generator().manual_seed(27))
    pe = rope(x0, torch.arange(T).unsqueeze(0))
    results = []
    for tiled in (False, True):
        x = x0.clone().requires_grad_(True)
        if tiled:
            y, logits = tiled_hf_moe_layer_forward(layer, x, position_embeddings=pe, tile_tokens=tile,
                                                   return_router_logits=True)
        else:
            seen = []
            handle = layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[0]))
            y = layer(x, position_embeddings=pe)
            handle.remove()
            (logits,) = seen
        loss = (y * gy).sum() + (logits * gl).sum()
        results.append([y.detach(), logits.detach()] + list(torch.autograd.grad(loss, [x] + list(layer.parameters()))))
    want, got = results
    assert got[1].shape == (2 * T, 4)
    for name, w, g in zip(["y", "logits", "dx"] + [n for n, _ in layer.named_parameters()], want, got):
        assert _max_err(w, g) <= 1e-5 * max(w.abs().max().item(), 1e-3), (name, _max_err(w, g))
    # the logits' gradient is a real part of the router's: without it the router gradient differs
    x = x0.clone().requires_grad_(True)
    y = tiled_hf_moe_layer_forward(layer, x, position_embeddings=pe, tile_tokens=tile)
    (no_logits,) = torch.autograd.grad((y * gy).sum(), [layer.mlp.gate.weight])
    router = 3 + [n for n, _ in layer.named_parameters()].index("mlp.gate.weight")  # after y, logits, dx
    assert _max_err(no_logits, want[router]) > 1e-3 * want[router].abs().max().item()


def test_hf_layer_refuses_cache_jitter_and_missing_rope():
    from moepeak.hf.tiled import tiled_hf_moe_layer_forward
    layer, rope, cfg = _qwen3_layer(torch.float32, "sdpa")
    x = torch.randn(1, 8, 32, requires_grad=True)
    pe = rope(x, torch.arange(8).unsqueeze(0))
    from transformers import DynamicCache
    cache = DynamicCache(config=cfg)  # 3 earlier tokens of layer 0: generation, not training
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    with pytest.raises(ValueError, match="cannot attend to 3 cached tokens"):
        tiled_hf_moe_layer_forward(layer, x, position_embeddings=pe, cache=cache, use_cache=True, tile_tokens=4)
    with pytest.raises(ValueError, match="position_embeddings"):
        tiled_hf_moe_layer_forward(layer, x, tile_tokens=4)
    layer.mlp.jitter_noise = 0.01  # Mixtral's router jitter: drawn per tile, not as the untiled layer draws it
    with pytest.raises(ValueError, match="jitter"):
        tiled_hf_moe_layer_forward(layer, x, position_embeddings=pe, tile_tokens=4)


def _prefetch_order(device, nkv):
    """Two tiled blocks under sco_checkpoint; the order of the engine's loads and of each core
    head group's backward (marked where dq is born) during backward."""
    import moepeak
    events = []

    class Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, tag):
            ctx.tag = tag
            return q.view_as(q)

        @staticmethod
        def backward(ctx, g):
            events.append(("core", ctx.tag))
            return g, None

    blocks = [RefBlock(H=32, nh=8, nkv=nkv, seed=s).to(device) for s in (0, 1)]
    calls = []

    def fn(blk, t):
        s = demo_block_spec(blk, t)

        def core(q, k, v):
            calls.append(None)
            return s.attn_core(Mark.apply(q, (len(calls) - 1) % nkv), k, v)
        return tiled_block(t, dataclasses.replace(s, attn_core=core), 8)

    cfg = moepeak.SCOOffloader(moepeak.SCOConfig(keep_last=False))
    x = torch.randn(1, 20, 32, device=device, requires_grad=True)
    y = x
    for blk in blocks:
        y = moepeak.sco_checkpoint(functools.partial(fn, blk), y, sco_offloader=cfg)
    engine = cfg.engine(device)
    real_load = engine._load
    engine._load = lambda rec: (events.append(("load", rec.seq)), real_load(rec))[1]
    y.sum().backward()
    stats = cfg.stats(device)
    cfg.free()
    return events, stats


@pytest.mark.parametrize("nkv", [1, 2, 4])
def test_sco_prefetch_waits_for_half_the_core_backward(nkv):
    """The previous block's boundary is prefetched only once half the head groups' core
    backward is done (all of it when there is one group): not part of the block's peak."""
    events, stats = _prefetch_order("cpu", nkv)
    half = (nkv + 1) // 2
    block2 = [("load", 1)] + [("core", g) for g in range(half)] + [("load", 0)] + \
        [("core", g) for g in range(half, nkv)]
    assert events == block2 + [("core", g) for g in range(nkv)]  # block 1's boundary: already loaded
    assert stats["prefetches"] == 1 and stats["reloads"] == 2


@pytest.mark.cuda
def test_sco_prefetch_waits_for_half_the_core_backward_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    events, stats = _prefetch_order("cuda", 4)
    assert events == [("load", 1), ("core", 0), ("core", 1), ("load", 0), ("core", 2), ("core", 3)] + \
        [("core", g) for g in range(4)]
    assert stats["prefetches"] == 1
