"""`moepeak plan`: preset arithmetic, peaks vs context, binding peak, the
longest context, bad input, and the model's formulas against bytes measured
on CPU (the 15% GPU comparison is in benchmarks/bench_demo.py)."""

import dataclasses
import re

import pytest
import torch

import moepeak
from moepeak import cli
from moepeak import plan as P
from moepeak.plan import chart as plan_chart
from moepeak.plan import cli as plan_cli
from moepeak.demo.config import MoEConfig
from moepeak.demo.models import DenseMoE, MoELM, PlainLMHead
from moepeak.demo.peaks import SavedBytes

# Published total parameter counts (billions) of the presets.
PUBLISHED = {"Qwen3-30B-A3B": 30.5, "Qwen3-235B-A22B": 235.1, "DeepSeek-V3": 671.0,
             "gpt-oss-120b": 116.8, "Mixtral-8x22B": 140.6, "OLMoE-1B-7B": 6.92,
             # torchtitan flavors: Qwen3, DeepSeek-V2-Lite / V2 / V3, gpt-oss
             "titan:qwen3:30B-A3B": 30.5, "titan:qwen3:235B-A22B": 235.1, "titan:deepseek_v3:16B": 15.7,
             "titan:deepseek_v3:236B": 236.0, "titan:deepseek_v3:671B": 671.0, "titan:gpt_oss:20b": 20.9,
             "titan:gpt_oss:120b": 116.8}


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
                    if plan == "moepeak" and k == "vocab":
                        continue  # Ring-DTP leaves its fused mode past 8 token chunks (512 -> 256 MiB)
                    assert r[k] >= prev[plan][k], (plan, k, ctx)
            prev[plan] = r
        assert P.peaks(m, s, ctx, "moepeak")["total"] <= P.peaks(m, s, ctx, "plain")["total"]
    assert P.longest_context(m, s, "moepeak") >= P.longest_context(m, s, "plain")


def test_plain_peaks_scale_as_documented():
    m, s = P.PRESETS["Qwen3-30B-A3B"], P.Setup(gpus=1, imbalance=1.0)
    a, b = P.peaks(m, s, 65536, "plain"), P.peaks(m, s, 131072, "plain")
    for k in ("vocab", "boundaries"):
        assert b[k] == 2 * a[k]            # linear in T
    assert a["vocab"] == 65536 * 151936 * 12   # fp32 log-softmax + nll grad + log-softmax grad
    assert a["boundaries"] == 48 * 65536 * 2048 * 2
    assert a["optimizer"] == 12 * m.params()
    # moepeak's boundaries are flat in depth; StreamAdamW adds no GPU memory
    deep = P.ModelShape(**{**m.__dict__, "layers": 96})
    assert P.peaks(deep, s, 65536, "moepeak")["boundaries"] == P.peaks(m, s, 65536, "moepeak")["boundaries"]
    assert P.peaks(m, s, 1 << 20, "moepeak")["optimizer"] == 0 == P.peaks(m, s, 8192, "moepeak")["optimizer"]


def test_binding_peak_changes_with_context():
    m, s = P.PRESETS["Qwen3-30B-A3B"], P.Setup(gpus=8)
    assert P.peaks(m, s, 4096, "plain")["binding"] == "optimizer"   # 30B params dominate short context
    assert P.peaks(m, s, 1 << 21, "plain")["binding"] == "vocab"     # T x 151936 logits at 2M tokens
    # moepeak's vocab peak is O(T*H), not O(T*V): < 5% of plain's at 2M tokens
    assert P.peaks(m, s, 1 << 21, "moepeak")["vocab"] < 0.05 * P.peaks(m, s, 1 << 21, "plain")["vocab"]


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


def test_host_ram_terms():
    """SCO's boundaries L*T*H*b, StreamAdamW's 12 B per param over P less the device tail
    (never below 0), 5 half-bucket pinned slots."""
    m = P.ModelShape(layers=4, hidden=1024, experts=16, top_k=2, intermediate=512, vocab=65536, heads=8,
                     kv_heads=2)
    h = P.host_bytes(m, P.Setup(gpus=2), 1 << 20)
    assert h["sco_boundaries"] == 4 * (1 << 19) * 1024 * 2
    assert h["optimizer_state"] == 12 * m.params() / 2
    assert h["pinned_slots"] == 160 * 2 ** 20
    assert h["total"] == sum(v for k, v in h.items() if k != "total")
    tail = P.host_bytes(m, P.Setup(gpus=2, device_state_gib=1.0), 1 << 20)
    assert tail["optimizer_state"] == 12 * m.params() / 2 - 2 ** 30
    assert P.host_bytes(m, P.Setup(gpus=2, device_state_gib=1e6), 1 << 20)["optimizer_state"] == 0


