"""SCO tests: bitwise gradients vs torch.utils.checkpoint(use_reentrant=False),
the schedule (one offload per block, slots, order, prefetch), RNG, gradient
accumulation, eval/no_grad, errors, opcheck, FSDP2 (gloo); GPU: the same on
CUDA plus peak memory flat in depth and ordering under delayed side streams."""
import copy

import pytest
import torch

import moepeak
from moepeak.sco import SCOConfig, SCOOffloader
from tests.refs import SCOBlock, sco_stack_forward

H, B, T = 16, 2, 8


def _stack(n, dropout=0.0, device="cpu", dtype=torch.float32, h=H, attention=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList([SCOBlock(h, dropout=dropout, attention=attention) for _ in range(n)]).to(device, dtype)


def _sco_forward(blocks, x, sco, keep_last=False, **kw):
    for i, b in enumerate(blocks):
        x = moepeak.sco_checkpoint(b, x, sco_offloader=sco, sco_keep_on_gpu=keep_last and i == len(blocks) - 1, **kw)
    return x


def _assert_grads_equal(ma, mb, xa=None, xb=None):
    for (na, pa), (_, pb) in zip(ma.named_parameters(), mb.named_parameters()):
        assert pa.grad is not None and pb.grad is not None, na
        assert torch.equal(pa.grad, pb.grad), f"{na}: max diff {(pa.grad - pb.grad).abs().max().item()}"
    if xa is not None:
        assert torch.equal(xa.grad, xb.grad), f"x.grad max diff {(xa.grad - xb.grad).abs().max().item()}"


def _compare(n=3, dropout=0.0, device="cpu", dtype=torch.float32, keep_last=False, sco=None, x_grad=True, t=T, h=H):
    ref = _stack(n, dropout, device, dtype, h=h)
    ours = copy.deepcopy(ref)
    sco = sco or SCOOffloader()
    x = torch.randn(B, t, h, device=device, dtype=dtype)
    xa = x.clone().requires_grad_(x_grad)
    xb = x.clone().requires_grad_(x_grad)
    torch.manual_seed(123)
    ya = sco_stack_forward(ref, xa, "torch", scale=0.5)
    ya.float().square().sum().backward()
    torch.manual_seed(123)
    yb = _sco_forward(ours, xb, sco, keep_last=keep_last, scale=0.5)
    assert torch.equal(ya, yb)
    yb.float().square().sum().backward()
    _assert_grads_equal(ref, ours, xa if x_grad else None, xb if x_grad else None)
    return sco


# ---------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_grad", [True, False])
def test_grads_bitwise_vs_torch_checkpoint(dtype, x_grad):
    sco = _compare(n=3, dtype=dtype, x_grad=x_grad, t=7)  # odd T
    st = sco.stats("cpu")
    assert st["live"] == 0 and st["gpu_held"] == 0


def test_dropout_rng_preserved():
    # dropout inside the block: recompute must replay the same mask
    _compare(n=3, dropout=0.3)
    # and the global RNG continues as after torch's checkpoint
    torch.manual_seed(5)
    _compare(n=2, dropout=0.3)
    a = torch.rand(4)
    torch.manual_seed(5)
    _compare(n=2, dropout=0.3)
    assert torch.equal(a, torch.rand(4))


def test_one_offload_per_block_slots_and_order():
    n = 4
    sco = SCOOffloader(SCOConfig(prefetch=1))
    blocks = _stack(n)
    x = torch.randn(B, T, H, requires_grad=True)
    y = _sco_forward(blocks, x, sco)
    st = sco.stats("cpu")
    nbytes = B * T * H * 4
    assert st["offloads"] == n and st["offloaded_bytes"] == n * nbytes  # exactly one tensor per block
    offs = [e for e in st["log"] if e[0] == "offload"]
    assert [e[1] for e in offs] == list(range(n))
    slots = [e[2] for e in offs]
    assert len(set(slots)) == n  # each block its own slot
    assert st["live"] == n
    y.sum().backward()
    st = sco.stats("cpu")
    order = [(e[0], e[1]) for e in st["log"] if e[0] != "offload"]
    # backward: block 3 loads on demand, then each reload prefetches the block before it
    assert order == [("load", 3), ("reload", 3), ("prefetch", 2), ("reload", 2), ("prefetch", 1),
                     ("reload", 1), ("prefetch", 0), ("reload", 0)]
    assert st["live"] == 0 and st["reloads"] == n
    # next iteration reuses the same slots
    y = _sco_forward(blocks, x, sco)
    assert [e[2] for e in sco.stats("cpu")["log"] if e[0] == "offload"] == slots
    y.sum().backward()


def test_keep_last_and_prefetch_depth():
    sco = SCOOffloader(SCOConfig(prefetch=2))
    _compare(n=4, keep_last=True, sco=sco)
    st = sco.stats("cpu")
    assert st["kept"] == 1 and st["offloads"] == 3
    pre = [e[1] for e in st["log"] if e[0] == "prefetch"]
    assert pre == [2, 1, 0]  # reload of 3 (kept) prefetches 2, 1; reload of 2 prefetches 0


def test_gradient_accumulation_own_slots():
    n = 3
    ref = _stack(n, dropout=0.2)
    ours = copy.deepcopy(ref)
    sco = SCOOffloader()
    xs = [torch.randn(B, T, H) for _ in range(2)]
    torch.manual_seed(7)
    la = sum(sco_stack_forward(ref, x.clone().requires_grad_(), "torch").square().sum() for x in xs)
    la.backward()
    torch.manual_seed(7)
    lb = sum(_sco_forward(ours, x.clone().requires_grad_(), sco).square().sum() for x in xs)
    st = sco.stats("cpu")
    assert st["live"] == 2 * n
    assert len({e[2] for e in st["log"] if e[0] == "offload"}) == 2 * n  # each forward its own slots
    lb.backward()
    _assert_grads_equal(ref, ours)
    assert sco.stats("cpu")["live"] == 0


def test_autocast_state_replayed():
    ref = _stack(2)
    ours = copy.deepcopy(ref)
    sco = SCOOffloader()
    x = torch.randn(B, T, H)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = sco_stack_forward(ref, xa, "torch")
        yb = _sco_forward(ours, xb, sco)
    assert torch.equal(ya, yb)
    ya.float().square().sum().backward()  # backward outside autocast: recompute must re-enter it
    yb.float().square().sum().backward()
    _assert_grads_equal(ref, ours, xa, xb)


def test_tuple_output_and_kwargs_and_nontensor_args():
    lin = torch.nn.Linear(H, H)
    lin2 = copy.deepcopy(lin)

    def fn(x, mask, k, *, bias):
        y = torch.tanh(lin(x)) * mask * k + bias
        return y, y.sum(-1)

    def fn2(x, mask, k, *, bias):
        y = torch.tanh(lin2(x)) * mask * k + bias
        return y, y.sum(-1)

    x = torch.randn(B, T, H)
    mask = torch.rand(B, T, 1)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    sco = SCOOffloader()
    a, sa = torch.utils.checkpoint.checkpoint(fn2, xa, mask, 3, bias=0.5, use_reentrant=False)
    b, sb = moepeak.sco_checkpoint(fn, xb, mask, 3, bias=0.5, sco_offloader=sco)
    assert torch.equal(a, b) and torch.equal(sa, sb)
    (a.square().sum() + sa.sum()).backward()
    (b.square().sum() + sb.sum()).backward()
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(lin.weight.grad, lin2.weight.grad)
    assert sco.stats("cpu")["offloads"] == 1  # only x (the first tensor arg), not mask


def test_apply_sco_module_class_eval_and_no_grad():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList([SCOBlock(H, dropout=0.1) for _ in range(3)])
            self.head = torch.nn.Linear(H, 3)

        def forward(self, x):
            for blk in self.layers:
                x = blk(x)
            return self.head(x)

    ref, ours = Model(), Model()
    keys = list(ours.state_dict())
    cfg = SCOConfig(keep_last=True)
    moepeak.apply_sco(ours, blocks=SCOBlock, config=cfg)
    assert list(ours.state_dict()) == keys
    with pytest.raises(ValueError, match="already applied"):
        moepeak.apply_sco(ours, blocks=ours.layers, config=cfg)
    sco = moepeak.sco.offloader_of(ours)  # the runtime apply_sco made for cfg
    assert sco.config is cfg and moepeak.sco.offloader_of(ours.layers[0]) is sco
    for blk in ref.layers:
        fwd = blk.forward
        blk.forward = lambda x, _f=fwd: torch.utils.checkpoint.checkpoint(_f, x, use_reentrant=False)
    x = torch.randn(B, T, H)
    torch.manual_seed(3)
    ref(x).square().sum().backward()
    torch.manual_seed(3)
    ours(x).square().sum().backward()
    _assert_grads_equal(ref, ours)
    st = sco.stats("cpu")
    assert st["offloads"] == 2 and st["kept"] == 1 and st["live"] == 0
    # eval and no_grad: no offload, same numbers as the plain model
    ours.eval()
    ref.eval()
    assert torch.equal(ours(x), ref(x))
    ours.train()
    with torch.no_grad():
        ours(x)
    st2 = sco.stats("cpu")
    assert st2["offloads"] == 2 and st2["kept"] == 1


@pytest.mark.parametrize("keep_last, kept", [(0, 0), (False, 0), (True, 1), (2, 2), (4, 4), (9, 4)])
def test_apply_sco_keep_last_counts_blocks(keep_last, kept):
    """keep_last = n: the last n blocks' inputs stay on the device (all of them when n >= the
    blocks), the others go to the host; the gradients are torch checkpoint's, bit for bit."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[SCOBlock(H) for _ in range(4)])
    ours = copy.deepcopy(ref)
    sco = SCOOffloader(SCOConfig(keep_last=keep_last))
    moepeak.apply_sco(ours, blocks=list(ours), offloader=sco)
    for blk in ref:
        fwd = blk.forward
        blk.forward = lambda x, _f=fwd: torch.utils.checkpoint.checkpoint(_f, x, use_reentrant=False)
    x = torch.randn(B, T, H)
    ref(x).square().sum().backward()
    ours(x).square().sum().backward()
    _assert_grads_equal(ref, ours)
    st = sco.stats("cpu")
    assert st["kept"] == kept and st["offloads"] == 4 - kept and st["live"] == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "2", None])
def test_keep_last_must_be_a_count(bad):
    with pytest.raises(ValueError, match=r"SCOConfig.keep_last must be a bool or an int >= 0, got"):
        SCOConfig(keep_last=bad)


def test_arena_too_small_cannot_grow():
    sco = SCOOffloader(SCOConfig(arena_bytes=B * T * H * 4 * 2, grow=False))
    blocks = _stack(3)
    x = torch.randn(B, T, H, requires_grad=True)
    with pytest.raises(RuntimeError, match="arena too small and cannot grow"):
        _sco_forward(blocks, x, sco)
    import gc
    gc.collect()
    assert sco.stats("cpu")["live"] == 0  # the two offloaded slots went with their graphs
    sco2 = SCOOffloader(SCOConfig(max_arena_bytes=1000, grow_bytes=1 << 20))
    with pytest.raises(RuntimeError, match="arena too small"):
        _sco_forward(blocks, x, sco2)


def _both(fn_ours, fn_ref, n=2, attention=True, seed=0):
    """Run fn on a block stack under torch's checkpoint and under SCO from the
    same start; return (ref blocks, ours blocks, ref result, our result)."""
    ref = _stack(n, attention=attention, seed=seed)
    ours = copy.deepcopy(ref)
    x = torch.randn(B, T, H)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ra = fn_ref(ref, xa)
    rb = fn_ours(ours, xb)
    return ref, ours, xa, xb, ra, rb


def _torch_forward(blocks, x):
    return sco_stack_forward(blocks, x, "torch")


def test_second_backward_with_retain_graph_matches_torch():
    sco = SCOOffloader()

    def run(fwd):
        def f(blocks, x):
            y = fwd(blocks, x).square().sum()
            y.backward(retain_graph=True)
            y.backward()  # accumulates, as for torch's checkpoint
        return f

    ref, ours, xa, xb, _, _ = _both(run(lambda b, x: _sco_forward(b, x, sco)), run(_torch_forward))
    _assert_grads_equal(ref, ours, xa, xb)
    assert sco.stats("cpu")["live"] == 0


def test_create_graph_gradient_penalty_matches_torch():
    # A gradient penalty: the second-order term flows through the recomputed
    # activations exactly as through torch's checkpoint.
    sco = SCOOffloader()

    def run(fwd):
        def f(blocks, x):
            y = fwd(blocks, x).square().sum()
            (gx,) = torch.autograd.grad(y, x, create_graph=True)
            assert gx.requires_grad
            (y + gx.square().sum()).backward()
        return f

    ref, ours, xa, xb, _, _ = _both(run(lambda b, x: _sco_forward(b, x, sco)), run(_torch_forward),
                                    attention=False)
    _assert_grads_equal(ref, ours, xa, xb)


def _scaled(x, w):
    return (x.sin() * w).sum()


@pytest.mark.parametrize("checkpoint", ["torch", "sco"])
def test_inplace_change_of_a_saved_argument_raises(checkpoint):
    # w (no grad) is saved by the block's mul; changing it before backward
    # must raise as plain autograd and torch's checkpoint do, never give a
    # gradient computed from the new value.
    x = torch.randn(B, T, H, requires_grad=True)
    w = torch.randn(B, T, H)
    if checkpoint == "torch":
        y = torch.utils.checkpoint.checkpoint(_scaled, x, w, use_reentrant=False)
    else:
        y = moepeak.sco_checkpoint(_scaled, x, w, sco_offloader=SCOOffloader())
    w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def _ck(checkpoint, tier, tmp_path):
    """checkpoint(fn, x): torch's, or SCO with the boundary on the given tier."""
    if checkpoint == "torch":
        return lambda fn, x: torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)
    spill = dict(spill_dir=str(tmp_path), host_budget_bytes=0) if tier == "disk" else {}
    sco = SCOOffloader(SCOConfig(**spill))
    return lambda fn, x: moepeak.sco_checkpoint(fn, x, sco_offloader=sco, sco_keep_on_gpu=tier == "device")


