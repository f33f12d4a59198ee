"""benchmarks/bench_ring_dtp.py's CPU-checkable parts: which baseline arms it builds
from the installed Cut Cross-Entropy (a fake package here), the peak budget its
verdicts use, and the CSV rows it writes."""
import enum
import math
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_ring_dtp as bench  # noqa: E402


def fake_cce(monkeypatch, impls):
    """A stand-in cut_cross_entropy package with the given impl names; records each call."""
    calls = []

    def linear_cross_entropy(e, c, targets, **kw):
        calls.append(kw)
        return torch.zeros(())
    pkg = types.ModuleType("cut_cross_entropy")
    pkg.linear_cross_entropy = linear_cross_entropy
    pkg.LinearCrossEntropyImpl = enum.IntEnum("LinearCrossEntropyImpl", impls)
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", pkg)
    return calls


@pytest.mark.parametrize("impls, exact_arm, exact_kw", [
    (["CCE", "TORCH_COMPILE"], "cce_nofilter", {"impl": "cce", "filter_eps": None}),  # 25.1.1
    (["CCE", "TORCH_COMPILE", "CCE_EXACT"], "cce_exact", {"impl": "cce_exact"}),
])
def test_cce_arms_follow_the_installed_impls(monkeypatch, impls, exact_arm, exact_kw):
    calls = fake_cce(monkeypatch, impls)
    arms = bench.make_arms()
    assert callable(arms["cce"]) and callable(arms[exact_arm]), {k: v for k, v in arms.items() if isinstance(v, str)}
    assert ({"cce_exact", "cce_nofilter"} - {exact_arm}).isdisjoint(arms)
    x, w, y = torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long)
    arms["cce"](x, w, y)
    arms[exact_arm](x, w, y)
    assert calls == [{"impl": "cce"}, exact_kw]
    assert "cce_exact" not in bench.make_arms(quick_big=True) and "cce_nofilter" not in bench.make_arms(quick_big=True)


def test_missing_baseline_is_a_named_status(monkeypatch):
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)  # import fails
    arms = bench.make_arms()
    assert arms["cce"].startswith("unavailable: ") and "cut_cross_entropy" in arms["cce"]


def test_peak_budget_per_shape():
    assert bench.grads_gib(*bench.TARGET_SHAPE) + bench.WORKSPACE_GIB == pytest.approx(2.0)
    assert bench.grads_gib(131072, 4096, 151936) + bench.WORKSPACE_GIB == pytest.approx(2.75, abs=1e-3)


def test_csv_rows(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    assert bench.quantiles([]) == pytest.approx((math.nan,) * 3, nan_ok=True)
    assert bench.quantiles([0.3, 0.1, 0.2] * 4) == (0.2, 0.1, 0.3)
    r = bench.csv_row(32768, 4096, 151936, "moepeak_auto", "ok", 1.99, [0.19] * 10, 781.0, 8192, (1e-7, 2e-3, 1e-3))
    t3 = 6.0 * 32768 * 4096 * 151936 / 781e12
    assert (r["median_ms"], r["iters"], r["x_3gemm"], r["err_dw"]) == ("190.00", 10, f"{0.19 / t3:.3f}", "1.000e-03")
    oom = bench.csv_row(131072, 4096, 151936, "naive", "oom", rate=781.0)
    assert (oom["status"], oom["median_ms"], oom["iters"], oom["peak_gib"]) == ("oom", "nan", 0, "nan")
    assert bench._ints("8192,32768", (1,)) == [8192, 32768] and bench._ints(None, (4096,)) == [4096]


def test_select_arms():
    arms = {"naive": 1, "liger_flce_fp32acc": 2, "moepeak_auto": 3, "cce": 4}
    assert bench.select_arms(arms, None) is arms
    assert bench.select_arms(arms, "moepeak_auto, liger_flce_fp32acc") == {
        "naive": 1, "liger_flce_fp32acc": 2, "moepeak_auto": 3}          # naive kept, grid order
    with pytest.raises(SystemExit, match="unknown arms \\['moepeak_nope'\\]"):
        bench.select_arms(arms, "moepeak_auto,moepeak_nope")
    made = bench.select_arms(arms, "moepeak_fused_lowp_ct1024")                # made on demand
    assert list(made) == ["naive", "moepeak_fused_lowp_ct1024"]
    assert (made["moepeak_fused_lowp_ct1024"].mode, made["moepeak_fused_lowp_ct1024"].ct) == ("fused_lowp", 1024)
    with pytest.raises(SystemExit, match="unknown arms"):
        bench.select_arms(arms, "moepeak_nope_ct1024")
