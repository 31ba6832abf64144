"""One way real programs get GPU memory, run under `gputrace record` (see check-real-driver.sh).

    python3 workload.py API OUT.json

Writes what it asked for and, at checkpoints, the driver's own count of this process's memory
(NVML, through nvidia-smi) with the CLOCK_MONOTONIC time gputrace's records carry, so the
traced live bytes can be compared with it at the same moments. APIs: cudaMalloc,
cudaMallocAsync, vmm (cuMemCreate/cuMemMap), vmm-release-while-mapped, vmm-ipc (export to a
POSIX fd and import back), cudaHostAlloc,
cudaHostRegister, cudaMallocManaged, torch, torch-expandable, oom, microbench.
"""
import json
import os
import subprocess
import sys
import time

api, out_path = sys.argv[1], sys.argv[2]
MIB, GIB = 1 << 20, 1 << 30
asked, checkpoints, notes = [], [], {}


def note(what, nbytes, expect="ok"):
    asked.append({"api": what, "bytes": nbytes, "expect": expect})


def nvml_used():
    """This process's used GPU memory as NVML counts it (bytes), or None."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in text.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip() == str(os.getpid()) and mib.strip().isdigit():
            return int(mib.strip()) * MIB
    return 0


def checkpoint(label):
    """Synchronises, then records the time and NVML's figure."""
    try:
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
    except Exception:
        pass
    time.sleep(0.3)
    checkpoints.append({"label": label, "ts": time.monotonic_ns(), "nvml_bytes": nvml_used()})


def cupy_runtime():
    import cupy
    return cupy, cupy.cuda.runtime