@pytest.mark.parametrize("checkpoint, tier", [("torch", None), ("sco", "host"), ("sco", "device"), ("sco", "disk")])
@pytest.mark.parametrize("x_grad", [True, False])
def test_inplace_change_of_the_boundary_raises(checkpoint, tier, x_grad, tmp_path):
    # The block's input modified in place after its forward: torch's checkpoint raises at
    # backward; SCO must too, on every tier, never recompute from the new values.
    torch.manual_seed(0)
    blk = SCOBlock(H)
    x0 = torch.randn(B, T, H, requires_grad=x_grad)
    x = x0 * 1 if x_grad else x0  # a non-leaf when it needs grad (a leaf refuses in-place ops)
    y = _ck(checkpoint, tier, tmp_path)(blk, x)
    with torch.no_grad():
        x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.square().sum().backward()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_inplace_change_of_the_base_of_a_dropped_boundary(tier, tmp_path):
    # The boundary is a view of a larger tensor; the caller drops the view and changes the
    # base in place (a view keeps its base alive, not the other way round). On CPU's host
    # tier the engine holds the boundary itself (its version counter is the base's): the
    # error is raised. On the disk tier the engine holds only a copy and a weak reference,
    # so it cannot see the change once the view is gone (torch's checkpoint, holding the
    # view, would raise); the recompute uses the forward's bytes, so the gradients are those
    # of the unchanged input, never of the new values.
    torch.manual_seed(0)
    blk = SCOBlock(H)
    ref = copy.deepcopy(blk)
    base = torch.randn(B + 1, T, H)
    x0 = base[:B].clone()
    x = base[:B]  # a contiguous view of base
    y = _ck("sco", tier, tmp_path)(blk, x)
    del x
    base.add_(1.0)
    if tier == "host":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.square().sum().backward()
        return
    y.square().sum().backward()
    torch.utils.checkpoint.checkpoint(ref, x0, use_reentrant=False).square().sum().backward()
    _assert_grads_equal(ref, blk)


