// Launch descriptor and entry points shared by kernels.cu and binding.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvstrata {

// One scatter or gather launch. Addresses are device-visible byte addresses
// (device memory, or pinned host memory's device pointer).
struct CopyDesc {
  const uint64_t* planes;  // device array [num_layers * kv]: address of (block 0, token 0, head 0) per layer/plane
  const int64_t* tokens;   // device array [n_tok][3]: staged-side offset, staged-side layer stride, engine offset
  uint64_t src_base;       // added to tokens[t][0] (0 when the table holds absolute addresses)
  int64_t n_tok;
  int32_t kv;
  int32_t num_layers;     // engine layers (bounds check only)
  int32_t layer_offset;   // engine layer of slot 0
  int32_t staged_layers;  // slots in this launch (the grid's layer axis)
  int32_t src_layers;     // layers per kv plane on the staged side: its stride divisor
  int32_t src_layer0;     // staged-side layer of slot 0
  int32_t row_bytes;      // heads * head_bytes: one token of one layer and plane
  int32_t head_bytes;
  int64_t head_stride;    // engine bytes between heads of one token
};

void launch_copy(const CopyDesc& desc, bool scatter, int vec_bytes, int max_ctas, int device, uintptr_t stream);

// Per-token table from per-copy descriptors (device arrays): copies [n_copies][5] =
// {staged-side address of the copy's first token, staged-side layer stride, engine position of the first
// token, tokens, index of the first token in the job}; blocks = the block table. Writes table [n_tok][3].
void build_table(const int64_t* copies, int n_copies, const int64_t* blocks, int64_t row_bytes, int64_t block_size,
                 int64_t block_stride, int64_t token_stride, int64_t n_tok, int64_t* table, int device,
                 uintptr_t stream);

// The same from host memory in one call: uploads the descriptors and block table (pinned `host`, laid out
// copies then blocks) into `dev`, then builds the table right after them in `dev`.
void build_table_from_host(const int64_t* host, int n_copies, int64_t n_blocks, int64_t* dev, int64_t row_bytes,
                           int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t n_tok, int device,
                           uintptr_t stream);

// Raw event calls (handles as integers): a Python wrapper costs several times the driver call on the
// way to a transfer's first slice.
void event_record(uintptr_t event, uintptr_t stream);
void stream_wait_event(uintptr_t stream, uintptr_t event);
bool event_query(uintptr_t event);  // true once complete

// runs: host array [n_runs][3] of {dst, src, bytes}; one cudaMemcpyAsync each, issued here so
// the per-run cost is a driver call, not a Python call.
void memcpy_runs(const int64_t* runs, int64_t n_runs, int device, uintptr_t stream);

// runs: host array [n_runs][6] of {dst, dpitch, src, spitch, width, height}: one copy-engine job per row
// (cudaMemcpy2DAsync for height > 1), so equally spaced ranges cost one job instead of one each.
void memcpy2d_runs(const int64_t* runs, int64_t n_runs, int device, uintptr_t stream);

// After everything enqueued so far on `stream`, store `value` at `dev_word` (the device pointer of a
// mapped host word): the GPU announces a transfer's end to a host that polls memory, with no host thread
// between the copy's end and the announcement.
void signal_host(uintptr_t dev_word, uint64_t value, int device, uintptr_t stream);

uintptr_t host_register(uintptr_t ptr, size_t size, int device, bool read_only);
uintptr_t host_device_pointer(uintptr_t ptr, int device);
void host_unregister(uintptr_t ptr);
int sm_count(int device);

// cudaStreamQuery, result ignored: keeps the driver's paths warm while a thread waits (see spin_until_readable).
void touch_stream(uintptr_t stream);

}  // namespace kvstrata

namespace kvstrata {

// Blocks the calling thread (the binding releases the GIL) until the work before `event`'s last record has run.
void event_synchronize(uintptr_t event);

}  // namespace kvstrata
