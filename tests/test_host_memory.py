"""Host RAM checks (moepeak.core.host_memory): SCO's pinned arena and StreamAdamW's host state
refuse with a MemoryError naming the sizes when the host RAM left cannot hold them, before
anything is allocated or updated."""
from __future__ import annotations

import collections

import pytest
import torch

import moepeak
from moepeak.core import host_memory
from moepeak.testing import sco_extension

MEMINFO = """MemTotal:       131072000 kB
MemFree:         1000000 kB
MemAvailable:    2000000 kB
SwapTotal:       4000000 kB
SwapFree:        3000000 kB
"""


@pytest.fixture
def fake_meminfo(tmp_path, monkeypatch):
    f = tmp_path / "meminfo"
    f.write_text(MEMINFO)
    monkeypatch.setattr(host_memory, "MEMINFO_PATH", str(f))
    return f


def test_available_reads_memavailable_and_swap(fake_meminfo):
    assert host_memory.available_bytes(pinned=True) == 2000000 * 1024
    assert host_memory.available_bytes(pinned=False) == 5000000 * 1024


def test_unreadable_meminfo_means_no_check(tmp_path, monkeypatch):
    monkeypatch.setattr(host_memory, "MEMINFO_PATH", str(tmp_path / "absent"))
    assert host_memory.available_bytes(pinned=True) is None
    host_memory.check_room(1 << 60, "x", "y", pinned=True)  # unknown: no refusal
    (tmp_path / "odd").write_text("MemTotal: 5 kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO_PATH", str(tmp_path / "odd"))
    assert host_memory.available_bytes(pinned=False) is None


def test_this_host_reports_some_memory():
    got = host_memory.available_bytes(pinned=True)
    if got is None:
        pytest.skip("no /proc/meminfo here")
    assert 0 < got <= host_memory.available_bytes(pinned=False)


def test_check_room_message(fake_meminfo):
    host_memory.check_room(2000000 * 1024, "buf", "do less", pinned=True)  # exactly fits
    with pytest.raises(MemoryError, match=r"buf: needs 1.91 GiB of page-locked memory, but this host has "
                                          r"1.91 GiB available .*MemAvailable\); do less. Nothing was allocated."):
        host_memory.check_room(2000000 * 1024 + 1, "buf", "do less", pinned=True)
    host_memory.check_room(4000000 * 1024, "buf", "do less", pinned=False)  # swap counts for pageable


class _CountingExt:
    """moepeak._C with every call counted."""

    def __init__(self, real):
        self.real, self.calls = real, collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self.real, name)

        def call(*a):
            self.calls[name] += 1
            return fn(*a)
        return call


@pytest.mark.cuda
def test_sco_arena_refuses_before_pinning_cuda(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(host_memory, "available_bytes", lambda pinned: 1 << 20)
    sco = moepeak.SCOOffloader(moepeak.SCOConfig(arena_bytes=1 << 30))
    with sco_extension(sco, _CountingExt(moepeak._C)) as ext:
        with pytest.raises(MemoryError, match=r"moepeak: SCO arena chunk: needs 1.00 GiB of page-locked memory.*"
                                              r"shorten the sequence"):
            sco.engine("cuda")
    assert not ext.calls  # nothing pinned, no event created
    monkeypatch.undo()
    assert sco.engine("cuda").stats()["arena_bytes"] == 1 << 30  # with the room, the same offloader pins it
    sco.free()


def test_sco_arena_refuses_before_any_extension_call(monkeypatch):
    """The arena's host-RAM check runs before the engine binds its device: a refused arena
    makes no call into the extension at all (set_device included), so this runs without a
    GPU on a CUDA build (the engine never reaches torch.cuda)."""
    if not moepeak._C.has_cuda:
        pytest.skip("needs moepeak._C built with CUDA")
    monkeypatch.setattr(host_memory, "available_bytes", lambda pinned: 1 << 20)
    ext = _CountingExt(moepeak._C)
    sco = moepeak.SCOOffloader(moepeak.SCOConfig(arena_bytes=1 << 30), extension=ext)
    with pytest.raises(MemoryError, match=r"moepeak: SCO arena chunk: needs 1.00 GiB of page-locked memory"):
        sco.engine(torch.device("cuda", 0))
    assert not ext.calls and sco.devices() == []


def test_sco_spill_staging_refuses_before_pinning(monkeypatch):
    """The disk tier's pinned staging slot is checked against the host RAM left before it is
    page-locked (the check comes first, so this runs without a GPU)."""
    from moepeak.core.spill import HostBuffer

    monkeypatch.setattr(host_memory, "available_bytes", lambda pinned: 1 << 20)
    with pytest.raises(MemoryError, match=r"moepeak: SCO spill staging slot: needs 1.00 GiB of page-locked memory"
                                          r".*spill_slots"):
        HostBuffer(1 << 30, pinned=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_adamw_refuses_state_that_does_not_fit(monkeypatch, dtype):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000, 100).to(dtype))
    before = p.detach().clone()
    opt = moepeak.StreamAdamW([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    need = 1000 * 100 * 4 * (2 if dtype == torch.float32 else 3)  # m, v (+ the fp32 master)
    monkeypatch.setattr(host_memory, "available_bytes", lambda pinned: need - 1)
    with pytest.raises(MemoryError, match=rf"moepeak.StreamAdamW: the optimizer state of 1 params: needs "
                                          rf"{need / 2**30:.2f} GiB of host memory.*device_state="):
        opt.step()
    assert torch.equal(p.detach(), before) and not opt.state[p]
    monkeypatch.setattr(host_memory, "available_bytes", lambda pinned: need)
    opt.step()
    assert not torch.equal(p.detach(), before)
    monkeypatch.setattr(host_memory, "available_bytes", lambda pinned: 0)
    opt.step()  # the state exists: nothing new to hold, no check
