"""The two-rank benchmarks' --smoke runs (2 gloo ranks, tiny shapes): every arm of
bench_llep.py (its arms' outputs compared inside the run) and of bench_ring_dtp_dist.py
(each arm's loss and gradients against the reference) completes, so the two-GPU runs
start from code paths that ran."""
import re

import pytest

from dist_utils import run_torchrun


def test_bench_llep_two_rank_smoke():
    pytest.importorskip("torch.distributed.run")
    p = run_torchrun("benchmarks/bench_llep.py", ["--smoke"], timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [line for line in p.stdout.splitlines() if re.match(r"smoke_E\d+_K\d+_H\d+_I\d+\s+T=", line)]
    arms = {line.split()[4] for line in rows}
    assert arms == {"standard_ep", "llep_1chunk", "pipelined", "pipelined_nocache", "pipelined_c32k"}, arms
    # 2 configs x 2 token counts x every imbalance x 5 arms, each "ok"
    assert len(rows) % 20 == 0 and len(rows) >= 40, len(rows)
    assert all(line.split()[5] == "ok" for line in rows), [r for r in rows if r.split()[5] != "ok"]


def test_bench_ring_dtp_dist_two_rank_smoke():
    pytest.importorskip("torch.distributed.run")
    p = run_torchrun("benchmarks/bench_ring_dtp_dist.py", ["--smoke"], timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "smoke ok" in p.stdout
    torch_rows = [line.split() for line in p.stdout.splitlines() if re.match(r"\s*\w+\s+torch\s", line)]
    assert {r[0] for r in torch_rows} >= {"ring_weights", "ring_activations", "ring_auto", "ring_gather"}
    assert all(r[-1] == "ok" for r in torch_rows), torch_rows
