// The load issuer's program for a load's staged slices, written natively.
//
// In staged mode each piece of a slice is the same handful of ops (wait for its staging buffer, copy host ->
// staging, hand the buffer to the kernel stream, scatter, mark the buffer idle), and a slice ends with its
// event's record and a mark. Written in Python that cost the engine's thread microseconds per piece, so a load
// of many thin slices (80 layers at width 1) spent most of its planning here, before the engine got its request
// back. Here the whole load's words are written in one call, whatever its slice count.
#pragma once

#include <cstdint>
#include <utility>

namespace kvstrata {

// Words per row of each input (see write_staged_slices).
constexpr int64_t kSliceWords = 3;        // layer start, layer count, event handle
constexpr int64_t kPieceKindWords = 5;    // layer count, token table address, vector bytes, first job, jobs
constexpr int64_t kPieceJobWords = 7;     // dst, dpitch, src, spitch, width, height, src shift per layer
constexpr int64_t kBufferWords = 4;       // staging address, filled event, idle event, used (0/1, updated)
constexpr int64_t kLaunchWords = 11;      // copy stream, kernel stream, planes, n_tok, kv, num_layers,
                                          // row_bytes, head_bytes, head_stride, max_ctas, device

// Writes the ops of `n_slices` slices into `out` (at most `capacity` words) and each slice's MARK op offset into
// `marks_at`; returns (words written, pieces written). A slice is split into pieces of at most
// `layers_per_piece` layers; a piece of n layers uses the piece kind whose layer count is n: its token table
// and its copy-engine jobs, which move the layer-0 piece into staging at 0 (dst is added the staging buffer's
// address, src the piece's first layer times the job's shift). Pieces take the buffers in turn from
// `first_piece % n_buffers`; a buffer used before is waited for, and is marked used. Throws
// std::invalid_argument on a slice outside the layers or a piece with no kind, std::length_error if `out` is
// too small: nothing is then valid in `out`, and `buffers` may be partly marked used (the caller drops the
// program and treats every buffer as used).
std::pair<int64_t, int64_t> write_staged_slices(const int64_t* slices, int64_t n_slices, int64_t layers_per_piece,
                                                const int64_t* kinds, int64_t n_kinds, const int64_t* jobs,
                                                int64_t* buffers, int64_t n_buffers, int64_t first_piece,
                                                const int64_t* launch, int64_t* out, int64_t capacity,
                                                int64_t* marks_at);

}  // namespace kvstrata
