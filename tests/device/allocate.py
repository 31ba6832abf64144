"""Allocates through CUDA's runtime the ways real programs do, and writes what it asked for.

Run under `gputrace record` on a machine with a real NVIDIA GPU (see check-real-driver.sh).
"""
import json
import sys

import cupy

rt = cupy.cuda.runtime
asked = []

def note(api, nbytes):
    asked.append({"api": api, "bytes": nbytes})

device = []
for size in [1 << 20, 64 << 20, 1 << 30, 3 * (1 << 30) + 12345]:
    device.append(rt.malloc(size))
    note("cudaMalloc", size)
pinned = rt.hostAlloc(256 << 20, 0)
note("cudaHostAlloc", 256 << 20)
managed = rt.mallocManaged(128 << 20, 1)
note("cudaMallocManaged", 128 << 20)
for p in device:
    rt.free(p)
rt.freeHost(pinned)
rt.free(managed)
try:
    rt.malloc(1 << 50)
except cupy.cuda.runtime.CUDARuntimeError:
    note("cudaMalloc-expected-failure", 1 << 50)
with open(sys.argv[1], "w") as f:
    json.dump(asked, f)
