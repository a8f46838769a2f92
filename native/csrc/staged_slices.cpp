// See staged_slices.h. Host code only: it writes words for the load issuer, it calls nothing.

#include "staged_slices.h"

#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "load_issuer.h"

namespace kvstrata {

namespace {

class Words {
 public:
  Words(int64_t* out, int64_t capacity) : out_(out), capacity_(capacity) {}
  void put(std::initializer_list<int64_t> values) {
    if (n_ + static_cast<int64_t>(values.size()) > capacity_)
      throw std::length_error("kvstrata staged slices: the program needs more than " + std::to_string(capacity_) +
                              " words");
    for (int64_t v : values) out_[n_++] = v;
  }
  int64_t size() const { return n_; }

 private:
  int64_t* out_;
  int64_t capacity_;
  int64_t n_ = 0;
};

}  // namespace

std::pair<int64_t, int64_t> write_staged_slices(const int64_t* slices, int64_t n_slices, int64_t layers_per_piece,
                                                const int64_t* kinds, int64_t n_kinds, const int64_t* jobs,
                                                int64_t* buffers, int64_t n_buffers, int64_t first_piece,
                                                const int64_t* launch, int64_t* out, int64_t capacity,
                                                int64_t* marks_at) {
  if (layers_per_piece <= 0 || n_buffers <= 0 || first_piece < 0)
    throw std::invalid_argument("kvstrata staged slices: layers_per_piece and n_buffers must be positive");
  const int64_t copy_s = launch[0], kernel_s = launch[1], planes = launch[2], n_tok = launch[3], kv = launch[4],
                num_layers = launch[5], row_bytes = launch[6], head_bytes = launch[7], head_stride = launch[8],
                max_ctas = launch[9], device = launch[10];
  Words w(out, capacity);
  int64_t piece = 0;
  for (int64_t s = 0; s < n_slices; ++s) {
    const int64_t start = slices[kSliceWords * s], count = slices[kSliceWords * s + 1];
    const int64_t event = slices[kSliceWords * s + 2];
    if (count <= 0 || start < 0 || start + count > num_layers)
      throw std::invalid_argument("kvstrata staged slices: slice [" + std::to_string(start) + ", " +
                                  std::to_string(start + count) + ") is outside " + std::to_string(num_layers) +
                                  " layers");
    for (int64_t first = start; first < start + count; first += layers_per_piece) {
      const int64_t n = std::min(layers_per_piece, start + count - first);
      const int64_t* kind = nullptr;
      for (int64_t k = 0; k < n_kinds && kind == nullptr; ++k)
        if (kinds[kPieceKindWords * k] == n) kind = kinds + kPieceKindWords * k;
      if (kind == nullptr)
        throw std::invalid_argument("kvstrata staged slices: no piece kind of " + std::to_string(n) + " layers");
      const int64_t table = kind[1], vec = kind[2], job0 = kind[3], n_jobs = kind[4];
      int64_t* buffer = buffers + kBufferWords * ((first_piece + piece++) % n_buffers);
      const int64_t stage = buffer[0], filled = buffer[1], idle = buffer[2];
      if (buffer[3]) w.put({kOpWaitEvent, 2, copy_s, idle});  // whatever used this buffer last is done
      w.put({kOpMemcpy2D, 2 + 6 * n_jobs, copy_s, n_jobs});
      for (int64_t j = job0; j < job0 + n_jobs; ++j) {
        const int64_t* job = jobs + kPieceJobWords * j;
        w.put({job[0] + stage, job[1], job[2] + first * job[6], job[3], job[4], job[5]});
      }
      w.put({kOpRecordEvent, 2, filled, copy_s, kOpWaitEvent, 2, kernel_s, filled});
      // the scatter launch's 18 arguments (binding.cpp's copy): staging -> engine layout
      w.put({kOpCopy, 18, 1, planes, table, stage, n_tok, kv, num_layers, first, n, n, 0, row_bytes, head_bytes,
             head_stride, vec, max_ctas, device, kernel_s});
      w.put({kOpRecordEvent, 2, idle, kernel_s});
      buffer[3] = 1;
    }
    w.put({kOpRecordEvent, 2, event, kernel_s});
    marks_at[s] = w.size();
    w.put({kOpMark, 1, 0});
  }
  return {w.size(), piece};
}

}  // namespace kvstrata
