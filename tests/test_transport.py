"""The transports every multi-rank schedule talks to (moepeak/core/transport.py).

CPU (here):
  * TorchDistTransport on gloo, P = 2 and 3: send/recv rings (and to self),
    all-to-all-v with uneven and zero counts, all-gather, all-reduce.
  * The C NCCL transport's bindings: argument validation before any NCCL call,
    unique-id length, stale handles, error reporting with file:line, the
    grouped all-to-all-v offset arithmetic; against tests/fake_nccl.c (a
    stand-in libnccl on host memory, in a subprocess, because the loaded
    library sticks for the life of a process).
  * NcclTransport's Python layer (byte counts, row offsets, validation,
    close) end to end with CUDA stubbed out, over the stand-in libnccl.
  * NcclTransport refuses clearly when a CUDA build, a GPU or libnccl is
    missing, and refuses CPU tensors/devices.
GPU (@pytest.mark.cuda):
  * one GPU: a 1-rank NCCL communicator (the id broadcast over a gloo group of
    size 1): the same exercise, plus stream ordering with no sync in between.
  * two GPUs (skipped below 2): NCCL transport vs TorchDistTransport (nccl).
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import moepeak._C as C
from moepeak.core import TorchDistTransport, get_transport

from dist_utils import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# The exercise both transports must pass; returns every result for comparison
# ---------------------------------------------------------------------------
def _a2a_counts(P, case):
    """S[i][j] = rows rank i sends to rank j: uneven, with zeros (case 0);
    a rank that sends nothing at all and one that receives nothing (case 1)."""
    if case == 0:
        return [[(i * 3 + j * 5 + 1) % 4 for j in range(P)] for i in range(P)]
    return [[0 if (i == 0 or j == P - 1) else i + j for j in range(P)] for i in range(P)]


def _row(src, dst, k, width):
    """The row rank src sends to dst as its k-th row: distinct everywhere."""
    return [1000.0 * src + 100.0 * dst + k + 0.125 * c for c in range(width)]


def exercise(t, rank, P, device):
    out = {}
    f32 = dict(dtype=torch.float32, device=device)
    # send_recv: ring forward, ring backward, to self
    for name, dst, src in (("ring+", (rank + 1) % P, (rank - 1) % P), ("ring-", (rank - 1) % P, (rank + 1) % P),
                           ("self", rank, rank)):
        send = torch.arange(7, **f32) + 100 * rank
        recv = torch.full((7,), -1.0, **f32)
        t.send_recv(send, dst, recv, src).wait()
        exp = torch.arange(7, **f32) + 100 * src
        torch.testing.assert_close(recv, exp, rtol=0, atol=0, msg=f"send_recv {name}")
        out[name] = recv.cpu()
    # all_to_all_v, rows of width 3, both count patterns, float32 and int64
    for case in (0, 1):
        S = _a2a_counts(P, case)
        for dtype in (torch.float32, torch.int64):
            sc = S[rank]
            rc = [S[i][rank] for i in range(P)]
            send = torch.tensor([_row(rank, j, k, 3) for j in range(P) for k in range(sc[j])],
                                dtype=torch.float64).reshape(-1, 3).to(dtype=dtype, device=device)
            exp = torch.tensor([_row(i, rank, k, 3) for i in range(P) for k in range(rc[i])],
                               dtype=torch.float64).reshape(-1, 3).to(dtype=dtype, device=device)
            recv = torch.full((sum(rc), 3), -7, dtype=dtype, device=device)
            t.all_to_all_v(send, sc, recv, rc).wait()
            torch.testing.assert_close(recv, exp, rtol=0, atol=0, msg=f"all_to_all_v case {case} {dtype}")
            out[f"a2a{case}{dtype}"] = recv.cpu()
    # all_gather
    inp = torch.arange(6, **f32).reshape(2, 3) + 10 * rank
    g = torch.full((P, 2, 3), -1.0, **f32)
    t.all_gather(g, inp)
    exp = torch.stack([torch.arange(6, **f32).reshape(2, 3) + 10 * r for r in range(P)])
    torch.testing.assert_close(g, exp, rtol=0, atol=0)
    out["gather"] = g.cpu()
    # all_reduce_ (integer-valued floats: every order sums exactly)
    for op, red in (("sum", sum), ("max", max), ("min", min)):
        for dtype in (torch.float32, torch.int64):
            x = torch.tensor([rank + 1, 2 * rank - 3, 5 - rank], dtype=dtype, device=device)
            t.all_reduce_(x, op)
            exp = torch.tensor([red(r + 1 for r in range(P)), red(2 * r - 3 for r in range(P)),
                                red(5 - r for r in range(P))], dtype=dtype, device=device)
            torch.testing.assert_close(x, exp, rtol=0, atol=0, msg=f"all_reduce_ {op} {dtype}")
            out[f"reduce{op}{dtype}"] = x.cpu()
    return out


def _gloo_rank(rank, P):
    exercise(TorchDistTransport(), rank, P, torch.device("cpu"))
    # P = 2 on a sub-group of global ranks {1, 2}: the transport must use group
    # ranks (0, 1), not global ones. (One spawn covers P = 3 and P = 2: spawning
    # ranks costs most of this test's time on a small machine.)
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        exercise(TorchDistTransport(sub), rank - 1, 2, torch.device("cpu"))


def test_torch_dist_transport_gloo_p3_and_p2():
    run_ranks(3, _gloo_rank)


# ---------------------------------------------------------------------------
# NcclTransport refusals (no GPU / no NCCL / CPU tensors)
# ---------------------------------------------------------------------------
def test_nccl_transport_names_what_is_missing():
    from moepeak.core.nccl import NcclTransport, nccl_available
    missing = nccl_available()
    if missing is None:
        pytest.skip("NCCL, a GPU and a CUDA build are all present")
    with pytest.raises(RuntimeError, match="NcclTransport cannot run here") as ei:
        NcclTransport(None)
    msg = str(ei.value)
    if not C.has_cuda:
        assert "CUDA build" in msg
    if not torch.cuda.is_available():
        assert "CUDA GPU" in msg
    if C.nccl_loaded() is None:
        assert "NCCL" in msg and "MOEPEAK_NCCL_LIB" in msg


def test_nccl_missing_library_names_the_paths_tried(monkeypatch):
    if C.nccl_loaded() is not None:
        pytest.skip("an NCCL library is already loaded")
    monkeypatch.setenv("MOEPEAK_NCCL_LIB", "/nonexistent/libnccl.so.2")
    try:
        C.nccl_load("/also/not/here.so")
    except RuntimeError as e:
        assert "NCCL not found" in str(e) and "/nonexistent/libnccl.so.2" in str(e) and "/also/not/here.so" in str(e)
    else:
        pytest.skip("libnccl.so.2 is on the loader path here")


def test_get_transport_nccl_refuses_cpu():
    with pytest.raises(ValueError, match="CUDA tensors only"):
        get_transport(object(), device=torch.device("cpu"), backend="nccl")
    with pytest.raises(ValueError, match="backend"):
        get_transport(object(), backend="mpi")


def test_count_lists_validated():
    from moepeak.core.nccl import normalize_counts
    assert normalize_counts("send_counts", [3, 0, 2], 3) == [3, 0, 2]
    assert normalize_counts("send_counts", torch.tensor([1, 2]), 2) == [1, 2]
    with pytest.raises(ValueError, match=r"send_counts\[1\] must be >= 0, got -2"):
        normalize_counts("send_counts", [1, -2], 2)
    with pytest.raises(ValueError, match="one count per rank \\(3\\), got 2"):
        normalize_counts("recv_counts", [1, 2], 3)
    with pytest.raises(TypeError, match="recv_counts must be a sequence of ints"):
        normalize_counts("recv_counts", [1.5, 2], 2)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        normalize_counts("recv_counts", torch.tensor([1.0, 2.0]), 2)


def test_benchmark_script_refuses_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present (the GPU run covers the script)")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_transport.py"), "--quick"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stdout + r.stderr


def test_bindings_validate_before_loading():
    uid = bytes(128)
    with pytest.raises(ValueError, match="unique_id must be 128 bytes"):
        C.nccl_comm_init(b"x" * 127, 1, 0, -1)
    with pytest.raises(ValueError, match="nranks"):
        C.nccl_comm_init(uid, 0, 0, -1)
    with pytest.raises(ValueError, match="rank must be in"):
        C.nccl_comm_init(uid, 2, 2, -1)
    with pytest.raises(ValueError, match="device"):
        C.nccl_comm_init(uid, 1, 0, -2)
    with pytest.raises(TypeError):
        C.nccl_comm_init("not bytes", 1, 0, -1)
    for fn, args in ((C.nccl_send, (0, 0, 0, 1, 0)), (C.nccl_all_reduce, (0, 0, 0, 7, 0, 0)),
                     (C.nccl_all_to_all_v, (0, [0], 0, [0], 1, 0)), (C.nccl_comm_destroy, ())):
        with pytest.raises(ValueError, match="comm is not a live NCCL communicator"):
            fn(123456, *args)
    with pytest.raises(ValueError, match="comm must be >= 0"):
        C.nccl_comm_info(-1)


# ---------------------------------------------------------------------------
# The C transport against a stand-in libnccl (tests/fake_nccl.c)
# ---------------------------------------------------------------------------
_FAKE_SCRIPT = textwrap.dedent(r"""
    import ctypes, os, sys
    import moepeak._C as C          # does not import torch (so torch's libnccl is not loaded)
    ver, how = C.nccl_load()
    if ver != 29901:
        print("REAL NCCL", ver, how); sys.exit(0)
    fake = ctypes.CDLL(os.environ["MOEPEAK_NCCL_LIB"]); fake.fake_nccl_calls.restype = ctypes.c_long
    addr = ctypes.addressof

    def raises(exc, words, fn, *args):
        try:
            fn(*args)
        except exc as e:
            assert all(w in str(e) for w in words), (words, str(e))
        else:
            raise AssertionError(f"no {exc.__name__} for {words}")

    uid = C.nccl_get_unique_id(); assert isinstance(uid, bytes) and len(uid) == 128
    comm = C.nccl_comm_init(uid, 3, 1, -1)
    assert C.nccl_comm_info(comm) == (3, 1, -1)
    assert C.nccl_comm_async_error(comm)[0] == 0

    # all-to-all-v offsets: float64 (code 8, 8-byte rows) and bfloat16 (code 9, 2 bytes);
    # each fake peer echoes what it was sent, so recv == send exactly when offsets are right
    src = (ctypes.c_double * 5)(1.5, 2.5, 3.5, 4.5, 5.5); dst = (ctypes.c_double * 5)()
    C.nccl_all_to_all_v(comm, addr(src), [2, 0, 3], addr(dst), [2, 0, 3], 8, 0)
    assert list(dst) == list(src), list(dst)
    s16 = (ctypes.c_uint16 * 6)(*range(10, 16)); d16 = (ctypes.c_uint16 * 6)()
    C.nccl_all_to_all_v(comm, addr(s16), (1, 5, 0), addr(d16), (1, 5, 0), 9, 0)
    assert list(d16) == list(range(10, 16)), list(d16)
    C.nccl_all_to_all_v(comm, 0, [0, 0, 0], 0, [0, 0, 0], 7, 0)   # nothing to move: null pointers fine

    # send_recv with one peer, then an unmatched pair: an error naming NCCL's message
    f = (ctypes.c_float * 4)(1, 2, 3, 4); g = (ctypes.c_float * 4)()
    C.nccl_send_recv(comm, addr(f), 4, 2, addr(g), 4, 2, 7, 0)
    assert list(g) == [1, 2, 3, 4]
    raises(RuntimeError, ["ncclGroupEnd", "invalid usage (fake)", "unmatched send/recv", "nccl.c:"],
           C.nccl_send_recv, comm, addr(f), 4, 0, addr(g), 4, 2, 7, 0)
    # a failing ncclSend inside the group: reported with file:line, and the group is closed again
    big = (ctypes.c_uint8 * 12345)()
    raises(RuntimeError, ["ncclSend", "invalid argument (fake)", "count 12345", "nccl.c:"],
           C.nccl_all_to_all_v, comm, addr(big), [0, 12345, 0], addr(big), [0, 12345, 0], 1, 0)
    C.nccl_send_recv(comm, addr(f), 4, 0, addr(g), 4, 0, 7, 0)          # works: group depth balanced
    # the manual group API
    C.nccl_group_start(); C.nccl_send(comm, addr(f), 2, 7, 1, 0); C.nccl_recv(comm, addr(g), 2, 7, 1, 0)
    C.nccl_group_end()

    # collectives
    x = (ctypes.c_float * 3)(1, -2, 3)
    C.nccl_all_reduce(comm, addr(x), addr(x), 3, 7, 0, 0); assert list(x) == [3, -6, 9]
    y = (ctypes.c_float * 6)()
    C.nccl_all_gather(comm, addr(f), addr(y), 2, 7, 0); assert list(y) == [1, 2] * 3

    # bad arguments never reach the library
    n0 = fake.fake_nccl_calls()
    p = addr(f)
    bad = [
        (ValueError, ["dtype code", "got 10"], C.nccl_send, comm, p, 1, 10, 0, 0),
        (ValueError, ["dtype code", "got -1"], C.nccl_all_reduce, comm, p, p, 1, -1, 0, 0),
        (ValueError, ["count must be >= 0", "-4"], C.nccl_recv, comm, p, -4, 7, 0, 0),
        (ValueError, ["send_counts[1] must be >= 0"], C.nccl_all_to_all_v, comm, p, [1, -1, 0], p, [0, 0, 0], 7, 0),
        (ValueError, ["recv_counts must have one count per rank (3), got 2"], C.nccl_all_to_all_v, comm, p,
         [0, 0, 0], p, [0, 0], 7, 0),
        (TypeError, ["send_counts[0] must be an int"], C.nccl_all_to_all_v, comm, p, [1.0, 0, 0], p, [1, 0, 0], 7, 0),
        (ValueError, ["send_ptr is a null pointer"], C.nccl_all_to_all_v, comm, 0, [0, 2, 0], p, [0, 2, 0], 7, 0),
        (ValueError, ["dst must be a rank in [0, 3)", "got 3"], C.nccl_send_recv, comm, p, 1, 3, p, 1, 0, 7, 0),
        (ValueError, ["src must be a rank", "got -1"], C.nccl_send_recv, comm, p, 1, 0, p, 1, -1, 7, 0),
        (ValueError, ["peer must be a rank"], C.nccl_send, comm, p, 1, 7, 5, 0),
        (ValueError, ["op code", "got 4"], C.nccl_all_reduce, comm, p, p, 1, 7, 4, 0),
        (ValueError, ["recv_ptr is a null pointer"], C.nccl_all_gather, comm, p, 0, 1, 7, 0),
        (ValueError, ["stream must be >= 0"], C.nccl_all_gather, comm, p, p, 1, 7, -5),
        (ValueError, ["not a plausible count"], C.nccl_send, comm, p, 1 << 50, 7, 0, 0),
        (ValueError, ["unique_id must be 128 bytes"], C.nccl_comm_init, uid[:100], 1, 0, -1),
    ]
    for exc, words, fn, *args in bad:
        raises(exc, words, fn, *args)
    assert fake.fake_nccl_calls() == n0, "validation let a call through"

    C.nccl_comm_destroy(comm)
    raises(ValueError, ["not a live NCCL communicator"], C.nccl_comm_destroy, comm)
    raises(ValueError, ["not a live NCCL communicator"], C.nccl_send, comm, p, 1, 7, 0, 0)
    c2 = C.nccl_comm_init(uid, 1, 0, -1); C.nccl_comm_destroy(c2, True)     # abort path

    # NcclTransport's release on a deadline thread (imports torch: after the fake is loaded)
    import time, warnings
    from moepeak.core.nccl import release_communicator
    c3 = C.nccl_comm_init(uid, 1, 0, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        release_communicator(c3, False, 5.0)                   # quick: no warning
    raises(ValueError, ["not a live"], C.nccl_comm_destroy, c3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        release_communicator(c3, False, 5.0)                   # stale handle: a warning, not an exception
        assert any("releasing the NCCL communicator failed" in str(x.message) for x in w), w
        os.environ["FAKE_NCCL_SLOW_DESTROY"] = "1"
        c4 = C.nccl_comm_init(uid, 1, 0, -1)
        t0 = time.monotonic()
        release_communicator(c4, False, 0.5)                   # a destroy that outlasts its deadline: returns anyway
        assert time.monotonic() - t0 < 2.5 and any("did not finish" in str(x.message) for x in w)
    print("FAKE OK")
""")


def _run_on_stand_in_nccl(tmp_path, script, pythonpath):
    """Build tests/fake_nccl.c into a stand-in libnccl, run `script` in a fresh
    interpreter that loads it (MOEPEAK_NCCL_LIB), return the finished run; skips
    without a C compiler or when a real libnccl.so.2 is found first."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libnccl")
    lib = tmp_path / "libfakenccl.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), os.path.join(ROOT, "tests", "fake_nccl.c")],
                   check=True)
    env = dict(os.environ, MOEPEAK_NCCL_LIB=str(lib),
               PYTHONPATH=os.pathsep.join(pythonpath + [os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    if "REAL NCCL" in r.stdout:
        pytest.skip(f"a real libnccl.so.2 is found first here: {r.stdout.strip()}")
    return r


def test_c_transport_against_fake_nccl(tmp_path):
    r = _run_on_stand_in_nccl(tmp_path, _FAKE_SCRIPT, [ROOT])
    assert "FAKE OK" in r.stdout, r.stdout + r.stderr


_PY_SCRIPT = textwrap.dedent(r"""
    import contextlib, os, sys
    import moepeak._C as C
    ver, how = C.nccl_load()
    if ver != 29901:
        print("REAL NCCL", ver, how); sys.exit(0)
    import torch, torch.distributed as dist
    import moepeak.core.nccl as MN
    import test_transport as T

    # CUDA stubbed out: streams and events become no-ops, tensors stay on the
    # CPU, and the stand-in libnccl moves host memory. One rank, whose NCCL
    # semantics (send/recv to self, gather of one, reduce of one) it matches.
    class Ev:
        def record(self, stream=None): pass
        def query(self): return True
    class St:
        cuda_stream = 0
        def wait_event(self, e): pass
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.device = lambda d: contextlib.nullcontext()
    torch.cuda.Stream = lambda device=None: St()
    torch.cuda.Event = lambda *a, **k: Ev()
    torch.cuda.current_stream = lambda device=None: St()
    torch.Tensor.record_stream = lambda self, s: None
    MN.HAS_CUDA_BUILD = True
    class CProxy:                      # device -1: no cudaSetDevice on a machine without a GPU
        def __getattr__(self, n): return getattr(C, n)
        def nccl_comm_init(self, uid, n, r, dev): return C.nccl_comm_init(uid, n, r, -1)
    MN._C = CProxy()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t = MN.NcclTransport(None, "cuda:0")
    assert (t.rank, t.world_size) == (0, 1) and C.nccl_comm_info(t._comm)[:2] == (1, 0)
    t.device = torch.device("cpu")     # the tensors of this run
    T.exercise(t, 0, 1, torch.device("cpu"))
    # every dtype moves as bytes, including ones NCCL has no type for
    for dt in (torch.bool, torch.bfloat16, torch.float16, torch.int16, torch.float64):
        a = (torch.arange(10) % 3).to(dt).reshape(5, 2); b = torch.zeros_like(a)
        t.all_to_all_v(a, [5], b, [5]).wait(); assert torch.equal(a, b), dt
    x = torch.arange(6.0)
    t.all_reduce_(x, "max"); assert torch.equal(x, torch.arange(6.0))
    t.close(); t.close()
    try:
        t.all_reduce_(x)
    except RuntimeError as e:
        assert "closed" in str(e)
    else:
        raise AssertionError("a closed transport worked")
    dist.destroy_process_group()
    print("PY OK")
""")


def test_nccl_transport_python_layer_on_stand_in(tmp_path):
    """NcclTransport's own logic (byte counts, row offsets, validation, close)
    end to end on the CPU: CUDA stubbed out, the stand-in libnccl underneath."""
    r = _run_on_stand_in_nccl(tmp_path, _PY_SCRIPT, [ROOT, os.path.join(ROOT, "tests")])
    assert "PY OK" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
_LEFT_OPEN = []


def _one_gpu_rank(rank, P):
    from moepeak.core.nccl import NcclTransport
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    t = get_transport(dist.group.WORLD, device=dev, backend="nccl")
    assert isinstance(t, NcclTransport) and t.world_size == 1
    exercise(t, 0, 1, dev)

    # Stream ordering, no sync between producer, op and consumer. The producer
    # runs late (a spin before it), so a comm stream that did not wait for it
    # would send the -1s.
    n = 1 << 20
    x = torch.full((n,), -1.0, device=dev)
    y = torch.full((n,), -1.0, device=dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)
    x.fill_(3.0)                                   # producer on the current stream
    h = t.send_recv(x, 0, y, 0)
    h.wait()
    z = y * 2                                      # consumer on the current stream
    # The comm stream runs late (a spin on it before the op), so a wait() that
    # did not order the current stream after it would read stale -1s.
    y2 = torch.full((n,), -1.0, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.stream(t._stream):
        torch.cuda._sleep(20_000_000)
    h = t.send_recv(x, 0, y2, 0)
    h.wait()
    z2 = y2 + 1
    # The same for the ops that return no handle (all_gather; an all-reduce of
    # one rank is the identity, so it could not show a race).
    gi = torch.full((n,), 2.0, device=dev)
    go = torch.full((1, n), -1.0, device=dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)
    gi.mul_(3)                                     # producer of an all-gather
    t.all_gather(go, gi)
    s2 = go[0] + 0                                 # consumer right after
    torch.cuda.synchronize()
    assert torch.equal(z, torch.full_like(z, 6.0)), "comm stream did not wait for the producer"
    assert torch.equal(z2, torch.full_like(z2, 4.0)), "Handle.wait() did not order the consumer"
    assert torch.equal(s2, torch.full_like(s2, 6.0)), "all_gather was not ordered with the current stream"

    # Buffers dropped before wait() stay valid (the handle holds them).
    a = torch.arange(n, device=dev, dtype=torch.float32)
    b = torch.empty(n, device=dev)
    h = t.send_recv(a, 0, b, 0)
    del a
    junk = torch.full((n,), 9.0, device=dev)       # may not reuse a's memory under NCCL
    h.wait()
    torch.cuda.synchronize()
    assert torch.equal(b, torch.arange(n, device=dev, dtype=torch.float32)) and junk[0].item() == 9.0

    # Refusals
    with pytest.raises(ValueError, match="send must be on cuda"):
        t.send_recv(torch.zeros(3), 0, torch.zeros(3, device=dev), 0)
    with pytest.raises(ValueError, match="contiguous"):
        t.all_reduce_(torch.zeros(4, 4, device=dev).t())
    with pytest.raises(ValueError, match="send_counts sum to 2 rows but send has 3"):
        t.all_to_all_v(torch.zeros(3, 2, device=dev), [2], torch.zeros(2, 2, device=dev), [2])
    with pytest.raises(ValueError, match="dst must be a rank"):
        t.send_recv(x, 1, y, 0)
    with pytest.raises(TypeError, match="dtype"):
        t.all_reduce_(torch.zeros(2, dtype=torch.bool, device=dev))
    with pytest.raises(ValueError, match="op"):
        t.all_reduce_(torch.zeros(2, device=dev), "avg")
    t.check()
    t.close()
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.all_reduce_(torch.zeros(2, device=dev))
    # A second transport left open (a module-level reference keeps it from
    # being collected): closed by the atexit hook at process exit, no hang.
    _LEFT_OPEN.append(get_transport(dist.group.WORLD, device=dev, backend="nccl"))
    _LEFT_OPEN[-1].all_reduce_(torch.ones(3, device=dev))


@pytest.mark.cuda
def test_nccl_transport_one_gpu():
    run_ranks(1, _one_gpu_rank, timeout=240)


def _two_gpu_rank(rank, P):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    nccl_pg = dist.new_group(backend="nccl")
    ours = get_transport(dist.group.WORLD, device=dev, backend="nccl")
    theirs = TorchDistTransport(nccl_pg)
    a = exercise(ours, rank, P, dev)
    b = exercise(theirs, rank, P, dev)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    big = torch.randn(1 << 22, device=dev, generator=torch.Generator(dev).manual_seed(rank))
    r1, r2 = torch.empty_like(big), torch.empty_like(big)
    ours.send_recv(big, 1 - rank, r1, 1 - rank).wait()
    theirs.send_recv(big, 1 - rank, r2, 1 - rank).wait()
    assert torch.equal(r1, r2)
    ours.close()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_vs_torch_two_gpus():
    run_ranks(2, _two_gpu_rank, timeout=300)
