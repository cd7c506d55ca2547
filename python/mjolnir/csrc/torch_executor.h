// The CPU backend on torch's intra-op threads: in a process that runs torch (a vLLM worker),
// threads of mjolnir's own would compete with torch's OpenMP threads, which spin after every
// op. at::parallel_for hands the work to those same threads instead.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>

#include "mjolnir/decode.h"

namespace mjolnir::python {

class TorchExecutor final : public Executor {
 public:
  int workers() const override { return std::max(1, at::get_num_threads()); }

  // One task per thread, each taking indices from a shared counter, so uneven items balance as
  // on mjolnir's own pool. The task's position is its worker index: at::parallel_for runs
  // distinct tasks at once, never one twice.
  void parallel_for(std::int64_t count, const std::function<void(std::int64_t, int)>& fn) override {
    const std::int64_t tasks = std::min<std::int64_t>(workers(), count);
    if (tasks <= 1 || at::in_parallel_region()) {
      for (std::int64_t i = 0; i < count; ++i) fn(i, 0);
      return;
    }
    std::atomic<std::int64_t> next{0};
    at::parallel_for(0, tasks, 1, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t worker = begin; worker < end; ++worker) {
        for (std::int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
          fn(i, int(worker));
        }
      }
    });
  }
};

}  // namespace mjolnir::python
