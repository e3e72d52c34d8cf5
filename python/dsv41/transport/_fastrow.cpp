// C++ hot path of the dsv41 row transport (protocol: dsv41/transport/protocol.py, versions 1-2)
// and of the vLLM overlay's id plan (plan_rows).
//
// ServerCore: the per-client request loop of the table server (lookup, hello, ping, refusals),
// run with the GIL released, busy-polling for a bounded time for the next request before
// blocking; ops it does not handle itself (the NIXL handshake) are handed back
// to Python.  client_lookup: one lookup on a non-blocking client socket, busy-polling for a
// bounded time before sleeping in ppoll, writing rows straight into caller buffers.
// Built by setup.py (pybind11 setuptools helpers); dsv41/transport/tcp.py and server.py hold the
// pure-Python equivalents, tested to give identical bytes and statuses.

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

// The tail pieces of a multi-piece job's layout, rows each, applied in order (piece_layout).
using Tails = std::vector<int64_t>;

constexpr uint32_t kMagic = 0x45565344u;
constexpr uint16_t kVersion = 1;     // frames of the single-table ops that every peer speaks
constexpr uint16_t kMaxVersion = 2;  // version 2 adds OP_LOOKUP_MULTI
constexpr uint32_t kMaxSegs = 16;    // tables per OP_LOOKUP_MULTI request
constexpr size_t kSeg = 40;          // segment header: 32 B identity, u32 count, u32 reserved
constexpr size_t kReq = 56, kRep = 24, kRow = 264, kW = 256, kS = 8;
constexpr uint32_t kMaxRows = 1u << 20;
constexpr uint64_t kMaxPayload = uint64_t(kMaxRows) * 8;
constexpr size_t kGatherChunk = 16384;
constexpr uint32_t kPrefetch = 8;  // rows gathered ahead of the copy (prefetch distance)
enum : uint16_t { OP_LOOKUP = 1, OP_HELLO = 2, OP_NIXL_HELLO = 3, OP_PING = 4, OP_LOOKUP_MULTI = 5 };
enum : uint16_t {
  ST_OK = 0, ST_BAD_MAGIC = 1, ST_BAD_VERSION = 2, ST_UNKNOWN_OP = 3, ST_WRONG_IDENTITY = 4,
  ST_OUT_OF_RANGE = 5, ST_OVERSIZE = 6, ST_BAD_FRAME = 7, ST_SHUTTING_DOWN = 8, ST_NOT_SUPPORTED = 9,
  ST_COUNT = 16
};
constexpr double kBuckets[] = {25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 0.25, 1.0, 5.0};
constexpr int kNBuckets = sizeof(kBuckets) / sizeof(kBuckets[0]);

// Little-endian hosts only (x86-64, aarch64): fields are copied with memcpy.
template <class T> T rd(const uint8_t *p) { T v; std::memcpy(&v, p, sizeof v); return v; }
template <class T> void wr(uint8_t *p, T v) { std::memcpy(p, &v, sizeof v); }

void pack_rep(uint8_t *h, uint16_t ver, uint16_t status, uint64_t rid, uint32_t count, uint32_t plen) {
  wr<uint32_t>(h, kMagic); wr<uint16_t>(h + 4, ver); wr<uint16_t>(h + 6, status);
  wr<uint64_t>(h + 8, rid); wr<uint32_t>(h + 16, count); wr<uint32_t>(h + 20, plen);
}

// Blocking full read; false on EOF or error.
bool recv_all(int fd, uint8_t *p, size_t n) {
  while (n) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r > 0) { p += r; n -= size_t(r); continue; }
    if (r < 0 && errno == EINTR) continue;
    return false;
  }
  return true;
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

// Whether `fd` has a send timeout (SO_SNDTIMEO): the table server sets one on each client's
// socket, so a blocking send that returns EAGAIN has already waited that long for a client that
// does not read its answer.
bool has_send_timeout(int fd) {
  timeval tv{};
  socklen_t len = sizeof tv;
  return ::getsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, &len) == 0 && (tv.tv_sec > 0 || tv.tv_usec > 0);
}

// Send all of p[0..n): false on an error, or when a socket with a send timeout made no progress
// within it (the caller closes the connection: a client that stops reading holds no buffer for
// longer than that).
bool send_all(int fd, const uint8_t *p, size_t n) {
  while (n) {
    ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r > 0) { p += r; n -= size_t(r); continue; }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (has_send_timeout(fd)) return false;
      pollfd pf{fd, POLLOUT, 0};
      ::poll(&pf, 1, 1000);
      continue;
    }
    return false;
  }
  return true;
}

struct Table {
  uint8_t ident[32];
  uint32_t layer;
  uint64_t rows;
  const uint8_t *w;
  const uint8_t *s;
};

class ServerCore {
 public:
  std::vector<Table> tables;
  std::vector<py::object> keep;  // the numpy arrays backing the tables
  std::vector<uint8_t> hello;
  std::atomic<bool> stopping{false};
  // Busy-poll budget of a client thread waiting for the next request header (ns; 0 = block at
  // once): DSV41_TRANSPORT_SERVER_SPIN_US, set by RowServer before it accepts.
  std::atomic<int64_t> spin_ns{0};
  std::atomic<uint64_t> requests{0}, rows_served{0}, lat_sum_ns{0};
  std::atomic<uint64_t> refusals[ST_COUNT];
  std::atomic<uint64_t> buckets[kNBuckets + 1];

  ServerCore() {
    for (auto &r : refusals) r = 0;
    for (auto &b : buckets) b = 0;
  }

  void add_table(py::bytes ident, uint32_t layer, py::array_t<uint8_t, py::array::c_style> w,
                 py::array_t<uint8_t, py::array::c_style> s) {
    std::string id = ident;
    if (id.size() != 32) throw std::invalid_argument("identity must be 32 bytes");
    if (w.ndim() != 2 || w.shape(1) != (py::ssize_t)kW || s.ndim() != 2 || s.shape(1) != (py::ssize_t)kS ||
        w.shape(0) != s.shape(0))
      throw std::invalid_argument("weight must be uint8[rows,256] and scale uint8[rows,8]");
    Table t;
    std::memcpy(t.ident, id.data(), 32);
    t.layer = layer;
    t.rows = uint64_t(w.shape(0));
    t.w = w.data();
    t.s = s.data();
    tables.push_back(t);
    keep.push_back(w);
    keep.push_back(s);
    size_t o = hello.size();
    hello.resize(o + 48);
    std::memcpy(&hello[o], t.ident, 32);
    wr<uint32_t>(&hello[o + 32], layer);
    wr<uint64_t>(&hello[o + 36], t.rows);
    wr<uint32_t>(&hello[o + 44], uint32_t(kRow));
  }

  const Table *find(const uint8_t *id) const {
    for (auto &t : tables)
      if (std::memcmp(t.ident, id, 32) == 0) return &t;
    return nullptr;
  }

  py::dict stats() const {
    py::dict d;
    d["requests"] = requests.load();
    d["rows"] = rows_served.load();
    d["latency_sum"] = double(lat_sum_ns.load()) * 1e-9;
    py::list b;
    for (auto &x : buckets) b.append(x.load());
    d["latency_buckets"] = b;
    py::dict r;
    for (int i = 0; i < ST_COUNT; i++)
      if (refusals[i]) r[py::int_(i)] = refusals[i].load();
    d["refusals"] = r;
    return d;
  }

  void observe(double sec, uint64_t n) {
    requests++;
    rows_served += n;
    lat_sum_ns += uint64_t(sec * 1e9);
    int i = 0;
    while (i < kNBuckets && sec > kBuckets[i]) i++;
    buckets[i]++;
  }
};

class Connection {
 public:
  Connection(ServerCore &core, int fd, bool nixl) : core_(core), fd_(fd), nixl_(nixl) {}

  // Serve until the peer closes, a fatal frame arrives (None), or an op Python must handle
  // arrives: returns (op, request_id, count, payload bytes).
  py::object run() {
    uint16_t op = 0;
    uint64_t rid = 0;
    uint32_t count = 0;
    bool handoff = false;
    {
      py::gil_scoped_release nogil;
      handoff = loop(op, rid, count);
    }
    if (!handoff) return py::none();
    return py::make_tuple(op, rid, count, py::bytes(reinterpret_cast<const char *>(pp_), plen_));
  }

  // Send a reply prepared by Python (the NIXL handshake) in the handed-off request's version;
  // false if the peer is gone.
  bool reply(uint16_t status, uint64_t rid, uint32_t count, py::bytes body) {
    std::string b = body;
    std::vector<uint8_t> buf(kRep + b.size());
    pack_rep(buf.data(), ver_, status, rid, count, uint32_t(b.size()));
    std::memcpy(buf.data() + kRep, b.data(), b.size());
    if (status != ST_OK && status < ST_COUNT) core_.refusals[status]++;
    py::gil_scoped_release nogil;
    return send_all(fd_, buf.data(), buf.size());
  }

 private:
  struct Seg {
    const Table *t;
    const uint8_t *ids;  // u64 little-endian
    uint32_t n;
  };
  ServerCore &core_;
  int fd_;
  bool nixl_;
  uint16_t ver_ = kVersion;  // version of the request being answered (replies echo it)
  uint8_t hdr_[kReq];
  std::vector<uint8_t> payload_;  // a payload larger than rbuf_
  const uint8_t *pp_ = nullptr;   // the current request's payload (in rbuf_ or payload_)
  size_t plen_ = 0;
  // Receive buffer: one recv takes a request's header and its payload together (and whatever
  // the client pipelined after them), so a decode request costs one recv, not two.
  static constexpr size_t kRbuf = 64 * 1024;
  std::vector<uint8_t> rbuf_ = std::vector<uint8_t>(kRbuf);
  size_t rpos_ = 0, rend_ = 0;  // unread bytes: rbuf_[rpos_, rend_)

  // At least `need` (<= kRbuf) unread bytes in rbuf_; false on EOF or error.  It first
  // busy-polls a non-blocking recv for up to spin_ns, then blocks: a request arriving inside the
  // budget finds the thread running instead of paying a thread wake-up (tens of us on a KVM
  // guest, docs/benchmarks.md).  Every failed try yields the CPU (sched_yield): when the
  // client's thread is runnable on this CPU it runs at once instead of waiting out the spin
  // (the same-vCPU case of a 2-vCPU host); alone on its CPU the yield returns at once.  A
  // shutdown(SHUT_RD) by RowServer.stop ends the spin like the blocking read (recv returns 0).
  bool fill(size_t need, int64_t spin_ns) {
    if (rend_ - rpos_ >= need) return true;
    if (rpos_ == rend_) rpos_ = rend_ = 0;
    if (rpos_ + need > kRbuf) {  // make room at the end
      std::memmove(rbuf_.data(), rbuf_.data() + rpos_, rend_ - rpos_);
      rend_ -= rpos_;
      rpos_ = 0;
    }
    int64_t until = spin_ns > 0 ? now_ns() + spin_ns : 0;
    while (rend_ - rpos_ < need) {
      bool spinning = until && now_ns() < until;
      ssize_t r = ::recv(fd_, rbuf_.data() + rend_, kRbuf - rend_, spinning ? MSG_DONTWAIT : 0);
      if (r > 0) { rend_ += size_t(r); continue; }
      if (r == 0) return false;
      if (errno == EINTR) continue;
      if (spinning && (errno == EAGAIN || errno == EWOULDBLOCK)) { ::sched_yield(); continue; }
      return false;
    }
    return true;
  }

  // The current request's payload of plen bytes: in rbuf_ when it fits, else in payload_ (what
  // rbuf_ holds of it, then the rest read straight into payload_).  Sets pp_; false on EOF/error.
  bool take_payload(size_t plen) {
    if (plen <= kRbuf) {
      if (!fill(plen, 0)) return false;
      pp_ = rbuf_.data() + rpos_;
      rpos_ += plen;
      return true;
    }
    if (payload_.size() < plen) payload_.resize(plen);
    size_t have = rend_ - rpos_;  // < plen: every buffered byte belongs to this payload
    std::memcpy(payload_.data(), rbuf_.data() + rpos_, have);
    rpos_ = rend_ = 0;
    pp_ = payload_.data();
    return recv_all(fd_, payload_.data() + have, plen - have);
  }
  std::vector<uint8_t> gather_;
  std::vector<Seg> segs_;

  bool refuse(uint16_t st, uint64_t rid) {
    core_.refusals[st]++;
    uint8_t h[kRep];
    pack_rep(h, ver_, st, rid, 0, 0);
    return send_all(fd_, h, kRep);
  }

  bool loop(uint16_t &op_out, uint64_t &rid_out, uint32_t &count_out) {
    for (;;) {
      if (!fill(kReq, core_.spin_ns.load(std::memory_order_relaxed))) return false;
      std::memcpy(hdr_, rbuf_.data() + rpos_, kReq);
      rpos_ += kReq;
      auto t0 = std::chrono::steady_clock::now();
      uint32_t magic = rd<uint32_t>(hdr_);
      uint16_t ver = rd<uint16_t>(hdr_ + 4), op = rd<uint16_t>(hdr_ + 6);
      uint64_t rid = rd<uint64_t>(hdr_ + 8);
      const uint8_t *ident = hdr_ + 16;
      uint32_t count = rd<uint32_t>(hdr_ + 48), plen = rd<uint32_t>(hdr_ + 52);
      ver_ = kVersion;
      if (magic != kMagic) { refuse(ST_BAD_MAGIC, rid); return false; }
      // bad_version carries the newest version this server speaks in its header
      if (ver < kVersion || ver > kMaxVersion) { ver_ = kMaxVersion; refuse(ST_BAD_VERSION, rid); return false; }
      ver_ = ver;
      if (plen > kMaxPayload) { refuse(ST_OVERSIZE, rid); return false; }
      plen_ = plen;
      if (!take_payload(plen)) return false;
      if (core_.stopping.load()) { if (!refuse(ST_SHUTTING_DOWN, rid)) return false; continue; }
      bool ok = true;
      switch (op) {
        case OP_LOOKUP: ok = lookup(rid, ident, count, t0); break;
        case OP_LOOKUP_MULTI:
          ok = ver >= 2 ? lookup_multi(rid, count, t0) : refuse(ST_UNKNOWN_OP, rid);  // as a v1 server would
          break;
        case OP_HELLO: {
          std::vector<uint8_t> b(kRep + core_.hello.size());
          pack_rep(b.data(), ver_, ST_OK, rid, uint32_t(core_.tables.size()), uint32_t(core_.hello.size()));
          if (!core_.hello.empty()) std::memcpy(b.data() + kRep, core_.hello.data(), core_.hello.size());
          ok = send_all(fd_, b.data(), b.size());
          break;
        }
        case OP_PING: {
          uint8_t h[kRep];
          pack_rep(h, ver_, ST_OK, rid, 0, 0);
          ok = send_all(fd_, h, kRep);
          break;
        }
        case OP_NIXL_HELLO:
          if (!nixl_) { ok = refuse(ST_NOT_SUPPORTED, rid); break; }
          op_out = op; rid_out = rid; count_out = count;
          return true;
        default: ok = refuse(ST_UNKNOWN_OP, rid);
      }
      if (!ok) return false;
    }
  }

  bool in_range(const Seg &g) const {
    for (uint32_t i = 0; i < g.n; i++)
      if (rd<uint64_t>(g.ids + 8 * size_t(i)) >= g.t->rows) return false;
    return true;
  }

  bool lookup(uint64_t rid, const uint8_t *ident, uint32_t count, std::chrono::steady_clock::time_point t0) {
    const Table *t = core_.find(ident);
    if (!t) return refuse(ST_WRONG_IDENTITY, rid);
    if (uint64_t(count) * 8 != plen_) return refuse(ST_BAD_FRAME, rid);
    segs_.assign(1, Seg{t, pp_, count});
    if (!in_range(segs_[0])) return refuse(ST_OUT_OF_RANGE, rid);
    return serve(rid, count, t0);
  }

  // Version 2: `nseg` segment headers (identity, count, reserved 0), then every segment's ids.
  bool lookup_multi(uint64_t rid, uint32_t nseg, std::chrono::steady_clock::time_point t0) {
    if (nseg == 0 || nseg > kMaxSegs || plen_ < size_t(nseg) * kSeg) return refuse(ST_BAD_FRAME, rid);
    const uint8_t *p = pp_;
    uint64_t total = 0;
    for (uint32_t k = 0; k < nseg; k++) {
      if (rd<uint32_t>(p + k * kSeg + 36) != 0) return refuse(ST_BAD_FRAME, rid);
      total += rd<uint32_t>(p + k * kSeg + 32);
    }
    if (size_t(nseg) * kSeg + total * 8 != plen_) return refuse(ST_BAD_FRAME, rid);
    segs_.clear();
    const uint8_t *ids = p + size_t(nseg) * kSeg;
    for (uint32_t k = 0; k < nseg; k++) {
      const Table *t = core_.find(p + k * kSeg);
      if (!t) return refuse(ST_WRONG_IDENTITY, rid);
      uint32_t n = rd<uint32_t>(p + k * kSeg + 32);
      segs_.push_back(Seg{t, ids, n});
      ids += 8 * size_t(n);
    }
    for (auto &g : segs_)
      if (!in_range(g)) return refuse(ST_OUT_OF_RANGE, rid);
    return serve(rid, uint32_t(total), t0);
  }

