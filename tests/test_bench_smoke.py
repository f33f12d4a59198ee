"""The GPU benchmarks without a test of their own run end to end on the CPU in their tiny
mode and write rows of the results schema (so a device call is not spent on a script error)."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout=300):
    res = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res


def _rows(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["timestamp"] and r["torch"] for r in rows), rows
    return rows


@pytest.mark.parametrize("model", [False, True])
def test_bench_tiled_tiny(tmp_path, model):
    _run(["benchmarks/bench_tiled.py", "--tiny", "--out", str(tmp_path)] + (["--model"] if model else []))
    rows = _rows(tmp_path / ("tiled_model.csv" if model else "tiled.csv"))
    assert {(r["arm"], r["status"]) for r in rows} == {("untiled", "ok"), ("tiled", "ok")}, rows


def test_bench_titan_tiny(tmp_path):
    try:
        from tests.titan_utils import require_torchtitan
    except ImportError:  # rootdir not on sys.path
        from titan_utils import require_torchtitan
    require_torchtitan()
    out = tmp_path / "titan.csv"
    _run(["benchmarks/bench_titan.py", "--tiny", "--out", str(out), "--max-t", "128",
          "--jobs", "stock,moepeak,moepeak_tiled"], timeout=600)
    rows = _rows(out)
    assert {r["job"] for r in rows if r["status"] == "ok"} == {"stock", "moepeak", "moepeak_tiled"}, rows


def test_bench_titan_jobs_share_one_rope_table_per_model():
    try:
        from tests.titan_utils import require_torchtitan
    except ImportError:  # rootdir not on sys.path
        from titan_utils import require_torchtitan
    require_torchtitan()
    import torch
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_titan

    own = bench_titan.build_config(True, max_seq_len=96).model_spec.model.build()  # stock torchtitan
    own.init_weights(buffer_device=torch.device("cpu"))
    for name in bench_titan.JOBS:
        model = bench_titan.job_config(name, True, max_seq_len=96).model_spec.model.build()
        model.init_weights(buffer_device=torch.device("cpu"))
        shared = [blk.attention.rope.cache for blk in model.layers.values()]
        assert len(shared) == 2 and shared[0].shape[0] == 96, name
        assert shared[1] is shared[0], name
        assert torch.equal(shared[0], own.layers["0"].attention.rope.cache), name  # the same numbers
        assert "layers.1.attention.rope.cache" in dict(model.named_buffers(remove_duplicate=False)), name


LLEP_P1_ARMS = ("grouped_mm_hf", "grouped_mm_titan", "grouped_mm_bf16w", "grouped_mm_fp32w", "pipelined",
                "pipelined_hf_layout", "pipelined_titan_layout")


def test_bench_llep_one_rank_fair_arms_smoke(tmp_path):
    """Issue 38's P = 1 arms (transformers' and torchtitan's grouped layers, the fp32-weights
    arm under its new name, llep_moe on each library's weight layout) run on CPU and agree
    on the layer's output inside the run (bench_llep's --smoke check)."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchtitan")
    res = _run(["benchmarks/bench_llep.py", "--smoke", "--tokens", "64", "--routing", "balanced,95:4",
                "--arms", ",".join(LLEP_P1_ARMS), "--out", str(tmp_path)])
    rows = _rows(tmp_path / "llep.csv")
    # 2 smoke configs x 2 routings, every arm ok
    assert sorted((r["arm"], r["status"]) for r in rows) == sorted([(a, "ok") for a in LLEP_P1_ARMS] * 4), rows
    assert "pipelined vs the grouped arms" not in res.stdout  # CPU runs measure no time: no ratios


