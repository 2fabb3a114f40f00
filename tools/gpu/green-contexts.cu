// tools/gpu/green-contexts.cu — issue 15 item 3: what SM partitioning with green contexts buys.
//
// A GEMM of a Llama-3.1-8B layer's shape (the MLP up-projection: tokens × 4096 → 14336, bf16 in,
// fp32 accumulate, cuBLAS) is timed with CUDA events, N repetitions per case, medians reported:
//   alone_primary         GEMM on an ordinary stream of the primary context (all SMs): the baseline;
//   alone_compute_green   GEMM on a green context holding the SMs the I/O partition leaves;
//   io_green+gemm_primary GEMM on the primary context while a poller runs on the I/O green context
//                         (today's tutti layout: only the I/O side is a green context);
//   io_green+gemm_green   both sides on disjoint green contexts (the full partition);
//   io_stream+gemm_primary the poller on an ordinary stream beside the GEMM (no partition);
//   h2d_copy+gemm_primary host-to-device copies from pinned memory beside the GEMM (staged mode's
//                         copy-engine traffic; uses no SMs, competes for memory bandwidth).
// The GPU's clocks drift over a run (power and temperature under sustained bf16 GEMMs), by as much
// as the effect measured: so every case is bracketed by the same GEMM alone on the primary context,
// timed right before and right after it, and its slowdown is its median over the mean of those two
// medians (base_before_us, base_after_us in the JSON; base_drift_percent says how far they moved).
// A GEMM on the compute green context is also bracketed by that GEMM alone on the compute green
// context (slowdown_vs_compute_green_percent: the poller's effect apart from the partition's).
// alone_primary, bracketed like any case, is the noise floor (expected 0 %).
// cuBLAS is told the compute green context's SM count (cublasSetSmCountTarget, where the library
// has it): its persistent/stream-K kernels size their grids from the device's SM count otherwise,
// and a partial extra wave would show as the partition's cost. alone_compute_green_no_sm_target
// times the same GEMM through a handle without the target (the library's tiling effect), and
// io_green+gemm_green_no_sm_target the full partition through it (PyTorch sets no target, so an
// engine's GEMMs run so unless it is changed).
//
// The poller is a stand-in for the gio I/O kernel (kernels/gio_io_kernel.cu), which cannot be
// launched without NVMe queue pairs: a grid of (I/O SMs × occupancy) blocks of 128 threads that
// read 16-byte "completions" from host-mapped memory, as the kernel's reaper reads NVMe CQEs.
//   poll: one thread per block polls with exponential __nanosleep backoff capped at
//         --backoff-ns-max (the gio kernel's idle wait; GpuExecutorConfig's default is 10 µs);
//   spin: every thread reads host memory with no sleep (the upper bound of a busy I/O kernel).
// Every poller wait is bounded (%globaltimer deadline, --poller-limit-s); the host's waits too.
// It does no atomics on host memory (undefined where hostNativeAtomicSupported is 0; the value is
// reported, since the gio kernel does such atomics).
//
// The driver's green-context entry points come from cudaGetDriverEntryPointByVersion and cuBLAS
// from dlopen (GREEN_CUBLAS_LIBRARY, else libcublas.so.13/.12), so the program links with the
// CUDA runtime alone: it compiles and links without a GPU, cuBLAS headers or libcuda.
//
// Build: nvcc -std=c++17 -O2 -arch=sm_90 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror
//        -o green-contexts green-contexts.cu -ldl          (tools/gpu/check.sh, tools/gpu/run-all.sh)
// Usage: green-contexts [--tokens 1024,4096,16384] [--io-sms 8,16] [--repetitions 50]
//        [--warmup 5] [--pollers poll,spin] [--backoff-ns-max 10000] [--poller-limit-s 20]
//        [--json PATH] [--json-self-test PATH (the JSON case writer alone, no GPU: check.sh)]
// STATUS: compiled here (sm_90, warnings as errors); it has never run on a GPU.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <library_types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

// ---- the GEMM: Llama-3.1-8B MLP up-projection ----
constexpr int kHiddenSize = 4096;
constexpr int kIntermediateSize = 14336;
constexpr int kPollerThreadsPerBlock = 128;
constexpr uint32_t kCompletionEntries = 4096;  // 64 KiB of host-mapped "CQEs"
constexpr uint32_t kPollerBlocksMax = 4096;
constexpr size_t kCopyBytes = size_t(256) << 20;
constexpr int kCopiesMax = 400;

[[noreturn]] void fail(const std::string& what) {
    std::fprintf(stderr, "green-contexts: %s\n", what.c_str());
    std::exit(1);
}

void check(cudaError_t result, const char* call) {
    if (result != cudaSuccess) {
        fail(std::string(call) + ": " + cudaGetErrorName(result) + " (" + cudaGetErrorString(result) + ")");
    }
}

// ---- driver entry points (green contexts need a CUDA 12.4+ driver; the stream call 12.5+) ----
struct Driver {
    PFN_cuGetErrorString_v6000 get_error_string = nullptr;
    PFN_cuDeviceGetDevResource_v12040 device_get_dev_resource = nullptr;
    PFN_cuDevSmResourceSplitByCount_v12040 sm_resource_split_by_count = nullptr;
    PFN_cuDevResourceGenerateDesc_v12040 dev_resource_generate_desc = nullptr;
    PFN_cuGreenCtxCreate_v12040 green_ctx_create = nullptr;
    PFN_cuGreenCtxDestroy_v12040 green_ctx_destroy = nullptr;
    PFN_cuCtxFromGreenCtx_v12040 ctx_from_green_ctx = nullptr;
    PFN_cuGreenCtxStreamCreate_v12050 green_ctx_stream_create = nullptr;
    PFN_cuCtxSetCurrent_v4000 ctx_set_current = nullptr;
    PFN_cuCtxGetCurrent_v4000 ctx_get_current = nullptr;
};

