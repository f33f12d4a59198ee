/* abi.c: moepeak._C.abi_info(), the dtype codes and row layouts of mp_abi.h as
 * Python values, so tests/test_abi.py can check moepeak/core/abi.py against the
 * header the kernels are compiled with. The row tables name each struct field
 * with its offsetof: a field renamed or moved in mp_abi.h without this table
 * fails to compile or shows up as a mismatch in the test. */
#include "mp_python.h" /* Python.h first */

#include "mp_abi.h"

typedef struct {
  const char *name;
  long long value;
} abi_entry;

#define ROW_FIELD(type, field) {#field, (long long)(offsetof(type, field) / 8)}

static const abi_entry dtypes[] = {
    {"float32", MP_DTYPE_F32}, {"bfloat16", MP_DTYPE_BF16}, {"float16", MP_DTYPE_F16}};

static const abi_entry nccl_dtypes[] = {
    {"int8", MP_NCCL_INT8},       {"uint8", MP_NCCL_UINT8},     {"int32", MP_NCCL_INT32},
    {"uint32", MP_NCCL_UINT32},   {"int64", MP_NCCL_INT64},     {"uint64", MP_NCCL_UINT64},
    {"float16", MP_NCCL_FLOAT16}, {"float32", MP_NCCL_FLOAT32}, {"float64", MP_NCCL_FLOAT64},
    {"bfloat16", MP_NCCL_BFLOAT16}};

static const abi_entry nccl_ops[] = {
    {"sum", MP_NCCL_SUM}, {"prod", MP_NCCL_PROD}, {"max", MP_NCCL_MAX}, {"min", MP_NCCL_MIN}};

static const abi_entry adamw_param_row[] = {
    ROW_FIELD(mp_adamw_param_row, master),     ROW_FIELD(mp_adamw_param_row, exp_avg),
    ROW_FIELD(mp_adamw_param_row, exp_avg_sq), ROW_FIELD(mp_adamw_param_row, grad),
    ROW_FIELD(mp_adamw_param_row, param_lowp), ROW_FIELD(mp_adamw_param_row, numel),
    ROW_FIELD(mp_adamw_param_row, grad_dtype), ROW_FIELD(mp_adamw_param_row, param_dtype),
    ROW_FIELD(mp_adamw_param_row, max_exp_avg_sq)};

static const abi_entry adamw_hyper_row[] = {
    ROW_FIELD(mp_adamw_hyper_row, lr),           ROW_FIELD(mp_adamw_hyper_row, beta1),
    ROW_FIELD(mp_adamw_hyper_row, beta2),        ROW_FIELD(mp_adamw_hyper_row, eps),
    ROW_FIELD(mp_adamw_hyper_row, weight_decay), ROW_FIELD(mp_adamw_hyper_row, step),
    ROW_FIELD(mp_adamw_hyper_row, maximize)};

static const abi_entry adamw_segment_row[] = {
    ROW_FIELD(mp_adamw_segment_row, param),           ROW_FIELD(mp_adamw_segment_row, first),
    ROW_FIELD(mp_adamw_segment_row, numel),           ROW_FIELD(mp_adamw_segment_row, grad_slot_offset),
    ROW_FIELD(mp_adamw_segment_row, param_slot_offset)};

#define COUNT(table) (sizeof table / sizeof table[0])

/* {name: value} of a table (new reference, NULL with an exception set). */
static PyObject *entries_dict(const abi_entry *e, size_t n) {
  PyObject *d = PyDict_New();
  for (size_t i = 0; d && i < n; i++) {
    PyObject *v = PyLong_FromLongLong(e[i].value);
    if (!v || PyDict_SetItemString(d, e[i].name, v) < 0) Py_CLEAR(d);
    Py_XDECREF(v);
  }
  return d;
}

/* {"fields": {name: index}, "width": sizeof / 8} of a row struct's table. */
static PyObject *row_dict(const abi_entry *e, size_t n, size_t row_bytes) {
  PyObject *fields = entries_dict(e, n);
  if (!fields) return NULL;
  PyObject *d = Py_BuildValue("{sOsn}", "fields", fields, "width", (Py_ssize_t)(row_bytes / 8));
  Py_DECREF(fields);
  return d;
}

/* Set d[key] = value, stealing value; -1 on error (value NULL included). */
static int set_steal(PyObject *d, const char *key, PyObject *value) {
  if (!value) return -1;
  int rc = PyDict_SetItemString(d, key, value);
  Py_DECREF(value);
  return rc;
}

static PyObject *py_abi_info(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  PyObject *info = PyDict_New(), *rows = PyDict_New();
  if (!info || !rows) goto fail;
  if (set_steal(rows, "adamw_param", row_dict(adamw_param_row, COUNT(adamw_param_row), sizeof(mp_adamw_param_row))) ||
      set_steal(rows, "adamw_hyper", row_dict(adamw_hyper_row, COUNT(adamw_hyper_row), sizeof(mp_adamw_hyper_row))) ||
      set_steal(rows, "adamw_segment",
                row_dict(adamw_segment_row, COUNT(adamw_segment_row), sizeof(mp_adamw_segment_row))))
    goto fail;
  if (set_steal(info, "dtype", entries_dict(dtypes, COUNT(dtypes))) ||
      set_steal(info, "nccl_dtype", entries_dict(nccl_dtypes, COUNT(nccl_dtypes))) ||
      set_steal(info, "nccl_op", entries_dict(nccl_ops, COUNT(nccl_ops))))
    goto fail;
  int rc = PyDict_SetItemString(info, "rows", rows);
  Py_CLEAR(rows);
  if (rc < 0) goto fail;
  return info;
fail:
  Py_XDECREF(rows);
  Py_XDECREF(info);
  return NULL;
}

PyMethodDef mp_abi_methods[] = {
    {"abi_info", py_abi_info, METH_NOARGS,
     "abi_info() -> {'dtype': {name: code}, 'nccl_dtype': {...}, 'nccl_op': {...}, 'rows': {layout: "
     "{'fields': {name: index}, 'width': n}}}: csrc/mp_abi.h's codes and row layouts, as compiled."},
    {NULL, NULL, 0, NULL},
};
