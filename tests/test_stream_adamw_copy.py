"""StreamAdamW copied (copy.deepcopy, pickle) like torch.optim.AdamW: state,
param_groups and settings travel, the runtime (bucket plan, streams, overlap
hooks and worker) is rebuilt; the copy's step() is bitwise the original's.
And params of a dtype the kernel does not update refused at construction."""
import copy
import pickle

import pytest
import torch

import moepeak


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def _backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _optimizer(model, **kw):
    m = list(model)
    groups = [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 3e-3, "weight_decay": 0.0}]
    return moepeak.StreamAdamW(groups, lr=1e-2, **kw)


def _train(model, opt, seeds):
    for s in seeds:
        _backward(model, s)
        opt.step()
        opt.zero_grad()


def _assert_same(model_a, opt_a, model_b, opt_b):
    for (n, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), f"{n}: max diff {(a - b).abs().max().item()}"
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert sorted(sa) == sorted(sb), n
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{n} {k}"


def _deepcopy(model, opt):
    return copy.deepcopy((model, opt))  # one memo: the copied optimizer holds the copied model's params


def _pickle(model, opt):
    return pickle.loads(pickle.dumps((model, opt)))


@pytest.mark.parametrize("how", [_deepcopy, _pickle], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("kw", [
    {},
    dict(amsgrad=True, maximize=True, clip_grad_norm=0.5),
    dict(overlap_backward=True, bucket_mb=1e-3),
    dict(_host_pipeline=True, bucket_mb=1e-3, threads=2),  # the bucket plan's slots are made again
], ids=["default", "amsgrad-maximize-clip", "overlap", "host-pipeline"])
def test_copy_steps_bitwise_like_the_original(how, kw):
    model = _model()
    opt = _optimizer(model, **kw)
    _train(model, opt, seeds=[1, 2])
    model_c, opt_c = how(model, opt)
    assert type(opt_c) is moepeak.StreamAdamW
    assert all(a is not b for a, b in zip(model.parameters(), model_c.parameters()))
    assert opt_c.param_groups[1]["lr"] == 3e-3 and opt_c.param_groups[1]["params"][0] is model_c[2].weight
    assert opt_c.options == opt.options
    assert opt_c._plan is None and opt_c._plan_id != opt._plan_id  # runtime rebuilt, not shared
    _assert_same(model, opt, model_c, opt_c)
    _train(model, opt, seeds=[3, 4])
    _train(model_c, opt_c, seeds=[3, 4])
    _assert_same(model, opt, model_c, opt_c)
    if "overlap_backward" in kw:  # the copy's hooks are its own: its params updated during its backward
        assert opt_c.overlap_stats()["params_in_backward"] == 8
        assert opt.overlap_stats()["params_in_backward"] == 16
    if "clip_grad_norm" in kw:
        assert torch.equal(opt_c.last_grad_norm, opt.last_grad_norm)


def test_copy_matches_torch_adamw_copy():
    # the same copy, step, compare, for torch.optim.AdamW(fused=True): the two agree
    ours_m, ref_m = _model(), _model()
    ours = moepeak.StreamAdamW(ours_m.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
    _train(ours_m, ours, [1])
    _train(ref_m, ref, [1])
    (ours_m, ours), (ref_m, ref) = _deepcopy(ours_m, ours), _deepcopy(ref_m, ref)
    _train(ours_m, ours, [2, 3])
    _train(ref_m, ref, [2, 3])
    _assert_same(ours_m, ours, ref_m, ref)


def test_copy_keeps_set_overlap_and_refuses_mid_round():
    model = _model()
    opt = _optimizer(model, overlap_backward=True, bucket_mb=1e-6)  # a bucket per param: updated in backward
    opt.set_overlap(False)
    assert _deepcopy(model, opt)[1]._overlap.enabled is False
    opt.set_overlap(True)
    _backward(model, 1)  # params updated during backward; step() not called yet
    with pytest.raises(RuntimeError, match=r"between backward\(\) and step\(\).*call step\(\) first"):
        copy.deepcopy(opt)
    with pytest.raises(RuntimeError, match="call step"):
        pickle.dumps(opt)
    opt.step()
    copy.deepcopy(opt).step()  # between rounds: fine


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.int64])
def test_unsupported_param_dtype_refused_at_construction(dtype):
    good = torch.nn.Parameter(torch.randn(3))
    bad = torch.nn.Parameter(torch.zeros(2, 2, dtype=dtype), requires_grad=dtype.is_floating_point or
                             dtype.is_complex)
    with pytest.raises(TypeError, match=rf"param_groups\[0\]\['params'\]\[1\] \(shape \(2, 2\), dtype {dtype}\).*"
                                        r"float32, bfloat16 and float16"):
        moepeak.StreamAdamW([good, bad])
    opt = moepeak.StreamAdamW([good])
    with pytest.raises(TypeError, match=rf"param_groups\[1\]\['params'\]\[0\] \(shape \(2, 2\), dtype {dtype}\)"):
        opt.add_param_group({"params": [bad], "lr": 0.1})
    assert len(opt.param_groups) == 1  # nothing added


def test_supported_dtypes_and_param_forms_still_accepted():
    ps = [torch.nn.Parameter(torch.randn(3, dtype=dt)) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    opt = moepeak.StreamAdamW(iter(ps[:2]))  # a generator is consumed once
    assert opt.param_groups[0]["params"] == ps[:2]
    group = {"params": ps[2]}  # a single tensor, as torch accepts
    opt.add_param_group(group)
    assert opt.param_groups[1] is group and group["params"] == [ps[2]]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_copy_steps_bitwise_like_the_original(dtype, overlap):
    # CUDA params: the copy makes its own pinned bucket plan and streams at its first
    # step; the fp32 CPU masters and the bf16 params' master_param travel with it
    model = _model().cuda().to(dtype)
    opt = _optimizer(model, overlap_backward=overlap, bucket_mb=1e-3)

    def train(m, o, seeds):
        for s in seeds:
            g = torch.Generator().manual_seed(s)
            x, y = torch.randn(8, 13, generator=g).cuda().to(dtype), torch.randn(8, 5, generator=g).cuda()
            torch.nn.functional.mse_loss(m(x).float(), y).backward()
            o.step()
            o.zero_grad()

    train(model, opt, [1, 2])
    model_c, opt_c = _deepcopy(model, opt)
    assert opt_c._plan is None and opt.pinned_bytes() > 0
    train(model, opt, [3, 4])
    train(model_c, opt_c, [3, 4])
    assert opt_c.pinned_bytes() > 0 and opt_c._plan is not opt._plan
    torch.cuda.synchronize()
    _assert_same(model, opt, model_c, opt_c)
