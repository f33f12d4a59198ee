"""SCO's disk tier (SCOConfig(spill_dir=..., host_budget_bytes=...)) and its spill file
(moepeak.core.spill): gradients bitwise those of the all-host run (and of torch's
checkpoint) with boundaries on disk, the placement order (GPU, then host RAM from the last
blocks backward, then disk for the earliest), the host budget counted in bytes, the stats
that say where each boundary went, the file unlinked while open, ENOSPC (a 1 MiB tmpfs in a
private mount namespace) refused before anything is written and, when a write fails later,
nothing lost; the SpillFile wrapper's own contract; CUDA: the overlapped GPU path."""
import ctypes
import errno
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import moepeak
from moepeak.core import spill
from moepeak.core.spill import HostBuffer, SpillFile
from moepeak.sco import SCOConfig, SCOOffloader, sizes
from tests.refs import SCOBlock

H, B, T = 16, 2, 8
ONE = B * T * H * 4  # one fp32 boundary: 1 KiB, an arena slot exactly
REPO = os.path.dirname(os.path.dirname(os.path.abspath(moepeak.__file__)))


# ---------------------------------------------------------------------------
# SpillFile, HostBuffer
# ---------------------------------------------------------------------------
def test_spill_file_round_trip_and_futures(tmp_path):
    f = SpillFile(tmp_path, threads=2)
    assert os.listdir(tmp_path) == []  # anonymous: unlinked while open
    src, back = HostBuffer(10_000, pinned=False), HostBuffer(10_000, pinned=False)
    assert src.address % spill.ALIGN == 0 and src.nbytes == 12_288 and src.view.numel() == 12_288
    src.view.copy_(torch.randint(0, 256, (12_288,), dtype=torch.uint8))
    w = f.write(src, 10_000, 8192)
    w.wait()
    w.wait()  # once waited, later waits return
    assert w.done() and f.info()["written_end"] == 18_192
    r = f.read(back, 10_000, 8192)
    r.wait()
    assert torch.equal(back.view[:10_000], src.view[:10_000])
    f.close()
    f.close()  # idempotent
    with pytest.raises(ValueError, match=r"spill file in .* is closed"):
        f.write(src, 1, 0)
    assert os.listdir(tmp_path) == []


def test_spill_file_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        SpillFile(tmp_path / "missing")
    assert e.value.filename == str(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        SpillFile(tmp_path / "file")
    with pytest.raises(ValueError, match="capacity must be an int >= 0, got -1"):
        SpillFile(tmp_path, -1)
    f = SpillFile(tmp_path)
    buf = HostBuffer(4096, pinned=False)
    with pytest.raises(ValueError, match=r"offset must be an int >= 0 and a multiple of 4096, got 100"):
        f.write(buf, 10, 100)
    with pytest.raises(ValueError, match=r"nbytes must be an int in \[1, 4096\]"):
        f.write(buf, 4097, 0)
    with pytest.raises(TypeError, match="buffer must be a HostBuffer or a contiguous CPU tensor, got int"):
        f.read(5, 1, 0)
    with pytest.raises(ValueError, match="HostBuffer nbytes must be an int >= 1, got 0"):
        HostBuffer(0, pinned=False)
    f.close()


def test_spill_file_refuses_what_the_disk_cannot_hold(tmp_path, monkeypatch):
    """statvfs says 8 KiB free: a 16 KiB capacity and a write growing the file past the free
    space are refused with ENOSPC naming the directory and the bytes free, before anything is
    queued; writes within the room work, and the room counts the writes still in flight."""
    monkeypatch.setattr(spill, "free_bytes", lambda d: 8192)
    with pytest.raises(OSError, match=r"a spill file of 16384 bytes needs 16384 more bytes .* 8192 bytes free") as e:
        SpillFile(tmp_path, 16384)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path)
    f = SpillFile(tmp_path)
    buf = HostBuffer(8192, pinned=False)
    w = f.write(buf, 4096, 0)  # in flight: 4096 of the 8192 free are taken
    with pytest.raises(OSError, match=r"writing bytes \[4096, 12288\) .* needs 8192 more bytes.* 4096 bytes free"):
        f.write(buf, 8192, 4096)
    assert f.info()["written_end"] == 4096  # the refused write queued nothing
    w.wait()
    f.write(buf, 4096, 0).wait()  # inside what the file holds: no new room needed
    f.close()