template <typename Function>
void load_entry_point(Function* out, const char* symbol, unsigned int version) {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    check(cudaGetDriverEntryPointByVersion(symbol, &function, version, cudaEnableDefault, &status), symbol);
    if (status != cudaDriverEntryPointSuccess || function == nullptr) {
        fail(std::string(symbol) + " (driver API " + std::to_string(version) + ") is not provided by this driver");
    }
    *out = reinterpret_cast<Function>(function);
}

Driver load_driver() {
    Driver driver;
    load_entry_point(&driver.get_error_string, "cuGetErrorString", 6000);
    load_entry_point(&driver.device_get_dev_resource, "cuDeviceGetDevResource", 12040);
    load_entry_point(&driver.sm_resource_split_by_count, "cuDevSmResourceSplitByCount", 12040);
    load_entry_point(&driver.dev_resource_generate_desc, "cuDevResourceGenerateDesc", 12040);
    load_entry_point(&driver.green_ctx_create, "cuGreenCtxCreate", 12040);
    load_entry_point(&driver.green_ctx_destroy, "cuGreenCtxDestroy", 12040);
    load_entry_point(&driver.ctx_from_green_ctx, "cuCtxFromGreenCtx", 12040);
    load_entry_point(&driver.green_ctx_stream_create, "cuGreenCtxStreamCreate", 12050);
    load_entry_point(&driver.ctx_set_current, "cuCtxSetCurrent", 4000);
    load_entry_point(&driver.ctx_get_current, "cuCtxGetCurrent", 4000);
    return driver;
}

const Driver* g_driver = nullptr;

void check(CUresult result, const char* call) {
    if (result != CUDA_SUCCESS) {
        const char* text = nullptr;
        if (g_driver == nullptr || g_driver->get_error_string(result, &text) != CUDA_SUCCESS || text == nullptr) {
            text = "unknown";
        }
        fail(std::string(call) + ": CUresult " + std::to_string(static_cast<int>(result)) + " (" + text + ")");
    }
}

// ---- cuBLAS through dlopen: prototypes of the four calls used (cublas_api.h, stable since 11) ----
using CublasHandle = void*;
using CublasCreate = int (*)(CublasHandle*);
using CublasDestroy = int (*)(CublasHandle);
using CublasSetStream = int (*)(CublasHandle, cudaStream_t);
using CublasGetVersion = int (*)(CublasHandle, int*);
using CublasSetSmCountTarget = int (*)(CublasHandle, int);
using CublasGemmEx = int (*)(CublasHandle, int, int, int, int, int, const void*, const void*, cudaDataType, int, const void*,
                             cudaDataType, int, const void*, void*, cudaDataType, int, int, int);
constexpr int kCublasOpN = 0;
constexpr int kCublasOpT = 1;
constexpr int kCublasCompute32F = 68;
constexpr int kCublasGemmDefault = -1;

struct Cublas {
    std::string library;
    CublasCreate create = nullptr;
    CublasDestroy destroy = nullptr;
    CublasSetStream set_stream = nullptr;
    CublasGetVersion get_version = nullptr;
    CublasGemmEx gemm_ex = nullptr;
    CublasSetSmCountTarget set_sm_count_target = nullptr;  // optional: nullptr where the library lacks it
};

template <typename Function>
void load_symbol(void* library, Function* out, const char* symbol) {
    void* function = dlsym(library, symbol);
    if (function == nullptr) {
        fail(std::string("cuBLAS has no ") + symbol);
    }
    *out = reinterpret_cast<Function>(function);
}

Cublas load_cublas() {
    std::vector<std::string> candidates;
    if (const char* path = std::getenv("GREEN_CUBLAS_LIBRARY"); path != nullptr && *path != '\0') {
        candidates.emplace_back(path);
    }
    candidates.insert(candidates.end(), {"libcublas.so.13", "libcublas.so.12", "libcublas.so"});
    std::string tried;
    for (const std::string& name : candidates) {
        void* library = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (library == nullptr) {
            const char* error = dlerror();
            tried += "\n  " + name + ": " + (error != nullptr ? error : "not found");
            continue;
        }
        Cublas cublas;
        cublas.library = name;
        load_symbol(library, &cublas.create, "cublasCreate_v2");
        load_symbol(library, &cublas.destroy, "cublasDestroy_v2");
        load_symbol(library, &cublas.set_stream, "cublasSetStream_v2");
        load_symbol(library, &cublas.get_version, "cublasGetVersion_v2");
        load_symbol(library, &cublas.gemm_ex, "cublasGemmEx");
        if (void* function = dlsym(library, "cublasSetSmCountTarget"); function != nullptr) {
            cublas.set_sm_count_target = reinterpret_cast<CublasSetSmCountTarget>(function);
        }
        return cublas;
    }
    fail("no cuBLAS library could be loaded (set GREEN_CUBLAS_LIBRARY):" + tried);
}

void check_cublas(int status, const char* call) {
    if (status != 0) {
        fail(std::string(call) + ": cuBLAS status " + std::to_string(status));
    }
}

// ---- device code ----
__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// Deterministic pseudo-random values in [-1, 1): random data, because zeros make a GEMM draw less
// power and run faster than real weights would.
__global__ void fill_random(__nv_bfloat16* data, size_t count, uint32_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
        uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
        x ^= x >> 15;
        x *= 2246822519u;
        x ^= x >> 13;
        data[i] = __float2bfloat16(static_cast<float>(x & 0xFFFF) / 32768.0f - 1.0f);
    }
}

// Host-mapped control block: the host writes `stop`; each block writes only its own slots.
struct PollerControl {
    uint32_t stop;
    uint32_t started[kPollerBlocksMax];
    uint32_t timed_out[kPollerBlocksMax];
    unsigned long long polls[kPollerBlocksMax];
};

enum PollerMode : uint32_t { kPoll = 0, kSpin = 1 };

