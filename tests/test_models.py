"""The model zoo: config validation, the plain MoE and attention against fp64
references, identical parameters in every schedule setting, deterministic init."""
import pytest
import torch

from moepeak.demo.config import MoEConfig, available, param_count, resolve, sco_arena_bytes
from moepeak.demo.models import Attention, DenseMoE, MoELM, Rotary, apply_rope
from refs import ref_causal_attention, ref_moe

PLAIN = dict(moe="dense", head="plain", checkpoint="torch")


def test_dense_moe_matches_fp64_reference():
    torch.manual_seed(0)
    moe = DenseMoE(16, 8, 6, 2, dtype=torch.float64)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 13, 16, dtype=torch.float64, requires_grad=True)
    y, logits = moe(x)
    yr, lr = ref_moe(x.reshape(-1, 16), moe.router.weight, moe.w_gate_up, moe.w_down, 2)
    torch.testing.assert_close(y.reshape(-1, 16), yr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits, lr, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(y.square().sum(), [x, moe.w_down])
    gr = torch.autograd.grad(yr.square().sum(), [x, moe.w_down])
    for a, b in zip(g, gr):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_dense_moe_no_renorm():
    torch.manual_seed(1)
    moe = DenseMoE(8, 4, 4, 3, norm_topk_prob=False, dtype=torch.float64)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(7, 8, dtype=torch.float64)
    yr, _ = ref_moe(x, moe.router.weight, moe.w_gate_up, moe.w_down, 3, norm_topk_prob=False)
    torch.testing.assert_close(moe(x)[0], yr, rtol=1e-12, atol=1e-12)


def test_attention_with_rope_matches_explicit_mask():
    cfg = MoEConfig(hidden=32, heads=4, kv_heads=2)
    rot = Rotary(cfg.head_dim, cfg.rope_theta)
    att = Attention(cfg, rot, dtype=torch.float64)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in att.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    B, T, _ = x.shape
    q = att.q_proj(x).view(B, T, 4, 8).transpose(1, 2)
    k = att.k_proj(x).view(B, T, 2, 8).transpose(1, 2)
    v = att.v_proj(x).view(B, T, 2, 8).transpose(1, 2)
    cos, sin = rot.tables(T, x.device)
    # RoPE: position 0 unchanged, norms preserved
    qr = apply_rope(q, cos, sin)
    torch.testing.assert_close(qr[:, :, 0], q[:, :, 0])
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1))
    o = ref_causal_attention(qr, apply_rope(k, cos, sin), v)
    ref = att.o_proj(o.transpose(1, 2).reshape(B, T, 32))
    torch.testing.assert_close(att(x), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kw, msg", [
    (dict(hidden=30, heads=4), "heads (4) must divide hidden (30)"),
    (dict(heads=4, kv_heads=3), "kv_heads (3) must divide heads (4)"),
    (dict(top_k=5, experts=4), "top_k (5) must be <= experts (4)"),
    (dict(vocab_size=100), "vocab_size (100) must be >= 259"),
    (dict(moe="sparse"), "moe must be one of"),
    (dict(layers=0), "layers must be a positive integer"),
    (dict(sco_keep_last=-1), "sco_keep_last must be an integer >= 0, got -1"),
])
def test_config_rejects_with_clear_message(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        MoEConfig(**kw).validate()


def test_config_world_size_and_arena():
    with pytest.raises(ValueError, match=r"experts \(6\) must be divisible by the number of ranks \(4\)"):
        MoEConfig(experts=6).validate(world_size=4)
    with pytest.raises(ValueError, match="SCO arena needs"):
        MoEConfig(checkpoint="sco").validate(seq_len=1 << 20, arena_limit_bytes=1 << 20)
    MoEConfig(checkpoint="torch").validate(seq_len=1 << 20, arena_limit_bytes=1 << 20)


def test_bad_config_fails_before_building():
    with pytest.raises(ValueError, match="must divide hidden"):
        MoELM(MoEConfig(hidden=30, heads=4, **PLAIN))


def test_param_count_and_deterministic_init():
    cfg = MoEConfig(**PLAIN)
    a, b = MoELM(cfg, seed=3), MoELM(cfg.replace(checkpoint="none"), seed=3)
    assert sum(p.numel() for p in a.parameters()) == param_count(cfg)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    c = MoELM(cfg, seed=4)
    assert not torch.equal(c.embed.weight, a.embed.weight)


def test_checkpoint_modes_same_loss_and_grads():
    cfg = MoEConfig(**PLAIN)
    torch.manual_seed(0)
    ids = torch.randint(0, 259, (2, 16))
    out = []
    for ck in ("none", "torch"):
        m = MoELM(cfg.replace(checkpoint=ck), seed=1)
        loss = m(ids, ids.roll(-1, 1))
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=0)
    for n in out[0][1]:
        torch.testing.assert_close(out[0][1][n], out[1][1][n], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("keep", [1, 2, 5])
def test_sco_keep_last_is_exact_and_keeps_the_last_blocks(keep):
    """checkpoint "sco" with sco_keep_last = n: the last n blocks' inputs stay on the device
    (all when n >= layers); loss and gradients bitwise those of the run offloading every block;
    the arena check counts only the offloaded blocks."""
    if not available("checkpoint"):
        pytest.skip("moepeak.sco_checkpoint is not in this build")
    cfg = MoEConfig(**dict(PLAIN, checkpoint="sco", layers=3))
    torch.manual_seed(0)
    ids = torch.randint(0, 259, (2, 16))
    out = []
    for n in (0, keep):
        m = MoELM(cfg.replace(sco_keep_last=n), seed=1)
        loss = m(ids, ids.roll(-1, 1))
        loss.backward()
        st = m.sco.stats("cpu")
        assert st["kept"] == min(n, 3) and st["offloads"] == 3 - min(n, 3) and st["live"] == 0
        out.append((loss.detach(), {k: p.grad for k, p in m.named_parameters()}))
        m.close()
    assert torch.equal(out[0][0], out[1][0]) and all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])
    one = 2 * 16 * cfg.hidden * 4  # one fp32 boundary [2, 16, H]
    assert sco_arena_bytes(cfg.replace(sco_keep_last=keep), 16, 2, torch.float32) == max(3 - keep, 0) * one