def test_saved_argument_unchanged_gives_torch_gradient():
    x = torch.randn(B, T, H)
    w = torch.randn(B, T, H, requires_grad=True)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(_scaled, xa, w, use_reentrant=False).backward()
    ga, w.grad = w.grad, None
    moepeak.sco_checkpoint(_scaled, xb, w, sco_offloader=SCOOffloader()).backward()
    assert torch.equal(xa.grad, xb.grad) and torch.equal(ga, w.grad)


def test_tensors_passed_only_by_keyword():
    sco = SCOOffloader()

    def fn(*, x, w):
        return (x.sin() * w).sum()

    x, w0 = torch.randn(B, T, H), torch.randn(B, T, H)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    wa, wb = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    ya = torch.utils.checkpoint.checkpoint(fn, x=xa, w=wa, use_reentrant=False)
    yb = moepeak.sco_checkpoint(fn, x=xb, w=wb, sco_offloader=sco)
    assert torch.equal(ya, yb)
    ya.backward()
    yb.backward()
    assert torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)
    assert sco.stats("cpu")["offloads"] == 1  # the first tensor keyword argument was the boundary


def test_graph_dropped_without_backward_frees_slots():
    sco = SCOOffloader()
    blocks = _stack(3)
    y = _sco_forward(blocks, torch.randn(B, T, H, requires_grad=True), sco)
    assert sco.stats("cpu")["live"] == 3
    del y
    import gc
    gc.collect()
    st = sco.stats("cpu")
    assert st["live"] == 0 and st["discarded"] == 3