def test_sco_keep_last_moves_boundaries_from_host_to_gpu():
    m, s = P.PRESETS["Qwen3-30B-A3B"], P.Setup(gpus=8, tile_tokens=8192)
    one = 131072 * 2048 * 2  # one [T, H] bf16 boundary at 1M tokens over 8 GPUs
    base, keep = P.peaks(m, s, 1 << 20, "moepeak"), P.peaks(m, P.Setup(gpus=8, tile_tokens=8192, sco_keep_last=4),
                                                            1 << 20, "moepeak")
    assert keep["boundaries_head"] == base["boundaries_head"] + 4 * one
    assert keep["boundaries_block"] == base["boundaries_block"] + 3 * one
    h0, h4 = P.host_bytes(m, s, 1 << 20), P.host_bytes(m, dataclasses.replace(s, sco_keep_last=4), 1 << 20)
    assert h0["sco_boundaries"] - h4["sco_boundaries"] == 4 * one
    every = dataclasses.replace(s, sco_keep_last=99)
    assert P.host_bytes(m, every, 1 << 20)["sco_boundaries"] == 0
    assert P.peaks(m, every, 1 << 20, "moepeak")["boundaries_head"] == 48 * one
    assert P.longest_host_context(m, every, 560, 8) == 1 << 26  # the search's limit: context no longer binds


def test_sco_keep_last_defaults_to_that_of_the_layers_code():
    """Unset, the plan keeps what the code running the layers keeps: the demo model none
    (MoEConfig.sco_keep_last), the Hugging Face drop-in one (SCOConfig().keep_last)."""
    m = P.PRESETS["Qwen3-30B-A3B"]
    one = 131072 * 2048 * 2
    for impl, default in (("demo", MoEConfig().sco_keep_last), ("hf", moepeak.SCOConfig().keep_last)):
        s = P.Setup(gpus=8, impl=impl)
        assert P.keep_last(s) == default
        explicit = P.host_bytes(m, dataclasses.replace(s, sco_keep_last=0), 1 << 20, sized_arena=True)
        assert P.host_bytes(m, s, 1 << 20, sized_arena=True)["sco_boundaries"] == \
            explicit["sco_boundaries"] - default * one
    assert cli.main(["plan", "--preset", "Qwen3-30B-A3B", "--impl", "hf", "--context", "1048576"]) == 0


def test_longest_host_context_is_the_edge():
    m, s = P.PRESETS["Qwen3-30B-A3B"], P.Setup(gpus=8, tile_tokens=8192)
    c = P.longest_host_context(m, s, 560, 8)
    assert 8 * P.host_bytes(m, s, c)["total"] <= 560 * 2 ** 30 < 8 * P.host_bytes(m, s, c + 1024)["total"]
    assert P.longest_host_context(m, s, 1, 8) == 0  # the state alone is 43 GiB per GPU


def test_cli_host_ram_line(capsys):
    argv = ["plan", "--layers", "16", "--hidden", "2048", "--experts", "16", "--top-k", "4", "--intermediate",
            "768", "--vocab", "151936", "--heads", "32", "--kv-heads", "4", "--head-dim", "128", "--gpus", "1",
            "--context", "2097152", "--tile-tokens", "8192"]
    assert cli.main(argv + ["--host-mem", "125"]) == 0
    out = capsys.readouterr().out  # bench_titan's model at 2M tokens: 128 GiB of boundaries alone
    assert "SCO boundaries 128.00 + StreamAdamW state 23.84" in out
    assert "host RAM: 125.0 GiB, --host-mem 125, less its margin (8 GiB + 10%) = 104.5 GiB: does NOT fit" in out
    assert "host RAM is short and there is no disk tier" in out  # the placement says why nothing fits
    # without --host-mem: this machine's MemAvailable, named as such, with how to give another's
    ram = P.Machine(gpu_bytes=141 * P.GiB, host_bytes=64 * P.GiB, host_from="MemAvailable of this machine (box)")
    monkey = pytest.MonkeyPatch()
    monkey.setattr(plan_cli, "machine_of", lambda a, gpus: ram)
    try:
        assert cli.main(argv) == 0
    finally:
        monkey.undo()
    out = capsys.readouterr().out
    assert "per host of 1 GPU(s): 152.57 GiB" in out and "MemAvailable of this machine (box)" in out
    assert "give its host RAM with --host-mem GIB" in out


