"""moepeak.hf.apply_moepeak(..., tile_tokens=N): Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and DeepSeek-V3 decoder
layers run sequence-tiled in training; 3 training steps equal the untiled patched model, also with the
router aux loss (output_router_logits=True: same loss, aux loss, router logits and gradients);
other families are left alone with the reason. One layer called directly: an input without grad
under a checkpoint, random numbers drawn in a part, positional arguments in the layer's own order.
tests/test_tiled_hf_user_path.py compares the tiled model with stock transformers on what users run."""
import copy
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moepeak.hf import apply_moepeak  # noqa: E402
from moepeak.tiled import tiled_block  # noqa: E402

V, T, B = 97, 13, 2
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)


def qwen3_moe(output_router_logits=False, **extra):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                      num_experts_per_tok=2, output_router_logits=output_router_logits, **extra)
    return _random_routers(transformers.Qwen3MoeForCausalLM(cfg))


def mixtral(output_router_logits=False, **extra):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
                                     output_router_logits=output_router_logits, **extra)
    return _random_routers(transformers.MixtralForCausalLM(cfg))


def qwen2_moe(output_router_logits=False, **extra):
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=24, moe_intermediate_size=24, num_experts=8,
                                      shared_expert_intermediate_size=24, num_experts_per_tok=2, qkv_bias=True,
                                      output_router_logits=output_router_logits, **extra)
    return _random_routers(transformers.Qwen2MoeForCausalLM(cfg))


def olmoe(output_router_logits=False, clip_qkv=0.5, **extra):
    torch.manual_seed(0)  # q/k norms over the whole projection; clip_qkv small enough to clip
    cfg = transformers.OlmoeConfig(**{k: v for k, v in COMMON.items() if k != "head_dim"}, intermediate_size=24,
                                   num_experts=8, num_experts_per_tok=2, clip_qkv=clip_qkv,
                                   output_router_logits=output_router_logits, **extra)
    return _random_routers(transformers.OlmoeForCausalLM(cfg))


def deepseek_v3(q_lora_rank=None, rope_interleave=True, **extra):
    torch.manual_seed(0)  # multi-head latent attention; layer 0 dense, layer 1 MoE
    common = {k: v for k, v in COMMON.items() if k not in ("head_dim", "num_key_value_heads")}
    cfg = transformers.DeepseekV3Config(**common, num_key_value_heads=COMMON["num_attention_heads"],
                                        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                                        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=q_lora_rank,
                                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                        rope_interleave=rope_interleave, **extra)
    return _random_routers(transformers.DeepseekV3ForCausalLM(cfg))


FAMILIES = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "qwen2_moe": qwen2_moe, "olmoe": olmoe}


def _random_routers(model):
    with torch.no_grad():  # transformers initialises the router to zero (all routes tie)
        for name, p in model.named_parameters():
            if ".gate.weight" in name:
                p.normal_(0, 1.0)
    return model


def _train(model, steps=3, T=T):
    """(losses, aux losses, first step's router logits, first step's grads, final params)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    model.train()
    losses, aux, logits, grads = [], [], None, None
    for _ in range(steps):
        ids = torch.randint(0, V, (B, T), generator=g)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            logits = [t.detach() for t in getattr(out, "router_logits", None) or ()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        aux_loss = getattr(out, "aux_loss", None)  # DeepSeek-V3's output has none
        aux.append(None if aux_loss is None else aux_loss.item())
    return losses, aux, logits, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_runs_equal(want, got):
    """fp32: losses to 1e-5, gradients to 1e-5 of each tensor's largest entry, parameters after 3
    AdamW steps to tests/test_hf.py's tolerance (Adam amplifies tiny gradient differences)."""
    (l0, a0, r0, g0, p0), (l1, a1, r1, g1, p1) = want, got
    assert l0 == pytest.approx(l1, rel=1e-5, abs=1e-6)
    assert (a0[0] is None) == (a1[0] is None) and (a0[0] is None or a0 == pytest.approx(a1, rel=1e-5, abs=1e-6))
    assert len(r0) == len(r1)
    for i, (w, g) in enumerate(zip(r0, r1)):
        assert w.shape == g.shape and (w - g).abs().max().item() <= 1e-5 * w.abs().max().item(), i
    for n in g0:
        err = (g0[n] - g1[n]).abs().max().item()
        assert err <= 1e-5 * max(g0[n].abs().max().item(), 1e-6), (n, err)
    for n in p0:
        assert torch.allclose(p1[n], p0[n], rtol=1e-4, atol=2e-5), (n, (p0[n] - p1[n]).abs().max().item())


