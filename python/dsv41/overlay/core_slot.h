// The overlay worker core's per-table state: the hand-off state and staging of one Engram table
// (EngramSlot), with its exact local rows (LocalTable, core_local.h). Part of dsv41.overlay._core.

#pragma once

#include "dsv41/overlay/core_local.h"

namespace {

// The tail pieces of a multi-piece job's layout, rows each, applied in order (piece_layout).
using Tails = std::vector<int64_t>;

// One Engram table's hand-off state and staging (RemoteRows holds one): the generation handed
// off, the one abandoned (a refused hand-off: never launched, never handed off), the buffers the
// core plans and fetches into (owned and kept alive by Python), the table's identity and range,
// and its launch graphs by (rows, staged_rows address).
struct EngramSlot {
  std::mutex m;
  std::condition_variable cv;
  std::atomic<uint64_t> handed{0};
  // the generation whose last request is out (mark_tail): its hand-off is due
  // within that request, so a join waiting for it polls instead of sleeping on the cv
  std::atomic<uint64_t> tail{0};
  std::atomic<int64_t> tail_polls{0};  // joins that polled for a hand-off after mark_tail
  // the last wait_stream's host times (CLOCK_MONOTONIC ns, launching thread only; the phase trace):
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
  // The GPU-side join: 4 KiB of host-mapped pinned memory (cuMemHostAlloc
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
    lo = l;
    hi = h;
    limit = lim;
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
  // ---- the GPU-side join ----
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
  // The shard's exact rows for the fallback, read as `opt` says (LocalTable, core_local.h;
  // std::runtime_error when unusable, std::invalid_argument for bad options).
  void set_local(const std::string &path, uint64_t weight_offset, uint64_t scale_offset, int64_t rows,
                 const LocalReadOptions &opt = LocalReadOptions{}) {
    auto t = std::make_shared<LocalTable>(path, weight_offset, scale_offset, rows, opt);
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
  static std::vector<std::pair<int64_t, int64_t>> piece_layout_of(int64_t rows, int64_t piece_rows,
                                                                  const Tails &tail_rows);
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
  // (mark_tail); from then on it polls the flag (no wake-up after the hand-off: a sleeping join's
  // wake-up costs more than the polling), still within timeout_s.
  bool wait(uint64_t gen, double timeout_s, int64_t spin_ns) {
    if (handed.load(std::memory_order_acquire) == gen) return true;
    py::gil_scoped_release nogil;
    return wait_nogil(gen, timeout_s, spin_ns);
  }
  // wait, then (handed off, `event` nonzero) queue `stream`'s wait on the event (cuStreamWaitEvent;
  // stream 0 is the legacy default stream) before the GIL is taken back (so no
  // Python-level wait_event follows the hand-off). Returns 0: not handed off within timeout_s;
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
      auto due = [&] {
        return handed.load(std::memory_order_acquire) == gen || tail.load(std::memory_order_acquire) == gen;
      };
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

}  // namespace
