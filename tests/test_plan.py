"""`moepeak plan`: preset arithmetic, peaks vs context, binding peak, the
longest context, bad input, and the model's formulas against bytes measured
on CPU (the 15% GPU comparison is in benchmarks/bench_demo.py)."""
import argparse

import pytest
import torch

from moepeak import cli
from moepeak import plan as P
from moepeak.models import DenseMoE, MoEConfig, MoELM, PlainLMHead
from moepeak.peaks import SavedBytes

# Published total parameter counts (billions) of the presets.
PUBLISHED = {"Qwen3-30B-A3B": 30.5, "Qwen3-235B-A22B": 235.1, "DeepSeek-V3": 671.0,
             "gpt-oss-120b": 116.8, "Mixtral-8x22B": 140.6}


@pytest.mark.parametrize("name", sorted(P.PRESETS))
def test_preset_param_counts_match_published(name):
    n = P.PRESETS[name].validate().params() / 1e9
    assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.03, (name, n)


@pytest.mark.parametrize("name", sorted(P.PRESETS))
def test_peaks_monotone_in_context_and_moepeak_lower(name):
    m, s = P.PRESETS[name], P.Setup(gpus=8)
    prev = {p: None for p in ("plain", "moepeak")}
    for ctx in (8192, 32768, 131072, 524288, 1 << 21):
        for plan in ("plain", "moepeak"):
            r = P.peaks(m, s, ctx, plan)
            if prev[plan] is not None:
                for k in P.PEAKS + ("fixed", "total"):
                    assert r[k] >= prev[plan][k], (plan, k, ctx)
            prev[plan] = r
        assert P.peaks(m, s, ctx, "moepeak")["total"] <= P.peaks(m, s, ctx, "plain")["total"]
    assert P.longest_context(m, s, "moepeak") >= P.longest_context(m, s, "plain")


def test_plain_peaks_scale_as_documented():
    m, s = P.PRESETS["Qwen3-30B-A3B"], P.Setup(gpus=1, imbalance=1.0)
    a, b = P.peaks(m, s, 65536, "plain"), P.peaks(m, s, 131072, "plain")
    for k in ("vocab", "boundaries"):
        assert b[k] == 2 * a[k]            # linear in T
    assert a["vocab"] == 65536 * 151936 * (2 + 8)
    assert a["boundaries"] == 48 * 65536 * 2048 * 2
    assert a["optimizer"] == 12 * m.params()
    # moepeak's boundaries are flat in depth, its optimizer flat in context
    deep = P.ModelShape(**{**m.__dict__, "layers": 96})
    assert P.peaks(deep, s, 65536, "moepeak")["boundaries"] == P.peaks(m, s, 65536, "moepeak")["boundaries"]
    assert P.peaks(m, s, 1 << 20, "moepeak")["optimizer"] == P.peaks(m, s, 8192, "moepeak")["optimizer"]


def test_binding_peak_changes_with_context():
    m, s = P.PRESETS["Qwen3-30B-A3B"], P.Setup(gpus=8)
    assert P.peaks(m, s, 4096, "plain")["binding"] == "optimizer"   # 30B params dominate short context
    assert P.peaks(m, s, 1 << 21, "plain")["binding"] == "vocab"     # T x 151936 logits at 2M tokens
    assert P.peaks(m, s, 1 << 21, "moepeak")["binding"] != "vocab"


def test_longest_context_is_the_edge():
    m, s = P.PRESETS["Qwen3-30B-A3B"], P.Setup(gpus=8, gpu_mem_gib=141)
    for plan in ("plain", "moepeak"):
        c = P.longest_context(m, s, plan)
        cap = s.gpu_mem_gib * 2 ** 30
        assert c > 0 and P.peaks(m, s, c, plan)["total"] <= cap
        assert P.peaks(m, s, c + 1024, plan)["total"] > cap
    # Mixtral-8x22B: 141 B params x 12 B of fp32 AdamW state / 8 GPUs > 141 GiB: plain never fits
    assert P.longest_context(P.PRESETS["Mixtral-8x22B"], s, "plain") == 0
    assert P.longest_context(P.PRESETS["Mixtral-8x22B"], s, "moepeak") > 0


