// The overlay worker core's exact local rows: a table's shard read with pread (LocalTable) and the
// persistent reader threads that split a large job's reads (ReadPool). Part of dsv41.overlay._core.
//
// A table's exact local rows for the fallback (no connection, a failed request, the GPU join's
// watchdog): the shard file kept open and read with pread (dsv41.engram.manifest.TableEntry
// regions: weight_offset + id * 256 and scale_offset + id * 8, the bytes LocalRowReader.read
// packs), so a fallback fills rows with no GIL, no CUDA call, no Python reader. Not a MAP_SHARED
// mapping and not a copy in memory: production shards are larger than the host's memory, and a
// shard truncated under the running worker would SIGBUS a mapping at the first row past the new
// end; here a short pread is an error. gather() writes n packed 264-byte rows of the ids in `ids`
// and returns false (the piece counted bad) when an id is outside [0, rows), a read comes back
// short, or the file is no longer the one opened (size or modification time changed: rewritten or
// truncated in place), checked before and after the reads. A shard shorter than its regions is
// refused at construction (std::runtime_error).
//
// How it reads (LocalReadOptions; the overlay's DSV41_ENGRAM_LOCAL_* settings): the ids are sorted
// (the output keeps the request order), each distinct id is read once (duplicates are copied), and
// ids whose bytes lie at most gap_bytes apart in a region are read with one pread of the covering
// span (at most kSpanBytes, through a stack buffer): for ids near each other in the file, one read
// instead of one per row, which matters most for the 8-byte scales. A job of more than
// parallel_rows rows is split, by spans, across `readers` threads: the calling thread and the
// table's persistent helpers (created at its first such job); a smaller job (a decode step's)
// stays on the calling thread and pays no hand-off. coalesce = false is the reader before this
// one: two preads per row in request order (kept for comparisons).

#pragma once

#include "dsv41/overlay/core_driver.h"

#include <algorithm>
#include <functional>

namespace {

struct LocalReadOptions {
  int readers = 0;               // threads of a large job, the calling thread included; 0: auto_readers()
  int64_t parallel_rows = 1536;  // a job of more rows is split across the readers
  int64_t gap_bytes = 4096;      // one pread spans two rows whose bytes are at most this far apart
  bool coalesce = true;          // false: two preads per row in request order
  static constexpr int kMaxReaders = 64;
  static constexpr int64_t kMaxGap = 32768;
  // min(8, hardware threads / 2), at least 1: a fallback reads while vLLM's own threads run
  static int auto_readers() {
    const unsigned hw = std::thread::hardware_concurrency();
    return int(std::max(1u, std::min(8u, hw / 2)));
  }
  // The options as given, checked (std::invalid_argument), readers resolved.
  LocalReadOptions resolved() const {
    if (readers < 0 || readers > kMaxReaders) throw std::invalid_argument("local reader: readers must be in [0, 64]");
    if (parallel_rows < 1) throw std::invalid_argument("local reader: parallel_rows must be >= 1");
    if (gap_bytes < 0 || gap_bytes > kMaxGap)
      throw std::invalid_argument("local reader: gap_bytes must be in [0, 32768]");
    LocalReadOptions o = *this;
    if (o.readers == 0) o.readers = auto_readers();
    return o;
  }
};

// Persistent helper threads that run the parts of one job at a time with the calling thread.
// The helpers sleep on a condition variable between jobs (no CPU when idle). A thread that cannot
// be started is left out (fewer helpers); with none, run() runs every part on the caller.
class ReadPool {
 public:
  explicit ReadPool(int helpers) {
    threads_.reserve(size_t(helpers));  // may throw before any thread exists, never after
    for (int k = 0; k < helpers; k++) {
      try {
        threads_.emplace_back([this] { loop(); });
      } catch (const std::system_error &) { break; }
    }
  }
  ~ReadPool() {
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto &t : threads_) t.join();
  }
  ReadPool(const ReadPool &) = delete;
  ReadPool &operator=(const ReadPool &) = delete;
  int helpers() const { return int(threads_.size()); }
  // fn(k) for every k in [0, parts), on the helpers and the calling thread; returns once every
  // part has run. One job at a time: false (nothing run) while another caller's job holds the pool.
  bool run(int64_t parts, const std::function<void(int64_t)> &fn) {
    std::unique_lock<std::mutex> busy(run_m_, std::try_to_lock);
    if (!busy) return false;
    {
      std::lock_guard<std::mutex> g(m_);
      fn_ = &fn;
      parts_ = parts;
      next_.store(0, std::memory_order_relaxed);
      left_.store(parts, std::memory_order_relaxed);
      gen_++;
    }
    cv_.notify_all();
    work(fn, parts);
    std::unique_lock<std::mutex> l(m_);
    done_.wait(l, [&] { return left_.load(std::memory_order_acquire) == 0 && active_ == 0; });
    fn_ = nullptr;  // a helper waking late finds no job
    return true;
  }

