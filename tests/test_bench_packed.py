"""benchmarks/bench_packed.py: its CPU smoke run (stock and moepeak on one packed row of
documents, against each document run alone in fp32) writes rows of the results schema
with the masks checked, and its document-mask check rejects masks that let documents
attend across their boundaries."""
import csv
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_packed", os.path.join(ROOT, "benchmarks", "bench_packed.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_matches_the_unpacked_reference(tmp_path):
    res = subprocess.run([sys.executable, "benchmarks/bench_packed.py", "--smoke", "--dtypes", "bfloat16,float32",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    with open(tmp_path / "packed.csv") as f:
        rows = {(r["arm"], r["dtype"]): r for r in csv.DictReader(f)}
    assert all(r["timestamp"] and r["torch"] and r["commit"] for r in rows.values())
    groups = [f"err_{g}" for g in _bench().GROUPS]
    for dtype in ("bfloat16", "float32"):
        for arm in ("stock", "moepeak"):
            r = rows[arm, dtype]
            assert r["status"] == "ok" and r["mask_ok"] == "True", r  # the attention got the document mask
        ratio = rows["moepeak/stock", dtype]
        if dtype == "float32":  # the packed row is the documents run alone, up to fp32 rounding
            for arm in ("stock", "moepeak"):
                errs = {c: float(rows[arm, dtype][c]) for c in ["loss_err"] + groups}
                assert max(errs.values()) < 1e-5, (arm, errs)
        else:  # docs/design.md's rule: at most 2x stock's error at bf16
            assert all(float(ratio[c]) <= 2.0 for c in groups), ratio
            assert all(float(rows[arm, dtype]["loss_err"]) < 1e-3 for arm in ("stock", "moepeak"))
    ref = rows["fp32_ref", "float32"]
    assert ref["status"] == "ok" and ref["mask_ok"] == "True" and "BlockMask" in ref["note"], ref  # flex's mask
    assert res.stdout.rstrip().splitlines()[-1].split()[0] == "moepeak/stock"  # the table comes last


def test_mask_check_rejects_masks_across_documents():
    bench = _bench()
    from torch.nn.attention.flex_attention import create_block_mask
    lengths = [100, 156, 7, 121]  # T = 384: three 128-token blocks, documents across block edges
    T = sum(lengths)
    doc_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    q, kv = torch.arange(T)[:, None], torch.arange(T)[None, :]

    def document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_of[q_idx] == doc_of[kv_idx])

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def boundary_moved(b, h, q_idx, kv_idx):  # right pairs, except a document boundary moved by one token
        shifted = doc_of.clone()
        shifted[100] = 0
        return (kv_idx <= q_idx) & (shifted[q_idx] == shifted[kv_idx])

    ok, detail = bench.check_document_causal(create_block_mask(document_causal, 1, None, T, T, device="cpu"),
                                             lengths, every_pair=True)
    assert ok, detail
    dense = document_causal(0, 0, q, kv)[None, None]  # [1, 1, T, T], as SDPA gets it
    ok, detail = bench.check_document_causal(dense, lengths, every_pair=True)
    assert ok, detail
    for bad in (create_block_mask(causal, 1, None, T, T, device="cpu"),
                create_block_mask(boundary_moved, 1, None, T, T, device="cpu"),
                causal(0, 0, q, kv)[None, None], None):
        ok, detail = bench.check_document_causal(bad, lengths, every_pair=True)
        assert not ok and detail, type(bad)
    # the sampled check (the GPU run's) sees a boundary error too
    ok, _ = bench.check_document_causal(create_block_mask(boundary_moved, 1, None, T, T, device="cpu"), lengths,
                                        every_pair=False)
    assert not ok


def test_document_lengths_and_labels():
    bench = _bench()
    for T, seed in [(384, 0), (131072, 0), (131072, 5), (1000, 3)]:
        lengths = bench.document_lengths(T, seed)
        assert sum(lengths) == T and min(lengths) >= 2 and len(lengths) >= 3, lengths
    ids, pos, labels = bench.packed_inputs([5, 3, 4], 50, 0, "cpu")
    assert pos.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]
    assert (labels == -100).nonzero()[:, 1].tolist() == [0, 5, 8]
    assert torch.equal(labels[labels != -100], ids[labels != -100])
    with pytest.raises(ValueError, match="no group"):
        bench.group_of("model.layers.0.mlp.shared_expert.weight")
