// The overlay worker core's id plan: plan_span / plan_rows (one rank's mask and fetch list) and
// the plan of a multi-piece job (piece_layout, PiecePlan) on its planner thread (Planner).
// Part of dsv41.overlay._core.

#pragma once

#include "dsv41/overlay/core_slot.h"

namespace {

// The vLLM overlay's mask + plan of one rank's ids (dsv41/overlay/engram_ops.py plan_into, which
// holds the numpy equivalent, tested to give identical selectors and fetch lists): an id in
// [lo, hi) gets sel = its position in the fetch list and is appended to it, any other id
// (-1, padded heads, other ranks' rows) sel = -1, a zero row in vLLM's kernel. Runs without the
// GIL for large inputs, so the overlay's worker does not hold up the launching thread there.
// plan_rows' arithmetic on ids[r0, r1), branch-free (random ids make a branch on ownership
// unpredictable, and a mispredict per id costs more than the arithmetic): sel[i] = the id's position in the
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
  if (sel.size() < r || fetch.size() < r)
    throw std::invalid_argument("plan_rows: sel and fetch need ids.size() entries");
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

// The plan of a multi-piece job in the fixed piece layout (EngramCore::serve_pieces): piece k's
// selectors (relative to the piece) at rows [k*piece_rows, ...) of the slot's selector part, its
// fetch list from fetch[k*piece_rows]. plan(k) plans one piece; start_ahead(planner) plans pieces
// 1..count-1 on a planner thread (in order, publishing `planned`), so the worker thread waits
// (wait(k)) only when a piece's plan is not done by the time its request is due. The destructor
// waits for the planner (PiecePlan::join): no early return leaves it writing into buffers Python reuses.
// plan_head(h) plans only piece 0's first h rows (head_n owned ids: a request
// of its own, sent at once); start_ahead() then plans the rest of piece 0 first, continuing its
// fetch list and selectors after head_n, so piece 0's plan and fetch list are those of plan(0).
struct PiecePlan;
// The planner thread of a core: started once, at the first multi-piece job that plans ahead,
// instead of one std::thread per job (a thread's start is on piece 0's critical path and costs
// more than planning the head itself). post()
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

  Planner() {
    th = std::thread([this] { loop(); });
  }  // throws std::system_error: no thread
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
      job = p;
      first = f;
      busy = true;
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
// rows as a piece of their own when it is longer than t (the last piece's H2D copy and kernel,
// after the job's last reply, are on layer 1's critical path; two tails, so that what follows the last reply is a small
// piece and the piece before it is short enough to be done by then). RemoteRows._piece_keys agrees.
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
  std::vector<int64_t> ns;            // owned ids per piece
  int64_t head_rows = 0, head_n = 0;  // plan_head: piece 0's rows planned first, their owned ids
  std::atomic<size_t> planned{0};
  std::atomic<bool> stop{false};
  bool bad = false;
  int64_t ahead_ns = 0;        // the planner thread's time (valid after finish())
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
      ns[0] =
          head_n + plan_span(s.ids, head_rows, r1, s.lo, s.hi, s.limit, sel, s.fetch + head_n, bad, int32_t(head_n));
    else ns[k] = plan_span(s.ids, r0, r1, s.lo, s.hi, s.limit, sel, s.fetch + r0, bad);
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

}  // namespace
