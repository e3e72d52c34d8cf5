// The overlay worker core's CUDA driver entry points (dlopen of libcuda.so.1) and its probe of
// the driver's v2 stream memory operations. Part of dsv41.overlay._core (_core.cpp).

#pragma once

#include "dsv41/transport/wire.h"

namespace {

// CUDA driver entry points from libcuda.so.1, loaded at first use (the extension links no CUDA
// library; on a host without one the core never calls CUDA: every handle is 0 there).
struct CudaDriver {
  int (*event_sync)(void *) = nullptr;
  int (*event_record)(void *, void *) = nullptr;
  int (*graph_launch)(void *, void *) = nullptr;
  int (*stream_wait_event)(void *, void *, unsigned) = nullptr;  // optional (EngramSlot::wait_stream)
  // optional, for the GPU-side join: the _v2 stream memory operations, host-mapped
  // pinned memory, the device and driver queries of their detection (stream_mem_ops)
  int (*wait_value64)(void *, uint64_t, uint64_t, unsigned) = nullptr;
  int (*write_value64)(void *, uint64_t, uint64_t, unsigned) = nullptr;
  int (*host_alloc)(void **, size_t, unsigned) = nullptr;
  int (*host_dev_ptr)(uint64_t *, void *, unsigned) = nullptr;
  int (*ctx_current)(void **) = nullptr;
  int (*device_get)(int *, int) = nullptr;
  int (*device_attribute)(int *, int, int) = nullptr;
  int (*driver_version)(int *) = nullptr;
  bool ok = false;
};
// cuda.h: CU_STREAM_WAIT_VALUE_GEQ, CU_STREAM_WRITE_VALUE_DEFAULT (the write is preceded by a
// system-wide memory fence: the D2H copy of the ids before it is visible first),
// CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
constexpr unsigned kWaitValueGeq = 0x1, kWriteValueDefault = 0x0, kHostAllocMapped = 0x1 | 0x2;
constexpr int kAttr64BitStreamMemOps = 93;
const CudaDriver &cuda_driver() {
  static const CudaDriver d = [] {
    CudaDriver r;
    void *h = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return r;
    r.event_sync = reinterpret_cast<int (*)(void *)>(::dlsym(h, "cuEventSynchronize"));
    r.event_record = reinterpret_cast<int (*)(void *, void *)>(::dlsym(h, "cuEventRecord"));
    r.graph_launch = reinterpret_cast<int (*)(void *, void *)>(::dlsym(h, "cuGraphLaunch"));
    r.stream_wait_event = reinterpret_cast<int (*)(void *, void *, unsigned)>(::dlsym(h, "cuStreamWaitEvent"));
    using MemOp = int (*)(void *, uint64_t, uint64_t, unsigned);
    r.wait_value64 = reinterpret_cast<MemOp>(::dlsym(h, "cuStreamWaitValue64_v2"));
    r.write_value64 = reinterpret_cast<MemOp>(::dlsym(h, "cuStreamWriteValue64_v2"));
    r.host_alloc = reinterpret_cast<int (*)(void **, size_t, unsigned)>(::dlsym(h, "cuMemHostAlloc"));
    r.host_dev_ptr =
        reinterpret_cast<int (*)(uint64_t *, void *, unsigned)>(::dlsym(h, "cuMemHostGetDevicePointer_v2"));
    r.ctx_current = reinterpret_cast<int (*)(void **)>(::dlsym(h, "cuCtxGetCurrent"));
    r.device_get = reinterpret_cast<int (*)(int *, int)>(::dlsym(h, "cuDeviceGet"));
    r.device_attribute = reinterpret_cast<int (*)(int *, int, int)>(::dlsym(h, "cuDeviceGetAttribute"));
    r.driver_version = reinterpret_cast<int (*)(int *)>(::dlsym(h, "cuDriverGetVersion"));
    r.ok = r.event_sync && r.event_record && r.graph_launch;
    return r;
  }();
  return d;
}

// Whether the GPU-side join can run on CUDA device `ordinal`: the _v2 stream
// memory operations and host-mapped memory resolve on a driver of CUDA 11.7 or later (NVIDIA's
// driver API: the V2 entry points are "available by default on all platforms"), else the device
// reports the v1 64-bit operations (attribute 93; on the H200 with driver 580 it read 0 while
// cuStreamWaitValue64_v2 worked, so the attribute alone would refuse a working device). False without the driver or an
// entry point.
bool stream_mem_ops(int ordinal) {
  const CudaDriver &cu = cuda_driver();
  if (!cu.ok || !cu.wait_value64 || !cu.write_value64 || !cu.host_alloc || !cu.host_dev_ptr || !cu.device_get ||
      !cu.device_attribute || !cu.stream_wait_event)
    return false;
  int dev = 0, v = 0, version = 0;
  if (cu.device_get(&dev, ordinal) != 0) return false;
  if (cu.driver_version && cu.driver_version(&version) == 0 && version >= 11070) return true;
  return cu.device_attribute(&v, kAttr64BitStreamMemOps, dev) == 0 && v != 0;
}

}  // namespace
