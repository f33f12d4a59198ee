"""SCOOffloader at run time: reconfigure() between steps (what the automatic placement,
moepeak.plan, calls: keep_last, the host budget, the disk tier on and off), its refusals,
sco_block_from_end, and the disk tier's failure paths: an exception mid-step and a killed
process leave no spill file behind, and the next step runs exactly."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import moepeak
from moepeak.sco import SCOConfig, SCOOffloader, sizes
from tests.test_sco_spill import B, H, ONE, REPO, T, _model, _steps, _torch_checkpointed


def _tiers(sco):
    return [t for _, t in sco.stats()["placement"]]


def _assert_exact(got, want):
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_reconfigure_moves_keep_last_and_the_disk_tier_between_steps(tmp_path):
    """One offloader, four steps of a 5-block model, reconfigured between them: the placement
    follows each new config from the next step on and every step's gradients stay those of
    torch's checkpoint; the spill file goes away when the disk tier is turned off."""
    sco = SCOOffloader(SCOConfig(keep_last=1))
    model = _model(5)
    moepeak.apply_sco(model, list(model), offloader=sco)
    ref = _torch_checkpointed(_model(5))
    plan = [({}, ["host"] * 4 + ["device"]),
            (dict(keep_last=3), ["host"] * 2 + ["device"] * 3),
            (dict(keep_last=0, spill_dir=str(tmp_path), host_budget_bytes=2 * ONE), ["disk"] * 3 + ["host"] * 2),
            (dict(spill_dir=None, host_budget_bytes=None, keep_last=2), ["host"] * 3 + ["device"] * 2)]
    for step, (fields, want) in enumerate(plan):
        if fields:
            assert sco.idle
            cfg = sco.reconfigure(**fields)
            assert sco.config is cfg and all(getattr(cfg, k) == v for k, v in fields.items())
        _assert_exact(_steps(model, steps=1, seed=step), _steps(ref, steps=1, seed=step))
        assert _tiers(sco) == want, step
        assert os.listdir(tmp_path) == []
    st = sco.stats()
    assert st["spilled"] == 3 and st["spill_file_bytes"] == 0 and st["staging_bytes"] == 0  # disk tier closed
    assert st["offloads"] == 4 + 2 + 5 + 3  # counters carry on over reconfigures
    sco.free()


def test_reconfigure_refuses_what_it_cannot_do_and_changes_nothing(tmp_path):
    sco = SCOOffloader()
    before = sco.config
    with pytest.raises(ValueError, match=r"SCOConfig.keep_last must be a bool or an int >= 0, got -1"):
        sco.reconfigure(keep_last=-1)
    with pytest.raises(ValueError, match=r"SCOConfig.spill_dir needs both"):
        sco.reconfigure(spill_dir=str(tmp_path))
    with pytest.raises(TypeError, match=r"SCOConfig has no field keep_first"):
        sco.reconfigure(keep_first=1)
    with pytest.raises(TypeError, match=r"a config or fields, not both"):
        sco.reconfigure(SCOConfig(), keep_last=2)
    with pytest.raises(TypeError, match=r"must be a moepeak.SCOConfig, got dict"):
        sco.reconfigure({"keep_last": 2})
    y = moepeak.sco_checkpoint(torch.sin, torch.ones(B, T, H, requires_grad=True), sco_offloader=sco)
    assert not sco.idle
    with pytest.raises(RuntimeError, match=r"between steps only: boundaries are still live \(\{'cpu': 1\}\)"):
        sco.reconfigure(keep_last=2)
    assert sco.config is before
    y.sum().backward()
    assert sco.idle and sco.reconfigure(keep_last=2).keep_last == 2