@pytest.mark.parametrize("tile", [4, 13])
def test_three_steps_equal_untiled(tile):
    base = qwen3_moe()
    tiled = copy.deepcopy(base)
    apply_moepeak(base, chunk_rows=32)
    report = apply_moepeak(tiled, chunk_rows=32, tile_tokens=tile)
    assert "tile_tokens: 2 decoder layers" in str(report), str(report)
    calls = {"n": 0}
    from moepeak.hf import tiled as hf_tiled
    orig = hf_tiled.hf_moe_layer_spec

    def counting(*a, **k):
        calls["n"] += 1
        return orig(*a, **k)
    hf_tiled.hf_moe_layer_spec = counting
    try:
        got = _train(tiled)
    finally:
        hf_tiled.hf_moe_layer_spec = orig
    assert calls["n"] >= 3 * 2  # every layer of every step went through the tiled block
    _assert_runs_equal(_train(base), got)


# T = 12, B = 2: tiles of 4 divide T, tiles of 5 do not; the aux loss weighs 1.0 so that its
# gradient is a visible part of every router's (transformers' default coefficient is 0.001)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tile", [4, 5])
def test_router_aux_loss_equals_untiled(family, tile):
    base = FAMILIES[family](output_router_logits=True, router_aux_loss_coef=1.0)
    tiled = copy.deepcopy(base)
    apply_moepeak(base, chunk_rows=32)
    assert "tile_tokens: 2 decoder layers" in str(apply_moepeak(tiled, chunk_rows=32, tile_tokens=tile))
    want, got = _train(base, T=12), _train(tiled, T=12)
    assert len(got[2]) == 2 and got[2][0].shape == (B * 12, 8)  # one [B*T, E] per layer, not one per tile
    _assert_runs_equal(want, got)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_aux_loss_gradient_reaches_routers_and_earlier_layers(family):
    """The aux loss alone, backpropagated: the tiled model's gradients equal the untiled ones,
    for the routers (through the router logits of every tile) and for layer 0's attention
    (layer 1's logits depend on layer 0's output), and they are not zero."""
    base = FAMILIES[family](output_router_logits=True)
    tiled = copy.deepcopy(base)
    apply_moepeak(base, chunk_rows=32)
    apply_moepeak(tiled, chunk_rows=32, tile_tokens=5)
    ids = torch.randint(0, V, (B, 12), generator=torch.Generator().manual_seed(3))
    grads = []
    for model in (base, tiled):
        model.train()
        model(input_ids=ids).aux_loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    want, got = grads
    assert set(want) == set(got)
    for n in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.0.self_attn.q_proj.weight"):
        assert want[n].abs().max().item() > 0, n
    for n in want:
        err = (want[n] - got[n]).abs().max().item()
        assert err <= 1e-5 * max(want[n].abs().max().item(), 1e-6), (n, err)


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


def test_router_jitter_is_refused_clearly():
    model = mixtral(router_jitter_noise=0.1)
    apply_moepeak(model, tile_tokens=8)
    model.train()
    with pytest.raises(ValueError, match="jitter"):
        model(input_ids=torch.randint(0, V, (1, T)), labels=torch.randint(0, V, (1, T)))


@pytest.mark.parametrize("q_lora_rank, rope_interleave", [(None, True), (8, False)])
@pytest.mark.parametrize("tile", [4, 5])
def test_deepseek_v3_three_steps_equal_untiled(q_lora_rank, rope_interleave, tile):
    """DeepSeek-V3's latent attention (both q paths, both rotary layouts) in tiles: 3 steps equal
    the untiled patched model (its dense first layer and its MoE layer both tiled)."""
    base = deepseek_v3(q_lora_rank, rope_interleave)
    tiled = copy.deepcopy(base)
    apply_moepeak(base, chunk_rows=32)
    assert "tile_tokens: 2 decoder layers" in str(apply_moepeak(tiled, chunk_rows=32, tile_tokens=tile))
    from moepeak.hf import tiled as hf_tiled
    calls = []
    orig = hf_tiled.hf_moe_layer_spec
    hf_tiled.hf_moe_layer_spec = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        got = _train(tiled, T=12)
    finally:
        hf_tiled.hf_moe_layer_spec = orig
    assert len(calls) >= 3 * 2  # every layer of every step went through the tiled block
    _assert_runs_equal(_train(base, T=12), got)