def test_replay_stops_after_last_saved_tensor():
    # The block's last GEMM (down) and residual add produce nothing backward
    # reads: like torch's checkpoint (early stop), the replay must stop before
    # launching them. Count module calls in forward + backward for both.
    def count_calls(blocks):
        calls = {"up": 0, "down": 0}
        for b in blocks:
            for name in calls:
                getattr(b, name).register_forward_hook(lambda *_, _n=name: calls.__setitem__(_n, calls[_n] + 1))
        return calls

    n = 3
    ref = _stack(n, attention=False)
    ours = copy.deepcopy(ref)
    ca, cb = count_calls(ref), count_calls(ours)
    x = torch.randn(B, T, H)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    sco_stack_forward(ref, xa, "torch").square().sum().backward()
    _sco_forward(ours, xb, SCOOffloader()).square().sum().backward()
    _assert_grads_equal(ref, ours, xa, xb)
    assert cb == ca, (ca, cb)
    assert cb == {"up": 2 * n, "down": n}  # up: forward + replay; down: forward only


def test_stats_counters_and_devices():
    sco = SCOOffloader()
    st = sco.stats()  # no engine yet: every counter present and zero, none created
    assert st["offloads"] == 0 and st["kept"] == 0 and st["live"] == 0 and not sco.devices()
    _compare(n=2, sco=sco)
    assert sco.stats()["offloads"] == 2 and sco.stats("cpu") == sco.stats()
    assert sco.stats("meta")["offloads"] == 0  # a device this offloader never ran on
    sco.engine("meta")
    with pytest.raises(ValueError, match="ambiguous"):
        sco.stats()


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_in_flight"):
        SCOConfig(max_in_flight=0)
    with pytest.raises(ValueError, match="grow=False"):
        SCOConfig(grow=False)
    with pytest.raises(TypeError, match="needs a tensor argument"):
        moepeak.sco_checkpoint(lambda k: k, 3)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        moepeak.sco_checkpoint(lambda k: k, torch.ones(1), use_reentrant=True)
    with pytest.raises(TypeError, match="sco_offloader must be a moepeak.SCOOffloader, got int"):
        moepeak.sco_checkpoint(lambda k: k, torch.ones(1, requires_grad=True), sco_offloader=3)
    with pytest.raises(TypeError, match=r"takes sco_offloader=moepeak.SCOOffloader\(config\)"):
        moepeak.sco_checkpoint(lambda k: k, torch.ones(1, requires_grad=True), sco_config=SCOConfig())
    with pytest.raises(TypeError, match="config must be a moepeak.SCOConfig, got dict"):
        SCOOffloader({"keep_last": 2})
    with pytest.raises(ValueError, match="bytes"):
        torch.ops.moepeak.sco_offload(torch.ones(4), torch.empty(3, dtype=torch.uint8))


