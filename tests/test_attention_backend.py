"""The attention core's SDPA backend (moepeak/tiled/attention.py) and head-group choice
(moepeak/tiled/sizes.py): the option's checks; the order sdpa_kernel receives around every core
call of the forward and the recompute; "math" tiled equals the untiled block on the CPU (causal and
packed documents through moepeak_varlen_sdpa, several head-group counts); the off switch leaves
torch's own choice (and a user's surrounding sdpa_kernel) alone; the fewest head groups that fit a
budget, chosen at the forward and kept for its backward; apply_moepeak's attention_backend on the
tiled and the untiled layers. CUDA (run by the lead): "auto" (cuDNN on Hopper) against fp64 within
2x the error of torch's default backend, causal and packed, head_dim 128 in bf16."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moepeak.demo.tiled import demo_block_spec
from moepeak.tiled import (ATTENTION_BACKENDS, attention_backend_context, check_attention_backend,
                           describe_attention_backend, sizes, tiled_block)
from moepeak.tiled.attention import auto_order, backend_order
from tiled_blocks import RefBlock

NAMES = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
SWITCHES = {"cudnn": "cudnn_sdp_enabled", "flash": "flash_sdp_enabled", "efficient": "mem_efficient_sdp_enabled",
            "math": "math_sdp_enabled"}


def sdpa_state():
    """torch's SDPA selection state: (enabled backends, priority order)."""
    enabled = tuple(n for n, s in SWITCHES.items() if getattr(torch.backends.cuda, s)())
    return enabled, tuple(torch._C._get_sdp_priority_order())


def expected_state(order):
    """The state sdpa_kernel(order, set_priority=True) sets."""
    rest = [b for b in torch._C._get_sdp_priority_order() if b not in [int(NAMES[n]) for n in order]]
    return tuple(n for n in SWITCHES if n in order), tuple(int(NAMES[n]) for n in order) + tuple(rest)


def block_and_input(T=24, B=2, H=64, nh=8, nkv=4, core=None, seed=0):
    kw = {} if core is None else {"core": core}
    blk = RefBlock(H=H, nh=nh, nkv=nkv, seed=seed, **kw)
    x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(seed + 1))
    gy = torch.randn(B, T, H, generator=torch.Generator().manual_seed(seed + 2))
    return blk, x, gy


def run(blk, x, gy, tile=None, **spec_fields):
    """[y, dx, *weight grads] of the block, tiled (tile, spec fields replaced) or untiled."""
    x = x.detach().requires_grad_(True)
    if tile is None:
        y = blk(x)
    else:
        y = tiled_block(x, dataclasses.replace(demo_block_spec(blk, x), **spec_fields), tile)
    return [y.detach()] + list(torch.autograd.grad(y, [x] + list(blk.parameters()), gy))


def recording_core(blk, seen, inner=None):
    """blk's core, recording torch's SDPA state and the heads of each call."""
    inner = inner or blk.attn.core

    def core(q, k, v):
        seen.append((sdpa_state(), q.shape[1]))
        return inner(q, k, v)
    return core


# ---------------------------------------------------------------- the option's checks

def test_check_attention_backend_accepts_the_choices_and_none():
    for name in ATTENTION_BACKENDS:
        assert check_attention_backend(name) == name
    assert check_attention_backend(None) == "torch"


@pytest.mark.parametrize("bad", ["CUDNN", "fast", "", 3, True, ["math"]])
def test_check_attention_backend_names_the_argument(bad):
    with pytest.raises(ValueError, match="my_arg must be one of"):
        check_attention_backend(bad, "my_arg")


@pytest.mark.parametrize("field,bad,match", [("attention_backend", "speedy", "spec.attention_backend"),
                                             ("head_group_budget", -1, "spec.head_group_budget"),
                                             ("head_group_budget", True, "spec.head_group_budget"),
                                             ("head_group_budget", "half", "spec.head_group_budget")])
def test_tiled_block_refuses_bad_fields_before_running(field, bad, match):
    blk, x, _ = block_and_input()
    calls = []
    spec = demo_block_spec(blk, x)
    pre_attn = spec.pre_attn
    spec = dataclasses.replace(spec, pre_attn=lambda *a: calls.append(1) or pre_attn(*a), **{field: bad})
    with pytest.raises(ValueError, match=match):
        tiled_block(x.requires_grad_(True), spec, 8)
    assert not calls


