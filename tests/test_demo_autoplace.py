"""`moepeak demo`'s automatic placement (moepeak/demo/autoplace.py) on CPU with made-up machine
numbers (autoplace.measure monkeypatched, as tests/test_plan_autoplace.py does for moepeak.hf):
the plan reaches the model (sco_keep_last, SCO's arena, the tiles, StreamAdamW's device tail)
and the report lines, --tile-tokens wins, --no-auto-placement turns it off, a machine too small
raises before anything is built, and on CPU it does nothing and the output is unchanged."""
import pytest
import torch

from moepeak import plan as P
from moepeak.demo import autoplace, run
from moepeak.demo import train as demo_train
from moepeak.sco import KEEP_LAST_DEMO
from test_demo import TINY
from tests.autoplace_helpers import fake_machine, tiles_only_gpu

G = P.GiB
QUIET = TINY.index("--quiet")
LOUD = TINY[:QUIET] + TINY[QUIET + 1:]  # TINY without --quiet


def built_models(monkeypatch):
    """The models the demo builds, in order."""
    models, make = [], demo_train.MoELM

    def record(*a, **k):
        models.append(make(*a, **k))
        return models[-1]
    monkeypatch.setattr(demo_train, "MoELM", record)
    return models


def test_the_plan_reaches_the_model_and_the_report(monkeypatch, capsys):
    calls = fake_machine(monkeypatch, autoplace, 100 * G, 200 * G)
    models = built_models(monkeypatch)
    r = run(LOUD + ["--steps", "2", "--no-peaks"])
    p = r["placement"].placement
    assert len(calls) == 1 and p is not None and p.keep_last == KEEP_LAST_DEMO and p.tile_tokens is None
    model = models[0]
    assert model.cfg.sco_keep_last == p.keep_last and model.cfg.tile_tokens is None
    assert r["cfg"].sco_keep_last == p.keep_last
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("placement:", "  keep_last:"))]
    assert len(lines) == 2 and "boundaries on the GPU" in lines[0] and "whole blocks" in lines[0], lines


def test_cpu_report_unchanged(capsys):
    """Without a GPU the placement is a no-op and prints nothing: the CPU report is as before."""
    run(LOUD + ["--steps", "1", "--no-peaks"])
    assert "placement" not in capsys.readouterr().out


@pytest.mark.cuda
def test_cuda_demo_is_placed(capsys):
    r = run(["--device", "cuda", "--steps", "2", "--no-peaks", "--no-compare", "--seq-len", "8192"])
    p = r["placement"].placement
    assert p is not None and r["cfg"].sco_keep_last == p.keep_last
    out = capsys.readouterr().out
    assert "placement: 8192 tokens per step" in out and "(measured)" in out, out


def test_the_plans_arena_and_tiles_reach_sco(monkeypatch):
    fake_machine(monkeypatch, autoplace, 100 * G, 200 * G)
    arenas = []
    reconfigure = demo_train.MoELM.use_sco

    def use_sco(self):
        reconfigure(self)
        sco = self.sco
        orig = sco.reconfigure

        def spy(*a, **k):
            arenas.append(k.get("arena_bytes"))
            return orig(*a, **k)
        sco.reconfigure = spy
    monkeypatch.setattr(demo_train.MoELM, "use_sco", use_sco)
    r = run(TINY + ["--steps", "1", "--no-peaks"])
    assert arenas == [r["placement"].arena_bytes()] and arenas[0] > 0
    given = run(TINY + ["--steps", "1", "--no-peaks", "--tile-tokens", "16"])
    assert given["placement"].placement.tile_tokens == 16 and given["cfg"].tile_tokens == 16


def test_too_small_a_machine_raises_before_anything_is_built(monkeypatch):
    fake_machine(monkeypatch, autoplace, 100 * G, 9 * G)  # 9 GiB less the 8 GiB + 10% margin: nothing left
    models = built_models(monkeypatch)
    with pytest.raises(P.PlacementError) as e:
        run(TINY + ["--steps", "1"])
    assert e.value.tier == "host" and not models


def test_off_switches_and_cpu(monkeypatch):
    r = run(TINY + ["--steps", "1", "--no-peaks"])  # the real measure: CPU
    assert r["placement"].placement is None and r["placement"].note == "off on CPU (no-op)"
    assert r["cfg"].sco_keep_last == KEEP_LAST_DEMO
    calls = fake_machine(monkeypatch, autoplace, 100 * G, 200 * G)
    off = run(TINY + ["--steps", "1", "--no-peaks", "--no-auto-placement"])
    assert off["placement"].note == "off (--no-auto-placement)" and not calls
    plain = run(TINY + ["--steps", "1", "--no-peaks", "--no-sco"])
    assert plain["placement"].placement is None and "all four schedules" in plain["placement"].note and not calls


def test_cpu_losses_unchanged_by_the_placement(monkeypatch):
    """The placed run (the CPU defaults' keep_last, a sized arena) trains the same numbers."""
    want = run(TINY + ["--steps", "3", "--no-peaks", "--no-auto-placement"])["losses"]
    fake_machine(monkeypatch, autoplace, 100 * G, 200 * G)
    got = run(TINY + ["--steps", "3", "--no-peaks"])["losses"]
    assert got == want
    assert torch.isfinite(torch.tensor(got)).all()


def _share(world, batch, **fields):
    """The Setup of one rank of the demo under torchrun, written out: the planner's default
    layout (the parameters over the world, the context split over it)."""
    return P.Setup(gpus=world, impl="demo", act_bytes=4, batch=batch, **fields)


def test_each_rank_places_its_share_and_never_picks_tiles(monkeypatch):
    """Under torchrun (world 2, LOCAL_WORLD_SIZE 2) a rank plans its own tokens (seq_len / 2 of
    each sequence with context parallelism, its own batch x seq_len without) on its own GPU and
    half the host; where only tiles fit and --tile-tokens was not given, TilesNeeded names it."""
    from moepeak.demo.config import MoEConfig

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    fake_machine(monkeypatch, autoplace, 100 * G, 200 * G)
    common = dict(opt_kind="stream", enabled=True, device=torch.device("cuda"), world=2, batch=2,
                  dtype=torch.float32, bucket_mb=None, state_dtype=None)
    m = autoplace.demo_shape(MoEConfig())
    for cp, context in ((True, 4096), (False, 8192)):
        cfg, placed = autoplace.place_demo(MoEConfig(context_parallel=cp), seq_len=4096, **common)
        expect = P.place(m, _share(2, 2), context, gpu_bytes=100 * G, host_bytes=200 * G, ranks_per_host=2)
        p = placed.placement
        assert (p.tokens, p.keep_last, p.used) == ((2048 if cp else 4096) * 2, expect.keep_last, expect.used)
        assert cfg.sco_keep_last == p.keep_last and "one rank of 2, 2 on this host" in placed.note
    # a GPU where only tiles fit the step
    seq = 1 << 16
    s = _share(2, 1)
    hi, tile = tiles_only_gpu(m, s, seq, ranks_per_host=2)
    fake_machine(monkeypatch, autoplace, hi, 1e15)
    with pytest.raises(P.TilesNeeded, match=rf"give --tile-tokens {tile} on every rank"):
        autoplace.place_demo(MoEConfig(context_parallel=True), seq_len=seq, **dict(common, batch=1))
    _, given = autoplace.place_demo(MoEConfig(context_parallel=True, tile_tokens=tile), seq_len=seq,
                                    **dict(common, batch=1))
    assert given.placement.tile_tokens == tile