def test_opcheck():
    x = torch.randn(3, 5)
    host = torch.empty(60, dtype=torch.uint8)
    torch.library.opcheck(torch.ops.moepeak.sco_offload.default, (x, host))
    out = torch.empty(3, 5)
    torch.library.opcheck(torch.ops.moepeak.sco_reload.default, (host, out))
    torch.ops.moepeak.sco_offload(x, host)
    torch.ops.moepeak.sco_reload(host, out)
    assert torch.equal(out, x)


def _fsdp_rank(rank, world, _unused):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[SCOBlock(H, dropout=0.1) for _ in range(3)])
    sco_first, fsdp_first = copy.deepcopy(ref), copy.deepcopy(ref)
    scos = [SCOOffloader(), SCOOffloader()]
    for blk in ref:
        fwd = blk.forward
        blk.forward = lambda x, _f=fwd: torch.utils.checkpoint.checkpoint(_f, x, use_reentrant=False)
    moepeak.apply_sco(sco_first, blocks=list(sco_first), offloader=scos[0])  # apply_sco, then fully_shard
    for m in (ref, sco_first, fsdp_first):
        for blk in m:
            fully_shard(blk)
        fully_shard(m)
    moepeak.apply_sco(fsdp_first, blocks=list(fsdp_first), offloader=scos[1])  # fully_shard, then apply_sco
    x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(1 + rank))
    for step in range(2):
        for m in (ref, sco_first, fsdp_first):
            torch.manual_seed(10 + step + rank)
            m(x).square().sum().backward()
    for m in (sco_first, fsdp_first):
        for (n, a), (_, b) in zip(ref.named_parameters(), m.named_parameters()):
            assert torch.equal(a.grad.to_local(), b.grad.to_local()), n
    # fully_shard's default mesh is on the accelerator when one is present: it
    # moves the blocks (and their inputs) there, so SCO ran on that device.
    dev = next(sco_first.parameters()).to_local().device
    for sco in scos:
        assert sco.devices() == [dev if dev.type == "cpu" else torch.device("cuda", dev.index)]
        st = sco.stats()  # the one engine used, whatever its device
        assert st["live"] == 0 and st["offloads"] == 4 and st["kept"] == 2  # keep_last: 2 offloads + 1 kept per step