  // Gather the rows of segs_ (in order) and stream them after an OK header, kGatherChunk rows
  // per send.
  bool serve(uint64_t rid, uint32_t total, std::chrono::steady_clock::time_point t0) {
    size_t first = total < kGatherChunk ? total : kGatherChunk;
    if (gather_.size() < kRep + first * kRow) gather_.resize(kRep + first * kRow);
    pack_rep(gather_.data(), ver_, ST_OK, rid, total, uint32_t(uint64_t(total) * kRow));
    size_t fill = 0;           // rows gathered into the current chunk
    bool header_pending = true;  // the header rides in the first chunk's send
    auto flush = [&]() {
      size_t skip = header_pending ? 0 : kRep;
      bool ok = send_all(fd_, gather_.data() + skip, kRep - skip + fill * kRow);
      header_pending = false;
      fill = 0;
      return ok;
    };
    for (auto &g : segs_) {
      const Table *t = g.t;
      for (uint32_t i = 0; i < g.n; i++) {
        if (i + kPrefetch < g.n) {  // random rows: hide the cache/TLB misses of rows ahead
          uint64_t q = rd<uint64_t>(g.ids + 8 * size_t(i + kPrefetch));
          const uint8_t *wq = t->w + q * kW;
          __builtin_prefetch(wq);
          __builtin_prefetch(wq + 64);
          __builtin_prefetch(wq + 128);
          __builtin_prefetch(wq + 192);
          __builtin_prefetch(t->s + q * kS);
        }
        uint64_t r = rd<uint64_t>(g.ids + 8 * size_t(i));
        uint8_t *o = gather_.data() + kRep + fill * kRow;
        std::memcpy(o, t->w + r * kW, kW);
        std::memcpy(o + kW, t->s + r * kS, kS);
        if (++fill == kGatherChunk && !flush()) return false;
      }
    }
    if ((fill || header_pending) && !flush()) return false;
    core_.observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), total);
    return true;
  }
};

int send_deadline(int fd, iovec *iov, int niov, int64_t deadline) {
  while (niov) {
    ssize_t r = ::writev(fd, iov, niov);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -2;
      int64_t rem = deadline - now_ns();
      if (rem <= 0) return -1;
      pollfd pf{fd, POLLOUT, 0};
      timespec ts{time_t(rem / 1000000000LL), long(rem % 1000000000LL)};
      ::ppoll(&pf, 1, &ts, nullptr);
      continue;
    }
    size_t k = size_t(r);
    while (niov && k >= iov->iov_len) { k -= iov->iov_len; iov++; niov--; }
    if (niov) { iov->iov_base = static_cast<uint8_t *>(iov->iov_base) + k; iov->iov_len -= k; }
  }
  return 0;
}

// A destination range of a lookup's rows: bytes in request order.
struct Dest {
  uint8_t *p;
  size_t n;
};
constexpr size_t kMaxDests = 16;  // tcp.py MAX_DEST_RANGES, kMaxSegs
constexpr size_t kScratch = 4096;  // a refusal's payload limit (tcp.py _refusal)

// The reply of request `gen` (sent in a `ver` frame) that should carry `rows` rows into the
// destinations d[0..nd) (sum of n = rows * 264), received with as few recv calls as the data
// allows: each recvmsg scatters over the reply header, a 4 KiB stack scratch for the first
// bytes of the rows, then the destinations from there on, so a decode reply arriving whole
// costs one call.  The scratch keeps a refusal's payload (at most 4,096 B) out of the
// destinations ("a refusal never writes row bytes"); an OK reply's first bytes are copied from
// it (<= 4 KiB).  Returns 0 (rows written), 1 (refused: status in rcount, payload discarded) or
// the negative codes of client_lookup; -4 also for a reply longer than its header says.
// Failed tries spin (yielding, as in Connection::fill) for spin_ns, then sleep in ppoll.
int recv_reply_rows(int fd, uint64_t gen, uint16_t ver, uint64_t rows, const Dest *d, size_t nd,
                    int64_t deadline, int64_t spin_ns, uint32_t &rcount) {
  uint8_t rep[kRep];
  uint8_t scratch[kScratch];
  size_t body = size_t(rows) * kRow, head = std::min(body, kScratch);
  iovec all[2 + kMaxDests];
  size_t na = 0;
  all[na++] = {rep, kRep};
  all[na++] = {scratch, kScratch};
  size_t skip = head;  // destination bytes that go to the scratch
  for (size_t j = 0; j < nd; j++) {
    if (skip >= d[j].n) { skip -= d[j].n; continue; }
    all[na++] = {d[j].p + skip, d[j].n - skip};
    skip = 0;
  }
  size_t got = 0, need = kRep;  // need: the whole reply once its header is in
  bool parsed = false;
  uint16_t status = ST_OK;
  int64_t spin_until = now_ns() + spin_ns;
  for (;;) {
    if (!parsed && got >= kRep) {
      parsed = true;
      status = rd<uint16_t>(rep + 6);
      uint32_t rc = rd<uint32_t>(rep + 16), rplen = rd<uint32_t>(rep + 20);
      if (rd<uint32_t>(rep) != kMagic || (rd<uint16_t>(rep + 4) != ver && status != ST_BAD_VERSION)) return -4;
      if (rd<uint64_t>(rep + 8) != gen) return -3;
      if (status != ST_OK) {
        if (rplen > kScratch) return -4;
        rcount = status;
      } else {
        if (rc != rows || uint64_t(rplen) != uint64_t(body)) return -4;
        rcount = rc;
      }
      need = kRep + rplen;
    }
    if (got > need) return -4;  // bytes past the reply: no request of ours asked for them
    if (parsed && got == need) break;
    iovec iov[2 + kMaxDests];  // the part of `all` not yet filled
    size_t ni = 0, off = got;
    for (size_t j = 0; j < na; j++) {
      if (off >= all[j].iov_len) { off -= all[j].iov_len; continue; }
      iov[ni++] = {static_cast<uint8_t *>(all[j].iov_base) + off, all[j].iov_len - off};
      off = 0;
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = ni;
    ssize_t r = ::recvmsg(fd, &mh, MSG_DONTWAIT);
    if (r > 0) { got += size_t(r); continue; }
    if (r == 0) return -2;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -2;
    int64_t t = now_ns();
    if (t >= deadline) return -1;
    if (t < spin_until) { ::sched_yield(); continue; }  // yield as in Connection::fill
    pollfd pf{fd, POLLIN, 0};
    int64_t rem = deadline - t;
    timespec ts{time_t(rem / 1000000000LL), long(rem % 1000000000LL)};
    ::ppoll(&pf, 1, &ts, nullptr);
  }
  if (status != ST_OK) return 1;
  uint8_t *src = scratch;
  for (size_t j = 0; j < nd && head; j++) {  // the rows' first bytes, from the scratch
    size_t c = std::min(head, d[j].n);
    std::memcpy(d[j].p, src, c);
    src += c;
    head -= c;
  }
  return 0;
}

// One lookup on a non-blocking connected socket.  Returns (code, reply_count, reply_plen):
// code 0 = rows written; 1 = refused (status in reply_count's place, payload discarded);
// -1 = timeout; -2 = transport error; -3 = generation mismatch; -4 = malformed reply.
// On any negative code the caller must close the socket.
py::tuple client_lookup(int fd, uint64_t gen, py::bytes ident, py::array_t<uint64_t, py::array::c_style> rows,
                        py::list dests, int64_t timeout_ns, int64_t spin_ns) {
  std::string id = ident;
  if (id.size() != 32) throw std::invalid_argument("identity must be 32 bytes");
  uint32_t n = uint32_t(rows.shape(0));
  if (dests.size() > kMaxDests) throw std::invalid_argument("at most 16 destination ranges");
  Dest out[kMaxDests];
  size_t nd = 0;
  for (auto h : dests) {
    auto a = py::reinterpret_borrow<py::array_t<uint8_t, py::array::c_style>>(h);
    out[nd++] = Dest{a.mutable_data(), size_t(a.nbytes())};
  }
  const uint8_t *rp = reinterpret_cast<const uint8_t *>(rows.data());
  int code = 0;
  uint32_t rcount = 0, rplen = 0;
  {
    py::gil_scoped_release nogil;
    int64_t deadline = now_ns() + timeout_ns;
    uint8_t h[kReq];
    wr<uint32_t>(h, kMagic); wr<uint16_t>(h + 4, kVersion); wr<uint16_t>(h + 6, OP_LOOKUP);
    wr<uint64_t>(h + 8, gen); std::memcpy(h + 16, id.data(), 32);
    wr<uint32_t>(h + 48, n); wr<uint32_t>(h + 52, n * 8);
    iovec iov[2] = {{h, kReq}, {const_cast<uint8_t *>(rp), size_t(n) * 8}};
    code = send_deadline(fd, iov, n ? 2 : 1, deadline);
    if (code == 0) code = recv_reply_rows(fd, gen, kVersion, n, out, nd, deadline, spin_ns, rcount);
    if (code == 0) rplen = uint32_t(size_t(n) * kRow);
  }
  return py::make_tuple(code, rcount, rplen);
}

// The reply in progress on a non-blocking socket, read without blocking (client_lookup_many's
// pipeline and the C++ core's request stream): its header, then `c` rows straight into `rows`.
struct ReplyReader {
  enum { NONE, SOME, DONE, FAIL };
  uint8_t rep[kRep];
  size_t rgot = 0;          // bytes of the current reply (header then rows) received
  bool in_payload = false;
  // One recv for the reply to request `gen` of `c` rows: NONE (nothing there), SOME (bytes in,
  // the reply not complete), DONE (the reply complete; ready for the next), FAIL (`code` set to
  // the codes of client_lookup, a refusal's status in `status`; the caller closes the socket).
  int read(int fd, uint8_t *rows, uint32_t c, uint64_t gen, int &code, uint32_t &status) {
    uint8_t *dst;
    size_t want;
    if (!in_payload) { dst = rep + rgot; want = kRep - rgot; }
    else { dst = rows + rgot; want = size_t(c) * kRow - rgot; }
    const ssize_t r = ::recv(fd, dst, want, MSG_DONTWAIT);
    if (r == 0) { code = -2; return FAIL; }
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return NONE;
      code = -2;
      return FAIL;
    }
    rgot += size_t(r);
    if (!in_payload && rgot == kRep) {
      const uint16_t st = rd<uint16_t>(rep + 6);
      if (rd<uint32_t>(rep) != kMagic || rd<uint16_t>(rep + 4) != kVersion) { code = -4; return FAIL; }
      if (rd<uint64_t>(rep + 8) != gen) { code = -3; return FAIL; }
      if (st != ST_OK) { code = 1; status = st; return FAIL; }
      if (rd<uint32_t>(rep + 16) != c || uint64_t(rd<uint32_t>(rep + 20)) != uint64_t(c) * kRow) { code = -4; return FAIL; }
      in_payload = c != 0;
      rgot = 0;
      return c == 0 ? DONE : SOME;
    }
    if (in_payload && rgot == size_t(c) * kRow) {
      in_payload = false;
      rgot = 0;
      return DONE;
    }
    return SOME;
  }
};