__global__ void poller(PollerControl* control, const uint4* completions, uint32_t mode, uint32_t backoff_ns_max,
                       uint64_t limit_ns) {
    volatile PollerControl* shared = control;
    if (threadIdx.x == 0) {
        shared->started[blockIdx.x] = 1;
        __threadfence_system();
    }
    if (mode == kPoll && threadIdx.x != 0) {
        return;  // like the gio kernel once its warps have submitted: one polling thread per block
    }
    const uint64_t started_ns = global_timer_ns();
    uint32_t index = (blockIdx.x * blockDim.x + threadIdx.x) % kCompletionEntries;
    uint32_t sleep_ns = 32;
    unsigned long long polls = 0;
    uint32_t checksum = 0;
    bool timed_out = false;
    while (shared->stop == 0) {
        if (global_timer_ns() - started_ns > limit_ns) {
            timed_out = true;
            break;
        }
        const uint4 entry = __ldcv(completions + index);  // uncached: every read crosses PCIe
        checksum ^= entry.w;
        index = (index + 1) % kCompletionEntries;
        ++polls;
        if (mode == kPoll) {
            __nanosleep(sleep_ns);
            sleep_ns = sleep_ns * 2 > backoff_ns_max ? backoff_ns_max : sleep_ns * 2;
        }
    }
    // The host zeroed the completions: the checksum is 0, and storing it keeps the reads alive.
    if (threadIdx.x == 0) {
        shared->polls[blockIdx.x] = polls + checksum;
        shared->timed_out[blockIdx.x] = timed_out ? 1 : 0;
    }
}

// ---- host side ----
struct Options {
    std::vector<int> tokens = {1024, 4096, 16384};
    std::vector<int> io_sms = {8, 16};
    std::vector<std::string> pollers = {"poll", "spin"};
    int repetitions = 50;
    int warmup = 5;
    uint32_t backoff_ns_max = 10000;
    int poller_limit_s = 20;
    std::string json_path;
    std::string json_self_test_path;  // --json-self-test: the case writer alone, no CUDA call (check.sh)
};

std::vector<std::string> split(const std::string& text) {
    std::vector<std::string> parts;
    size_t start = 0;
    while (start <= text.size()) {
        const size_t comma = text.find(',', start);
        const size_t end = comma == std::string::npos ? text.size() : comma;
        if (end > start) {
            parts.push_back(text.substr(start, end - start));
        }
        start = end + 1;
    }
    return parts;
}

int parse_int(const std::string& text, const char* flag, long min, long max) {
    char* end = nullptr;
    const long value = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || end == nullptr || *end != '\0' || value < min || value > max) {
        fail(std::string(flag) + ": `" + text + "` is not an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
    }
    return static_cast<int>(value);
}

Options parse_options(int argc, char** argv) {
    Options options;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (i + 1 >= argc) {
            fail("missing value after " + flag);
        }
        const std::string value = argv[++i];
        if (flag == "--tokens") {
            options.tokens.clear();
            for (const std::string& part : split(value)) options.tokens.push_back(parse_int(part, "--tokens", 16, 65536));
        } else if (flag == "--io-sms") {
            options.io_sms.clear();
            for (const std::string& part : split(value)) options.io_sms.push_back(parse_int(part, "--io-sms", 1, 1024));
        } else if (flag == "--pollers") {
            options.pollers = split(value);
            for (const std::string& poller_name : options.pollers) {
                if (poller_name != "poll" && poller_name != "spin") fail("--pollers: `" + poller_name + "` is neither poll nor spin");
            }
        } else if (flag == "--repetitions") {
            options.repetitions = parse_int(value, "--repetitions", 3, 10000);
        } else if (flag == "--warmup") {
            options.warmup = parse_int(value, "--warmup", 0, 1000);
        } else if (flag == "--backoff-ns-max") {
            options.backoff_ns_max = static_cast<uint32_t>(parse_int(value, "--backoff-ns-max", 32, 1000000));
        } else if (flag == "--poller-limit-s") {
            options.poller_limit_s = parse_int(value, "--poller-limit-s", 1, 300);
        } else if (flag == "--json") {
            options.json_path = value;
        } else if (flag == "--json-self-test") {
            options.json_self_test_path = value;
        } else {
            fail("unknown option " + flag);
        }
    }
    if (options.tokens.empty() || options.io_sms.empty()) {
        fail("--tokens and --io-sms need at least one value");
    }
    return options;
}

// One execution domain: a context (primary or green), a stream on it, a cuBLAS handle bound to
// it, and GEMM operands allocated in it.
struct Domain {
    std::string name;
    CUcontext context = nullptr;
    CUgreenCtx green = nullptr;
    cudaStream_t stream = nullptr;
    CublasHandle cublas = nullptr;
    __nv_bfloat16* activations = nullptr;  // tokens × 4096, row-major
    __nv_bfloat16* weights = nullptr;      // 14336 × 4096, row-major (nn.Linear layout)
    __nv_bfloat16* output = nullptr;       // tokens × 14336, row-major
    unsigned int sm_count = 0;
};

void make_current(const Domain& domain) { check(g_driver->ctx_set_current(domain.context), "cuCtxSetCurrent"); }

void allocate_operands(Domain& domain, int tokens_max) {
    make_current(domain);
    const size_t activation_count = size_t(tokens_max) * kHiddenSize;
    const size_t weight_count = size_t(kIntermediateSize) * kHiddenSize;
    check(cudaMalloc(&domain.activations, activation_count * sizeof(__nv_bfloat16)), "cudaMalloc activations");
    check(cudaMalloc(&domain.weights, weight_count * sizeof(__nv_bfloat16)), "cudaMalloc weights");
    check(cudaMalloc(&domain.output, size_t(tokens_max) * kIntermediateSize * sizeof(__nv_bfloat16)), "cudaMalloc output");
    fill_random<<<1024, 256, 0, domain.stream>>>(domain.activations, activation_count, 1u);
    fill_random<<<1024, 256, 0, domain.stream>>>(domain.weights, weight_count, 2u);
    check(cudaGetLastError(), "fill_random launch");
    check(cudaStreamSynchronize(domain.stream), "fill_random");
}

