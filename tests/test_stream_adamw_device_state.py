"""StreamAdamW(device_state=[...]): the chosen params' state stays on their device and
their update is torch's fused AdamW there. Bitwise the host update and torch's fused
AdamW (CPU), with and without overlap_backward, amsgrad / maximize, slices smaller than
the param, clipping, state_dict interchange; updated from the hook during backward; bad
input named; on a GPU, bitwise torch's fused CUDA AdamW."""
import pytest
import torch

import moepeak


def _mlp(seed, device="cpu", dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.Tanh(), torch.nn.Linear(32, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 5)).to(device, dtype)


def _batches(n, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 13, generator=g).to(device, dtype), torch.randn(8, 5, generator=g).to(device, dtype))
            for _ in range(n)]


def _run(model, opt, batches):
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _device_params(model):
    return [model[0].weight, model[4].bias]  # the first layer's grad is final last in backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("flags", [{}, {"amsgrad": True}, {"maximize": True}])
def test_bitwise_the_host_update(dtype, overlap, flags):
    """bucket_mb = 1e-4 (26 fp32 elements): the host pipeline's buckets are smaller than the
    params (CPU device params are one kernel call each: torch's CPU kernel rounds a tensor's
    scalar tail apart from its vector body)."""
    kw = dict(lr=1e-2, weight_decay=1e-2, bucket_mb=1e-4, overlap_backward=overlap, **flags)
    host_m, dev_m = _mlp(0, dtype=dtype), _mlp(0, dtype=dtype)
    host = moepeak.StreamAdamW(host_m.parameters(), **kw)
    dev = moepeak.StreamAdamW(dev_m.parameters(), device_state=_device_params(dev_m), **kw)
    batches = _batches(4, dtype=dtype)
    _run(host_m, host, batches)
    _run(dev_m, dev, batches)
    for a, b in zip(host_m.parameters(), dev_m.parameters()):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "step") + (("max_exp_avg_sq",) if flags.get("amsgrad") else ()) + \
                (("master_param",) if dtype != torch.float32 else ()):
            assert torch.equal(host.state[a][k], dev.state[b][k]), k


def test_bitwise_torch_fused_and_state_dict_both_ways():
    ours_m, ref_m = _mlp(1), _mlp(1)
    ours = moepeak.StreamAdamW(ours_m.parameters(), lr=1e-2, weight_decay=1e-2, device_state=_device_params(ours_m))
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=1e-2, fused=True)
    batches = _batches(6)
    _run(ours_m, ours, batches[:3])
    _run(ref_m, ref, batches[:3])
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        assert torch.equal(a, b)
    # swap the states: each continues from the other's
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    ours.load_state_dict(ref_sd)
    ref.load_state_dict(ours_sd)
    assert ours.state[ours_m[0].weight]["step"].dtype == torch.float32
    _run(ours_m, ours, batches[3:])
    _run(ref_m, ref, batches[3:])
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        assert torch.equal(a, b)


def test_clip_grad_norm_mode():
    ours_m, ref_m = _mlp(2), _mlp(2)
    ours = moepeak.StreamAdamW(ours_m.parameters(), lr=1e-2, overlap_backward=True, clip_grad_norm=0.05,
                               device_state=_device_params(ours_m))
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
    for x, y in _batches(3):
        for m in (ours_m, ref_m):
            torch.nn.functional.mse_loss(m(x), y).backward()
        ours.step()
        torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.05)
        ref.step()
        ours.zero_grad()
        ref.zero_grad()
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        assert torch.equal(a, b)


def test_updated_from_its_hook_during_backward():
    """With overlap_backward the device param's update runs in its own hook: the first layer's
    weight (final last) has its new value before backward returns, without the worker."""
    model = _mlp(3)
    w = model[0].weight
    opt = moepeak.StreamAdamW(model.parameters(), lr=1e-2, overlap_backward=True, device_state=[w])
    before = w.detach().clone()
    x, y = _batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    after_backward = w.detach().clone()
    assert not torch.equal(after_backward, before)  # updated inside backward
    opt.step()
    assert torch.equal(w, after_backward)  # step() did not update it again
    assert float(opt.state[w]["step"]) == 1.0
    assert opt.overlap_stats()["params_in_backward"] == len(list(model.parameters()))


