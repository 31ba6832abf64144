#!/usr/bin/env bash
# The real-driver check, in one call, for the `device` tool of a session lent a GPU machine. Run
# from the repository root with the release binary carried:
#   run(command="bash tests/device/check-real-driver.sh", carry=["target/release/gputrace"], timeout_s=540)
# For each way real programs get GPU memory (README.md), it records workload.py under
# `gputrace record --raw`, then verdicts.py prints one verdict per question. Everything lands in
# $OUT. A library that is missing (CuPy, cuda-python, torch) is installed with pip when the
# machine reaches PyPI, else its questions say UNSETTLED.
set -u
OUT=${OUT:-/tmp/gputrace-device}
GPUTRACE=./target/release/gputrace
mkdir -p "$OUT"
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
cat /sys/module/nvidia/version /proc/driver/nvidia/version 2>/dev/null | head -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# The majors gputrace checks NVIDIA's files against (SECURITY.md), and the nodes' own numbers.
grep -E ' nvidia(-frontend|-uvm)?$' /proc/devices
ls -l /dev/nvidiactl /dev/nvidia0 /dev/nvidia-uvm 2>&1
for module in cupy:cupy-cuda12x cuda:cuda-python torch:torch numpy:numpy; do
    python3 -c "import ${module%%:*}" 2>/dev/null || timeout 240 pip install -q "${module##*:}" >>"$OUT/pip.log" 2>&1
done
APIS="cudaMalloc cudaMallocAsync vmm vmm-release-while-mapped vmm-ipc cudaHostAlloc cudaHostRegister cudaMallocManaged torch torch-expandable oom microbench"
for api in $APIS; do
    env=()
    [ "$api" = torch-expandable ] && env=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
    timeout 120 env "${env[@]}" "$GPUTRACE" record --raw --json -o "$OUT/$api.trace" -- \
        python3 tests/device/workload.py "$api" "$OUT/$api.json" >"$OUT/$api.report.json" 2>"$OUT/$api.log"
    echo "$api: gputrace record exited $?"
done
# The microbenchmark's baseline, untraced, right after the traced run.
timeout 120 python3 tests/device/workload.py microbench "$OUT/microbench.untraced.json"
python3 tests/device/verdicts.py "$OUT" "$GPUTRACE" | tee "$OUT/verdicts.txt"
