// tools/gpu/h2d-bandwidth.cu — issue 15 item 5's baseline: how fast one KV layer of Llama-3.1-8B
// reaches GPU memory from host memory without tutti, for the layer sizes of a retrieve.
//
// One layer's KV is tokens × 4096 bytes (8 KV heads × 128 dims × K and V × bf16); the default
// sizes are the layers of 256 to 32768 cached tokens (1 to 128 MiB). For each size, medians of
// --repetitions transfers timed with CUDA events:
//   pinned_h2d       cudaMemcpyAsync from cudaHostAlloc memory (the ideal staged copy);
//   registered_h2d   from page-aligned memory registered with cudaHostRegister, which is how
//                    gio-uring's staging buffers reach the GPU (a DmaRegion + cuMemHostRegister);
//   pageable_h2d     from malloc'd memory (what a copy without staging registration costs);
//   pinned_d2h       the store direction, into cudaHostAlloc memory;
//   mapped_read_NNsm a kernel on NN SMs' worth of blocks reading host-mapped memory into GPU
//                    memory (zero-copy: SMs pulling over PCIe, as an I/O kernel's SMs would);
//                    NN = --kernel-sms values and all SMs.
// Every transfer's bytes are checked at the end of each size (a wrong copy is an error, not a
// figure).
//
// Build: nvcc -std=c++17 -O2 -arch=sm_90 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror
//        -o h2d-bandwidth h2d-bandwidth.cu                 (tools/gpu/check.sh, tools/gpu/run-all.sh)
// Usage: h2d-bandwidth [--tokens 256,1024,4096,16384,32768] [--repetitions 20] [--kernel-sms 8,16]
//        [--json PATH]
// STATUS: compiled here (sm_90, warnings as errors); it has never run on a GPU.

#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr size_t kKvBytesPerTokenPerLayer = 4096;  // Llama-3.1-8B: 2 × 8 × 128 × 2 bytes
constexpr int kCopyThreadsPerBlock = 256;

[[noreturn]] void fail(const std::string& what) {
    std::fprintf(stderr, "h2d-bandwidth: %s\n", what.c_str());
    std::exit(1);
}

void check(cudaError_t result, const char* call) {
    if (result != cudaSuccess) fail(std::string(call) + ": " + cudaGetErrorName(result) + " (" + cudaGetErrorString(result) + ")");
}

// Grid-stride 16-byte copy from host-mapped memory; uncached loads so every byte crosses PCIe.
__global__ void mapped_read(const uint4* source, uint4* target, size_t count) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
        target[i] = __ldcv(source + i);
    }
}

struct Options {
    std::vector<int> tokens = {256, 1024, 4096, 16384, 32768};
    std::vector<int> kernel_sms = {8, 16};
    int repetitions = 20;
    std::string json_path;
};

