// A fixed set of worker threads that run index ranges; the CPU backend's only threading.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mjolnir::cpu {

class ThreadPool {
 public:
  // `threads` workers in total, the calling thread included (threads - 1 are spawned).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return threads_; }

  // Calls fn(index, worker) for every index in [0, count), handing indices out dynamically so
  // uneven items balance; worker in [0, size()) identifies per-thread scratch. Blocks until
  // all are done; rethrows the first exception an fn threw. Calls are serialized.
  //
  // Workers spin for a short while (kSpinMicros) before sleeping, and so does the caller while
  // it waits for them: a decode step of a short context takes tens of microseconds, about what
  // waking a sleeping thread costs, and serving loops call once per layer back to back.
  void parallel_for(std::int64_t count, const std::function<void(std::int64_t, int)>& fn);

  static constexpr int kSpinMicros = 100;

 private:
  void worker_loop(int worker);
  void run_share(int worker);

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time
  std::mutex mutex_;       // guards sleeping and waking
  std::condition_variable wake_, done_;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<int> active_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(std::int64_t, int)>* fn_ = nullptr;
  std::int64_t count_ = 0;
  std::atomic<std::int64_t> next_{0};
  std::exception_ptr error_;
  std::mutex error_mutex_;
};

// Number of hardware threads, at least 1.
int hardware_threads();

}  // namespace mjolnir::cpu
