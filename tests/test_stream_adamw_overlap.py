"""StreamAdamW(overlap_backward=True): updates started from post-accumulate-grad
hooks while backward runs, bitwise vs torch.optim.AdamW(fused=True) over
several steps, with micro-batch accumulation, the clip_grad_norm mode, an LR
scheduler, state_dict interchange, FSDP2 (gloo) and, on a GPU, the stream
ordering of the worker's H2D copies before the next forward."""
import gc
import time

import pytest
import torch

import moepeak


def _mlp(seed, dims=(13, 32, 24, 16, 5), device="cpu", dtype=torch.float32):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).to(device, dtype)


def _batches(n, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 13, generator=g).to(device, dtype), torch.randn(8, 5, generator=g).to(device, dtype))
            for _ in range(n)]


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def _pair(**kw):
    ours_m, ref_m = _mlp(0), _mlp(0)
    ours = moepeak.StreamAdamW(ours_m.parameters(), lr=1e-2, weight_decay=1e-2, overlap_backward=True,
                               bucket_mb=kw.pop("bucket_mb", 1e-3), **kw)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=1e-2, fused=True)
    return ours_m, ref_m, ours, ref


def _assert_same(ours_m, ref_m, ours, ref):
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        assert torch.equal(a, b), f"param max diff {(a - b).abs().max().item()}"
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours.state[a][k], ref.state[b][k]), k


def _step_then_zero(*optimizers):
    """step() each optimizer in turn, then zero_grad() each in the same order."""
    for o in optimizers:
        o.step()
    for o in optimizers:
        o.zero_grad()


@pytest.mark.parametrize("host_pipeline", [False, True])
def test_overlap_bitwise_vs_torch_fused(host_pipeline):
    ours_m, ref_m, ours, ref = _pair(_host_pipeline=host_pipeline)
    for x, y in _batches(4):
        for m, o in ((ours_m, ours), (ref_m, ref)):
            _loss(m, x, y).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    _assert_same(ours_m, ref_m, ours, ref)
    stats = ours.overlap_stats()
    assert stats["params_in_backward"] == 4 * 8  # every param of every step was handed over by its hook
    assert stats["jobs_done"] >= 4 * 2  # bucket_mb=1e-3: several jobs per backward
    # the last round's jobs: every element once, each submitted <= started <= finished, in order
    jobs = stats["last_round"]
    assert sum(n for n, *_ in jobs) == sum(p.numel() for p in ours_m.parameters())
    assert all(sub <= start <= end for _, sub, start, end in jobs)
    assert all(a[3] <= b[2] for a, b in zip(jobs, jobs[1:]))  # one worker: a job starts after the previous


def test_update_runs_before_backward_returns():
    """The last layer's grads are final first; its update is observed from the
    hook of the first layer's weight (final last), i.e. inside backward."""
    model, _, opt, _ = _pair()
    first_w, last_w = model[0].weight, model[-1].weight
    seen = {}

    def probe(_p):
        deadline = time.time() + 30
        while opt.overlap_stats()["jobs_done"] < 1 and time.time() < deadline:
            time.sleep(0.001)
        seen["step"] = float(opt.state[last_w]["step"])
        seen["value"] = last_w.detach().clone()

    before = last_w.detach().clone()
    first_w.register_post_accumulate_grad_hook(probe)  # runs after the optimizer's hook on first_w
    x, y = _batches(1)[0]
    _loss(model, x, y).backward()
    assert seen["step"] == 1.0
    assert not torch.equal(seen["value"], before)  # updated while backward was still running
    opt.step()
    assert torch.equal(last_w.detach(), seen["value"])  # step() did not update it again
    assert float(opt.state[first_w]["step"]) == 1.0


def test_microbatch_accumulation():
    ours_m, ref_m, ours, ref = _pair()
    data = _batches(9, seed=1)
    for step in range(3):
        micro = data[3 * step:3 * step + 3]
        for i, (x, y) in enumerate(micro):
            _loss(ref_m, x, y).backward()
            if i < len(micro) - 1:
                with ours.accumulate():
                    _loss(ours_m, x, y).backward()
                assert ours.overlap_stats()["params_in_backward"] == 8 * step  # nothing updated yet
            else:
                _loss(ours_m, x, y).backward()
        _step_then_zero(ref, ours)
    _assert_same(ours_m, ref_m, ours, ref)


def test_second_backward_without_step_raises():
    model, _, opt, _ = _pair()
    x, y = _batches(1)[0]
    _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match="accumulate"):
        _loss(model, x, y).backward()


def test_clip_grad_norm_mode_matches_torch_clip_then_step():
    ours_m, ref_m, ours, ref = _pair(clip_grad_norm=0.05)
    for x, y in _batches(4, seed=2):
        _loss(ref_m, x, y).backward()
        want = torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.05)
        ref.step()
        _loss(ours_m, x, y).backward()
        assert ours.overlap_stats()["params_in_backward"] == 0  # deferred: the norm needs every grad first
        ours.step()
        assert torch.equal(ours.last_grad_norm, want)
        assert float(want) > 0.05  # the clip was active
        ref.zero_grad()
        ours.zero_grad()
    _assert_same(ours_m, ref_m, ours, ref)


