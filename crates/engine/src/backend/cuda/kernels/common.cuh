// Helpers every kernel family shares; nvrtc.rs puts this text in front of each family's source
// (NVRTC has no include path here: the kernels use no CUDA headers).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000u)

// Programmatic dependent launch (Hopper and newer): wait until the previous kernel's results are
// visible, then let the next kernel start launching, so that its launch overlaps this kernel's
// work. Every kernel calls this first; without the launch attribute both are no-ops.
__device__ __forceinline__ void grid_dep() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// (value, index) packed in a u64 that orders as "larger value, then lower index" (NaN excluded by
// the callers): the value's bits made monotonic in the high half, the index's complement in the
// low half. Argmax and top-k compare these with plain integer max.
__device__ __forceinline__ u64 pack_max(float v, int i) {
    const u32 b = __float_as_uint(v);
    const u32 ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)ordered << 32) | (u64)(0xffffffffu - (u32)i);
}
