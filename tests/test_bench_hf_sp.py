"""benchmarks/bench_hf_sp.py --smoke under torchrun (2 gloo ranks, DeepSpeed Ulysses on the CPU):
both arms (the stock engine: Ulysses + FSDP2; Ulysses + apply_moepeak + DDP) train a 64-token
sequence split over the ranks and write their rows."""
import csv
import math
import os

import pytest

from dist_utils import run_torchrun

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")


def test_hf_sp_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    p = run_torchrun("benchmarks/bench_hf_sp.py", ["--smoke", "--max-len", "64", "--out", str(tmp_path)],
                     timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "hf_sp.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["arm"], int(r["T"]), int(r["tokens_per_rank"]), r["status"]) for r in rows] == \
        [("ulysses", 64, 32, "ok"), ("moepeak", 64, 32, "ok")], [r["note"] for r in rows]
    assert all(r["P"] == "2" and r["model"] == "tiny" and float(r["tokens_per_s"]) > 0 for r in rows)
    assert all(math.isfinite(float(r["loss"])) and float(r["loss"]) > 0 for r in rows)
    assert "split over 2 ranks" in rows[1]["note"] and "FSDP2" in rows[0]["note"]
    assert "reach ratio moepeak/ulysses: 1.0x" in p.stdout
    assert not os.path.exists(tmp_path / ".hf_sp_tmp")
