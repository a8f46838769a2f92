// See load_issuer.h. Built with the host compiler: it calls the kernels' entry points, never the CUDA runtime.

#include "load_issuer.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "kvstrata_cuda.h"

namespace kvstrata {

namespace {

constexpr size_t kFailuresKept = 64;  // a waiter asks right after its program failed; older ones are long read

int64_t expected_args(int64_t op, const int64_t* args, int64_t available) {
  switch (op) {
    case kOpMemcpy2D: return available >= 2 ? 2 + 6 * args[1] : -1;
    case kOpMemcpy: return available >= 2 ? 2 + 3 * args[1] : -1;
    case kOpWaitEvent:
    case kOpRecordEvent: return 2;
    case kOpCopy: return 18;
    case kOpTableFromHost: return 10;
    case kOpMark: return 1;
    default: return -1;
  }
}

}  // namespace

LoadIssuer::LoadIssuer(int device) : device_(device) { thread_ = std::thread([this] { run(); }); }

LoadIssuer::~LoadIssuer() { close(); }

void LoadIssuer::submit(const int64_t* words, int64_t n_words) {
  for (int64_t i = 0; i < n_words;) {
    if (i + 2 > n_words) throw std::invalid_argument("kvstrata issuer: a program ends inside an op header");
    const int64_t op = words[i], n_args = words[i + 1];
    const int64_t want = expected_args(op, words + i + 2, n_words - i - 2);
    if (want < 0 || n_args != want || i + 2 + n_args > n_words)
      throw std::invalid_argument("kvstrata issuer: malformed op " + std::to_string(op) + " at word " +
                                  std::to_string(i));
    i += 2 + n_args;
  }
  Program p{std::vector<int64_t>(words, words + n_words)};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) throw std::runtime_error("kvstrata issuer: closed");
    queue_.push_back(std::move(p));
  }
  queued_cv_.notify_one();
}

bool LoadIssuer::wait_mark(uint64_t mark, int64_t timeout_us) {
  if (issued_mark() >= mark) return true;
  // A slice's mark is normally microseconds away: look for it without sleeping first, then sleep on the
  // condition (a sleeping thread takes 0.1-0.5 ms to wake on a virtual machine).
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::microseconds(timeout_us);
  const auto spin_until = start + std::chrono::microseconds(std::min<int64_t>(timeout_us, 200));
  while (std::chrono::steady_clock::now() < spin_until) {
    if (issued_mark() >= mark) return true;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  return issued_cv_.wait_until(lock, deadline, [&] { return issued_mark() >= mark; });
}

std::string LoadIssuer::mark_error(uint64_t mark) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& f : failures_)
    if (f.first.first <= mark && mark <= f.first.second) return f.second;
  return {};
}

void LoadIssuer::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_ && !thread_.joinable()) return;
    closing_ = true;
  }
  queued_cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void LoadIssuer::run() {
  while (true) {
    Program p;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queued_cv_.wait(lock, [&] { return closing_ || !queue_.empty(); });
      if (queue_.empty()) return;  // closing, and everything queued was issued
      p = std::move(queue_.front());
      queue_.pop_front();
    }
    execute(p);
  }
}

void LoadIssuer::execute(const Program& program) {
  const int64_t* w = program.words.data();
  const int64_t n = static_cast<int64_t>(program.words.size());
  int64_t i = 0;
  try {
    for (; i < n; i += 2 + w[i + 1]) {
      const int64_t* a = w + i + 2;
      switch (w[i]) {
        case kOpMemcpy2D: memcpy2d_runs(a + 2, a[1], device_, static_cast<uintptr_t>(a[0])); break;
        case kOpMemcpy: memcpy_runs(a + 2, a[1], device_, static_cast<uintptr_t>(a[0])); break;
        case kOpWaitEvent: stream_wait_event(static_cast<uintptr_t>(a[0]), static_cast<uintptr_t>(a[1])); break;
        case kOpRecordEvent: event_record(static_cast<uintptr_t>(a[0]), static_cast<uintptr_t>(a[1])); break;
        case kOpCopy: {
          CopyDesc d{};
          d.planes = reinterpret_cast<const uint64_t*>(a[1]);
          d.tokens = reinterpret_cast<const int64_t*>(a[2]);
          d.src_base = static_cast<uint64_t>(a[3]);
          d.n_tok = a[4];
          d.kv = static_cast<int32_t>(a[5]);
          d.num_layers = static_cast<int32_t>(a[6]);
          d.layer_offset = static_cast<int32_t>(a[7]);
          d.staged_layers = static_cast<int32_t>(a[8]);
          d.src_layers = static_cast<int32_t>(a[9]);
          d.src_layer0 = static_cast<int32_t>(a[10]);
          d.row_bytes = static_cast<int32_t>(a[11]);
          d.head_bytes = static_cast<int32_t>(a[12]);
          d.head_stride = a[13];
          launch_copy(d, a[0] != 0, static_cast<int>(a[14]), static_cast<int>(a[15]), static_cast<int>(a[16]),
                      static_cast<uintptr_t>(a[17]));
          break;
        }
        case kOpTableFromHost:
          build_table_from_host(reinterpret_cast<const int64_t*>(a[0]), static_cast<int>(a[1]), a[2],
                                reinterpret_cast<int64_t*>(a[3]), a[4], a[5], a[6], a[7], a[8], device_,
                                static_cast<uintptr_t>(a[9]));
          break;
        case kOpMark: {
          std::lock_guard<std::mutex> lock(mutex_);  // a waiter checks under it before it sleeps
          issued_mark_.store(static_cast<uint64_t>(a[0]), std::memory_order_release);
        }
          issued_cv_.notify_all();
          break;
      }
    }
  } catch (const std::exception& exc) {
    // The program stops here: its remaining marks are published as failed, so no waiter hangs and none takes
    // a slice whose copies were never issued for landed.
    uint64_t first = 0, last = 0;
    for (int64_t j = i; j < n; j += 2 + w[j + 1]) {
      if (w[j] == kOpMark) {
        if (first == 0) first = static_cast<uint64_t>(w[j + 2]);
        last = static_cast<uint64_t>(w[j + 2]);
      }
    }
    if (last != 0) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        failures_.emplace_back(std::make_pair(first, last), exc.what());
        while (failures_.size() > kFailuresKept) failures_.pop_front();
        issued_mark_.store(last, std::memory_order_release);
      }
      issued_cv_.notify_all();
    }
  }
}

}  // namespace kvstrata
