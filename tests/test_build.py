"""The extension builds, imports and reports what it was built with; the CUDA
targets it lists are those in its binary, and a GPU they cannot run on is refused
at the first CUDA op with its compute capability named."""
import struct

import pytest
import torch

import moepeak
import moepeak._C as C
from moepeak.core import ext


def test_import_and_flags():
    assert C.has_cuda in (0, 1)
    assert C.best_isa in (C.ISA_SCALAR, C.ISA_AVX2, C.ISA_AVX512)
    assert C.get_num_threads() >= 1
    assert moepeak.__version__


def test_thread_setting_validated():
    with pytest.raises(ValueError, match="threads"):
        C.set_num_threads(-1)
    old = C.get_num_threads()
    C.set_num_threads(1)
    assert C.get_num_threads() == 1
    C.set_num_threads(0)
    assert C.get_num_threads() >= 1
    C.set_num_threads(old)


def test_cuda_entry_points_fail_cleanly_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="moepeak"):
        C.host_alloc(1024)
    with pytest.raises(ValueError, match="nbytes"):
        C.host_alloc(0)


def test_unknown_attribute():
    with pytest.raises(AttributeError):
        moepeak.no_such_thing


@pytest.mark.cuda
def test_pinned_roundtrip_gpu():
    n = 1 << 20
    src = torch.arange(n, dtype=torch.float32, device="cuda")
    ptr = C.host_alloc(n * 4)
    try:
        stream = torch.cuda.current_stream().cuda_stream
        ev = C.event_create()
        C.memcpy_async(ptr, src.data_ptr(), n * 4, stream)
        C.event_record(ev, stream)
        C.event_synchronize(ev)
        assert C.event_query(ev)
        back = torch.empty(n, dtype=torch.float32, device="cuda")
        C.memcpy_async(back.data_ptr(), ptr, n * 4, stream)
        torch.cuda.synchronize()
        assert torch.equal(back, src)
        C.event_destroy(ev)
    finally:
        C.host_free(ptr)


# ---------------------------------------------------------------------------
# CUDA targets: what was built, and which GPUs can run it
# ---------------------------------------------------------------------------
FATBIN_MAGIC = 0xBA55ED50


def _elf_section(data: bytes, wanted: str) -> bytes:
    """The bytes of the ELF64 (little-endian) section named `wanted`."""
    assert data[:4] == b"\x7fELF" and data[4] == 2, "not an ELF64 file"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for name_off, _type, _flags, _addr, offset, size in headers:
        end = data.index(b"\0", names_at + name_off)
        if data[names_at + name_off:end].decode() == wanted:
            return data[offset:offset + size]
    raise AssertionError(f"no section {wanted}")


def _fatbin_targets(blob: bytes) -> set:
    """{"sm_XY" / "compute_XY"} of every image in the fatbinaries of `blob`. Layout (what
    cuobjdump reads): a header {u32 magic 0xBA55ED50, u16 version, u16 header size, u64
    body size}, then images, each {u16 kind (1 PTX, 2 SASS), u16, u32 header size, u32
    padded payload size, ..., u32 arch at byte 28} followed by its payload."""
    found, pos = set(), 0
    while pos + 16 <= len(blob):
        magic, _version, header, body = struct.unpack_from("<IHHQ", blob, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fatbinaries are 8-byte aligned in the section
            continue
        image, end = pos + header, pos + header + body
        while image < end:
            kind, _, image_header, payload = struct.unpack_from("<HHII", blob, image)
            (arch,) = struct.unpack_from("<I", blob, image + 28)
            found.add(f"{'compute' if kind == 1 else 'sm'}_{arch}")
            image += image_header + payload
        pos = end
    return found


def test_cuda_archs_are_the_targets_in_the_binary():
    assert isinstance(C.cuda_archs, tuple) and all(isinstance(t, str) for t in C.cuda_archs)
    if not C.has_cuda:
        assert C.cuda_archs == ()
        return
    for target in C.cuda_archs:
        ext.parse_cuda_target(target)  # nvcc's spelling
    with open(C.__file__, "rb") as f:
        images = _fatbin_targets(_elf_section(f.read(), ".nv_fatbin"))
    plain = {t.rstrip("af") for t in C.cuda_archs}  # the arch number; the suffix lives in image flags
    assert images == plain, f"moepeak._C.cuda_archs {C.cuda_archs}, its fatbinaries hold {sorted(images)}"
    assert any(t.startswith("compute_") for t in C.cuda_archs), "no PTX: newer GPUs could not JIT the kernels"


PORTABLE = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "compute_120")


