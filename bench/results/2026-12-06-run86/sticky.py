"""Can a CUDA context in a sticky error be recreated in the same process? (issue 30)

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


# A virtual-memory reservation whose address the recreated context asks for again.
va = C.c_uint64()
size = 2 << 20
call("cuMemAddressReserve", cu.cuMemAddressReserve(C.byref(va), size, 0, 0, 0))
print(f"reserved at {va.value:#x}")
print("before the fault works:", works("before"))
boom, _ = load()
call("launch boom", cu.cuLaunchKernel(boom, 1, 1, 1, 1, 1, 1, 0, None, None, None))
call("cuCtxSynchronize after trap", cu.cuCtxSynchronize())
p = C.c_uint64()
call("cuMemAlloc after trap (sticky?)", cu.cuMemAlloc_v2(C.byref(p), 4))
call("cuDevicePrimaryCtxReset", cu.cuDevicePrimaryCtxReset_v2(dev))
ctx2 = C.c_void_p()
call("cuDevicePrimaryCtxRetain again", cu.cuDevicePrimaryCtxRetain(C.byref(ctx2), dev))
call("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx2))
print("after the reset works:", works("after"))
va2 = C.c_uint64()
call("cuMemAddressReserve at the old address", cu.cuMemAddressReserve(C.byref(va2), size, 0, va, 0))
print(f"asked {va.value:#x}, got {va2.value:#x}: {'same' if va.value == va2.value else 'different'}")
sys.exit(0)
