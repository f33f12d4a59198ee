"""benchmarks/bench_composed.py runs end to end on the CPU (--tiny) and writes
its CSV: every arm gets rows (liger: a skip row when liger_kernel is absent),
the moepeak arms report their exposed and standalone optimizer times."""
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))


def test_bench_composed_tiny(tmp_path):
    import bench_composed
    assert bench_composed.main(["--tiny", "--out", str(tmp_path), "--max-len", "64"]) == 0
    with open(tmp_path / "composed.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    by_arm = {}
    for r in rows:
        by_arm.setdefault(r["arm"], []).append(r)
    assert set(by_arm) == {"plain", "liger", "moepeak", "moepeak_gpu_embed", "moepeak_gpu_tail", "moepeak_tiled"}
    for arm in ("plain", "moepeak", "moepeak_gpu_embed", "moepeak_gpu_tail", "moepeak_tiled"):
        (r,) = by_arm[arm]
        assert r["status"] == "ok" and r["seq_len"] == "64", r
        assert float(r["step_s"]) > 0 and float(r["tokens_per_s"]) > 0
        assert float(r["opt_exposed_s"]) >= 0
    assert float(by_arm["moepeak"][0]["opt_standalone_s"]) > 0
    assert "tile_tokens 32" in by_arm["moepeak_tiled"][0]["note"]
    assert "embedding's optimizer state on the device" in by_arm["moepeak_gpu_embed"][0]["note"]
    assert "optimizer state of the first" in by_arm["moepeak_gpu_tail"][0]["note"]
    assert "overlap:" in by_arm["moepeak"][0]["note"]  # what of the update ran after backward
    try:
        import liger_kernel  # noqa: F401
        assert by_arm["liger"][0]["status"] == "ok"
    except ImportError:
        assert by_arm["liger"][0]["status"] == "skipped"


def test_bench_composed_opt_threads(tmp_path):
    import pytest
    import bench_composed
    assert bench_composed.main(["--tiny", "--out", str(tmp_path), "--max-len", "64", "--arms", "moepeak",
                                "--opt-threads", "1"]) == 0
    with open(tmp_path / "composed.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["status"] == "ok" and "StreamAdamW threads 1" in row["note"], row
    with pytest.raises(SystemExit):
        bench_composed.main(["--tiny", "--out", "", "--opt-threads", "0"])