@pytest.mark.parametrize("target, runs_on, not_on", [
    ("sm_80", [(8, 0), (8, 6), (8, 7), (8, 9)], [(7, 5), (9, 0), (10, 0), (12, 0)]),
    ("sm_86", [(8, 6), (8, 9)], [(8, 0), (9, 0)]),
    ("sm_90", [(9, 0)], [(8, 9), (10, 0), (12, 0)]),
    ("sm_100", [(10, 0), (10, 3)], [(9, 0), (11, 0), (12, 0)]),
    ("sm_120", [(12, 0), (12, 1)], [(10, 0), (13, 0)]),
    ("compute_80", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 1)], [(7, 5)]),
    ("compute_90", [(9, 0), (10, 0), (12, 0)], [(8, 0), (8, 9)]),
    ("compute_120", [(12, 0), (12, 1), (13, 0)], [(9, 0), (10, 3), (11, 0)]),
    ("sm_90a", [(9, 0)], [(9, 1), (10, 0), (12, 0)]),
    ("compute_90a", [(9, 0)], [(10, 0), (12, 0)]),  # arch-specific PTX is not forward compatible
    ("sm_100f", [(10, 0), (10, 3)], [(9, 0), (11, 0), (12, 0)]),
    ("compute_100f", [(10, 0), (10, 3)], [(11, 0), (12, 0)]),
])
def test_cuda_compatibility_rules(target, runs_on, not_on):
    for cap in runs_on:
        assert ext.target_runs_on(target, cap), f"{target} should run on {cap}"
    for cap in not_on:
        assert not ext.target_runs_on(target, cap), f"{target} should not run on {cap}"


def test_portable_build_covers_ampere_to_blackwell():
    for cap in [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1), (13, 0)]:
        assert ext.cuda_arch_error(cap, PORTABLE) is None, cap
    for cap in [(7, 5), (11, 0)]:  # below sm_80; Jetson Thor (11.0) has neither SASS nor PTX below it
        assert ext.cuda_arch_error(cap, PORTABLE) is not None, cap


def test_sm90_build_on_an_a100_names_capability_and_targets():
    msg = ext.cuda_arch_error((8, 0), ("sm_90", "compute_90"), "NVIDIA A100-SXM4-80GB")
    assert msg is not None
    assert "NVIDIA A100-SXM4-80GB" in msg and "compute capability 8.0" in msg and "sm_90, compute_90" in msg
    assert "MOEPEAK_CUDA_ARCH=80" in msg
    assert ext.cuda_arch_error((10, 0), ("sm_90", "compute_90")) is None  # B200 JITs compute_90
    assert ext.cuda_arch_error((12, 0), ("sm_90",)) is not None  # SASS alone: same major only


@pytest.mark.parametrize("bad", ["sm90", "sm_9", "compute_", "sm_90b", "lto_90", "sm_090", 90])
def test_bad_target_named(bad):
    with pytest.raises((ValueError, TypeError)):
        ext.parse_cuda_target(bad)


def test_first_cuda_op_refuses_a_gpu_the_build_cannot_run_on(monkeypatch):
    """current_stream_handle is where every CUDA op gets its stream: it checks the device
    first, once per device (here with a fake sm_90 build and fake GPUs on a CPU machine)."""
    monkeypatch.setattr(ext, "HAS_CUDA_BUILD", True)
    monkeypatch.setattr(ext, "CUDA_TARGETS", ("sm_90", "compute_90"))
    monkeypatch.setattr(ext, "CHECKED_DEVICES", set())
    caps = {0: (8, 6), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"fake GPU {i}")
    streams = []

    class Stream:
        cuda_stream = 1234

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: streams.append(device) or Stream())
    with pytest.raises(RuntimeError, match=r"fake GPU 0 \(compute capability 8\.6\).*sm_90, compute_90"):
        ext.current_stream_handle(torch.device("cuda", 0))
    assert not streams and not ext.CHECKED_DEVICES  # refused before the stream was taken
    assert ext.current_stream_handle(torch.device("cuda", 1)) == 1234
    assert ext.CHECKED_DEVICES == {1}
    caps[1] = (7, 0)  # checked once per device: not asked again
    assert ext.current_stream_handle(torch.device("cuda", 1)) == 1234
    assert ext.current_stream_handle(torch.device("cpu")) == 0


def test_cpu_only_build_is_not_checked(monkeypatch):
    monkeypatch.setattr(ext, "HAS_CUDA_BUILD", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: pytest.fail("asked for a capability"))
    ext.check_cuda_arch(torch.device("cuda", 0))


@pytest.mark.cuda
def test_this_gpu_runs_the_build():
    """On a GPU machine the default build (the GPUs present) passes the check, and a kernel runs."""
    ext.check_cuda_arch(torch.device("cuda", 0))
    assert ext.cuda_arch_error(torch.cuda.get_device_capability(0), C.cuda_archs) is None
    from moepeak.ring_dtp.blocks import scale_
    t = torch.ones(4, dtype=torch.float32, device="cuda")
    scale_(t, torch.tensor([3.0], device="cuda"))  # a moepeak kernel (ce_scale)
    assert torch.equal(t.cpu(), torch.full((4,), 3.0))