def test_fsdp2_gloo():
    pytest.importorskip("torch.distributed.fsdp")
    from tests.dist_utils import run_ranks

    run_ranks(2, _fsdp_rank, None, timeout=150)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
def _math_sdpa():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep_last", [False, True])
def test_cuda_grads_bitwise(dtype, keep_last):
    # SDPA's flash / mem-efficient backward accumulate dQ with atomics (not
    # bitwise run to run, with or without checkpointing): compare on the math backend.
    with _math_sdpa():
        sco = _compare(n=4, dropout=0.1, device="cuda", dtype=dtype, keep_last=keep_last, t=257, h=64)
        st = sco.stats("cuda")
    assert st["offloads"] == 4 - keep_last and st["live"] == 0 and st["gpu_held"] == 0
    assert st["arena_bytes"] > 0
    sco.free()
    assert sco.stats("cuda")["arena_bytes"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("w", [1, 3])
def test_cuda_delayed_side_streams_still_exact(w):
    # The copy and load streams sleep ~tens of ms before each copy: a missing
    # event (compute reading a reload early, or x freed before its D2H) gives
    # wrong gradients here.
    sco = SCOOffloader(SCOConfig(max_in_flight=w, prefetch=2))
    sco.engine("cuda").delay_cycles = 50_000_000
    for it in range(2):  # second iteration: slot reuse after the previous loads
        with _math_sdpa():
            _compare(n=5, dropout=0.1, device="cuda", dtype=torch.bfloat16, sco=sco, t=1024, h=256)
    st = sco.stats("cuda")
    assert st["max_in_flight"] <= w and st["live"] == 0
    assert st["compute_waits"] >= 1  # the copies were slow: W was enforced by compute waiting
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_peak_flat_in_depth():
    h, t = 1024, 4096  # boundary: 4096 x 1024 x 2 B = 8 MiB; block weights 8 H^2 x 2 B = 16 MiB
    bnd = t * h * 2

    def peak(n, mode):
        blocks = _stack(n, device="cuda", dtype=torch.bfloat16, h=h, attention=False)
        sco = SCOOffloader(SCOConfig(max_in_flight=1, prefetch=1))
        x = torch.randn(1, t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2):  # second step: arena allocated, allocator warm
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = _sco_forward(blocks, x, sco) if mode == "sco" else sco_stack_forward(blocks, x, "torch")
            y.float().sum().backward()
            torch.cuda.synchronize()
            p = torch.cuda.max_memory_allocated() - base
            for q in list(blocks.parameters()) + [x]:  # grads stay allocated: part of the base
                q.grad.zero_()
        sco.free()
        return p

    s4, s16 = peak(4, "sco"), peak(16, "sco")
    t4, t16 = peak(4, "torch"), peak(16, "torch")
    # torch keeps 12 more boundaries; SCO's working set does not grow with depth
    assert t16 - t4 >= 11 * bnd, (t4, t16)
    assert s16 - s4 <= 2 * bnd, (s4, s16)
    assert s16 < t16 - 8 * bnd


class _CountingC:
    """Stands in for moepeak._C in an offloader's engines: counts every call by name."""

    def __init__(self, real):
        self._real, self.calls = real, {}

    def __getattr__(self, name):
        fn = getattr(self._real, name)

        def wrapped(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a, **k)

        return wrapped


@pytest.mark.cuda
def test_cuda_steady_state_never_blocks_the_host(monkeypatch):
    # After a warm-up step the schedule must be pure enqueue: no event/stream
    # synchronize, no pinned allocation (cudaHostAlloc blocks), no new events,
    # no torch-level synchronize either; the GPU tensors are released by event
    # polling or by compute waits (W rule / reload), never by a host wait.
    from moepeak.testing import sco_extension

    blocks = _stack(6, device="cuda", dtype=torch.bfloat16, h=256, attention=False)
    sco = SCOOffloader(SCOConfig(max_in_flight=2, prefetch=1))
    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _sco_forward(blocks, x, sco, keep_last=True).float().sum().backward()  # warm-up: arena, events
    torch.cuda.synchronize()
    before = dict(sco.stats("cuda"))
    with sco_extension(sco, _CountingC(moepeak._C)) as fake:
        torch_syncs = []
        for mod, name in ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                          (torch.cuda.Event, "synchronize"), (torch.Tensor, "item")):
            orig = getattr(mod, name)
            monkeypatch.setattr(mod, name,
                                lambda *a, _o=orig, _n=name, **k: (torch_syncs.append(_n), _o(*a, **k))[1])
        for _ in range(2):
            _sco_forward(blocks, x, sco, keep_last=True).float().sum().backward()
        monkeypatch.undo()
    torch.cuda.synchronize()
    after = sco.stats("cuda")
    assert not torch_syncs, torch_syncs
    blocking = {k: v for k, v in fake.calls.items()
                if k in ("event_synchronize", "stream_synchronize", "device_synchronize", "sco_arena_alloc",
                         "host_alloc", "event_create")}
    assert not blocking, blocking
    assert fake.calls.get("event_record", 0) > 0  # the proxy did see the engine's calls
    assert after["arena_chunks"] == before["arena_chunks"] and after["events_created"] == before["events_created"]
    assert after["offloads"] == before["offloads"] + 10 and after["live"] == 0