// What can be sent of one lookup request (its kReq-byte header `hdr`, then `plen` bytes of ids)
// from byte `off` on, without blocking: the bytes sent, -1 when the socket would block
// (EAGAIN, EINTR), -2 on an error (the caller closes the socket).
ssize_t send_request_part(int fd, const uint8_t *hdr, const uint8_t *ids, size_t plen, size_t off) {
  iovec iov[2];
  int niov = 0;
  if (off < kReq) {
    iov[niov++] = {const_cast<uint8_t *>(hdr) + off, kReq - off};
    iov[niov++] = {const_cast<uint8_t *>(ids), plen};
  } else {
    iov[niov++] = {const_cast<uint8_t *>(ids) + (off - kReq), plen - (off - kReq)};
  }
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = niov;
  const ssize_t r = ::sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (r < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? -1 : -2;
  return r;
}

// The body of client_lookup_many without the GIL (also the C++ worker core's prefill pieces):
// returns the code, the refusal status in `status` and the reply index reached in `recv_idx`.
int lookup_many_nogil(int fd, uint64_t gen0, const char *ident, const uint8_t *rp, size_t n, uint8_t *op,
                      uint32_t chunk, uint32_t window, int64_t timeout_ns, int64_t spin_ns, int64_t end_ns,
                      uint32_t &status, size_t &recv_idx) {
  size_t nchunks = (n + chunk - 1) / chunk;
  int code = 0;
  status = 0;
  recv_idx = 0;
  {
    std::vector<uint8_t> hdrs(nchunks * kReq);
    for (size_t k = 0; k < nchunks; k++) {
      uint8_t *h = &hdrs[k * kReq];
      uint32_t c = uint32_t(std::min<size_t>(chunk, n - k * chunk));
      wr<uint32_t>(h, kMagic); wr<uint16_t>(h + 4, kVersion); wr<uint16_t>(h + 6, OP_LOOKUP);
      wr<uint64_t>(h + 8, gen0 + k); std::memcpy(h + 16, ident, 32);
      wr<uint32_t>(h + 48, c); wr<uint32_t>(h + 52, c * 8);
    }
    size_t send_idx = 0, send_off = 0;  // bytes of chunk send_idx already sent
    ReplyReader reply;
    auto budget = [&]() { int64_t d = now_ns() + timeout_ns; return end_ns > 0 && end_ns < d ? end_ns : d; };
    int64_t deadline = budget();
    int64_t spin_until = now_ns() + spin_ns;
    while (recv_idx < nchunks && code == 0) {
      bool progressed = false;
      while (send_idx < nchunks && send_idx - recv_idx < window) {
        size_t c = std::min<size_t>(chunk, n - send_idx * chunk);
        const size_t plen = c * 8;
        const ssize_t r = send_request_part(fd, &hdrs[send_idx * kReq], rp + send_idx * chunk * 8, plen, send_off);
        if (r == -1) break;
        if (r < 0) { code = -2; break; }
        progressed = progressed || r > 0;
        send_off += size_t(r);
        if (send_off == kReq + plen) { send_idx++; send_off = 0; }
      }
      if (code) break;
      // receive whatever is there for the reply in progress
      for (;;) {
        const size_t c = std::min<size_t>(chunk, n - recv_idx * chunk);
        const int got = reply.read(fd, op + recv_idx * chunk * kRow, uint32_t(c), gen0 + recv_idx, code, status);
        if (got == ReplyReader::NONE || got == ReplyReader::FAIL) break;
        progressed = true;
        if (got == ReplyReader::DONE) {
          recv_idx++;
          deadline = budget();  // next reply: its own full budget, within the whole-call deadline
          if (recv_idx == nchunks) break;
          if (send_idx < nchunks && send_idx - recv_idx < window) break;  // go send the next request
        }
      }
      if (code || recv_idx == nchunks) break;
      if (progressed) { spin_until = now_ns() + spin_ns; continue; }
      int64_t t = now_ns();
      if (t >= deadline) { code = -1; break; }
      if (t < spin_until) { ::sched_yield(); continue; }  // yield as in Connection::fill
      pollfd pf{fd, short(POLLIN | (send_idx < nchunks && send_idx - recv_idx < window ? POLLOUT : 0)), 0};
      int64_t rem = deadline - t;
      timespec ts{time_t(rem / 1000000000LL), long(rem % 1000000000LL)};
      ::ppoll(&pf, 1, &ts, nullptr);
    }
  }
  return code;
}

// Pipelined lookup of many rows: requests of `chunk` rows, up to `window` in flight, replies
// received in order straight into `out` (uint8[N,264]).  Each reply must arrive within
// `timeout_ns` of the previous one (the same budget a sequential request would get), and every
// reply by `end_ns` (absolute CLOCK_MONOTONIC ns, the caller's whole-call deadline; 0 = none).
// Generations gen0, gen0+1, ... Returns (code, status, chunk_index) with the codes of
// client_lookup; on any code != 0 the caller must close the socket (requests may be in flight).
py::tuple client_lookup_many(int fd, uint64_t gen0, py::bytes ident, py::array_t<uint64_t, py::array::c_style> rows,
                             py::array_t<uint8_t, py::array::c_style> out, uint32_t chunk, uint32_t window,
                             int64_t timeout_ns, int64_t spin_ns, int64_t end_ns) {
  std::string id = ident;
  if (id.size() != 32) throw std::invalid_argument("identity must be 32 bytes");
  if (chunk == 0 || chunk > kMaxRows || window == 0) throw std::invalid_argument("bad chunk/window");
  size_t n = size_t(rows.shape(0));
  if (out.ndim() != 2 || size_t(out.shape(0)) != n || out.shape(1) != (py::ssize_t)kRow)
    throw std::invalid_argument("out must be uint8[N,264]");
  const uint8_t *rp = reinterpret_cast<const uint8_t *>(rows.data());
  uint8_t *op = out.mutable_data();
  int code = 0;
  uint32_t status = 0;
  size_t recv_idx = 0;
  {
    py::gil_scoped_release nogil;
    code = lookup_many_nogil(fd, gen0, id.data(), rp, n, op, chunk, window, timeout_ns, spin_ns, end_ns, status,
                             recv_idx);
  }
  return py::make_tuple(code, status, recv_idx);
}

// One lookup request of k segments (their ids checked by the caller) on a non-blocking
// connected socket, without the GIL: the codes of client_lookup (0 rows written, 1 refused with
// the status in rcount, negative: the caller must close the socket).
struct CSeg { const char *ident; const uint8_t *ids; uint8_t *out; size_t n; };
int lookup_segs_nogil(int fd, uint64_t gen, uint16_t version, const CSeg *cs, size_t k, size_t total,
                      int64_t timeout_ns, int64_t spin_ns, uint32_t &rcount) {
  int64_t deadline = now_ns() + timeout_ns;
  uint8_t h[kReq + kMaxSegs * kSeg];
  iovec iov[1 + kMaxSegs];
  int niov = 0;
  uint16_t ver = k == 1 ? kVersion : version;
  size_t hlen = kReq;
  wr<uint32_t>(h, kMagic); wr<uint16_t>(h + 4, ver); wr<uint64_t>(h + 8, gen);
  if (k == 1) {
    wr<uint16_t>(h + 6, OP_LOOKUP);
    std::memcpy(h + 16, cs[0].ident, 32);
    wr<uint32_t>(h + 48, uint32_t(total)); wr<uint32_t>(h + 52, uint32_t(total * 8));
  } else {
    wr<uint16_t>(h + 6, OP_LOOKUP_MULTI);
    std::memset(h + 16, 0, 32);
    wr<uint32_t>(h + 48, uint32_t(k)); wr<uint32_t>(h + 52, uint32_t(k * kSeg + total * 8));
    for (size_t j = 0; j < k; j++) {
      uint8_t *g = h + kReq + j * kSeg;
      std::memcpy(g, cs[j].ident, 32);
      wr<uint32_t>(g + 32, uint32_t(cs[j].n)); wr<uint32_t>(g + 36, 0);
    }
    hlen += k * kSeg;
  }
  iov[niov++] = {h, hlen};
  for (size_t j = 0; j < k; j++)
    if (cs[j].n) iov[niov++] = {const_cast<uint8_t *>(cs[j].ids), cs[j].n * 8};
  int code = send_deadline(fd, iov, niov, deadline);
  Dest out[kMaxSegs];
  for (size_t j = 0; j < k; j++) out[j] = Dest{cs[j].out, cs[j].n * kRow};
  if (code == 0) code = recv_reply_rows(fd, gen, ver, total, out, k, deadline, spin_ns, rcount);
  return code;
}

// The engine's lookup: rows of one or more tables in one request, straight into caller buffers.
// `segs`: a tuple of (identity bytes[32], rows, row_limit, out) with rows a 1-D C-contiguous
// int64/uint64 array and out a writable C-contiguous uint8[len(rows), 264] array.  Checks run
// here (O(1) Python per call): returns (2, k, 0) when segment k's rows are not such an array
// (the caller converts and retries), (3, k, i) when id i of segment k is outside [0, row_limit)
// (nothing sent), (4, k, 0) for a bad out.  One segment goes as a version-1 OP_LOOKUP (every
// server speaks it); several as one OP_LOOKUP_MULTI in a `version` (>= 2) frame.  Otherwise
// the codes of client_lookup: (0, total, 0) rows written; (1, status, 0) refused; negative:
// the caller must close the socket.  More than `max_rows` rows in all: (2, 0, 0), nothing sent.
py::tuple client_lookup_segs(int fd, uint64_t gen, uint16_t version, py::tuple segs, int64_t timeout_ns,
                             int64_t spin_ns, uint64_t max_rows) {
  size_t k = segs.size();
  if (k == 0 || k > kMaxSegs) throw std::invalid_argument("1..16 segments");
  if (k > 1 && version < 2) throw std::invalid_argument("several tables per request need protocol version 2");
  CSeg cs[kMaxSegs];
  size_t total = 0;
  for (size_t j = 0; j < k; j++) {
    PyObject *t = PyTuple_GET_ITEM(segs.ptr(), j);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) throw std::invalid_argument("segment must be (ident, rows, limit, out)");
    PyObject *id = PyTuple_GET_ITEM(t, 0);
    if (!PyBytes_Check(id) || PyBytes_GET_SIZE(id) != 32) throw std::invalid_argument("identity must be 32 bytes");
    py::handle rh(PyTuple_GET_ITEM(t, 1)), oh(PyTuple_GET_ITEM(t, 3));
    if (!py::isinstance<py::array>(rh)) return py::make_tuple(2, j, 0);
    auto r = py::reinterpret_borrow<py::array>(rh);
    char kind = r.dtype().kind();
    if (r.ndim() != 1 || r.itemsize() != 8 || (kind != 'i' && kind != 'u') ||
        !(r.flags() & py::array::c_style))
      return py::make_tuple(2, j, 0);
    size_t n = size_t(r.shape(0));
    if (!py::isinstance<py::array>(oh)) return py::make_tuple(4, j, 0);
    auto o = py::reinterpret_borrow<py::array>(oh);
    if (o.ndim() != 2 || size_t(o.shape(0)) != n || o.shape(1) != (py::ssize_t)kRow || o.itemsize() != 1 ||
        o.dtype().kind() != 'u' || !(o.flags() & py::array::c_style) || !o.writeable())
      return py::make_tuple(4, j, 0);
    uint64_t limit = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 2));
    if (limit == uint64_t(-1) && PyErr_Occurred()) throw py::error_already_set();
    const uint8_t *ids = static_cast<const uint8_t *>(r.data());
    for (size_t i = 0; i < n; i++)  // a negative int64 is >= limit as u64
      if (rd<uint64_t>(ids + 8 * i) >= limit) return py::make_tuple(3, j, i);
    cs[j] = CSeg{PyBytes_AS_STRING(id), ids, static_cast<uint8_t *>(o.mutable_data()), n};
    total += n;
  }
  if (total > max_rows) return py::make_tuple(2, 0, 0);  // the caller's large-lookup path
  if (total > kMaxRows) throw std::invalid_argument("at most 1 Mi rows per request");
  int code = 0;
  uint32_t rcount = 0;
  {
    py::gil_scoped_release nogil;
    code = lookup_segs_nogil(fd, gen, version, cs, k, total, timeout_ns, spin_ns, rcount);
  }
  return py::make_tuple(code, rcount, 0);
}

// The vLLM overlay's mask + plan of one rank's ids (dsv41/overlay/engram_ops.py plan_into, which
// holds the numpy equivalent, tested to give identical selectors and fetch lists): an id in
// [lo, hi) gets sel = its position in the fetch list and is appended to it, any other id
// (-1, padded heads, other ranks' rows) sel = -1, a zero row in vLLM's kernel. Runs without the
// GIL for large inputs, so the overlay's worker does not hold up the launching thread there.
// plan_rows' arithmetic on ids[r0, r1), branch-free (random ids make a branch on ownership
// unpredictable: pass H measured about 3.6 ns per id with it): sel[i] = the id's position in the
// piece's fetch list or -1, fetch[0, n) the owned ids in order; returns n. fetch[n] is written
// before n is known to grow, which stays inside [0, r1 - r0). `bad` is set when an owned id is
// at or past `limit` (the table's row count). `sel_off` is added to every owned id's selector:
// a span planned after `sel_off` owned ids of the same piece (its fetch list then starts there).
static inline int64_t plan_span(const int64_t *ids, int64_t r0, int64_t r1, int64_t lo, int64_t hi, uint64_t limit,
                                int32_t *sel, int64_t *fetch, bool &bad, int32_t sel_off = 0) {
  if (hi <= lo) {
    for (int64_t i = r0; i < r1; i++) sel[i] = -1;
    return 0;
  }
  // lo <= v < hi as one unsigned compare (mod 2^64): v - lo < hi - lo
  const uint64_t ulo = uint64_t(lo), width = uint64_t(hi) - ulo;
  int64_t n = 0;
  uint64_t over = 0;
  for (int64_t i = r0; i < r1; i++) {
    const int64_t v = ids[i];
    const int64_t own = int64_t(uint64_t(v) - ulo < width);
    sel[i] = own ? int32_t(n) + sel_off : -1;
    fetch[n] = v;
    over |= uint64_t(own) & uint64_t(uint64_t(v) >= limit);
    n += own;
  }
  bad = bad || over;
  return n;
}

constexpr ssize_t kPlanNoGil = 16384;
int64_t plan_rows(py::array_t<int64_t, py::array::c_style> ids, int64_t lo, int64_t hi,
                  py::array_t<int32_t, py::array::c_style> sel, py::array_t<int64_t, py::array::c_style> fetch) {
  const ssize_t r = ids.size();
  if (sel.size() < r || fetch.size() < r) throw std::invalid_argument("plan_rows: sel and fetch need ids.size() entries");
  if (r > INT32_MAX) throw std::invalid_argument("plan_rows: more than 2^31 ids");
  const int64_t *p = ids.data();
  int32_t *s = sel.mutable_data();
  int64_t *f = fetch.mutable_data();
  int64_t n = 0;
  {
    // a decode step's ids (about a thousand) take microseconds: releasing the GIL would only add a
    // re-acquisition, which can wait for the launching thread's next release
    std::optional<py::gil_scoped_release> nogil;
    if (r >= kPlanNoGil) nogil.emplace();
    bool bad = false;
    n = plan_span(p, 0, r, lo, hi, UINT64_MAX, s, f, bad);
  }
  return n;
}

// ---- the vLLM overlay's Engram worker core (dsv41/overlay/engram_worker.py, issue 23 pass F) ----
// The rank's worker thread runs EngramCore::next() with the GIL released: it waits for a job
// (a condition variable; the launching thread's submit notifies it), waits on the job's ids event
// (cuEventSynchronize), takes the step's other Engram layer when it is due (coalescing, as the
// Python worker), plans and masks every layer (plan_rows' arithmetic), fetches them in one request
// on the connection the row source lent (RemoteRowSource.native_lease), launches each layer's
// captured launch graph (cuGraphLaunch) and records its done event (cuEventRecord) on the job's
// stream, and hands each layer off (EngramSlot::handoff), all without Python. It returns to
// Python only for what Python does: a job it may not serve (no lent connection, a piece larger
// than one request, an id past the table), a launch without a graph (Python launches eagerly and
// captures), a failed request (Python serves the exact local rows or raises in required mode), a
// failed CUDA call, a report, a retire. A multi-piece (prefill) job is served alone, in order, by
// serve_pieces (issue 23 pass H).

// CUDA driver entry points from libcuda.so.1, loaded at first use (the extension links no CUDA
// library; on a host without one the core never calls CUDA: every handle is 0 there).
struct CudaDriver {
  int (*event_sync)(void *) = nullptr;
  int (*event_record)(void *, void *) = nullptr;
  int (*graph_launch)(void *, void *) = nullptr;
  int (*stream_wait_event)(void *, void *, unsigned) = nullptr;  // optional (EngramSlot::wait_stream)
  // optional, the GPU-side join (issue 23 pass O): the _v2 stream memory operations, host-mapped
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
    r.host_dev_ptr = reinterpret_cast<int (*)(uint64_t *, void *, unsigned)>(::dlsym(h, "cuMemHostGetDevicePointer_v2"));
    r.ctx_current = reinterpret_cast<int (*)(void **)>(::dlsym(h, "cuCtxGetCurrent"));
    r.device_get = reinterpret_cast<int (*)(int *, int)>(::dlsym(h, "cuDeviceGet"));
    r.device_attribute = reinterpret_cast<int (*)(int *, int, int)>(::dlsym(h, "cuDeviceGetAttribute"));
    r.driver_version = reinterpret_cast<int (*)(int *)>(::dlsym(h, "cuDriverGetVersion"));
    r.ok = r.event_sync && r.event_record && r.graph_launch;
    return r;
  }();
  return d;
}

// Whether the GPU-side join (issue 23 pass O) can run on CUDA device `ordinal`: the _v2 stream
// memory operations and host-mapped memory resolve on a driver of CUDA 11.7 or later (NVIDIA's
// driver API: the V2 entry points are "available by default on all platforms"), else the device
// reports the v1 64-bit operations (attribute 93; on the H200 with driver 580 it read 0 while
// cuStreamWaitValue64_v2 worked, pass N). False without the driver or an entry point.
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

// A table's exact local rows for the GPU-side join's fallback (issue 23 pass O): the shard file
// kept open and read with pread (dsv41.engram.manifest.TableEntry regions: weight_offset + id * 256
// and scale_offset + id * 8, the bytes LocalRowReader.read packs), so a fallback fills rows with
// no GIL, no CUDA call, no Python reader. Not a MAP_SHARED mapping: a shard truncated under the
// running worker would SIGBUS it at the first row past the new end; a short pread is an error.
// gather() writes n packed 264-byte rows of the ids in `ids` (each in [0, rows): the caller's
// plan guarantees it) and returns false (the piece counted bad) when an id is past the table, a
// read comes back short, or the file is no longer the one opened (size or modification time
// changed: rewritten or truncated in place). A shard shorter than its regions is refused at
// construction (std::runtime_error).
struct LocalTable {
  int fd = -1;
  int64_t rows = 0;
  uint64_t woff = 0, soff = 0;
  off_t size = 0;
  struct timespec mtime {};
  LocalTable(const std::string &path, uint64_t weight_offset, uint64_t scale_offset, int64_t nrows) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw std::runtime_error("cannot stat " + path + ": " + std::strerror(e));
    }
    const uint64_t need = std::max(weight_offset + uint64_t(nrows) * kW, scale_offset + uint64_t(nrows) * kS);
    if (nrows <= 0 || uint64_t(st.st_size) < need) {
      ::close(fd);
      throw std::runtime_error(path + ": shorter than its table's regions (" + std::to_string(st.st_size) + " < " +
                               std::to_string(need) + " bytes)");
    }
    size = st.st_size;
    mtime = st.st_mtim;
    rows = nrows; woff = weight_offset; soff = scale_offset;
  }
  ~LocalTable() {
    if (fd >= 0) ::close(fd);
  }
  LocalTable(const LocalTable &) = delete;
  LocalTable &operator=(const LocalTable &) = delete;
  bool unchanged() const {
    struct stat st {};
    return ::fstat(fd, &st) == 0 && st.st_size == size && st.st_mtim.tv_sec == mtime.tv_sec &&
           st.st_mtim.tv_nsec == mtime.tv_nsec;
  }
  static bool read_all(int fd, uint8_t *dst, size_t n, uint64_t off) {
    while (n) {
      const ssize_t got = ::pread(fd, dst, n, off_t(off));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      dst += got; n -= size_t(got); off += uint64_t(got);
    }
    return true;
  }
  bool gather(const int64_t *ids, int64_t n, uint8_t *out) const {
    if (!unchanged()) return false;
    for (int64_t i = 0; i < n; i++) {
      const int64_t id = ids[i];
      if (id < 0 || id >= rows) return false;
      if (!read_all(fd, out + i * kRow, kW, woff + uint64_t(id) * kW) ||
          !read_all(fd, out + i * kRow + kW, kS, soff + uint64_t(id) * kS))
        return false;
    }
    return unchanged();  // changed while read: these rows may mix old and new bytes
  }
};

// One Engram table's hand-off state and staging (RemoteRows holds one): the generation handed
// off, the one abandoned (a refused hand-off: never launched, never handed off), the buffers the
// core plans and fetches into (owned and kept alive by Python), the table's identity and range,
// and its launch graphs by (rows, staged_rows address).
struct EngramSlot {
  std::mutex m;
  std::condition_variable cv;
  std::atomic<uint64_t> handed{0};
  // the generation whose last request is out (mark_tail, issue 23 pass L): its hand-off is due
  // within that request, so a join waiting for it polls instead of sleeping on the cv
  std::atomic<uint64_t> tail{0};
  std::atomic<int64_t> tail_polls{0};  // joins that polled for a hand-off after mark_tail
  // the last wait_stream's host times (CLOCK_MONOTONIC ns, launching thread only; issue 23 pass M):
  // entered, the hand-off seen, the stream wait queued, the GIL taken back; its generation
  int64_t w_enter = 0, w_seen = 0, w_queued = 0, w_gil = 0;
  uint64_t w_gen = 0;
  uint64_t current = 0, abandoned = 0;
  int64_t key = 0, lo = 0, hi = 0;
  uint64_t limit = 0;
  char ident[32] = {};
  bool has_table = false;
  const int64_t *ids = nullptr;
  uint8_t *hbuf = nullptr;
  int64_t *fetch = nullptr;
  size_t max_rows = 0;
  std::map<std::pair<int64_t, uint64_t>, void *> graphs;
  // a multi-piece job's launch graphs by (first row, rows, staged_rows address): the fixed piece
  // layout (RemoteRows._launch_piece: selectors at row r0, packed rows at max_rows*4 + r0*264)
  std::map<std::tuple<int64_t, int64_t, uint64_t>, void *> piece_graphs;
  // The GPU-side join (issue 23 pass O): 4 KiB of host-mapped pinned memory (cuMemHostAlloc
  // DEVICEMAP), word 0 the ids word (the GPU writes a job's generation there after its ids' D2H
  // copy), words kGjFlag0.. one flag per piece (the worker or the watchdog stores the job's
  // generation there once the piece's rows are in the pinned staging); their device addresses;
  // the exact local rows (set_local); counters (atomics: read by Python at any time).
  static constexpr size_t kGjFlag0 = 8, kGjWords = 512;
  uint64_t *gj_host = nullptr;
  uint64_t gj_dev = 0;
  std::shared_ptr<LocalTable> local;
  std::atomic<int64_t> gj_jobs{0}, gj_fallback_jobs{0}, gj_fallback_rows{0}, gj_takeovers{0}, gj_bad{0};
  std::atomic<uint64_t> gj_done{0};  // the last GPU-join generation whose every flag is stored

