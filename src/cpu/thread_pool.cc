#include "cpu/thread_pool.h"

#include <algorithm>
#include <chrono>

namespace mjolnir::cpu {

namespace {

// Spins while `busy()` and the spin budget lasts; true when busy() turned false.
template <class Busy>
bool spin_while(Busy busy) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::microseconds(ThreadPool::kSpinMicros);
  for (int i = 0;; ++i) {
    if (!busy()) return true;
    if ((i & 63) == 63 && clock::now() > deadline) return false;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
}

}  // namespace

int hardware_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

ThreadPool::ThreadPool(int threads) : threads_(std::max(1, threads)) {
  for (int w = 1; w < threads_; ++w) workers_.emplace_back([this, w] { worker_loop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run_share(int worker) {
  for (;;) {
    const std::int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= count_) return;
    try {
      (*fn_)(i, worker);
    } catch (...) {
      std::lock_guard lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
      next_.store(count_, std::memory_order_relaxed);  // stop handing out work
    }
  }
}

void ThreadPool::worker_loop(int worker) {
  std::uint64_t seen = 0;
  for (;;) {
    const auto idle = [&] {
      return generation_.load(std::memory_order_acquire) == seen && !stop_.load();
    };
    if (!spin_while(idle)) {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return !idle(); });
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    run_share(worker);
    if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard lock(mutex_);  // the caller may be between its check and its wait
      done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(std::int64_t count,
                              const std::function<void(std::int64_t, int)>& fn) {
  if (count <= 0) return;
  std::lock_guard call(call_mutex_);
  if (threads_ == 1 || count == 1) {
    for (std::int64_t i = 0; i < count; ++i) fn(i, 0);
    return;
  }
  fn_ = &fn;
  count_ = count;
  next_.store(0, std::memory_order_relaxed);
  error_ = nullptr;
  active_.store(threads_ - 1, std::memory_order_relaxed);
  {
    std::lock_guard lock(mutex_);  // sleeping workers check the generation under it
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  run_share(0);
  const auto working = [&] { return active_.load(std::memory_order_acquire) != 0; };
  if (!spin_while(working)) {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return !working(); });
  }
  if (error_) std::rethrow_exception(error_);
}

}  // namespace mjolnir::cpu
