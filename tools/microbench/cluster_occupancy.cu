// How many thread-block clusters of the GDN state pass's shape the GPU holds at once: one block
// of 256 threads and 176 KiB of dynamic shared memory an SM (gdn_chunk_state, kernels/gdn.cu),
// in clusters of 1, 2 and 4 blocks along y. The chunked state pass launches 128 blocks (32 value
// heads x 4 row blocks); a cluster of a head's 4 row blocks could read the stage data they share
// once, by multicast, instead of 4 times from L2. That needs all 32 clusters resident at once,
// or the pass takes two waves. Build and run on the GPU machine:
//
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/cluster_occupancy tools/microbench/cluster_occupancy.cu
//   /tmp/cluster_occupancy
#include <cstdio>
#include <cuda_runtime.h>

__global__ void state_shape(float* out) {
    extern __shared__ float smem[];
    smem[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    if (out) out[blockIdx.x] = smem[(threadIdx.x + 1) % blockDim.x];
}

int main() {
    const int smem = 176 * 1024;
    if (cudaFuncSetAttribute(state_shape, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
        printf("cudaFuncSetAttribute failed\n");
        return 1;
    }
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("%s: %d SMs\n", prop.name, prop.multiProcessorCount);
    printf("cluster blocks | blocks needed | clusters needed | max active clusters | blocks resident\n");
    for (int c : {1, 2, 4, 8}) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(32, 4, 1);
        cfg.blockDim = dim3(256, 1, 1);
        cfg.dynamicSmemBytes = smem;
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = 1;
        attr.val.clusterDim.y = c < 4 ? c : 4;
        attr.val.clusterDim.z = 1;
        if (c == 8) attr.val.clusterDim.x = 2;  // 2 heads x 4 row blocks
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        int clusters = 0;
        const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, state_shape, &cfg);
        if (e != cudaSuccess) {
            printf("%d | 128 | %d | error: %s\n", c, 128 / c, cudaGetErrorString(e));
            continue;
        }
        printf("%d | 128 | %d | %d | %d\n", c, 128 / c, clusters, clusters * c);
    }
    return 0;
}
