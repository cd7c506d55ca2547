#include "cpu/thread_pool.h"

#include <atomic>

namespace mjolnir::cpu {

int hardware_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

ThreadPool::ThreadPool(int threads) : threads_(std::max(1, threads)) {
  for (int w = 1; w < threads_; ++w) workers_.emplace_back([this, w] { worker_loop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
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
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_.store(count_, std::memory_order_relaxed);  // stop handing out work
    }
  }
}

void ThreadPool::worker_loop(int worker) {
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_share(worker);
    {
      std::lock_guard lock(mutex_);
      if (--active_ == 0) done_.notify_one();
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
  {
    std::lock_guard lock(mutex_);
    fn_ = &fn;
    count_ = count;
    next_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    active_ = threads_ - 1;
    ++generation_;
  }
  wake_.notify_all();
  run_share(0);
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return active_ == 0; });
  if (error_) std::rethrow_exception(error_);
}

}  // namespace mjolnir::cpu