 private:
  void work(const std::function<void(int64_t)> &fn, int64_t parts) {
    for (int64_t k; (k = next_.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      fn(k);
      if (left_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> g(m_);
        done_.notify_all();
      }
    }
  }
  void loop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> l(m_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || gen_ != seen; });
      if (stop_) return;
      seen = gen_;
      if (!fn_) continue;
      const std::function<void(int64_t)> *fn = fn_;
      const int64_t parts = parts_;
      active_++;
      l.unlock();
      work(*fn, parts);
      l.lock();
      if (--active_ == 0) done_.notify_all();
    }
  }
  std::vector<std::thread> threads_;
  std::mutex run_m_, m_;
  std::condition_variable cv_, done_;
  const std::function<void(int64_t)> *fn_ = nullptr;
  int64_t parts_ = 0;
  std::atomic<int64_t> next_{0}, left_{0};
  int active_ = 0;
  uint64_t gen_ = 0;
  bool stop_ = false;
};

struct LocalTable {
  static constexpr int64_t kSpanBytes = 65536;  // the longest coalesced read (a stack buffer)
  int fd = -1;
  int64_t rows = 0;
  uint64_t woff = 0, soff = 0;
  off_t size = 0;
  struct timespec mtime{};
  LocalReadOptions opt;
  // syscalls and bytes read, jobs and the ones split across readers (any thread)
  mutable std::atomic<int64_t> c_reads{0}, c_bytes{0}, c_jobs{0}, c_parallel{0};
  LocalTable(const std::string &path, uint64_t weight_offset, uint64_t scale_offset, int64_t nrows,
             const LocalReadOptions &o = LocalReadOptions{})
      : opt(o.resolved()) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
    struct stat st{};
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
    rows = nrows;
    woff = weight_offset;
    soff = scale_offset;
  }
  ~LocalTable() {
    pool_.reset();  // its helpers joined before the file is closed
    if (fd >= 0) ::close(fd);
  }
  LocalTable(const LocalTable &) = delete;
  LocalTable &operator=(const LocalTable &) = delete;
  bool unchanged() const {
    struct stat st{};
    return ::fstat(fd, &st) == 0 && st.st_size == size && st.st_mtim.tv_sec == mtime.tv_sec &&
           st.st_mtim.tv_nsec == mtime.tv_nsec;
  }
  bool read_all(uint8_t *dst, size_t n, uint64_t off) const {
    c_reads.fetch_add(1, std::memory_order_relaxed);
    c_bytes.fetch_add(int64_t(n), std::memory_order_relaxed);
    while (n) {
      const ssize_t got = ::pread(fd, dst, n, off_t(off));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      dst += got;
      n -= size_t(got);
      off += uint64_t(got);
    }
    return true;
  }
  // n packed rows of ids[0, n) into out[0, n * kRow) (see the top of this file).
  bool gather(const int64_t *ids, int64_t n, uint8_t *out) const {
    if (!unchanged()) return false;
    for (int64_t i = 0; i < n; i++)
      if (ids[i] < 0 || ids[i] >= rows) return false;
    c_jobs.fetch_add(1, std::memory_order_relaxed);
    bool ok = n <= 0;
    if (!ok && opt.coalesce && fits_keys(n)) {
      try {
        ok = gather_sorted(ids, n, out);
      } catch (const std::bad_alloc &) {  // no memory for the sort: the rows one by one
        ok = gather_rows(ids, n, out);
      }
    } else if (!ok) {
      ok = gather_rows(ids, n, out);
    }
    return ok && unchanged();  // changed while read: these rows may mix old and new bytes
  }

 private:
  // One region's reads: its offset, bytes per row and place in a packed row.
  struct Region {
    uint64_t off;
    int64_t stride, at;
  };
  // The sort key of request position i: (id << pbits) | i, so a sorted key names its id and where
  // it goes; false where an id and a position do not fit 64 bits together (then rows are read one
  // by one).
  static int bits(uint64_t v) { return v ? 64 - __builtin_clzll(v) : 1; }
  bool fits_keys(int64_t n) const { return bits(uint64_t(rows - 1)) + bits(uint64_t(n - 1)) <= 64; }

  mutable std::mutex pool_m_;
  mutable std::unique_ptr<ReadPool> pool_;
  mutable bool pool_tried_ = false;
  ReadPool *pool() const {
    std::lock_guard<std::mutex> g(pool_m_);
    if (!pool_tried_) {
      pool_tried_ = true;
      try {
        if (opt.readers > 1) pool_ = std::make_unique<ReadPool>(opt.readers - 1);
      } catch (const std::exception &) {}  // no pool: every job on its calling thread
    }
    return pool_ && pool_->helpers() ? pool_.get() : nullptr;
  }
  // fn(k) for k in [0, parts): split across the readers for a job of more than parallel_rows rows
  // (while the pool is free), else in turn on the calling thread.
  void run_parts(int64_t n, int64_t parts, const std::function<void(int64_t)> &fn) const {
    ReadPool *p = n > opt.parallel_rows ? pool() : nullptr;
    if (p && p->run(parts, fn)) {
      c_parallel.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    for (int64_t k = 0; k < parts; k++) fn(k);
  }
  int64_t parts_for(int64_t units) const { return std::max<int64_t>(1, std::min<int64_t>(units, opt.readers * 4)); }

  // The reader before this one: two preads per row, in request order (split across the readers
  // by contiguous positions for a large job).
  bool gather_rows(const int64_t *ids, int64_t n, uint8_t *out) const {
    std::atomic<bool> bad{false};
    const int64_t parts = parts_for(n);
    run_parts(n, parts, [&](int64_t k) {
      for (int64_t i = n * k / parts, e = n * (k + 1) / parts; i < e && !bad.load(std::memory_order_relaxed); i++)
        if (!read_all(out + i * kRow, kW, woff + uint64_t(ids[i]) * kW) ||
            !read_all(out + i * kRow + kW, kS, soff + uint64_t(ids[i]) * kS))
          bad.store(true, std::memory_order_relaxed);
    });
    return !bad.load();
  }

  // Sorted, deduplicated, coalesced (see the top of this file).
  bool gather_sorted(const int64_t *ids, int64_t n, uint8_t *out) const {
    const int pbits = bits(uint64_t(n - 1));
    const uint64_t pmask = (1ull << pbits) - 1;  // pbits < 64: fits_keys
    std::vector<uint64_t> keys(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; i++) keys[size_t(i)] = (uint64_t(ids[i]) << pbits) | uint64_t(i);
    std::sort(keys.begin(), keys.end());
    // first[u]: the first key of distinct id u (first[nu] = n)
    std::vector<int64_t> first;
    first.reserve(size_t(n) + 1);
    for (int64_t j = 0; j < n; j++)
      if (j == 0 || (keys[size_t(j)] >> pbits) != (keys[size_t(j) - 1] >> pbits)) first.push_back(j);
    const int64_t nu = int64_t(first.size());
    first.push_back(n);
    auto id_of = [&](int64_t u) { return int64_t(keys[size_t(first[size_t(u)])] >> pbits); };
    // spans of distinct ids per region: [seg[s], seg[s + 1]) read with one pread
    const Region regs[2] = {{woff, int64_t(kW), 0}, {soff, int64_t(kS), int64_t(kW)}};
    std::vector<int64_t> segs[2];
    for (int r = 0; r < 2; r++) {
      const int64_t stride = regs[r].stride, max_rows = std::max<int64_t>(1, kSpanBytes / stride);
      auto &sg = segs[r];
      int64_t start = 0, prev = 0;
      for (int64_t u = 0; u < nu; u++) {
        const int64_t id = id_of(u);
        if (u == 0 || (id - prev - 1) * stride > opt.gap_bytes || id - start >= max_rows) {
          sg.push_back(u);
          start = id;
        }
        prev = id;
      }
      sg.push_back(nu);
    }
    const int64_t nw = int64_t(segs[0].size()) - 1, units = nw + int64_t(segs[1].size()) - 1;
    std::atomic<bool> bad{false};
    auto read_seg = [&](int r, int64_t s, uint8_t *buf) {
      const Region &g = regs[r];
      const int64_t u0 = segs[r][size_t(s)], u1 = segs[r][size_t(s) + 1];
      const int64_t id0 = id_of(u0), len = (id_of(u1 - 1) - id0 + 1) * g.stride;
      const uint64_t k0 = keys[size_t(first[size_t(u0)])];
      // one row: straight into its first place; a span: through the buffer
      uint8_t *dst = u1 - u0 == 1 ? out + int64_t(k0 & pmask) * kRow + g.at : buf;
      if (!read_all(dst, size_t(len), g.off + uint64_t(id0) * uint64_t(g.stride))) return false;
      for (int64_t u = u0; u < u1; u++) {
        const uint8_t *src = dst == buf ? buf + (id_of(u) - id0) * g.stride : dst;
        for (int64_t j = first[size_t(u)]; j < first[size_t(u) + 1]; j++) {
          uint8_t *to = out + int64_t(keys[size_t(j)] & pmask) * kRow + g.at;
          if (to != src) std::memcpy(to, src, size_t(g.stride));
        }
      }
      return true;
    };
    const int64_t parts = parts_for(units);
    run_parts(n, parts, [&](int64_t k) {
      alignas(64) uint8_t buf[kSpanBytes];
      for (int64_t i = units * k / parts, e = units * (k + 1) / parts; i < e; i++) {
        if (bad.load(std::memory_order_relaxed)) return;
        if (!(i < nw ? read_seg(0, i, buf) : read_seg(1, i - nw, buf))) bad.store(true, std::memory_order_relaxed);
      }
    });
    return !bad.load();
  }
};

}  // namespace