def test_auto_order_prefers_cudnn_only_where_it_runs():
    bf16 = torch.bfloat16
    assert auto_order("cuda", (9, 0), bf16, True) == ("cudnn", "flash", "efficient", "math")
    assert auto_order("cuda", (9, 0), torch.float16, True) == ("cudnn", "flash", "efficient", "math")
    assert auto_order("cuda", (8, 0), bf16, True) is None         # A100: torch's own choice
    assert auto_order("cuda", (10, 0), bf16, True) is None        # Blackwell: unmeasured, a GQA report
    assert auto_order("cuda", (9, 0), bf16, True, masked=True) is None  # cuDNN's masked-backward NaN
    assert auto_order("cuda", (9, 0), torch.float32, True) is None
    assert auto_order("cuda", (9, 0), bf16, False) is None        # no cuDNN
    assert auto_order("cpu", None, bf16, True) is None
    # a backend switched off globally (torch.backends.cuda.enable_*_sdp(False), a user's sdpa_kernel) stays off
    assert auto_order("cuda", (9, 0), bf16, True, enabled=("cudnn", "flash", "math")) == ("cudnn", "flash", "math")
    assert auto_order("cuda", (9, 0), bf16, True, enabled=("flash", "math")) is None


def test_named_orders_and_the_off_switch():
    cpu, f32 = torch.device("cpu"), torch.float32
    for name in ("cudnn", "flash", "efficient", "math"):  # forced: that one only
        assert backend_order(name, cpu, f32) == (name,)
    for off in (None, "torch"):
        assert backend_order(off, cpu, f32) is None
    assert backend_order("auto", cpu, torch.bfloat16) is None  # off CUDA: torch's own choice
    assert "cudnn > flash > efficient > math" in describe_attention_backend("auto")
    assert "torch's own" in describe_attention_backend(None)


# ---------------------------------------------------------------- the context around the core

@pytest.mark.parametrize("choice", ["math", "flash"])
def test_every_core_call_runs_under_the_order(choice):
    """Forward and recompute: each of the G core calls sees sdpa_kernel(order, set_priority=True)'s
    state; outside the block, and after it, torch's state is what it was."""
    blk, x, gy = block_and_input()
    seen = []
    blk.attn.core = recording_core(blk, seen)
    before = sdpa_state()
    run(blk, x, gy, tile=8, attention_backend=choice)
    assert sdpa_state() == before
    order = backend_order(choice, x.device, x.dtype)
    with sdpa_kernel([NAMES[n] for n in order], set_priority=True):
        want = sdpa_state()
    assert want == expected_state(order)
    assert [s for s, _ in seen] == [want] * 8  # 4 head groups, forward + recompute


def test_sdpa_kernel_receives_the_list_with_priority(monkeypatch):
    calls = []
    real = torch.nn.attention.sdpa_kernel

    def spy(backends, **kw):
        calls.append((list(backends), kw))
        return real(backends, **kw)
    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", spy)
    blk, x, gy = block_and_input()
    run(blk, x, gy, tile=8, attention_backend="math")
    assert calls == [([SDPBackend.MATH], {"set_priority": True})] * 8
    calls.clear()
    for off in (None, "torch", "auto"):  # auto: torch's own choice on the CPU
        run(blk, x, gy, tile=8, attention_backend=off)
    assert calls == []


@pytest.mark.parametrize("off", [None, "torch", "auto"])
def test_off_switch_leaves_torchs_choice_and_the_users_context(off):
    blk, x, gy = block_and_input()
    seen = []
    blk.attn.core = recording_core(blk, seen)
    with sdpa_kernel([SDPBackend.MATH]):  # the user's own choice around the step
        users = sdpa_state()
        run(blk, x, gy, tile=8, attention_backend=off)
    assert [s for s, _ in seen] == [users] * 8
    seen.clear()
    plain = sdpa_state()
    run(blk, x, gy, tile=8, attention_backend=off)
    assert [s for s, _ in seen] == [plain] * 8


def test_the_state_is_restored_when_the_core_raises():
    before = sdpa_state()
    with pytest.raises(RuntimeError, match="boom"):
        with attention_backend_context("math", torch.device("cpu"), torch.float32):
            raise RuntimeError("boom")
    assert sdpa_state() == before