class _MisalignedPinnedC:
    """moepeak._C's host_alloc/host_free over ordinary memory, handing out addresses 0xc00 past
    a page boundary (as cudaHostAlloc did for a staging slot on an H200)."""

    def __init__(self):
        self.blocks, self.freed = {}, []

    def host_alloc(self, n):
        raw = (ctypes.c_uint8 * (n + 2 * spill.ALIGN))()
        ptr = ctypes.addressof(raw) + (-ctypes.addressof(raw)) % spill.ALIGN + 0xC00
        self.blocks[ptr] = (raw, n)
        return ptr

    def host_free(self, ptr):
        self.freed.append(ptr)


@pytest.mark.parametrize("nbytes", [1, 4096, 10_000, 1 << 20])
def test_host_buffer_is_aligned_by_construction(monkeypatch, nbytes):
    """A pinned HostBuffer is 4096-aligned whatever address the pinned allocator returns: it
    allocates ALIGN bytes more and views the aligned slice (freeing the allocator's pointer);
    the pageable one likewise; aligned_view refuses a base too short to hold the slice."""
    fake = _MisalignedPinnedC()
    monkeypatch.setattr(spill, "_C", fake)
    buf = HostBuffer(nbytes, pinned=True)
    (ptr, (raw, n)), = fake.blocks.items()
    assert ptr % spill.ALIGN == 0xC00 and n == buf.allocated == spill.round_up(nbytes) + spill.ALIGN
    assert buf.address % spill.ALIGN == 0 and buf.view.numel() == buf.nbytes == spill.round_up(nbytes)
    assert ptr <= buf.address and buf.address + buf.nbytes <= ptr + n  # inside what was allocated
    buf.view.fill_(7)  # writable end to end
    buf.free()
    assert fake.freed == [ptr] and buf.view is None
    assert HostBuffer(nbytes, pinned=False).address % spill.ALIGN == 0
    base = torch.empty(spill.ALIGN + 1, dtype=torch.uint8)[1:]  # 4096 bytes at an odd address
    with pytest.raises(ValueError, match=r"holds no 4096-aligned 4096 bytes \(it needs nbytes \+ 4095\)"):
        spill.aligned_view(base, spill.ALIGN)


def test_disk_tier_close_returns_its_staging_events(monkeypatch, tmp_path):
    """Closing the disk tier (SCOOffloader.free, reconfigure) gives its staging slots' events
    back to the engine's pool, so slots made again afterwards take them from there instead of
    creating new ones (the CUDA engine's bookkeeping, on a stand-in engine)."""
    import collections
    import types

    from moepeak.sco.disk import DiskTier

    monkeypatch.setattr(spill, "_C", _MisalignedPinnedC())
    created = []

    def event():
        if eng.events:
            return eng.events.pop()
        created.append(len(created) + 1)
        return created[-1]

    eng = types.SimpleNamespace(cfg=SCOConfig(spill_dir=str(tmp_path), host_budget_bytes=0, spill_slots=2),
                                is_cuda=True, counts=collections.Counter(), events=[], event=event)
    disk = DiskTier(eng)
    for _ in range(2):
        disk._acquire(4096, "write")
    assert created == [1, 2, 3, 4] and eng.counts["staging_allocs"] == 2
    disk.close()
    assert sorted(eng.events) == [1, 2, 3, 4] and all(st.d2h_ev == st.h2d_ev == 0 for st in disk.stages)
    for _ in range(2):
        disk._acquire(4096, "write")
    assert created == [1, 2, 3, 4] and eng.events == []  # the pool's events, none new
    disk.close()


