// Python binding for the kvstrata CUDA kernels (built by kvstrata.native.cuda_ext).
//
// Everything crosses as plain integers (device addresses, stream handles): the
// per-slice call must cost microseconds, and no torch headers keeps the build short.

#include <poll.h>
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "kvstrata_cuda.h"
#include "load_issuer.h"
#include "staged_slices.h"

namespace py = pybind11;

namespace {

void copy(bool scatter, uintptr_t planes, uintptr_t tokens, uint64_t src_base, int64_t n_tok, int32_t kv,
          int32_t num_layers, int32_t layer_offset, int32_t staged_layers, int32_t src_layers, int32_t src_layer0,
          int32_t row_bytes, int32_t head_bytes, int64_t head_stride, int vec_bytes, int max_ctas, int device,
          uintptr_t stream) {
  kvstrata::CopyDesc d{};
  d.planes = reinterpret_cast<const uint64_t*>(planes);
  d.tokens = reinterpret_cast<const int64_t*>(tokens);
  d.src_base = src_base;
  d.n_tok = n_tok;
  d.kv = kv;
  d.num_layers = num_layers;
  d.layer_offset = layer_offset;
  d.staged_layers = staged_layers;
  d.src_layers = src_layers;
  d.src_layer0 = src_layer0;
  d.row_bytes = row_bytes;
  d.head_bytes = head_bytes;
  d.head_stride = head_stride;
  kvstrata::launch_copy(d, scatter, vec_bytes, max_ctas, device, stream);
}

// Poll a file descriptor without sleeping and without the GIL until it is readable or
// max_us passed. On a virtual machine a thread that sleeps in the kernel takes 0.1 to
// 0.5 ms to wake; one that spins here sees a socket's signal at once, while the
// process's Python threads run undisturbed.
//
// With warm_stream, the spin also queries that stream every 50 us. The host work of a
// transfer's first slice took 4.5x longer after 20 ms asleep than back to back, and still
// 3.2x after 20 ms of spinning, but 1.9x when the spin kept calling the CUDA driver
// (benchmarks/profile_host.py --idle-study on the H200): the driver's own code and data
// go cold between transfers, and a query keeps them resident at no cost to the GPU.
bool spin_until_readable(int fd, int64_t max_us, uintptr_t warm_stream) {
  py::gil_scoped_release no_gil;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::microseconds(max_us);
  auto next_touch = start;
  struct pollfd p {};
  p.fd = fd;
  p.events = POLLIN;
  do {
    p.revents = 0;
    if (::poll(&p, 1, 0) > 0) return true;
    if (warm_stream != 0) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_touch) {
        kvstrata::touch_stream(warm_stream);
        next_touch = now + std::chrono::microseconds(50);
      }
    }
  } while (std::chrono::steady_clock::now() < deadline);
  return false;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvstrata scatter/gather kernels with a layer selector (layer_offset, staged_layers)";
  m.def("copy", &copy, "Launch one scatter (L1 -> engine) or gather (engine -> L1) over a layer slice",
        py::arg("scatter"), py::arg("planes"), py::arg("tokens"), py::arg("src_base"), py::arg("n_tok"),
        py::arg("kv"), py::arg("num_layers"), py::arg("layer_offset"), py::arg("staged_layers"),
        py::arg("src_layers"), py::arg("src_layer0"), py::arg("row_bytes"), py::arg("head_bytes"),
        py::arg("head_stride"), py::arg("vec_bytes"), py::arg("max_ctas"), py::arg("device"), py::arg("stream"));
  m.def(
      "build_table",
      [](uintptr_t copies, int n_copies, uintptr_t blocks, int64_t row_bytes, int64_t block_size, int64_t block_stride,
         int64_t token_stride, int64_t n_tok, uintptr_t table, int device, uintptr_t stream) {
        kvstrata::build_table(reinterpret_cast<const int64_t*>(copies), n_copies,
                              reinterpret_cast<const int64_t*>(blocks), row_bytes, block_size, block_stride,
                              token_stride, n_tok, reinterpret_cast<int64_t*>(table), device, stream);
      },
      "Build the per-token {staged address, staged layer stride, engine offset} table on the device",
      py::arg("copies"), py::arg("n_copies"), py::arg("blocks"), py::arg("row_bytes"), py::arg("block_size"),
      py::arg("block_stride"), py::arg("token_stride"), py::arg("n_tok"), py::arg("table"), py::arg("device"),
      py::arg("stream"));
  m.def(
      "build_table_from_host",
      [](uintptr_t host, int n_copies, int64_t n_blocks, uintptr_t dev, int64_t row_bytes, int64_t block_size,
         int64_t block_stride, int64_t token_stride, int64_t n_tok, int device, uintptr_t stream) {
        kvstrata::build_table_from_host(reinterpret_cast<const int64_t*>(host), n_copies, n_blocks,
                                        reinterpret_cast<int64_t*>(dev), row_bytes, block_size, block_stride,
                                        token_stride, n_tok, device, stream);
      },
      "Upload copies + block table from pinned host memory and build the token table after them, in one call",
      py::arg("host"), py::arg("n_copies"), py::arg("n_blocks"), py::arg("dev"), py::arg("row_bytes"),
      py::arg("block_size"), py::arg("block_stride"), py::arg("token_stride"), py::arg("n_tok"), py::arg("device"),
      py::arg("stream"));
  m.def("event_record", &kvstrata::event_record, "cudaEventRecord(event, stream) on raw handles", py::arg("event"),
        py::arg("stream"));
  m.def("stream_wait_event", &kvstrata::stream_wait_event, "cudaStreamWaitEvent(stream, event) on raw handles",
        py::arg("stream"), py::arg("event"));
  m.def("event_query", &kvstrata::event_query, "cudaEventQuery on a raw handle: True once complete",
        py::arg("event"));
  m.def(
      "memcpy_runs",
      [](uintptr_t runs, int64_t n_runs, int device, uintptr_t stream) {
        kvstrata::memcpy_runs(reinterpret_cast<const int64_t*>(runs), n_runs, device, stream);
      },
      "cudaMemcpyAsync each {dst, src, bytes} row of a host int64 array", py::arg("runs"), py::arg("n_runs"),
      py::arg("device"), py::arg("stream"));
  m.def(
      "memcpy2d_runs",
      [](uintptr_t runs, int64_t n_runs, int device, uintptr_t stream) {
        kvstrata::memcpy2d_runs(reinterpret_cast<const int64_t*>(runs), n_runs, device, stream);
      },
      "one copy-engine job per {dst, dpitch, src, spitch, width, height} row of a host int64 array",
      py::arg("runs"), py::arg("n_runs"), py::arg("device"), py::arg("stream"));
  m.def("signal_host", &kvstrata::signal_host,
        "After the work enqueued so far on stream, store value (64-bit) at dev_word, a mapped host word's "
        "device pointer", py::arg("dev_word"), py::arg("value"), py::arg("device"), py::arg("stream"));
  // Registering pins every page (a third of a second per GiB or more): the GIL goes meanwhile, so a pool registered
  // on a thread of its own does not stop the engine's Python.
  m.def("host_register", &kvstrata::host_register,
        "Pin (cudaHostRegister, portable + mapped, read-only if asked) a host range once; returns its device "
        "pointer", py::arg("ptr"), py::arg("size"), py::arg("device"), py::arg("read_only") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("host_device_pointer", &kvstrata::host_device_pointer, py::arg("ptr"), py::arg("device"));
  m.def("host_unregister", &kvstrata::host_unregister, py::arg("ptr"), py::call_guard<py::gil_scoped_release>());
  m.def("sm_count", &kvstrata::sm_count, py::arg("device"));
  m.def(
      "event_synchronize",
      [](uintptr_t event) {
        py::gil_scoped_release no_gil;
        kvstrata::event_synchronize(event);
      },
      "cudaEventSynchronize on a raw handle, without the GIL", py::arg("event"));
  py::class_<kvstrata::LoadIssuer>(m, "LoadIssuer",
                                   "A native thread issuing recorded copy programs in submission order "
                                   "(load_issuer.h)")
      .def(py::init<int>(), py::arg("device"))
      .def(
          "submit",
          [](kvstrata::LoadIssuer& self, uintptr_t words, int64_t n_words) {
            self.submit(reinterpret_cast<const int64_t*>(words), n_words);
          },
          "Queue the program of n_words int64 words at address words (copied before this returns)",
          py::arg("words"), py::arg("n_words"))
      .def("issued_mark", &kvstrata::LoadIssuer::issued_mark)
      .def("wait_mark", &kvstrata::LoadIssuer::wait_mark, py::call_guard<py::gil_scoped_release>(),
           "Wait without the GIL until mark is issued or timeout_us passed; whether it was", py::arg("mark"),
           py::arg("timeout_us"))
      .def("mark_error", &kvstrata::LoadIssuer::mark_error, py::arg("mark"))
      .def("close", &kvstrata::LoadIssuer::close, py::call_guard<py::gil_scoped_release>());
  m.def(
      "write_staged_slices",
      [](uintptr_t slices, int64_t n_slices, int64_t layers_per_piece, uintptr_t kinds, int64_t n_kinds,
         uintptr_t jobs, uintptr_t buffers, int64_t n_buffers, int64_t first_piece, uintptr_t launch, uintptr_t out,
         int64_t capacity, uintptr_t marks_at) {
        return kvstrata::write_staged_slices(
            reinterpret_cast<const int64_t*>(slices), n_slices, layers_per_piece,
            reinterpret_cast<const int64_t*>(kinds), n_kinds, reinterpret_cast<const int64_t*>(jobs),
            reinterpret_cast<int64_t*>(buffers), n_buffers, first_piece, reinterpret_cast<const int64_t*>(launch),
            reinterpret_cast<int64_t*>(out), capacity, reinterpret_cast<int64_t*>(marks_at));
      },
      "Write the load issuer's program of a load's staged slices into out (staged_slices.h); returns (words, "
      "pieces)",
      py::arg("slices"), py::arg("n_slices"), py::arg("layers_per_piece"), py::arg("kinds"), py::arg("n_kinds"),
      py::arg("jobs"), py::arg("buffers"), py::arg("n_buffers"), py::arg("first_piece"), py::arg("launch"),
      py::arg("out"), py::arg("capacity"), py::arg("marks_at"));
  m.def("spin_until_readable", &spin_until_readable,
        "Poll fd without sleeping and without the GIL until readable (True) or max_us passed (False); with "
        "warm_stream, query that CUDA stream every 50 us meanwhile",
        py::arg("fd"), py::arg("max_us"), py::arg("warm_stream") = 0);
}
