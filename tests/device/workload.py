"""One way real programs get GPU memory, run under `gputrace record` (see check-real-driver.sh).

    python3 workload.py API OUT.json
    python3 workload.py ask PORT BYTES  # one POST of BYTES bytes to the `attach` server; prints its status
    python3 workload.py --libs          # which libcudart and libcuda it would use, and their versions

Everything but the torch workloads calls the CUDA libraries through ctypes, so it needs no
package and no network: the runtime (libcudart, found in torch's or nvidia-cuda-runtime's wheel,
by ldconfig, or under /usr/local/cuda; GPUTRACE_CUDART names one) and the driver API
(libcuda.so.1, the driver's own). Writes what it asked for and, at checkpoints, the driver's own
count of this process's memory (NVML, through nvidia-smi) with the CLOCK_MONOTONIC time
gputrace's records carry, so the traced live bytes can be compared with it at the same moments;
each checkpoint lasts 0.8 s so the recorder's own NVML sample (every 500 ms) falls inside it.
OUT.json is rewritten at every checkpoint, so a run cut short still says how far it got. Every
CUDA call is checked; a failure ends the workload with its name in `notes.why`, never a traceback.

APIs: cudaMalloc, cudaMallocAsync, vmm (cuMemCreate/cuMemMap), vmm-release-while-mapped, vmm-ipc
(export to a POSIX fd and import back), cudaHostAlloc, cudaHostRegister, cudaMallocManaged,
torch, torch-expandable, oom, microbench (torch when importable, else cudart), and attach: a
PyTorch server, started untraced, that `gputrace record --pid` attaches to once it serves (its port
in OUT.json.port once it listens; SIGTERM ends it normally).
"""
import ctypes
import ctypes.util
import glob
import http.client
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time

MIB, GIB = 1 << 20, 1 << 30
CHECKPOINT_S = 0.8  # longer than the recorder's NVML sampling period (500 ms)
# The attach server: what it loads before it listens, and the GPU memory a request costs per byte
# of its body: a 300-byte prompt holds 234 MiB, one of 200 KiB asks 156 GiB (past an H200's 141).
ATTACH_WEIGHTS = 16 * GIB
ATTACH_PER_BYTE = 800 << 10


# ---- The driver API's structures (cuda.h, CUDA 12/13) ----


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    """CUmemAllocationProp_v1: 32 bytes on LP64."""
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    """CUmemAccessDesc_v1: 12 bytes."""
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_NONE = 0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
cudaErrorMemoryAllocation = 2
cudaErrorStubLibrary = 34
cudaErrorInsufficientDriver = 35
cudaStreamNonBlocking = 1
cudaMemAttachGlobal = 1
cudaDevAttrMemoryPoolsSupported = 115

P, U64, SZ, INT, UINT = ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
PP, PU64, PSZ, PINT = ctypes.POINTER(P), ctypes.POINTER(U64), ctypes.POINTER(SZ), ctypes.POINTER(INT)

# name: (argtypes), every one returning an int status. Names as exported (cuda.h's #defines).
DRIVER = {
    "cuInit": (UINT,),
    "cuDriverGetVersion": (PINT,),
    "cuDeviceGet": (PINT, INT),
    "cuDevicePrimaryCtxRetain": (PP, INT),
    "cuCtxSetCurrent": (P,),
    "cuCtxSynchronize": (),
    "cuMemGetAllocationGranularity": (PSZ, ctypes.POINTER(CUmemAllocationProp), INT),
    "cuMemCreate": (PU64, SZ, ctypes.POINTER(CUmemAllocationProp), U64),
    "cuMemAddressReserve": (PU64, SZ, SZ, U64, U64),
    "cuMemMap": (U64, SZ, SZ, U64, U64),
    "cuMemSetAccess": (U64, SZ, ctypes.POINTER(CUmemAccessDesc), SZ),
    "cuMemUnmap": (U64, SZ),
    "cuMemRelease": (U64,),
    "cuMemAddressFree": (U64, SZ),
    "cuMemExportToShareableHandle": (P, U64, INT, U64),
    "cuMemImportFromShareableHandle": (PU64, P, INT),
}
RUNTIME = {
    "cudaRuntimeGetVersion": (PINT,),
    "cudaDriverGetVersion": (PINT,),
    "cudaSetDevice": (INT,),
    "cudaDeviceSynchronize": (),
    "cudaGetLastError": (),
    "cudaMemGetInfo": (PSZ, PSZ),
    "cudaDeviceGetAttribute": (PINT, INT, INT),
    "cudaMalloc": (PP, SZ),
    "cudaFree": (P,),
    "cudaStreamCreateWithFlags": (PP, UINT),
    "cudaStreamSynchronize": (P,),
    "cudaStreamDestroy": (P,),
    "cudaMallocAsync": (PP, SZ, P),
    "cudaFreeAsync": (P, P),
    "cudaHostAlloc": (PP, SZ, UINT),
    "cudaFreeHost": (P,),
    "cudaHostRegister": (P, SZ, UINT),
    "cudaHostUnregister": (P,),
    "cudaMallocManaged": (PP, SZ, UINT),
    "cudaMemset": (P, INT, SZ),
}