  void set_table(int64_t l, int64_t h, py::bytes id, uint64_t lim) {
    std::string b = id;
    if (b.size() != 32) throw std::invalid_argument("identity must be 32 bytes");
    std::lock_guard<std::mutex> g(m);
    lo = l; hi = h; limit = lim;
    std::memcpy(ident, b.data(), 32);
    has_table = true;
  }
  void set_buffers(uint64_t ids_p, uint64_t hbuf_p, uint64_t fetch_p, uint64_t rows) {
    std::lock_guard<std::mutex> g(m);
    ids = reinterpret_cast<const int64_t *>(ids_p);
    hbuf = reinterpret_cast<uint8_t *>(hbuf_p);
    fetch = reinterpret_cast<int64_t *>(fetch_p);
    max_rows = rows;
  }
  void set_graphs(const std::vector<std::tuple<int64_t, uint64_t, uint64_t>> &gs) {
    std::lock_guard<std::mutex> g(m);
    graphs.clear();
    for (auto &t : gs)
      if (std::get<2>(t)) graphs[{std::get<0>(t), std::get<1>(t)}] = reinterpret_cast<void *>(std::get<2>(t));
  }
  void set_piece_graphs(const std::vector<std::tuple<int64_t, int64_t, uint64_t, uint64_t>> &gs) {
    std::lock_guard<std::mutex> g(m);
    piece_graphs.clear();
    for (auto &t : gs)
      if (std::get<3>(t))
        piece_graphs[{std::get<0>(t), std::get<1>(t), std::get<2>(t)}] = reinterpret_cast<void *>(std::get<3>(t));
  }
  void *piece_graph_locked(int64_t r0, int64_t len, uint64_t out) const {
    auto it = piece_graphs.find({r0, len, out});
    return it == piece_graphs.end() ? nullptr : it->second;
  }
  void begin(uint64_t gen) {
    std::lock_guard<std::mutex> g(m);
    current = gen;
  }
  bool handoff_locked(uint64_t gen) {
    if (gen != current || gen == abandoned) return false;
    handed.store(gen, std::memory_order_release);
    cv.notify_all();
    return true;
  }
  bool handoff(uint64_t gen) {
    std::lock_guard<std::mutex> g(m);
    return handoff_locked(gen);
  }
  void abandon(uint64_t gen) {
    std::lock_guard<std::mutex> g(m);
    abandoned = gen;
  }
  bool is_abandoned(uint64_t gen) {
    std::lock_guard<std::mutex> g(m);
    return gen == abandoned;
  }
  // ---- the GPU-side join (issue 23 pass O) ----
  // Launching thread, with the CUDA context current: the host-mapped words (once). False when a
  // driver call is missing or fails (the table then joins on the host).
  bool gj_setup() {
    std::lock_guard<std::mutex> g(m);
    if (gj_host) return true;
    const CudaDriver &cu = cuda_driver();
    void *ctx = nullptr, *p = nullptr;
    uint64_t d = 0;
    if (!cu.host_alloc || !cu.host_dev_ptr || !cu.ctx_current || cu.ctx_current(&ctx) != 0 || !ctx) return false;
    if (cu.host_alloc(&p, kGjWords * 8, kHostAllocMapped) != 0 || !p) return false;
    std::memset(p, 0, kGjWords * 8);
    if (cu.host_dev_ptr(&d, p, 0) != 0 || !d) return false;  // 4 KiB kept: freed with the process
    gj_host = static_cast<uint64_t *>(p);
    gj_dev = d;
    return true;
  }
  // The shard's exact rows for the fallback (LocalTable; std::runtime_error when unusable).
  void set_local(const std::string &path, uint64_t weight_offset, uint64_t scale_offset, int64_t rows) {
    auto t = std::make_shared<LocalTable>(path, weight_offset, scale_offset, rows);
    std::lock_guard<std::mutex> g(m);
    local = std::move(t);
  }
  // The exact local rows where they cover the rank's range of the table (the host join's fallback
  // without Python: EngramCore::serve_batch), else nullptr.
  std::shared_ptr<LocalTable> local_rows() {
    std::lock_guard<std::mutex> g(m);
    if (!(local && has_table && lo >= 0 && hi <= local->rows && ids && hbuf && fetch)) return nullptr;
    return local;
  }
  bool gj_ready() {
    std::lock_guard<std::mutex> g(m);
    return gj_host && local && lo >= 0 && hi <= local->rows && has_table && ids && hbuf && fetch;
  }
  uint64_t ids_word() const { return __atomic_load_n(&gj_host[0], __ATOMIC_ACQUIRE); }
  // Release-store piece k's flag (the piece's rows are written before it; a flag only grows).
  void store_flag(size_t k, uint64_t gen) {
    std::atomic_thread_fence(std::memory_order_seq_cst);  // rows (recv, memcpy) before the flag
    uint64_t *f = &gj_host[kGjFlag0 + k];
    if (__atomic_load_n(f, __ATOMIC_RELAXED) < gen) __atomic_store_n(f, gen, __ATOMIC_RELEASE);
  }
  // Launching thread (RemoteRows.start): queue job `gen` of `rows` rows into `out` on `stream`,
  // whose ids' D2H copy is already queued: the ids word's write, then per piece of the fixed
  // layout (piece_layout) the wait for its flag (>= gen) and its captured piece graph, then
  // `done_event`. 1: queued; 0: nothing queued (no words, a piece graph missing, too many pieces,
  // no driver entry); -1: a driver call failed after part of it was queued (the stream then waits
  // on flags the core still stores: the caller submits the job anyway, then serves it again).
  int gj_queue(uint64_t stream, uint64_t gen, int64_t rows, uint64_t out, int64_t piece_rows, const Tails &tail_rows,
               uint64_t done_event) {
    const CudaDriver &cu = cuda_driver();
    if (!gj_host || !cu.wait_value64 || !cu.write_value64 || !cu.graph_launch || !cu.event_record || !stream ||
        !done_event || piece_rows <= 0)
      return 0;
    const auto lay = piece_layout_of(rows, piece_rows, tail_rows);
    if (lay.size() > kGjWords - kGjFlag0) return 0;
    std::vector<void *> gs;
    {
      std::lock_guard<std::mutex> g(m);
      for (auto &pc : lay) {
        void *e = piece_graph_locked(pc.first, pc.second, out);
        if (!e) return 0;
        gs.push_back(e);
      }
    }
    void *st = reinterpret_cast<void *>(stream);
    if (cu.write_value64(st, gj_dev, gen, kWriteValueDefault) != 0) return 0;
    for (size_t k = 0; k < gs.size(); k++)
      if (cu.wait_value64(st, gj_dev + (kGjFlag0 + k) * 8, gen, kWaitValueGeq) != 0 || cu.graph_launch(gs[k], st) != 0)
        return -1;
    if (cu.event_record(reinterpret_cast<void *>(done_event), st) != 0) return -1;
    return 1;
  }
  // Launching thread (RemoteRows.join of a GPU-joined job): `stream` waits on `event`, then on
  // `event2` (nonzero); 1 | 2 | 4 as wait_stream's bits (0: not queued).
  int gj_stream_waits(uint64_t stream, uint64_t event, uint64_t event2) {
    const CudaDriver &cu = cuda_driver();
    void *st = reinterpret_cast<void *>(stream);
    if (!cu.stream_wait_event || !event || cu.stream_wait_event(st, reinterpret_cast<void *>(event), 0) != 0) return 0;
    int r = 1 | 2;
    if (event2 && cu.stream_wait_event(st, reinterpret_cast<void *>(event2), 0) == 0) r |= 4;
    return r;
  }
  static std::vector<std::pair<int64_t, int64_t>> piece_layout_of(int64_t rows, int64_t piece_rows, const Tails &tail_rows);
  // Worker (core): the last request of job `gen` is about to go out; wakes a join sleeping for it.
  void mark_tail(uint64_t gen) {
    {
      std::lock_guard<std::mutex> g(m);
      tail.store(gen, std::memory_order_release);
    }
    cv.notify_all();
  }
  // Launching thread: wait up to timeout_s for the hand-off of `gen` with the GIL released,
  // polling the flag for spin_ns first (a hand-off that is already due costs no sleep/wake),
  // then sleeping on the cv until the hand-off or until the job's last request is out
  // (mark_tail); from then on it polls the flag (no wake-up after the hand-off: pass K measured
  // 0.36-0.40 ms from the hand-off to the join's return with the sleep), still within timeout_s.
  bool wait(uint64_t gen, double timeout_s, int64_t spin_ns) {
    if (handed.load(std::memory_order_acquire) == gen) return true;
    py::gil_scoped_release nogil;
    return wait_nogil(gen, timeout_s, spin_ns);
  }
  // wait, then (handed off, `event` nonzero) queue `stream`'s wait on the event (cuStreamWaitEvent;
  // stream 0 is the legacy default stream) before the GIL is taken back (issue 23 pass M: no
  // Python-level wait_event after the hand-off). Returns 0: not handed off within timeout_s;
  // 1: handed off, the stream wait not queued (no event, no driver entry, or it failed: the
  // caller queues it); 1 | 2: handed off and the stream wait queued. Records the w_* host times.
  // `event2` (nonzero): a second event the stream waits on after the first (vLLM's prefetch-done
  // event, so _finish_prefetch's own wait_event is not run in Python); its bit is 4 in the result
  // (1 | 2 | 4: both queued).
  int wait_stream(uint64_t gen, double timeout_s, int64_t spin_ns, uint64_t stream, uint64_t event, uint64_t event2) {
    w_gen = gen;
    w_enter = now_ns();
    int r = 0;
    auto queue = [&] {
      w_seen = now_ns();
      const CudaDriver &cu = cuda_driver();
      void *st = reinterpret_cast<void *>(stream);
      r = 1;
      if (event && cu.stream_wait_event && cu.stream_wait_event(st, reinterpret_cast<void *>(event), 0) == 0) {
        r |= 2;
        if (event2 && cu.stream_wait_event(st, reinterpret_cast<void *>(event2), 0) == 0) r |= 4;
      }
      w_queued = now_ns();
    };
    if (handed.load(std::memory_order_acquire) == gen) {
      queue();  // already handed off: the GIL is kept (nothing to wait for)
    } else {
      py::gil_scoped_release nogil;
      if (wait_nogil(gen, timeout_s, spin_ns)) queue();
      else w_seen = w_queued = now_ns();
    }
    w_gil = now_ns();
    return r;
  }
  bool wait_nogil(uint64_t gen, double timeout_s, int64_t spin_ns) {
    const int64_t t0 = now_ns(), spin_end = t0 + spin_ns;
    const int64_t end = t0 + int64_t(std::max(timeout_s, 0.0) * 1e9);
    while (now_ns() < spin_end)
      if (handed.load(std::memory_order_acquire) == gen) return true;
    {
      std::unique_lock<std::mutex> l(m);
      auto due = [&] { return handed.load(std::memory_order_acquire) == gen || tail.load(std::memory_order_acquire) == gen; };
      if (!cv.wait_for(l, std::chrono::nanoseconds(std::max<int64_t>(end - now_ns(), 0)), due)) return false;
      if (handed.load(std::memory_order_acquire) == gen) return true;
    }
    tail_polls.fetch_add(1, std::memory_order_relaxed);
    while (now_ns() < end) {
      if (handed.load(std::memory_order_acquire) == gen) return true;
      cpu_relax();
    }
    return handed.load(std::memory_order_acquire) == gen;
  }
};

// The plan of a multi-piece job in the fixed piece layout (EngramCore::serve_pieces): piece k's
// selectors (relative to the piece) at rows [k*piece_rows, ...) of the slot's selector part, its
// fetch list from fetch[k*piece_rows]. plan(k) plans one piece; start_ahead(planner) plans pieces
// 1..count-1 on a planner thread (in order, publishing `planned`), so the worker thread waits
// (wait(k)) only when a piece's plan is not done by the time its request is due. The destructor
// waits for the planner (PiecePlan::join): no early return leaves it writing into buffers Python reuses.
// plan_head(h) (issue 23 pass K) plans only piece 0's first h rows (head_n owned ids: a request
// of its own, sent at once); start_ahead() then plans the rest of piece 0 first, continuing its
// fetch list and selectors after head_n, so piece 0's plan and fetch list are those of plan(0).
struct PiecePlan;
// The planner thread of a core (issue 23 pass L): started once, at the first multi-piece job
// that plans ahead, instead of one std::thread per job (pass K measured piece 0's plan phase at
// 0.13-0.14 ms with the thread's start in it, ~0.1 ms over the 8,192-id head's plan). post()
// hands it a PiecePlan (PiecePlan::run_ahead from piece `first` on) and returns at once;
// wait_idle() returns once that plan is done (or stopped). One plan at a time. The destructor
// stops and joins the thread.
struct Planner {
  std::mutex m;
  std::condition_variable cv;
  PiecePlan *job = nullptr;
  size_t first = 0;
  bool busy = false, quit = false;
  std::thread th;

  Planner() { th = std::thread([this] { loop(); }); }  // throws std::system_error: no thread
  ~Planner() {
    {
      std::lock_guard<std::mutex> g(m);
      quit = true;
    }
    cv.notify_all();
    if (th.joinable()) th.join();
  }
  Planner(const Planner &) = delete;
  Planner &operator=(const Planner &) = delete;
  void post(PiecePlan *p, size_t f) {
    {
      std::lock_guard<std::mutex> g(m);
      job = p; first = f; busy = true;
    }
    cv.notify_all();
  }
  void wait_idle() {
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return !busy; });
  }
  inline void loop();
};

// A multi-piece job's fixed piece layout, (first row, rows) per piece: pieces of piece_rows,
// then, in a job of more than one piece, for each t of tail_rows in turn the last piece's last t
// rows as a piece of their own when it is longer than t (issue 23 pass L: the last piece's H2D
// copy and kernel, after the job's last reply, are on layer 1's critical path; pass Q: two tails,
// so that what follows the last reply is a small piece and the piece before it is short enough to
// be done by then). RemoteRows._piece_keys agrees.
std::vector<std::pair<int64_t, int64_t>> piece_layout(int64_t rows, int64_t piece_rows, const Tails &tail_rows) {
  std::vector<std::pair<int64_t, int64_t>> v;
  for (int64_t r0 = 0; r0 < rows; r0 += piece_rows) v.push_back({r0, std::min(piece_rows, rows - r0)});
  if (v.size() < 2) return v;
  for (const int64_t t : tail_rows) {
    if (t <= 0 || v.back().second <= t) continue;
    const int64_t r0 = v.back().first, len = v.back().second;
    v.back().second = len - t;
    v.push_back({r0 + len - t, t});
  }
  return v;
}

// tail_rows as the constructors take it: every entry >= 0 (0: no split), else invalid_argument.
static Tails checked_tails(const Tails &t, const char *who) {
  for (const int64_t x : t)
    if (x < 0) throw std::invalid_argument(std::string(who) + ": tail_rows entries must be >= 0");
  return t;
}

std::vector<std::pair<int64_t, int64_t>> EngramSlot::piece_layout_of(int64_t rows, int64_t piece_rows,
                                                                        const Tails &tail_rows) {
  return piece_layout(rows, piece_rows, tail_rows);
}

struct PiecePlan {
  EngramSlot &s;
  const int64_t rows;
  const std::vector<std::pair<int64_t, int64_t>> lay;  // piece_layout
  const size_t count;
  std::vector<int64_t> ns;  // owned ids per piece
  int64_t head_rows = 0, head_n = 0;  // plan_head: piece 0's rows planned first, their owned ids
  std::atomic<size_t> planned{0};
  std::atomic<bool> stop{false};
  bool bad = false;
  int64_t ahead_ns = 0;  // the planner thread's time (valid after finish())
  Planner *planner = nullptr;  // set while a Planner runs this plan (start_ahead .. join)