def test_cli_report(capsys):
    assert cli.main(["plan", "--preset", "Qwen3-235B-A22B", "--context", "131072", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    for word in ("dispatch", "vocab", "boundaries", "optimizer", "binding peak", "longest context"):
        assert word in out
    assert cli.main(["plan", "--layers", "4", "--hidden", "1024", "--experts", "16", "--top-k", "2",
                     "--intermediate", "512", "--vocab", "65536", "--heads", "8", "--kv-heads", "2",
                     "--gpus", "1", "--gpu-mem", "141"]) == 0


@pytest.mark.parametrize("argv, msg", [
    (["--layers", "4"], "give --preset or all of"),
    (["--preset", "Mixtral-8x22B", "--heads", "5"], "kv_heads (8) must divide heads (5)"),
    (["--preset", "Mixtral-8x22B", "--top-k", "9"], "top_k (9) must be <= experts (8)"),
    (["--preset", "Qwen3-30B-A3B", "--gpus", "0"], "--gpus >= 1"),
    (["--preset", "Qwen3-30B-A3B", "--gpus", "3"], "must be divisible by --gpus (3)"),
    (["--preset", "Qwen3-30B-A3B", "--imbalance", "0.5"], "--imbalance >= 1"),
])
def test_bad_input(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        P.main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_plot_when_matplotlib(tmp_path):
    ok = P.plot(P.PRESETS["Qwen3-30B-A3B"], P.Setup(), str(tmp_path / "p.png"))
    try:
        import matplotlib  # noqa: F401
        assert ok and (tmp_path / "p.png").stat().st_size > 0
    except ImportError:
        assert not ok


# ---------------------------------------------- the formulas vs bytes measured on CPU

def test_vocab_formula_vs_saved_bytes_fp32():
    """Plain head at b=4: the formula counts T*V*8 bytes at the forward peak: the
    fp32 logits plus log-softmax's saved output. Autograd saves the log-softmax
    output (T*V*4) plus the head's inputs; the logits are freed after it, so the
    saved bytes are half the formula's logit term (the other half is transient)."""
    T, H, V = 96, 16, 1000
    head = PlainLMHead(H, V)
    torch.nn.init.normal_(head.weight)
    h = torch.randn(T, H, requires_grad=True)
    y = torch.randint(0, V, (T,))
    with SavedBytes() as sb:
        head(h, y)
    inputs = T * H * 4 + V * H * 4
    assert sb.bytes - inputs == T * V * 4 + T * 8 + 4  # log-softmax out, int64 labels, nll total_weight
    m = P.ModelShape(layers=1, hidden=H, experts=1, top_k=1, intermediate=1, vocab=V, heads=1, kv_heads=1)
    pred = P.peaks(m, P.Setup(gpus=1, act_bytes=4), T, "plain")["vocab"]
    assert pred == 2 * T * V * 4


def test_dispatch_formula_bounds_saved_bytes_fp32():
    """Plain dense MoE at b=4, one rank (rho=1): bytes autograd saves (gathered
    rows T*K*H, GEMM outputs T*K*2I, activation T*K*I, ...) lie within 15% of the
    formula's b*[T*K*H + T*K*(H + 4I)] + 4*T*H (the rest: routing and int64 indices)."""
    T, H, I, E, K = 256, 32, 48, 4, 2
    moe = DenseMoE(H, I, E, K)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(T, H, requires_grad=True)
    with SavedBytes() as sb:
        moe(x)
    weights = sum(p.numel() * 4 for p in moe.parameters())
    measured = sb.bytes - weights - T * H * 4
    m = P.ModelShape(layers=1, hidden=H, experts=E, top_k=K, intermediate=I, vocab=300, heads=1, kv_heads=1)
    pred = P.peaks(m, P.Setup(gpus=1, act_bytes=4, imbalance=1.0), T, "plain")["dispatch"]
    assert abs(measured - pred) / pred < 0.15, (measured, pred)


def test_boundary_formula_equals_model_tensors():
    """torch checkpoint keeps one [B, T, H] input per block: L*T*H*b."""
    cfg = MoEConfig(hidden=32, layers=3, heads=2, kv_heads=1, experts=4, intermediate=32,
                    moe="dense", head="plain", checkpoint="torch")
    model = MoELM(cfg)
    ids = torch.randint(0, 259, (2, 40))
    kept = []
    orig = model._run_block
    model._run_block = lambda blk, x: (kept.append(x.numel() * x.element_size()), orig(blk, x))[1]
    model.hidden_states(ids)
    m = P.ModelShape(layers=3, hidden=32, experts=4, top_k=2, intermediate=32, vocab=264, heads=2, kv_heads=1)
    assert sum(kept) == P.peaks(m, P.Setup(gpus=1, act_bytes=4, batch=2), 40, "plain")["boundaries"]
