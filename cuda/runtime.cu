// runtime.cu: thin extern "C" wrappers over the CUDA runtime, so that C code
// (csrc/) can allocate pinned memory, copy asynchronously and order streams
// with events without including CUDA headers. Streams and events travel as
// uintptr_t; torch's current stream is passed in as
// torch.cuda.current_stream().cuda_stream.
//
// moepeak links cudart statically; both its runtime and torch's act on the
// device's primary context, so streams and events are interchangeable.
#include "common.cuh"

extern "C" {

mp_status mp_cu_set_device(int device) {
  return MP_CUDA_STATUS(cudaSetDevice(device));
}

mp_status mp_cu_device_count(int *count) {
  *count = 0;
  return MP_CUDA_STATUS(cudaGetDeviceCount(count));
}

mp_status mp_cu_host_alloc(void **ptr, size_t nbytes) {
  *ptr = nullptr;
  return MP_CUDA_STATUS(cudaHostAlloc(ptr, nbytes, cudaHostAllocPortable));
}

mp_status mp_cu_host_free(void *ptr) {
  return MP_CUDA_STATUS(cudaFreeHost(ptr));
}

mp_status mp_cu_host_register(void *ptr, size_t nbytes) {
  return MP_CUDA_STATUS(cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable));
}

mp_status mp_cu_host_unregister(void *ptr) {
  return MP_CUDA_STATUS(cudaHostUnregister(ptr));
}

mp_status mp_cu_memcpy_async(void *dst, const void *src, size_t nbytes, uintptr_t stream) {
  if (nbytes == 0) return MP_OK;
  return MP_CUDA_STATUS(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, MP_STREAM(stream)));
}

mp_status mp_cu_stream_create(uintptr_t *stream, int priority) {
  mp_status st = MP_OK;
  cudaStream_t s = nullptr;
  MP_CUDA_CHECK(st, cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  *stream = reinterpret_cast<uintptr_t>(s);
fail:
  return st;
}

mp_status mp_cu_stream_destroy(uintptr_t stream) {
  return MP_CUDA_STATUS(cudaStreamDestroy(MP_STREAM(stream)));
}

mp_status mp_cu_stream_synchronize(uintptr_t stream) {
  return MP_CUDA_STATUS(cudaStreamSynchronize(MP_STREAM(stream)));
}

mp_status mp_cu_stream_wait_event(uintptr_t stream, uintptr_t event) {
  return MP_CUDA_STATUS(cudaStreamWaitEvent(MP_STREAM(stream), MP_EVENT(event), 0));
}

mp_status mp_cu_event_create(uintptr_t *event) {
  mp_status st = MP_OK;
  cudaEvent_t e = nullptr;
  MP_CUDA_CHECK(st, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  *event = reinterpret_cast<uintptr_t>(e);
fail:
  return st;
}

mp_status mp_cu_event_destroy(uintptr_t event) {
  return MP_CUDA_STATUS(cudaEventDestroy(MP_EVENT(event)));
}

mp_status mp_cu_event_record(uintptr_t event, uintptr_t stream) {
  return MP_CUDA_STATUS(cudaEventRecord(MP_EVENT(event), MP_STREAM(stream)));
}

mp_status mp_cu_event_synchronize(uintptr_t event) {
  return MP_CUDA_STATUS(cudaEventSynchronize(MP_EVENT(event)));
}

mp_status mp_cu_event_query(uintptr_t event, int *done) {
  mp_status st = MP_OK;
  cudaError_t e = cudaEventQuery(MP_EVENT(event));
  *done = 0;
  if (e == cudaSuccess) {
    *done = 1;
  } else if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();  // NotReady is not sticky; clear it
  } else {
    MP_CUDA_CHECK(st, e);
  }
fail:
  return st;
}

}  // extern "C"