# ---------------------------------------------------------------------------
# SCO with the disk tier, on CPU
# ---------------------------------------------------------------------------
def _model(n, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[SCOBlock(H, dropout=0.1) for _ in range(n)])


def _torch_checkpointed(model):
    for blk in model:
        fwd = blk.forward
        blk.forward = lambda x, _f=fwd: torch.utils.checkpoint.checkpoint(_f, x, use_reentrant=False)
    return model


def _steps(model, steps=2, accumulate=1, seed=0):
    """Run `steps` steps (accumulate forwards each, one backward); return the gradients."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        model.zero_grad()
        loss = 0
        for k in range(accumulate):
            torch.manual_seed(100 * step + k)  # the same dropout masks in every run
            loss = loss + model(torch.randn(B, T, H, generator=gen)).square().sum()
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _spilling(tmp_path, host_slots, **kw):
    return SCOConfig(spill_dir=str(tmp_path), host_budget_bytes=host_slots * ONE, **kw)


@functools.lru_cache(maxsize=None)
def _reference_grads(n):
    """torch's checkpoint and SCO all in host RAM on the same 6-block model: equal, bitwise."""
    want = _steps(_torch_checkpointed(_model(n)))
    host_model = _model(n)
    moepeak.apply_sco(host_model, list(host_model), SCOConfig())
    host = _steps(host_model)
    assert all(torch.equal(host[k], want[k]) for k in want)
    return host


@pytest.mark.parametrize("host_slots", [0, 2])
@pytest.mark.parametrize("prefetch, spill_slots", [(0, 1), (2, 1), (1, 3)])
def test_disk_tier_gradients_bitwise_those_of_the_all_host_run(tmp_path, host_slots, prefetch, spill_slots):
    n = 6
    sco = SCOOffloader(_spilling(tmp_path, host_slots, prefetch=prefetch, spill_slots=spill_slots))
    disk_model = _model(n)
    moepeak.apply_sco(disk_model, list(disk_model), offloader=sco)
    host, got = _reference_grads(n), _steps(disk_model)
    for name in host:
        assert torch.equal(got[name], host[name]), name
    st = sco.stats()
    assert st["spilled"] == 2 * (n - 1 - host_slots) and st["live"] == 0
    assert st["reloads"] == 2 * (n - 1) and st["kept"] == 2
    assert os.listdir(tmp_path) == []
    sco.free()


def test_placement_order_and_stats(tmp_path):
    """apply_sco (keep_last=1) over 6 blocks, host room for 2: the last block on the GPU tier,
    the two before it in host RAM, the three earliest on disk, from the first step on; the
    stats say so per boundary and count the bytes."""
    sco = SCOOffloader(_spilling(tmp_path, 2, spill_slots=2))
    model = _model(6)
    moepeak.apply_sco(model, list(model), offloader=sco)
    _steps(model, steps=1)
    st = sco.stats()
    assert [t for _, t in st["placement"]] == ["disk"] * 3 + ["host"] * 2 + ["device"]
    assert [e for e in st["log"] if e[0] == "spill"] == [("spill", 0, 0), ("spill", 1, 4096), ("spill", 2, 8192)]
    assert st["spilled_bytes"] == 3 * ONE and st["offloaded_bytes"] == 5 * ONE
    assert st["host_bytes"] == 2 * ONE and st["max_host_bytes"] == 2 * ONE
    assert st["staging_bytes"] == sizes.staging_bytes(2, ONE) and st["spill_file_bytes"] == 3 * 4096
    assert st["spill_direct"] in (True, False)
    # the two latest disk boundaries were still in their staging slots: only the earliest was read
    assert st["spill_reads"] == 1 and st["spill_read_bytes"] == ONE
    assert sizes.tiers(6, 1, ONE, 2 * ONE) == {"gpu": 1, "host": 2, "disk": 3}
    sco.free()


