// LoadIssuer: one native thread per engine-placement copier that hands recorded copy programs to the GPU.
//
// Python plans a load (every slice's copy-engine jobs, waits, kernel launches and slice events) into a program
// of integer words in one pass, and submits it; this thread issues the program's driver calls in submission
// order, never holding or needing the GIL. So once a load is submitted, no Python thread of the engine process
// has to run for its slices to reach the GPU, whatever the engine's own thread is doing.
//
// A program is a sequence of ops, each `op, n_args, args...`. A MARK op says "everything before me is
// issued": the thread publishes its id (ids increase in submission order), and a layer wait that finds its
// slice's event not issued yet waits for that mark (wait_mark) before it waits on the event.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace kvstrata {

enum IssueOp : int64_t {
  kOpMemcpy2D = 1,        // stream, n_rows, rows[6 * n_rows] (dst, dpitch, src, spitch, width, height)
  kOpMemcpy = 2,          // stream, n_runs, runs[3 * n_runs] (dst, src, bytes)
  kOpWaitEvent = 3,       // stream, event
  kOpRecordEvent = 4,     // event, stream
  kOpCopy = 5,            // the 18 arguments of the scatter/gather launch (see binding.cpp's copy)
  kOpTableFromHost = 6,   // host, n_copies, n_blocks, dev, row_bytes, block_size, block_stride, token_stride,
                          // n_tok, stream
  kOpMark = 7,            // mark id
};

class LoadIssuer {
 public:
  explicit LoadIssuer(int device);
  ~LoadIssuer();
  LoadIssuer(const LoadIssuer&) = delete;
  LoadIssuer& operator=(const LoadIssuer&) = delete;

  // Copies the program and queues it; returns at once. Throws if the issuer is closed or the program is
  // malformed (checked here, on the caller's thread, so a bad program is the caller's error).
  void submit(const int64_t* words, int64_t n_words);
  // The highest mark issued so far.
  uint64_t issued_mark() const { return issued_mark_.load(std::memory_order_acquire); }
  // Waits until `mark` is issued or timeout_us passed; whether it was.
  bool wait_mark(uint64_t mark, int64_t timeout_us);
  // Empty if every op before `mark` was issued; else why the program holding it stopped.
  std::string mark_error(uint64_t mark) const;
  // Stops taking programs, issues what is queued, joins the thread.
  void close();

 private:
  struct Program {
    std::vector<int64_t> words;
  };
  void run();
  void execute(const Program& program);

  const int device_;
  mutable std::mutex mutex_;
  std::condition_variable queued_cv_;
  std::condition_variable issued_cv_;
  std::deque<Program> queue_;
  bool closing_ = false;
  std::atomic<uint64_t> issued_mark_{0};
  std::deque<std::pair<std::pair<uint64_t, uint64_t>, std::string>> failures_;  // (first, last mark), why
  std::thread thread_;
};

}  // namespace kvstrata