def test_lr_scheduler_and_param_groups():
    ours_m, ref_m = _mlp(3), _mlp(3)

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 3e-2}, {"params": [p for l in list(m)[1:] for p in l.parameters()]}]

    ours = moepeak.StreamAdamW(groups(ours_m), lr=1e-2, overlap_backward=True, bucket_mb=1e-3)
    ref = torch.optim.AdamW(groups(ref_m), lr=1e-2, fused=True)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ours, ref)]
    for x, y in _batches(4, seed=3):
        for m, o, s in ((ours_m, ours, scheds[0]), (ref_m, ref, scheds[1])):
            _loss(m, x, y).backward()
            o.step()
            s.step()
            o.zero_grad()
    _assert_same(ours_m, ref_m, ours, ref)


def test_state_dict_round_trip_with_torch():
    ours_m, ref_m, ours, ref = _pair()
    data = _batches(6, seed=4)
    for x, y in data[:3]:
        for m, o in ((ours_m, ours), (ref_m, ref)):
            _loss(m, x, y).backward()
            o.step()
            o.zero_grad()
    # swap: torch continues from our state, we continue from torch's
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    ref2 = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=1e-2, fused=True)
    ref2.load_state_dict(ours_sd)
    ours2 = moepeak.StreamAdamW(ours_m.parameters(), lr=1e-2, weight_decay=1e-2, overlap_backward=True,
                                bucket_mb=1e-3)
    ours2.load_state_dict(ref_sd)
    del ours
    gc.collect()  # the first optimizer's hooks go with it
    for x, y in data[3:]:
        for m, o in ((ours_m, ours2), (ref_m, ref2)):
            _loss(m, x, y).backward()
            o.step()
            o.zero_grad()
    _assert_same(ours_m, ref_m, ours2, ref2)
    assert ours2.overlap_stats()["params_in_backward"] == 3 * 8


def test_dropped_optimizer_removes_hooks():
    model, _, opt, _ = _pair()
    x, y = _batches(1)[0]
    _loss(model, x, y).backward()
    opt.step()
    del opt
    gc.collect()
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, x, y).backward()
    _loss(model, x, y).backward()  # no "became final twice": no hooks left
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_param_raises_from_backward():
    # an fp64 param is refused at construction; one whose .data became fp64 after it is caught in the hook
    p = torch.nn.Parameter(torch.randn(4))
    opt = moepeak.StreamAdamW([p], overlap_backward=True, bucket_mb=1e-6)  # a bucket per param: flushed in the hook
    p.data = p.data.double()
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        (p * 2).sum().backward()
    assert p not in opt.state
    q = torch.nn.Parameter(torch.randn(4))
    opt = moepeak.StreamAdamW([q], overlap_backward=True)  # bucket not full in backward: step() raises
    q.data = q.data.double()
    (q * 2).sum().backward()
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        opt.step()
    assert q not in opt.state


def _fsdp_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    models = [_mlp(5, dims=(13, 32, 32, 5)) for _ in range(2)]
    for m in models:
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    ours_m, ref_m = models
    ours = moepeak.StreamAdamW(ours_m.parameters(), lr=1e-2, overlap_backward=True, bucket_mb=1e-4)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
    torch.manual_seed(100 + rank)
    for _ in range(3):
        x, y = torch.randn(4, 13), torch.randn(4, 5)
        for m, o in ((ours_m, ours), (ref_m, ref)):
            _loss(m, x, y).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), f"rank {rank}: shard differs"
        assert torch.equal(ours.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"].to_local())
    # the hooks fired on the sharded params after reduce-scatter: every update ran from backward
    assert ours.overlap_stats()["params_in_backward"] == 3 * 6


def test_fsdp2_sharded_params_overlap():
    from dist_utils import run_ranks

    run_ranks(2, _fsdp_rank)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
def _cuda_train(overlap, dtype, steps=4, layers=6, width=4096):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to("cuda", dtype)
    opt = moepeak.StreamAdamW(model.parameters(), lr=1e-3, overlap_backward=overlap, bucket_mb=64)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(steps + 1):
        x = torch.randn(256, width, device="cuda", dtype=dtype, generator=g)
        loss = model(x).float().pow(2).mean()  # right after the previous step(): reads every param at once
        losses.append(loss.detach())
        if len(losses) > steps:
            break
        loss.backward()
        opt.step()
        opt.zero_grad()
    return torch.stack(losses).cpu(), [p.detach().cpu() for p in model.parameters()], opt


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_overlap_matches_plain_step_and_orders_h2d(dtype):
    """Same bits as the non-overlapped pipeline (same arithmetic), and every
    forward after step() sees the updated params with no synchronize: the
    first layer's weight (64 MiB fp32, final last) is the last bucket, still
    in its H2D copy when step() returns, and the next forward reads it first."""
    want_l, want_p, _ = _cuda_train(False, dtype)
    got_l, got_p, opt = _cuda_train(True, dtype)
    assert opt.overlap_stats()["params_in_backward"] == 4 * 6
    assert opt.overlap_stats()["jobs_done"] >= 4 * 5  # the weights of layers 6..2 each went during backward
    assert torch.equal(got_l, want_l)
    assert all(torch.equal(a, b) for a, b in zip(got_p, want_p))
