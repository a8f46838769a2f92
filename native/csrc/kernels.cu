// kvstrata CUDA kernels: scatter (L1 object -> engine paged cache) and gather (engine -> L1).
//
// Every engine format reduces to one strided description (core/layouts.py): the
// bytes of (layer l, plane k, block b, token t, head h) start at
//     plane[l * kv + k] + b * block_stride + t * token_stride + h * head_stride
// and run head_bytes contiguous bytes. The host precomputes, once per transfer,
// a per-token table {source address, source layer stride, engine offset}, so the
// kernel needs no knowledge of block tables, chunk boundaries or which engine it
// is writing.
//
// Layer selector: a launch covers `staged_layers` slots. Slot s is engine layer
// `layer_offset + s`; on the staged (L1) side it is layer `src_layer0 + s` of a
// plane that holds `src_layers` layers, i.e. `src_layers` is the stride divisor
// of the staged side. Reading an L1 object in place means src_layers = all layers
// and src_layer0 = layer_offset; reading a slice-sized staging buffer means
// src_layers = staged_layers and src_layer0 = 0. staged_layers = all layers and
// layer_offset = 0 is the chunk-major launch, with exactly the all-layer addressing.
//
// The source side may be pinned host memory read through its device pointer
// (no staging buffer, no per-range memcpy: one launch moves a whole slice of
// every object), or a device staging buffer filled by the copy engine.
//
// Kept free of torch headers so it compiles in seconds.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kvstrata_cuda.h"

