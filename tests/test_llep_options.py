"""PipelinedLLEP's options and statistics (CPU): LLEPOptions is the one home of the
schedule's defaults and checks (llep_moe, PipelinedLLEPMoE, moepeak.hf and moepeak.titan
read it); LLEPStats receives each call's forward and backward record, per object (no
module global); the grouped-GEMM choice is the option grouped_mm ("auto" falls back per
call and warns once through the logger "moepeak"; "on" refuses or raises; "off" never)."""
import dataclasses
import gc
import logging
import uuid

import pytest
import torch

from moepeak.llep import LLEPOptions, LLEPStats, PipelinedLLEPMoE, gemm, llep_moe
from tests import refs


def _problem(T=37, H=16, I=8, E=8, K=2, dtype=torch.float32, seed=0):
    x, ids, tw, wgu, wd, gy = refs.moe_problem(T, E, K, H, I, 0.3, seed)
    return (x.to(dtype), ids, tw.float(), wgu.to(dtype), wd.to(dtype), gy.to(dtype))


def _grads(x, ids, tw, wgu, wd, gy, **kw):
    leaves = [t.clone().requires_grad_() for t in (x, tw, wgu, wd)]
    y = llep_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], **kw)
    return (y.detach(),) + torch.autograd.grad(y, leaves, gy)


# ---------------------------------------------------------------------------
# LLEPOptions
# ---------------------------------------------------------------------------
def test_defaults_and_names():
    o = LLEPOptions()
    assert (o.chunk_rows, o.alpha, o.min_tokens_per_gemm, o.imbalance_threshold, o.save_budget_mb,
            o.grouped_mm) == (None, 1.0, 1024, 1.3, None, "auto")
    assert LLEPOptions.names() == ("chunk_rows", "alpha", "min_tokens_per_gemm", "imbalance_threshold",
                                   "save_budget_mb", "grouped_mm")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.alpha = 2.0


