// C++ hot path of the dsv41 row transport (protocol: dsv41/transport/protocol.py, versions 1-2),
// the extension dsv41.transport._fastrow. The wire constants and the client's request path live in
// wire.h and client.h, shared with the overlay's worker core (dsv41/overlay/_core.cpp).
//
// ServerCore: the per-client request loop of the table server (lookup, hello, ping, refusals),
// run with the GIL released, busy-polling for a bounded time for the next request before
// blocking; ops it does not handle itself (the NIXL handshake) are handed back
// to Python.  client_lookup: one lookup on a non-blocking client socket, busy-polling for a
// bounded time before sleeping in ppoll, writing rows straight into caller buffers.
// Built by setup.py (pybind11 setuptools helpers); dsv41/transport/tcp.py and server.py hold the
// pure-Python equivalents, tested to give identical bytes and statuses.

#include "dsv41/transport/wire.h"
#include "dsv41/transport/client.h"

namespace {

constexpr size_t kGatherChunk = 16384;
constexpr uint32_t kPrefetch = 8;  // rows gathered ahead of the copy (prefetch distance)
constexpr double kBuckets[] = {25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 0.25, 1.0, 5.0};
constexpr int kNBuckets = sizeof(kBuckets) / sizeof(kBuckets[0]);

void pack_rep(uint8_t *h, uint16_t ver, uint16_t status, uint64_t rid, uint32_t count, uint32_t plen) {
  wr<uint32_t>(h, kMagic);
  wr<uint16_t>(h + 4, ver);
  wr<uint16_t>(h + 6, status);
  wr<uint64_t>(h + 8, rid);
  wr<uint32_t>(h + 16, count);
  wr<uint32_t>(h + 20, plen);
}

// Blocking full read; false on EOF or error.
bool recv_all(int fd, uint8_t *p, size_t n) {
  while (n) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= size_t(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    return false;
  }
  return true;
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
    if (r > 0) {
      p += r;
      n -= size_t(r);
      continue;
    }
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
      if (r > 0) {
        rend_ += size_t(r);
        continue;
      }
      if (r == 0) return false;
      if (errno == EINTR) continue;
      if (spinning && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        ::sched_yield();
        continue;
      }
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
      if (magic != kMagic) {
        refuse(ST_BAD_MAGIC, rid);
        return false;
      }
      // bad_version carries the newest version this server speaks in its header
      if (ver < kVersion || ver > kMaxVersion) {
        ver_ = kMaxVersion;
        refuse(ST_BAD_VERSION, rid);
        return false;
      }
      ver_ = ver;
      if (plen > kMaxPayload) {
        refuse(ST_OVERSIZE, rid);
        return false;
      }
      plen_ = plen;
      if (!take_payload(plen)) return false;
      if (core_.stopping.load()) {
        if (!refuse(ST_SHUTTING_DOWN, rid)) return false;
        continue;
      }
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
          if (!nixl_) {
            ok = refuse(ST_NOT_SUPPORTED, rid);
            break;
          }
          op_out = op;
          rid_out = rid;
          count_out = count;
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
    size_t fill = 0;             // rows gathered into the current chunk
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
      wr<uint32_t>(h, kMagic);
      wr<uint16_t>(h + 4, kVersion);
      wr<uint16_t>(h + 6, OP_LOOKUP);
      wr<uint64_t>(h + 8, gen0 + k);
      std::memcpy(h + 16, ident, 32);
      wr<uint32_t>(h + 48, c);
      wr<uint32_t>(h + 52, c * 8);
    }
    size_t send_idx = 0, send_off = 0;  // bytes of chunk send_idx already sent
    ReplyReader reply;
    auto budget = [&]() {
      int64_t d = now_ns() + timeout_ns;
      return end_ns > 0 && end_ns < d ? end_ns : d;
    };
    int64_t deadline = budget();
    int64_t spin_until = now_ns() + spin_ns;
    while (recv_idx < nchunks && code == 0) {
      bool progressed = false;
      while (send_idx < nchunks && send_idx - recv_idx < window) {
        size_t c = std::min<size_t>(chunk, n - send_idx * chunk);
        const size_t plen = c * 8;
        const ssize_t r = send_request_part(fd, &hdrs[send_idx * kReq], rp + send_idx * chunk * 8, plen, send_off);
        if (r == -1) break;
        if (r < 0) {
          code = -2;
          break;
        }
        progressed = progressed || r > 0;
        send_off += size_t(r);
        if (send_off == kReq + plen) {
          send_idx++;
          send_off = 0;
        }
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
      if (progressed) {
        spin_until = now_ns() + spin_ns;
        continue;
      }
      int64_t t = now_ns();
      if (t >= deadline) {
        code = -1;
        break;
      }
      if (t < spin_until) {
        ::sched_yield();
        continue;
      }  // yield as in Connection::fill
      pollfd pf{fd, short(POLLIN | (send_idx < nchunks && send_idx - recv_idx < window ? POLLOUT : 0)), 0};
      int64_t rem = deadline - t;
      timespec ts{time_t(rem / 1000000000LL), long(rem % 1000000000LL)};
      ::ppoll(&pf, 1, &ts, nullptr);
    }
  }
  return code;
}

}  // namespace

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
    wr<uint32_t>(h, kMagic);
    wr<uint16_t>(h + 4, kVersion);
    wr<uint16_t>(h + 6, OP_LOOKUP);
    wr<uint64_t>(h + 8, gen);
    std::memcpy(h + 16, id.data(), 32);
    wr<uint32_t>(h + 48, n);
    wr<uint32_t>(h + 52, n * 8);
    iovec iov[2] = {{h, kReq}, {const_cast<uint8_t *>(rp), size_t(n) * 8}};
    code = send_deadline(fd, iov, n ? 2 : 1, deadline);
    if (code == 0) code = recv_reply_rows(fd, gen, kVersion, n, out, nd, deadline, spin_ns, rcount);
    if (code == 0) rplen = uint32_t(size_t(n) * kRow);
  }
  return py::make_tuple(code, rcount, rplen);
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
    code =
        lookup_many_nogil(fd, gen0, id.data(), rp, n, op, chunk, window, timeout_ns, spin_ns, end_ns, status, recv_idx);
  }
  return py::make_tuple(code, status, recv_idx);
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
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4)
      throw std::invalid_argument("segment must be (ident, rows, limit, out)");
    PyObject *id = PyTuple_GET_ITEM(t, 0);
    if (!PyBytes_Check(id) || PyBytes_GET_SIZE(id) != 32) throw std::invalid_argument("identity must be 32 bytes");
    py::handle rh(PyTuple_GET_ITEM(t, 1)), oh(PyTuple_GET_ITEM(t, 3));
    if (!py::isinstance<py::array>(rh)) return py::make_tuple(2, j, 0);
    auto r = py::reinterpret_borrow<py::array>(rh);
    char kind = r.dtype().kind();
    if (r.ndim() != 1 || r.itemsize() != 8 || (kind != 'i' && kind != 'u') || !(r.flags() & py::array::c_style))
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
  m.def("client_lookup", &client_lookup);
  // end_ns defaults to 0 (no whole-call deadline), so callers of the 9-argument form keep working
  m.def("client_lookup_many", &client_lookup_many, py::arg("fd"), py::arg("gen0"), py::arg("ident"), py::arg("rows"),
        py::arg("out"), py::arg("chunk"), py::arg("window"), py::arg("timeout_ns"), py::arg("spin_ns"),
        py::arg("end_ns") = 0);
  m.def("client_lookup_segs", &client_lookup_segs);
}
