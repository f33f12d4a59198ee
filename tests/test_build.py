"""The extension builds, imports and reports what it was built with."""
import pytest
import torch

import moepeak
import moepeak._C as C


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