def test_the_order_is_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="moepeak")
    for _ in range(3):
        with attention_backend_context("efficient", torch.device("cpu"), torch.float64):
            pass
    lines = [r.getMessage() for r in caplog.records if "backends efficient (" in r.getMessage()]
    assert len(lines) == 1 and "attention_backend='efficient'" in lines[0]


# ---------------------------------------------------------------- exactness on the CPU

def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _assert_close(want, got, rel=1e-5):
    for i, (w, g) in enumerate(zip(want, got)):
        assert _max_err(w, g) <= rel * max(w.abs().max().item(), 1e-3), (i, _max_err(w, g))


def varlen_core(position_ids):
    """moepeak_varlen_sdpa as the demo block's core: causal within each document of position_ids."""
    pytest.importorskip("transformers")
    from moepeak.hf.attention import varlen_sdpa_attention

    class Causal(torch.nn.Module):
        is_causal = True

    module = Causal()

    def core(q, k, v):
        out, _ = varlen_sdpa_attention(module, q, k, v, None, position_ids=position_ids)
        return out.transpose(1, 2)  # [B, T, h, d] -> the demo block's [B, h, T, d]
    return core


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_math_tiled_equals_math_untiled(packed, groups):
    """fp32 on the CPU, the untiled block under sdpa_kernel(MATH): every output and gradient equal
    within fp32 rounding (bitwise with one tile and one head group: the same ops in the same order)."""
    T = 24
    core = None
    if packed:  # three documents of 7, 10 and 7 tokens
        pos = torch.cat([torch.arange(7), torch.arange(10), torch.arange(7)]).unsqueeze(0)
        core = varlen_core(pos)
    blk, x, gy = block_and_input(T=T, core=core)
    with sdpa_kernel([SDPBackend.MATH]):
        want = run(blk, x, gy)
    got = run(blk, x, gy, tile=5, attention_backend="math", head_groups=groups)
    _assert_close(want, got)
    if groups == 1:
        whole = run(blk, x, gy, tile=T, attention_backend="math", head_groups=1)
        for w, g in zip(want, whole):
            assert torch.equal(w, g)


