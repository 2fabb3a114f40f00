#!/usr/bin/env python3
"""tools/gpu/cuda-attrs.py — the CUDA device attributes that decide whether the gio kernel's
results can be trusted, read through the driver API with ctypes (no torch, no nvcc; standard
library only), one `key=value` line each, for run-all.sh's header and run-gpu-tests.sh.

Why: kernels/gio_io_kernel.cu does atomicCAS/atomicAdd on host-mapped memory (the sink ring's
header, the IOCB status words and counters). Where hostNativeAtomicSupported is 0 (an x86 host
with the GPU on PCIe, the usual H100/H200 server) such atomics are atomic among GPU threads but
not with respect to the CPU, so a wrong result there may be this, not the code. The others say
how host memory is reached (pageable access, host page tables, registered pointers).

Never fails: whatever cannot be read is printed as `unknown (why)`, and the exit status is 0.

`cuda-attrs.py --load-probe STEM DIR...` instead loads, for each DIR, the kernel image the gio
runtime would pick there (STEM.sm_XY.cubin for this GPU, else STEM.compute_80.ptx, as
KernelImage::locate does) with cuModuleLoadData in the device's primary context, and prints
`load DIR=ok (FILE)`, `load DIR=FAILED <CUresult> (FILE)` (the driver refuses the image: a cubin
of a newer CUDA major than the driver's, say), `load DIR=missing (...)` or `load DIR=unknown (why)`
(the probe itself could not run), after a `driverApiVersion=` line. run-gpu-tests.sh uses the
first DIR that loads.
"""
import ctypes
import ctypes.util
import glob
import os
import site
import sys

# CUdevice_attribute values (cuda.h; the runtime's cudaDevAttr* have the same numbers).
ATTRIBUTES = [
    ("computeCapabilityMajor", 75),
    ("computeCapabilityMinor", 76),
    ("multiProcessorCount", 16),
    ("hostNativeAtomicSupported", 86),
    ("pageableMemoryAccess", 88),
    ("pageableMemoryAccessUsesHostPageTables", 100),
    ("canUseHostPointerForRegisteredMem", 91),
    ("canMapHostMemory", 19),
    ("unifiedAddressing", 41),
    ("concurrentManagedAccess", 89),
    ("directManagedMemAccessFromHost", 101),
    ("gpuDirectRdmaSupported", 116),
]


def load(names):
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name), name
        except OSError as error:
            errors.append(str(error))
    # The first error (the plain name's) says enough; the others repeat it for other names.
    return None, (errors[0][:160] + (f" and {len(errors) - 1} more names" if len(errors) > 1 else "")) if errors else "no candidate"


def runtime_candidates():
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    roots = ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
    try:
        roots += [os.path.join(r, "nvidia", sub, "lib") for r in site.getsitepackages() + [site.getusersitepackages()]
                  for sub in ("cuda_runtime", "cu13", "cu12")]
    except Exception:  # a python without site-packages paths
        pass
    for root in roots:
        names += sorted(glob.glob(os.path.join(root, "libcudart.so*")), reverse=True)
    return names


def version(value):
    return f"{value // 1000}.{value % 1000 // 10}" if value > 0 else str(value)


def main():
    device = int(os.environ.get("CUDA_ATTRS_DEVICE", "0"))
    print(f"LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '<unset>')}")
    cuda, how = load(["libcuda.so.1", "libcuda.so"])
    if cuda is None:
        print(f"driver=unknown (libcuda not loadable: {how})")
    else:
        print(f"libcuda={how}")
        value = ctypes.c_int(0)
        rc = cuda.cuDriverGetVersion(ctypes.byref(value))
        print(f"driverApiVersion={version(value.value)}" if rc == 0 else f"driverApiVersion=unknown (cuDriverGetVersion {rc})")
        rc = cuda.cuInit(0)
        if rc != 0:
            print(f"cuInit=FAILED {rc} (a stub libcuda on LD_LIBRARY_PATH, no device, or a driver/library mismatch)")
        else:
            handle = ctypes.c_int(0)
            rc = cuda.cuDeviceGet(ctypes.byref(handle), device)
            if rc != 0:
                print(f"device{device}=unknown (cuDeviceGet {rc})")
            else:
                name = ctypes.create_string_buffer(256)
                if cuda.cuDeviceGetName(name, 256, handle) == 0:
                    print(f"device{device}={name.value.decode(errors='replace')}")
                for key, attribute in ATTRIBUTES:
                    rc = cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, handle)
                    print(f"{key}={value.value}" if rc == 0 else f"{key}=unknown (cuDeviceGetAttribute {rc})")
    runtime, how = load(runtime_candidates())
    if runtime is None:
        print(f"runtimeVersion=unknown (no libcudart: {how})")
    else:
        value = ctypes.c_int(0)
        rc = runtime.cudaRuntimeGetVersion(ctypes.byref(value))
        print(f"runtimeVersion={version(value.value)} ({how})" if rc == 0 else f"runtimeVersion=unknown (cudaRuntimeGetVersion {rc})")
    sys.stdout.flush()


def load_probe(stem, dirs):
    cuda, how = load(["libcuda.so.1", "libcuda.so"])
    unknown = None
    if cuda is None:
        unknown = f"libcuda not loadable: {how}"
    else:
        value = ctypes.c_int(0)
        rc = cuda.cuDriverGetVersion(ctypes.byref(value))
        print(f"driverApiVersion={version(value.value)}" if rc == 0 else f"driverApiVersion=unknown (cuDriverGetVersion {rc})")
        device = ctypes.c_int(0)
        context = ctypes.c_void_p(None)
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        steps = (("cuInit", lambda: cuda.cuInit(0)),
                 ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(device), int(os.environ.get("CUDA_ATTRS_DEVICE", "0")))),
                 ("cuDeviceGetAttribute", lambda: cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)),
                 ("cuDeviceGetAttribute", lambda: cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)),
                 ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)),
                 ("cuCtxSetCurrent", lambda: cuda.cuCtxSetCurrent(context)))
        for call, step in steps:
            rc = step()
            if rc != 0:
                unknown = f"{call} {rc}"
                break
    if unknown is not None:
        for directory in dirs:
            print(f"load {directory}=unknown ({unknown})")
        return
    cubin, ptx = f"{stem}.sm_{major.value}{minor.value}.cubin", f"{stem}.compute_80.ptx"
    for directory in dirs:
        name = cubin if os.path.isfile(os.path.join(directory, cubin)) else ptx
        try:
            with open(os.path.join(directory, name), "rb") as handle:
                image = handle.read()
        except OSError:
            print(f"load {directory}=missing (neither {cubin} nor {ptx})")
            continue
        if name.endswith(".ptx"):
            image += b"\0"  # cuModuleLoadData reads PTX as a C string
        module = ctypes.c_void_p(None)
        rc = cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image))
        if rc == 0:
            cuda.cuModuleUnload(module)
            print(f"load {directory}=ok ({name})")
        else:
            print(f"load {directory}=FAILED {rc} ({name})")
    cuda.cuDevicePrimaryCtxRelease_v2(device)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--load-probe":
        try:
            load_probe(sys.argv[2], sys.argv[3:])
        except Exception as error:  # never fail the caller over a probe
            print(f"cuda-attrs: load probe failed: {error!r}")
        sys.stdout.flush()
        sys.exit(0)
    try:
        main()
    except Exception as error:  # never fail the caller over a probe
        print(f"cuda-attrs: probe failed: {error!r}")
