// What the gbn_jax CPU kernels share: the XLA FFI API (as ffi), GBN_X86
// with the x86 intrinsics where the compiler targets x86-64, and ParallelFor,
// which runs fn(i) for i in [0, n_items) on XLA's intra-op thread pool
// (ffi::ThreadPool, or any pool with num_threads() and Schedule(task)).
#ifndef GBN_JAX_CSRC_CPU_KERNEL_H_
#define GBN_JAX_CSRC_CPU_KERNEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GBN_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace gbn_jax {

// Alike train/native/csrc/parallel_for.h: its copy, as train/ builds from
// train/native/csrc alone (its header says so); a fix to one goes to the other.
// Runs fn(i) for i in [0, n_items) on the caller and the pool's threads.
// Items are claimed from a shared counter and the caller waits only for items
// already started, so it cannot deadlock on a busy pool (nor when fn itself
// calls ParallelFor); a pool task that starts after the handler returned
// finds no items left and touches nothing but the shared counters.
// Exception-safe: an exception in fn (std::bad_alloc) is caught where it is
// thrown, the items not yet started are skipped, and once every started item
// has finished (fn lives on the caller's stack) the first one is rethrown on
// the caller's thread.
struct WorkCounters {
  explicit WorkCounters(int n) : total(n) {}
  const int total;
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable finished;
  std::exception_ptr error;  // the first exception of an item (under mutex)
};

template <class Pool, class Fn>
void ParallelFor(Pool& pool, int n_items, const Fn& fn) {
  if (n_items <= 0) return;
  const int helpers = int(std::min<int64_t>(n_items - 1, pool.num_threads()));
  if (helpers <= 0) {  // nothing runs beside the caller: exceptions just unwind
    for (int i = 0; i < n_items; ++i) fn(i);
    return;
  }
  auto counters = std::make_shared<WorkCounters>(n_items);
  auto work = [counters, fn_ptr = &fn]() noexcept {
    for (int i; (i = counters->next.fetch_add(1)) < counters->total;) {
      if (!counters->failed.load(std::memory_order_relaxed)) {
        try {
          (*fn_ptr)(i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(counters->mutex);
          if (!counters->error) counters->error = std::current_exception();
          counters->failed.store(true);
        }
      }
      if (counters->done.fetch_add(1) + 1 == counters->total) {
        std::lock_guard<std::mutex> lock(counters->mutex);
        counters->finished.notify_all();
      }
    }
  };
  for (int h = 0; h < helpers; ++h) {
    try {
      auto task = work;
      pool.Schedule(std::move(task));
    } catch (...) {
      break;  // no room for another task: the caller claims its items
    }
  }
  work();
  {
    std::unique_lock<std::mutex> lock(counters->mutex);
    counters->finished.wait(lock, [&] { return counters->done.load() == counters->total; });
  }
  if (counters->error) std::rethrow_exception(counters->error);
}

}  // namespace gbn_jax

#endif  // GBN_JAX_CSRC_CPU_KERNEL_H_