@pytest.mark.parametrize("field,value,msg", [
    ("chunk_rows", 0, "chunk_rows must be None or an int >= 1"),
    ("chunk_rows", 2.0, "chunk_rows must be None or an int >= 1"),
    ("chunk_rows", True, "chunk_rows must be None or an int >= 1"),
    ("alpha", 0.5, "alpha must be a finite number >= 1.0"),
    ("alpha", float("nan"), "alpha must be a finite number >= 1.0"),
    ("alpha", "2", "alpha must be a finite number >= 1.0"),
    ("imbalance_threshold", 0.9, "imbalance_threshold must be a finite number >= 1.0"),
    ("imbalance_threshold", float("inf"), "imbalance_threshold must be a finite number >= 1.0"),
    ("min_tokens_per_gemm", -1, "min_tokens_per_gemm must be an int >= 0"),
    ("min_tokens_per_gemm", None, "min_tokens_per_gemm must be an int >= 0"),
    ("save_budget_mb", -1, "save_budget_mb must be None or an int >= 0"),
    ("save_budget_mb", 1.5, "save_budget_mb must be None or an int >= 0"),
    ("grouped_mm", "yes", "grouped_mm must be one of"),
])
def test_bad_option_named(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        LLEPOptions(**{field: value})
    if value is not None:  # a keyword left at None takes the options' field
        x, ids, tw, wgu, wd, _ = _problem()
        with pytest.raises(ValueError, match=msg):
            llep_moe(x, ids, tw, wgu, wd, **{field: value})
        with pytest.raises(ValueError, match=msg):
            PipelinedLLEPMoE(16, 8, 8, 2, **{field: value})


def test_resolve():
    base = LLEPOptions(chunk_rows=8, save_budget_mb=0)
    assert LLEPOptions.resolve() == LLEPOptions()
    assert LLEPOptions.resolve(base) is base
    assert LLEPOptions.resolve(base, alpha=1.5, chunk_rows=None) == LLEPOptions(chunk_rows=8, save_budget_mb=0,
                                                                                alpha=1.5)
    with pytest.raises(TypeError, match="keywords"):
        LLEPOptions.resolve(base, chunk_size=3)
    with pytest.raises(TypeError, match="options must be an LLEPOptions"):
        LLEPOptions.resolve({"chunk_rows": 8})


def test_options_object_equals_keywords_bitwise():
    prob = _problem()
    kw = dict(chunk_rows=9, save_budget_mb=0, alpha=1.2, imbalance_threshold=1.5, min_tokens_per_gemm=3)
    a = _grads(*prob, **kw)
    b = _grads(*prob, options=LLEPOptions(**kw))
    c = _grads(*prob, options=LLEPOptions(chunk_rows=1 << 20, save_budget_mb=0), chunk_rows=9, alpha=1.2,
               imbalance_threshold=1.5, min_tokens_per_gemm=3)
    for u, v, w in zip(a, b, c):
        assert torch.equal(u, v) and torch.equal(u, w)


def test_module_keeps_its_options():
    m = PipelinedLLEPMoE(16, 8, 8, 2, chunk_rows=7, save_budget_mb=0)
    assert m.options == LLEPOptions(chunk_rows=7, save_budget_mb=0)
    m2 = PipelinedLLEPMoE(16, 8, 8, 2, options=m.options, alpha=2.0)
    assert m2.options == LLEPOptions(chunk_rows=7, save_budget_mb=0, alpha=2.0)


def test_chunk_rows_below_group_size_refused():
    x, ids, tw, wgu, wd, _ = _problem()
    with pytest.raises(ValueError, match="chunk_rows must be"):
        llep_moe(x, ids, tw, wgu, wd, chunk_rows=0)


def test_integrations_read_the_option_names():
    from moepeak.hf import apply
    assert apply.EXPERTS_OPTIONS == LLEPOptions.names()
    pytest.importorskip("torchtitan")
    from moepeak.titan.routed_experts import LLEPRoutedExperts
    defaults = {f.name: f.default for f in dataclasses.fields(LLEPRoutedExperts.Config)}
    for f in dataclasses.fields(LLEPOptions):
        assert defaults[f.name] == f.default, f.name


# ---------------------------------------------------------------------------
# LLEPStats
# ---------------------------------------------------------------------------
def test_stats_per_object_and_per_phase():
    prob = _problem()
    a, b = LLEPStats(), LLEPStats()
    _grads(*prob, chunk_rows=9, save_budget_mb=0, stats=a)
    _grads(*prob, chunk_rows=1 << 20, save_budget_mb=0, stats=b)
    assert a.forward["n_chunks"] == a.backward["n_chunks"] == -(-37 * 2 // 9)
    assert b.forward["n_chunks"] == b.backward["n_chunks"] == 1
    assert a.forward["host_syncs"] == 1 and a.backward["host_syncs"] == 0  # backward reuses forward's plan
    assert "recomputed_chunks" in a.backward and "recomputed_chunks" not in a.forward
    assert "cache_bytes" in a.forward and "cache_bytes" not in a.backward
    before = (dict(a.forward), dict(a.backward))
    _grads(*prob, chunk_rows=5)  # a call without stats changes no one's
    assert (a.forward, a.backward) == before
    with torch.no_grad():  # forward only: backward's record stays the last one
        llep_moe(*prob[:5], chunk_rows=5, stats=a)
    assert a.forward["n_chunks"] == -(-37 * 2 // 5) and a.backward == before[1]


def test_stats_bad_type_and_dropped_object():
    x, ids, tw, wgu, wd, gy = _problem()
    with pytest.raises(TypeError, match="stats must be an LLEPStats"):
        llep_moe(x, ids, tw, wgu, wd, stats={})
    st = LLEPStats()
    xl = x.clone().requires_grad_()
    y = llep_moe(xl, ids, tw, wgu, wd, chunk_rows=9, stats=st)
    del st
    gc.collect()
    y.backward(gy)  # its backward has nowhere to put the record: nothing happens
    assert xl.grad is not None


def test_module_last_stats():
    torch.manual_seed(0)
    m = PipelinedLLEPMoE(16, 8, 8, 2, chunk_rows=7)
    y, _ = m(torch.randn(2, 5, 16))
    assert m.last_stats.forward["n_chunks"] == 3 and m.last_stats.backward == {}
    y.square().sum().backward()
    assert m.last_stats.backward["n_chunks"] == 3


def test_torch_compile_fullgraph_fills_stats():
    """The ops stay opaque under torch.compile (the stats key is a constant of the graph):
    the whole module traces as one graph, gives eager's values, and its statistics are
    filled at run time."""
    torch.manual_seed(0)
    m = PipelinedLLEPMoE(16, 8, 8, 2, chunk_rows=7)
    x = torch.randn(2, 5, 16)
    y, _ = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    y.square().sum().backward()
    assert m.last_stats.forward["n_chunks"] == m.last_stats.backward["n_chunks"] == 3
    got = m.w_gate_up.grad.clone()
    m.zero_grad()
    y2, _ = m(x)
    y2.square().sum().backward()
    assert torch.equal(y, y2) and torch.equal(got, m.w_gate_up.grad)


# ---------------------------------------------------------------------------
# grouped_mm
# ---------------------------------------------------------------------------
def test_grouped_on_refused_where_it_cannot_run():
    x, ids, tw, wgu, wd, _ = _problem()  # fp32: torch._grouped_mm takes bf16
    with pytest.raises(ValueError, match="grouped_mm='on' but torch._grouped_mm cannot run this call: it takes bf16"):
        llep_moe(x, ids, tw, wgu, wd, grouped_mm="on")
    x, ids, tw, wgu, wd, _ = _problem(H=12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 8"):
        llep_moe(x, ids, tw, wgu, wd, grouped_mm="on")


def test_grouped_auto_falls_back_per_call_and_warns_once(monkeypatch, caplog):
    """Under "auto" a raise from torch._grouped_mm sends the rest of the call to the
    per-expert GEMMs (bitwise grouped_mm="off"), warns once per distinct error through the
    logger "moepeak", and switches nothing off for the next call, which tries again."""
    prob = _problem(H=16, I=8, dtype=torch.bfloat16)
    want = _grads(*prob, chunk_rows=16, grouped_mm="off")
    tries = []
    message = f"fake grouped_mm failure {uuid.uuid4().hex}"

    def failing(*args, **kw):
        tries.append(1)
        raise RuntimeError(message)

    monkeypatch.setattr(gemm, "grouped_capability", lambda *a, **k: None)  # "auto" thinks it qualifies on CPU
    monkeypatch.setattr(torch, "_grouped_mm", failing)
    caplog.set_level(logging.WARNING, logger="moepeak")
    st = LLEPStats()
    for call in range(2):
        n = len(tries)
        got = _grads(*prob, chunk_rows=16, stats=st)
        assert len(tries) == n + 2  # forward and backward each tried once, then went per-expert
        assert st.forward["grouped_fallback"] == st.backward["grouped_fallback"] == 1
        assert st.forward["grouped_mm"] == st.backward["grouped_mm"] == 0
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    warnings = [r for r in caplog.records if r.name == "moepeak" and message in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    with pytest.raises(RuntimeError, match=message):  # "on": the error propagates
        _grads(*prob, chunk_rows=16, grouped_mm="on")