def test_other_families_left_alone_with_reason():
    cfg = transformers.GptOssConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(cfg)
    report = apply_moepeak(model, tile_tokens=8)
    assert "GptOssDecoderLayer stay untiled" in str(report), str(report)
    # the adapter called directly on such a layer refuses it by name
    from moepeak.hf.tiled import hf_moe_layer_spec
    x = torch.randn(1, 4, COMMON["hidden_size"])
    cos = sin = torch.ones(1, 4, COMMON["head_dim"])
    with pytest.raises(ValueError, match="no tiled adapter for GptOssDecoderLayer"):
        hf_moe_layer_spec(model.model.layers[0], x, position_embeddings=(cos, sin))


def test_olmoe_clip_qkv_is_exercised():
    """The OLMoE config above clips: the tiled pre-attention part must clamp as the layer does."""
    model = olmoe()
    seen = []
    attn = model.model.layers[0].self_attn
    h = attn.q_proj.register_forward_hook(lambda m, a, out: seen.append(attn.q_norm(out).abs().max().item()))
    model(input_ids=torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2)))
    h.remove()
    assert seen and seen[0] > 0.5


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_tile_tokens(bad):
    with pytest.raises(ValueError, match="tile_tokens"):
        apply_moepeak(qwen3_moe(), tile_tokens=bad)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_router_aux_loss_bf16_within_twice_torch_error(family):
    """bf16, aux loss on (weight 1.0), tiles of 5 over T = 12: after 3 AdamW steps the tiled
    model's loss, aux loss and parameters are at most 2x as far from an fp64 run as transformers'
    own bf16 model (eager experts, torch checkpoint, full-logits loss) is. OLMoE without its
    clip: with most of q, k clipped, many gradients are exactly zero in one rounding and not in
    another, and AdamW turns that noise into lr-sized steps (the fp32 tests cover the clip)."""
    extra = {"clip_qkv": None} if family == "olmoe" else {}
    model = FAMILIES[family](output_router_logits=True, router_aux_loss_coef=1.0, **extra).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    plain.set_experts_implementation("eager")
    plain.gradient_checkpointing_enable()
    truth = copy.deepcopy(plain).double()
    apply_moepeak(model, chunk_rows=32, tile_tokens=5)
    runs = [_train(m, T=12) for m in (model, plain, truth)]
    (ours_l, ours_a, _, _, ours_p), (plain_l, plain_a, _, _, plain_p), (true_l, true_a, _, _, true_p) = runs
    for name, ours, theirs, true in (("loss", ours_l, plain_l, true_l), ("aux loss", ours_a, plain_a, true_a)):
        e_ours = max(abs(a - t) for a, t in zip(ours, true))
        e_theirs = max(abs(a - t) for a, t in zip(theirs, true))
        assert e_ours <= 2 * e_theirs + 1e-3, (name, e_ours, e_theirs)
    # over all parameters together, as tests/test_hf.py measures the untiled drop-in
    e_ours = torch.cat([(ours_p[n].double() - t).abs().flatten() for n, t in true_p.items()])
    e_theirs = torch.cat([(plain_p[n].double() - t).abs().flatten() for n, t in true_p.items()])
    assert e_ours.max() <= 2 * e_theirs.max() + 1e-6 and e_ours.mean() <= 2 * e_theirs.mean() + 1e-7, \
        (e_ours.max().item(), e_theirs.max().item(), e_ours.mean().item(), e_theirs.mean().item())


