"""benchmarks/bench_hf_dist.py --tiny under torchrun (2 gloo ranks): both arms write rows,
the moepeak arm's replicated parameters stay equal over the ranks, and an OOM raised on
one rank only is that point's result and ends the arm on both ranks, without a hang."""
import csv
import os

import pytest

from dist_utils import run_torchrun

pytest.importorskip("transformers")


def test_hf_dist_tiny_oom_on_one_rank_is_a_result(tmp_path):
    p = run_torchrun("benchmarks/bench_hf_dist.py", ["--tiny", "--out", str(tmp_path), "--grace", "3",
                                                     "--simulate-oom", "fsdp:128:1"], timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "hf_dist.csv") as f:
        rows = list(csv.DictReader(f))
    got = [(r["arm"], int(r["tokens_per_rank"]), r["status"]) for r in rows]
    assert got == [("fsdp", 64, "ok"), ("fsdp", 128, "oom"), ("moepeak", 64, "ok"), ("moepeak", 128, "ok")], \
        (got, [r["note"] for r in rows])
    assert "simulated" in rows[1]["note"] and "rank 1" in rows[1]["note"]
    assert "split over 2 ranks" in rows[2]["note"] and all(r["P"] == "2" for r in rows)
    ok = [r for r in rows if r["status"] == "ok"]
    assert all(float(r["tokens_per_s_per_gpu"]) > 0 and float(r["loss"]) > 0 for r in ok)
    # the same data and weights: the two arms' first losses agree (fp32 vs bf16 params on the CPU)
    assert abs(float(ok[0]["loss"]) - float(ok[1]["loss"])) < 0.05
    assert "reach ratio moepeak/fsdp: 2.0x" in p.stdout
    assert not os.path.exists(tmp_path / ".hf_dist_tmp")
