"""moepeak.hf.apply_moepeak(..., tile_tokens=N): Qwen3-MoE decoder layers run sequence-tiled
in training; 3 training steps equal the untiled patched model; the router aux loss is refused
with a clear message; other families are left alone with the reason."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moepeak.hf import apply_moepeak  # noqa: E402

V, T, B = 97, 13, 2
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)


def qwen3_moe(output_router_logits=False):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                      num_experts_per_tok=2, output_router_logits=output_router_logits)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # transformers initialises the router to zero (all routes tie)
        for name, p in model.named_parameters():
            if ".gate.weight" in name:
                p.normal_(0, 1.0)
    return model


def _train(model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    model.train()
    losses, grads = [], None
    for _ in range(steps):
        ids = torch.randint(0, V, (B, T), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tile", [4, 13])
def test_three_steps_equal_untiled(tile):
    base = qwen3_moe()
    tiled = copy.deepcopy(base)
    apply_moepeak(base, chunk_rows=32)
    report = apply_moepeak(tiled, chunk_rows=32, tile_tokens=tile)
    assert "tile_tokens: 2 decoder layers" in str(report), str(report)
    calls = {"n": 0}
    from moepeak import tiled_adapters
    orig = tiled_adapters.qwen3_moe_layer_spec

    def counting(*a, **k):
        calls["n"] += 1
        return orig(*a, **k)
    tiled_adapters.qwen3_moe_layer_spec = counting
    try:
        l1, g1, p1 = _train(tiled)
    finally:
        tiled_adapters.qwen3_moe_layer_spec = orig
    assert calls["n"] >= 3 * 2  # every layer of every step went through the tiled block
    l0, g0, p0 = _train(base)
    assert l0 == pytest.approx(l1, rel=1e-5, abs=1e-6)
    for n in g0:
        err = (g0[n] - g1[n]).abs().max().item()
        assert err <= 1e-5 * max(g0[n].abs().max().item(), 1e-6), (n, err)
    for n in p0:  # after 3 AdamW steps: tests/test_hf.py's tolerance (Adam amplifies tiny gradients)
        assert torch.allclose(p1[n], p0[n], rtol=1e-4, atol=2e-5), (n, (p0[n] - p1[n]).abs().max().item())


def test_eval_runs_the_layers_own_forward():
    base = qwen3_moe()
    tiled = copy.deepcopy(base)
    apply_moepeak(base)
    apply_moepeak(tiled, tile_tokens=4)
    ids = torch.randint(0, V, (1, T))
    base.eval()
    tiled.eval()
    with torch.no_grad():  # generation-style call with a KV cache: the untiled forward serves it
        a = base(input_ids=ids, use_cache=True).logits
        b = tiled(input_ids=ids, use_cache=True).logits
    assert torch.equal(a, b)


def test_router_aux_loss_is_refused_clearly():
    model = qwen3_moe(output_router_logits=True)
    with pytest.raises(ValueError, match="output_router_logits=False"):
        apply_moepeak(model, tile_tokens=8)
    assert getattr(model, "_moepeak_hf", None) is None  # nothing was patched


def test_other_families_left_alone_with_reason():
    cfg = transformers.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                     output_router_logits=False)
    report = apply_moepeak(transformers.MixtralForCausalLM(cfg), tile_tokens=8)
    assert "MixtralDecoderLayer stay untiled" in str(report), str(report)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_tile_tokens(bad):
    with pytest.raises(ValueError, match="tile_tokens"):
        apply_moepeak(qwen3_moe(), tile_tokens=bad)
