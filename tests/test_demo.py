"""`moepeak demo` end to end on CPU through the Python entry point: the loss
falls, save/resume continues the same curve, bad configs are refused before
any work, the CLI dispatches."""
import math

import pytest
import torch

from moepeak import cli
from moepeak.demo import run

TINY = ["--device", "cpu", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
        "--experts", "4", "--top-k", "2", "--intermediate", "32", "--vocab", "264",
        "--seq-len", "64", "--batch", "4", "--no-compare", "--lr", "1e-2", "--quiet", "--data-mb", "1"]


def test_demo_loss_falls_and_reports_peaks():
    r = run(TINY + ["--steps", "40"])
    L = r["losses"]
    assert len(L) == 40 and all(torch.isfinite(torch.tensor(L)))
    first, last = sum(L[:5]) / 5, sum(L[-5:]) / 5
    assert last < first - 1.0, (first, last)
    names = [row["peak"] for row in r["peaks"]]
    assert names == ["dispatch", "vocab", "boundaries", "optimizer"]
    for row in r["peaks"]:
        assert isinstance(row["moepeak"], int) and row["moepeak"] > 0, row
    # boundaries on CPU: L*B*T*H*b exactly
    assert r["peaks"][2]["moepeak"] == 1 * 4 * 64 * 32 * 4


def test_demo_save_resume_continues_the_curve(tmp_path):
    sched = ["--warmup", "3", "--lr-horizon", "8"]  # one LR curve over the 8 steps
    full = run(TINY + sched + ["--steps", "8", "--no-peaks"])["losses"]
    ck = str(tmp_path / "ck")
    first = run(TINY + sched + ["--steps", "4", "--no-peaks", "--save", ck])
    second = run(TINY + sched + ["--steps", "4", "--no-peaks", "--resume", ck])
    assert second["start"] == 4
    assert second["losses"][:4] == first["losses"]
    torch.testing.assert_close(torch.tensor(second["losses"]), torch.tensor(full), rtol=1e-5, atol=1e-6)


def test_demo_plain_flags():
    r = run(TINY + ["--steps", "2", "--plain", "--no-peaks"])
    assert (r["cfg"].moe, r["cfg"].head, r["cfg"].checkpoint, r["optimizer"]) == \
        ("dense", "plain", "torch", "torch")
    r = run(TINY + ["--steps", "2", "--no-checkpoint", "--no-peaks"])
    assert r["cfg"].checkpoint == "none"