def test_packed_documents_do_not_attend_across():
    """The packed core is not the causal one (else the packed test above would prove nothing)."""
    pos = torch.cat([torch.arange(7), torch.arange(10), torch.arange(7)]).unsqueeze(0)
    blk, x, gy = block_and_input(core=varlen_core(pos))
    causal, _, _ = block_and_input()
    with sdpa_kernel([SDPBackend.MATH]):
        a, b = run(blk, x, gy)[0], run(causal, x, gy)[0]
    assert torch.allclose(a[:, :7], b[:, :7], rtol=1e-5, atol=1e-5)  # the first document: no earlier tokens
    assert not torch.allclose(a[:, 7:], b[:, 7:], rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- the head-group choice

def test_full_length_bytes_are_the_planners():
    from moepeak.plan.model import ModelShape, tiled_full_len_bytes
    shapes = [(2048, 16, 4, None, None), (2048, 16, 16, None, None), (1024, 8, 8, 128, 192)]  # qwen3, olmoe, MLA
    for hidden, nh, nkv, d, dqk in shapes:
        m = ModelShape(layers=2, hidden=hidden, experts=8, top_k=2, intermediate=64, vocab=100, heads=nh,
                       kv_heads=nkv, head_dim=d, qk_head_dim=dqk)
        for g in sizes.head_group_counts(nkv):
            mine = sizes.full_length_bytes_per_token(hidden, nh, nkv, m.dqk(), m.d(), 2, g)
            assert mine == tiled_full_len_bytes(m, 2, g), (hidden, nh, nkv, g)
    # the 2.0B model's table: 7.9 units with x at 4 head groups, 1.4 of them the group's backward
    unit = 2048 * 2
    at = {g: sizes.full_length_bytes_per_token(2048, 16, 4, 128, 128, 2, g) / unit for g in (1, 4)}
    assert round(at[4] + 1, 1) == 7.9 and round((at[1] - at[4]) / 3, 2) == round(1.375, 2)


def test_fewest_head_groups_fit_the_budget():
    shape = dict(hidden=2048, q_heads=16, kv_heads=4, qk_dim=128, v_dim=128, elem_bytes=2)
    per = {g: sizes.full_length_bytes_per_token(head_groups=g, **shape) for g in (1, 2, 4)}
    T = 1 << 19
    assert sizes.fewest_head_groups(4, None, T, **shape) == 4
    assert sizes.fewest_head_groups(4, int(T * per[1]), T, **shape) == 1
    assert sizes.fewest_head_groups(4, int(T * per[1]) - 1, T, **shape) == 2
    assert sizes.fewest_head_groups(4, int(T * per[2]) - 1, T, **shape) == 4
    assert sizes.fewest_head_groups(4, 0, T, **shape) == 4  # nothing fits: the most groups, as before
    assert sizes.head_group_counts(16) == [1, 2, 4, 8, 16]
    assert sizes.resolve_budget("free", torch.device("cpu")) is None  # off CUDA: the spec's head_groups


def _core_calls(blk, x, gy, **fields):
    """The q heads of each core call (forward, then recompute) of the tiled block."""
    seen = []
    blk.attn.core = recording_core(blk, seen)
    run(blk, x, gy, tile=8, **fields)
    return [heads for _, heads in seen]


def test_the_block_runs_the_fewest_groups_that_fit():
    blk, x, gy = block_and_input()  # 8 q / 4 kv heads of 8, H = 64, fp32, B = 2, T = 24
    shape = dict(hidden=64, q_heads=8, kv_heads=4, qk_dim=8, v_dim=8, elem_bytes=4)
    tokens = 2 * 24
    fits = {g: int(tokens * sizes.full_length_bytes_per_token(head_groups=g, **shape)) for g in (1, 2, 4)}
    for budget, heads in [(None, [2] * 8), (fits[1], [8] * 2), (fits[1] - 1, [4] * 4), (fits[2], [4] * 4),
                          (fits[2] - 1, [2] * 8), (0, [2] * 8)]:
        blk, x, gy = block_and_input()
        assert _core_calls(blk, x, gy, head_group_budget=budget) == heads, budget


def test_the_forwards_choice_is_kept_for_backward(monkeypatch):
    """"free" measured at the forward: a smaller budget by the backward does not change the groups
    (the recompute's core calls are the forward's, and the result equals the untiled block's)."""
    budgets = iter([1 << 40] + [0] * 100)
    monkeypatch.setattr(sizes, "free_memory_budget", lambda device: next(budgets))
    blk, x, gy = block_and_input()
    seen = []
    blk.attn.core = recording_core(blk, seen)
    got = run(blk, x, gy, tile=8, head_group_budget="free")
    assert [h for _, h in seen] == [8, 8]  # one call in the forward, one in the recompute
    blk2, _, _ = block_and_input()
    _assert_close(run(blk2, x, gy), got)


# ---------------------------------------------------------------- apply_moepeak

def _tiny_qwen3():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                      tie_word_embeddings=False, intermediate_size=48, moe_intermediate_size=24,
                                      num_experts=8, num_experts_per_tok=2)
    return transformers.Qwen3MoeForCausalLM(cfg)


def test_apply_moepeak_refuses_a_bad_backend_before_patching():
    from moepeak.hf import apply_moepeak
    model = _tiny_qwen3()
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        apply_moepeak(model, attention_backend="fastest", tile_tokens=4)
    assert getattr(model, "_moepeak_hf", None) is None
    assert all("forward" not in vars(m) for m in model.modules())