def run():
    if api == "cudaMalloc":
        cupy, rt = cupy_runtime()
        ptrs = []
        for size in [MIB, 64 * MIB, GIB, 3 * GIB + 12345]:
            ptrs.append(rt.malloc(size))
            note("cudaMalloc", size)
        checkpoint("4 allocations live")
        for p in ptrs:
            rt.free(p)
        checkpoint("all freed")
    elif api == "cudaMallocAsync":
        cupy, rt = cupy_runtime()
        stream = cupy.cuda.Stream(non_blocking=True)
        ptrs = []
        for size in [64 * MIB, GIB]:
            ptrs.append(rt.mallocAsync(size, stream.ptr))
            note("cudaMallocAsync", size)
        stream.synchronize()
        checkpoint("pool holds 1 GiB+")
        for p in ptrs:
            rt.freeAsync(p, stream.ptr)
        stream.synchronize()
        checkpoint("freed to the pool (the pool may keep it)")
    elif api in ("vmm", "vmm-release-while-mapped", "vmm-ipc"):
        from cuda import cuda  # cuda-python
        def ok(result):
            err = result[0]
            if err != cuda.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"CUDA driver error {err}")
            return result[1] if len(result) == 2 else result[1:]
        ok(cuda.cuInit(0))
        dev = ok(cuda.cuDeviceGet(0))
        ctx = ok(cuda.cuDevicePrimaryCtxRetain(dev))
        ok((cuda.cuCtxSetCurrent(ctx)[0], None))
        prop = cuda.CUmemAllocationProp()
        prop.type = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        if api == "vmm-ipc":
            prop.requestedHandleTypes = cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        gran = ok(cuda.cuMemGetAllocationGranularity(prop, cuda.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        size = ((GIB + gran - 1) // gran) * gran
        handle = ok(cuda.cuMemCreate(size, prop, 0))
        note("cuMemCreate", size)
        va = ok(cuda.cuMemAddressReserve(size, 0, 0, 0))
        ok((cuda.cuMemMap(va, size, 0, handle, 0)[0], None))
        access = cuda.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cuda.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        ok((cuda.cuMemSetAccess(va, size, [access], 1)[0], None))
        checkpoint("created and mapped")
        if api == "vmm-ipc":
            # Exported to a POSIX fd (which RM_CONTROL: EXPORT_OBJECT_TO_FD or the batched
            # EXPORT_OBJECTS_TO_FD?), imported back, every handle released with the fd open.
            kind = cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            fd = ok(cuda.cuMemExportToShareableHandle(handle, kind, 0))
            imported = ok(cuda.cuMemImportFromShareableHandle(fd, kind))
            ok((cuda.cuMemUnmap(va, size)[0], None))
            ok((cuda.cuMemRelease(handle)[0], None))
            checkpoint("released, the import's handle and the fd keep it: memory must stay live")
            ok((cuda.cuMemRelease(imported)[0], None))
            checkpoint("the import released, the fd open: memory must stay live")
            os.close(fd)
            checkpoint("fd closed: memory must be gone")
        elif api == "vmm-release-while-mapped":
            ok((cuda.cuMemRelease(handle)[0], None))
            checkpoint("handle released, still mapped: memory must stay live")
            ok((cuda.cuMemUnmap(va, size)[0], None))
            checkpoint("unmapped: memory must be gone")
        else:
            ok((cuda.cuMemUnmap(va, size)[0], None))
            ok((cuda.cuMemRelease(handle)[0], None))
            checkpoint("unmapped and released")
        ok((cuda.cuMemAddressFree(va, size)[0], None))
    elif api == "cudaHostAlloc":
        cupy, rt = cupy_runtime()
        p = rt.hostAlloc(256 * MIB, 0)
        note("cudaHostAlloc", 256 * MIB)
        checkpoint("pinned host memory live")
        rt.freeHost(p)
        checkpoint("freed")
    elif api == "cudaHostRegister":
        cupy, rt = cupy_runtime()
        import numpy
        buf = numpy.zeros(256 * MIB, dtype=numpy.uint8)
        rt.hostRegister(buf.ctypes.data, buf.nbytes, 0)
        note("cudaHostRegister", buf.nbytes)
        checkpoint("registered")
        rt.hostUnregister(buf.ctypes.data)
        checkpoint("unregistered")
    elif api == "cudaMallocManaged":
        cupy, rt = cupy_runtime()
        p = rt.mallocManaged(512 * MIB, 1)
        note("cudaMallocManaged", 512 * MIB, expect="no ioctl per allocation")
        cupy.cuda.runtime.memset(p, 1, 512 * MIB)
        checkpoint("managed, touched on the GPU")
        rt.free(p)
        checkpoint("freed")
    elif api in ("torch", "torch-expandable"):
        import torch
        xs = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in [MIB, 100 * MIB, GIB]]
        for size in [MIB, 100 * MIB, GIB]:
            note(api, size, expect="rounded into the caching allocator's segments")
        torch.cuda.synchronize()
        notes["torch_reserved"] = torch.cuda.memory_reserved()
        checkpoint("three tensors live")
        del xs
        torch.cuda.empty_cache()
        checkpoint("freed and cache emptied")
    elif api == "oom":
        cupy, rt = cupy_runtime()
        free, total = rt.memGetInfo()
        notes["free_before"], notes["total"] = free, total
        held = []
        try:
            while True:
                held.append(rt.malloc(GIB))
        except cupy.cuda.runtime.CUDARuntimeError as e:
            notes["error"] = str(e)
            note("cudaMalloc until it fails", GIB, expect="fails")
        checkpoint(f"{len(held)} GiB held, the next refused")
        for p in held:
            rt.free(p)
    elif api == "microbench":
        os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
        import torch
        torch.cuda.init()
        n = 2000
        start = time.perf_counter()
        for _ in range(n):
            t = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
            del t
        torch.cuda.synchronize()
        notes["us_per_alloc_free"] = (time.perf_counter() - start) / n * 1e6
    else:
        sys.exit(f"no API {api}")


try:
    run()
    notes["ran"] = True
except Exception as e:  # a missing library or API: said, not hidden
    notes["ran"] = False
    notes["why"] = f"{type(e).__name__}: {e}"
with open(out_path, "w") as f:
    json.dump({"api": api, "asked": asked, "checkpoints": checkpoints, "notes": notes}, f, indent=1)