  PiecePlan(EngramSlot &slot, int64_t r, std::vector<std::pair<int64_t, int64_t>> layout)
      : s(slot), rows(r), lay(std::move(layout)), count(lay.size()), ns(count, 0) {}
  ~PiecePlan() { join(); }
  PiecePlan(const PiecePlan &) = delete;
  PiecePlan &operator=(const PiecePlan &) = delete;

  void plan(size_t k) {
    const int64_t r0 = lay[k].first, r1 = r0 + lay[k].second;
    int32_t *sel = reinterpret_cast<int32_t *>(s.hbuf);
    if (k == 0 && head_rows > 0)  // the rest of piece 0, after its head's owned ids
      ns[0] = head_n + plan_span(s.ids, head_rows, r1, s.lo, s.hi, s.limit, sel, s.fetch + head_n, bad,
                                 int32_t(head_n));
    else
      ns[k] = plan_span(s.ids, r0, r1, s.lo, s.hi, s.limit, sel, s.fetch + r0, bad);
    planned.store(k + 1, std::memory_order_release);
  }
  // Piece 0's first h rows only (0 < h < piece 0's rows; else nothing): head_n owned ids at fetch[0..).
  void plan_head(int64_t h) {
    if (count == 0 || h <= 0 || h >= lay[0].second) return;
    head_n = plan_span(s.ids, 0, h, s.lo, s.hi, s.limit, reinterpret_cast<int32_t *>(s.hbuf), s.fetch, bad);
    head_rows = h;
  }
  void run_all() {
    for (size_t k = 0; k < count; k++) plan(k);
  }
  // Planner thread: pieces first.. in order until done or stopped.
  void run_ahead(size_t first) {
    const int64_t t0 = now_ns();
    for (size_t k = first; k < count && !stop.load(std::memory_order_relaxed); k++) plan(k);
    ahead_ns = now_ns() - t0;
  }
  // The rest planned ahead by `p` (the core's planner thread), or here when there is none.
  void start_ahead(Planner *p) {
    const size_t first = head_rows > 0 ? 0 : 1;  // after plan_head: the rest of piece 0 first
    if (count <= first) return;
    if (p == nullptr) {  // no planner thread to be had: plan here, as before
      for (size_t k = first; k < count; k++) plan(k);
      return;
    }
    planner = p;
    p->post(this, first);
  }
  void wait(size_t k) {
    for (int spins = 0; planned.load(std::memory_order_acquire) <= k; spins++)
      if (spins > 64) std::this_thread::yield();
  }
  void join() {
    stop.store(true, std::memory_order_relaxed);
    if (planner != nullptr) {
      planner->wait_idle();
      planner = nullptr;
    }
  }
  int64_t finish() {
    join();
    int64_t t = 0;
    for (int64_t n : ns) t += n;
    return t;
  }
};

void Planner::loop() {
  ::pthread_setname_np(::pthread_self(), "dsv41-planner");  // /proc/self/task/*/comm (tests)
  std::unique_lock<std::mutex> l(m);
  for (;;) {
    cv.wait(l, [&] { return job != nullptr || quit; });
    if (job == nullptr) return;  // quit with nothing posted
    PiecePlan *p = job;
    const size_t f = first;
    l.unlock();
    p->run_ahead(f);
    l.lock();
    job = nullptr;
    busy = false;
    cv.notify_all();
  }
}

// ---- the GPU-side join's jobs, their fill from the local rows and the watchdog (issue 23 pass O) ----
// One GPU-joined job: the launching thread queued its ids word's write, per piece the wait for
// its flag and its graph, and its done event on the job's stream (EngramSlot::gj_queue), so the
// GPU runs each piece once its flag holds `gen`. Exactly one of the worker and the watchdog
// serves it: the one whose compare-and-swap of `claim` from 0 wins (1 the worker, 2 the watchdog)
// fills every piece's rows (remote, or the exact local rows) and stores every flag; `done` once
// all are stored. The claimer's own state (which flags it stored) lives on its stack.
struct GJob {
  std::shared_ptr<EngramSlot> slot;
  uint64_t gen = 0;
  int64_t rows = 0, piece_rows = 0;
  Tails tail_rows;
  int64_t bound_ns = 0;    // the watchdog's bound, counted from its first sight of the ids word
  std::atomic<int64_t> t_ids_seen{0};  // the watchdog's first sight of the ids word
  std::atomic<int> claim{0};
  std::atomic<bool> done{false};
};

// The ids of job `gen` are in the pinned ids buffer once the GPU wrote `gen` (or later) into the
// slot's ids word (cuStreamWriteValue64, after the D2H copy, with a system-wide fence): polled,
// 50 us of busy polling, then 20 us sleeps; no CUDA call. No bound: the GPU reaches the job's
// flag waits only after this write, so while it has not come nothing waits on the job.
inline void gj_wait_ids(EngramSlot &s, uint64_t gen) {
  const int64_t spin_end = now_ns() + 50000;
  while (s.ids_word() < gen) {
    if (now_ns() < spin_end) {
      cpu_relax();
      continue;
    }
    timespec ts{0, 20000};
    ::nanosleep(&ts, nullptr);
  }
}

// Every piece of `plan` whose flag is not stored yet (`stored`, one entry per piece): its plan
// awaited, its owned rows gathered from the slot's exact local rows into the fixed piece layout,
// its flag stored. Returns the rows gathered. An owned id past the local table (excluded by
// EngramSlot::gj_ready's range check) leaves that piece's rows as they are and counts in `bad`.
int64_t gj_fill_local(EngramSlot &s, uint64_t gen, PiecePlan &plan, std::vector<char> &stored, int64_t &bad) {
  uint8_t *packed = s.hbuf + s.max_rows * 4;
  int64_t filled = 0;
  for (size_t k = 0; k < plan.count; k++) {
    if (stored[k]) continue;
    plan.wait(k);
    const int64_t r0 = plan.lay[k].first, n = plan.ns[k];
    if (n && !(s.local && s.local->gather(s.fetch + r0, n, packed + r0 * kRow))) bad++;
    filled += n;
    s.store_flag(k, gen);
    stored[k] = 1;
  }
  return filled;
}

// The process's watchdog of GPU-joined jobs (one thread, started at the first such job, never
// stopped: a daemon as the worker). Every kPollNs it looks at each open job: once the GPU has
// written the job's ids word (the GPU can wait on the job's flags from then on) and the job is
// still unclaimed bound_ns after the watchdog first saw that, it claims the job and serves it
// whole from the exact local rows (a dead, retired, hung or busy worker: the worker drops a job it
// cannot claim), counted in the slot's gj_takeovers. Jobs claimed by the worker are only
// forgotten once done. No CUDA call, no GIL.
class GjWatchdog {
 public:
  static constexpr int64_t kPollNs = 1000000;
  static GjWatchdog &get() {
    static GjWatchdog *w = new GjWatchdog();  // never destroyed: its thread runs until the process ends
    return *w;
  }
  // false: no thread could be started (the caller then does not queue a GPU-side join)
  bool watch(std::shared_ptr<GJob> g) {
    if (!start()) return false;
    std::lock_guard<std::mutex> l(m_);
    jobs_.push_back(std::move(g));
    return true;
  }
  // The thread, once (false: it cannot be started).
  bool start() {
    std::lock_guard<std::mutex> l(m_);
    if (started_) return true;
    try {
      std::thread([this] { loop(); }).detach();
    } catch (const std::system_error &) {
      return false;
    }
    started_ = true;
    return true;
  }
  size_t open() {
    std::lock_guard<std::mutex> l(m_);
    return jobs_.size();
  }
  // One look (the thread's loop).
  void look() {
    std::vector<std::shared_ptr<GJob>> seen;
    {
      std::lock_guard<std::mutex> l(m_);
      seen = jobs_;
    }
    for (auto &g : seen) {
      if (g->done.load(std::memory_order_acquire) || g->claim.load(std::memory_order_acquire) != 0) continue;
      EngramSlot &s = *g->slot;
      const int64_t t = now_ns();
      if (s.ids_word() < g->gen) continue;
      int64_t first = 0;
      g->t_ids_seen.compare_exchange_strong(first, t);
      if (t - g->t_ids_seen.load() < g->bound_ns) continue;
      int open = 0;
      if (!g->claim.compare_exchange_strong(open, 2, std::memory_order_acq_rel)) continue;
      take_over(*g);
    }
    std::lock_guard<std::mutex> l(m_);
    std::vector<std::shared_ptr<GJob>> keep;
    for (auto &g : jobs_)
      if (!g->done.load(std::memory_order_acquire)) keep.push_back(g);
    jobs_.swap(keep);
  }

 private:
  GjWatchdog() = default;
  void loop() {
    ::pthread_setname_np(::pthread_self(), "dsv41-gj-watch");
    for (;;) {
      timespec ts{0, long(kPollNs)};
      ::nanosleep(&ts, nullptr);
      look();
    }
  }
  static void take_over(GJob &g) {
    EngramSlot &s = *g.slot;
    PiecePlan plan(s, g.rows, piece_layout(g.rows, g.piece_rows, g.tail_rows));
    plan.run_all();
    std::vector<char> stored(plan.count, 0);
    int64_t bad = 0;
    const int64_t n = gj_fill_local(s, g.gen, plan, stored, bad);
    if (bad) s.gj_bad.fetch_add(bad);
    s.gj_takeovers.fetch_add(1);
    s.gj_fallback_jobs.fetch_add(1);
    s.gj_fallback_rows.fetch_add(n);
    s.gj_jobs.fetch_add(1);
    uint64_t prev = s.gj_done.load();
    while (prev < g.gen && !s.gj_done.compare_exchange_weak(prev, g.gen)) {
    }
    s.handoff(g.gen);
    g.done.store(true, std::memory_order_release);
  }
  std::mutex m_;
  std::vector<std::shared_ptr<GJob>> jobs_;
  bool started_ = false;
};

struct EngramJob {
  std::shared_ptr<EngramSlot> slot;
  uint64_t gen;
  int64_t rows;
  uint64_t out;
  void *stream, *ids_event, *done_event;
  bool cuda;     // the ids come by a D2H copy: never plan before ids_event (0: Python's path)
  bool py_wait;  // the ids event is a Python object (no raw handle): Python waits on it
  int64_t t_sub;
  int64_t n = 0;
  int64_t t_deq = 0, t_ids = 0;  // dequeued, ids event done (CLOCK_MONOTONIC ns; the phase trace)
  std::shared_ptr<GJob> gj;         // a GPU-joined job (issue 23 pass O), else null
  std::vector<char> *stored = nullptr;  // serve_gj: the pieces whose flag is stored
};

// One multi-piece job's phase timestamps (EngramCore::set_trace, issue 23 pass K: the step
// benchmark's decomposition of layer 1's exposed time), CLOCK_MONOTONIC ns as Python's
// time.monotonic_ns(): submitted, dequeued, ids event done, piece 0 planned; per piece the
// request's start and end and the end of its graph launch (the start of the next piece's
// request, less these, is the wait for its plan); the done event recorded and handed off
// (on the CPU: the return to Python). Piece 0 with a head (plan_head): fetch0[0] is the head
// request's start, fetch1[0] the rest's end, t_head1 / t_rest0 the head's end and the rest's
// start (between them the wait for the rest's plan); both 0 without a head.
struct PieceTrace {
  int64_t key = 0;
  uint64_t gen = 0;
  int64_t rows = 0, t_sub = 0, t_deq = 0, t_ids = 0, t_plan0 = 0, t_done = 0;
  int64_t t_head1 = 0, t_rest0 = 0;  // piece 0 with a head: its request's end, the rest's request's start
  std::vector<int64_t> fetch0, fetch1, launch1;
  // the pipelined stream (EngramCore::stream, issue 23 pass L): pieces' requests overlap, so the
  // fetch is the first send to the last reply less `idle` (gaps with nothing on the wire)
  bool stream = false;
  int64_t t_fetch0 = 0, t_fetch1 = 0, idle = 0;
  bool gpu_join = false;  // a GPU-joined job (pass O): launch1 = the piece's flag stored, t_done = the last
};

class EngramCore {
 public:
  // Statuses of next(): what Python does with the batch it returns.
  // GJ_FAILED (issue 23 pass O): a GPU-joined job's request failed and its rows were filled from
  // the exact local rows (every flag stored): Python closes the lent connection and counts it.
  // GJ (internal): take() dequeued and claimed a GPU-joined job.
  enum { RETIRED = 0, PYTHON = 1, FETCHED = 2, FAILED = 3, CUDA_FAILED = 4, REPORT = 5, PYTHON_IDS = 6,
         PIECES_FETCHED = 7, PIECES_FAILED = 8, GJ_FAILED = 9, GJ = 10 };
  // Requests in flight per piece of a multi-piece job (tcp.TcpClient.lookup_many's window).
  static constexpr uint32_t kPieceWindow = 4;

  // head_rows (issue 23 pass K): piece 0 of a multi-piece job is requested in two parts, its
  // first head_rows rows planned and sent at once, the rest planned meanwhile by the planner
  // thread (0: piece 0 planned whole before its request, as before).
  // tail_rows (issue 23 pass L): the last piece's last tail_rows rows are a piece of their own
  // (piece_layout; 0: pieces of piece_rows only).
  EngramCore(int64_t chunk_rows, int64_t piece_rows, double report_s, int64_t head_rows = 0, Tails tail_rows = {})
      : chunk_rows_(chunk_rows), piece_rows_(piece_rows), head_rows_(head_rows),
        tail_rows_(checked_tails(tail_rows, "EngramCore")), report_ns_(int64_t(report_s * 1e9)), last_return_(now_ns()) {
    if (head_rows < 0) throw std::invalid_argument("EngramCore: head_rows must be >= 0");
  }

  // Launching thread: queue one layer's job (handles are 0 where there is no CUDA).
  void submit(std::shared_ptr<EngramSlot> slot, uint64_t gen, int64_t rows, uint64_t out, uint64_t stream,
              uint64_t ids_event, uint64_t done_event, bool cuda, bool py_wait, int expect, double coalesce_s) {
    slot->begin(gen);
    std::lock_guard<std::mutex> g(m_);
    expect_ = expect;
    coalesce_ns_ = int64_t(coalesce_s * 1e9);
    q_.push_back(EngramJob{std::move(slot), gen, rows, out, reinterpret_cast<void *>(stream),
                           reinterpret_cast<void *>(ids_event), reinterpret_cast<void *>(done_event), cuda, py_wait, now_ns()});
    pending_.store(true, std::memory_order_release);
    cv_.notify_one();
  }
  // Launching thread (issue 23 pass O): GPU-join job `gen`. Every check first (the slot ready:
  // words, local rows, buffers, table; the rows fit; the watchdog's thread), then its GPU side
  // (slot->gj_queue on `stream`, unless `queue` is false: the CPU tests' stand-in for the GPU),
  // then the job to the worker's queue and to the watchdog (bound_s: GjWatchdog's bound). 0:
  // nothing queued anywhere (the caller serves the job on the host path); 1: queued; -1: the GPU
  // side was queued in part (a driver call failed): the job is still handed to the worker, which
  // releases every flag, and the caller serves it again once it is done (GpuJoin.join).
  int submit_gj(std::shared_ptr<EngramSlot> slot, uint64_t gen, int64_t rows, uint64_t out, uint64_t stream,
                uint64_t done_event, int64_t piece_rows, const Tails &tail_rows, double bound_s, int expect, bool queue) {
    if (!slot->gj_ready() || rows <= 0 || size_t(rows) > slot->max_rows || !GjWatchdog::get().start()) return 0;
    const int q = queue ? slot->gj_queue(stream, gen, rows, out, piece_rows, tail_rows, done_event) : 1;
    if (q == 0) return 0;
    auto g = std::make_shared<GJob>();
    g->slot = slot; g->gen = gen; g->rows = rows; g->piece_rows = piece_rows; g->tail_rows = tail_rows;
    g->bound_ns = int64_t(std::max(bound_s, 0.0) * 1e9);
    GjWatchdog::get().watch(g);  // its thread runs (start() above): never refused now
    slot->begin(gen);
    std::lock_guard<std::mutex> l(m_);
    expect_ = expect;
    EngramJob j{slot, gen, rows, out, reinterpret_cast<void *>(stream), nullptr, reinterpret_cast<void *>(done_event),
                true, false, now_ns()};
    j.gj = std::move(g);
    q_.push_back(std::move(j));
    pending_.store(true, std::memory_order_release);
    cv_.notify_one();
    return q;
  }
  void joined(int expect) {  // expect: the worker's new expectation (EngramWorker.joined)
    std::lock_guard<std::mutex> g(m_);
    expect_ = expect;
    joins_++;
    cv_.notify_one();
  }
  void retire() {
    std::lock_guard<std::mutex> g(m_);
    retired_ = true;
    pending_.store(true, std::memory_order_release);
    cv_.notify_all();
  }
  bool retired() {
    std::lock_guard<std::mutex> g(m_);
    return retired_;
  }
  // Worker thread only (as next()): the connection the core requests rows on.
  void lend(int fd, uint64_t next_gen, uint16_t version, int64_t timeout_ns, int64_t spin_ns) {
    if (fd < 0 || timeout_ns <= 0 || spin_ns < 0) throw std::invalid_argument("lend: bad fd, timeout or spin");
    fd_ = fd; gen_ = next_gen; version_ = version; timeout_ns_ = timeout_ns; spin_ns_ = spin_ns;
  }
  void revoke() {
    fd_ = -1;
    std::lock_guard<std::mutex> g(om_);
    offer_fd_ = -1;
  }
  bool lent() const { return fd_ >= 0; }
  // Any thread (the worker's lease probe): a connection for the worker thread to adopt before its
  // next job (adopt()), so a table server that answers again is used without the core returning
  // to Python. Arguments as lend(); an offer not adopted yet is replaced.
  void offer(int fd, uint64_t next_gen, uint16_t version, int64_t timeout_ns, int64_t spin_ns) {
    if (fd < 0 || timeout_ns <= 0 || spin_ns < 0) throw std::invalid_argument("offer: bad fd, timeout or spin");
    std::lock_guard<std::mutex> g(om_);
    offer_fd_ = fd; offer_gen_ = next_gen; offer_version_ = version; offer_timeout_ns_ = timeout_ns;
    offer_spin_ns_ = spin_ns;
  }
  // Whether a connection is lent or offered (any thread).
  bool connected() {
    if (fd_ >= 0) return true;
    std::lock_guard<std::mutex> g(om_);
    return offer_fd_ >= 0;
  }
  // Nanoseconds the idle worker polls its queue (no system call) before it sleeps on the condition
  // variable, counted from the end of its last job: a job submitted within the window is taken
  // within microseconds, whatever the host's wake-up latency (C-states, timer slack); 0: sleep at once.
  void set_idle_spin(double seconds) {
    if (!(seconds >= 0)) throw std::invalid_argument("set_idle_spin: seconds must be >= 0");
    idle_spin_ns_.store(int64_t(seconds * 1e9), std::memory_order_relaxed);
  }