def _sdpa_states(monkeypatch):
    """Records torch's SDPA state at each scaled_dot_product_attention call."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(sdpa_state())
        return real(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("tile", [None, 4])
def test_apply_moepeak_runs_the_attention_under_the_backend(monkeypatch, tile):
    """Untiled (every self_attn) and tiled (the core): training calls run math first, eval calls
    torch's own choice; the loss equals the stock model's within fp32 rounding."""
    from moepeak.hf import apply_moepeak
    stock, model = _tiny_qwen3(), _tiny_qwen3()
    report = apply_moepeak(model, attention_backend="math", tile_tokens=tile, checkpoint=False, experts=False)
    assert any(p.startswith("attention_backend: 2 self_attn modules") for p in report.patched), report
    seen = _sdpa_states(monkeypatch)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    for m in (stock, model):
        m.train()
    want = stock(input_ids=ids, labels=ids).loss
    plain = sdpa_state()
    assert set(seen) == {plain}
    seen.clear()
    got = model(input_ids=ids, labels=ids).loss
    got.backward()
    order = expected_state(("math",))
    assert seen and set(seen) == {order}, seen
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    seen.clear()
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert seen and set(seen) == {plain}


def test_apply_moepeak_off_switch_patches_nothing():
    from moepeak.hf import apply_moepeak
    model = _tiny_qwen3()
    report = apply_moepeak(model, attention_backend=None, checkpoint=False, experts=False)
    assert not any("forward" in vars(layer.self_attn) for layer in model.model.layers)
    assert any(p.startswith("attention_backend: torch's own") for p in report.left_alone), report


@pytest.mark.parametrize("head_groups", [None, "auto"])
def test_apply_moepeak_measures_the_budget_only_when_asked(monkeypatch, head_groups):
    """By default the tiled layers run num_key_value_heads groups and measure nothing;
    attention_head_groups="auto" runs the fewest head groups that fit the measured budget (here:
    all heads in one call), measured once per layer's forward."""
    from moepeak.hf import apply_moepeak
    measured = []
    monkeypatch.setattr(sizes, "free_memory_budget", lambda device: measured.append(device) or 1 << 40)
    seen = _sdpa_heads(monkeypatch)
    model = _tiny_qwen3()
    report = apply_moepeak(model, tile_tokens=4, checkpoint=False, experts=False, attention_head_groups=head_groups)
    model.train()
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids, position_ids=torch.arange(12).unsqueeze(0)).loss.backward()
    tiled = next(p for p in report.patched if p.startswith("tile_tokens"))
    if head_groups is None:
        assert measured == [] and set(seen) == {2}, (measured, seen)  # 2 kv-head groups of 2 q heads
        assert "num_key_value_heads head groups" in tiled, tiled
    else:
        assert len(measured) == 2 and set(seen) == {4}  # one forward per layer, all 4 q heads per call
        assert "free GPU memory" in tiled, tiled


def test_apply_moepeak_auto_head_groups_refused_under_a_sequence_group():
    """Free memory differs by rank, and every rank of a sequence group must make the same
    attention calls: "auto" head groups are refused there, naming the option, before patching."""
    from moepeak.hf import apply_moepeak
    model = _tiny_qwen3()
    with pytest.raises(ValueError, match="attention_head_groups='auto'.*same attention calls"):
        apply_moepeak(model, tile_tokens=4, sequence_group="engine", sequence_loss="sum", attention_head_groups="auto")
    assert getattr(model, "_moepeak_hf", None) is None
    with pytest.raises(ValueError, match="it needs tile_tokens"):
        apply_moepeak(_tiny_qwen3(), attention_head_groups="auto")


