"""The disk tier's spill file (moepeak._C.spill_*; csrc/spill.h): round trips of
random bytes at several offsets and sizes (tails that are not a multiple of 4096
included: staged through a bounce block, caller memory past nbytes untouched),
many requests in flight, the file unlinked while open, ENOSPC on a 1 MiB tmpfs
(mounted in a private mount namespace when this machine allows it) and EFBIG
under RLIMIT_FSIZE, reads past what was written, closing with requests in
flight, the buffered fallback where O_DIRECT is refused (ramfs), bad arguments."""
import errno
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import moepeak
from moepeak import _C

ALIGN = 4096
MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(moepeak.__file__)))


def aligned(nbytes, fill=None, seed=0):
    """A 4096-aligned uint8 CPU tensor of nbytes (a view that keeps its storage alive): random bytes,
    or `fill`."""
    base = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = (-base.data_ptr()) % ALIGN
    t = base[off:off + nbytes]
    if fill is None:
        t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    else:
        t.fill_(fill)
    assert t.data_ptr() % ALIGN == 0
    return t


def round_up(n):
    return -(-n // ALIGN) * ALIGN


# odd sizes: 1 byte, one block +- 1, a partial last block after whole ones, and requests of 2 and 3
# chunks (MP_SPILL_CHUNK = 8 MiB) whose last chunk ends in a partial block
SIZES = [1, 100, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 5, 3 * MiB + 7, 8 * MiB, 8 * MiB + ALIGN + 1, 17 * MiB + 3]


@pytest.mark.parametrize("direct", [-1, 0])
def test_roundtrip_offsets_and_sizes(tmp_path, direct):
    """Every write in flight at once, then every read; the bytes come back, and the 4096 bytes after
    each read buffer's nbytes keep their sentinel (a partial last block never spills into caller memory)."""
    h = _C.spill_open(str(tmp_path), 64 * MiB, threads=3, direct=direct)
    info = _C.spill_info(h)
    assert info["dir"] == str(tmp_path) and info["threads"] == 3
    if direct == 0:
        assert info["direct"] is False
    offsets, off = [], 0
    for i, n in enumerate(SIZES):
        offsets.append(off)
        off = round_up(off + n) + (i % 3) * ALIGN  # gaps of 0-2 blocks between requests
    srcs = [aligned(n, seed=i) for i, n in enumerate(SIZES)]
    tickets = [_C.spill_submit_write(h, s.data_ptr(), n, o) for s, n, o in zip(srcs, SIZES, offsets)]
    for t in tickets:
        _C.spill_wait(h, t)
    assert _C.spill_info(h)["written_end"] == offsets[-1] + SIZES[-1]
    dsts = [aligned(n + ALIGN, fill=0xAB) for n in SIZES]
    tickets = [_C.spill_submit_read(h, d.data_ptr(), n, o) for d, n, o in zip(dsts, SIZES, offsets)]
    for t in reversed(tickets):
        _C.spill_wait(h, t)
    for i, (src, dst, n) in enumerate(zip(srcs, dsts, SIZES)):
        assert torch.equal(dst[:n], src), f"request {i}: {n} bytes at {offsets[i]} differ"
        assert bool((dst[n:] == 0xAB).all()), f"request {i}: the read wrote past nbytes"
    # a later write over an earlier range replaces it; reads of a sub-range at an aligned offset
    new = aligned(2 * ALIGN + 9, seed=99)
    _C.spill_wait(h, _C.spill_submit_write(h, new.data_ptr(), new.numel(), offsets[7]))
    part = aligned(ALIGN + 9, fill=0)
    _C.spill_wait(h, _C.spill_submit_read(h, part.data_ptr(), ALIGN + 9, offsets[7] + ALIGN))
    assert torch.equal(part, new[ALIGN:])
    _C.spill_close(h)


def test_direct_io_used_where_the_filesystem_accepts_it(tmp_path):
    """direct=-1 turns O_DIRECT on exactly when this filesystem accepts it (probed here with os.open);
    direct=1 then opens too, or fails with EINVAL naming the directory."""
    probe = str(tmp_path / "probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
        accepts = True
    except OSError as e:
        assert e.errno == errno.EINVAL
        accepts = False
    os.unlink(probe)
    h = _C.spill_open(str(tmp_path))
    assert _C.spill_info(h)["direct"] is accepts
    _C.spill_close(h)
    if accepts:
        _C.spill_close(_C.spill_open(str(tmp_path), direct=1))
    else:
        with pytest.raises(OSError, match="refuses O_DIRECT") as e:
            _C.spill_open(str(tmp_path), direct=1)
        assert e.value.errno == errno.EINVAL and e.value.filename == str(tmp_path)


def test_many_requests_in_flight(tmp_path):
    """256 writes then 256 reads of 64 KiB + 17 B, each batch submitted before any wait, polled until done."""
    h = _C.spill_open(str(tmp_path), threads=4)
    n, k = 64 * 1024 + 17, 256
    stride = round_up(n)
    src = aligned(stride * k, seed=5)
    tickets = [_C.spill_submit_write(h, src.data_ptr() + i * stride, n, i * stride) for i in range(k)]
    while not all(_C.spill_poll(h, t) for t in tickets):
        time.sleep(0.001)
    for t in tickets:
        _C.spill_wait(h, t)
    dst = aligned(stride * k, fill=0)
    tickets = [_C.spill_submit_read(h, dst.data_ptr() + i * stride, n, i * stride) for i in range(k)]
    for t in tickets:
        _C.spill_wait(h, t)
    for i in range(k):
        assert torch.equal(dst[i * stride:i * stride + n], src[i * stride:i * stride + n]), i
    with pytest.raises(ValueError, match=r"spill ticket \d+ is unknown \(never issued, or already waited on\)"):
        _C.spill_poll(h, tickets[0])  # released by its wait
    _C.spill_close(h)


def test_ticket_limit(tmp_path):
    h = _C.spill_open(str(tmp_path))
    buf = aligned(ALIGN)
    tickets = [_C.spill_submit_write(h, buf.data_ptr(), ALIGN, i * ALIGN) for i in range(1024)]
    with pytest.raises(ValueError, match="1024 spill tickets are held"):
        _C.spill_submit_write(h, buf.data_ptr(), ALIGN, 1024 * ALIGN)
    for t in tickets:
        _C.spill_wait(h, t)
    _C.spill_wait(h, _C.spill_submit_write(h, buf.data_ptr(), ALIGN, 1024 * ALIGN))
    _C.spill_close(h)


@pytest.mark.parametrize("tmpfile", [True, False])
def test_file_is_gone_from_the_directory_while_open(tmp_path, tmpfile):
    """O_TMPFILE, and the create + unlink fallback: the directory stays empty while the file holds data."""
    h = _C.spill_open(str(tmp_path), 2 * MiB, tmpfile=tmpfile)
    assert os.listdir(tmp_path) == []
    buf = aligned(MiB)
    _C.spill_wait(h, _C.spill_submit_write(h, buf.data_ptr(), MiB, 0))
    assert os.listdir(tmp_path) == []
    back = aligned(MiB, fill=0)
    _C.spill_wait(h, _C.spill_submit_read(h, back.data_ptr(), MiB, 0))
    assert torch.equal(back, buf)
    _C.spill_close(h)
    assert os.listdir(tmp_path) == []


def test_read_past_what_was_written(tmp_path):
    h = _C.spill_open(str(tmp_path), 4 * MiB)
    buf = aligned(3 * ALIGN)
    with pytest.raises(ValueError, match=r"read of bytes \[0, 1\) reaches past the 0 bytes written"):
        _C.spill_submit_read(h, buf.data_ptr(), 1, 0)  # inside the reserved capacity, but never written
    _C.spill_wait(h, _C.spill_submit_write(h, buf.data_ptr(), 10000, 0))
    _C.spill_wait(h, _C.spill_submit_read(h, buf.data_ptr(), 10000, 0))
    with pytest.raises(ValueError, match=r"read of bytes \[8192, 18192\) reaches past the 10000 bytes written"):
        _C.spill_submit_read(h, buf.data_ptr(), 10000, 8192)
    with pytest.raises(ValueError, match=r"read of bytes \[0, 10001\) reaches past the 10000 bytes written"):
        _C.spill_submit_read(h, buf.data_ptr(), 10001, 0)
    _C.spill_close(h)


def test_close_with_requests_in_flight(tmp_path):
    """close waits for 64 MiB of writes in flight (no crash, no use of the buffers after it returns);
    a thread waiting meanwhile returns normally; afterwards submits are refused, while tickets still
    held are done and can be waited on."""
    h = _C.spill_open(str(tmp_path), threads=2)
    src = aligned(64 * MiB)
    tickets = [_C.spill_submit_write(h, src.data_ptr() + i * MiB, MiB, i * MiB) for i in range(64)]
    assert _C.spill_info(h)["in_flight"] > 0
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(_C.spill_wait(h, tickets[-1])))
    waiter.start()
    _C.spill_close(h)
    waiter.join(timeout=60)
    assert waited == [None]
    assert _C.spill_info(h)["in_flight"] == 0
    assert all(_C.spill_poll(h, t) for t in tickets[:-1])
    for t in tickets[:-1]:
        _C.spill_wait(h, t)
    with pytest.raises(ValueError, match=r"spill file in .* is closed"):
        _C.spill_submit_write(h, src.data_ptr(), ALIGN, 0)
    _C.spill_close(h)  # idempotent
    # dropping the last reference with requests in flight: the destructor waits for them
    dropped = _C.spill_open(str(tmp_path), threads=2)
    for i in range(16):
        _C.spill_submit_write(dropped, src.data_ptr() + i * MiB, MiB, i * MiB)
    del dropped
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_overlapping_requests_refused_while_in_flight(tmp_path):
    """One I/O thread: a small write queued behind a 64 MiB one is surely in flight when the
    overlapping read and write are submitted; a read overlapping a read is fine."""
    h = _C.spill_open(str(tmp_path), threads=1)
    big, small = aligned(64 * MiB), aligned(ALIGN + 1)
    t_big = _C.spill_submit_write(h, big.data_ptr(), 64 * MiB, 0)
    t_small = _C.spill_submit_write(h, small.data_ptr(), ALIGN + 1, 64 * MiB)
    with pytest.raises(ValueError, match=rf"read of bytes \[{64 * MiB + ALIGN}, {64 * MiB + ALIGN + 1}\) overlaps "
                                         rf"the in-flight write of \[{64 * MiB}, {64 * MiB + ALIGN + 1}\)"):
        _C.spill_submit_read(h, small.data_ptr(), 1, 64 * MiB + ALIGN)
    with pytest.raises(ValueError, match="overlaps the in-flight write"):  # the padded block counts
        _C.spill_submit_write(h, small.data_ptr(), 1, 64 * MiB + ALIGN)
    _C.spill_wait(h, t_big)
    _C.spill_wait(h, t_small)
    r1 = _C.spill_submit_read(h, big.data_ptr(), 32 * MiB, 0)
    r2 = _C.spill_submit_read(h, small.data_ptr(), ALIGN, 0)
    with pytest.raises(ValueError, match="overlaps the in-flight read"):
        _C.spill_submit_write(h, small.data_ptr(), ALIGN, 0)
    _C.spill_wait(h, r1)
    _C.spill_wait(h, r2)
    _C.spill_close(h)


def test_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        _C.spill_open(str(tmp_path / "missing"))
    assert e.value.filename == str(tmp_path / "missing") and "cannot create a spill file" in str(e.value)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        _C.spill_open(str(tmp_path / "file"))
    for kw, msg in (({"threads": 0}, r"threads must be in \[1, 65\), got 0"),
                    ({"capacity": -1}, r"capacity must be >= 0, got -1"),
                    ({"direct": 2}, r"direct must be in \[-1, 2\), got 2")):
        with pytest.raises(ValueError, match=r"moepeak._C.spill_open: " + msg):
            _C.spill_open(str(tmp_path), **kw)
    with pytest.raises(ValueError, match="dir must name a directory"):
        _C.spill_open("")
    h = _C.spill_open(str(tmp_path))
    buf = aligned(2 * ALIGN)
    a = buf.data_ptr()
    cases = [
        ((a + 8, ALIGN, 0), r"spill_submit_write: buffer address 0x[0-9a-f]+ must be a non-null multiple of 4096"),
        ((0, ALIGN, 0), r"buffer address 0x0 must be a non-null multiple of 4096"),
        ((a, 0, 0), r"spill_submit_write: nbytes must be in \[1, \d+\), got 0"),
        ((a, 1 << 62, 0), r"nbytes must be in \[1, \d+\), got 4611686018427387904"),
        ((a, ALIGN, -ALIGN), r"spill_submit_write: offset must be in \[0, \d+\), got -4096"),
        ((a, ALIGN, 100), r"spill_submit_write: offset 100 must be a multiple of 4096"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _C.spill_submit_write(h, *args)
    with pytest.raises(ValueError, match=r"spill_submit_read: offset 4095 must be a multiple of 4096"):
        _C.spill_submit_read(h, a, 1, 4095)
    with pytest.raises(TypeError, match=r"spill_wait: handle must be a spill file from spill_open, got int"):
        _C.spill_wait(5, 1)
    with pytest.raises(ValueError, match=r"spill ticket 12345 is unknown"):
        _C.spill_wait(h, 12345)
    with pytest.raises(ValueError, match=r"spill ticket -1 is unknown"):
        _C.spill_poll(h, -1)
    assert _C.spill_info(h)["written_end"] == 0 and _C.spill_info(h)["in_flight"] == 0  # nothing was queued
    t = _C.spill_submit_write(h, a, ALIGN, 0)
    _C.spill_wait(h, t)
    with pytest.raises(ValueError, match="is unknown"):
        _C.spill_wait(h, t)  # each ticket is waited on once
    _C.spill_close(h)


# ---------------------------------------------------------------------------
# OS errors, in subprocesses (a private mount namespace; a file-size limit)
# ---------------------------------------------------------------------------
def _run_script(tmp_path, body, argv, prefix=()):
    script = tmp_path / "script.py"
    script.write_text("import errno, json, sys, torch\nfrom moepeak import _C\n" + HELPERS + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([*prefix, sys.executable, str(script), *argv], capture_output=True, text=True, env=env,
                          timeout=120)


HELPERS = """
def aligned(n):
    base = torch.randint(0, 256, (n + 4096,), dtype=torch.uint8)
    off = (-base.data_ptr()) % 4096
    return base[off:off + n]

def failure(fn):
    try:
        fn()
    except OSError as e:
        return {"errno": e.errno, "filename": e.filename, "text": str(e)}
    return None
"""


def _mount_prefix(tmp_path):
    """A command prefix that runs its argv in a private mount namespace with a 1 MiB tmpfs on
    tmp_path/tiny and a ramfs on tmp_path/ram; None when this machine allows neither root's
    unshare nor a user namespace's."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    mounts = 'mount -t tmpfs -o size=1m tmpfs "$1" && mount -t ramfs ramfs "$2" && shift 2 && exec "$@"'
    for flags in ([["-m"]] if os.geteuid() == 0 else []) + [["-r", "-m"]]:
        prefix = [unshare, *flags, "sh", "-c", mounts, "sh", str(tmp_path / "tiny"), str(tmp_path / "ram")]
        (tmp_path / "tiny").mkdir(exist_ok=True)
        (tmp_path / "ram").mkdir(exist_ok=True)
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


def test_enospc_on_a_tiny_tmpfs_and_buffered_fallback_on_ramfs(tmp_path):
    """On a 1 MiB tmpfs: a 2 MiB write fails with ENOSPC naming the byte range, where it failed and
    the directory; a 4 MiB capacity fails at open. On ramfs (no O_DIRECT): buffered I/O, flagged,
    round trip intact; direct=1 refused with EINVAL."""
    prefix = _mount_prefix(tmp_path)
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (no root, no user namespaces): "
                    "test_efbig_under_rlimit_fsize covers the OS-error path")
    body = """
    tiny, ram = sys.argv[1], sys.argv[2]
    out = {}
    h = _C.spill_open(tiny)
    buf = aligned(2 << 20)
    t = _C.spill_submit_write(h, buf.data_ptr(), 2 << 20, 0)
    out["write"] = failure(lambda: _C.spill_wait(h, t))
    _C.spill_close(h)
    out["open"] = failure(lambda: _C.spill_open(tiny, 4 << 20))
    h = _C.spill_open(ram)
    out["ram_direct"] = _C.spill_info(h)["direct"]
    _C.spill_wait(h, _C.spill_submit_write(h, buf.data_ptr(), 100001, 8192))
    back = aligned(100001)
    _C.spill_wait(h, _C.spill_submit_read(h, back.data_ptr(), 100001, 8192))
    out["ram_roundtrip"] = bool(torch.equal(back, buf[:100001]))
    _C.spill_close(h)
    out["ram_direct1"] = failure(lambda: _C.spill_open(ram, direct=1))
    print(json.dumps(out))
    """
    tiny, ram = str(tmp_path / "tiny"), str(tmp_path / "ram")
    p = _run_script(tmp_path, body, [tiny, ram], prefix=prefix)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    w = out["write"]
    assert w is not None and w["errno"] == errno.ENOSPC and w["filename"] == tiny, w
    assert "spill write of bytes [0, 2097152) failed at byte" in w["text"], w
    o = out["open"]
    assert o is not None and o["errno"] == errno.ENOSPC and "cannot reserve 4194304 bytes" in o["text"], o
    assert out["ram_direct"] is False and out["ram_roundtrip"] is True
    d = out["ram_direct1"]
    assert d is not None and d["errno"] == errno.EINVAL and "refuses O_DIRECT" in d["text"] and d["filename"] == ram


def test_efbig_under_rlimit_fsize(tmp_path):
    """RLIMIT_FSIZE = 1 MiB (SIGXFSZ is ignored by Python, so the write returns EFBIG): a 2 MiB write
    fails with EFBIG at byte 1 MiB after a short write; a read of what that write never stored
    hits the end of the file (ENODATA); a 2 MiB capacity fails at open; writes under the limit work."""
    body = """
    import resource, signal
    d = sys.argv[1]
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    out = {}
    h = _C.spill_open(d)
    buf = aligned(2 << 20)
    t = _C.spill_submit_write(h, buf.data_ptr(), 2 << 20, 0)
    out["write"] = failure(lambda: _C.spill_wait(h, t))
    back = aligned(1 << 20)
    t = _C.spill_submit_read(h, back.data_ptr(), 1 << 20, 0)
    _C.spill_wait(h, t)
    out["first_mib"] = bool(torch.equal(back, buf[:1 << 20]))
    t = _C.spill_submit_read(h, back.data_ptr(), 1 << 20, 1 << 20)
    out["eof"] = failure(lambda: _C.spill_wait(h, t))
    _C.spill_close(h)
    out["open"] = failure(lambda: _C.spill_open(d, 2 << 20))
    print(json.dumps(out))
    """
    p = _run_script(tmp_path, body, [str(tmp_path)])
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    w = out["write"]
    assert w is not None and w["errno"] == errno.EFBIG and w["filename"] == str(tmp_path), w
    assert "spill write of bytes [0, 2097152) failed at byte 1048576: File too large" in w["text"], w
    assert out["first_mib"] is True
    e = out["eof"]
    assert e is not None and e["errno"] == errno.ENODATA, e
    assert "spill read of bytes [1048576, 2097152) failed at byte 1048576" in e["text"], e
    o = out["open"]
    assert o is not None and o["errno"] == errno.EFBIG and "cannot reserve 2097152 bytes" in o["text"], o


def test_bench_spill_smoke(tmp_path):
    """benchmarks/bench_spill.py --smoke (16 MiB) runs against dd in tmp_path and appends one row."""
    import csv

    p = subprocess.run([sys.executable, "benchmarks/bench_spill.py", "--smoke", "--dir", str(tmp_path), "--out",
                        str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "out" / "spill.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["dir"] == str(tmp_path) and rows[0]["total_MiB"] == "16", rows
    assert float(rows[0]["spill_write_GBs"]) > 0 and float(rows[0]["spill_read_GBs"]) > 0
    assert rows[0]["dd_write_GBs"] or "dd write" in rows[0]["note"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the spill file and dd's file are gone