@pytest.mark.parametrize("switch, setting", [("moe", "llep"), ("head", "ring_dtp"), ("checkpoint", "sco")])
def test_moepeak_switch_keeps_parameter_names_and_shapes(switch, setting):
    if not available(switch):
        pytest.skip(f"moepeak component for {switch} not in this build yet")
    base = MoEConfig(**PLAIN)
    a = MoELM(base, seed=0)
    b = MoELM(base.replace(**{switch: setting}), seed=0)
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k], sb[k]), k


def test_resolve_falls_back_with_notes():
    cfg, opt, notes = resolve(MoEConfig(), "stream", want_moepeak=dict.fromkeys(
        ("moe", "head", "checkpoint", "optimizer"), False))
    assert (cfg.moe, cfg.head, cfg.checkpoint, opt) == ("dense", "plain", "torch", "torch")
    assert notes == []
    cfg, opt, notes = resolve(MoEConfig(), "stream", want_moepeak={})
    for sw, name in (("moe", "llep"), ("head", "ring_dtp"), ("checkpoint", "sco")):
        assert (getattr(cfg, sw) == name) == available(sw)
    assert len(notes) == sum(not available(s) for s in ("moe", "head", "checkpoint", "optimizer"))


@pytest.mark.parametrize("moe", ["dense", "llep"])
def test_router_logits_stay_fp32_under_autocast(moe):
    """Under bf16 autocast the router's logits are the fp32 ones (autocast
    would run F.linear in bf16), and the dense loop's accumulator keeps one
    dtype (CUDA autocast's fp32 softmax once met a bf16 accumulator there)."""
    if moe == "llep" and not available("moe"):
        pytest.skip("moepeak.PipelinedLLEPMoE is not in this build")
    torch.manual_seed(0)
    cfg = MoEConfig(moe=moe, head="plain", checkpoint="none")
    moe_layer = MoELM(cfg).layers[0].moe
    x2 = torch.randn(16, cfg.hidden)
    want = x2 @ moe_layer.router.weight.t()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = moe_layer.route(x2)[0]
        y = moe_layer(x2.view(1, 16, -1))[0]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)
    assert y.shape == (1, 16, cfg.hidden) and torch.isfinite(y).all()


def test_lean_norms_follow_the_schedules_and_keep_the_loss():
    """lean_norm (default): the final RMSNorm with the Ring-DTP head and the blocks' with SCO
    run moepeak.norms.rms_norm, plain PyTorch keeps the eager ones; the forward is bitwise the
    same and the gradients agree to fp32 rounding."""
    if not (available("head") and available("checkpoint")):
        pytest.skip("moepeak's head / SCO not in this build")
    cfg = MoEConfig(moe="dense", head="ring_dtp", checkpoint="sco")
    lean, eager = MoELM(cfg), MoELM(cfg.replace(lean_norm=False))
    plain = MoELM(cfg.plain())
    assert lean.norm.lean and all(b.attn_norm.lean and b.mlp_norm.lean for b in lean.layers)
    for m in (eager, plain):
        assert not m.norm.lean and not any(b.attn_norm.lean or b.mlp_norm.lean for b in m.layers)
    assert MoELM(cfg.replace(checkpoint="torch")).norm.lean  # the final norm follows the head only
    eager.load_state_dict(lean.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (lean, eager):
        loss = m(ids[:, :-1], ids[:, 1:])
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (n, p), q in zip(lean.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
    for m in (lean, eager, plain):
        m.close()