void release_operands(Domain& domain) {
    make_current(domain);
    check(cudaFree(domain.activations), "cudaFree");
    check(cudaFree(domain.weights), "cudaFree");
    check(cudaFree(domain.output), "cudaFree");
    domain.activations = domain.weights = domain.output = nullptr;
}

// output[tokens × 14336] = activations[tokens × 4096] · weightsᵀ: in cuBLAS's column-major terms
// C(14336 × tokens) = op_T(W: 4096 × 14336) · X(4096 × tokens), the "TN" layout of nn.Linear.
void enqueue_gemm(const Cublas& cublas, const Domain& domain, int tokens) {
    const float alpha = 1.0f;
    const float beta = 0.0f;
    check_cublas(cublas.gemm_ex(domain.cublas, kCublasOpT, kCublasOpN, kIntermediateSize, tokens, kHiddenSize, &alpha, domain.weights,
                                CUDA_R_16BF, kHiddenSize, domain.activations, CUDA_R_16BF, kHiddenSize, &beta, domain.output,
                                CUDA_R_16BF, kIntermediateSize, kCublasCompute32F, kCublasGemmDefault),
                 "cublasGemmEx");
}

struct Timing {
    double median_us = 0, p10_us = 0, p90_us = 0;
};

// `repetitions` GEMMs back to back on the domain's stream, each between two events.
Timing time_gemm(const Cublas& cublas, const Domain& domain, int tokens, const Options& options) {
    make_current(domain);
    for (int i = 0; i < options.warmup; ++i) enqueue_gemm(cublas, domain, tokens);
    std::vector<cudaEvent_t> events(size_t(options.repetitions) + 1);
    for (cudaEvent_t& event : events) check(cudaEventCreate(&event), "cudaEventCreate");
    check(cudaEventRecord(events[0], domain.stream), "cudaEventRecord");
    for (int i = 0; i < options.repetitions; ++i) {
        enqueue_gemm(cublas, domain, tokens);
        check(cudaEventRecord(events[size_t(i) + 1], domain.stream), "cudaEventRecord");
    }
    check(cudaStreamSynchronize(domain.stream), "GEMM repetitions");
    std::vector<double> samples_us;
    for (int i = 0; i < options.repetitions; ++i) {
        float ms = 0;
        check(cudaEventElapsedTime(&ms, events[size_t(i)], events[size_t(i) + 1]), "cudaEventElapsedTime");
        samples_us.push_back(double(ms) * 1000.0);
    }
    for (cudaEvent_t event : events) check(cudaEventDestroy(event), "cudaEventDestroy");
    std::sort(samples_us.begin(), samples_us.end());
    const size_t n = samples_us.size();
    Timing timing;
    timing.median_us = n % 2 == 1 ? samples_us[n / 2] : (samples_us[n / 2 - 1] + samples_us[n / 2]) / 2.0;
    timing.p10_us = samples_us[n / 10];
    timing.p90_us = samples_us[std::min(n - 1, (n * 9) / 10)];
    return timing;
}

struct PollerRun {
    unsigned int blocks = 0;
    unsigned long long polls = 0;
    unsigned int timed_out_blocks = 0;
};

struct HostPoller {
    PollerControl* control = nullptr;  // host address
    PollerControl* control_device = nullptr;
    uint4* completions_device = nullptr;
};

void stop_poller(const HostPoller& host, const Domain& domain, PollerRun& run, const Options& options);

