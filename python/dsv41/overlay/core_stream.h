// The pipelined request stream of a multi-piece job (EngramCore::stream, declared and described
// in core_engram.h): one member function, the core's longest, defined in its own header so that
// each file stays within the C++ length cap. Part of dsv41.overlay._core (_core.cpp).

#pragma once

#include "dsv41/overlay/core_engram.h"

namespace {

int EngramCore::stream(EngramJob &j, EngramSlot &s, PiecePlan &plan,
                       const std::vector<std::pair<int64_t, void *>> &pieces, PieceTrace *tr, size_t &launched,
                       int64_t &launch_ns, int &code, uint32_t &rcount, int64_t &fetch_ns) {
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
    if (head && i == 0) {
      seg_n[0] = plan.head_n;
      return true;
    }
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
  size_t real_fly = 0;  // requests on the wire: sent in full or started
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
          ss++;
          soff = 0;
          progressed = true;
          continue;
        }
        cur_c = uint32_t(std::min<size_t>(chunk, size_t(seg_n[ss]) - soff));
        cur_gen = gen_++;
        write_req(hdr, kVersion, OP_LOOKUP, cur_gen, s.ident, cur_c, cur_c * 8);
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
      if (r < 0) {
        code = -2;
        break;
      }
      progressed = progressed || r > 0;
      send_off += size_t(r);
      if (send_off == kReq + plen) {
        fly.push_back(StreamChunk{ss, soff, cur_c, cur_gen});
        send_off = 0;
        soff += cur_c;
        if (soff == size_t(seg_n[ss])) {
          ss++;
          soff = 0;
        }
      }
    }
    if (code) break;
    if (ss == nseg && send_off == 0 && !tail_marked && j.cuda) {  // the job's last request is out:
      s.mark_tail(j.gen);                                         // the join polls from here on
      tail_marked = true;
    }
    // 2. the pieces whose replies are all in: their graphs, after the requests above; a
    // GPU-joined job's: their flags (the GPU's waits release the graphs queued at start)
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
      if (j.gen == s.abandoned || j.gen != s.current) {
        stop_send = true;
        break;
      }  // refused meanwhile
      if (cu.graph_launch(pieces[p].second, j.stream) != 0) {
        stop_send = cuda_failed = true;
        break;
      }
      launched++;
      const int64_t tle = now_ns();
      if (tr) tr->launch1[p] = tle;
      launch_ns += tle - tl;
      progressed = true;
    }
    if (!j.cuda) {  // the CPU: Python launches the pieces (PIECES_FETCHED)
      const int64_t t = now_ns();
      if (tr)
        for (size_t p : to_launch) tr->launch1[p] = t;
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
    if (progressed) {
      spin_until = now_ns() + spin_ns_;
      continue;
    }
    const int64_t t = now_ns();
    if (real_fly == 0 && send_off == 0 && fly.empty() && ss < nseg && !stop_send) {
      plan.wait(piece_of(ss));  // nothing on the wire: the next segment's plan is due
      plan_wait += now_ns() - t;
      continue;
    }
    if (t >= deadline) {
      code = -1;
      break;
    }
    if (t < spin_until) {
      ::sched_yield();
      continue;
    }  // yield as in Connection::fill
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
    c_fetch += busy;
    c_requests += int64_t(segs_sent);
    if (code == 0 && !stop_send) {
      c_rows += rows_in;
      c_lookups += int64_t(segs_sent);
    }
  }
  if (tr) {
    tr->t_fetch0 = t_first;
    tr->t_fetch1 = t_last;
    tr->idle = idle;
    tr->stream = true;
  }
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

}  // namespace