def test_block_from_end_follows_keep_last_and_is_checked():
    sco = SCOOffloader(SCOConfig(keep_last=2))
    assert [sco.keeps(n) for n in range(4)] == [True, True, False, False]
    assert sco.blocks_per_step is None
    sco.num_blocks = 5
    assert sco.blocks_per_step == 3
    x = torch.ones(B, T, H, requires_grad=True)
    for n, tier in ((1, "device"), (2, "host")):
        moepeak.sco_checkpoint(torch.sin, x, sco_offloader=sco, sco_block_from_end=n).sum().backward()
        assert _tiers(sco) == [tier]
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match=r"sco_block_from_end must be an int >= 0"):
            moepeak.sco_checkpoint(torch.sin, x, sco_offloader=sco, sco_block_from_end=bad)
    with pytest.raises(ValueError, match=r"sco_keep_on_gpu or sco_block_from_end, not both"):
        moepeak.sco_checkpoint(torch.sin, x, sco_offloader=sco, sco_block_from_end=0, sco_keep_on_gpu=True)
    assert sco.idle


class _Fails(torch.nn.Module):
    """A block whose forward raises while `armed`."""

    def __init__(self):
        super().__init__()
        self.armed = True

    def forward(self, x):
        if self.armed:
            raise ValueError("block failed")
        return x * 2


def test_exception_mid_step_leaves_nothing_and_the_next_step_is_exact(tmp_path):
    """The fourth of five blocks raises after three boundaries went to disk: nothing stays live,
    no file is left in the spill directory, and the next step (the block fixed) gives torch's
    gradients with its boundaries on disk again."""
    sco = SCOOffloader(SCOConfig(spill_dir=str(tmp_path), host_budget_bytes=0, keep_last=0))
    blocks = _model(5)
    failing = _Fails()
    model = torch.nn.Sequential(*blocks[:3], failing, *blocks[3:])
    moepeak.apply_sco(model, list(model), offloader=sco)
    with pytest.raises(ValueError, match="block failed"):
        _steps(model, steps=1)
    assert sco.stats()["live"] == 0 and sco.stats()["spilled"] == 4  # the failing block's own boundary too
    assert os.listdir(tmp_path) == []
    failing.armed = False
    ref = _torch_checkpointed(torch.nn.Sequential(*_model(5)[:3], _Fails(), *_model(5)[3:]))
    ref[3].armed = False
    _assert_exact(_steps(model, steps=1), _steps(ref, steps=1))
    assert _tiers(sco) == ["disk"] * 6 and sco.stats()["live"] == 0
    sco.free()
    assert os.listdir(tmp_path) == []


KILLED_SCRIPT = """
import os, signal, sys, torch, moepeak
from moepeak.sco import SCOConfig, SCOOffloader, sizes
sco = SCOOffloader(SCOConfig(spill_dir=sys.argv[1], host_budget_bytes=0, keep_last=0))
y = torch.randn(64, 1024, requires_grad=True)
for _ in range(4):
    y = moepeak.sco_checkpoint(torch.nn.Linear(1024, 1024), y, sco_offloader=sco)
st = sco.stats()
assert st["spilled"] == 4 and st["spill_file_bytes"] == 4 * 64 * 1024 * 4, st
print("spilled", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # mid-step: four boundaries on disk, no backward
"""


def test_killed_mid_step_leaves_no_file(tmp_path):
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_SCRIPT))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(script), str(spill_dir)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == -signal.SIGKILL and p.stdout.strip() == "spilled", (p.returncode, p.stderr[-2000:])
    assert os.listdir(spill_dir) == []


@pytest.mark.parametrize("blocks, grow_bytes, cap, want", [(5, 2500, None, 3 * 2500), (4, 2500, None, 2 * 2500),
                                                           (5, 2500, 6100, 2 * 2500 + 1024), (3, 512, None, 3 * 1024)])
def test_arena_grown_bytes_is_what_the_arena_takes(blocks, grow_bytes, cap, want):
    """sizes.arena_grown_bytes (the planner's formula for an arena grown on demand) against the
    arena an offloader really grew over one step (CPU: the same chunk bookkeeping, unpinned)."""
    assert sizes.arena_grown_bytes(blocks, ONE, grow_bytes, cap) == want
    sco = SCOOffloader(SCOConfig(keep_last=0, grow_bytes=grow_bytes, max_arena_bytes=cap))
    model = _model(blocks)
    moepeak.apply_sco(model, list(model), offloader=sco)
    _steps(model, steps=1)
    assert sco.stats()["arena_bytes"] == want