def test_bench_llep_old_grouped_arm_name_refused():
    res = subprocess.run([sys.executable, "benchmarks/bench_llep.py", "--smoke", "--arms", "grouped_mm"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode != 0 and "grouped_mm_fp32w" in res.stderr, res.stderr[-2000:]


def test_profile_llep_vs_grouped_smoke(tmp_path):
    """The issue 38 profile study runs its four default arms on CPU (CPU ops stand in for
    kernels) and writes the side-by-side table and its kernel rows."""
    pytest.importorskip("transformers")
    res = _run(["benchmarks/studies/profile_llep_vs_grouped.py", "--smoke", "--out", str(tmp_path)])
    stem = tmp_path / "profile_llep_T64_balanced"
    text = (stem.with_suffix(".txt")).read_text()
    for arm in ("pipelined", "grouped_mm_hf", "pipelined_nocache", "moepeak_1chunk"):
        assert f"== {arm}: wall" in text, res.stdout[-3000:]
    assert "llep bwd:" in text and "per kernel class" in text
    with open(stem.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    assert rows and float(rows[0]["pipelined_ms"]) >= 0 and "grouped_mm_hf_count" in rows[0]
    assert any(r["class"] == "gemm" and float(r["grouped_mm_hf_ms"]) > 0 for r in rows), rows[:5]


def test_bench_attention_smoke(tmp_path):
    """bench_attention.py --smoke (CPU, T = 128): accuracy rows per backend against the fp64
    reference, the packed-document flex check, and timing rows for every grouping and GQA mode
    of the default grid; backends the CPU lacks are rows saying so, not crashes."""
    _run(["benchmarks/bench_attention.py", "--smoke", "--backends", "flash,efficient,flex", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "attention.csv")
    acc = {(r["model"], r["backend"], r["gqa"]): r for r in rows if r["kind"] == "accuracy"}
    for key in (("qwen3", "flash", "gqa"), ("qwen3", "flash", "expand"), ("olmoe", "flash", "mha"),
                ("qwen3", "math", "gqa")):
        r = acc[key]
        assert r["status"] == "ok", r
        assert all(float(r[e]) < 1e-2 for e in ("err_out", "err_dq", "err_dk", "err_dv")), r
    assert acc[("olmoe", "efficient", "mha")]["status"].startswith("unsupported"), acc
    flex = acc[("olmoe", "flex", "mha")]
    assert flex["status"].startswith("fwd only") and float(flex["err_out"]) < 1e-2, flex  # no flex backward on CPU
    doc = [r for r in rows if r["kind"] == "docmask"]
    assert len(doc) == 1 and float(doc[0]["err_out"]) < 1e-2, doc
    timed = [r for r in rows if r["kind"] == "time" and r["backend"] == "flash"]
    got = {(r["model"], r["q_heads"], r["kv_heads"], r["calls_per_layer"], r["gqa"]) for r in timed}
    assert got == {("qwen3", "16", "4", "1", "gqa"), ("qwen3", "16", "4", "1", "expand"),
                   ("qwen3", "8", "2", "2", "gqa"), ("qwen3", "8", "2", "2", "expand"),
                   ("qwen3", "4", "1", "4", "gqa"), ("qwen3", "4", "1", "4", "expand"),
                   ("olmoe", "16", "16", "1", "mha"), ("olmoe", "4", "4", "4", "mha"),
                   ("olmoe", "1", "1", "16", "mha")}, got
    assert all(r["status"] == "ok" and float(r["fwd_bwd_ms"]) > 0 for r in timed), timed
    assert {r["status"][:8] for r in rows if r["kind"] == "time" and r["backend"] == "flex"} == {"fwd only"}


def test_bench_attention_docmask_check_sees_a_wrong_mask(monkeypatch):
    """The packed-document check fails loudly when flex is given plain causal attention
    instead of the document mask (so its small error in the smoke run means something)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import argparse
    import torch
    import bench_attention

    flex = bench_attention.Flex(torch.device("cpu"))
    args = argparse.Namespace(acc_T=256, layout="bshd")
    good = bench_attention.docmask_row(args, torch.device("cpu"), flex)
    causal_only = flex.mask(256)
    monkeypatch.setattr(flex, "mask", lambda T, mask_mod=None, key=None: causal_only)
    bad = bench_attention.docmask_row(args, torch.device("cpu"), flex)
    assert float(good["err_out"]) < 1e-2 < 0.1 < float(bad["err_out"]), (good, bad)


@pytest.mark.parametrize("T", [64, 300, 384])
def test_bench_attention_causal_block_mask_is_create_block_masks(T):
    """The causal BlockMask bench_attention builds from block lists (no T x T evaluation, so
    512k needs no compile) has create_block_mask's blocks and gives flex its outputs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import bench_attention

    mine = bench_attention.causal_block_mask(T, "cpu")
    ref = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T, device="cpu")
    assert torch.equal(mine.to_dense(), ref.to_dense())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, 16, generator=g) for _ in range(3))
    assert torch.equal(flex_attention(q, k, v, block_mask=mine), flex_attention(q, k, v, block_mask=ref))


def test_run_gpu_stages_parse():
    """benchmarks/run_gpu.sh (the GPU machine's runbook) is valid bash, every stage its header
    names has a case, and every flag its bench_hf.py stages pass is one bench_hf.py takes."""
    import re

    path = os.path.join(ROOT, "benchmarks", "run_gpu.sh")
    res = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = open(path).read()
    header = [m.group(1) for m in re.finditer(r"^#   ([a-z_]+)  ", text, flags=re.M)]
    cases = set(re.findall(r"^    ([a-z_0-9]+)\)$", text, flags=re.M))
    assert header and set(header) <= cases, (header, cases)
    commands = text.replace("\\\n", " ").splitlines()  # continuation lines joined
    hf_flags = set(re.findall(r"(--[a-z][a-z-]*)", "\n".join(c for c in commands if c.strip().startswith("hf "))))
    helptext = _run(["benchmarks/bench_hf.py", "--help"], timeout=120).stdout
    assert hf_flags and all(f in helptext for f in hf_flags), sorted(f for f in hf_flags if f not in helptext)