@pytest.mark.parametrize("argv, msg", [
    (["--layers", "4"], "give --preset or all of"),
    (["--preset", "Mixtral-8x22B", "--heads", "5"], "--kv-heads (8) must divide --heads (5)"),
    (["--preset", "Mixtral-8x22B", "--top-k", "9"], "--top-k (9) must be <= --experts (8)"),
    (["--preset", "Qwen3-30B-A3B", "--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["--preset", "Qwen3-30B-A3B", "--gpus", "3"], "--gpus (3) must divide the experts (128)"),
    (["--preset", "Qwen3-30B-A3B", "--imbalance", "0.5"], "--imbalance must be >= 1"),
    (["--preset", "Qwen3-30B-A3B", "--host-mem", "0"], "--host-mem must be > 0, got 0"),
    (["--preset", "Qwen3-30B-A3B", "--sco-keep-last", "-1"], "--sco-keep-last must be >= 0, got -1"),
    (["--preset", "Qwen3-30B-A3B", "--gpus-per-node", "0"], "--gpus-per-node must be >= 1, got 0"),
    (["--preset", "Qwen3-30B-A3B", "--plot", "/no/such/dir/p.png"], "--plot '/no/such/dir/p.png': the directory"),
    (["--preset", "Qwen3-30B-A3B", "--spill-dir", "/no/such/dir"], "--spill-dir '/no/such/dir' is not a directory"),
])
def test_bad_input(argv, msg, capsys):
    """One error line, prefixed once, naming only the bad flag (no traceback)."""
    with pytest.raises(SystemExit) as e:
        P.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("moepeak plan: error: ") and line.count("moepeak plan") == 1, line
    if "--preset" not in msg:
        flags = {f for f in re.findall(r"--[a-z-]+", line)}
        assert flags == {f for f in re.findall(r"--[a-z-]+", msg)}, (flags, msg)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        P.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("moepeak ")


def test_plot_when_matplotlib(tmp_path):
    ok = plan_chart.plot(P.PRESETS["Qwen3-30B-A3B"], P.Setup(), str(tmp_path / "p.png"))
    try:
        import matplotlib  # noqa: F401
        assert ok and (tmp_path / "p.png").stat().st_size > 0
    except ImportError:
        assert not ok


# ---------------------------------------------- the formulas vs bytes measured on CPU

def test_vocab_formula_vs_saved_bytes_fp32():
    """Plain head at b=4: the formula counts T*V*12 bytes at the backward peak: the
    saved fp32 log-softmax output (measured here: T*V*4), nll_loss's fp32 grad and
    log_softmax's fp32 grad, both [T, V] like it (transient, made by the backward)."""
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
    assert pred == 3 * T * V * 4


def test_dispatch_formula_bounds_saved_bytes_fp32():
    """Plain dense MoE at b=4, one rank (rho=1): the plan's saved bytes per token of the
    router + DenseMoE match what autograd saves within 2%."""
    T, H, I, E, K = 256, 32, 48, 4, 2
    moe = DenseMoE(H, I, E, K)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(T, H, requires_grad=True)
    got = _saved_bytes_per_token(lambda: moe(x), list(moe.parameters()), T)
    m = P.ModelShape(layers=1, hidden=H, experts=E, top_k=K, intermediate=I, vocab=300, heads=1, kv_heads=1)
    r = P.peaks(m, P.Setup(gpus=1, act_bytes=4, imbalance=1.0), T, "plain")
    want = r["saved_router"] + r["saved_moe"]
    assert abs(got - want) <= 0.02 * got, (got, want)


def test_boundary_formula_equals_model_tensors():
    """torch checkpoint keeps one [B, T, H] input per block: L*T*H*b."""
    cfg = MoEConfig(hidden=32, layers=3, heads=2, kv_heads=1, experts=4, intermediate=32,
                    moe="dense", head="plain", checkpoint="torch")
    model = MoELM(cfg)
    ids = torch.randint(0, 259, (2, 40))
    kept = []
    orig = model.run_block
    model.run_block = lambda blk, x: (kept.append(x.numel() * x.element_size()), orig(blk, x))[1]
    model.hidden_states(ids)
    m = P.ModelShape(layers=3, hidden=32, experts=4, top_k=2, intermediate=32, vocab=264, heads=2, kv_heads=1)
    assert sum(kept) == P.peaks(m, P.Setup(gpus=1, act_bytes=4, batch=2), 40, "plain")["boundaries"]


# ---------------------------------------------------------------- checked against measurements

def _saved_bytes_per_token(fn, params, T):
    """Bytes of the distinct non-parameter storages autograd saves while fn() runs, per token."""
    import torch
    pids = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in pids:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values()) / T


def test_saved_tensor_terms_match_autograd_on_cpu():
    """The plan's per-token saved bytes of RMSNorm, the router + DenseMoE (plain) and the
    router + PipelinedLLEPMoE (moepeak), measured on CPU with saved_tensors_hooks."""
    import torch
    from moepeak.demo.config import available, component
    from moepeak.demo.models import DenseMoE, RMSNorm
    T, H, I, E, K = 512, 64, 48, 8, 2
    m = P.ModelShape(layers=1, hidden=H, experts=E, top_k=K, intermediate=I, vocab=256, heads=4, kv_heads=2)
    s = P.Setup(gpus=1, imbalance=1.0)
    plain, mine = P.peaks(m, s, T, "plain"), P.peaks(m, s, T, "moepeak")
    torch.manual_seed(0)
    x = torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True)
    n = RMSNorm(H, dtype=torch.bfloat16)
    got = _saved_bytes_per_token(lambda: n(x), list(n.parameters()), T)
    assert abs(got - plain["saved_norm"]) <= 0.01 * got, (got, plain["saved_norm"])
    lean = RMSNorm(H, dtype=torch.bfloat16, lean=True)  # saves x itself and an fp32 rstd
    got = _saved_bytes_per_token(lambda: lean(x), list(lean.parameters()), T)
    assert abs(got - mine["saved_norm"]) <= 0.01 * got and mine["saved_norm"] == 2 * H + 4, (got, mine["saved_norm"])
    d = DenseMoE(H, I, E, K, dtype=torch.bfloat16)
    for p in d.parameters():
        torch.nn.init.normal_(p)
    got = _saved_bytes_per_token(lambda: d(x), list(d.parameters()), T)
    want = plain["saved_router"] + plain["saved_moe"]
    assert abs(got - want) <= 0.02 * got, (got, want)
    if available("moe"):
        mo = component("moe")(H, I, E, K, dtype=torch.bfloat16)
        got = _saved_bytes_per_token(lambda: mo(x), list(mo.parameters()), T)
        # + the activation cache (saved for backward, whole C-row slots), per token
        want = mine["saved_router"] + mine["saved_moe"] + mine["llep_cache"] / T
        assert abs(got - want) <= 0.02 * got, (got, want)


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("T,H", [(512, 64), (256, 128)])
def test_demo_final_norm_terms_match_live_bytes_on_cpu(T, H, lean):
    """The demo's final RMSNorm in bf16, forward and backward under LiveBytes: its eager
    autograd peaks at 24H per token and saves 8H + 4 (fp32 x, fp32 normalised rows, rstd);
    with lean=True (moepeak.norms.rms_norm, the default with the Ring-DTP head) the plan's
    lean final_norm and head_act hold. The head's input (the norm's output) is in both
    head_act terms; the product with g stands in for the head, and grad_y is its [T, H]."""
    from tiled_blocks import LiveBytes
    from moepeak.demo.models import RMSNorm
    norm = RMSNorm(H, dtype=torch.bfloat16, lean=lean)
    x = torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, T, H, dtype=torch.bfloat16)
    with LiveBytes() as live:
        y = norm(x)
        after_forward = live.live      # what the norm keeps for backward + its output y
        loss = (y * g).sum()
        del y                          # as the head's input, freed when the head's backward ends
        loss.backward()
    m = P.ModelShape(layers=2, hidden=H, experts=4, top_k=2, intermediate=32, vocab=256, heads=4, kv_heads=2)
    r = P.peaks(m, P.Setup(gpus=1, lean_norm=lean), T, "moepeak")
    # lean: the norm saves a view of x, so LiveBytes counts x's storage (the plan's "saved x");
    # eager saves fp32 copies and x itself is not counted
    assert abs(after_forward - r["head_act"]) <= 0.01 * r["head_act"], (after_forward / T, r["head_act"] / T)
    assert 0 <= live.peak - r["final_norm"] <= 0.02 * r["final_norm"], (live.peak / T, r["final_norm"] / T)
    if not lean:
        assert r["final_norm"] == 24 * H * T and r["head_act"] == T * (8 * H + 4 + 2 * H)