  py::dict counters() {
    std::lock_guard<std::mutex> g(cm_);
    py::dict d;
    d["native_batches"] = c_batches; d["native_jobs"] = c_jobs; d["native_requests"] = c_requests;
    d["native_multi_layer_requests"] = c_multi; d["native_launches"] = c_launches;
    d["native_coalesce_waits"] = c_cwaits; d["native_rows"] = c_rows;
    d["native_wake_s"] = c_wake * 1e-9; d["native_ids_wait_s"] = c_ids * 1e-9; d["native_coalesce_s"] = c_coal * 1e-9;
    d["native_plan_s"] = c_plan * 1e-9; d["native_fetch_s"] = c_fetch * 1e-9; d["native_launch_s"] = c_launch * 1e-9;
    d["native_host_s"] = c_host * 1e-9; d["native_plan_ahead_s"] = c_plan_ahead * 1e-9;
    d["native_gj_jobs"] = c_gj_jobs; d["native_gj_fallback_jobs"] = c_gj_fb_jobs;
    d["native_gj_fallback_rows"] = c_gj_fb_rows; d["native_gj_nolease"] = c_gj_nolease;
    d["native_gj_failed_requests"] = c_gj_failed;
    d["native_local_batches"] = c_local_batches; d["native_local_jobs"] = c_local_jobs;
    d["native_local_rows"] = c_local_rows; d["native_local_s"] = c_local * 1e-9;
    d["native_idle_spins"] = c_spins; d["native_idle_spin_s"] = c_spin * 1e-9; d["native_offers_adopted"] = c_adopted;
    return d;
  }
  // The row-source counters of the requests made here (RemoteRowSource.add_counters).
  py::dict source_counters() {
    std::lock_guard<std::mutex> g(cm_);
    py::dict d;
    // a GPU-joined job served from the local rows without a lent connection is one lookup and
    // one fallback (one whose request failed is counted by Python's lease_failed)
    // a host-joined batch filled from the local rows without a connection: its layers' lookups, one fallback
    d["lookups"] = c_lookups + c_gj_nolease + c_nolease_jobs;
    d["rows"] = c_rows + c_gj_nolease_rows + c_nolease_rows; d["remote_rows"] = c_rows;
    d["fallbacks"] = c_gj_nolease + c_nolease_batches;
    d["latency_sum_s"] = c_fetch * 1e-9; d["latency_count"] = c_requests;
    return d;
  }

  // The phase trace of multi-piece jobs (PieceTrace; off by default, the step benchmark turns it
  // on): set_trace(on) starts or stops recording, take_traces() returns and clears the recorded
  // jobs, oldest first, as dicts of CLOCK_MONOTONIC ns (key, gen, rows, t_sub, t_deq, t_ids,
  // t_plan0, t_done, and per piece fetch0 / fetch1 / launch1 lists; fetch0 = fetch1 = 0 where a
  // piece had no request). Jobs served whole are recorded (on CUDA: launch1 after the piece's
  // graph launch, t_done after the done event and the hand-off; on the CPU, PIECES_FETCHED:
  // launch1 = the reply's end, t_done the return to Python); at most kMaxTraces are kept.
  static constexpr size_t kMaxTraces = 256;
  void set_trace(bool on) { trace_.store(on, std::memory_order_relaxed); }
  py::list take_traces() {
    std::deque<PieceTrace> got;
    {
      std::lock_guard<std::mutex> g(cm_);
      got.swap(traces_);
    }
    py::list out;
    for (auto &t : got) {
      py::dict d;
      d["key"] = t.key; d["gen"] = t.gen; d["rows"] = t.rows; d["t_sub"] = t.t_sub; d["t_deq"] = t.t_deq;
      d["t_ids"] = t.t_ids; d["t_plan0"] = t.t_plan0; d["t_done"] = t.t_done;
      d["fetch0"] = t.fetch0; d["fetch1"] = t.fetch1; d["launch1"] = t.launch1;
      d["t_head1"] = t.t_head1; d["t_rest0"] = t.t_rest0;
      d["stream"] = t.stream; d["t_fetch0"] = t.t_fetch0; d["t_fetch1"] = t.t_fetch1; d["idle"] = t.idle;
      d["gpu_join"] = t.gpu_join;
      out.append(d);
    }
    return out;
  }

  // Worker thread: serve jobs until one needs Python; returns (status, [(key, gen, n)...], code, rcount).
  py::tuple next() {
    std::vector<EngramJob> batch;
    int status = RETIRED, code = 0;
    uint32_t rcount = 0;
    last_busy_ = now_ns();  // back from Python's work: the idle spin's window starts here
    {
      py::gil_scoped_release nogil;
      static thread_local bool slack_set = false;
      if (!slack_set) {  // the ids word's short sleeps (gj_wait_ids) last what they ask, not + 50 us of slack
        ::prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
        slack_set = true;
      }
      for (;;) {
        batch.clear();
        code = 0;
        rcount = 0;
        status = take(batch);
        if (status != RETIRED) adopt();
        if (status == GJ) {
          status = serve_gj(batch[0], code, rcount);  // REPORT or GJ_FAILED
          last_busy_ = now_ns();
          // served from the local rows for want of a connection: the worker's lease probe offers a
          // connection once the server answers (offer(), adopted before the next job), so the core
          // stays here and no step waits for Python
        } else if (status != FETCHED) {
          break;  // RETIRED, or PYTHON (ids not awaited or not eligible)
        } else {
          status = serve(batch, code, rcount);
        }
        // a batch filled from the local rows after its request failed: Python closes the connection
        if (status != REPORT || code != 0) break;
        int64_t t = now_ns();
        if (t - last_return_ >= report_ns_) break;
      }
      last_return_ = now_ns();
    }
    py::list jobs;
    for (auto &j : batch) jobs.append(py::make_tuple(j.slot->key, j.gen, j.n));
    return py::make_tuple(status, jobs, code, rcount);
  }

 private:
  // Dequeue the batch (first job, ids awaited, the step's other layers coalesced); FETCHED means
  // "go on serving", PYTHON that Python serves the batch as it is.
  // A GPU-joined job is claimed here (GJ) or dropped when the watchdog claimed it first.
  int take(std::vector<EngramJob> &batch) {
    std::unique_lock<std::mutex> l(m_);
    for (;;) {
      if (q_.empty() && !retired_) {
        pending_.store(false, std::memory_order_relaxed);  // submit() sets it under m_, after its push
        idle_spin(l);
      }
      cv_.wait(l, [&] { return !q_.empty() || retired_; });
      if (retired_) return RETIRED;  // GPU-joined jobs still queued: the watchdog serves them
      EngramJob j = std::move(q_.front());
      q_.pop_front();
      if (j.gj) {
        int open = 0;
        if (!j.gj->claim.compare_exchange_strong(open, 1, std::memory_order_acq_rel)) continue;
      }
      batch.push_back(std::move(j));
      break;
    }
    l.unlock();
    int64_t t0 = now_ns();
    EngramJob &j0 = batch[0];
    j0.t_deq = t0;
    add(c_wake, t0 - j0.t_sub);
    if (j0.gj) return GJ;
    if (j0.py_wait) return PYTHON_IDS;  // Python waits on its ids event, then calls coalesce()
    const CudaDriver &cu = cuda_driver();
    if (j0.cuda && (!j0.ids_event || !cu.ok || cu.event_sync(j0.ids_event) != 0))
      return PYTHON;  // Python's synchronize raises the cause
    int64_t t1 = now_ns();
    j0.t_ids = t1;
    add(c_ids, t1 - t0);
    gather(batch, j0.rows);
    add(c_coal, now_ns() - t1);
    return FETCHED;
  }
  // Poll for a job, without the lock and without a system call, until idle_spin_ns_ after the end of
  // the last job (set_idle_spin); the caller then sleeps on cv_ if none came.
  void idle_spin(std::unique_lock<std::mutex> &l) {
    const int64_t window = idle_spin_ns_.load(std::memory_order_relaxed);
    if (window <= 0 || last_busy_ == 0) return;
    const int64_t t0 = now_ns(), end = last_busy_ + window;
    if (t0 >= end) return;
    l.unlock();
    int64_t t = t0;
    while (!pending_.load(std::memory_order_acquire) && t < end) {
      for (int i = 0; i < 64; i++) cpu_relax();
      t = now_ns();
    }
    l.lock();
    std::lock_guard<std::mutex> g(cm_);
    c_spins++;
    c_spin += t - t0;
  }
  // Worker thread: take the connection a probe offered (offer()) when none is lent.
  void adopt() {
    if (fd_ >= 0) return;
    std::lock_guard<std::mutex> g(om_);
    if (offer_fd_ < 0) return;
    fd_ = offer_fd_; gen_ = offer_gen_; version_ = offer_version_; timeout_ns_ = offer_timeout_ns_;
    spin_ns_ = offer_spin_ns_;
    offer_fd_ = -1;
    std::lock_guard<std::mutex> c(cm_);
    c_adopted++;
  }
  // The step's other layers: those queued, or due within the coalescing bound (never past a join).
  void gather(std::vector<EngramJob> &batch, int64_t first_rows) {
    std::unique_lock<std::mutex> l(m_);
    if (int64_t(q_.size()) + 1 < expect_ && first_rows <= chunk_rows_) {
      add(c_cwaits, 1);
      uint64_t joins = joins_;
      cv_.wait_for(l, std::chrono::nanoseconds(coalesce_ns_),
                   [&] { return int64_t(q_.size()) + 1 >= expect_ || retired_ || joins_ != joins; });
    }
    while (!q_.empty() && batch.size() < kMaxSegs && !q_.front().gj) {  // a GPU-joined job: alone
      batch.push_back(std::move(q_.front()));
      q_.pop_front();
    }
  }

 public:
  // Worker thread, after a PYTHON_IDS job's ids wait: the jobs to serve with it ([(key, gen, 0)]).
  py::list coalesce(int64_t first_rows) {
    std::vector<EngramJob> more;
    {
      py::gil_scoped_release nogil;
      gather(more, first_rows);
    }
    py::list jobs;
    for (auto &j : more) jobs.append(py::make_tuple(j.slot->key, j.gen, j.n));
    return jobs;
  }

 private:

  int serve(std::vector<EngramJob> &batch, int &code, uint32_t &rcount) {
    int64_t t0 = now_ns(), fetch_ns = 0;
    int st = serve_batch(batch, code, rcount, fetch_ns);
    last_busy_ = now_ns();
    std::lock_guard<std::mutex> g(cm_);
    c_host += now_ns() - t0 - fetch_ns;  // host work: the batch's time minus the request's
    if (st != PYTHON && st != PIECES_FAILED) { c_batches++; c_jobs += int64_t(batch.size()); }
    return st;
  }
  int serve_batch(std::vector<EngramJob> &batch, int &code, uint32_t &rcount, int64_t &fetch_ns) {
    bool multi = false;
    for (auto &j : batch) multi = multi || j.rows > piece_rows_;
    if (multi) {  // one job at a time, in order (layer 1 of a prefill chunk is handed off first)
      if (batch.size() > 1) {
        std::lock_guard<std::mutex> g(m_);
        int64_t t = now_ns();
        for (size_t k = batch.size(); k-- > 1;) {
          batch[k].t_sub = t;  // back to the queue's front: their wake-up is not counted twice
          batch[k].t_deq = batch[k].t_ids = 0;
          q_.push_front(std::move(batch[k]));
        }
        batch.resize(1);
      }
      if (batch[0].rows > piece_rows_) return serve_pieces(batch[0], code, rcount, fetch_ns);
    }
    int64_t total_rows = 0;
    const bool lease = fd_ >= 0;
    bool ok = true;
    // each layer's exact local rows: the fill without a connection, or after a failed request
    std::shared_ptr<LocalTable> loc[kMaxSegs];
    bool local = batch.size() <= kMaxSegs;
    for (size_t k = 0; k < batch.size(); k++) {
      const EngramJob &j = batch[k];
      total_rows += j.rows;
      ok = ok && j.slot->has_table && j.slot->ids && j.rows <= piece_rows_ && size_t(j.rows) <= j.slot->max_rows;
      if (local) local = bool(loc[k] = j.slot->local_rows());
    }
    if (!ok || !(lease || local) || total_rows > chunk_rows_) return PYTHON;
    const CudaDriver &cu = cuda_driver();
    for (size_t k = 1; k < batch.size(); k++)
      if (batch[k].cuda && (!batch[k].ids_event || !cu.ok || cu.event_sync(batch[k].ids_event) != 0)) return PYTHON;
    int64_t tp = now_ns();
    CSeg cs[kMaxSegs];
    size_t ns = 0, total = 0;
    for (auto &j : batch) {  // plan_rows' arithmetic, on the slot's buffers
      EngramSlot &s = *j.slot;
      int32_t *sel = reinterpret_cast<int32_t *>(s.hbuf);
      bool bad = false;
      const int64_t n = plan_span(s.ids, 0, j.rows, s.lo, s.hi, s.limit, sel, s.fetch, bad);
      if (bad) return PYTHON;  // an id past the table: Python's path raises RowRangeError
      j.n = n;
      if (n) cs[ns++] = CSeg{s.ident, reinterpret_cast<const uint8_t *>(s.fetch), s.hbuf + j.rows * 4, size_t(n)};
      total += size_t(n);
    }
    int64_t tf = now_ns();
    add(c_plan, tf - tp);
    if (ns) {
      bool fill = !lease;
      if (lease) {
        if (ns > 1 && version_ < 2) return PYTHON;  // one request per layer: Python's path
        code = lookup_segs_nogil(fd_, gen_++, version_, cs, ns, total, timeout_ns_, spin_ns_, rcount);
        int64_t te = now_ns();
        fetch_ns = te - tf;
        {
          std::lock_guard<std::mutex> g(cm_);
          c_fetch += te - tf; c_requests++; c_multi += ns > 1;
          if (code == 0) { c_rows += int64_t(total); c_lookups += int64_t(batch.size()); }
        }
        if (code != 0) {
          fd_ = -1;  // the request failed: Python closes the connection (and counts the failure)
          if (!local) return FAILED;  // Python serves the exact local rows
          fill = true;  // no timeout or reconnect in any later step: the local rows until a probe connects
        }
      }
      if (fill) {  // the exact local rows, no GIL: a memcpy gather per owned row
        const int64_t t1 = now_ns();
        for (size_t k = 0; k < batch.size(); k++) {
          EngramJob &j = batch[k];
          EngramSlot &s = *j.slot;
          if (j.n && !loc[k]->gather(s.fetch, j.n, s.hbuf + j.rows * 4))
            return code != 0 ? FAILED : PYTHON;  // an id past the shard: Python's path raises or serves it
        }
        const int64_t t2 = now_ns();
        fetch_ns += t2 - t1;
        std::lock_guard<std::mutex> g(cm_);
        c_local += t2 - t1; c_local_batches++; c_local_jobs += int64_t(batch.size()); c_local_rows += int64_t(total);
        if (code == 0) {  // no connection: counted here (a failed request: by Python's lease_failed)
          c_nolease_batches++; c_nolease_jobs += int64_t(batch.size()); c_nolease_rows += int64_t(total);
        }
      }
    }
    int64_t tl = now_ns();
    for (auto &j : batch)
      if (!j.done_event || !j.stream || !cu.ok || !graph_of(j)) return FETCHED;  // Python launches (and captures)
    size_t k = 0;
    for (; k < batch.size(); k++) {
      EngramJob &j = batch[k];
      EngramSlot &s = *j.slot;
      std::lock_guard<std::mutex> g(s.m);
      if (j.gen == s.abandoned || j.gen != s.current) continue;  // refused meanwhile: never launched
      void *exec = graph_of_locked(j);
      if (!exec || cu.graph_launch(exec, j.stream) != 0 || cu.event_record(j.done_event, j.stream) != 0)
        break;
      s.handoff_locked(j.gen);
      add(c_launches, 1);
    }
    add(c_launch, now_ns() - tl);
    if (k < batch.size()) {  // a CUDA call failed: Python launches the rest eagerly (graphs off)
      batch.erase(batch.begin(), batch.begin() + k);
      return CUDA_FAILED;
    }
    return REPORT;
  }
  // A multi-piece (prefill) job in the fixed piece layout: every piece planned (plan_rows'
  // arithmetic: sel relative to the piece, fetch list and packed rows from row r0; piece 0 here,
  // pieces 1.. by a PiecePlan thread during the requests before them; with head_rows_, only
  // piece 0's first head_rows_ rows here, requested at once, and the rest of piece 0 by the
  // planner thread during that request, then requested: the same rows as one request), then piece
  // by piece one pipelined request (lookup_many_nogil) and, on CUDA, its captured launch graph on
  // the job's stream, so no Python runs between the pieces; the done event and the hand-off after
  // the last. PYTHON (nothing done) when a piece graph is missing, an id is past the table or the
  // job does not fit; PIECES_FETCHED on the CPU (no graphs: Python launches the pieces);
  // PIECES_FAILED when a request (code != 0) or a CUDA call (code 0) failed: Python serves the
  // whole job again (the work already queued on the stream is waited for first).
  int serve_pieces(EngramJob &j, int &code, uint32_t &rcount, int64_t &fetch_ns) {
    EngramSlot &s = *j.slot;
    if (fd_ < 0 || !s.has_table || !s.ids || !s.hbuf || size_t(j.rows) > s.max_rows) return PYTHON;
    const CudaDriver &cu = cuda_driver();
    std::vector<std::pair<int64_t, int64_t>> lay = piece_layout(j.rows, piece_rows_, tail_rows_);
    std::vector<std::pair<int64_t, void *>> pieces;  // (rows, graph) per piece
    for (auto &pc : lay) pieces.push_back({pc.second, nullptr});
    if (j.cuda) {
      if (!j.done_event || !j.stream || !cu.ok) return PYTHON;
      std::lock_guard<std::mutex> g(s.m);
      for (size_t k = 0; k < pieces.size(); k++) {
        pieces[k].second = s.piece_graph_locked(lay[k].first, pieces[k].first, j.out);
        if (!pieces[k].second) return PYTHON;  // Python serves it and captures the pieces
      }
    }
    int64_t tp = now_ns();
    PiecePlan plan(s, j.rows, std::move(lay));
    if (s.lo < 0 || s.hi > int64_t(std::min<uint64_t>(s.limit, uint64_t(INT64_MAX)))) {
      // an owned id can be past the table (or negative): every piece planned (and checked) before any request,
      // so such a job sends nothing and Python's path raises RowRangeError
      plan.run_all();
      if (plan.bad) return PYTHON;
    } else {
      // no owned id can be past the table (it covers [lo, hi)): piece 0 planned here, the rest
      // by a planner thread while the requests of the pieces before are in flight
      plan.plan_head(head_rows_);  // piece 0's head (issue 23 pass K); without one, piece 0 whole
      if (plan.head_rows == 0) plan.plan(0);
      plan.start_ahead(planner());
    }
    const int64_t t_plan0 = now_ns();
    add(c_plan, t_plan0 - tp);
    PieceTrace tr;
    const bool tracing = trace_.load(std::memory_order_relaxed);
    if (tracing) {
      tr.key = s.key; tr.gen = j.gen; tr.rows = j.rows; tr.t_sub = j.t_sub; tr.t_deq = j.t_deq; tr.t_ids = j.t_ids;
      tr.t_plan0 = t_plan0;
      tr.fetch0.assign(pieces.size(), 0); tr.fetch1.assign(pieces.size(), 0); tr.launch1.assign(pieces.size(), 0);
    }
    size_t launched = 0;
    int64_t launch_ns = 0;
    const int st = stream(j, s, plan, pieces, tracing ? &tr : nullptr, launched, launch_ns, code, rcount, fetch_ns);
    if (st >= 0) return st;
    j.n = plan.finish();
    add(c_plan_ahead, plan.ahead_ns);
    if (!j.cuda) {
      if (tracing) keep_trace(tr, now_ns());
      return PIECES_FETCHED;
    }
    int64_t tl = now_ns();
    {
      std::lock_guard<std::mutex> g(s.m);
      if (cu.event_record(j.done_event, j.stream) != 0) {
        code = 0;
        drain(j, launched);
        return PIECES_FAILED;
      }
      s.handoff_locked(j.gen);
    }
    const int64_t t_done = now_ns();
    add(c_launches, int64_t(launched));
    add(c_launch, launch_ns + t_done - tl);
    if (tracing) keep_trace(tr, t_done);
    return REPORT;
  }
  // A multi-piece job's requests as one pipelined stream over its segments (issue 23 pass L):
  // piece 0 (its head and its rest with head_rows_), then pieces 1.., each cut into requests of
  // chunk_rows_ ids, up to kPieceWindow requests in flight across segment and piece boundaries,
  // replies received in order into the fixed piece layout; a segment's requests go out once the
  // planner has planned it (its ids count is known then). A piece whose last reply is in gets its
  // graph launched (CUDA) after the requests that fit the window are sent, so the launch overlaps
  // the next piece's requests instead of sitting between a reply and the next request (pass K:
  // 0.21-0.25 ms per step), and the connection does not drain at every piece. Returns -1 when
  // every piece was fetched (and launched on CUDA); else the status to return: REPORT (the job was
  // refused meanwhile: nothing more launched, the requests in flight received and dropped so the
  // connection stays in step), PIECES_FAILED (a request failed: code != 0, rcount the refusal
  // status, the connection dropped; or a graph launch failed: code 0, after the replies in
  // flight), with the pieces launched already waited for (drain). Counts one request per segment
  // with ids (as one lookup_many call before), the connection's busy time as the fetch (from the
  // first request's send to the last reply, less the gaps with nothing in flight). The trace
  // (tr): per piece its first send and last reply (fetch0/fetch1; 0 with no ids) and its launch's
  // end; piece 0's head's last reply and its rest's first send; t_fetch0, t_fetch1 and idle (the
  // gaps, ns) for the phases (dsv41.harness.phases, stream traces).
  struct StreamChunk {
    size_t seg, off;
    uint32_t c;  // 0: a segment with no ids (completes in order, nothing on the wire)
    uint64_t gen;
  };
  int stream(EngramJob &j, EngramSlot &s, PiecePlan &plan, const std::vector<std::pair<int64_t, void *>> &pieces,
             PieceTrace *tr, size_t &launched, int64_t &launch_ns, int &code, uint32_t &rcount, int64_t &fetch_ns) {
    const CudaDriver &cu = cuda_driver();
    const bool head = plan.head_rows > 0;
    const size_t np = pieces.size(), nseg = np + (head ? 1 : 0);
    uint8_t *packed = s.hbuf + s.max_rows * 4;
    auto piece_of = [&](size_t i) -> size_t { return head ? (i == 0 ? 0 : i - 1) : i; };
    auto row0 = [&](size_t i) -> size_t {  // the segment's first fetch slot (= its first packed row)
      if (head && i == 1) return size_t(plan.head_n);
      return head && i == 0 ? 0 : size_t(plan.lay[piece_of(i)].first);
    };
    std::vector<int64_t> seg_n(nseg, -1);  // -1: not planned yet
    auto know = [&](size_t i) -> bool {
      if (seg_n[i] >= 0) return true;
      if (head && i == 0) { seg_n[0] = plan.head_n; return true; }
      const size_t p = piece_of(i);
      if (plan.planned.load(std::memory_order_acquire) <= p) return false;
      seg_n[i] = head && i == 1 ? plan.ns[0] - plan.head_n : plan.ns[p];
      return true;
    };
    const uint32_t chunk = uint32_t(chunk_rows_);
    std::deque<StreamChunk> fly;  // sent in full (or segments without ids), reply awaited, in order
    size_t ss = 0, soff = 0;      // next segment to send, its ids already sent
    size_t send_off = 0;          // bytes of the request being sent (0: none started)
    uint8_t hdr[kReq];
    uint32_t cur_c = 0;
    uint64_t cur_gen = 0;
    size_t real_fly = 0;          // requests on the wire: sent in full or started
    size_t done_seg = 0, segs_sent = 0;
    int64_t rows_in = 0;
    std::deque<size_t> to_launch;
    bool stop_send = false, cuda_failed = false, tail_marked = false;
    ReplyReader reply;
    int64_t t_first = 0, t_last = 0, idle = 0, t_gap = 0, plan_wait = 0;
    int64_t deadline = now_ns() + timeout_ns_, spin_until = now_ns() + spin_ns_;
    uint32_t status = 0;
    code = 0;
    auto complete = [&](size_t seg, int64_t t) {  // every request of segment `seg` is in
      const size_t p = piece_of(seg);
      if (tr && seg_n[seg] > 0) {
        if (head && seg == 0) tr->t_head1 = t;
        else tr->fetch1[p] = t;
      }
      done_seg = seg + 1;
      if (!(head && seg == 0)) to_launch.push_back(p);
    };
    for (;;) {
      bool progressed = false;
      // 1. send: finish the request started, then new ones while the window has room
      while (code == 0 && ss < nseg && (send_off > 0 || (!stop_send && real_fly < kPieceWindow))) {
        if (send_off == 0) {
          if (!know(ss)) break;  // not planned yet
          if (seg_n[ss] == 0) {  // nothing to fetch: completes in order
            fly.push_back(StreamChunk{ss, 0, 0, 0});
            ss++; soff = 0;
            progressed = true;
            continue;
          }
          cur_c = uint32_t(std::min<size_t>(chunk, size_t(seg_n[ss]) - soff));
          cur_gen = gen_++;
          wr<uint32_t>(hdr, kMagic); wr<uint16_t>(hdr + 4, kVersion); wr<uint16_t>(hdr + 6, OP_LOOKUP);
          wr<uint64_t>(hdr + 8, cur_gen); std::memcpy(hdr + 16, s.ident, 32);
          wr<uint32_t>(hdr + 48, cur_c); wr<uint32_t>(hdr + 52, cur_c * 8);
          const int64_t t = now_ns();
          if (!t_first) t_first = t;
          if (real_fly == 0) {
            if (t_gap) idle += t - t_gap;
            t_gap = 0;
            deadline = t + timeout_ns_;
          }
          if (soff == 0) {
            segs_sent++;
            if (tr) {
              if (head && ss == 1) tr->t_rest0 = t;
              else tr->fetch0[piece_of(ss)] = t;
            }
          }
          real_fly++;
        }
        const size_t plen = size_t(cur_c) * 8;
        const uint8_t *ids = reinterpret_cast<const uint8_t *>(s.fetch + row0(ss) + soff);
        const ssize_t r = send_request_part(fd_, hdr, ids, plen, send_off);
        if (r == -1) break;
        if (r < 0) { code = -2; break; }
        progressed = progressed || r > 0;
        send_off += size_t(r);
        if (send_off == kReq + plen) {
          fly.push_back(StreamChunk{ss, soff, cur_c, cur_gen});
          send_off = 0;
          soff += cur_c;
          if (soff == size_t(seg_n[ss])) { ss++; soff = 0; }
        }
      }
      if (code) break;
      if (ss == nseg && send_off == 0 && !tail_marked && j.cuda) {  // the job's last request is out:
        s.mark_tail(j.gen);                                          // the join polls from here on
        tail_marked = true;
      }
      // 2. the pieces whose replies are all in: their graphs, after the requests above; a
      // GPU-joined job's (pass O): their flags (the GPU's waits release the graphs queued at start)
      while (!to_launch.empty() && j.gj) {
        const size_t p = to_launch.front();
        to_launch.pop_front();
        s.store_flag(p, j.gen);
        (*j.stored)[p] = 1;
        if (tr) tr->launch1[p] = now_ns();
        progressed = true;
      }
      while (!to_launch.empty() && j.cuda && !stop_send) {
        const size_t p = to_launch.front();
        to_launch.pop_front();
        const int64_t tl = now_ns();
        std::lock_guard<std::mutex> g(s.m);
        if (j.gen == s.abandoned || j.gen != s.current) { stop_send = true; break; }  // refused meanwhile
        if (cu.graph_launch(pieces[p].second, j.stream) != 0) { stop_send = cuda_failed = true; break; }
        launched++;
        const int64_t tle = now_ns();
        if (tr) tr->launch1[p] = tle;
        launch_ns += tle - tl;
        progressed = true;
      }
      if (!j.cuda) {  // the CPU: Python launches the pieces (PIECES_FETCHED)
        const int64_t t = now_ns();
        if (tr) for (size_t p : to_launch) tr->launch1[p] = t;
        to_launch.clear();
      }
      if (done_seg == nseg && to_launch.empty()) break;
      if (stop_send && fly.empty() && send_off == 0) break;
      // 3. receive what is there, in order; segments without ids complete as they come up
      for (;;) {
        while (!fly.empty() && fly.front().c == 0) {
          const size_t seg = fly.front().seg;
          fly.pop_front();
          complete(seg, now_ns());
          progressed = true;
        }
        if (fly.empty()) break;
        const StreamChunk ch = fly.front();
        const int got = reply.read(fd_, packed + (row0(ch.seg) + ch.off) * kRow, ch.c, ch.gen, code, status);
        if (got == ReplyReader::NONE || got == ReplyReader::FAIL) break;
        progressed = true;
        if (got == ReplyReader::DONE) {
          fly.pop_front();
          real_fly--;
          rows_in += ch.c;
          const int64_t t = now_ns();
          t_last = t;
          deadline = t + timeout_ns_;  // the next reply: its own full budget
          if (real_fly == 0) t_gap = t;
          if (ch.off + ch.c == size_t(seg_n[ch.seg])) complete(ch.seg, t);
          break;  // back to send (the window has room) and launch
        }
      }
      if (code) break;
      if (progressed) { spin_until = now_ns() + spin_ns_; continue; }
      const int64_t t = now_ns();
      if (real_fly == 0 && send_off == 0 && fly.empty() && ss < nseg && !stop_send) {
        plan.wait(piece_of(ss));  // nothing on the wire: the next segment's plan is due
        plan_wait += now_ns() - t;
        continue;
      }
      if (t >= deadline) { code = -1; break; }
      if (t < spin_until) { ::sched_yield(); continue; }  // yield as in Connection::fill
      pollfd pf{fd_, short(POLLIN | (ss < nseg && !stop_send && real_fly < kPieceWindow ? POLLOUT : 0)), 0};
      const int64_t rem = deadline - t;
      timespec ts{time_t(rem / 1000000000LL), long(rem % 1000000000LL)};
      ::ppoll(&pf, 1, &ts, nullptr);
    }
    const int64_t busy = t_first && t_last ? t_last - t_first - idle : 0;
    fetch_ns += busy;
    add(c_plan, plan_wait);
    {
      std::lock_guard<std::mutex> g(cm_);
      c_fetch += busy; c_requests += int64_t(segs_sent);
      if (code == 0 && !stop_send) { c_rows += rows_in; c_lookups += int64_t(segs_sent); }
    }
    if (tr) { tr->t_fetch0 = t_first; tr->t_fetch1 = t_last; tr->idle = idle; tr->stream = true; }
    if (code != 0) {
      rcount = status;
      fd_ = -1;  // the request failed: Python closes the connection and serves the job again
      drain(j, launched);
      return PIECES_FAILED;
    }
    if (cuda_failed) {
      drain(j, launched);
      return PIECES_FAILED;  // code 0: piece graphs off, Python serves the job again
    }
    if (stop_send) {
      add(c_launch, launch_ns);
      return REPORT;  // refused meanwhile: nothing more launched
    }
    return -1;
  }
  // A GPU-joined job (issue 23 pass O; claimed by take()): its ids awaited on the ids word,
  // planned as serve_pieces plans (piece 0's head here, the rest on the planner thread), then on
  // the lent connection the pipelined request stream, each piece's flag stored once its last
  // reply is in (stream(), j.gj); without a connection, or after a failed request, every piece
  // not stored yet is filled from the exact local rows (gj_fill_local) and its flag stored. No
  // CUDA call. REPORT, or GJ_FAILED after a failed request (code, rcount as PIECES_FAILED: Python
  // closes the connection and counts the failure; the rows are already exact and released).
  int serve_gj(EngramJob &j, int &code, uint32_t &rcount) {
    EngramSlot &s = *j.slot;
    GJob &g = *j.gj;
    const int64_t t0 = now_ns();
    gj_wait_ids(s, j.gen);
    j.t_ids = now_ns();
    add(c_ids, j.t_ids - t0);
    std::vector<std::pair<int64_t, int64_t>> lay = piece_layout(j.rows, g.piece_rows, g.tail_rows);
    std::vector<std::pair<int64_t, void *>> pieces;
    for (auto &pc : lay) pieces.push_back({pc.second, nullptr});
    const int64_t tp = now_ns();
    PiecePlan plan(s, j.rows, std::move(lay));
    plan.plan_head(head_rows_);
    if (plan.head_rows == 0) plan.plan(0);
    plan.start_ahead(planner());
    const int64_t t_plan0 = now_ns();
    add(c_plan, t_plan0 - tp);
    std::vector<char> stored(plan.count, 0);
    j.stored = &stored;
    PieceTrace tr;
    const bool tracing = trace_.load(std::memory_order_relaxed);
    if (tracing) {
      tr.key = s.key; tr.gen = j.gen; tr.rows = j.rows; tr.t_sub = j.t_sub; tr.t_deq = j.t_deq; tr.t_ids = j.t_ids;
      tr.t_plan0 = t_plan0; tr.gpu_join = true;
      tr.fetch0.assign(pieces.size(), 0); tr.fetch1.assign(pieces.size(), 0); tr.launch1.assign(pieces.size(), 0);
    }
    const bool lease = fd_ >= 0 && s.has_table;
    int st = -1;
    int64_t fetch_ns = 0, launch_ns = 0;
    size_t launched = 0;
    code = 0;
    if (lease) st = stream(j, s, plan, pieces, tracing ? &tr : nullptr, launched, launch_ns, code, rcount, fetch_ns);
    const bool failed = st >= 0;  // PIECES_FAILED: a request failed (stop_send cannot happen here)
    int64_t filled = 0, bad = 0;
    size_t unstored = 0;
    for (char c : stored) unstored += c == 0;
    if (unstored) filled = gj_fill_local(s, j.gen, plan, stored, bad);  // no lease, or after the failure
    j.n = plan.finish();
    j.stored = nullptr;
    add(c_plan_ahead, plan.ahead_ns);
    uint64_t prev = s.gj_done.load();
    while (prev < j.gen && !s.gj_done.compare_exchange_weak(prev, j.gen)) {
    }
    s.handoff(j.gen);
    g.done.store(true, std::memory_order_release);
    const int64_t t_done = now_ns();
    s.gj_jobs.fetch_add(1);
    const bool fb = unstored > 0;
    if (fb) {
      s.gj_fallback_jobs.fetch_add(1);
      s.gj_fallback_rows.fetch_add(filled);
    }
    {
      std::lock_guard<std::mutex> l(cm_);
      c_gj_jobs++; c_batches++; c_jobs++;
      c_host += t_done - t0 - fetch_ns;
      if (fb) { c_gj_fb_jobs++; c_gj_fb_rows += filled; }
      if (!lease) { c_gj_nolease++; c_gj_nolease_rows += filled; }
      if (failed) c_gj_failed++;
    }
    if (tracing && lease && !fb) keep_trace(tr, t_done);
    if (bad) s.gj_bad.fetch_add(bad);
    return failed && code != 0 ? GJ_FAILED : REPORT;
  }
  void keep_trace(PieceTrace &tr, int64_t t_done) {
    tr.t_done = t_done;
    std::lock_guard<std::mutex> g(cm_);
    if (traces_.size() >= kMaxTraces) traces_.pop_front();
    traces_.push_back(std::move(tr));
  }
  // Before Python rewrites the staging of a job whose pieces were partly launched: wait for them.
  void drain(EngramJob &j, size_t launched) {
    const CudaDriver &cu = cuda_driver();
    if (launched && cu.ok && cu.event_record(j.done_event, j.stream) == 0) cu.event_sync(j.done_event);
  }
  static void *graph_of_locked(const EngramJob &j) {
    auto it = j.slot->graphs.find({j.rows, j.out});
    return it == j.slot->graphs.end() ? nullptr : it->second;
  }
  static void *graph_of(const EngramJob &j) {
    std::lock_guard<std::mutex> g(j.slot->m);
    return graph_of_locked(j);
  }
  void add(int64_t &c, int64_t v) {
    std::lock_guard<std::mutex> g(cm_);
    c += v;
  }
  // The core's planner thread, started at the first multi-piece job (worker thread only);
  // nullptr when no thread can be had (then the job plans every piece itself).
  Planner *planner() {
    if (!planner_ && !planner_failed_) {
      try {
        planner_ = std::make_unique<Planner>();
      } catch (const std::system_error &) {
        planner_failed_ = true;
      }
    }
    return planner_.get();
  }

