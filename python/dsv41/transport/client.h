// The client side of a lookup without the GIL: send a request, receive its reply into caller
// buffers (one lookup, a pipelined many-chunk lookup, a multi-table lookup), used by the
// transport's client functions (_fastrow.cpp) and by the overlay's worker core on the
// connection a row source lends it (dsv41/overlay/_core.cpp).

#pragma once

#include "dsv41/transport/wire.h"

namespace {

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
    while (niov && k >= iov->iov_len) {
      k -= iov->iov_len;
      iov++;
      niov--;
    }
    if (niov) {
      iov->iov_base = static_cast<uint8_t *>(iov->iov_base) + k;
      iov->iov_len -= k;
    }
  }
  return 0;
}

// A destination range of a lookup's rows: bytes in request order.
struct Dest {
  uint8_t *p;
  size_t n;
};
constexpr size_t kMaxDests = 16;   // tcp.py MAX_DEST_RANGES, kMaxSegs
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
int recv_reply_rows(int fd, uint64_t gen, uint16_t ver, uint64_t rows, const Dest *d, size_t nd, int64_t deadline,
                    int64_t spin_ns, uint32_t &rcount) {
  uint8_t rep[kRep];
  uint8_t scratch[kScratch];
  size_t body = size_t(rows) * kRow, head = std::min(body, kScratch);
  iovec all[2 + kMaxDests];
  size_t na = 0;
  all[na++] = {rep, kRep};
  all[na++] = {scratch, kScratch};
  size_t skip = head;  // destination bytes that go to the scratch
  for (size_t j = 0; j < nd; j++) {
    if (skip >= d[j].n) {
      skip -= d[j].n;
      continue;
    }
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
      if (off >= all[j].iov_len) {
        off -= all[j].iov_len;
        continue;
      }
      iov[ni++] = {static_cast<uint8_t *>(all[j].iov_base) + off, all[j].iov_len - off};
      off = 0;
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = ni;
    ssize_t r = ::recvmsg(fd, &mh, MSG_DONTWAIT);
    if (r > 0) {
      got += size_t(r);
      continue;
    }
    if (r == 0) return -2;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -2;
    int64_t t = now_ns();
    if (t >= deadline) return -1;
    if (t < spin_until) {
      ::sched_yield();
      continue;
    }  // yield as in Connection::fill
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

// The reply in progress on a non-blocking socket, read without blocking (client_lookup_many's
// pipeline and the C++ core's request stream): its header, then `c` rows straight into `rows`.
struct ReplyReader {
  enum { NONE, SOME, DONE, FAIL };
  uint8_t rep[kRep];
  size_t rgot = 0;  // bytes of the current reply (header then rows) received
  bool in_payload = false;
  // One recv for the reply to request `gen` of `c` rows: NONE (nothing there), SOME (bytes in,
  // the reply not complete), DONE (the reply complete; ready for the next), FAIL (`code` set to
  // the codes of client_lookup, a refusal's status in `status`; the caller closes the socket).
  int read(int fd, uint8_t *rows, uint32_t c, uint64_t gen, int &code, uint32_t &status) {
    uint8_t *dst;
    size_t want;
    if (!in_payload) {
      dst = rep + rgot;
      want = kRep - rgot;
    } else {
      dst = rows + rgot;
      want = size_t(c) * kRow - rgot;
    }
    const ssize_t r = ::recv(fd, dst, want, MSG_DONTWAIT);
    if (r == 0) {
      code = -2;
      return FAIL;
    }
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return NONE;
      code = -2;
      return FAIL;
    }
    rgot += size_t(r);
    if (!in_payload && rgot == kRep) {
      const uint16_t st = rd<uint16_t>(rep + 6);
      if (rd<uint32_t>(rep) != kMagic || rd<uint16_t>(rep + 4) != kVersion) {
        code = -4;
        return FAIL;
      }
      if (rd<uint64_t>(rep + 8) != gen) {
        code = -3;
        return FAIL;
      }
      if (st != ST_OK) {
        code = 1;
        status = st;
        return FAIL;
      }
      if (rd<uint32_t>(rep + 16) != c || uint64_t(rd<uint32_t>(rep + 20)) != uint64_t(c) * kRow) {
        code = -4;
        return FAIL;
      }
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

// One lookup request of k segments (their ids checked by the caller) on a non-blocking
// connected socket, without the GIL: the codes of client_lookup (0 rows written, 1 refused with
// the status in rcount, negative: the caller must close the socket).
struct CSeg {
  const char *ident;
  const uint8_t *ids;
  uint8_t *out;
  size_t n;
};
int lookup_segs_nogil(int fd, uint64_t gen, uint16_t version, const CSeg *cs, size_t k, size_t total,
                      int64_t timeout_ns, int64_t spin_ns, uint32_t &rcount) {
  int64_t deadline = now_ns() + timeout_ns;
  uint8_t h[kReq + kMaxSegs * kSeg];
  iovec iov[1 + kMaxSegs];
  int niov = 0;
  uint16_t ver = k == 1 ? kVersion : version;
  size_t hlen = kReq;
  if (k == 1) {
    write_req(h, ver, OP_LOOKUP, gen, cs[0].ident, uint32_t(total), uint32_t(total * 8));
  } else {
    write_req(h, ver, OP_LOOKUP_MULTI, gen, nullptr, uint32_t(k), uint32_t(k * kSeg + total * 8));
    for (size_t j = 0; j < k; j++) {
      uint8_t *g = h + kReq + j * kSeg;
      std::memcpy(g, cs[j].ident, 32);
      wr<uint32_t>(g + 32, uint32_t(cs[j].n));
      wr<uint32_t>(g + 36, 0);
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

}  // namespace
