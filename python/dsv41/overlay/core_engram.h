// The overlay worker core itself (EngramCore): the rank's worker thread's job queue, plan,
// fetch, launch and hand-off without the GIL. Part of dsv41.overlay._core (_core.cpp).

#pragma once

#include "dsv41/transport/client.h"
#include "dsv41/overlay/core_jobs.h"

namespace {

class EngramCore {
 public:
  // Statuses of next(): what Python does with the batch it returns.
  // GJ_FAILED: a GPU-joined job's request failed and its rows were filled from
  // the exact local rows (every flag stored): Python closes the lent connection and counts it.
  // GJ (internal): take() dequeued and claimed a GPU-joined job.
  enum {
    RETIRED = 0,
    PYTHON = 1,
    FETCHED = 2,
    FAILED = 3,
    CUDA_FAILED = 4,
    REPORT = 5,
    PYTHON_IDS = 6,
    PIECES_FETCHED = 7,
    PIECES_FAILED = 8,
    GJ_FAILED = 9,
    GJ = 10
  };
  // Requests in flight per piece of a multi-piece job (tcp.TcpClient.lookup_many's window).
  static constexpr uint32_t kPieceWindow = 4;

  // head_rows: piece 0 of a multi-piece job is requested in two parts (its first request leaves
  // before the whole piece is planned), its
  // first head_rows rows planned and sent at once, the rest planned meanwhile by the planner
  // thread (0: piece 0 planned whole before its request, as before).
  // tail_rows: the last piece's last tail_rows rows are a piece of their own
  // (piece_layout; 0: pieces of piece_rows only).
  EngramCore(int64_t chunk_rows, int64_t piece_rows, double report_s, int64_t head_rows = 0, Tails tail_rows = {})
      : chunk_rows_(chunk_rows), piece_rows_(piece_rows), head_rows_(head_rows),
        tail_rows_(checked_tails(tail_rows, "EngramCore")), report_ns_(int64_t(report_s * 1e9)),
        last_return_(now_ns()) {
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
                           reinterpret_cast<void *>(ids_event), reinterpret_cast<void *>(done_event), cuda, py_wait,
                           now_ns()});
    pending_.store(true, std::memory_order_release);
    cv_.notify_one();
  }
  // Launching thread: GPU-join job `gen`. Every check first (the slot ready:
  // words, local rows, buffers, table; the rows fit; the watchdog's thread), then its GPU side
  // (slot->gj_queue on `stream`, unless `queue` is false: the CPU tests' stand-in for the GPU),
  // then the job to the worker's queue and to the watchdog (bound_s: GjWatchdog's bound). 0:
  // nothing queued anywhere (the caller serves the job on the host path); 1: queued; -1: the GPU
  // side was queued in part (a driver call failed): the job is still handed to the worker, which
  // releases every flag, and the caller serves it again once it is done (GpuJoin.join).
  int submit_gj(std::shared_ptr<EngramSlot> slot, uint64_t gen, int64_t rows, uint64_t out, uint64_t stream,
                uint64_t done_event, int64_t piece_rows, const Tails &tail_rows, double bound_s, int expect,
                bool queue) {
    if (!slot->gj_ready() || rows <= 0 || size_t(rows) > slot->max_rows || !GjWatchdog::get().start()) return 0;
    const int q = queue ? slot->gj_queue(stream, gen, rows, out, piece_rows, tail_rows, done_event) : 1;
    if (q == 0) return 0;
    auto g = std::make_shared<GJob>();
    g->slot = slot;
    g->gen = gen;
    g->rows = rows;
    g->piece_rows = piece_rows;
    g->tail_rows = tail_rows;
    g->bound_ns = int64_t(std::max(bound_s, 0.0) * 1e9);
    GjWatchdog::get().watch(g);  // its thread runs (start() above): never refused now
    slot->begin(gen);
    std::lock_guard<std::mutex> l(m_);
    expect_ = expect;
    EngramJob j{
        slot, gen,   rows,    out, reinterpret_cast<void *>(stream), nullptr, reinterpret_cast<void *>(done_event),
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
    fd_ = fd;
    gen_ = next_gen;
    version_ = version;
    timeout_ns_ = timeout_ns;
    spin_ns_ = spin_ns;
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
    offer_fd_ = fd;
    offer_gen_ = next_gen;
    offer_version_ = version;
    offer_timeout_ns_ = timeout_ns;
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
    using namespace pybind11::literals;  // "name"_a = value: a keyword of the dict
    py::dict d(
        "native_batches"_a = c_batches, "native_jobs"_a = c_jobs, "native_requests"_a = c_requests,
        "native_multi_layer_requests"_a = c_multi, "native_launches"_a = c_launches,
        "native_coalesce_waits"_a = c_cwaits, "native_rows"_a = c_rows, "native_wake_s"_a = c_wake * 1e-9,
        "native_ids_wait_s"_a = c_ids * 1e-9, "native_coalesce_s"_a = c_coal * 1e-9, "native_plan_s"_a = c_plan * 1e-9,
        "native_fetch_s"_a = c_fetch * 1e-9, "native_launch_s"_a = c_launch * 1e-9, "native_host_s"_a = c_host * 1e-9,
        "native_plan_ahead_s"_a = c_plan_ahead * 1e-9, "native_gj_jobs"_a = c_gj_jobs,
        "native_gj_fallback_jobs"_a = c_gj_fb_jobs, "native_gj_fallback_rows"_a = c_gj_fb_rows,
        "native_gj_nolease"_a = c_gj_nolease, "native_gj_failed_requests"_a = c_gj_failed,
        "native_local_batches"_a = c_local_batches, "native_local_jobs"_a = c_local_jobs,
        "native_local_rows"_a = c_local_rows, "native_local_s"_a = c_local * 1e-9, "native_idle_spins"_a = c_spins,
        "native_idle_spin_s"_a = c_spin * 1e-9, "native_offers_adopted"_a = c_adopted);
    return d;
  }
  // The row-source counters of the requests made here (RemoteRowSource.add_counters).
  py::dict source_counters() {
    std::lock_guard<std::mutex> g(cm_);
    using namespace pybind11::literals;
    // a GPU-joined job served from the local rows without a lent connection is one lookup and
    // one fallback (one whose request failed is counted by Python's lease_failed)
    // a host-joined batch filled from the local rows without a connection: its layers' lookups, one fallback
    return py::dict("lookups"_a = c_lookups + c_gj_nolease + c_nolease_jobs,
                    "rows"_a = c_rows + c_gj_nolease_rows + c_nolease_rows, "remote_rows"_a = c_rows,
                    "fallbacks"_a = c_gj_nolease + c_nolease_batches, "latency_sum_s"_a = c_fetch * 1e-9,
                    "latency_count"_a = c_requests);
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
      using namespace pybind11::literals;  // "name"_a = value: a keyword of the dict
      py::dict d("key"_a = t.key, "gen"_a = t.gen, "rows"_a = t.rows, "t_sub"_a = t.t_sub, "t_deq"_a = t.t_deq,
                 "t_ids"_a = t.t_ids, "t_plan0"_a = t.t_plan0, "t_done"_a = t.t_done, "fetch0"_a = t.fetch0,
                 "fetch1"_a = t.fetch1, "launch1"_a = t.launch1, "t_head1"_a = t.t_head1, "t_rest0"_a = t.t_rest0,
                 "stream"_a = t.stream, "t_fetch0"_a = t.t_fetch0, "t_fetch1"_a = t.t_fetch1, "idle"_a = t.idle,
                 "gpu_join"_a = t.gpu_join);
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
    fd_ = offer_fd_;
    gen_ = offer_gen_;
    version_ = offer_version_;
    timeout_ns_ = offer_timeout_ns_;
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
    if (st != PYTHON && st != PIECES_FAILED) {
      c_batches++;
      c_jobs += int64_t(batch.size());
    }
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
          c_fetch += te - tf;
          c_requests++;
          c_multi += ns > 1;
          if (code == 0) {
            c_rows += int64_t(total);
            c_lookups += int64_t(batch.size());
          }
        }
        if (code != 0) {
          fd_ = -1;                   // the request failed: Python closes the connection (and counts the failure)
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
        c_local += t2 - t1;
        c_local_batches++;
        c_local_jobs += int64_t(batch.size());
        c_local_rows += int64_t(total);
        if (code == 0) {  // no connection: counted here (a failed request: by Python's lease_failed)
          c_nolease_batches++;
          c_nolease_jobs += int64_t(batch.size());
          c_nolease_rows += int64_t(total);
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
      if (!exec || cu.graph_launch(exec, j.stream) != 0 || cu.event_record(j.done_event, j.stream) != 0) break;
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
      plan.plan_head(head_rows_);  // piece 0's head; without one, piece 0 whole
      if (plan.head_rows == 0) plan.plan(0);
      plan.start_ahead(planner());
    }
    const int64_t t_plan0 = now_ns();
    add(c_plan, t_plan0 - tp);
    PieceTrace tr;
    const bool tracing = trace_.load(std::memory_order_relaxed);
    if (tracing) tr.start(s.key, j, t_plan0, pieces.size(), false);
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
  // A multi-piece job's requests as one pipelined stream over its segments:
  // piece 0 (its head and its rest with head_rows_), then pieces 1.., each cut into requests of
  // chunk_rows_ ids, up to kPieceWindow requests in flight across segment and piece boundaries,
  // replies received in order into the fixed piece layout; a segment's requests go out once the
  // planner has planned it (its ids count is known then). A piece whose last reply is in gets its
  // graph launched (CUDA) after the requests that fit the window are sent, so the launch overlaps
  // the next piece's requests instead of sitting between a reply and the next request (where it
  // adds to every step's exposed time), and the connection does not drain at every piece. Returns -1 when
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
             PieceTrace *tr, size_t &launched, int64_t &launch_ns, int &code, uint32_t &rcount, int64_t &fetch_ns);
  // A GPU-joined job (claimed by take()): its ids awaited on the ids word,
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
    if (tracing) tr.start(s.key, j, t_plan0, pieces.size(), true);
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
    while (prev < j.gen && !s.gj_done.compare_exchange_weak(prev, j.gen)) {}
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
      c_gj_jobs++;
      c_batches++;
      c_jobs++;
      c_host += t_done - t0 - fetch_ns;
      if (fb) {
        c_gj_fb_jobs++;
        c_gj_fb_rows += filled;
      }
      if (!lease) {
        c_gj_nolease++;
        c_gj_nolease_rows += filled;
      }
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
      } catch (const std::system_error &) { planner_failed_ = true; }
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
  int64_t coalesce_ns_ = 0;           // the last submit's COALESCE_S (read under m_)
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
