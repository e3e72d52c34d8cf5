// C++ worker core of the vLLM overlay's Engram layer (dsv41/overlay/engram_worker.py), the
// extension dsv41.overlay._core; its concerns live in core_*.h (one translation unit: the
// headers' definitions keep internal linkage). It sends its requests with the transport's
// client path (dsv41/transport/client.h) on a connection a row source lends it.
//
// ---- the vLLM overlay's Engram worker core (dsv41/overlay/engram_worker.py) ----
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
// serve_pieces (its pieces share one buffer layout and one connection, so they cannot interleave
// with another job's).

#include "dsv41/overlay/core_engram.h"
#include "dsv41/overlay/core_stream.h"

// The core's plan of a multi-piece job (PiecePlan, as EngramCore::serve_pieces runs it) on given
// buffers: `ahead` plans piece 0 here (only its first `head` rows when 0 < head < piece 0's rows,
// the rest of it then first on the planner thread) and the rest on the planner thread, waited for
// piece by piece; otherwise every piece in turn. Returns (owned ids per piece, whether an owned id
// is at or past `limit`). `tail`: piece_layout's tail_rows. For the tests that the orders give the same pieces.
py::tuple plan_pieces(py::array_t<int64_t, py::array::c_style> ids, int64_t lo, int64_t hi, uint64_t limit,
                      int64_t piece_rows, py::array_t<int32_t, py::array::c_style> sel,
                      py::array_t<int64_t, py::array::c_style> fetch, bool ahead, int64_t head, Tails tail) {
  const ssize_t r = ids.size();
  if (sel.size() < r || fetch.size() < r)
    throw std::invalid_argument("plan_pieces: sel and fetch need ids.size() entries");
  if (piece_rows <= 0 || r > INT32_MAX)
    throw std::invalid_argument("plan_pieces: piece_rows must be > 0 and ids < 2^31");
  EngramSlot slot;
  slot.ids = ids.data();
  slot.hbuf = reinterpret_cast<uint8_t *>(sel.mutable_data());
  slot.fetch = fetch.mutable_data();
  slot.lo = lo;
  slot.hi = hi;
  slot.limit = limit;
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

// A LocalTable's options as a dict (readers resolved) and its counters.
py::dict local_options(const LocalTable &t) {
  using namespace pybind11::literals;
  return py::dict("readers"_a = t.opt.readers, "parallel_rows"_a = t.opt.parallel_rows, "gap_bytes"_a = t.opt.gap_bytes,
                  "coalesce"_a = t.opt.coalesce);
}

PYBIND11_MODULE(_core, m) {
  m.doc() = "C++ worker core of the vLLM overlay's Engram layer (slots, planner, GPU join, watchdog).";
  py::class_<EngramSlot, std::shared_ptr<EngramSlot>>(m, "EngramSlot")
      .def(py::init([](int64_t key) {
             auto s = std::make_shared<EngramSlot>();
             s->key = key;
             return s;
           }),
           py::arg("key"))
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
      .def(
          "set_local",
          [](EngramSlot &s, const std::string &path, uint64_t wo, uint64_t so, int64_t rows, int readers,
             int64_t parallel_rows, int64_t gap_bytes, bool coalesce) {
            s.set_local(path, wo, so, rows, LocalReadOptions{readers, parallel_rows, gap_bytes, coalesce});
          },
          py::arg("path"), py::arg("weight_offset"), py::arg("scale_offset"), py::arg("rows"),
          py::arg("readers") = LocalReadOptions{}.readers, py::arg("parallel_rows") = LocalReadOptions{}.parallel_rows,
          py::arg("gap_bytes") = LocalReadOptions{}.gap_bytes, py::arg("coalesce") = LocalReadOptions{}.coalesce)
      .def("local_options",
           [](EngramSlot &s) -> py::object {
             std::shared_ptr<LocalTable> t;
             {
               std::lock_guard<std::mutex> g(s.m);
               t = s.local;
             }
             if (t) return local_options(*t);
             return py::none();
           })
      .def("gj_ready", &EngramSlot::gj_ready)
      .def("gj_queue", &EngramSlot::gj_queue, py::arg("stream"), py::arg("gen"), py::arg("rows"), py::arg("out"),
           py::arg("piece_rows"), py::arg("tail_rows"), py::arg("done_event"))
      .def("gj_stream_waits", &EngramSlot::gj_stream_waits, py::arg("stream"), py::arg("event"), py::arg("event2") = 0)
      .def("gj_done", [](EngramSlot &s) { return s.gj_done.load(); })
      .def("gj_counters",
           [](EngramSlot &s) {
             py::dict d;
             d["gj_jobs"] = s.gj_jobs.load();
             d["gj_fallback_jobs"] = s.gj_fallback_jobs.load();
             d["gj_fallback_rows"] = s.gj_fallback_rows.load();
             d["gj_takeovers"] = s.gj_takeovers.load();
             d["gj_bad_pieces"] = s.gj_bad.load();
             return d;
           })
      // the unit tests' stand-in for the GPU, on a slot with words: the ids word's write and the flags
      .def("gj_test_words",
           [](EngramSlot &s) {
             std::lock_guard<std::mutex> g(s.m);
             if (!s.gj_host) s.gj_host = new uint64_t[EngramSlot::kGjWords]();  // plain host memory, no CUDA (tests)
           })
      .def("gj_write_ids",
           [](EngramSlot &s, uint64_t gen) {
             if (!s.gj_host) throw std::runtime_error("no GPU-join words");
             __atomic_store_n(&s.gj_host[0], gen, __ATOMIC_RELEASE);
           })
      .def("gj_flags",
           [](EngramSlot &s, size_t n) {
             if (!s.gj_host) throw std::runtime_error("no GPU-join words");
             std::vector<uint64_t> v;
             for (size_t k = 0; k < n && EngramSlot::kGjFlag0 + k < EngramSlot::kGjWords; k++)
               v.push_back(__atomic_load_n(&s.gj_host[EngramSlot::kGjFlag0 + k], __ATOMIC_ACQUIRE));
             return v;
           })
      .def("wait_times",
           [](EngramSlot &s) { return py::make_tuple(s.w_gen, s.w_enter, s.w_seen, s.w_queued, s.w_gil); });
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
  // A shard's exact rows as the core reads them (tests, tests/perf): gather(ids, out) fills
  // out[:n * 264] with the packed rows of int64 ids (GIL released); False as the core's gather.
  py::class_<LocalTable, std::shared_ptr<LocalTable>>(m, "LocalTable")
      .def(py::init([](const std::string &path, uint64_t wo, uint64_t so, int64_t rows, int readers,
                       int64_t parallel_rows, int64_t gap_bytes, bool coalesce) {
             return std::make_shared<LocalTable>(path, wo, so, rows,
                                                 LocalReadOptions{readers, parallel_rows, gap_bytes, coalesce});
           }),
           py::arg("path"), py::arg("weight_offset"), py::arg("scale_offset"), py::arg("rows"),
           py::arg("readers") = LocalReadOptions{}.readers, py::arg("parallel_rows") = LocalReadOptions{}.parallel_rows,
           py::arg("gap_bytes") = LocalReadOptions{}.gap_bytes, py::arg("coalesce") = LocalReadOptions{}.coalesce)
      .def(
          "gather",
          [](const LocalTable &t, py::array_t<int64_t, py::array::c_style> ids,
             py::array_t<uint8_t, py::array::c_style> out) {
            const int64_t n = int64_t(ids.size());
            if (out.size() < n * int64_t(kRow)) throw std::invalid_argument("gather: out needs ids.size() * 264 bytes");
            const int64_t *p = ids.data();
            uint8_t *o = out.mutable_data();
            py::gil_scoped_release nogil;
            return t.gather(p, n, o);
          },
          py::arg("ids").noconvert(), py::arg("out").noconvert())
      .def_property_readonly("options", &local_options)
      .def("counters", [](const LocalTable &t) {
        using namespace pybind11::literals;
        return py::dict("reads"_a = t.c_reads.load(), "bytes"_a = t.c_bytes.load(), "jobs"_a = t.c_jobs.load(),
                        "parallel_jobs"_a = t.c_parallel.load());
      });
  m.def("stream_mem_ops", &stream_mem_ops, py::arg("ordinal"));
  m.def("gj_watch_start", [] { return GjWatchdog::get().start(); });
  m.def("gj_watch_open", [] { return GjWatchdog::get().open(); });
  // noconvert: a dtype or layout mismatch must fail, never plan into a temporary copy
  m.def("plan_rows", &plan_rows, py::arg("ids").noconvert(), py::arg("lo"), py::arg("hi"), py::arg("sel").noconvert(),
        py::arg("fetch").noconvert());
  m.def("plan_pieces", &plan_pieces, py::arg("ids").noconvert(), py::arg("lo"), py::arg("hi"), py::arg("limit"),
        py::arg("piece_rows"), py::arg("sel").noconvert(), py::arg("fetch").noconvert(), py::arg("ahead"),
        py::arg("head") = 0, py::arg("tail") = Tails{});
}