def test_deepseek_v3_bf16_within_twice_torch_error():
    """bf16, tiles of 5 over T = 12: after 3 AdamW steps the tiled DeepSeek-V3's losses and
    parameters are at most 2x as far from an fp64 run as transformers' own bf16 model is."""
    model = deepseek_v3().to(torch.bfloat16)
    plain = copy.deepcopy(model)
    plain.set_experts_implementation("eager")
    plain.gradient_checkpointing_enable()
    truth = copy.deepcopy(plain).double()
    apply_moepeak(model, chunk_rows=32, tile_tokens=5)
    (ours_l, _, _, _, ours_p), (plain_l, _, _, _, plain_p), (true_l, _, _, _, true_p) = \
        [_train(m, T=12) for m in (model, plain, truth)]
    e_ours = max(abs(a - t) for a, t in zip(ours_l, true_l))
    e_theirs = max(abs(a - t) for a, t in zip(plain_l, true_l))
    assert e_ours <= 2 * e_theirs + 1e-3, (e_ours, e_theirs)
    e_ours = torch.cat([(ours_p[n].double() - t).abs().flatten() for n, t in true_p.items()])
    e_theirs = torch.cat([(plain_p[n].double() - t).abs().flatten() for n, t in true_p.items()])
    assert e_ours.max() <= 2 * e_theirs.max() + 1e-6 and e_ours.mean() <= 2 * e_theirs.mean() + 1e-7, \
        (e_ours.max().item(), e_theirs.max().item(), e_ours.mean().item(), e_theirs.mean().item())


# --------------------------------------------------------------------------- one layer, called directly

def _qwen3_layer(seed=0, device="cpu"):
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                      num_experts_per_tok=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    layer = _random_routers(hf.Qwen3MoeDecoderLayer(cfg, layer_idx=0))
    with torch.no_grad():
        for p in layer.mlp.experts.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(B, 12, COMMON["hidden_size"], generator=torch.Generator().manual_seed(seed + 1)).to(device)
    pe = hf.Qwen3MoeRotaryEmbedding(cfg).to(device)(x, torch.arange(12, device=device).unsqueeze(0))
    return layer.to(device).train(), x, pe


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("ckpt", ["sco", "torch", "none"])
def test_layer_input_without_grad_replays_only_the_boundary(ckpt):
    """A layer input that needs no gradient (a frozen embedding's output): the tiled block still
    keeps x through its boundary node, so a checkpoint around it replays nothing but that node
    (post_attn runs once per tile in forward and once in backward) and the weights get the
    untiled layer's gradients."""
    import functools

    import moepeak
    import torch.utils.checkpoint as torch_ckpt
    from moepeak.hf.tiled import hf_moe_layer_spec
    layer, x, pe = _qwen3_layer()
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    params = list(layer.parameters())
    want = torch.autograd.grad((layer(x, position_embeddings=pe) * gy).sum(), params)
    posts = []

    def tiled(t):
        spec = hf_moe_layer_spec(layer, t, position_embeddings=pe)
        post = spec.post_attn
        return tiled_block(t, dataclasses.replace(spec, post_attn=lambda *a: posts.append(1) or post(*a)), 5)
    cfg = moepeak.SCOOffloader()
    run = {"sco": functools.partial(moepeak.sco_checkpoint, tiled, sco_offloader=cfg),
           "torch": functools.partial(torch_ckpt.checkpoint, tiled, use_reentrant=False), "none": tiled}[ckpt]
    assert not x.requires_grad
    got = torch.autograd.grad((run(x) * gy).sum(), params)
    cfg.free()
    assert len(posts) == 2 * 3  # 3 tiles of 12 tokens: forward, backward; no replay
    for n, w, g in zip([n for n, _ in layer.named_parameters()], want, got):
        assert (w - g).abs().max().item() <= 1e-5 * max(w.abs().max().item(), 1e-6), n


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_draws_the_forwards_random_numbers(device):
    """A part that draws random numbers (dropout on post_attn's output, in a hand-built spec: the
    adapter itself refuses dropout): each tile's recompute in backward starts from the RNG state
    its forward call started from, so the gradients are those of the masks the forward applied
    (the untiled layer times those masks), and backward leaves the RNG state as it found it."""
    from moepeak.hf.tiled import hf_moe_layer_spec
    layer, x0, pe = _qwen3_layer(device=device)
    gy = torch.randn(x0.shape, generator=torch.Generator().manual_seed(9)).to(device)
    params = list(layer.parameters())
    x = x0.clone().requires_grad_(True)
    spec = hf_moe_layer_spec(layer, x, position_embeddings=pe)
    post = spec.post_attn
    spec = dataclasses.replace(spec, post_attn=lambda x_t, o_t: torch.nn.functional.dropout(post(x_t, o_t), 0.5))
    torch.manual_seed(5)
    y = tiled_block(x, spec, 5)
    rng = (lambda: torch.cuda.get_rng_state(x.device)) if device == "cuda" else torch.get_rng_state
    after_forward = rng()
    got = torch.autograd.grad((y * gy).sum(), [x] + params)
    assert torch.equal(rng(), after_forward)
    scale = (y != 0).to(y.dtype) * 2.0  # the forward's masks, times dropout's 1 / (1 - p)
    assert 0 < scale.count_nonzero() < scale.numel()
    x = x0.clone().requires_grad_(True)
    want = torch.autograd.grad((layer(x, position_embeddings=pe) * scale * gy).sum(), [x] + params)
    for n, w, g in zip(["x"] + [n for n, _ in layer.named_parameters()], want, got):
        assert (w - g).abs().max().item() <= 1e-5 * max(w.abs().max().item(), 1e-6), n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile", [12, 5])