def test_placement_learned_without_apply_sco(tmp_path):
    """sco_checkpoint alone gives no block count: the first step fills the host first, later
    steps place by what the step before offloaded (the earliest on disk)."""
    sco = SCOOffloader(_spilling(tmp_path, 2))
    blocks = _model(5)
    for step, want in enumerate((["host"] * 2 + ["disk"] * 3, ["disk"] * 3 + ["host"] * 2)):
        y = torch.randn(B, T, H, requires_grad=True)
        for blk in blocks:
            y = moepeak.sco_checkpoint(blk, y, sco_offloader=sco)
        assert [t for _, t in sco.stats()["placement"]] == want, step
        y.sum().backward()
    sco.free()


@pytest.mark.parametrize("budget", [0, ONE - 1, ONE, 2 * ONE + 700])
def test_host_budget_respected_in_bytes(tmp_path, budget):
    """Gradient accumulation (3 forwards per backward, 4 blocks each): the bytes of the
    boundaries in host RAM never exceed the budget, nor does the arena; the rest is on disk."""
    sco = SCOOffloader(SCOConfig(spill_dir=str(tmp_path), host_budget_bytes=budget, keep_last=0))
    model = _model(4)
    moepeak.apply_sco(model, list(model), offloader=sco)
    want = _steps(_torch_checkpointed(_model(4)), steps=2, accumulate=3)
    got = _steps(model, steps=2, accumulate=3)
    assert all(torch.equal(got[k], want[k]) for k in want)
    st = sco.stats()
    host = [s for s, t in st["placement"] if t == "host"]
    assert len(host) * sizes.slot_bytes(ONE) <= budget and len(host) == min(budget // ONE, 12)
    assert st["max_host_bytes"] <= budget and st["arena_bytes"] <= budget
    assert len(st["placement"]) == 12 and st["spilled"] == 2 * (12 - len(host))
    sco.free()


def test_file_unlinked_while_open(tmp_path):
    sco = SCOOffloader(_spilling(tmp_path, 0))
    y = torch.randn(B, T, H, requires_grad=True)
    for blk in _model(3):
        y = moepeak.sco_checkpoint(blk, y, sco_offloader=sco)
    assert sco.stats()["spilled"] == 3 and sco.stats()["spill_file_bytes"] == 3 * 4096
    assert os.listdir(tmp_path) == []
    y.sum().backward()
    sco.free()
    assert os.listdir(tmp_path) == []


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"SCOConfig.spill_dir needs both spill_dir .* and host_budget_bytes"):
        SCOConfig(spill_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"SCOConfig.host_budget_bytes needs both"):
        SCOConfig(host_budget_bytes=10)
    with pytest.raises(ValueError, match=r"SCOConfig.host_budget_bytes must be an int >= 0, got -1"):
        SCOConfig(spill_dir=str(tmp_path), host_budget_bytes=-1)
    with pytest.raises(ValueError, match=r"SCOConfig.spill_slots must be an int >= 1, got 0"):
        SCOConfig(spill_slots=0)
    with pytest.raises(ValueError, match=r"arena_bytes \(4096\) must be <= host_budget_bytes \(1024\)"):
        SCOConfig(spill_dir=str(tmp_path), host_budget_bytes=1024, arena_bytes=4096)
    sco = SCOOffloader(SCOConfig(spill_dir=str(tmp_path / "missing"), host_budget_bytes=0))
    with pytest.raises(FileNotFoundError, match="spill directory") as e:
        moepeak.sco_checkpoint(torch.sin, torch.ones(3, requires_grad=True), sco_offloader=sco)
    assert e.value.filename == str(tmp_path / "missing")
    gc.collect()
    assert sco.stats()["live"] == 0


