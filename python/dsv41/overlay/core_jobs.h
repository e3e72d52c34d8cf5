// The jobs the overlay worker core serves: a GPU-joined job (GJob), its fill from the local
// rows and its watchdog (GjWatchdog), a queued job (EngramJob) and a multi-piece job's phase
// trace (PieceTrace). Part of dsv41.overlay._core.

#pragma once

#include "dsv41/overlay/core_plan.h"

namespace {

// ---- the GPU-side join's jobs, their fill from the local rows and the watchdog ----
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
  int64_t bound_ns = 0;                // the watchdog's bound, counted from its first sight of the ids word
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
    } catch (const std::system_error &) { return false; }
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
    while (prev < g.gen && !s.gj_done.compare_exchange_weak(prev, g.gen)) {}
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
  int64_t t_deq = 0, t_ids = 0;         // dequeued, ids event done (CLOCK_MONOTONIC ns; the phase trace)
  std::shared_ptr<GJob> gj;             // a GPU-joined job, else null
  std::vector<char> *stored = nullptr;  // serve_gj: the pieces whose flag is stored
};

// One multi-piece job's phase timestamps (EngramCore::set_trace, for the step
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
  // the pipelined stream (EngramCore::stream): pieces' requests overlap, so the
  // fetch is the first send to the last reply less `idle` (gaps with nothing on the wire)
  bool stream = false;
  int64_t t_fetch0 = 0, t_fetch1 = 0, idle = 0;
  bool gpu_join = false;  // a GPU-joined job: launch1 = the piece's flag stored, t_done = the last
  // A traced job's fields known once its plan's first part is done (`npieces` zeroed per piece).
  void start(int64_t key_, const EngramJob &j, int64_t plan0, size_t npieces, bool gj) {
    key = key_;
    gen = j.gen;
    rows = j.rows;
    t_sub = j.t_sub;
    t_deq = j.t_deq;
    t_ids = j.t_ids;
    t_plan0 = plan0;
    gpu_join = gj;
    fetch0.assign(npieces, 0);
    fetch1.assign(npieces, 0);
    launch1.assign(npieces, 0);
  }
};

}  // namespace