  std::mutex m_, cm_;
  std::condition_variable cv_;
  std::deque<EngramJob> q_;
  std::atomic<bool> trace_{false};
  std::deque<PieceTrace> traces_;  // the latest kMaxTraces multi-piece jobs served on CUDA (under cm_)
  bool retired_ = false;
  uint64_t joins_ = 0;
  int64_t expect_ = 1;
  std::atomic<int> fd_{-1};
  std::mutex om_;  // guards the offer (offer(), adopt(), connected())
  int offer_fd_ = -1;
  uint64_t offer_gen_ = 0;
  uint16_t offer_version_ = 1;
  int64_t offer_timeout_ns_ = 0, offer_spin_ns_ = 0;
  std::atomic<bool> pending_{false};  // a job queued (or retired): ends idle_spin
  std::atomic<int64_t> idle_spin_ns_{0};
  int64_t last_busy_ = 0;  // worker thread: when its last job ended
  uint64_t gen_ = 0;
  uint16_t version_ = 1;
  int64_t timeout_ns_ = 0, spin_ns_ = 0;
  const int64_t chunk_rows_, piece_rows_, head_rows_;
  const Tails tail_rows_;
  const int64_t report_ns_;
  int64_t coalesce_ns_ = 0;  // the last submit's COALESCE_S (read under m_)
  std::unique_ptr<Planner> planner_;  // declared last of the state a plan touches: destroyed first
  bool planner_failed_ = false;
  int64_t last_return_;
  int64_t c_batches = 0, c_jobs = 0, c_requests = 0, c_multi = 0, c_launches = 0, c_cwaits = 0, c_rows = 0,
          c_lookups = 0, c_wake = 0, c_ids = 0, c_coal = 0, c_plan = 0, c_fetch = 0, c_launch = 0, c_host = 0,
          c_plan_ahead = 0, c_gj_jobs = 0, c_gj_fb_jobs = 0, c_gj_fb_rows = 0, c_gj_nolease = 0, c_gj_nolease_rows = 0,
          c_gj_failed = 0, c_local_batches = 0, c_local_jobs = 0, c_local_rows = 0, c_local = 0, c_nolease_batches = 0,
          c_nolease_jobs = 0, c_nolease_rows = 0, c_spins = 0, c_spin = 0, c_adopted = 0;
};

}  // namespace

// The core's plan of a multi-piece job (PiecePlan, as EngramCore::serve_pieces runs it) on given
// buffers: `ahead` plans piece 0 here (only its first `head` rows when 0 < head < piece 0's rows,
// the rest of it then first on the planner thread) and the rest on the planner thread, waited for
// piece by piece; otherwise every piece in turn. Returns (owned ids per piece, whether an owned id
// is at or past `limit`). `tail`: piece_layout's tail_rows. For the tests that the orders give the same pieces.
py::tuple plan_pieces(py::array_t<int64_t, py::array::c_style> ids, int64_t lo, int64_t hi, uint64_t limit,
                      int64_t piece_rows, py::array_t<int32_t, py::array::c_style> sel,
                      py::array_t<int64_t, py::array::c_style> fetch, bool ahead, int64_t head, Tails tail) {
  const ssize_t r = ids.size();
  if (sel.size() < r || fetch.size() < r) throw std::invalid_argument("plan_pieces: sel and fetch need ids.size() entries");
  if (piece_rows <= 0 || r > INT32_MAX) throw std::invalid_argument("plan_pieces: piece_rows must be > 0 and ids < 2^31");
  EngramSlot slot;
  slot.ids = ids.data();
  slot.hbuf = reinterpret_cast<uint8_t *>(sel.mutable_data());
  slot.fetch = fetch.mutable_data();
  slot.lo = lo; slot.hi = hi; slot.limit = limit;
  tail = checked_tails(tail, "plan_pieces");
  std::vector<int64_t> ns;
  bool bad = false;
  {
    py::gil_scoped_release nogil;
    Planner planner;  // as the core's: a persistent thread, here for this call
    PiecePlan plan(slot, r, piece_layout(r, piece_rows, tail));
    const size_t count = plan.count;
    if (ahead && count) {
      plan.plan_head(head);  // the core's order: piece 0's head, then its rest and pieces 1.. ahead
      if (plan.head_rows == 0) plan.plan(0);
      plan.start_ahead(&planner);
      for (size_t k = 0; k < count; k++) plan.wait(k);
    } else {
      plan.run_all();
    }
    plan.finish();
    ns = plan.ns;
    bad = plan.bad;
  }
  return py::make_tuple(ns, bad);
}

PYBIND11_MODULE(_fastrow, m) {
  m.doc() = "C++ hot path of the dsv41 row transport (server request loop, client lookup).";
  py::class_<ServerCore>(m, "ServerCore")
      .def(py::init<>())
      .def("add_table", &ServerCore::add_table)
      .def("stats", &ServerCore::stats)
      .def("set_stopping", [](ServerCore &c, bool v) { c.stopping = v; })
      .def("set_spin_ns", [](ServerCore &c, int64_t v) {
        if (v < 0) throw std::invalid_argument("spin_ns must be >= 0");
        c.spin_ns = v;
      });
  py::class_<Connection>(m, "Connection")
      .def(py::init<ServerCore &, int, bool>(), py::keep_alive<1, 2>())
      .def("run", &Connection::run)
      .def("reply", &Connection::reply);
  py::class_<EngramSlot, std::shared_ptr<EngramSlot>>(m, "EngramSlot")
      .def(py::init([](int64_t key) {
             auto s = std::make_shared<EngramSlot>();
             s->key = key;
             return s;
           }), py::arg("key"))
      .def_property_readonly("key", [](EngramSlot &s) { return s.key; })
      .def("set_table", &EngramSlot::set_table)
      .def("set_buffers", &EngramSlot::set_buffers)
      .def("set_graphs", &EngramSlot::set_graphs)
      .def("set_piece_graphs", &EngramSlot::set_piece_graphs)
      .def("begin", &EngramSlot::begin)
      .def("handoff", &EngramSlot::handoff)
      .def("abandon", &EngramSlot::abandon)
      .def("is_abandoned", &EngramSlot::is_abandoned)
      .def("handed", [](EngramSlot &s) { return s.handed.load(); })
      .def("mark_tail", &EngramSlot::mark_tail)
      .def("tail_polls", [](EngramSlot &s) { return s.tail_polls.load(); })
      .def("wait", &EngramSlot::wait, py::arg("gen"), py::arg("timeout_s"), py::arg("spin_ns") = 0)
      .def("wait_stream", &EngramSlot::wait_stream, py::arg("gen"), py::arg("timeout_s"), py::arg("spin_ns"),
           py::arg("stream"), py::arg("event"), py::arg("event2") = 0)
      .def("gj_setup", &EngramSlot::gj_setup)
      .def("set_local", &EngramSlot::set_local, py::arg("path"), py::arg("weight_offset"), py::arg("scale_offset"),
           py::arg("rows"))
      .def("gj_ready", &EngramSlot::gj_ready)
      .def("gj_queue", &EngramSlot::gj_queue, py::arg("stream"), py::arg("gen"), py::arg("rows"), py::arg("out"),
           py::arg("piece_rows"), py::arg("tail_rows"), py::arg("done_event"))
      .def("gj_stream_waits", &EngramSlot::gj_stream_waits, py::arg("stream"), py::arg("event"), py::arg("event2") = 0)
      .def("gj_done", [](EngramSlot &s) { return s.gj_done.load(); })
      .def("gj_counters", [](EngramSlot &s) {
        py::dict d;
        d["gj_jobs"] = s.gj_jobs.load(); d["gj_fallback_jobs"] = s.gj_fallback_jobs.load();
        d["gj_fallback_rows"] = s.gj_fallback_rows.load(); d["gj_takeovers"] = s.gj_takeovers.load();
        d["gj_bad_pieces"] = s.gj_bad.load();
        return d;
      })
      // the unit tests' stand-in for the GPU, on a slot with words: the ids word's write and the flags
      .def("gj_test_words", [](EngramSlot &s) {
        std::lock_guard<std::mutex> g(s.m);
        if (!s.gj_host) s.gj_host = new uint64_t[EngramSlot::kGjWords]();  // plain host memory, no CUDA (tests)
      })
      .def("gj_write_ids", [](EngramSlot &s, uint64_t gen) {
        if (!s.gj_host) throw std::runtime_error("no GPU-join words");
        __atomic_store_n(&s.gj_host[0], gen, __ATOMIC_RELEASE);
      })
      .def("gj_flags", [](EngramSlot &s, size_t n) {
        if (!s.gj_host) throw std::runtime_error("no GPU-join words");
        std::vector<uint64_t> v;
        for (size_t k = 0; k < n && EngramSlot::kGjFlag0 + k < EngramSlot::kGjWords; k++)
          v.push_back(__atomic_load_n(&s.gj_host[EngramSlot::kGjFlag0 + k], __ATOMIC_ACQUIRE));
        return v;
      })
      .def("wait_times", [](EngramSlot &s) {
        return py::make_tuple(s.w_gen, s.w_enter, s.w_seen, s.w_queued, s.w_gil);
      });
  py::class_<EngramCore>(m, "EngramCore")
      .def(py::init<int64_t, int64_t, double, int64_t, Tails>(), py::arg("chunk_rows"), py::arg("piece_rows"),
           py::arg("report_s"), py::arg("head_rows") = 0, py::arg("tail_rows") = Tails{})
      .def("submit", &EngramCore::submit)
      .def("submit_gj", &EngramCore::submit_gj, py::arg("slot"), py::arg("gen"), py::arg("rows"), py::arg("out"),
           py::arg("stream"), py::arg("done_event"), py::arg("piece_rows"), py::arg("tail_rows"), py::arg("bound_s"),
           py::arg("expect"), py::arg("queue") = true)
      .def("joined", &EngramCore::joined)
      .def("retire", &EngramCore::retire)
      .def("retired", &EngramCore::retired)
      .def("lend", &EngramCore::lend)
      .def("revoke", &EngramCore::revoke)
      .def("lent", &EngramCore::lent)
      .def("offer", &EngramCore::offer, py::arg("fd"), py::arg("next_gen"), py::arg("version"), py::arg("timeout_ns"),
           py::arg("spin_ns"))
      .def("connected", &EngramCore::connected)
      .def("set_idle_spin", &EngramCore::set_idle_spin, py::arg("seconds"))
      .def("counters", &EngramCore::counters)
      .def("source_counters", &EngramCore::source_counters)
      .def("next", &EngramCore::next)
      .def("coalesce", &EngramCore::coalesce)
      .def("set_trace", &EngramCore::set_trace, py::arg("on"))
      .def("take_traces", &EngramCore::take_traces);
  m.def("stream_mem_ops", &stream_mem_ops, py::arg("ordinal"));
  m.def("gj_watch_start", [] { return GjWatchdog::get().start(); });
  m.def("gj_watch_open", [] { return GjWatchdog::get().open(); });
  m.def("client_lookup", &client_lookup);
  // end_ns defaults to 0 (no whole-call deadline), so callers of the 9-argument form keep working
  m.def("client_lookup_many", &client_lookup_many, py::arg("fd"), py::arg("gen0"), py::arg("ident"), py::arg("rows"),
        py::arg("out"), py::arg("chunk"), py::arg("window"), py::arg("timeout_ns"), py::arg("spin_ns"),
        py::arg("end_ns") = 0);
  m.def("client_lookup_segs", &client_lookup_segs);
  // noconvert: a dtype or layout mismatch must fail, never plan into a temporary copy
  m.def("plan_rows", &plan_rows, py::arg("ids").noconvert(), py::arg("lo"), py::arg("hi"), py::arg("sel").noconvert(),
        py::arg("fetch").noconvert());
  m.def("plan_pieces", &plan_pieces, py::arg("ids").noconvert(), py::arg("lo"), py::arg("hi"), py::arg("limit"),
        py::arg("piece_rows"), py::arg("sel").noconvert(), py::arg("fetch").noconvert(), py::arg("ahead"),
        py::arg("head") = 0, py::arg("tail") = Tails{});
}
