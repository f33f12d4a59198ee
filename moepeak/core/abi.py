"""The C ABI of moepeak._C on the Python side: the dtype codes and the row layouts of the
buffers Python hands the kernels. The one definition is csrc/mp_abi.h; this module mirrors
it and tests/test_abi.py checks the two agree through moepeak._C.abi_info() (built from
the header). Change a code or a row in both together.

A row buffer is [n, width] int64 (or float64), row-major, built as a flat list of ints
and passed as array.array("q") / ("d"): RowLayout.row(...) builds one row from named
fields, RowLayout.<field> is a field's column index.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

# mp_dtype: the kernels' floating-point element types (dtype / z_dtype / state_dtype
# arguments, the grad_dtype / param_dtype fields of the AdamW rows).
DTYPE_CODES: Dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPE_OF_CODE: Dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
BYTES_OF_CODE: Dict[int, int] = {code: dtype.itemsize for dtype, code in DTYPE_CODES.items()}

# mp_nccl_dtype: ncclDataType_t values (NCCL's own ABI) by torch dtype name; mp_nccl_op:
# the ncclRedOp_t values nccl_all_reduce offers.
NCCL_DTYPE_CODES: Dict[str, int] = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
NCCL_OPS: Dict[str, int] = {"sum": 0, "prod": 1, "max": 2, "min": 3}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the names abi_info and NCCL_DTYPE_CODES use)."""
    return str(dtype).rpartition(".")[2]


class RowLayout:
    """The fields of one row struct of mp_abi.h, in order: each field's name is also an
    attribute holding its column index (ADAMW_PARAM_ROW.grad == 3)."""

    def __init__(self, name: str, fields: Sequence[str], optional: Sequence[str] = ()):
        self.name = name
        self.fields: Tuple[str, ...] = tuple(fields)
        self.width = len(self.fields)
        self.optional = frozenset(optional)  # fields that default to 0 ("absent") in row()
        for index, field in enumerate(self.fields):
            setattr(self, field, index)

    def row(self, **values) -> list:
        """One row in column order from every field by name (optional ones default to 0)."""
        unknown = set(values) - set(self.fields)
        missing = [f for f in self.fields if f not in values and f not in self.optional]
        if unknown or missing:
            raise TypeError(f"moepeak: a {self.name} row takes the fields {list(self.fields)}; "
                            f"unknown {sorted(unknown)}, missing {missing}")
        return [values.get(f, 0) for f in self.fields]

    def __repr__(self) -> str:
        return f"RowLayout({self.name!r}, {list(self.fields)})"


# StreamAdamW (csrc/adamw.c): `ptrs` [nparam, 9] int64 (addresses as ints, 0 = absent;
# grad 0 = no grad this step, the row is skipped), `hyper` [nparam, 7] float64, and the
# bucket plan's `segs` [nseg, 5] int64 (byte offsets into the pinned grad / param slots).
ADAMW_PARAM_ROW = RowLayout(
    "adamw_param",
    ("master", "exp_avg", "exp_avg_sq", "grad", "param_lowp", "numel", "grad_dtype", "param_dtype",
     "max_exp_avg_sq"),
    optional=("param_lowp", "param_dtype", "max_exp_avg_sq"))
ADAMW_HYPER_ROW = RowLayout("adamw_hyper", ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "maximize"))
ADAMW_SEGMENT_ROW = RowLayout("adamw_segment",
                              ("param", "first", "numel", "grad_slot_offset", "param_slot_offset"))

ROWS: Dict[str, RowLayout] = {r.name: r for r in (ADAMW_PARAM_ROW, ADAMW_HYPER_ROW, ADAMW_SEGMENT_ROW)}
