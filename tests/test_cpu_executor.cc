// Where the CPU backend runs: its own threads, an executor the host program hands it (a serving
// engine's pool), and a process forked after the backend was made (vLLM starts its workers so).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "expect_error.h"
#include "mjolnir/decode.h"
#include "test_seed.h"
#include "verify/problem.h"

namespace mjolnir {
namespace {

verify::ProblemSpec spec() {
  verify::ProblemSpec s;
  s.format = Format::fp8_e4m3;
  s.head_dim = 128;
  s.num_kv_heads = 4;
  s.group = 4;
  s.seq_lens = {700, 33, 1200};
  s.seed = testing::test_seed();
  return s;
}

std::vector<float> decode_with(const Backend& backend, verify::Problem& problem) {
  problem.poison_outputs();
  decode(backend, problem.args());
  return {problem.output().begin(), problem.output().end()};
}

// Runs every index on the calling thread, as workers() "threads", counting what it is given.
class CountingExecutor final : public Executor {
 public:
  explicit CountingExecutor(int workers) : workers_(workers) {}
  int workers() const override { return workers_; }
  void parallel_for(std::int64_t count, const std::function<void(std::int64_t, int)>& fn) override {
    ++calls;
    for (std::int64_t i = 0; i < count; ++i) fn(i, int(i % workers_));
    indices += count;
  }
  std::atomic<int> calls{0};
  std::atomic<std::int64_t> indices{0};

 private:
  int workers_;
};

TEST(CpuExecutor, AHostExecutorRunsTheWorkAndGivesTheSameOutput) {
  verify::Problem problem(spec());
  const std::vector<float> own = decode_with(*make_backend("cpu", {.threads = 3}), problem);
  auto executor = std::make_shared<CountingExecutor>(3);
  const auto backend = make_backend("cpu", {.executor = executor});
  EXPECT_EQ(backend->workers(), 3);
  const std::vector<float> hosted = decode_with(*backend, problem);
  EXPECT_GT(executor->calls.load(), 0);
  EXPECT_GT(executor->indices.load(), 0);
  // The same plan (3 workers) and kernels: the same bits, whichever threads ran them.
  ASSERT_EQ(own.size(), hosted.size());
  EXPECT_EQ(std::memcmp(own.data(), hosted.data(), own.size() * sizeof(float)), 0);
}

TEST(CpuExecutor, ThreadsAndAnExecutorAreExclusive) {
  testing::expect_error(
      [] {
        make_backend("cpu", {.threads = 2, .executor = std::make_shared<CountingExecutor>(2)});
      },
      "options.threads", "executor");
}

// A backend made and used before fork() decodes in the child: the child has none of the
// parent's worker threads, so the backend must start its own there (it used to hang).
TEST(CpuExecutor, ABackendMadeBeforeForkWorksInTheChild) {
  const auto backend = make_backend("cpu", {.threads = 2});
  verify::Problem problem(spec());
  const std::vector<float> parent = decode_with(*backend, problem);
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    alarm(60);  // a hang ends the child by SIGALRM, which the parent reports
    const std::vector<float> again = decode_with(*backend, problem);
    const bool same = again.size() == parent.size() &&
                      std::memcmp(again.data(), parent.data(), again.size() * sizeof(float)) == 0;
    _exit(same ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal "
                                 << (WIFSIGNALED(status) ? WTERMSIG(status) : 0)
                                 << " (SIGALRM: its decode hung)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's output differs from the parent's";
  // And the parent's backend still works after the fork.
  EXPECT_EQ(decode_with(*backend, problem), parent);
}

// Address space the process maps now (/proc/self/statm), in bytes.
std::size_t mapped_bytes() {
  unsigned long pages = 0;
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%lu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  return std::size_t(pages) * std::size_t(sysconf(_SC_PAGESIZE));
}

// A worker thread the system cannot start (here: no address space left for its stack) is an
// Error that says so, not std::terminate from the threads that did start; the next call may try
// again. In a child process, whose address space is capped 128 MiB above what it maps: 511
// threads want at least 2 MiB of stack each (glibc's least default; 8 MiB with the usual
// `ulimit -s`). Not under the sanitizers, which map terabytes of shadow, nor qemu.
TEST(CpuExecutor, AThreadThatCannotStartIsAnErrorNotACrash) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers' shadow memory does not fit an address-space limit";
#elif defined(MJOLNIR_TEST_UNDER_EMULATOR)
  GTEST_SKIP() << "under qemu the address-space limit would cap the emulator too";
#endif
  const auto backend = make_backend("cpu", {.threads = 512});
  verify::ProblemSpec small = spec();
  small.seq_lens = {300, 20};
  verify::Problem problem(small);
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    alarm(60);
    const rlimit limit{mapped_bytes() + (std::size_t(128) << 20), RLIM_INFINITY};
    if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(6);
    try {
      decode_with(*backend, problem);
      _exit(3);  // every thread started: the limit did not bite
    } catch (const Error& e) {
      _exit(std::string(e.what()).starts_with("threads: the CPU backend could start only") ? 0 : 4);
    } catch (...) {
      _exit(5);
    }
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal "
                                 << (WIFSIGNALED(status) ? WTERMSIG(status) : 0)
                                 << " (SIGABRT: std::terminate; SIGALRM: a hang)";
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "3: no error, 4: another message, 5: another exception, 6: setrlimit failed";
}

}  // namespace
}  // namespace mjolnir