def test_bad_device_state_is_named():
    model = _mlp(4)
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"device_state\[1\] must be one of the optimizer's params"):
        moepeak.StreamAdamW(model.parameters(), device_state=[model[0].weight, stranger])
    with pytest.raises(ValueError, match=r"device_state\[0\]"):
        moepeak.StreamAdamW(model.parameters(), device_state=["weight"])
    opt = moepeak.StreamAdamW(model.parameters(), device_state=model[0].weight)  # one tensor is accepted
    x, y = _batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.state[model[0].weight]["exp_avg"] = torch.zeros(5)
    opt.state[model[0].weight]["step"] = torch.tensor(0.0)
    opt.state[model[0].weight]["exp_avg_sq"] = torch.zeros(model[0].weight.shape)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="size mismatch: state 'exp_avg'"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was updated


def test_a_bad_host_state_stops_the_device_update_too():
    """Every check of the step runs before any update: a host param's broken state leaves the
    device param untouched as well."""
    model = _mlp(7)
    opt = moepeak.StreamAdamW(model.parameters(), device_state=[model[0].weight])
    x, y = _batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.state[model[2].weight]["exp_avg_sq"] = torch.zeros(3)
    before = [p.detach().clone() for p in model.parameters()]
    steps = float(opt.state[model[0].weight]["step"])
    with pytest.raises(RuntimeError, match="size mismatch: state 'exp_avg_sq'"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert float(opt.state[model[0].weight]["step"]) == steps


@pytest.mark.cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_bitwise_torch_fused(overlap):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moepeak.core.ext import HAS_CUDA_BUILD
    if not HAS_CUDA_BUILD:
        pytest.skip("moepeak._C built without CUDA")
    ours_m, ref_m = _mlp(5, device="cuda"), _mlp(5, device="cuda")
    ours = moepeak.StreamAdamW(ours_m.parameters(), lr=1e-2, weight_decay=1e-2, overlap_backward=overlap,
                               device_state=list(ours_m.parameters()), bucket_mb=1e-3)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=1e-2, fused=True)
    batches = _batches(3, device="cuda")
    _run(ours_m, ours, batches)
    _run(ref_m, ref, batches)
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        assert torch.equal(a, b)
        assert ours.state[a]["exp_avg"].device == a.device and ours.state[a]["step"].device == a.device
    assert ours.pinned_bytes() == 0  # nothing went through the host pipeline


@pytest.mark.cuda
def test_cuda_bf16_param_is_the_rounded_master():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _mlp(6, device="cuda", dtype=torch.bfloat16)
    mixed = moepeak.StreamAdamW(model.parameters(), lr=1e-2, overlap_backward=True,
                                device_state=[model[0].weight])
    _run(model, mixed, _batches(2, device="cuda", dtype=torch.bfloat16))
    w = model[0].weight
    master = mixed.state[w]["master_param"]
    assert master.device == w.device and torch.equal(master.to(torch.bfloat16), w)
    for p in list(model.parameters())[1:]:
        assert mixed.state[p]["exp_avg"].device.type == "cpu"  # the others stay in host RAM


def test_backward_tail_is_the_leading_params_that_fit():
    w = [torch.zeros(10), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(100), torch.zeros(1)]
    tail = moepeak.StreamAdamW.backward_tail
    assert tail(w, 0) == []
    assert [t is p for t, p in zip(tail(w, 80), w)] == [True]  # fp32: 8 B per element
    assert len(tail(w, 80 + 60)) == 2  # bf16: 12 B per element (master, exp_avg, exp_avg_sq)
    assert len(tail(w, 80 + 60 + 799)) == 2  # the 100-element param does not fit ...
    assert len(tail(w, 10 ** 6)) == 4
    assert len(tail(iter(w), 80 + 60 + 800)) == 3  # ... and nothing after it is taken before it; any iterable


def test_backward_tail_bad_input():
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0, got -1"):
        moepeak.StreamAdamW.backward_tail([torch.zeros(2)], -1)
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0, got 1.5"):
        moepeak.StreamAdamW.backward_tail([torch.zeros(2)], 1.5)
    with pytest.raises(TypeError, match=r"params\[1\] must be a tensor, got str"):
        moepeak.StreamAdamW.backward_tail([torch.zeros(2), "w"], 100)


def test_backward_tail_state_is_what_device_state_allocates():
    model = _mlp(0, dtype=torch.bfloat16)
    chosen = moepeak.StreamAdamW.backward_tail(model.parameters(), 12 * (13 * 32 + 32))
    assert chosen == [model[0].weight, model[0].bias]
    opt = moepeak.StreamAdamW(model.parameters(), device_state=chosen)
    _run(model, opt, _batches(1, dtype=torch.bfloat16))
    on_device = sum(t.numel() * t.element_size() for p in chosen for k, t in opt.state[p].items() if k != "step")
    assert on_device == 12 * (13 * 32 + 32)
