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
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaSetDevice(device));
fail:
  return st;
}

mp_status mp_cu_device_count(int *count) {
  mp_status st = MP_OK;
  *count = 0;
  MP_CUDA_CHECK(st, cudaGetDeviceCount(count));
fail:
  return st;
}

mp_status mp_cu_host_alloc(void **ptr, size_t nbytes) {
  mp_status st = MP_OK;
  *ptr = nullptr;
  MP_CUDA_CHECK(st, cudaHostAlloc(ptr, nbytes, cudaHostAllocPortable));
fail:
  return st;
}

mp_status mp_cu_host_free(void *ptr) {
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaFreeHost(ptr));
fail:
  return st;
}

mp_status mp_cu_host_register(void *ptr, size_t nbytes) {
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable));
fail:
  return st;
}

mp_status mp_cu_host_unregister(void *ptr) {
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaHostUnregister(ptr));
fail:
  return st;
}

mp_status mp_cu_memcpy_async(void *dst, const void *src, size_t nbytes, uintptr_t stream) {
  mp_status st = MP_OK;
  if (nbytes == 0) return MP_OK;
  MP_CUDA_CHECK(st, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, MP_STREAM(stream)));
fail:
  return st;
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
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaStreamDestroy(MP_STREAM(stream)));
fail:
  return st;
}

mp_status mp_cu_stream_synchronize(uintptr_t stream) {
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaStreamSynchronize(MP_STREAM(stream)));
fail:
  return st;
}

mp_status mp_cu_stream_wait_event(uintptr_t stream, uintptr_t event) {
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaStreamWaitEvent(MP_STREAM(stream), MP_EVENT(event), 0));
fail:
  return st;
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
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaEventDestroy(MP_EVENT(event)));
fail:
  return st;
}

mp_status mp_cu_event_record(uintptr_t event, uintptr_t stream) {
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaEventRecord(MP_EVENT(event), MP_STREAM(stream)));
fail:
  return st;
}

mp_status mp_cu_event_synchronize(uintptr_t event) {
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaEventSynchronize(MP_EVENT(event)));
fail:
  return st;
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