def _sdpa_heads(monkeypatch):
    """Records the q heads of each scaled_dot_product_attention call."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        seen.append(q.shape[1])
        return real(q, *args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def test_hf_spec_takes_the_budget_unless_forced():
    pytest.importorskip("transformers")
    from moepeak.hf.tiled import hf_moe_layer_spec
    model = _tiny_qwen3()
    layer = model.model.layers[0]
    x = torch.randn(1, 6, 32)
    rope = model.model.rotary_emb(x, torch.arange(6).unsqueeze(0))
    spec = hf_moe_layer_spec(layer, x, position_embeddings=rope, attention_mask=None)
    assert (spec.head_groups, spec.head_group_budget) == (2, None)  # one group per kv head by default
    spec = hf_moe_layer_spec(layer, x, position_embeddings=rope, attention_mask=None, head_group_budget="free")
    assert (spec.head_groups, spec.head_group_budget) == (2, "free")
    spec = hf_moe_layer_spec(layer, x, position_embeddings=rope, attention_mask=None, head_groups=1)
    assert (spec.head_groups, spec.head_group_budget) == (1, None)
    assert spec.attention_backend is None  # the HF core enters the order itself (it knows the mask)


# ---------------------------------------------------------------- CUDA: the default against fp64

def _cuda_block(dtype, core=None, kv_heads=2):
    # head_dim 128: H = 512, 4 q heads, GQA (2 kv heads) or MHA (4)
    kw = {} if core is None else {"core": core}
    return RefBlock(H=512, nh=4, nkv=kv_heads, E=4, K=2, I=256, dtype=dtype, seed=0, **kw).cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("docs", [None, "varlen"])
@pytest.mark.parametrize("groups", [None, 1])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_cuda_auto_within_twice_torch_default_error(docs, groups, kv_heads):
    """bf16, head_dim 128, T = 4096: the tiled block under "auto" (cuDNN first on Hopper) against the
    fp64 block; each output and gradient within 2x the error of the untiled bf16 block on torch's
    default backend (plus one bf16 ulp of the tensor's scale). Packed: moepeak_varlen_sdpa's causal
    calls per document, two of them 64 tokens past a multiple of 128 (the tail cuDNN's masked
    backward gets wrong). On Hopper the core of the MHA block ran cuDNN (GQA: whichever backend
    torch accepts it on first)."""
    T, H = 4096, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, T, H, device="cuda", generator=g)
    gy = torch.randn(1, T, H, device="cuda", generator=g)
    pos = torch.cat([torch.arange(n) for n in (1088, 2112, 896)]).unsqueeze(0).cuda()
    core = None if docs is None else varlen_core(pos)
    ref = run(_cuda_block(torch.float64, core, kv_heads), x.double(), gy.double())
    blk = _cuda_block(torch.bfloat16, core, kv_heads)
    stock = run(blk, x.bfloat16(), gy.bfloat16())
    fields = {} if groups is None else {"head_groups": groups}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tiled = run(blk, x.bfloat16(), gy.bfloat16(), tile=1024, attention_backend="auto", **fields)
    ops = {e.key for e in prof.key_averages()}
    if torch.cuda.get_device_capability()[0] == 9 and kv_heads == 4:
        assert "aten::_scaled_dot_product_cudnn_attention" in ops, sorted(o for o in ops if "attention" in o)
    for i, (r, s, t) in enumerate(zip(ref, stock, tiled)):
        e_stock, e_tiled = _max_err(s, r), _max_err(t, r)
        assert e_tiled <= 2 * e_stock + 2 ** -8 * r.abs().max().item(), (i, e_tiled, e_stock)


@pytest.mark.cuda
def test_cuda_untiled_attention_under_auto_within_twice_torch_default_error():
    """The untiled block's attention under attention_backend_context("auto") (what apply_moepeak's
    self_attn wrapper does), same bound."""
    T, H = 4096, 512
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, T, H, device="cuda", generator=g)
    gy = torch.randn(1, T, H, device="cuda", generator=g)
    ref = run(_cuda_block(torch.float64), x.double(), gy.double())
    blk = _cuda_block(torch.bfloat16)
    stock = run(blk, x.bfloat16(), gy.bfloat16())
    with attention_backend_context("auto", x.device, torch.bfloat16):
        got = run(blk, x.bfloat16(), gy.bfloat16())
    for i, (r, s, t) in enumerate(zip(ref, stock, got)):
        assert _max_err(t, r) <= 2 * _max_err(s, r) + 2 ** -8 * r.abs().max().item(), i


@pytest.mark.parametrize("tile", [None, 4])
def test_apply_moepeak_tells_auto_whether_the_call_is_masked(monkeypatch, tile):
    """"auto" stays torch's own choice for calls with an explicit mask (cuDNN's masked-backward
    NaN): the tiled core and the self_attn wrapper pass masked=True exactly when the layer passes
    an attention_mask (here: a padding mask), False for plain causal calls."""
    from moepeak.hf import apply_moepeak
    from moepeak.tiled import attention as attention_module
    flags = []
    real = attention_module.backend_order

    def spy(choice, device, dtype, masked=False):
        if choice == "auto":  # (the tiled block's own context for the HF spec is None: the core enters "auto")
            flags.append(masked)
        return real(choice, device, dtype, masked)
    monkeypatch.setattr(attention_module, "backend_order", spy)
    model = _tiny_qwen3()
    apply_moepeak(model, tile_tokens=tile, checkpoint=False, experts=False, attention_backend="auto")
    model.train()
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    assert flags and not any(flags)
    flags.clear()
    pad = torch.ones(1, 12, dtype=torch.long)
    pad[0, :2] = 0
    model(input_ids=ids, labels=ids, attention_mask=pad).loss.backward()
    assert flags and all(flags)
