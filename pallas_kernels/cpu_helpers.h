// Lingering helpers shared by the CPU kernels of one process (pallas_kernels/linear and
// pallas_kernels/ragged_paged_attention, each built into its own library by cpu_build.py).
//
// A decode step calls the kernels one after another, a few microseconds apart (~120 products and
// 30 attentions a step for SmolLM2), and a pool thread that went to sleep between two calls takes
// longer to wake on a small VM than a call takes to run. So a helper that finished its parts
// lingers, spinning up to kLingerNs on one process-wide mailbox for the next call's parts, whichever
// kernel posts them: the attention between two products then gets the second core the products
// keep warm, where waking a pool thread for it came too late to pay (BENCHMARKS.md "The CPU
// attention on the products' lingering helper").
//
// A call's work is a `Job`: `Run` claims parts from the job's own counter until none is left and
// counts the ones it finished. The caller runs it too and returns once every part is done, so a
// helper that starts late finds nothing left; which thread ran a part never changes its result.
// The mailbox is the linear kernel's library's (`JaxinferCpuHelperBox`); the attention kernel's
// library is pointed at it once loaded (`JaxinferCpuUseHelperBox`, ragged_paged_attention/cpu.py).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace jaxinfer_cpu {

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

constexpr int64_t kLingerNs = 100000;

struct Job {
  virtual ~Job() = default;
  virtual void Run() = 0;  // claims and runs parts until none is left
};

// The newest call's job, for lingering helpers. Never destroyed: a helper may still be lingering
// when the process exits.
struct Mailbox {
  std::mutex mu;
  std::shared_ptr<Job> job;
  std::atomic<uint64_t> generation{0};
  std::atomic<int> lingering{0};
};

// This library's mailbox until another library's is shared with it.
inline Mailbox*& BoxSlot() {
  static Mailbox* box = new Mailbox;
  return box;
}

inline Mailbox& Box() { return *BoxSlot(); }

inline uint64_t Post(std::shared_ptr<Job> job) {
  Mailbox& box = Box();
  std::lock_guard<std::mutex> lock(box.mu);
  box.job = std::move(job);
  return box.generation.fetch_add(1, std::memory_order_release) + 1;
}

// A pool task: `job`, then every job posted while it lingers (`linger_ns` after the last one).
inline void Help(std::shared_ptr<Job> job, uint64_t generation, int64_t linger_ns = kLingerNs) {
  using Clock = std::chrono::steady_clock;
  Mailbox& box = Box();
  job->Run();
  job.reset();
  box.lingering.fetch_add(1);
  auto deadline = Clock::now() + std::chrono::nanoseconds(linger_ns);
  for (int spins = 0;; ++spins) {
    if (box.generation.load(std::memory_order_acquire) != generation) {
      std::shared_ptr<Job> next;
      {
        std::lock_guard<std::mutex> lock(box.mu);
        next = box.job;
        generation = box.generation.load(std::memory_order_relaxed);
      }
      box.lingering.fetch_sub(1);
      next->Run();
      next.reset();
      box.lingering.fetch_add(1);
      deadline = Clock::now() + std::chrono::nanoseconds(linger_ns);
      continue;
    }
    if (spins % 64 == 0 && Clock::now() > deadline) break;
    Pause();
  }
  box.lingering.fetch_sub(1);
}

// Tests: a thread that lingers `ns` from now without a job of its own, as a helper does after its
// parts (a deterministic way to have one lingering when a call comes).
inline void Linger(int64_t ns) {
  struct Nothing : Job {
    void Run() override {}
  };
  const uint64_t generation = Box().generation.load(std::memory_order_acquire);
  std::thread([generation, ns] { Help(std::make_shared<Nothing>(), generation, ns); }).detach();
}

}  // namespace jaxinfer_cpu
