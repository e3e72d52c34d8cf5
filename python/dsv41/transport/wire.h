// The row wire protocol's constants and the byte and clock helpers that the transport's
// extension (_fastrow.cpp: server and client) and the overlay's worker core
// (dsv41/overlay/_core.cpp) share; protocol: dsv41/transport/protocol.py, versions 1-2.
// Each extension is one translation unit that includes this header once (internal linkage).

#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlfcn.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <system_error>
#include <tuple>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

constexpr uint32_t kMagic = 0x45565344u;
constexpr uint16_t kVersion = 1;     // frames of the single-table ops that every peer speaks
constexpr uint16_t kMaxVersion = 2;  // version 2 adds OP_LOOKUP_MULTI
constexpr uint32_t kMaxSegs = 16;    // tables per OP_LOOKUP_MULTI request
constexpr size_t kSeg = 40;          // segment header: 32 B identity, u32 count, u32 reserved
constexpr size_t kReq = 56, kRep = 24, kRow = 264, kW = 256, kS = 8;
constexpr uint32_t kMaxRows = 1u << 20;
constexpr uint64_t kMaxPayload = uint64_t(kMaxRows) * 8;
enum : uint16_t { OP_LOOKUP = 1, OP_HELLO = 2, OP_NIXL_HELLO = 3, OP_PING = 4, OP_LOOKUP_MULTI = 5 };
enum : uint16_t {
  ST_OK = 0,
  ST_BAD_MAGIC = 1,
  ST_BAD_VERSION = 2,
  ST_UNKNOWN_OP = 3,
  ST_WRONG_IDENTITY = 4,
  ST_OUT_OF_RANGE = 5,
  ST_OVERSIZE = 6,
  ST_BAD_FRAME = 7,
  ST_SHUTTING_DOWN = 8,
  ST_NOT_SUPPORTED = 9,
  ST_COUNT = 16
};

// Little-endian hosts only (x86-64, aarch64): fields are copied with memcpy.
template <class T>
T rd(const uint8_t *p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
void wr(uint8_t *p, T v) {
  std::memcpy(p, &v, sizeof v);
}
// A request's kReq-byte header: magic, version, op, generation, the table's 32-byte identity
// (zeros when `ident` is null: OP_LOOKUP_MULTI names its tables per segment), count, payload bytes.
void write_req(uint8_t *h, uint16_t ver, uint16_t op, uint64_t gen, const char *ident, uint32_t count,
               uint32_t payload) {
  wr<uint32_t>(h, kMagic);
  wr<uint16_t>(h + 4, ver);
  wr<uint16_t>(h + 6, op);
  wr<uint64_t>(h + 8, gen);
  if (ident) std::memcpy(h + 16, ident, 32);
  else std::memset(h + 16, 0, 32);
  wr<uint32_t>(h + 48, count);
  wr<uint32_t>(h + 52, payload);
}

// A spin loop's pause (x86 PAUSE; elsewhere nothing): less power and no memory-order stalls.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

}  // namespace
