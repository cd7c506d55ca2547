#include "cpu/thread_pool.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

#include "mjolnir/error.h"

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

struct ThreadPool::Crew {
  // A thread the system cannot start (out of memory for its stack, a limit on threads) is an
  // Error naming the count, after the ones that did start are stopped and joined: leaving the
  // constructor with joinable threads would end the process (std::terminate).
  explicit Crew(int threads) : threads(threads) {
    try {
      for (int w = 1; w < threads; ++w) workers.emplace_back([this, w] { worker_loop(w); });
    } catch (const std::system_error& e) {
      const std::size_t started = workers.size();
      stop_and_join();
      MJOLNIR_REQUIRE(false, "threads: the CPU backend could start only ", started + 1, " of ",
                      threads, " threads (", e.what(), "); ask for fewer threads");
    }
  }
  ~Crew() { stop_and_join(); }

  void stop_and_join() {
    {
      std::lock_guard lock(mutex);
      stop.store(true);
    }
    wake.notify_all();
    for (std::thread& t : workers) t.join();
    workers.clear();
  }

  void run_share(int worker) {
    for (;;) {
      const std::int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= count) return;
      try {
        (*fn)(i, worker);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
        next.store(count, std::memory_order_relaxed);  // stop handing out work
      }
    }
  }

  void worker_loop(int worker) {
    std::uint64_t seen = 0;
    for (;;) {
      const auto idle = [&] {
        return generation.load(std::memory_order_acquire) == seen && !stop.load();
      };
      if (!spin_while(idle)) {
        std::unique_lock lock(mutex);
        wake.wait(lock, [&] { return !idle(); });
      }
      if (stop.load()) return;
      seen = generation.load(std::memory_order_acquire);
      run_share(worker);
      if (active.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lock(mutex);  // the caller may be between its check and its wait
        done.notify_one();
      }
    }
  }

  void parallel_for(std::int64_t n, const std::function<void(std::int64_t, int)>& f) {
    std::lock_guard call(call_mutex);
    if (threads == 1 || n == 1) {
      for (std::int64_t i = 0; i < n; ++i) f(i, 0);
      return;
    }
    fn = &f;
    count = n;
    next.store(0, std::memory_order_relaxed);
    error = nullptr;
    active.store(threads - 1, std::memory_order_relaxed);
    {
      std::lock_guard lock(mutex);  // sleeping workers check the generation under it
      generation.fetch_add(1, std::memory_order_release);
    }
    wake.notify_all();
    run_share(0);
    const auto working = [&] { return active.load(std::memory_order_acquire) != 0; };
    if (!spin_while(working)) {
      std::unique_lock lock(mutex);
      done.wait(lock, [&] { return !working(); });
    }
    if (error) std::rethrow_exception(error);
  }

  const int threads;
  std::vector<std::thread> workers;
  std::mutex call_mutex;  // one parallel_for at a time
  std::mutex mutex;       // guards sleeping and waking
  std::condition_variable wake, done;
  std::atomic<std::uint64_t> generation{0};
  std::atomic<int> active{0};
  std::atomic<bool> stop{false};
  const std::function<void(std::int64_t, int)>* fn = nullptr;
  std::int64_t count = 0;
  std::atomic<std::int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
};

ThreadPool::ThreadPool(int threads) : threads_(std::max(1, threads)) {}

ThreadPool::~ThreadPool() {
  // A crew inherited through fork() has no threads in this process to stop or join.
  if (crew_ && crew_pid_ != ::getpid()) (void)crew_.release();
}

ThreadPool::Crew& ThreadPool::crew() {
  const int pid = ::getpid();
  std::lock_guard lock(crew_mutex_);
  if (!crew_ || crew_pid_ != pid) {
    // After fork() the child has only the forking thread: the parent's crew is memory without
    // threads, whose locks may even be held. It is left as it is (a few hundred bytes) and
    // this process gets threads of its own.
    if (crew_) (void)crew_.release();
    crew_ = std::make_unique<Crew>(threads_);
    crew_pid_ = pid;
  }
  return *crew_;
}

void ThreadPool::parallel_for(std::int64_t count,
                              const std::function<void(std::int64_t, int)>& fn) {
  if (count <= 0) return;
  crew().parallel_for(count, fn);
}

}  // namespace mjolnir::cpu
