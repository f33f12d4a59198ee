"""benchmarks/bench_demo_reach.py --smoke under torchrun (2 gloo ranks, tiny
model): rows for every point, and an OOM raised on one rank only (the other is
then blocked in a collective) is recorded as that point's result and stops the
arm, on both ranks, without a hang."""
import csv
import os

import pytest

from dist_utils import run_torchrun


def test_reach_smoke_oom_on_one_rank_is_a_result(tmp_path):
    pytest.importorskip("torch.distributed.run")
    p = run_torchrun("benchmarks/bench_demo_reach.py", ["--smoke", "--out", str(tmp_path), "--min-len", "64",
                                                        "--max-len", "128", "--steps", "1", "--grace", "3",
                                                        "--simulate-oom", "plain:128:1"], timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "demo_reach.csv") as f:
        rows = list(csv.DictReader(f))
    got = [(r["arm"], int(r["seq_len"]), r["status"]) for r in rows]
    notes = [(r["arm"], r["seq_len"], r["note"][:400]) for r in rows if r["status"] != "ok"]
    assert got == [("moepeak", 64, "ok"), ("moepeak", 128, "ok"), ("plain", 64, "ok"), ("plain", 128, "oom")], \
        (got, notes)
    assert "simulated" in rows[-1]["note"] and "rank 1" in rows[-1]["note"]
    assert all(float(r["tokens_per_s"]) > 0 for r in rows if r["status"] == "ok")
    assert rows[0]["P"] == "2" and rows[0]["note"] == "llep/ring_dtp/sco/stream"
    assert "plain: longest context completed 64 tokens" in p.stdout
    assert not os.path.exists(tmp_path / ".reach_tmp")


def test_reach_smoke_given_model_and_tiled_blocks(tmp_path):
    """--model L,H,heads,kv_heads,E,K,I,V, --tile-tokens and --sco-keep-last: the moepeak arm's
    blocks tiled under context parallelism over the 2 ranks, the last 2 inputs kept on the
    device; the model tag records all three."""
    pytest.importorskip("torch.distributed.run")
    p = run_torchrun("benchmarks/bench_demo_reach.py", ["--smoke", "--out", str(tmp_path), "--min-len", "128",
                                                        "--max-len", "128", "--steps", "1", "--arms", "moepeak",
                                                        "--model", "3,64,4,2,4,2,48,264", "--tile-tokens", "24",
                                                        "--sco-keep-last", "2"],
                     timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "demo_reach.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["arm"], r["seq_len"], r["status"]) for r in rows] == [("moepeak", "128", "ok")], rows
    assert rows[0]["model"] == "L3-H64-h4/2-E4-K2-I48-V264-float32-tile24-keep2"
    bad = run_torchrun("benchmarks/bench_demo_reach.py", ["--smoke", "--out", str(tmp_path), "--model", "3,64"],
                       timeout=60)
    assert bad.returncode != 0 and "--model must be one of" in bad.stderr