def test_layer_under_autocast_recomputes_as_the_forward_ran(device, tile):
    """fp32 weights, bf16 autocast forward, backward outside autocast (torch's AMP recipe): every
    router call of the backward's recompute gives the forward's bf16 logits and experts, and the
    gradients are the untiled layer's: within half a bf16 ulp of each tensor's largest entry with
    one tile, 2 ulps with several (weight gradients summed per tile in fp32, not one bf16 product)."""
    from moepeak.hf.tiled import tiled_hf_moe_layer_forward
    layer, x0, pe = _qwen3_layer(device=device)
    gy = torch.randn(x0.shape, generator=torch.Generator().manual_seed(9)).to(device)
    params = list(layer.parameters())
    calls = []
    results = []
    for tiled in (False, True):
        x = x0.clone().requires_grad_(True)
        handle = layer.mlp.gate.register_forward_hook(
            lambda m, a, out: calls.append((torch.is_grad_enabled(), out[0], out[2])) if tiled else None)
        with torch.autocast(device, dtype=torch.bfloat16):
            y = tiled_hf_moe_layer_forward(layer, x, position_embeddings=pe, tile_tokens=tile) if tiled else \
                layer(x, position_embeddings=pe)
        results.append(torch.autograd.grad((y.float() * gy).sum(), [x] + params))
        handle.remove()
    forward = [c for c in calls if not c[0]]
    recompute = [c for c in calls if c[0]][::-1]  # backward runs the tiles last first
    assert len(forward) == len(recompute) == -(-12 // tile)
    for (_, logits_f, experts_f), (_, logits_r, experts_r) in zip(forward, recompute):
        assert logits_f.dtype == logits_r.dtype == torch.bfloat16
        assert torch.equal(logits_f, logits_r) and torch.equal(experts_f, experts_r)
    rel = 2 ** -9 if tile >= 12 else 2 ** -7
    for n, w, g in zip(["x"] + [n for n, _ in layer.named_parameters()], *results):
        assert (w - g).abs().max().item() <= rel * max(w.abs().max().item(), 1e-6), n


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_layer_arguments_placed_by_the_layers_own_signature(family):
    """Positional arguments after hidden_states follow the layer's own forward signature (Mixtral's
    starts with position_embeddings, Qwen3-MoE's with attention_mask): the tiled layer called
    positionally gives the untiled layer's output."""
    from moepeak.hf.tiled import tiled_hf_moe_layer_forward
    model = FAMILIES[family]()
    layer = model.model.layers[0].train()
    x = torch.randn(B, 12, COMMON["hidden_size"], generator=torch.Generator().manual_seed(3))
    pos = torch.arange(12).unsqueeze(0)
    pe = model.model.rotary_emb(x, pos)
    args = (pe, None, pos) if family == "mixtral" else (None, pos, None, False, pe)
    with torch.no_grad():
        want = layer(x, *args)
    got = tiled_hf_moe_layer_forward(layer, x, *args, tile_tokens=5)
    assert (want - got).abs().max().item() <= 1e-5 * want.abs().max().item()
