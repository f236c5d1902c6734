import ctypes, sys
lib = ctypes.CDLL('/tmp/nvrtc130/x/nvidia/cu13/lib/libnvrtc.so.13')
src = open('/tmp/mb/mb.cu').read()
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b'mb.cu', 0, None, None) == 0
opts = [b'--gpu-architecture=sm_90a', b'--std=c++17', b'-default-device', b'-Xptxas=-v']
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, log); print(log.value.decode()[-3000:])
if rc: sys.exit(1)
lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)); buf = ctypes.create_string_buffer(n.value); lib.nvrtcGetCUBIN(prog, buf)
open('/tmp/mb/mb.cubin', 'wb').write(buf.raw)