@pytest.mark.parametrize("extra, msg", [
    (["--hidden", "31"], "heads (2) must divide hidden (31)"),
    (["--top-k", "9"], "top_k (9) must be <= experts (4)"),
    (["--seq-len", "1"], "--seq-len must be >= 2"),
    (["--seq-len", str(1 << 44)], "SCO arena needs"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--resume", "/nonexistent/moepeak"], "is not a directory written by --save"),
])
def test_demo_rejects_bad_config_before_work(extra, msg, capsys):
    assert cli.main(["demo"] + TINY + ["--steps", "1"] + extra) == 2
    err = capsys.readouterr().err
    assert msg in err, err


def test_cli_dispatch(capsys):
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert cli.main(["bogus"]) == 2
    assert cli.main(["demo"] + TINY + ["--steps", "1", "--no-peaks"]) == 0


def test_plot_without_matplotlib_is_skipped_cleanly(tmp_path, capsys):
    out = tmp_path / "p.png"
    run(TINY + ["--steps", "2", "--no-peaks", "--plot", str(out)])
    try:
        import matplotlib  # noqa: F401
        assert out.exists() and out.stat().st_size > 0
    except ImportError:
        assert not out.exists()


@pytest.mark.cuda
def test_demo_cuda_small():
    r = run(["--device", "cuda", "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
             "--experts", "8", "--intermediate", "256", "--vocab", "32768", "--seq-len", "8192",
             "--steps", "30", "--quiet"])
    L = r["losses"]
    assert sum(L[-5:]) / 5 < sum(L[:5]) / 5 - 0.5
    rows = {row["peak"]: row for row in r["peaks"]}
    # at 8192 x 32768 the plain head holds >= 1 GiB of fp32 logits; Ring-DTP must stay far below
    if r["cfg"].head == "ring_dtp":
        assert rows["vocab"]["moepeak"] < rows["vocab"]["plain"] / 4


def test_ctrl_c_exits_cleanly():
    """SIGINT mid-training: exit status 130, a message, no traceback, no child left.
    The signal is sent only once the demo reports training steps; it stops at the
    next step boundary, so a loaded machine slows the exit down but cannot lose it."""
    import os
    import queue
    import signal
    import subprocess
    import sys
    import threading
    import time
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONUNBUFFERED="1",  # this checkout's moepeak, not an installed one
               PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    p = subprocess.Popen([sys.executable, "-m", "moepeak", "demo"] + TINY[:-3] +
                         ["--steps", "100000", "--log-every", "1", "--data-mb", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines, err = queue.Queue(), []
    readers = [threading.Thread(target=lambda: [lines.put(x) for x in p.stdout] + [lines.put(None)], daemon=True),
               threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + 600  # startup on a loaded 2-core machine
        seen = []
        while not any("step" in x and "loss" in x for x in seen):
            left = deadline - time.monotonic()
            assert left > 0, f"demo produced no progress line in 600 s: {seen[-5:]}"
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"demo exited before training: {seen[-5:]} {''.join(err)[-2000:]}"
            seen.append(line)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=300)  # one tiny step and the cleanup, on a loaded machine
        for t in readers:  # the pipes reach EOF once the demo has exited
            t.join(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    err = "".join(err)
    assert p.returncode == 130, (p.returncode, err)
    assert "interrupted" in err and "Traceback" not in err, err


def _demo_ranks(rank, world, ck, out):
    from moepeak.demo import run as demo_run
    argv = TINY + ["--no-peaks", "--experts", "4", "--warmup", "2", "--lr-horizon", "4"]
    full = demo_run(argv + ["--steps", "4"])["losses"]
    first = demo_run(argv + ["--steps", "2", "--save", ck])["losses"]
    second = demo_run(argv + ["--steps", "2", "--resume", ck])
    if rank == 0:
        torch.save({"full": full, "first": first, "second": second["losses"],
                    "start": second["start"]}, out)


def test_demo_fsdp2_gloo_save_resume(tmp_path, monkeypatch):
    """Two gloo ranks (FSDP2, and expert parallelism + Ring-DTP when present):
    save after 2 steps, resume, and the 4-step curve is the uninterrupted one."""
    import os
    from dist_utils import run_ranks
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = str(tmp_path / "r.pt")
    run_ranks(2, _demo_ranks, str(tmp_path / "ck"), out, timeout=170)
    r = torch.load(out)
    assert r["start"] == 2 and r["second"][:2] == r["first"]
    torch.testing.assert_close(torch.tensor(r["second"]), torch.tensor(r["full"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_interrupt_in_process_frees_sco_arena(device, monkeypatch):
    """KeyboardInterrupt mid-run: no live SCO boundary and no pinned arena left."""
    import moepeak.demo.data as D
    import moepeak.demo.models as M
    made, orig_use, orig_batch, n = [], M.MoELM.use_sco, D.TokenStream.batch, [0]

    def use_sco(self):
        orig_use(self)
        made.append(self.sco)

    def batch(self, *a, **k):
        n[0] += 1
        if n[0] == 4:  # during the 4th step, after 3 forward/backward passes
            raise KeyboardInterrupt
        return orig_batch(self, *a, **k)
    monkeypatch.setattr(M.MoELM, "use_sco", use_sco)
    monkeypatch.setattr(D.TokenStream, "batch", batch)
    argv = TINY + ["--steps", "10", "--no-peaks", "--device", device]
    if device == "cuda":
        argv += ["--seq-len", "2048"]
    with pytest.raises(KeyboardInterrupt):
        run(argv)
    if not made:
        pytest.skip("SCO not in this build")
    for c in made:
        st = c.stats()
        assert st["live"] == 0 and st["arena_bytes"] == 0, st


def test_warmup_cosine_schedule():
    from moepeak.demo import warmup_cosine
    f = warmup_cosine(15, 150, 0.1)
    assert abs(f(0) - 1 / 15) < 1e-12 and f(14) == 1.0 and f(15) == 1.0
    assert abs(f(82) - (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 67 / 135)))) < 1e-12
    assert abs(f(150) - 0.1) < 1e-12 and abs(f(10 ** 6) - 0.1) < 1e-12
    vals = [f(s) for s in range(15, 151)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))  # monotone decay after warmup


def _png_width(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", head
    return int.from_bytes(head[16:20], "big")


def test_demo_overlays_plain_pytorch(tmp_path):
    """--compare trains the same model in plain PyTorch from the same weights on the
    same batches: in fp32 on CPU its loss is moepeak's at every step to fp32 rounding
    (sums in another order), and the PNG has the loss, difference and peak panels."""
    out = tmp_path / "demo.png"
    r = run(TINY + ["--compare", "--steps", "8", "--plot", str(out)])
    plain = r["plain"]
    assert len(plain["losses"]) == 8 and not plain["note"], plain
    for s, (p, m) in enumerate(zip(plain["losses"], r["losses"])):
        assert abs(p - m) <= 1e-5 * abs(p), (s, p, m)
    assert plain["max_abs_diff"] == max(abs(p - m) for p, m in zip(plain["losses"], r["losses"]))
    assert r["losses"][-1] < r["losses"][0]
    pytest.importorskip("matplotlib")
    assert _png_width(out) == 3 * 660  # three panels of 5.5 in at 120 dpi


def test_demo_compare_off_when_already_plain_or_resumed(tmp_path):
    r = run(TINY + ["--compare", "--plain", "--steps", "2", "--no-peaks"])
    assert r["plain"]["losses"] == [] and "plain PyTorch already" in r["plain"]["note"]
    ck = str(tmp_path / "ck")
    run(TINY + ["--steps", "1", "--no-peaks", "--save", ck])
    r = run(TINY + ["--compare", "--steps", "1", "--no-peaks", "--resume", ck])
    assert r["plain"]["losses"] == [] and "resumed" in r["plain"]["note"]


@pytest.mark.parametrize("compare, table, panels", [
    (False, False, 1),   # the multi-rank run without a comparison: the loss panel alone
    (True, False, 2),    # the multi-rank run with one: loss + difference
    (True, True, 3),
])
def test_plot_has_no_empty_panel(tmp_path, compare, table, panels):
    pytest.importorskip("matplotlib")
    from moepeak.demo.plot import plot_run
    losses = [5.0, 4.0, 3.5]
    plain = {"losses": [5.0, 4.001, 3.5] if compare else [], "note": "" if compare else "comparison off"}
    rows = [{"peak": k, "moepeak": 1 << 20, "plain": "OOM" if k == "vocab" else 2 << 20}
            for k in ("dispatch", "vocab", "boundaries", "optimizer")] if table else None
    out = tmp_path / "p.png"
    assert plot_run(str(out), losses, 0, plain, rows, "title", lambda *a: None)
    assert _png_width(out) == panels * 660