class CudaError(Exception):
    def __init__(self, call, code, name):
        super().__init__(f"{call} returned {code} ({name})")
        self.call, self.code = call, code


class Lib:
    """A CUDA library through ctypes: lib.call("cuMemMap", ...) raises CudaError on a non-zero
    status; lib.status("...", ...) returns it."""

    def __init__(self, path, table, error_name):
        self.path, self.dll = path, ctypes.CDLL(path)
        self.fns = {}
        for name, args in table.items():
            fn = getattr(self.dll, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = list(args), ctypes.c_int
                self.fns[name] = fn
        self._error_name = error_name

    def status(self, name, *args):
        fn = self.fns.get(name)
        if fn is None:
            raise CudaError(name, -1, f"not exported by {self.path}")
        return fn(*args)

    def call(self, name, *args):
        code = self.status(name, *args)
        if code != 0:
            raise CudaError(name, code, self.error_name(code))
        return code

    def error_name(self, code):
        try:
            return self._error_name(self.dll, code)
        except Exception:  # an old library without the name function: the number says it
            return "?"


def _driver_error_name(dll, code):
    text = ctypes.c_char_p()
    dll.cuGetErrorName.argtypes, dll.cuGetErrorName.restype = [INT, ctypes.POINTER(ctypes.c_char_p)], INT
    return text.value.decode() if dll.cuGetErrorName(code, ctypes.byref(text)) == 0 and text.value else "?"


def _runtime_error_name(dll, code):
    dll.cudaGetErrorName.argtypes, dll.cudaGetErrorName.restype = [INT], ctypes.c_char_p
    name = dll.cudaGetErrorName(code)
    return name.decode() if name else "?"


def cudart_candidates():
    """Where a libcudart may be: GPUTRACE_CUDART, the wheels next to torch (torch/lib, or
    nvidia-cuda-runtime's nvidia/cuda_runtime/lib, nvidia/cu13/lib), ldconfig, /usr/local/cuda."""
    found = [os.environ["GPUTRACE_CUDART"]] if os.environ.get("GPUTRACE_CUDART") else []
    roots = [p for p in sys.path if p and os.path.isdir(p)]
    try:
        import site
        roots += [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    except Exception:
        pass
    for root in dict.fromkeys(roots):
        for pattern in ["torch/lib/libcudart*.so*", "nvidia/cuda_runtime/lib/libcudart.so*", "nvidia/cu*/lib/libcudart.so*"]:
            found += sorted(glob.glob(os.path.join(root, pattern)), reverse=True)
    try:
        name = ctypes.util.find_library("cudart")
        if name:
            found.append(name)
    except Exception:
        pass
    found += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    for pattern in ["/usr/local/cuda/lib64/libcudart.so*", "/usr/local/cuda-*/lib64/libcudart.so*",
                    "/usr/local/cuda*/targets/*/lib/libcudart.so*", "/usr/lib/*-linux-gnu/libcudart.so*",
                    "/opt/conda/lib/libcudart.so*", "/usr/lib64/libcudart.so*"]:
        found += sorted(glob.glob(pattern), reverse=True)
    return list(dict.fromkeys(found))


def load_runtime(init=True):
    """The first libcudart that loads and (with init) brings up device 0: (Lib, tried)."""
    tried = []
    for path in cudart_candidates():
        try:
            lib = Lib(path, RUNTIME, _runtime_error_name)
            version = ctypes.c_int()
            lib.call("cudaRuntimeGetVersion", ctypes.byref(version))
            if init:
                lib.call("cudaSetDevice", 0)
                lib.call("cudaFree", None)  # creates the primary context
            lib.version = version.value
            return lib, tried
        except OSError:
            continue  # not there, or not loadable here
        except CudaError as e:
            tried.append(f"{path}: {e}")
    raise RuntimeError("no usable libcudart: " + ("; ".join(tried[-4:]) or "none found (GPUTRACE_CUDART names one)"))


def load_driver():
    path = os.environ.get("GPUTRACE_LIBCUDA") or "libcuda.so.1"
    try:
        return Lib(path, DRIVER, _driver_error_name)
    except OSError:
        return Lib("libcuda.so", DRIVER, _driver_error_name)


def parse_compute_apps(text, pid):
    """NVML's used memory for pid from `nvidia-smi --query-compute-apps=pid,used_memory
    --format=csv,noheader,nounits` (MiB), in bytes; None when pid is not listed (another pid
    namespace, say) or has no figure."""
    for line in text.splitlines():
        who, _, mib = line.partition(",")
        if who.strip() == str(pid):
            return int(mib.strip()) * MIB if mib.strip().isdigit() else None
    return None


def nvml_used():
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_compute_apps(text, os.getpid())


class Workload:
    def __init__(self, api, out_path):
        self.api, self.out_path = api, out_path
        self.asked, self.checkpoints, self.notes = [], [], {"ran": False, "pid": os.getpid()}
        self.sync = None

    def note(self, what, nbytes, expect="ok"):
        self.asked.append({"api": what, "bytes": nbytes, "expect": expect})

    def save(self):
        tmp = self.out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"api": self.api, "asked": self.asked, "checkpoints": self.checkpoints, "notes": self.notes}, f, indent=1)
        os.replace(tmp, self.out_path)

    def checkpoint(self, label):
        """Synchronises, records the time and NVML's figure, and stays still for CHECKPOINT_S so a
        sample of the recorder's falls between `ts` and `ts_end`."""
        if self.sync:
            try:
                self.sync()
            except Exception as e:
                self.notes.setdefault("errors", []).append(f"sync at {label!r}: {e}")
        ts = time.monotonic_ns()
        nvml = nvml_used()
        time.sleep(max(0.0, CHECKPOINT_S - (time.monotonic_ns() - ts) / 1e9))
        self.checkpoints.append({"label": label, "ts": ts, "ts_end": time.monotonic_ns(), "nvml_bytes": nvml})
        self.save()

    # ---- the runtime API ----

    def runtime(self):
        rt, tried = load_runtime()
        self.notes["cudart"], self.notes["cudart_version"] = rt.path, rt.version
        if tried:
            self.notes["cudart_refused"] = tried
        self.sync = lambda: rt.call("cudaDeviceSynchronize")
        return rt

    def run_cudaMalloc(self):
        rt = self.runtime()
        self.checkpoint("baseline")
        ptrs = []
        for size in [MIB, 64 * MIB, GIB, 3 * GIB + 12345]:
            p = P()
            rt.call("cudaMalloc", ctypes.byref(p), size)
            ptrs.append(p)
            self.note("cudaMalloc", size)
        self.checkpoint("4 allocations live")
        for p in ptrs:
            rt.call("cudaFree", p)
        self.checkpoint("all freed")

    def run_cudaMallocAsync(self):
        rt = self.runtime()
        supported = INT()
        if rt.status("cudaDeviceGetAttribute", ctypes.byref(supported), cudaDevAttrMemoryPoolsSupported, 0) == 0:
            self.notes["memory_pools_supported"] = supported.value
        stream = P()
        rt.call("cudaStreamCreateWithFlags", ctypes.byref(stream), cudaStreamNonBlocking)
        self.checkpoint("baseline")
        ptrs = []
        for size in [64 * MIB, GIB]:
            p = P()
            rt.call("cudaMallocAsync", ctypes.byref(p), size, stream)
            ptrs.append(p)
            self.note("cudaMallocAsync", size)
        rt.call("cudaStreamSynchronize", stream)
        self.checkpoint("pool holds 1 GiB+")
        for p in ptrs:
            rt.call("cudaFreeAsync", p, stream)
        rt.call("cudaStreamSynchronize", stream)
        self.checkpoint("freed to the pool (the pool may keep it)")
        rt.call("cudaStreamDestroy", stream)

    def run_cudaHostAlloc(self):
        rt = self.runtime()
        self.checkpoint("baseline")
        p = P()
        rt.call("cudaHostAlloc", ctypes.byref(p), 256 * MIB, 0)
        self.note("cudaHostAlloc", 256 * MIB)
        self.checkpoint("pinned host memory live")
        rt.call("cudaFreeHost", p)
        self.checkpoint("freed")

    def run_cudaHostRegister(self):
        rt = self.runtime()
        size = 256 * MIB
        region = mmap.mmap(-1, size)
        view = (ctypes.c_char * size).from_buffer(region)
        try:
            self.checkpoint("baseline")
            rt.call("cudaHostRegister", ctypes.addressof(view), size, 0)
            self.note("cudaHostRegister", size)
            self.checkpoint("registered")
            rt.call("cudaHostUnregister", ctypes.addressof(view))
            self.checkpoint("unregistered")
        finally:
            del view
            region.close()

    def run_cudaMallocManaged(self):
        rt = self.runtime()
        self.checkpoint("baseline")
        p, size = P(), 512 * MIB
        rt.call("cudaMallocManaged", ctypes.byref(p), size, cudaMemAttachGlobal)
        self.note("cudaMallocManaged", size, expect="no ioctl per allocation")
        rt.call("cudaMemset", p, 1, size)  # a kernel on the GPU: the pages move there
        self.checkpoint("managed, touched on the GPU")
        # Kept live to the end: the report compares NVML's last sample with the traced bytes,
        # so the buffer must still be there at the last samples before the process goes.
        time.sleep(1.2)
        self.checkpoint("still live, the process about to exit")
        self.notes["held_until_exit"] = True

    def run_oom(self):
        rt = self.runtime()
        free, total = SZ(), SZ()
        rt.call("cudaMemGetInfo", ctypes.byref(free), ctypes.byref(total))
        self.notes["free_before"], self.notes["total"] = free.value, total.value
        held = []
        for _ in range(4096):
            p = P()
            code = rt.status("cudaMalloc", ctypes.byref(p), GIB)
            if code != 0:
                rt.status("cudaGetLastError")
                self.notes["error"] = f"cudaMalloc returned {code} ({rt.error_name(code)}) after {len(held)} GiB"
                self.notes["refused"] = code == cudaErrorMemoryAllocation
                self.note("cudaMalloc until it fails", GIB, expect="fails")
                break
            held.append(p)
        self.notes["held_gib"] = len(held)
        self.checkpoint(f"{len(held)} GiB held, the next refused")
        for p in held:
            rt.status("cudaFree", p)

    # ---- the driver API (VMM) ----

    def run_vmm(self):
        cu = load_driver()
        self.notes["libcuda"] = cu.path
        version = INT()
        if cu.status("cuDriverGetVersion", ctypes.byref(version)) == 0:
            self.notes["driver_api_version"] = version.value
        cu.call("cuInit", 0)
        dev, ctx = INT(), P()
        cu.call("cuDeviceGet", ctypes.byref(dev), 0)
        cu.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev.value)
        cu.call("cuCtxSetCurrent", ctx)
        self.sync = lambda: cu.call("cuCtxSynchronize")
        ipc = self.api == "vmm-ipc"
        prop = CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if ipc else CU_MEM_HANDLE_TYPE_NONE
        prop.location.type, prop.location.id = CU_MEM_LOCATION_TYPE_DEVICE, dev.value
        gran = SZ()
        cu.call("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self.notes["granularity"] = gran.value
        size = -(-GIB // gran.value) * gran.value
        self.checkpoint("baseline")
        handle, va = U64(), U64()
        cu.call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
        self.note("cuMemCreate", size)
        cu.call("cuMemAddressReserve", ctypes.byref(va), size, 0, 0, 0)
        cu.call("cuMemMap", va.value, size, 0, handle.value, 0)
        access = CUmemAccessDesc()
        access.location.type, access.location.id = CU_MEM_LOCATION_TYPE_DEVICE, dev.value
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        cu.call("cuMemSetAccess", va.value, size, ctypes.byref(access), 1)
        self.checkpoint("created and mapped")
        if ipc:
            # Exported to a POSIX fd (EXPORT_OBJECT_TO_FD or the batched EXPORT_OBJECTS_TO_FD?),
            # imported back, every handle released with the fd open.
            fd, imported = INT(-1), U64()
            cu.call("cuMemExportToShareableHandle", ctypes.byref(fd), handle.value, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            self.notes["exported_fd"] = fd.value
            cu.call("cuMemImportFromShareableHandle", ctypes.byref(imported), P(fd.value), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            self.notes["exported_and_imported"] = True
            cu.call("cuMemUnmap", va.value, size)
            cu.call("cuMemRelease", handle.value)
            self.checkpoint("released, the import's handle and the fd keep it: memory must stay live")
            cu.call("cuMemRelease", imported.value)
            self.checkpoint("the import released, the fd open: memory must stay live")
            os.close(fd.value)
            self.checkpoint("fd closed: memory must be gone")
        elif self.api == "vmm-release-while-mapped":
            cu.call("cuMemRelease", handle.value)
            self.checkpoint("handle released, still mapped: memory must stay live")
            cu.call("cuMemUnmap", va.value, size)
            self.checkpoint("unmapped: memory must be gone")
        else:
            cu.call("cuMemUnmap", va.value, size)
            cu.call("cuMemRelease", handle.value)
            self.checkpoint("unmapped and released")
        cu.call("cuMemAddressFree", va.value, size)

    run_vmm_release_while_mapped = run_vmm_ipc = run_vmm

    # ---- PyTorch ----

    def run_torch(self):
        if self.api == "torch-expandable":
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        import torch
        self.notes["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
        self.notes["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        torch.cuda.init()
        torch.cuda.synchronize()  # the context, before any tensor
        self.sync = torch.cuda.synchronize
        self.checkpoint("baseline")
        sizes = [MIB, 100 * MIB, GIB]
        xs = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in sizes]
        for size in sizes:
            self.note(self.api, size, expect="rounded into the caching allocator's segments")
        self.notes["torch_reserved"] = torch.cuda.memory_reserved()
        self.checkpoint("three tensors live")
        del xs
        torch.cuda.empty_cache()
        self.checkpoint("freed and cache emptied")

    run_torch_expandable = run_torch

    def run_microbench(self):
        n = 2000
        try:
            os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            self.notes["via"] = f"torch {torch.__version__}, caching off"
            torch.cuda.init()
            torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")  # warm up
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                t = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
                del t
            torch.cuda.synchronize()
        else:
            rt = self.runtime()
            self.notes["via"] = "cudart cudaMalloc/cudaFree through ctypes (torch not importable)"
            p = P()
            start = time.perf_counter()
            for _ in range(n):
                rt.call("cudaMalloc", ctypes.byref(p), 4 * MIB)
                rt.call("cudaFree", p)
        self.notes["us_per_alloc_free"] = (time.perf_counter() - start) / n * 1e6

    # ---- a server met running (`record --pid`) ----

    def run_attach(self):
        """Loads ATTACH_WEIGHTS on cuda:0, then listens on 127.0.0.1 (a port of the kernel's
        choosing, written to OUT.json.port once listening: the shell waits for it) and serves
        each POST, one at a time, until SIGTERM; then releases everything and returns."""
        import http.server
        import torch
        self.notes["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
        weights = [torch.full((GIB,), 1, dtype=torch.uint8, device="cuda:0") for _ in range(ATTACH_WEIGHTS // GIB)]
        torch.cuda.synchronize()
        self.notes.update(weights_bytes=ATTACH_WEIGHTS, per_byte=ATTACH_PER_BYTE, reserved_after_load=torch.cuda.memory_reserved(),
                          requests=[])
        w = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 30  # a client that never sends does not hold the only thread

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, text = w.serve(torch, len(body))
                answer = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        server = http.server.HTTPServer(("127.0.0.1", 0), Handler)

        def stop(signum, frame):
            # shutdown() waits for serve_forever(), which runs in this (the main) thread.
            self.notes["stopping_ns"] = time.monotonic_ns()
            threading.Thread(target=server.shutdown).start()

        signal.signal(signal.SIGTERM, stop)
        self.notes["port"] = server.server_port
        self.save()
        with open(self.out_path + ".port.tmp", "w") as f:
            f.write(str(server.server_port))
        os.replace(self.out_path + ".port.tmp", self.out_path + ".port")
        server.serve_forever(poll_interval=0.2)
        server.server_close()
        del weights
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        self.notes["reserved_at_exit"] = torch.cuda.memory_reserved()

    def serve(self, torch, n):
        """One request of n bytes: ATTACH_PER_BYTE a byte of GPU memory, filled (a kernel) and
        freed to the caching allocator. An OOM answers 500, and serving goes on."""
        asked, began = n * ATTACH_PER_BYTE, time.monotonic_ns()
        try:
            x = torch.empty(asked, dtype=torch.uint8, device="cuda:0")
            x.fill_(1)
            torch.cuda.synchronize()
            del x
            status, text = 200, f"served {n} bytes\n"
        except torch.cuda.OutOfMemoryError as e:
            free, total = torch.cuda.mem_get_info()
            self.notes["oom"] = {"bytes": n, "asked": asked, "error": str(e).splitlines()[0][:300], "free": free, "total": total,
                                 "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
            status, text = 500, "CUDA out of memory\n"
        except Exception as e:  # said in the notes and the answer; the server goes on
            self.notes.setdefault("errors", []).append(f"{n} bytes: {type(e).__name__}: {e}"[:300])
            status, text = 500, f"{type(e).__name__}\n"
        self.notes["requests"].append({"bytes": n, "asked": asked, "status": status, "ts": began, "ts_end": time.monotonic_ns()})
        self.save()
        return status, text

    def run(self):
        method = getattr(self, "run_" + self.api.replace("-", "_"), None)
        if method is None:
            raise RuntimeError(f"no API {self.api}")
        method()


def libs():
    """Says which libraries the workloads would use, without a context."""
    try:
        rt, tried = load_runtime(init=False)
        print(f"libcudart: {rt.path} (runtime {rt.version})")
    except Exception as e:
        print(f"libcudart: none usable ({e})")
    try:
        cu = load_driver()
        version = INT()
        cu.status("cuDriverGetVersion", ctypes.byref(version))
        print(f"libcuda: {cu.path} (driver API {version.value})")
    except Exception as e:
        print(f"libcuda: not loadable ({e})")


def ask(port, n):
    """One POST of n bytes to the attach server, as a client would send a prompt: 0 when served."""
    conn, began = http.client.HTTPConnection("127.0.0.1", port, timeout=60), time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body=b"a" * n, headers={"Content-Type": "text/plain"})
        answer = conn.getresponse()
        text = answer.read().decode(errors="replace").strip()[:120]
    except (OSError, http.client.HTTPException) as e:
        print(f"attach: asked {n} bytes: no answer ({type(e).__name__}: {e})", flush=True)
        return 2
    finally:
        conn.close()
    print(f"attach: asked {n} bytes: HTTP {answer.status} in {time.monotonic() - began:.2f} s: {text}", flush=True)
    return 0 if answer.status == 200 else 1


def main(argv):
    if argv[1:] == ["--libs"]:
        libs()
        return 0
    if len(argv) == 4 and argv[1] == "ask":
        return ask(int(argv[2]), int(argv[3]))
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    w = Workload(argv[1], argv[2])
    with open(argv[2] + ".pid", "w") as f:
        f.write(str(os.getpid()))

    def terminated(signum, frame):
        w.notes["why"] = f"terminated by signal {signum} (the time limit?)"
        w.save()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    w.save()
    try:
        w.run()
        w.notes["ran"] = True
    except Exception as e:  # a missing library, a refused call: said, not hidden
        w.notes["why"] = f"{type(e).__name__}: {e}"
    w.save()
    print(f"{w.api}: {'ran' if w.notes['ran'] else 'did not run: ' + w.notes['why']}", file=sys.stderr)
    return 0 if w.notes["ran"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
