// sco.cu: the SCO arena's pinned allocation. No kernels: SCO only moves
// bytes (cudaMemcpyAsync through mp_cu_memcpy_async) and orders streams.
//
// Why not mp_cu_host_alloc directly: a refused cudaHostAlloc also leaves
// cudaErrorMemoryAllocation as the runtime's "last error", and the next
// MP_CUDA_CHECK_LAUNCH anywhere in moepeak (another component's kernel) would
// then report it as its own failure. This wrapper records the message and
// clears that state.
#include "common.cuh"

extern "C" mp_status mp_sco_host_alloc(void **ptr, size_t nbytes) {
  mp_status st = MP_OK;
  *ptr = nullptr;
  MP_CUDA_CHECK(st, cudaHostAlloc(ptr, nbytes, cudaHostAllocPortable));
  return MP_OK;
fail:
  (void)cudaGetLastError();  // not sticky: clear it so later launch checks stay truthful
  *ptr = nullptr;
  return st;
}