# ---------------------------------------------------------------------------
# ENOSPC on a 1 MiB tmpfs, in a private mount namespace
# ---------------------------------------------------------------------------
def _tmpfs_prefix(tmp_path):
    """A command prefix running its argv with a 1 MiB tmpfs on tmp_path/tiny (a private mount
    namespace), or None where this machine allows neither root's unshare nor a user namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    (tmp_path / "tiny").mkdir(exist_ok=True)
    mount = 'mount -t tmpfs -o size=1m tmpfs "$1" && shift && exec "$@"'
    for flags in ([["-m"]] if os.geteuid() == 0 else []) + [["-r", "-m"]]:
        prefix = [unshare, *flags, "sh", "-c", mount, "sh", str(tmp_path / "tiny")]
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


ENOSPC_SCRIPT = """
import copy, gc, json, sys, torch, moepeak
from moepeak.core import spill
from moepeak.sco import SCOConfig, SCOOffloader
tiny, late = sys.argv[1], sys.argv[2] == "late"
if late:  # statvfs says there is room: the write itself fails, after its boundary was staged
    spill.free_bytes = lambda d: 1 << 40
torch.manual_seed(0)
blocks = [torch.nn.Linear(1024, 1024) for _ in range(6)]
sco = SCOOffloader(SCOConfig(spill_dir=tiny, host_budget_bytes=0, keep_last=0))
x = torch.randn(64, 1024)  # 256 KiB per boundary: four fill the tmpfs

def run(blocks, n, ck):
    y = x.clone().requires_grad_(True)
    for b in blocks[:n]:
        y = ck(b, y)
    y.sum().backward()
    return [b.weight.grad.clone() for b in blocks[:n]]

def sco_ck(b, y):
    return moepeak.sco_checkpoint(b, y, sco_offloader=sco)

def torch_ck(b, y):
    return torch.utils.checkpoint.checkpoint(b, y, use_reentrant=False)

out = {}
n = 6 if not late else 5
try:
    got = run(blocks, n, sco_ck)
    out["step1"] = "ok"
    want = run(copy.deepcopy(blocks), n, torch_ck)
    out["step1_exact"] = all(torch.equal(a, b) for a, b in zip(got, want))
except OSError as e:
    out["step1"] = {"errno": e.errno, "filename": e.filename, "text": str(e)}
gc.collect()
out["live_after"] = sco.stats()["live"]
out["spill_errors"] = sco.stats()["spill_errors"]
for b in blocks:
    b.weight.grad = None
try:  # the next step: the late failure is reported at its first offload
    got = run(blocks, 3, sco_ck)
    out["step2"] = "ok"
except OSError as e:
    out["step2"] = {"errno": e.errno, "filename": e.filename, "text": str(e)}
gc.collect()
for b in blocks:
    b.weight.grad = None
