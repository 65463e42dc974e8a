// Part of cpu_kernel.cc (included by it after RunPart; not a standalone header): the state a call
// shares with its helpers (their lingering: ../cpu_helpers.h), and whether a call takes helpers.
//
// Helpers or not: on a machine whose cores are busy with other work (the shared 2-core VM: load
// average 5-9), a helper preempted in the middle of its part stalls the caller until the scheduler
// runs it again, and a decode step of ~120 calls then ran 1.6x slower with helpers than with the
// caller alone (BENCHMARKS.md "int4 decode step"); on idle cores helpers pay. So each call measures
// its wall time per multiply-add, and `UseHelpers` picks, per size class of call (log2 of its
// multiply-adds), the way whose running average (kCostWeight per call) is lower, trying the other
// way for a burst of kProbeBurst calls in every kProbeEvery of the class so that its average
// follows the machine. Calls with helpers are measured warm only (a helper already lingering):
// probing them one call at a time, each probe woke a pool thread, which on the VM took longer
// than the call, so helpers looked slower than they were and were never chosen even on idle
// cores (the whole decode step ran on one core: BENCHMARKS.md "int4 decode step, tiled").

// Shared with helpers, which may start after the call returned: they then only touch `next`.
// Lingering helpers and their mailbox: ../cpu_helpers.h (shared with the attention kernel).
struct Shared : jaxinfer_cpu::Job {
  Problem pb;
  std::vector<float> scratch;
  std::vector<int8_t> xq;        // `offsets` calls: x quantized
  std::vector<float> xd, xsum;   // and its block scales and sums
  std::atomic<int> next{0};
  std::atomic<int> done{0};

  void Run() override {
    for (int p = next.fetch_add(1); p < pb.parts; p = next.fetch_add(1)) {
      RunPart(pb, p);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};


constexpr int kProbeEvery = 32;
constexpr int kProbeBurst = 4;
constexpr float kCostWeight = 0.125f;
constexpr int kSizeClasses = 48;

// Per size class: calls made, and the average ns per multiply-add without ([0]) and with ([1])
// helpers (0: not measured yet). Races between concurrent calls only blur the averages.
struct CostClass {
  std::atomic<uint64_t> calls;
  std::atomic<float> cost[2];
};

CostClass& Costs(int64_t work) {
  static CostClass* classes = new CostClass[kSizeClasses]();  // zeroed, never destroyed
  return classes[std::min<int>(kSizeClasses - 1, 63 - __builtin_clzll(static_cast<uint64_t>(work)))];
}

// The way with the lower average (helpers only once measured warm); the other way for kProbeBurst
// calls in every kProbeEvery (a burst, so that a helper woken by its first call is warm for the
// others).
bool UseHelpers(int64_t work) {
  CostClass& c = Costs(work);
  const float alone = c.cost[0].load(std::memory_order_relaxed);
  const float helped = c.cost[1].load(std::memory_order_relaxed);
  const bool best = helped > 0.0f && (alone == 0.0f || helped <= alone);
  return c.calls.fetch_add(1, std::memory_order_relaxed) % kProbeEvery < kProbeBurst ? !best : best;
}

// `warm`: a helper was lingering when the call was posted. A call with helpers that had to wake a
// pool thread is not recorded: waking one takes longer on a VM than most calls take, and a way
// chosen call after call keeps its helper lingering, so only warm calls measure it.
void Record(int64_t work, bool helpers, bool warm, std::chrono::steady_clock::duration wall) {
  if (helpers && !warm) return;
  std::atomic<float>& avg = Costs(work).cost[helpers];
  const float v = std::chrono::duration<float, std::nano>(wall).count() / static_cast<float>(work);
  const float old = avg.load(std::memory_order_relaxed);
  avg.store(old == 0.0f ? v : old + kCostWeight * (v - old), std::memory_order_relaxed);
}

// Runs the parts of `sh` (its Problem set up, `pb.parts` of them) on the caller and, where
// `UseHelpers` measured that they pay, on lingering or newly scheduled pool helpers; returns once
// every part is done. The parts (and so a product's sums and their order) do not depend on
// whether helpers take some of them.
void RunAll(ffi::ThreadPool& pool, const std::shared_ptr<Shared>& sh, int64_t threads, int64_t work) {
  const int64_t parts = sh->pb.parts;
  const bool helpers = parts > 1 && UseHelpers(work);
  const auto start = std::chrono::steady_clock::now();
  bool warm = false;
  if (helpers) {
    const uint64_t generation = jaxinfer_cpu::Post(sh);
    // NOTE: a helper about to stop lingering may miss this call: the caller then does its parts.
    const int lingering = jaxinfer_cpu::Box().lingering.load();
    warm = lingering > 0;
    const int64_t wanted = std::min(threads, parts) - 1 - lingering;
    for (int64_t i = 0; i < wanted; ++i)
      pool.Schedule([sh, generation] { jaxinfer_cpu::Help(sh, generation); });
  }
  sh->Run();
  while (sh->done.load(std::memory_order_acquire) < parts) _mm_pause();
  if (parts > 1) Record(work, helpers, warm, std::chrono::steady_clock::now() - start);
}
