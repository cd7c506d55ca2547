// A fixed set of worker threads that run index ranges: the CPU backend's own Executor.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "mjolnir/decode.h"

namespace mjolnir::cpu {

class ThreadPool final : public Executor {
 public:
  // `threads` workers in total, the calling thread included (threads - 1 are spawned, on the
  // first parallel_for of each process: a pool made before fork() works in the child).
  explicit ThreadPool(int threads);
  ~ThreadPool() override;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int workers() const override { return threads_; }

  // Calls fn(index, worker) for every index in [0, count), handing indices out dynamically so
  // uneven items balance; worker in [0, workers()) identifies per-thread scratch. Blocks until
  // all are done; rethrows the first exception an fn threw. Calls are serialized: calls from
  // several threads run one at a time (each waits for a lock held for the whole call), so two of
  // them never share a worker index; the calling thread is worker 0 of its own call. A call from
  // inside fn on the same pool would wait for itself.
  //
  // Workers spin for a short while (kSpinMicros) before sleeping, and so does the caller while
  // it waits for them: a decode step of a short context takes tens of microseconds, about what
  // waking a sleeping thread costs, and serving loops call once per layer back to back.
  void parallel_for(std::int64_t count, const std::function<void(std::int64_t, int)>& fn) override;

  static constexpr int kSpinMicros = 100;

 private:
  struct Crew;  // the spawned threads of one process and what they synchronize on
  Crew& crew();

  int threads_;
  std::mutex crew_mutex_;  // guards creating the crew
  std::unique_ptr<Crew> crew_;
  int crew_pid_ = 0;  // the process whose threads crew_ holds
};

// Number of hardware threads, at least 1.
int hardware_threads();

}  // namespace mjolnir::cpu