_CTX_SCRIPT = r"""
import warnings, torch, moepeak
from moepeak.sco import SCOConfig, SCOOffloader
from tests.refs import SCOBlock
warnings.simplefilter("always")
with torch.device("cuda"):
    blocks = [SCOBlock(256, attention=False).to(torch.bfloat16) for _ in range(3)]
x = torch.randn(1, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
sco = SCOOffloader()
with warnings.catch_warnings(record=True) as caught:
    for keep in (True, False):  # backward starting at a kept block / at an offloaded one
        h = x
        for i, b in enumerate(blocks):
            h = moepeak.sco_checkpoint(b, h, sco_offloader=sco, sco_keep_on_gpu=keep and i == 2)
        h.backward(torch.ones_like(h))
torch.cuda.synchronize()
print("WARNINGS:", [str(w.message) for w in caught if "CUDA context" in str(w.message)])
"""


@pytest.mark.cuda
def test_cuda_backward_thread_has_a_context_before_cublas():
    # Autograd runs CUDA backward on its own thread, where torch binds no CUDA
    # context (its guard skips cudaSetDevice for device 0); the first cuBLAS
    # call there then warns "no current CUDA context". A block whose backward
    # starts with a GEMM does that under plain autograd; SCO's reload must bind
    # the context first. Fresh process: the warning is printed once per process.
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _CTX_SCRIPT], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "WARNINGS: []" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.cuda
def test_cuda_pinned_allocation_failure_is_clear(monkeypatch):
    # cudaHostAlloc's own refusal: the host-RAM guard (moepeak.core.host_memory), which refuses
    # 1 PiB first, is told the RAM left is unknown (as off Linux) so the allocation is reached
    from moepeak.core import host_memory

    monkeypatch.setattr(host_memory, "available_bytes", lambda pinned: None)
    sco = SCOOffloader(SCOConfig(arena_bytes=1 << 50, grow=False))
    blocks = _stack(1, device="cuda")
    with pytest.raises(MemoryError, match="pinned host memory"):
        _sco_forward(blocks, torch.randn(B, T, H, device="cuda", requires_grad=True), sco)


@pytest.mark.cuda
def test_cuda_ops_roundtrip():
    from moepeak import _C

    x = torch.randn(1000, 33, device="cuda", dtype=torch.bfloat16)
    ptr = _C.sco_arena_alloc(x.numel() * 2)
    try:
        import ctypes

        host = torch.frombuffer((ctypes.c_uint8 * (x.numel() * 2)).from_address(ptr), dtype=torch.uint8)
        torch.ops.moepeak.sco_offload(x, host)
        out = torch.empty_like(x)
        torch.ops.moepeak.sco_reload(host, out)
        torch.cuda.synchronize()
        assert torch.equal(out, x)
    finally:
        _C.sco_arena_free(ptr)