# The measurements below ran PipelinedLLEP with the activation-cache budget it had then on one
# GPU (save_budget_mb 1536); the plan is checked at that budget.
MEASURED_LLEP_BUDGET_MB = 1536


# MEASURED on an H200 (torch 2.11, CUDA 13.0) by benchmarks/bench_demo.py --quick (its rows are in
# benchmarks/results/demo.csv): torch.cuda.max_memory_allocated over
# the demo's default GPU model (L=4, H=1024, heads 8/2, E=16, K=2, I=512, V=65536, bf16, one
# GPU), per context and mode. Fixtures, not predictions (the plan said 2.67 / 7.28 / 26.42 /
# 100.20 GiB in that run).
MEASURED_H200_GIB = {
    (32768, "moepeak"): 2.58, (32768, "plain"): 25.97,
    (131072, "moepeak"): 7.15, (131072, "plain"): 99.75,
}


@pytest.mark.parametrize("context, plan", sorted(MEASURED_H200_GIB))
def test_plan_within_15_percent_of_h200_measurements(context, plan):
    m = P.ModelShape(layers=4, hidden=1024, experts=16, top_k=2, intermediate=512, vocab=65536,
                     heads=8, kv_heads=2)
    # the demo's plain run: bf16 params + grads, torch AdamW's bf16 m, v (bench_demo's Setup)
    # measured before the demo's final norm was moepeak.norms.rms_norm: the eager one
    s = P.Setup(gpus=1, act_bytes=2, imbalance=1.0, plain_opt_bytes=4.0, plain_fixed_bytes=4.0, lean_norm=False,
                llep_save_budget_mb=MEASURED_LLEP_BUDGET_MB)
    pred = P.peaks(m, s, context, plan)["total"] / P.GiB
    meas = MEASURED_H200_GIB[(context, plan)]
    print(f"{plan} @ {context}: plan {pred:.2f} GiB, measured {meas:.2f} GiB, ratio {pred / meas:.3f}")
    assert 0.85 <= pred / meas <= 1.15, (plan, context, pred, meas)


