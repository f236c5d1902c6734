// Does a decode step pay for address translation? lily's routed experts are 16 slices of 512 KiB
// (gate and up of 8 experts) chosen anew each step from 40 layers x 128 MiB stacks (15 GB of
// expert weights), while the ideal streaming kernels of step_floor.cu read the same buffers at
// every replay. This times one kernel that reads 16 slices of 512 KiB (8 MiB, as the expert
// gate/up does), the slices drawn at random for each launch from a window of W bytes of one
// 16 GiB buffer, against reading 8 MiB sequentially through that window (each launch the next
// 8 MiB): the same bytes from DRAM either way (the window is far above the 50 MB L2), but the
// random slices touch 16 pages a launch scattered over W. If the GPU's translation caches hold
// the window, both read alike; where they do not, the random form pays for page walks.
//
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/tlb_reach tools/microbench/tlb_reach.cu && /tmp/tlb_reach
// Prints a markdown table: microseconds a launch (2,000 launches back to back on one stream, after
// 200 warm-up launches; the mean of 3 runs, with their min and max).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "check.cuh"

constexpr int kSlices = 16;
constexpr size_t kSlice = 512 << 10;
constexpr int kLaunches = 2000, kWarm = 200;

// Reads the launch's 16 slices (offsets in 16-byte units), 16 bytes a thread a step.
__global__ void read_slices(const uint4* __restrict__ base, const unsigned long long* __restrict__ offsets,
                            unsigned* out) {
    const unsigned long long* off = offsets;
    const size_t per_slice = kSlice / 16, total = per_slice * kSlices;
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcs(base + off[i / per_slice] + i % per_slice);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;  // keeps the loads
}

int main() {
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t buffer = 16ull << 30;
    uint4* base;
    CHECK(cudaMalloc(&base, buffer));
    CHECK(cudaMemset(base, 1, buffer));
    unsigned* out;
    CHECK(cudaMalloc(&out, 4));
    unsigned long long* offsets;
    const size_t rows = kWarm + kLaunches;
    CHECK(cudaMalloc(&offsets, rows * kSlices * 8));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    std::mt19937_64 rng(7);
    std::printf("| slices | window | us a launch (mean) | min | max | GB/s |\n|---|---:|---:|---:|---:|---:|\n");
    for (int random = 0; random < 2; ++random) {
        for (size_t window : {256ull << 20, 1ull << 30, 2ull << 30, 4ull << 30, 8ull << 30, 16ull << 30}) {
            std::vector<unsigned long long> h(rows * kSlices);
            const size_t slots = window / kSlice;
            for (size_t r = 0; r < rows; ++r)
                for (int k = 0; k < kSlices; ++k) {
                    const size_t slot = random ? rng() % slots : (r * kSlices + k) % slots;
                    h[r * kSlices + k] = slot * (kSlice / 16);
                }
            CHECK(cudaMemcpy(offsets, h.data(), h.size() * 8, cudaMemcpyHostToDevice));
            std::vector<double> us;
            for (int run = 0; run < 3; ++run) {
                for (int i = 0; i < kWarm; ++i)
                    read_slices<<<2 * sms, 256, 0, s>>>(base, offsets + (size_t)i * kSlices, out);
                CHECK(cudaEventRecord(a, s));
                for (int i = 0; i < kLaunches; ++i)
                    read_slices<<<2 * sms, 256, 0, s>>>(base, offsets + (size_t)(kWarm + i) * kSlices, out);
                CHECK(cudaEventRecord(b, s));
                CHECK(cudaEventSynchronize(b));
                float ms = 0;
                CHECK(cudaEventElapsedTime(&ms, a, b));
                us.push_back(ms * 1000.0 / kLaunches);
            }
            double mean = 0;
            for (double u : us) mean += u / us.size();
            std::printf("| %s | %zu MiB | %.2f | %.2f | %.2f | %.0f |\n", random ? "random" : "sequential", window >> 20,
                        mean, *std::min_element(us.begin(), us.end()), *std::max_element(us.begin(), us.end()),
                        kSlices * kSlice / (mean * 1e3));
        }
    }
    return 0;
}