std::vector<int> parse_list(const std::string& text, const char* flag, long min, long max) {
    std::vector<int> values;
    size_t start = 0;
    while (start <= text.size()) {
        const size_t comma = text.find(',', start);
        const std::string part = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        char* end = nullptr;
        const long value = std::strtol(part.c_str(), &end, 10);
        if (part.empty() || *end != '\0' || value < min || value > max) {
            fail(std::string(flag) + ": `" + part + "` is not an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
        }
        values.push_back(static_cast<int>(value));
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return values;
}

Options parse_options(int argc, char** argv) {
    Options options;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (i + 1 >= argc) fail("missing value after " + flag);
        const std::string value = argv[++i];
        if (flag == "--tokens") {
            options.tokens = parse_list(value, "--tokens", 1, 1 << 20);
        } else if (flag == "--kernel-sms") {
            options.kernel_sms = parse_list(value, "--kernel-sms", 1, 1024);
        } else if (flag == "--repetitions") {
            options.repetitions = parse_list(value, "--repetitions", 3, 10000).at(0);
        } else if (flag == "--json") {
            options.json_path = value;
        } else {
            fail("unknown option " + flag);
        }
    }
    return options;
}

struct Measurement {
    std::string method;
    size_t bytes;
    double median_us;
    double p10_us;
    double p90_us;
};

// Median, 10th and 90th percentile of `repetitions` runs of `enqueue` on `stream`.
template <typename Enqueue>
Measurement time_transfers(const char* method, size_t bytes, int repetitions, cudaStream_t stream, Enqueue enqueue) {
    enqueue();  // warm-up: first-touch mappings and lazy module loading stay out of the figures
    check(cudaStreamSynchronize(stream), method);
    std::vector<cudaEvent_t> events(size_t(repetitions) + 1);
    for (cudaEvent_t& event : events) check(cudaEventCreate(&event), "cudaEventCreate");
    check(cudaEventRecord(events[0], stream), "cudaEventRecord");
    for (int i = 0; i < repetitions; ++i) {
        enqueue();
        check(cudaEventRecord(events[size_t(i) + 1], stream), "cudaEventRecord");
    }
    check(cudaStreamSynchronize(stream), method);
    std::vector<double> samples;
    for (int i = 0; i < repetitions; ++i) {
        float ms = 0;
        check(cudaEventElapsedTime(&ms, events[size_t(i)], events[size_t(i) + 1]), "cudaEventElapsedTime");
        samples.push_back(double(ms) * 1000.0);
    }
    for (cudaEvent_t event : events) check(cudaEventDestroy(event), "cudaEventDestroy");
    std::sort(samples.begin(), samples.end());
    const size_t n = samples.size();
    const double median = n % 2 == 1 ? samples[n / 2] : (samples[n / 2 - 1] + samples[n / 2]) / 2.0;
    return {method, bytes, median, samples[n / 10], samples[std::min(n - 1, (n * 9) / 10)]};
}

void fill_pattern(unsigned char* data, size_t bytes, uint32_t seed) {
    uint32_t x = seed;
    for (size_t i = 0; i < bytes; ++i) {
        x = x * 1664525u + 1013904223u;
        data[i] = static_cast<unsigned char>(x >> 24);
    }
}

void expect_device_equals(const void* device, const unsigned char* expected, size_t bytes, unsigned char* scratch, const char* method) {
    check(cudaMemcpy(scratch, device, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (verify)");
    if (std::memcmp(scratch, expected, bytes) != 0) fail(std::string(method) + ": bytes in GPU memory differ from the source");
}

}  // namespace

int main(int argc, char** argv) {
    const Options options = parse_options(argc, argv);
    int device_count = 0;
    check(cudaGetDeviceCount(&device_count), "cudaGetDeviceCount");
    if (device_count < 1) fail("no CUDA device");
    check(cudaSetDevice(0), "cudaSetDevice");
    cudaDeviceProp properties{};
    check(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
    int driver_version = 0;
    check(cudaDriverGetVersion(&driver_version), "cudaDriverGetVersion");
    int blocks_per_sm = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, mapped_read, kCopyThreadsPerBlock, 0), "occupancy");
    std::vector<int> kernel_sms = options.kernel_sms;
    kernel_sms.push_back(properties.multiProcessorCount);
    std::printf("h2d-bandwidth: %s, %d SMs, driver %d, PCIe %x:%x, %d repetitions per point\n", properties.name,
                properties.multiProcessorCount, driver_version, properties.pciBusID, properties.pciDeviceID, options.repetitions);
    std::printf("%8s %12s %-18s %10s %10s %10s %8s\n", "tokens", "bytes", "method", "median_us", "p10_us", "p90_us", "GB/s");

    const size_t bytes_max = size_t(*std::max_element(options.tokens.begin(), options.tokens.end())) * kKvBytesPerTokenPerLayer;
    cudaStream_t stream = nullptr;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    unsigned char* pinned = nullptr;
    check(cudaHostAlloc(&pinned, bytes_max, cudaHostAllocMapped), "cudaHostAlloc");
    void* mapping = mmap(nullptr, bytes_max, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping == MAP_FAILED) fail("mmap of the registered buffer");
    auto* registered = static_cast<unsigned char*>(mapping);
    auto* pageable = static_cast<unsigned char*>(std::malloc(bytes_max));
    auto* expected = static_cast<unsigned char*>(std::malloc(bytes_max));
    auto* scratch = static_cast<unsigned char*>(std::malloc(bytes_max));
    if (pageable == nullptr || expected == nullptr || scratch == nullptr) fail("malloc");
    fill_pattern(expected, bytes_max, 7u);
    std::memcpy(pinned, expected, bytes_max);
    std::memcpy(registered, expected, bytes_max);
    std::memcpy(pageable, expected, bytes_max);
    check(cudaHostRegister(registered, bytes_max, cudaHostRegisterMapped | cudaHostRegisterPortable), "cudaHostRegister");
    unsigned char* device = nullptr;
    check(cudaMalloc(&device, bytes_max), "cudaMalloc");
    unsigned char* pinned_on_device = nullptr;
    check(cudaHostGetDevicePointer(&pinned_on_device, pinned, 0), "cudaHostGetDevicePointer");

    std::vector<std::pair<int, Measurement>> results;
    auto report = [&](int tokens, const Measurement& m) {
        results.emplace_back(tokens, m);
        std::printf("%8d %12zu %-18s %10.1f %10.1f %10.1f %8.2f\n", tokens, m.bytes, m.method.c_str(), m.median_us, m.p10_us, m.p90_us,
                    double(m.bytes) / (m.median_us * 1e-6) / 1e9);
        std::fflush(stdout);
    };
    // --json, replaced whole (written aside, then renamed) after each layer size and at the end:
    // a run stopped from outside keeps the sizes it measured ("complete": false until the end).
    auto write_json = [&](bool complete) {
        if (options.json_path.empty()) return;
        const std::string partial = options.json_path + ".partial";
        FILE* out = std::fopen(partial.c_str(), "w");
        if (out == nullptr) fail("cannot write " + partial);
        std::fprintf(out,
                     "{\"tool\":\"tools/gpu/h2d-bandwidth.cu\",\"complete\":%s,\"device\":\"%s\",\"sm_count\":%d,\"driver_version\":%d,"
                     "\"kv_bytes_per_token_per_layer\":%zu,\"repetitions\":%d,\"mapped_read_blocks_per_sm\":%d,\"points\":[",
                     complete ? "true" : "false", properties.name, properties.multiProcessorCount, driver_version, kKvBytesPerTokenPerLayer,
                     options.repetitions, blocks_per_sm);
        for (size_t i = 0; i < results.size(); ++i) {
            const Measurement& m = results[i].second;
            std::fprintf(out,
                         "%s{\"tokens\":%d,\"bytes\":%zu,\"method\":\"%s\",\"median_us\":%.2f,\"p10_us\":%.2f,\"p90_us\":%.2f,"
                         "\"gb_per_s\":%.3f}",
                         i == 0 ? "" : ",", results[i].first, m.bytes, m.method.c_str(), m.median_us, m.p10_us, m.p90_us,
                         double(m.bytes) / (m.median_us * 1e-6) / 1e9);
        }
        std::fprintf(out, "]}\n");
        if (std::fclose(out) != 0) fail("writing " + partial);
        if (std::rename(partial.c_str(), options.json_path.c_str()) != 0) fail("renaming " + partial + " to " + options.json_path);
    };
    for (const int tokens : options.tokens) {
        const size_t bytes = size_t(tokens) * kKvBytesPerTokenPerLayer;
        const int r = options.repetitions;
        check(cudaMemset(device, 0, bytes), "cudaMemset");
        report(tokens, time_transfers("pinned_h2d", bytes, r, stream, [&] {
                   check(cudaMemcpyAsync(device, pinned, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
               }));
        expect_device_equals(device, expected, bytes, scratch, "pinned_h2d");
        check(cudaMemset(device, 0, bytes), "cudaMemset");
        report(tokens, time_transfers("registered_h2d", bytes, r, stream, [&] {
                   check(cudaMemcpyAsync(device, registered, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
               }));
        expect_device_equals(device, expected, bytes, scratch, "registered_h2d");
        check(cudaMemset(device, 0, bytes), "cudaMemset");
        report(tokens, time_transfers("pageable_h2d", bytes, r, stream, [&] {
                   check(cudaMemcpyAsync(device, pageable, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
               }));
        expect_device_equals(device, expected, bytes, scratch, "pageable_h2d");
        for (const int sms : kernel_sms) {
            check(cudaMemset(device, 0, bytes), "cudaMemset");
            const std::string method = "mapped_read_" + std::to_string(sms) + "sm";
            const unsigned int blocks = static_cast<unsigned int>(sms * blocks_per_sm);
            report(tokens, time_transfers(method.c_str(), bytes, r, stream, [&] {
                       mapped_read<<<blocks, kCopyThreadsPerBlock, 0, stream>>>(reinterpret_cast<const uint4*>(pinned_on_device),
                                                                               reinterpret_cast<uint4*>(device), bytes / sizeof(uint4));
                       check(cudaGetLastError(), "mapped_read launch");
                   }));
            expect_device_equals(device, expected, bytes, scratch, method.c_str());
        }
        // Cleared first: pinned still holds the pattern it was filled with, so a D2H that moved
        // nothing would pass the comparison. Only [0, bytes) is cleared, and a correct D2H puts the
        // pattern back there, so the next (larger) size's H2D and mapped reads still find it.
        std::memset(pinned, 0, bytes);
        report(tokens, time_transfers("pinned_d2h", bytes, r, stream, [&] {
                   check(cudaMemcpyAsync(pinned, device, bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
               }));
        if (std::memcmp(pinned, expected, bytes) != 0) fail("pinned_d2h: bytes in host memory differ from GPU memory");
        write_json(false);
    }

    write_json(true);
    check(cudaHostUnregister(registered), "cudaHostUnregister");
    munmap(mapping, bytes_max);
    check(cudaFreeHost(pinned), "cudaFreeHost");
    check(cudaFree(device), "cudaFree");
    std::free(pageable);
    std::free(expected);
    std::free(scratch);
    std::printf("h2d-bandwidth: done\n");
    return 0;
}