# MEASURED on one H200 by benchmarks/bench_tiled.py --model (torch 2.11; rows in
# benchmarks/results/tiled_model.csv): the demo model at the 2.0B shape, tile_tokens 8192,
# PipelinedLLEP + Ring-DTP + SCO + StreamAdamW, bf16, peak = max allocated over the step, before
# the demo's final norm was moepeak.norms.rms_norm. (layers, context): GiB.
MEASURED_TILED_MODEL_H200_GIB = {(16, 131072): 14.14, (16, 262144): 20.76, (2, 1048576): 55.14}


@pytest.mark.parametrize("layers, context", sorted(MEASURED_TILED_MODEL_H200_GIB))
def test_plan_within_15_percent_of_the_tiled_model(layers, context):
    m = P.ModelShape(layers=layers, hidden=2048, experts=16, top_k=4, intermediate=768, vocab=151936, heads=16,
                     kv_heads=4, head_dim=128)
    r = P.peaks(m, P.Setup(gpus=1, act_bytes=2, tile_tokens=8192, lean_norm=False,
                             llep_save_budget_mb=MEASURED_LLEP_BUDGET_MB), context, "moepeak")
    pred, meas = r["total"] / P.GiB, MEASURED_TILED_MODEL_H200_GIB[(layers, context)]
    print(f"L={layers} @ {context}: plan {pred:.2f} GiB ({r['binding']}), measured {meas:.2f} GiB, "
          f"ratio {pred / meas:.3f}")
    assert r["binding"] == "final_norm"  # the eager final norm's backward binds these points
    assert 0.85 <= pred / meas <= 1.15, (layers, context, pred, meas)


# The same benchmark since the demo's norms are lean (moepeak.rms_norm) and a tiled block holds the
# previous boundary's prefetch back past its peak (the plan's defaults). (layers, context, tile): GiB.
MEASURED_LEAN_MODEL_H200_GIB = {(16, 524288, None): 36.13, (16, 524288, 8192): 23.36,
                                (2, 1048576, 8192): 35.17, (2, 2097152, 8192): 67.77}