namespace kvstrata {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // independent loads in flight per thread before the first store

template <typename V, bool kScatter>
__global__ void __launch_bounds__(kThreads) copy_kernel(const CopyDesc d, const uint32_t n_tok) {
  // Flattened index over (kv plane, slot, token, vector-in-row), token fastest after the
  // vector so that consecutive threads read consecutive source bytes. Launches are split
  // on the host so the total fits 32 bits: no 64-bit division per element.
  const uint32_t vpr = static_cast<uint32_t>(d.row_bytes / sizeof(V));
  const uint32_t vph = static_cast<uint32_t>(d.head_bytes / sizeof(V));
  const uint32_t slots = static_cast<uint32_t>(d.staged_layers);
  const uint32_t total = static_cast<uint32_t>(d.kv) * slots * n_tok * vpr;
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t base = blockIdx.x * blockDim.x + threadIdx.x; base < total; base += stride * kUnroll) {
    V buf[kUnroll];
    char* out[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t idx = base + u * stride;
      out[u] = nullptr;
      if (idx < total) {
        const uint32_t row = idx / vpr;
        const uint32_t v = idx - row * vpr;
        const uint32_t t = row % n_tok;
        const uint32_t ks = row / n_tok;
        const uint32_t slot = ks % slots;
        const uint32_t k = ks / slots;
        const uint32_t h = v / vph;
        const uint32_t j = v - h * vph;
        const int64_t* tok = d.tokens + 3 * static_cast<uint64_t>(t);
        const int64_t src_layer = static_cast<int64_t>(k) * d.src_layers + d.src_layer0 + slot;
        char* staged = reinterpret_cast<char*>(d.src_base + tok[0] + src_layer * tok[1]) +
                       static_cast<uint64_t>(v) * sizeof(V);
        char* engine = reinterpret_cast<char*>(d.planes[(d.layer_offset + slot) * d.kv + k] + tok[2] +
                                               static_cast<int64_t>(h) * d.head_stride) +
                       static_cast<uint64_t>(j) * sizeof(V);
        // Global-space streaming loads: each source byte is read exactly once.
        if (kScatter) {
          buf[u] = __ldcs(reinterpret_cast<const V*>(staged));
          out[u] = engine;
        } else {
          buf[u] = __ldcs(reinterpret_cast<const V*>(engine));
          out[u] = staged;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (out[u] == nullptr) continue;
      // The engine reads scattered KV soon (keep it in L2); L1 objects are written once.
      if (kScatter) {
        __stcg(reinterpret_cast<V*>(out[u]), buf[u]);
      } else {
        __stcs(reinterpret_cast<V*>(out[u]), buf[u]);
      }
    }
  }
}

// One thread per transferred token: find its copy (binary search over the copies' first job
// token), then write {staged-side address, staged-side layer stride, engine offset}. Built on
// the device from a few hundred bytes of descriptors, so the host never touches per-token data.
__global__ void build_table_kernel(const int64_t* __restrict__ copies, int n_copies, const int64_t* __restrict__ blocks,
                                   int64_t row_bytes, int64_t block_size, int64_t block_stride, int64_t token_stride,
                                   int64_t n_tok, int64_t* __restrict__ table) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n_tok) return;
  int lo = 0, hi = n_copies - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (copies[5 * mid + 4] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t* c = copies + 5 * lo;  // src, src layer stride, dst position, tokens, first job token
  const int64_t local = t - c[4];
  const int64_t pos = c[2] + local;
  table[3 * t] = c[0] + local * row_bytes;
  table[3 * t + 1] = c[1];
  table[3 * t + 2] = blocks[pos / block_size] * block_stride + (pos % block_size) * token_stride;
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: a stale error would surface at the caller's next, unrelated CUDA call
    throw std::runtime_error(std::string("kvstrata CUDA: ") + what + " failed: " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

template <typename V, bool kScatter>
void launch_typed(const CopyDesc& desc, int max_ctas, cudaStream_t stream) {
  const uint64_t vpr = desc.row_bytes / sizeof(V);
  const uint64_t per_token = static_cast<uint64_t>(desc.kv) * desc.staged_layers * vpr;
  if (per_token == 0 || desc.n_tok == 0) return;
  // Split on tokens so every launch's flattened index fits comfortably in 32 bits.
  const uint64_t limit = (1ull << 31) / kUnroll;
  uint64_t tokens_per_launch = limit / per_token;
  if (tokens_per_launch == 0) {
    throw std::runtime_error("kvstrata CUDA: one token's row across the slice exceeds the per-launch index range");
  }
  for (int64_t first = 0; first < desc.n_tok; first += static_cast<int64_t>(tokens_per_launch)) {
    const uint64_t n = std::min<uint64_t>(tokens_per_launch, static_cast<uint64_t>(desc.n_tok - first));
    CopyDesc part = desc;
    part.tokens = desc.tokens + 3 * first;
    const uint64_t total = per_token * n;
    const uint64_t per_cta = static_cast<uint64_t>(kThreads) * kUnroll;
    uint64_t ctas = (total + per_cta - 1) / per_cta;
    if (max_ctas > 0 && ctas > static_cast<uint64_t>(max_ctas)) ctas = max_ctas;
    copy_kernel<V, kScatter><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(part, static_cast<uint32_t>(n));
    check(cudaGetLastError(), kScatter ? "scatter kernel launch" : "gather kernel launch");
  }
}

template <bool kScatter>
void launch_dir(const CopyDesc& desc, int vec_bytes, int max_ctas, cudaStream_t stream) {
  switch (vec_bytes) {
    case 16: return launch_typed<uint4, kScatter>(desc, max_ctas, stream);
    case 8: return launch_typed<uint2, kScatter>(desc, max_ctas, stream);
    case 4: return launch_typed<uint32_t, kScatter>(desc, max_ctas, stream);
    case 2: return launch_typed<uint16_t, kScatter>(desc, max_ctas, stream);
    case 1: return launch_typed<uint8_t, kScatter>(desc, max_ctas, stream);
    default: throw std::runtime_error("kvstrata CUDA: vector width must be 1, 2, 4, 8 or 16 bytes, got " +
                                      std::to_string(vec_bytes));
  }
}

void validate(const CopyDesc& d, int vec_bytes) {
  if (d.kv < 1 || d.kv > 2) throw std::runtime_error("kvstrata CUDA: kv must be 1 or 2");
  if (d.staged_layers < 1) throw std::runtime_error("kvstrata CUDA: staged_layers must be at least 1 here");
  if (d.layer_offset < 0 || d.layer_offset + d.staged_layers > d.num_layers) {
    throw std::runtime_error("kvstrata CUDA: layers [" + std::to_string(d.layer_offset) + ", " +
                             std::to_string(d.layer_offset + d.staged_layers) + ") outside the cache's " +
                             std::to_string(d.num_layers) + " layers");
  }
  if (d.src_layer0 < 0 || d.src_layer0 + d.staged_layers > d.src_layers) {
    throw std::runtime_error("kvstrata CUDA: staged side holds " + std::to_string(d.src_layers) +
                             " layers, launch reads [" + std::to_string(d.src_layer0) + ", " +
                             std::to_string(d.src_layer0 + d.staged_layers) + ")");
  }
  if (d.head_bytes <= 0 || d.row_bytes <= 0 || d.row_bytes % d.head_bytes || d.head_bytes % vec_bytes) {
    throw std::runtime_error("kvstrata CUDA: head_bytes " + std::to_string(d.head_bytes) + " / row_bytes " +
                             std::to_string(d.row_bytes) + " do not fit vector width " + std::to_string(vec_bytes));
  }
}

}  // namespace

void launch_copy(const CopyDesc& desc, bool scatter, int vec_bytes, int max_ctas, int device, uintptr_t stream) {
  validate(desc, vec_bytes);
  check(cudaSetDevice(device), "cudaSetDevice");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (scatter) {
    launch_dir<true>(desc, vec_bytes, max_ctas, s);
  } else {
    launch_dir<false>(desc, vec_bytes, max_ctas, s);
  }
}

void build_table(const int64_t* copies, int n_copies, const int64_t* blocks, int64_t row_bytes, int64_t block_size,
                 int64_t block_stride, int64_t token_stride, int64_t n_tok, int64_t* table, int device,
                 uintptr_t stream) {
  if (n_tok <= 0) return;
  if (n_copies <= 0) throw std::runtime_error("kvstrata CUDA: a token table needs at least one copy");
  check(cudaSetDevice(device), "cudaSetDevice");
  const int threads = 256;
  const int64_t grid = (n_tok + threads - 1) / threads;
  build_table_kernel<<<static_cast<unsigned>(grid), threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      copies, n_copies, blocks, row_bytes, block_size, block_stride, token_stride, n_tok, table);
  check(cudaGetLastError(), "token table kernel launch");
}

void build_table_from_host(const int64_t* host, int n_copies, int64_t n_blocks, int64_t* dev, int64_t row_bytes,
                           int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t n_tok, int device,
                           uintptr_t stream) {
  if (n_tok <= 0) return;
  check(cudaSetDevice(device), "cudaSetDevice");
  const size_t need = 5 * static_cast<size_t>(n_copies) + static_cast<size_t>(n_blocks);
  check(cudaMemcpyAsync(dev, host, need * sizeof(int64_t), cudaMemcpyHostToDevice,
                        reinterpret_cast<cudaStream_t>(stream)),
        "token table descriptors upload");
  build_table(dev, n_copies, dev + 5 * n_copies, row_bytes, block_size, block_stride, token_stride, n_tok,
              dev + need, device, stream);
}

void event_record(uintptr_t event, uintptr_t stream) {
  check(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), reinterpret_cast<cudaStream_t>(stream)),
        "cudaEventRecord");
}