// Launches the poller on `domain` and waits (bounded) until every block runs. A grid that cannot
// be resident at once (fewer SMs than reported, say) is stopped and reported, not measured.
bool start_poller(const HostPoller& host, const Domain& domain, unsigned int blocks, PollerMode mode, const Options& options,
                  PollerRun& run) {
    if (blocks == 0 || blocks > kPollerBlocksMax) fail("poller grid of " + std::to_string(blocks) + " blocks");
    volatile PollerControl* control = host.control;
    control->stop = 0;
    for (unsigned int b = 0; b < kPollerBlocksMax; ++b) {
        control->started[b] = 0;
        control->timed_out[b] = 0;
        control->polls[b] = 0;
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
    make_current(domain);
    poller<<<blocks, kPollerThreadsPerBlock, 0, domain.stream>>>(host.control_device, host.completions_device, mode,
                                                                  options.backoff_ns_max,
                                                                  uint64_t(options.poller_limit_s) * 1000000000ull);
    check(cudaGetLastError(), "poller launch");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (;;) {
        unsigned int started = 0;
        for (unsigned int b = 0; b < blocks; ++b) started += control->started[b];
        if (started == blocks) break;
        if (std::chrono::steady_clock::now() > deadline) {
            std::printf("NOTE only %u of %u poller blocks started within 5 s on %s: case skipped\n", started, blocks, domain.name.c_str());
            run = PollerRun{};
            run.blocks = blocks;
            stop_poller(host, domain, run, options);
            return false;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    run = PollerRun{};
    run.blocks = blocks;
    return true;
}

void stop_poller(const HostPoller& host, const Domain& domain, PollerRun& run, const Options& options) {
    volatile PollerControl* control = host.control;
    control->stop = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    make_current(domain);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(options.poller_limit_s + 5);
    for (;;) {
        const cudaError_t state = cudaStreamQuery(domain.stream);
        if (state == cudaSuccess) break;
        if (state != cudaErrorNotReady) check(state, "poller");
        if (std::chrono::steady_clock::now() > deadline) fail("the poller did not stop on " + domain.name);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    for (unsigned int b = 0; b < run.blocks; ++b) {
        run.polls += control->polls[b];
        run.timed_out_blocks += control->timed_out[b];
    }
}

// The first refusal of cublasSetSmCountTarget ("refused (status N)"), else empty: the JSON's
// cublas_sm_count_target reports it in place of "set on the compute green context".
std::string g_sm_count_target_refused;

// A cuBLAS handle for `domain`'s stream; told the domain's SM count where the library can be. The
// target is optional (the library may lack it): a refusal (INVALID_VALUE, NOT_SUPPORTED on a green
// context, say) is a NOTE and the handle goes on without it, rather than the program's exit,
// which would lose every green-context case.
CublasHandle create_handle(const Cublas& cublas, const Domain& domain, bool sm_target) {
    make_current(domain);
    CublasHandle handle = nullptr;
    check_cublas(cublas.create(&handle), "cublasCreate");
    check_cublas(cublas.set_stream(handle, domain.stream), "cublasSetStream");
    if (sm_target && cublas.set_sm_count_target != nullptr) {
        const int status = cublas.set_sm_count_target(handle, static_cast<int>(domain.sm_count));
        if (status != 0) {
            std::printf("NOTE cublasSetSmCountTarget(%u) on %s refused (status %d): its GEMMs run without the target\n", domain.sm_count,
                        domain.name.c_str(), status);
            if (g_sm_count_target_refused.empty()) g_sm_count_target_refused = "refused (status " + std::to_string(status) + ")";
        }
    }
    return handle;
}

// sm_target: whether its handle is told the SM count. The I/O domain's is not: only its poller
// runs there, never a GEMM, so a refusal there would mark cublas_sm_count_target "refused" for
// GEMMs that all ran with the target.
Domain create_green_domain(const std::string& name, CUgreenCtx green, const Cublas& cublas, unsigned int sm_count, bool sm_target) {
    Domain domain;
    domain.name = name;
    domain.green = green;
    domain.sm_count = sm_count;
    check(g_driver->ctx_from_green_ctx(&domain.context, green), "cuCtxFromGreenCtx");
    CUstream stream = nullptr;
    check(g_driver->green_ctx_stream_create(&stream, green, CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate");
    domain.stream = reinterpret_cast<cudaStream_t>(stream);
    domain.cublas = create_handle(cublas, domain, sm_target);
    return domain;
}

void destroy_domain(const Cublas& cublas, Domain& domain) {
    make_current(domain);
    if (domain.cublas != nullptr) check_cublas(cublas.destroy(domain.cublas), "cublasDestroy");
    check(cudaStreamDestroy(domain.stream), "cudaStreamDestroy");
    if (domain.green != nullptr) check(g_driver->green_ctx_destroy(domain.green), "cuGreenCtxDestroy");
    domain = Domain{};
}

struct Result {
    int tokens = 0;
    int io_sms_requested = 0;
    unsigned int io_sms_granted = 0;
    unsigned int compute_sms = 0;
    std::string case_name;
    std::string poller = "-";
    Timing timing;
    Timing base_before, base_after;                // the GEMM alone on the primary context around it
    Timing green_base_before, green_base_after;    // alone on the compute green context (its GEMMs there)
    double slowdown_percent = 0;                   // against the mean of base_before and base_after
    double slowdown_vs_compute_green_percent = 0;  // against the green bracket's mean, where there is one
    PollerRun poller_run;
    double copy_gb_per_s = 0;
    std::string error;  // a case that could not be measured says why

    bool has_green_base() const { return green_base_before.median_us > 0 && green_base_after.median_us > 0; }
    double base_us() const { return (base_before.median_us + base_after.median_us) / 2.0; }
    double green_base_us() const { return (green_base_before.median_us + green_base_after.median_us) / 2.0; }
    // The slowdowns, once the timing and its brackets are in; none for a case not measured.
    void finish() {
        if (!error.empty()) return;
        slowdown_percent = (timing.median_us / base_us() - 1.0) * 100.0;
        if (has_green_base()) slowdown_vs_compute_green_percent = (timing.median_us / green_base_us() - 1.0) * 100.0;
    }
};

double tflops(int tokens, double us) { return 2.0 * tokens * double(kHiddenSize) * kIntermediateSize / (us * 1e-6) / 1e12; }

void print_result(const Result& r) {
    std::printf("%6d %4d %4u %4u %-32s %-5s %10.1f %10.1f %10.1f %+8.2f%% %7.1f", r.tokens, r.io_sms_requested, r.io_sms_granted,
                r.compute_sms, r.case_name.c_str(), r.poller.c_str(), r.timing.median_us, r.timing.p10_us, r.timing.p90_us,
                r.slowdown_percent, tflops(r.tokens, r.timing.median_us));
    if (r.poller_run.blocks > 0) {
        std::printf("  poller %u blocks, %llu polls, %u timed out", r.poller_run.blocks, r.poller_run.polls, r.poller_run.timed_out_blocks);
    }
    std::printf("  base %.1f/%.1f us", r.base_before.median_us, r.base_after.median_us);
    if (r.has_green_base() && r.error.empty()) {
        std::printf(", green base %.1f/%.1f us (%+.2f%%)", r.green_base_before.median_us, r.green_base_after.median_us,
                    r.slowdown_vs_compute_green_percent);
    }
    if (r.copy_gb_per_s > 0) std::printf("  h2d %.1f GB/s", r.copy_gb_per_s);
    if (!r.error.empty()) std::printf("  NOT MEASURED: %s", r.error.c_str());
    std::printf("\n");
    std::fflush(stdout);
}

// `value` with `decimals` as a JSON number, or null where it is no finite number or `measured`
// is false: glibc prints 1/0 as `inf`, which JSON parsers refuse (one case not measured, with no
// timing, made the whole file unreadable).
std::string json_number(double value, int decimals, bool measured = true) {
    if (!measured || !std::isfinite(value)) return "null";
    char text[64];
    std::snprintf(text, sizeof text, "%.*f", decimals, value);
    return text;
}

// One case of --json's "cases" array (`first`: no comma before it). A case not measured (its
// error says why) has no timing: its slowdown and TFLOP/s are null.
void write_case_json(FILE* out, const Result& r, bool first) {
    const bool measured = r.error.empty();
    std::fprintf(out,
                 "%s{\"tokens\":%d,\"io_sms_requested\":%d,\"io_sms_granted\":%u,\"gemm_sms\":%u,\"case\":\"%s\",\"poller\":\"%s\","
                 "\"median_us\":%.2f,\"p10_us\":%.2f,\"p90_us\":%.2f,\"slowdown_percent\":%s,\"tflops\":%s,"
                 "\"base_before_us\":%.2f,\"base_after_us\":%.2f,\"base_drift_percent\":%s,"
                 "\"poller_blocks\":%u,\"poller_polls\":%llu,\"poller_timed_out_blocks\":%u,\"h2d_gb_per_s\":%.2f,"
                 "\"error\":\"%s\"",
                 first ? "" : ",", r.tokens, r.io_sms_requested, r.io_sms_granted, r.compute_sms, r.case_name.c_str(), r.poller.c_str(),
                 r.timing.median_us, r.timing.p10_us, r.timing.p90_us, json_number(r.slowdown_percent, 3, measured).c_str(),
                 json_number(tflops(r.tokens, r.timing.median_us), 1, measured).c_str(), r.base_before.median_us, r.base_after.median_us,
                 json_number((r.base_after.median_us / r.base_before.median_us - 1.0) * 100.0, 3).c_str(), r.poller_run.blocks,
                 r.poller_run.polls, r.poller_run.timed_out_blocks, r.copy_gb_per_s, r.error.c_str());
    if (r.has_green_base()) {
        std::fprintf(out, ",\"compute_green_base_before_us\":%.2f,\"compute_green_base_after_us\":%.2f", r.green_base_before.median_us,
                     r.green_base_after.median_us);
        if (r.error.empty()) std::fprintf(out, ",\"slowdown_vs_compute_green_percent\":%.3f", r.slowdown_vs_compute_green_percent);
    }
    std::fprintf(out, "}");
}

// --json-self-test PATH: a measured case and one not measured (a poller grid not resident: no
// timing) through write_case_json, before any CUDA call, so tools/gpu/check.sh can check on a
// machine without a GPU that what --json writes is JSON a parser takes.
int json_self_test(const std::string& path) {
    Result measured;
    measured.tokens = 4096;
    measured.compute_sms = 132;
    measured.case_name = "alone_primary";
    measured.timing = Timing{1000.0, 990.0, 1010.0};
    measured.base_before = measured.base_after = measured.timing;
    measured.finish();
    Result unmeasured;
    unmeasured.tokens = 4096;
    unmeasured.io_sms_requested = 8;
    unmeasured.io_sms_granted = 8;
    unmeasured.compute_sms = 124;
    unmeasured.case_name = "io_green+gemm_green";
    unmeasured.poller = "poll";
    unmeasured.base_before = unmeasured.base_after = unmeasured.green_base_before = unmeasured.green_base_after = measured.timing;
    unmeasured.error = "poller grid not resident";
    unmeasured.finish();
    FILE* out = std::fopen(path.c_str(), "w");
    if (out == nullptr) fail("cannot write " + path);
    std::fprintf(out, "{\"cases\":[");
    write_case_json(out, measured, true);
    write_case_json(out, unmeasured, false);
    std::fprintf(out, "]}\n");
    if (std::fclose(out) != 0) fail("writing " + path);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    const Options options = parse_options(argc, argv);
    if (!options.json_self_test_path.empty()) return json_self_test(options.json_self_test_path);
    int device_count = 0;
    check(cudaGetDeviceCount(&device_count), "cudaGetDeviceCount");
    if (device_count < 1) fail("no CUDA device");
    check(cudaSetDevice(0), "cudaSetDevice");
    check(cudaFree(nullptr), "primary context");
    cudaDeviceProp properties{};
    check(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
    int driver_version = 0;
    int runtime_version = 0;
    int host_native_atomics = 0;
    check(cudaDriverGetVersion(&driver_version), "cudaDriverGetVersion");
    check(cudaRuntimeGetVersion(&runtime_version), "cudaRuntimeGetVersion");
    check(cudaDeviceGetAttribute(&host_native_atomics, cudaDevAttrHostNativeAtomicSupported, 0), "cudaDeviceGetAttribute");
    if (driver_version < 12050) fail("green contexts with streams need a CUDA 12.5+ driver; this one is " + std::to_string(driver_version));
    static const Driver driver = load_driver();
    g_driver = &driver;
    const Cublas cublas = load_cublas();
    const int tokens_max = *std::max_element(options.tokens.begin(), options.tokens.end());

    Domain primary;
    primary.name = "primary";
    primary.sm_count = static_cast<unsigned int>(properties.multiProcessorCount);
    check(driver.ctx_get_current(&primary.context), "cuCtxGetCurrent");
    check(cudaStreamCreateWithFlags(&primary.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cublas(cublas.create(&primary.cublas), "cublasCreate");
    check_cublas(cublas.set_stream(primary.cublas, primary.stream), "cublasSetStream");
    int cublas_version = 0;
    check_cublas(cublas.get_version(primary.cublas, &cublas_version), "cublasGetVersion");
    const char* sm_count_target = cublas.set_sm_count_target != nullptr ? "set on the compute green context" : "unavailable in this cuBLAS";
    allocate_operands(primary, tokens_max);
    Domain primary_poller;  // a second ordinary stream for the unpartitioned case
    primary_poller.name = "primary (second stream)";
    primary_poller.context = primary.context;
    primary_poller.sm_count = primary.sm_count;
    check(cudaStreamCreateWithFlags(&primary_poller.stream, cudaStreamNonBlocking), "cudaStreamCreate");

    HostPoller host_poller;
    check(cudaHostAlloc(&host_poller.control, sizeof(PollerControl), cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    check(cudaHostGetDevicePointer(&host_poller.control_device, host_poller.control, 0), "cudaHostGetDevicePointer");
    uint4* completions = nullptr;
    check(cudaHostAlloc(&completions, kCompletionEntries * sizeof(uint4), cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    std::memset(completions, 0, kCompletionEntries * sizeof(uint4));
    check(cudaHostGetDevicePointer(&host_poller.completions_device, completions, 0), "cudaHostGetDevicePointer");
    int poller_blocks_per_sm = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&poller_blocks_per_sm, poller, kPollerThreadsPerBlock, 0), "occupancy");

    std::printf("green-contexts: %s, %d SMs, cc %d.%d, driver %d, runtime %d, cuBLAS %d (%s; SM count target %s), "
                "hostNativeAtomicSupported %d\n",
                properties.name, properties.multiProcessorCount, properties.major, properties.minor, driver_version, runtime_version,
                cublas_version, cublas.library.c_str(), sm_count_target, host_native_atomics);
    std::printf("GEMM tokens x %d -> %d bf16 (fp32 accumulate), %d repetitions after %d warm-up; poller %d threads/block, %d blocks/SM, "
                "backoff cap %u ns\n",
                kHiddenSize, kIntermediateSize, options.repetitions, options.warmup, kPollerThreadsPerBlock, poller_blocks_per_sm,
                options.backoff_ns_max);
    std::printf("%6s %4s %4s %4s %-32s %-5s %10s %10s %10s %9s %7s\n", "tokens", "ioSM", "got", "cmp", "case", "pollr", "median_us",
                "p10_us", "p90_us", "slowdown", "TFLOP/s");

    std::vector<Result> results;
    // One case: `measure` fills its timing (and poller run or error) between the brackets; `green`
    // (the compute green context's domain, or nullptr) when its GEMMs run there.
    auto run_case = [&](Result r, const Domain* green, auto&& measure) {
        r.base_before = time_gemm(cublas, primary, r.tokens, options);
        if (green != nullptr) r.green_base_before = time_gemm(cublas, *green, r.tokens, options);
        measure(r);
        if (green != nullptr) r.green_base_after = time_gemm(cublas, *green, r.tokens, options);
        r.base_after = time_gemm(cublas, primary, r.tokens, options);
        r.finish();
        results.push_back(r);
        print_result(results.back());
    };
    // --json, replaced whole (written aside, then renamed) after the baseline cases, after each I/O
    // SM count and at the end: a run stopped from outside keeps the cases it measured ("complete":
    // false until the end).
    auto write_json = [&](bool complete) {
        if (options.json_path.empty()) return;
        const std::string partial = options.json_path + ".partial";
        FILE* out = std::fopen(partial.c_str(), "w");
        if (out == nullptr) fail("cannot write " + partial);
        std::fprintf(out,
                     "{\"tool\":\"tools/gpu/green-contexts.cu\",\"complete\":%s,\"device\":\"%s\",\"sm_count\":%d,\"compute_capability\":\"%d.%d\","
                     "\"driver_version\":%d,\"runtime_version\":%d,\"cublas_version\":%d,\"host_native_atomic_supported\":%d,"
                     "\"gemm\":{\"m_tokens\":\"varies\",\"k\":%d,\"n\":%d,\"dtype\":\"bf16\",\"accumulate\":\"fp32\"},"
                     "\"repetitions\":%d,\"warmup\":%d,\"poller_threads_per_block\":%d,\"poller_blocks_per_sm\":%d,"
                     "\"backoff_ns_max\":%u,\"cublas_sm_count_target\":\"%s\",\"slowdown_base\":\"each case against the mean of "
                     "the GEMM alone on the primary context right before and right after it\",\"cases\":[",
                     complete ? "true" : "false", properties.name, properties.multiProcessorCount, properties.major, properties.minor,
                     driver_version, runtime_version, cublas_version, host_native_atomics, kHiddenSize, kIntermediateSize, options.repetitions, options.warmup,
                     kPollerThreadsPerBlock, poller_blocks_per_sm, options.backoff_ns_max,
                     g_sm_count_target_refused.empty() ? sm_count_target : g_sm_count_target_refused.c_str());
        for (size_t i = 0; i < results.size(); ++i) write_case_json(out, results[i], i == 0);
        std::fprintf(out, "]}\n");
        if (std::fclose(out) != 0) fail("writing " + partial);
        if (std::rename(partial.c_str(), options.json_path.c_str()) != 0) fail("renaming " + partial + " to " + options.json_path);
    };

    // Staged mode's copy-engine traffic beside the GEMM: once per token count, no green context.
    {
        void* host_buffer = nullptr;
        void* device_buffer = nullptr;
        check(cudaHostAlloc(&host_buffer, kCopyBytes, cudaHostAllocDefault), "cudaHostAlloc copy source");
        std::memset(host_buffer, 1, kCopyBytes);
        check(cudaMalloc(&device_buffer, kCopyBytes), "cudaMalloc copy target");
        for (const int tokens : options.tokens) {
            Result r;
            r.tokens = tokens;
            r.compute_sms = primary.sm_count;
            r.case_name = "alone_primary";  // the noise floor: the same GEMM as its brackets
            run_case(r, nullptr, [&](Result& c) { c.timing = time_gemm(cublas, primary, tokens, options); });
            const Timing alone = results.back().timing;
            // Enough 256 MiB copies (about 5 ms each at PCIe 5 speed) to outlast the GEMMs.
            const double gemm_total_us = alone.median_us * (options.repetitions + options.warmup);
            const int copies = std::min(kCopiesMax, static_cast<int>(gemm_total_us / 5000.0) + 2);
            r.case_name = "h2d_copy+gemm_primary";
            run_case(r, nullptr, [&](Result& measured) {
                cudaEvent_t copy_start = nullptr;
                cudaEvent_t copy_end = nullptr;
                check(cudaEventCreate(&copy_start), "cudaEventCreate");
                check(cudaEventCreate(&copy_end), "cudaEventCreate");
                check(cudaEventRecord(copy_start, primary_poller.stream), "cudaEventRecord");
                for (int c = 0; c < copies; ++c) {
                    check(cudaMemcpyAsync(device_buffer, host_buffer, kCopyBytes, cudaMemcpyHostToDevice, primary_poller.stream), "copy");
                }
                check(cudaEventRecord(copy_end, primary_poller.stream), "cudaEventRecord");
                measured.timing = time_gemm(cublas, primary, tokens, options);
                check(cudaStreamSynchronize(primary_poller.stream), "copies");
                float copy_ms = 0;
                check(cudaEventElapsedTime(&copy_ms, copy_start, copy_end), "cudaEventElapsedTime");
                check(cudaEventDestroy(copy_start), "cudaEventDestroy");
                check(cudaEventDestroy(copy_end), "cudaEventDestroy");
                measured.copy_gb_per_s = double(kCopyBytes) * copies / (double(copy_ms) * 1e-3) / 1e9;
            });
        }
        check(cudaFree(device_buffer), "cudaFree");
        check(cudaFreeHost(host_buffer), "cudaFreeHost");
    }
    write_json(false);

    for (const int io_sms_requested : options.io_sms) {
        // One group of at least io_sms_requested SMs for I/O (rounded up to the architecture's
        // granularity: 8 on compute capability 9.0), the remainder for compute.
        CUdevResource all_sms{};
        check(driver.device_get_dev_resource(0, &all_sms, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource");
        CUdevResource io_resource{};
        CUdevResource compute_resource{};
        unsigned int groups = 1;
        check(driver.sm_resource_split_by_count(&io_resource, &groups, &all_sms, &compute_resource, 0,
                                                static_cast<unsigned int>(io_sms_requested)),
              "cuDevSmResourceSplitByCount");
        if (groups != 1) fail("cuDevSmResourceSplitByCount gave " + std::to_string(groups) + " groups");
        if (compute_resource.sm.smCount == 0) fail("no SMs left for compute after " + std::to_string(io_sms_requested) + " I/O SMs");
        CUdevResourceDesc io_desc = nullptr;
        CUdevResourceDesc compute_desc = nullptr;
        check(driver.dev_resource_generate_desc(&io_desc, &io_resource, 1), "cuDevResourceGenerateDesc (I/O)");
        check(driver.dev_resource_generate_desc(&compute_desc, &compute_resource, 1), "cuDevResourceGenerateDesc (compute)");
        CUgreenCtx io_green = nullptr;
        CUgreenCtx compute_green = nullptr;
        check(driver.green_ctx_create(&io_green, io_desc, 0, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate (I/O)");
        check(driver.green_ctx_create(&compute_green, compute_desc, 0, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate (compute)");
        Domain io = create_green_domain("I/O green context", io_green, cublas, io_resource.sm.smCount, false);
        Domain compute = create_green_domain("compute green context", compute_green, cublas, compute_resource.sm.smCount, true);
        allocate_operands(compute, tokens_max);
        // The same GEMM through a handle not told the green context's SM count.
        Domain compute_untargeted = compute;
        compute_untargeted.cublas = cublas.set_sm_count_target != nullptr ? create_handle(cublas, compute, false) : nullptr;
        const unsigned int poller_blocks = io.sm_count * static_cast<unsigned int>(poller_blocks_per_sm);

        for (const int tokens : options.tokens) {
            auto make = [&](const char* case_name, const std::string& poller_name, unsigned int compute_sms) {
                Result r;
                r.tokens = tokens;
                r.io_sms_requested = io_sms_requested;
                r.io_sms_granted = io.sm_count;
                r.compute_sms = compute_sms;
                r.case_name = case_name;
                r.poller = poller_name;
                return r;
            };
            run_case(make("alone_compute_green", "-", compute.sm_count), &compute,
                     [&](Result& c) { c.timing = time_gemm(cublas, compute, tokens, options); });
            if (compute_untargeted.cublas != nullptr) {
                run_case(make("alone_compute_green_no_sm_target", "-", compute.sm_count), &compute,
                         [&](Result& c) { c.timing = time_gemm(cublas, compute_untargeted, tokens, options); });
            }
            // GEMM domain beside the poller's domain, for each case. The full partition also runs
            // through the handle without the SM target: an engine's GEMMs go through PyTorch,
            // which does not call cublasSetSmCountTarget, so that is tutti's layout on a
            // partitioned GPU unless the engine is changed; the targeted case is the best a
            // cuBLAS told the partition can do. Both are bracketed by the targeted GEMM alone on
            // the compute green context (as alone_compute_green_no_sm_target is).
            struct Case {
                const char* name;
                const Domain* poller_domain;
                const Domain* gemm_domain;
            };
            std::vector<Case> cases = {{"io_green+gemm_primary", &io, &primary},
                                       {"io_green+gemm_green", &io, &compute},
                                       {"io_stream+gemm_primary", &primary_poller, &primary}};
            if (compute_untargeted.cublas != nullptr) cases.push_back({"io_green+gemm_green_no_sm_target", &io, &compute_untargeted});
            for (const std::string& poller_name : options.pollers) {
                const PollerMode mode = poller_name == "spin" ? kSpin : kPoll;
                for (const auto& c : cases) {
                    const bool on_compute_green = c.gemm_domain == &compute || c.gemm_domain == &compute_untargeted;
                    run_case(make(c.name, poller_name, c.gemm_domain->sm_count), on_compute_green ? &compute : nullptr,
                             [&](Result& r) {
                                 if (!start_poller(host_poller, *c.poller_domain, poller_blocks, mode, options, r.poller_run)) {
                                     r.error = "poller grid not resident";
                                     return;
                                 }
                                 r.timing = time_gemm(cublas, *c.gemm_domain, tokens, options);
                                 stop_poller(host_poller, *c.poller_domain, r.poller_run, options);
                                 // A poller that hit its own deadline stopped polling during the GEMMs.
                                 if (r.poller_run.timed_out_blocks > 0) {
                                     r.error = "poller timed out during the GEMMs (raise --poller-limit-s)";
                                 }
                             });
                }
            }
        }
        if (compute_untargeted.cublas != nullptr) {
            make_current(compute);
            check_cublas(cublas.destroy(compute_untargeted.cublas), "cublasDestroy");
        }
        release_operands(compute);
        destroy_domain(cublas, compute);
        destroy_domain(cublas, io);
        make_current(primary);
        write_json(false);
    }

    write_json(true);
    release_operands(primary);
    check(cudaFreeHost(completions), "cudaFreeHost");
    check(cudaFreeHost(host_poller.control), "cudaFreeHost");
    std::printf("green-contexts: done\n");
    return 0;
}