@pytest.mark.parametrize("layers, context, tile", sorted(MEASURED_LEAN_MODEL_H200_GIB, key=str))
def test_plan_within_15_percent_of_the_lean_model(layers, context, tile):
    m = P.ModelShape(layers=layers, hidden=2048, experts=16, top_k=4, intermediate=768, vocab=151936, heads=16,
                     kv_heads=4, head_dim=128)
    s = P.Setup(gpus=1, act_bytes=2, tile_tokens=tile, llep_save_budget_mb=MEASURED_LLEP_BUDGET_MB)
    r = P.peaks(m, s, context, "moepeak")
    pred, meas = r["total"] / P.GiB, MEASURED_LEAN_MODEL_H200_GIB[(layers, context, tile)]
    print(f"L={layers} @ {context} tile {tile}: plan {pred:.2f} GiB ({r['binding']}), measured {meas:.2f} GiB, "
          f"ratio {pred / meas:.3f}")
    assert r["binding"] == "block"  # with lean norms the block's backward binds
    assert 0.85 <= pred / meas <= 1.15, (layers, context, tile, pred, meas)


def test_ring_dtp_bytes_follow_the_ops_choice():
    """plan's Ring-DTP bytes are those of the mode the op's auto picks (both read
    ring_dtp.sizes), with each mode's byte formula."""
    from moepeak.ring_dtp import sched as R
    from moepeak.ring_dtp import blocks as B
    from moepeak.ring_dtp import sizes as S
    for T in (1, 2048, 32768, 40960, 40961, 131072):
        for H, V in ((4096, 151936), (1024, 65536), (2048, 256000), (64, 1000)):
            mode = R.pick_mode(0, True, 1, T, H, V, torch.bfloat16)
            got = P.ring_dtp_vocab_bytes(T, H, V, 2)
            ct = B.fused_chunk_tokens(V, torch.bfloat16, lowp_logits=True)
            if mode == R.MODES["fused_lowp"]:
                chunks = -(-T // ct)
                extra = 4 * T if chunks > 1 else 0                        # the dW finish's tc
                if chunks > S.FUSED_CENTER_CHUNKS:                        # cs, mu (fp32, bf16), ones
                    extra += 4 * V + 6 * H + 2 * ct
                assert got == min(ct, T) * V * 2 + 2 * T * H + 32 * T + extra, (T, H, V)
            elif mode == R.MODES["vocab_outer"]:
                assert got == B.BLOCKED_WORKSPACE_BYTES + 6 * T * H + 32 * T, (T, H, V)
            else:
                assert mode == R.MODES["vocab_outer_lowp"], (T, H, V, mode)
                cv = min(V, S.lowp_dx_block_cols(V, H))  # the fp32 dW block's rows (dw_b in the op)
                assert got == B.BLOCKED_WORKSPACE_BYTES + 4 * cv * H + 2 * T * H + 32 * T + 4 * T, (T, H, V)


# ---------------------------------------------- what a reader sees: help, legend, plot


def test_help_shows_one_default_per_flag_and_points_to_the_legend():
    text = P.build_parser().format_help()
    flat = " ".join(text.split())  # argparse wraps lines at the terminal width
    assert "(default: 131072)" in flat and "(default: 8)" in flat and "(default: 141)" in flat
    # one default per flag, never two
    entries = text.split("options:")[1]
    for block in re.split(r"\n  (?=-)", entries):
        assert block.count("default") <= 1, block
    assert "rows (GiB per GPU)" not in text and "--explain" in text  # the legend is behind --explain
    # every option has words of its own beside its default
    for opt in ("--preset", "--layers", "--hidden", "--experts", "--top-k", "--intermediate", "--vocab",
                "--heads", "--kv-heads", "--head-dim", "--context", "--gpus", "--gpu-mem",
                "--imbalance", "--act-bytes", "--plot"):
        i = entries.index(f"  {opt} ")
        nxt = entries.find("\n  --", i + 1)
        desc = entries[i:nxt if nxt > 0 else None].split(None, 2)[-1]
        assert len(desc.replace("(default:", "").split()) >= 3, (opt, desc)


def test_report_explains_its_rows(capsys):
    assert cli.main(["plan", "--preset", "Qwen3-30B-A3B"]) == 0
    out = capsys.readouterr().out
    assert P.ROW_LEGEND not in out and "--explain" in out
    assert cli.main(["plan", "--preset", "Qwen3-30B-A3B", "--explain"]) == 0
    assert P.ROW_LEGEND in capsys.readouterr().out
    assert cli.main(["plan", "--explain"]) == 0  # alone: only the legend
    assert capsys.readouterr().out.strip() == P.ROW_LEGEND


def test_plot_spec_title_limit_range_and_requested_context():
    m, s = P.PRESETS["Qwen3-30B-A3B"], P.Setup(gpus=8)
    spec = plan_chart.plot_spec(m, s, context=262144, name="Qwen3-30B-A3B")
    assert "Qwen3-30B-A3B" in spec["title"] and "8 GPU(s)" in spec["title"]
    assert spec["limit_gib"] == 141.0 and "141 GiB" in spec["limit_label"]
    assert spec["context"] == 262144
    fits = P.longest_context(m, s, "moepeak")
    assert spec["fits"]["moepeak"] == fits and spec["contexts"][-1] > fits  # the axis reaches past it
    assert spec["contexts"][-1] > 262144
    # moepeak's GPU optimizer state is 0 at every context: no legend entry that draws nothing
    assert "moepeak optimizer" in spec["not_drawn"] and "not drawn" in spec["title"]
    for c in spec["curves"]:
        assert any(y > 0 for y in c["gib"]), c["label"]
    assert "moepeak: optimizer" not in [c["label"] for c in spec["curves"]]
    assert {"plain: total", "moepeak: total"} <= {c["label"] for c in spec["curves"]}


def _run_piped(cmd):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.run(["bash", "-c", f"{sys.executable} -m moepeak {cmd}"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", ["--help", "plan --help", "plan --preset Qwen3-30B-A3B"])
def test_closed_pipe_prints_no_traceback(args):
    """`moepeak ... | head -1`, and a reader that closes the pipe before anything is
    written (the write then fails for certain): no BrokenPipeError on stderr."""
    p = _run_piped(f"{args} | head -1")
    assert p.returncode == 0 and p.stdout.strip() and p.stderr == "", (p.stdout, p.stderr)
    p = _run_piped(f"{args} | (exec 0<&-; sleep 0)" + "; exit ${PIPESTATUS[0]}")
    assert p.stderr == "", p.stderr
    # argparse's own --help swallows the write error and exits 0; moepeak's output: 141
    assert p.returncode == (0 if args == "plan --help" else 141) or p.returncode == 141, p.returncode


# ---------------------------------------------- sequence-tiled blocks (--tile-tokens)

def test_mla_widths_in_the_attention_terms():
    """DeepSeek's latent attention: q and k heads are qk_head_dim (192) wide, v and the output
    head_dim (128). The tiled list and the untiled saved attention tensors count each width;
    without qk_head_dim both reduce to the GQA formulas."""
    m = P.PRESETS["DeepSeek-V3"]
    assert (m.d(), m.dqk(), m.heads, m.kv_heads) == (128, 192, 128, 128)
    H, nh, b = 7168, 128, 2
    q, o = nh * 192, nh * 128  # per token: q/k width and v/out width (kv_heads = heads)
    # grad_y, dx; q, out, dout; k, v; lse; one head group (G = 128 of one head each): fp32 dq
    # accumulator, dk/dv expanded, dq/dk/dv
    want = b * (2 * H + q + 2 * o + q + o) + 4 * nh + (4 * q + b * (q + o) + b * (2 * q + o)) / 128
    assert P.tiled_full_len_bytes(m, b) == want
    gqa = dataclasses.replace(m, qk_head_dim=None)
    assert P.tiled_full_len_bytes(gqa, b) < want
    T = 1 << 16
    wide = P.peaks(m, P.Setup(gpus=8), T * 8, "moepeak")["block"]
    narrow = P.peaks(gqa, P.Setup(gpus=8), T * 8, "moepeak")["block"]
    assert wide - narrow == T * b * 2 * (q - o)  # the untiled block: q and k, each 64 wider per head
    with pytest.raises(ValueError, match="qk_head_dim"):
        dataclasses.replace(m, qk_head_dim=0).validate()


def _model_2b(layers=16):
    """The 2.0B demo LM of issue 25."""
    return P.ModelShape(layers=layers, hidden=2048, experts=16, top_k=4, intermediate=768, vocab=151936,
                        heads=16, kv_heads=4, head_dim=128)


def test_tiled_block_term_is_the_listed_full_length_tensors_plus_one_tile():
    m = _model_2b()
    s = P.Setup(gpus=1, tile_tokens=8192)
    # moepeak/tiled/block.py's list without x (the boundaries term's): grad_y, dx 2*2*2048; q, out,
    # dout 3*2*2048; k, v 2*2*512; lse 4*16; group 0's flash backward (4 heads): fp32 dq
    # accumulator 4*512, dk/dv expanded 2*2*512, dq/dk/dv 2*(512+2*128)
    per_token = 2 * 2 * 2048 + 3 * 2 * 2048 + 2 * 2 * 512 + 4 * 16 + 4 * 512 + 2 * 2 * 512 + 2 * (512 + 256)
    assert P.tiled_full_len_bytes(m, 2) == per_token == 28224  # 6.9 bf16 [T, H]; 7.9 with x
    a, b = P.peaks(m, s, 1 << 19, "moepeak"), P.peaks(m, s, 1 << 20, "moepeak")
    assert b["block"] - a["block"] == (1 << 19) * per_token  # the tile's part does not grow with T
    untiled = P.peaks(m, P.Setup(gpus=1), 1 << 20, "moepeak")
    tile_part = b["block"] - (1 << 20) * per_token
    assert tile_part == 8192 * untiled["block"] / (1 << 20)  # one tile of the untiled block's bytes
    assert b["block"] < 0.7 * untiled["block"] and b["dispatch"] < untiled["dispatch"]
    eager = P.peaks(m, P.Setup(gpus=1, lean_norm=False), 1 << 20, "moepeak")  # fp32 norm copies in the block
    assert b["block"] < 0.5 * eager["block"] and untiled["block"] < 0.75 * eager["block"]
    assert P.peaks(m, s, 4096, "moepeak")["block"] == P.peaks(m, P.Setup(gpus=1), 4096, "moepeak")["block"] \
        + 4096 * per_token  # T < tile: one tile of T tokens plus the full-length set
    assert P.longest_context(m, s, "moepeak") > P.longest_context(m, P.Setup(gpus=1), "moepeak")


def test_block_term_named_when_it_binds(capsys):
    m = _model_2b()
    r = P.peaks(m, P.Setup(gpus=1, gpu_mem_gib=141), 1 << 20, "moepeak")
    assert r["binding"] == "block", r  # one GPU, 1M tokens: the recomputed block dominates
    assert cli.main(["plan", "--layers", "16", "--hidden", "2048", "--experts", "16", "--top-k", "4",
                     "--intermediate", "768", "--vocab", "151936", "--heads", "16", "--kv-heads", "4",
                     "--head-dim", "128", "--gpus", "1", "--context", "2097152", "--tile-tokens", "8192"]) == 0
    assert "binding peak = block" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        P.main(["--preset", "Qwen3-30B-A3B", "--tile-tokens", "0"])


def test_device_state_tail_adds_its_budget_capped_at_all_the_state():
    m = P.PRESETS["Qwen3-30B-A3B"]
    base = P.peaks(m, P.Setup(), 131072, "moepeak")
    tail = P.peaks(m, P.Setup(device_state_gib=3.0), 131072, "moepeak")
    assert base["optimizer"] == 0.0 and tail["optimizer"] == 3.0 * P.GiB
    assert tail["total"] == base["total"] + 3.0 * P.GiB
    every = P.peaks(m, P.Setup(device_state_gib=1e6), 131072, "moepeak")
    assert every["optimizer"] == 12.0 * m.params() / 8  # bf16 params: fp32 master, m, v on each of 8 GPUs
    assert P.peaks(m, P.Setup(device_state_gib=3.0), 131072, "plain")["optimizer"] == \
        P.peaks(m, P.Setup(), 131072, "plain")["optimizer"]  # plain keeps its own AdamW state
    with pytest.raises(SystemExit):
        P.main(["--preset", "Qwen3-30B-A3B", "--device-state-gib", "-1"])


# bench_composed.py's moepeak arms (H200; their rows in benchmarks/results/composed.csv): the same
# 2.0B demo model, all state on the host (tail 0) or the 1060.1M leading elements' state on the
# GPU (moepeak_gpu_tail: 12 B each), (context, tail GiB) -> measured peak GiB.
TAIL_GIB = 1060.1e6 * 12 / P.GiB
MEASURED_COMPOSED_H200_GIB = {(131072, 0.0): 15.409, (262144, 0.0): 22.316,
                              (32768, TAIL_GIB): 21.208, (131072, TAIL_GIB): 27.260, (262144, TAIL_GIB): 34.166}


@pytest.mark.parametrize("context, tail", sorted(MEASURED_COMPOSED_H200_GIB))
def test_plan_within_15_percent_of_the_composed_step(context, tail):
    m = P.ModelShape(layers=16, hidden=2048, experts=16, top_k=4, intermediate=768, vocab=151936, heads=16,
                     kv_heads=4, head_dim=128)
    pred = P.peaks(m, P.Setup(gpus=1, act_bytes=2, device_state_gib=tail,
                                llep_save_budget_mb=MEASURED_LLEP_BUDGET_MB), context, "moepeak")["total"] / P.GiB
    assert 0.85 <= pred / MEASURED_COMPOSED_H200_GIB[(context, tail)] <= 1.15, (context, tail, pred)
