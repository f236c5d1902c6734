# Launches mb.cubin's kernels on the GPU through the driver API; prints TFLOP/s.
import ctypes, sys
cu = ctypes.CDLL('libcuda.so.1')
def ck(r, w=''):
    if r: raise SystemExit(f'cuda error {r} {w}')
ck(cu.cuInit(0)); dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0))
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)); ck(cu.cuCtxSetCurrent(ctx))
sms = ctypes.c_int(); ck(cu.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev))
mod = ctypes.c_void_p(); data = open(sys.argv[1], 'rb').read(); ck(cu.cuModuleLoadData(ctypes.byref(mod), data), 'load')
out = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(out), 4 * 512 * 4096))
e0, e1 = ctypes.c_void_p(), ctypes.c_void_p(); ck(cu.cuEventCreate(ctypes.byref(e0), 0)); ck(cu.cuEventCreate(ctypes.byref(e1), 0))
print('SMs', sms.value)
for name in ['mb_n64_w0', 'mb_n64_w1', 'mb_n128_w0', 'mb_n128_w1']:
    N = int(name.split('_')[1][1:])
    f = ctypes.c_void_p(); ck(cu.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()))
    for wgs in (1, 2, 3, 4):
        for blocks_per_sm in (1, 2):
            if wgs * blocks_per_sm > 4: continue
            iters = 4000
            args = [ctypes.c_uint64(out.value), ctypes.c_int(iters)]
            ptrs = (ctypes.c_void_p * 2)(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
            grid = sms.value * blocks_per_sm
            ck(cu.cuLaunchKernel(f, grid, 1, 1, 128 * wgs, 1, 1, 0, None, ptrs, None), 'launch')
            ck(cu.cuEventRecord(e0, None))
            ck(cu.cuLaunchKernel(f, grid, 1, 1, 128 * wgs, 1, 1, 0, None, ptrs, None), 'launch')
            ck(cu.cuEventRecord(e1, None)); ck(cu.cuEventSynchronize(e1))
            ms = ctypes.c_float(); ck(cu.cuEventElapsedTime(ctypes.byref(ms), e0, e1))
            flop = grid * wgs * iters * 4 * 2 * 64 * N * 16
            print(f'{name:12s} WGs/block {wgs} blocks/SM {blocks_per_sm}: {flop / ms.value / 1e9:7.1f} TFLOP/s ({ms.value:.2f} ms)')