void stream_wait_event(uintptr_t stream, uintptr_t event) {
  check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), reinterpret_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
}

bool event_query(uintptr_t event) {
  const cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) return false;
  check(err, "cudaEventQuery");
  return true;
}

void event_synchronize(uintptr_t event) {
  check(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
}

void memcpy_runs(const int64_t* runs, int64_t n_runs, int device, uintptr_t stream) {
  check(cudaSetDevice(device), "cudaSetDevice");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  for (int64_t i = 0; i < n_runs; ++i) {
    const int64_t* r = runs + 3 * i;
    check(cudaMemcpyAsync(reinterpret_cast<void*>(r[0]), reinterpret_cast<const void*>(r[1]),
                          static_cast<size_t>(r[2]), cudaMemcpyDefault, s),
          "cudaMemcpyAsync of a run");
  }
}

void memcpy2d_runs(const int64_t* runs, int64_t n_runs, int device, uintptr_t stream) {
  check(cudaSetDevice(device), "cudaSetDevice");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  for (int64_t i = 0; i < n_runs; ++i) {
    const int64_t* r = runs + 6 * i;  // dst, dpitch, src, spitch, width, height
    if (r[5] == 1) {
      check(cudaMemcpyAsync(reinterpret_cast<void*>(r[0]), reinterpret_cast<const void*>(r[2]),
                            static_cast<size_t>(r[4]), cudaMemcpyDefault, s),
            "cudaMemcpyAsync of a run");
    } else {
      check(cudaMemcpy2DAsync(reinterpret_cast<void*>(r[0]), static_cast<size_t>(r[1]),
                              reinterpret_cast<const void*>(r[2]), static_cast<size_t>(r[3]),
                              static_cast<size_t>(r[4]), static_cast<size_t>(r[5]), cudaMemcpyDefault, s),
            "cudaMemcpy2DAsync of equally spaced runs");
    }
  }
}

namespace {

__global__ void signal_host_kernel(volatile unsigned long long* word, unsigned long long value) {
  // Everything before this kernel on the stream has finished (stream order); make that visible to the
  // host before the word that announces it.
  __threadfence_system();
  *word = value;
  __threadfence_system();
}

}  // namespace

void signal_host(uintptr_t dev_word, uint64_t value, int device, uintptr_t stream) {
  check(cudaSetDevice(device), "cudaSetDevice");
  signal_host_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<volatile unsigned long long*>(dev_word), static_cast<unsigned long long>(value));
  check(cudaGetLastError(), "launch of the host-signal kernel");
}

uintptr_t host_register(uintptr_t ptr, size_t size, int device, bool read_only) {
  check(cudaSetDevice(device), "cudaSetDevice");
  // read_only: a mapping this process may only read (an engine's view of the server's L1 pool); the
  // device then only reads through it too.
  unsigned flags = cudaHostRegisterPortable | cudaHostRegisterMapped | (read_only ? cudaHostRegisterReadOnly : 0u);
  cudaError_t err = cudaHostRegister(reinterpret_cast<void*>(ptr), size, flags);
  if (err == cudaErrorHostMemoryAlreadyRegistered) {
    cudaGetLastError();  // clear the sticky-free error: already pinned is what we want
  } else {
    check(err, "cudaHostRegister");
  }
  return host_device_pointer(ptr, device);
}

uintptr_t host_device_pointer(uintptr_t ptr, int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  void* dev = nullptr;
  check(cudaHostGetDevicePointer(&dev, reinterpret_cast<void*>(ptr), 0), "cudaHostGetDevicePointer");
  return reinterpret_cast<uintptr_t>(dev);
}

void host_unregister(uintptr_t ptr) { check(cudaHostUnregister(reinterpret_cast<void*>(ptr)), "cudaHostUnregister"); }

int sm_count(int device) {
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return n;
}

void touch_stream(uintptr_t stream) {
  // cudaErrorNotReady is the usual answer and not an error; nothing is left pending in this thread's state.
  (void)cudaStreamQuery(reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace kvstrata
