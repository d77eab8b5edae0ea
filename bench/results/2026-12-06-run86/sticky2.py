"""Can a CUDA context in a sticky error be recreated in the same process, other ways? (issue 30)

Run 87: after sticky.py (run 86) found that cuDevicePrimaryCtxReset + retain does not give a
working context, this tries, each in its own process (argument): `release` (make no context
current, release the primary context, reset it, retain it again) and `create` (a new
non-primary context, cuCtxCreate).

A kernel executes `trap`, which leaves the primary context in a sticky error. Then: is every
call refused; does cuDevicePrimaryCtxReset + retain give a working context; can memory be
reserved again at the address it had (cuMemAddressReserve with that address as the hint)?
Driver API through ctypes only, so nothing but libcuda is needed.
"""
import ctypes as C
import sys

cu = C.CDLL("libcuda.so.1")
PTX = rb"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry boom() { trap; ret; }
.visible .entry ok(.param .u64 p) { .reg .u64 a; .reg .u32 v; ld.param.u64 a, [p]; cvta.to.global.u64 a, a; mov.u32 v, 7; st.global.u32 [a], v; ret; }
"""


def name(r):
    s = C.c_char_p()
    cu.cuGetErrorName(r, C.byref(s))
    return f"{r} {s.value.decode() if s.value else '?'}"


def call(what, r):
    print(f"{what}: {name(r)}", flush=True)
    return r


dev = C.c_int()
ctx = C.c_void_p()
call("cuInit", cu.cuInit(0))
call("cuDeviceGet", cu.cuDeviceGet(C.byref(dev), 0))
call("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev))
call("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))


def load():
    mod, boom, ok = C.c_void_p(), C.c_void_p(), C.c_void_p()
    call("cuModuleLoadData", cu.cuModuleLoadData(C.byref(mod), PTX))
    cu.cuModuleGetFunction(C.byref(boom), mod, b"boom")
    cu.cuModuleGetFunction(C.byref(ok), mod, b"ok")
    return boom, ok


def works(tag):
    """Allocate, run `ok`, read back 7: whether the context does work."""
    p = C.c_uint64()
    if call(f"{tag} cuMemAlloc", cu.cuMemAlloc_v2(C.byref(p), 4)):
        return False
    _, ok = load()
    arg = C.c_uint64(p.value)
    params = (C.c_void_p * 1)(C.cast(C.byref(arg), C.c_void_p))
    call(f"{tag} launch ok", cu.cuLaunchKernel(ok, 1, 1, 1, 1, 1, 1, 0, None, params, None))
    call(f"{tag} cuCtxSynchronize", cu.cuCtxSynchronize())
    v = C.c_uint32()
    call(f"{tag} cuMemcpyDtoH", cu.cuMemcpyDtoH_v2(C.byref(v), p, 4))
    print(f"{tag}: read {v.value} (7 expected)", flush=True)
    return v.value == 7



variant = sys.argv[1]
print("before the fault works:", works("before"))
boom, _ = load()
call("launch boom", cu.cuLaunchKernel(boom, 1, 1, 1, 1, 1, 1, 0, None, None, None))
call("cuCtxSynchronize after trap", cu.cuCtxSynchronize())
if variant == "release":
    call("cuCtxSetCurrent(NULL)", cu.cuCtxSetCurrent(None))
    call("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease_v2(dev))
    call("cuDevicePrimaryCtxReset", cu.cuDevicePrimaryCtxReset_v2(dev))
    ctx2 = C.c_void_p()
    call("cuDevicePrimaryCtxRetain again", cu.cuDevicePrimaryCtxRetain(C.byref(ctx2), dev))
    call("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx2))
else:
    ctx2 = C.c_void_p()
    call("cuCtxCreate", cu.cuCtxCreate_v2(C.byref(ctx2), 0, dev))
    call("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx2))
print(f"after ({variant}) works:", works("after"))
