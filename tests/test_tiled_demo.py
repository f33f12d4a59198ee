"""The demo model with sequence-tiled blocks (MoEConfig.tile_tokens): a 3-step training run
equals the untiled run, under every checkpoint setting, with moepeak's schedules on."""
from __future__ import annotations

import pytest
import torch

from moepeak.demo.config import MoEConfig, available, build_optimizer
from moepeak.demo.models import MoELM

SMALL = dict(hidden=32, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, intermediate=24)


def _train(cfg, dtype, steps=3, seed=0, device="cpu"):
    """Losses, first-step gradients and final parameters (fp64 copies) of `steps` AdamW steps
    on one fixed batch."""
    m = MoELM(cfg, dtype=dtype, seed=seed, device=device)
    opt = build_optimizer(m.parameters(), "torch", lr=1e-2)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=g).to(device)
    losses, grads = [], None
    for s in range(steps):
        loss = m(ids, ids.roll(-1, 1))
        opt.zero_grad()
        loss.backward()
        if grads is None:
            grads = {n: p.grad.double().clone() for n, p in m.named_parameters()}
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().double().clone() for n, p in m.named_parameters()}
    m.close()
    return losses, grads, params


def _schedules():
    moe = "llep" if available("moe") else "dense"
    head = "ring_dtp" if available("head") else "plain"
    return moe, head


@pytest.mark.parametrize("checkpoint", ["sco", "torch", "none"])
@pytest.mark.parametrize("tile", [7, 16])
def test_three_steps_fp32_match_untiled(checkpoint, tile):
    if checkpoint == "sco" and not available("checkpoint"):
        pytest.skip("moepeak.sco_checkpoint is not in this build")
    moe, head = _schedules()
    cfg = MoEConfig(**SMALL, moe=moe, head=head, checkpoint=checkpoint)
    l0, g0, p0 = _train(cfg, torch.float32)
    l1, g1, p1 = _train(cfg.replace(tile_tokens=tile), torch.float32)
    assert l0 == pytest.approx(l1, rel=1e-5, abs=1e-6)
    assert l0[-1] < l0[0]  # it trained
    for n in g0:  # the gradients: fp32 reduction-order differences only
        err = (g0[n] - g1[n]).abs().max().item()
        assert err <= 1e-5 * max(g0[n].abs().max().item(), 1e-6), (n, err)
    for n in p0:  # after 3 AdamW steps (Adam's normalisation amplifies tiny-gradient entries)
        err = (p0[n] - p1[n]).abs().max().item()
        assert err <= 1e-4 * max(p0[n].abs().max().item(), 1e-3), (n, err)


@pytest.mark.cuda
def test_three_steps_fp32_match_untiled_cuda():
    """The same on the GPU, with SCO: the tiled block inside the demo's forward, its
    host-resident boundaries and the CUDA kernels of PipelinedLLEP and Ring-DTP."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    moe, head = _schedules()
    checkpoint = "sco" if available("checkpoint") else "torch"
    cfg = MoEConfig(**SMALL, moe=moe, head=head, checkpoint=checkpoint)
    l0, g0, p0 = _train(cfg, torch.float32, device="cuda")
    l1, g1, p1 = _train(cfg.replace(tile_tokens=16), torch.float32, device="cuda")
    assert l0 == pytest.approx(l1, rel=1e-5, abs=1e-6)
    assert l0[-1] < l0[0]
    for n in g0:
        err = (g0[n] - g1[n]).abs().max().item()
        assert err <= 1e-5 * max(g0[n].abs().max().item(), 1e-6), (n, err)
    for n in p0:
        err = (p0[n] - p1[n]).abs().max().item()
        assert err <= 1e-4 * max(p0[n].abs().max().item(), 1e-3), (n, err)


def test_three_steps_bf16_within_twice_untiled_error():
    """bf16 with SCO: the tiled run's distance to the fp32 run is at most 2x the untiled bf16
    run's (docs/design.md's rule), plus one bf16 ulp of the parameter's scale."""
    if not available("checkpoint"):
        pytest.skip("moepeak.sco_checkpoint is not in this build")
    moe, head = _schedules()
    cfg = MoEConfig(**SMALL, moe=moe, head=head, checkpoint="sco")
    lr, _, pr = _train(cfg, torch.float32)
    lp, _, pp = _train(cfg, torch.bfloat16)
    lt, _, pt = _train(cfg.replace(tile_tokens=9), torch.bfloat16)
    for a, b, c in zip(lr, lp, lt):
        assert abs(c - a) <= 2 * abs(b - a) + 2 ** -8 * abs(a)
    for n in pr:
        e_plain = (pp[n] - pr[n]).abs().max().item()
        e_tiled = (pt[n] - pr[n]).abs().max().item()
        assert e_tiled <= 2 * e_plain + 2 ** -8 * pr[n].abs().max().item(), (n, e_tiled, e_plain)


def test_sco_replays_only_the_boundary_of_a_tiled_block(monkeypatch):
    """Under SCO the tiled block's forward runs once per block (the checkpoint's replay
    stops at the boundary node): counted through the adapter's attention core."""
    if not available("checkpoint"):
        pytest.skip("moepeak.sco_checkpoint is not in this build")
    from moepeak.demo import models
    calls = {"n": 0}
    orig = models.Attention.attend

    def counting(self, q, k, v):
        calls["n"] += 1
        return orig(self, q, k, v)
    monkeypatch.setattr(models.Attention, "attend", counting)
    moe, head = _schedules()
    cfg = MoEConfig(**SMALL, moe=moe, head=head, checkpoint="sco", tile_tokens=8)
    m = MoELM(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, 24))
    m(ids, ids.roll(-1, 1)).backward()
    m.close()
    # forward + backward recompute, once per kv-head group, per block
    assert calls["n"] == 2 * cfg.kv_heads * cfg.layers


def test_bad_tile_tokens():
    with pytest.raises(ValueError, match="tile_tokens"):
        MoEConfig(**SMALL, tile_tokens=0).validate()
    assert MoEConfig(**SMALL, tile_tokens=5).plain().tile_tokens is None