got = run(blocks, 3, sco_ck)  # three boundaries fit: the same offloader works again
want = run(copy.deepcopy(blocks), 3, torch_ck)
out["step3_exact"] = all(torch.equal(a, b) for a, b in zip(got, want))
print(json.dumps(out))
"""


@pytest.mark.parametrize("when", ["early", "late"])
def test_enospc_is_a_clear_error_that_loses_nothing(tmp_path, when):
    """early: six 256 KiB boundaries bound for a 1 MiB tmpfs: the fifth is refused at its
    offload (statvfs) with ENOSPC naming the directory and the bytes free, before anything of
    it is written. late: statvfs is made to say there is room, the fifth (last) boundary's
    write fails: its bytes stay in their staging slot, the backward gives torch's gradients
    from them, and the next step's first offload reports the ENOSPC. Either way nothing stays
    live and the same offloader runs a step that fits, bitwise torch's."""
    prefix = _tmpfs_prefix(tmp_path)
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (no root, no user namespaces)")
    script = tmp_path / "enospc.py"
    script.write_text(textwrap.dedent(ENOSPC_SCRIPT))
    tiny = str(tmp_path / "tiny")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([*prefix, sys.executable, str(script), tiny, when], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    failure = out["step1"] if when == "early" else out["step2"]
    assert isinstance(failure, dict) and failure["errno"] == errno.ENOSPC and failure["filename"] == tiny, out
    if when == "early":
        assert "spilling a boundary of 262144 bytes needs 262144 more bytes" in failure["text"], failure
        assert "bytes free" in failure["text"] and "Nothing was written" in failure["text"], failure
    else:
        assert out["step1"] == "ok" and out["step1_exact"] is True and out["spill_errors"] == 1, out
        assert "spill write of bytes [1048576, 1310720) failed" in failure["text"], failure
        assert "bytes free" in failure["text"], failure
    assert out["live_after"] == 0 and out["step3_exact"] is True, out


# ---------------------------------------------------------------------------
# GPU (the lead runs these)
# ---------------------------------------------------------------------------
def _cuda_stack(n, h=256):
    torch.manual_seed(0)
    return torch.nn.ModuleList([SCOBlock(h, attention=False) for _ in range(n)]).cuda().to(torch.bfloat16)


def _cuda_step(blocks, x, sco, keep_last=1):
    """One forward and backward; nothing of it is left referenced on return."""
    y = x
    for i, b in enumerate(blocks):
        y = moepeak.sco_checkpoint(b, y, sco_offloader=sco, sco_keep_on_gpu=i >= len(blocks) - keep_last)
    y.float().square().sum().backward()


def _cuda_run(blocks, x, sco, keep_last=1):
    _cuda_step(blocks, x, sco, keep_last)
    return [p.grad.clone() for p in blocks.parameters()]


@pytest.mark.cuda
@pytest.mark.parametrize("host_slots", [0, 2])
@pytest.mark.parametrize("delay", [0, 20_000_000])
def test_cuda_disk_tier_bitwise_and_overlapped(tmp_path, host_slots, delay):
    """Six blocks, boundaries of 1 MiB: some on disk. Gradients bitwise those of the all-host
    run, with the side streams delayed (a missing event between a D2H, its write, a read and
    its H2D shows up as wrong numbers); after a warm-up step no staging slot or arena chunk
    is allocated; the spill file is O_DIRECT where /tmp takes it."""
    blocks = _cuda_stack(6)
    x = torch.randn(2, 1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    one = 2 * 1024 * 256 * 2
    host = SCOOffloader(SCOConfig())
    disk = SCOOffloader(SCOConfig(spill_dir=str(tmp_path), host_budget_bytes=host_slots * one, prefetch=2))
    disk.engine("cuda").delay_cycles = delay
    want = _cuda_run(blocks, x, host)
    for p in blocks.parameters():
        p.grad = None
    got = _cuda_run(blocks, x, disk)
    before = disk.stats("cuda")
    for p in blocks.parameters():
        p.grad = None
    again = _cuda_run(blocks, x, disk)
    torch.cuda.synchronize()
    after = disk.stats("cuda")
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and all(torch.equal(a, b) for a, b in zip(again, want))
    assert [t for _, t in after["placement"]] == ["disk"] * (5 - host_slots) + ["host"] * host_slots + ["device"]
    assert after["staging_allocs"] == before["staging_allocs"] and after["arena_chunks"] == before["arena_chunks"]
    assert after["live"] == 0 and after["gpu_held"] == 0 and after["max_host_bytes"] <= host_slots * one
    disk.free()
    host.free()


@pytest.mark.cuda
def test_cuda_disk_tier_peak_flat_in_depth(tmp_path):
    """With every boundary on disk (host budget 0) the GPU peak of a step does not grow with
    depth. Measured on the second step, whose parameter gradients exist before it (in the base)
    and are accumulated in place: the peak is the step's working set only. (Copies of the
    gradients taken inside the measured window would add 16 MiB per block, a term of the
    test, not of SCO.)"""
    h, t = 1024, 4096
    bnd = t * h * 2

    def peak(n):
        blocks = _cuda_stack(n, h)
        sco = SCOOffloader(SCOConfig(spill_dir=str(tmp_path), host_budget_bytes=0, max_in_flight=1, keep_last=0))
        x = torch.randn(1, t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _cuda_step(blocks, x, sco, keep_last=0)
            torch.cuda.synchronize()
            p = torch.cuda.max_memory_allocated() - base
        sco.free()
        return p

    assert peak(16) - peak(4) <= 2 * bnd
