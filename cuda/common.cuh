// common.cuh: what every CUDA C file of moepeak includes.
// MP_CUDA_CHECK records file:line and cudaGetErrorString and jumps to the
// caller's `fail:` label with `st` set (DESIGN.md section 4, C errors).
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moepeak.h"

#define MP_CUDA_CHECK(st, expr)                                                 \
  do {                                                                          \
    cudaError_t mp_e_ = (expr);                                                 \
    if (mp_e_ != cudaSuccess) {                                                 \
      mp_set_error(__FILE__, __LINE__, "%s: %s", #expr, cudaGetErrorString(mp_e_)); \
      (st) = MP_ERR_CUDA;                                                       \
      goto fail;                                                                \
    }                                                                           \
  } while (0)

// After a kernel launch: a bad configuration shows up here, not later.
#define MP_CUDA_CHECK_LAUNCH(st) MP_CUDA_CHECK(st, cudaGetLastError())

#define MP_STREAM(s) (reinterpret_cast<cudaStream_t>(s))
#define MP_EVENT(e) (reinterpret_cast<cudaEvent_t>(e))
