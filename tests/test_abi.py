"""The C ABI is defined once (csrc/mp_abi.h) and mirrored in moepeak/core/abi.py: the two
must agree, checked through moepeak._C.abi_info(), which is compiled from the header."""
import pytest
import torch

from moepeak import _C
from moepeak.core import abi


@pytest.fixture(scope="module")
def info():
    return _C.abi_info()


def test_dtype_codes_match_the_header(info):
    assert {abi.dtype_name(d): code for d, code in abi.DTYPE_CODES.items()} == info["dtype"]
    assert {code: abi.DTYPE_OF_CODE[code].itemsize for code in info["dtype"].values()} == abi.BYTES_OF_CODE


def test_nccl_codes_match_the_header(info):
    assert abi.NCCL_DTYPE_CODES == info["nccl_dtype"]
    assert abi.NCCL_OPS == info["nccl_op"]


def test_row_layouts_match_the_header(info):
    assert set(abi.ROWS) == set(info["rows"])
    for name, layout in abi.ROWS.items():
        c_row = info["rows"][name]
        assert c_row["width"] == layout.width, name
        assert c_row["fields"] == {f: i for i, f in enumerate(layout.fields)}, name
        assert all(getattr(layout, f) == i for f, i in c_row["fields"].items()), name


def test_row_builder_names_every_field():
    row = abi.ADAMW_PARAM_ROW.row(master=1, exp_avg=2, exp_avg_sq=3, grad=4, numel=5, grad_dtype=1)
    assert row == [1, 2, 3, 4, 0, 5, 1, 0, 0]
    assert row[abi.ADAMW_PARAM_ROW.grad] == 4 and row[abi.ADAMW_PARAM_ROW.max_exp_avg_sq] == 0
    with pytest.raises(TypeError, match="missing \\['numel'"):
        abi.ADAMW_PARAM_ROW.row(master=1, exp_avg=2, exp_avg_sq=3, grad=4, grad_dtype=1)
    with pytest.raises(TypeError, match="unknown \\['gard'\\]"):
        abi.ADAMW_SEGMENT_ROW.row(param=0, first=0, numel=1, grad_slot_offset=0, param_slot_offset=0, gard=1)


def test_the_check_can_fail(info, monkeypatch):
    """A Python mirror that drifted from the header (a swapped field, a changed code) is caught."""
    swapped = abi.RowLayout("adamw_segment", ("param", "numel", "first", "grad_slot_offset", "param_slot_offset"))
    monkeypatch.setitem(abi.ROWS, "adamw_segment", swapped)
    with pytest.raises(AssertionError):
        test_row_layouts_match_the_header(info)
    monkeypatch.setitem(abi.DTYPE_CODES, torch.float16, 3)
    with pytest.raises(AssertionError):
        test_dtype_codes_match_the_header(info)