def test_disk_tier_gradients_are_plain_autograds(tmp_path):
    """Boundaries on disk (the two earliest), in host RAM and kept: the gradients of two steps
    equal, bitwise, those of the same model run without any checkpointing (same dropout masks); one
    staging slot, so the earliest boundary comes back from the file itself."""
    sco = SCOOffloader(SCOConfig(spill_dir=str(tmp_path), host_budget_bytes=ONE, keep_last=1, spill_slots=1))
    model = _model(4)
    moepeak.apply_sco(model, list(model), offloader=sco)
    _assert_exact(_steps(model), _steps(_model(4)))
    assert _tiers(sco) == ["disk"] * 2 + ["host", "device"] and sco.stats()["spill_reads"] >= 1
    sco.free()
    assert os.listdir(tmp_path) == []


def _arena_refuses(monkeypatch, refused):
    """Arena.reserve raises MemoryError (as a short host's pinned allocation does) for every
    config refused(cfg) is true of; the others reserve as usual."""
    from moepeak.sco import arena

    reserve = arena.Arena.reserve

    def maybe(self):
        if refused(self.cfg):
            raise MemoryError(f"pinned memory short for {self.cfg.arena_bytes} bytes")
        reserve(self)
    monkeypatch.setattr(arena.Arena, "reserve", maybe)


def test_a_reconfigure_whose_arena_cannot_be_made_changes_nothing(monkeypatch):
    """The new arena's pinned memory is short: the error names arena_bytes, the offloader and its
    engine keep the previous config (arena made again), and the next step is exact."""
    sco = SCOOffloader(SCOConfig(keep_last=1, arena_bytes=4 * ONE))
    model = _model(5)
    moepeak.apply_sco(model, list(model), offloader=sco)
    ref = _torch_checkpointed(_model(5))
    _assert_exact(_steps(model, steps=1), _steps(ref, steps=1))
    before = sco.config
    _arena_refuses(monkeypatch, lambda cfg: cfg.arena_bytes == 64 * ONE)
    with pytest.raises(MemoryError, match=r"SCOConfig.arena_bytes=65536 could not be honoured on cpu: pinned "
                                          r"memory short .* nothing changed: the previous config runs on"):
        sco.reconfigure(arena_bytes=64 * ONE, keep_last=2)
    assert sco.config is before and sco.stats()["arena_bytes"] == 4 * ONE
    _assert_exact(_steps(model, steps=1, seed=1), _steps(ref, steps=1, seed=1))
    assert _tiers(sco) == ["host"] * 4 + ["device"]  # keep_last=1 still
    sco.free()


def test_a_reconfigure_that_cannot_be_undone_drops_the_engine(monkeypatch):
    """Neither the new arena nor the previous one can be made again: the error says the engine must
    be made anew, the offloader keeps its previous config and drops the engine, and once memory
    is back the next step makes a fresh engine and is exact."""
    sco = SCOOffloader(SCOConfig(keep_last=1, arena_bytes=4 * ONE))
    model = _model(5)
    moepeak.apply_sco(model, list(model), offloader=sco)
    ref = _torch_checkpointed(_model(5))
    _steps(model, steps=1), _steps(ref, steps=1)
    before = sco.config
    _arena_refuses(monkeypatch, lambda cfg: True)
    with pytest.raises(MemoryError, match=r"arena_bytes=65536 could not be honoured .* the previous config's arena "
                                          r"could not be made again .* must be made anew"):
        sco.reconfigure(arena_bytes=64 * ONE)
    assert sco.config is before and sco.devices() == []
    monkeypatch.undo()
    _assert_exact(_steps(model, steps=1, seed=1), _steps(ref, steps=1, seed=1))
    assert sco.stats()["arena_bytes"] == 4 * ONE and sco.config is before
    sco.free()
