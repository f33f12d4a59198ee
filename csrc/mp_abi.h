/* mp_abi.h: the one definition of what crosses the boundary between moepeak's
 * Python code and its C / CUDA C kernels: the dtype codes and the layouts of
 * the int64 / float64 row buffers Python builds (array.array("q") / ("d"),
 * row-major, one struct per row).
 *
 * Python mirror: moepeak/core/abi.py. tests/test_abi.py checks that the two
 * agree through moepeak._C.abi_info() (csrc/abi.c), which is built from this
 * header: change a code or a row here, there and in abi.c together.
 *
 * Row invariants: every field is 8 bytes (int64_t or double), in the order
 * written, with no padding (static asserts below), so a [n, k] buffer of
 * int64 is exactly n structs; addresses are ints, 0 meaning "absent". */
#ifndef MOEPEAK_ABI_H
#define MOEPEAK_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
#define MP_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define MP_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

/* ---- dtype codes ---------------------------------------------------------
 * Element types of the kernels' floating-point tensors: the `dtype`,
 * `z_dtype`, `out_dtype`, `state_dtype` arguments of the CE, LLEP and AdamW
 * bindings, and the grad / param dtype fields of the AdamW rows. */
typedef enum { MP_DTYPE_F32 = 0, MP_DTYPE_BF16 = 1, MP_DTYPE_F16 = 2, MP_DTYPE_COUNT = 3 } mp_dtype;

/* 1 when code is an mp_dtype. */
static inline int mp_dtype_valid(int64_t code) { return code >= 0 && code < MP_DTYPE_COUNT; }

/* Bytes per element of a valid mp_dtype. */
static inline size_t mp_dtype_bytes(int64_t code) { return code == MP_DTYPE_F32 ? 4 : 2; }

/* ncclDataType_t values (NCCL's own public ABI, which the transport's `dtype`
 * arguments take unchanged). */
typedef enum {
  MP_NCCL_INT8 = 0,
  MP_NCCL_UINT8 = 1,
  MP_NCCL_INT32 = 2,
  MP_NCCL_UINT32 = 3,
  MP_NCCL_INT64 = 4,
  MP_NCCL_UINT64 = 5,
  MP_NCCL_FLOAT16 = 6,
  MP_NCCL_FLOAT32 = 7,
  MP_NCCL_FLOAT64 = 8,
  MP_NCCL_BFLOAT16 = 9,
  MP_NCCL_DTYPE_COUNT = 10
} mp_nccl_dtype;

/* ncclRedOp_t values offered by nccl_all_reduce (avg exists but is not offered). */
typedef enum { MP_NCCL_SUM = 0, MP_NCCL_PROD = 1, MP_NCCL_MAX = 2, MP_NCCL_MIN = 3, MP_NCCL_OP_COUNT = 4 } mp_nccl_op;

/* ---- StreamAdamW rows (csrc/adamw.c; built in moepeak/stream_adamw) ------ */

/* One parameter of one step: `ptrs` of adamw_cpu / adamw_plan_step, [nparam, 9] int64. */
typedef struct {
  int64_t master;         /* fp32 master weights [numel], updated in place */
  int64_t exp_avg;        /* [numel] of the call's state_dtype */
  int64_t exp_avg_sq;     /* [numel] of the call's state_dtype */
  int64_t grad;           /* [numel] of grad_dtype; 0: no grad this step, the row is skipped */
  int64_t param_lowp;     /* the low-precision param to write (param_dtype); 0: none (an fp32 param is the master) */
  int64_t numel;          /* elements of the parameter */
  int64_t grad_dtype;     /* mp_dtype of grad */
  int64_t param_dtype;    /* mp_dtype of param_lowp (0 when param_lowp is 0) */
  int64_t max_exp_avg_sq; /* amsgrad's state, [numel] of state_dtype; 0: no amsgrad */
} mp_adamw_param_row;

/* The hyperparameters of one parameter's update: `hyper`, [nparam, 7] float64. */
typedef struct {
  double lr, beta1, beta2, eps, weight_decay;
  double step;     /* the step count of bias correction: torch's state["step"] after this step's increment */
  double maximize; /* 0 or 1 */
} mp_adamw_hyper_row;

/* A piece of one parameter in a bucket plan: `segs` of adamw_plan_create, [nseg, 5] int64. */
typedef struct {
  int64_t param;             /* the parameter's row in ptrs / hyper */
  int64_t first;             /* first element of the parameter in this segment */
  int64_t numel;             /* elements of the segment (> 0) */
  int64_t grad_slot_offset;  /* byte offset of the segment's grads in a pinned grad slot */
  int64_t param_slot_offset; /* byte offset of its new low-precision params in a pinned param slot */
} mp_adamw_segment_row;

/* ---- layout checks ---------------------------------------------------------
 * Every field is 8 bytes, so a struct of 8 * (its field count) bytes has no
 * padding and its fields sit at 8 * (declaration index). The field names and
 * indices are checked against moepeak/core/abi.py by tests/test_abi.py
 * (through the offsetof table of csrc/abi.c). */
#define MP_ROW_WIDTH(type, width) MP_STATIC_ASSERT(sizeof(type) == 8 * (width), #type " has " #width " fields")

MP_ROW_WIDTH(mp_adamw_param_row, 9);
MP_ROW_WIDTH(mp_adamw_hyper_row, 7);
MP_ROW_WIDTH(mp_adamw_segment_row, 5);

#endif
