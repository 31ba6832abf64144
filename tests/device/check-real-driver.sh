#!/usr/bin/env bash
# Checks gputrace's decoder against a real NVIDIA driver. For the `device` tool of a session that
# is lent a GPU machine, run from the repository root with the release binary carried:
#   run(command="bash tests/device/check-real-driver.sh", carry=["target/release/gputrace"])
# It records allocate.py (cudaMalloc, cudaHostAlloc, cudaMallocManaged, one failure) with --raw,
# and compare.py says which requested sizes gputrace decoded. Results land in $OUT.
set -u
OUT=${OUT:-/tmp/gputrace-device}
mkdir -p "$OUT"
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
cat /sys/module/nvidia/version /proc/driver/nvidia/version 2>/dev/null | head -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
./target/release/gputrace record --raw --json -o "$OUT/real.trace" -- \
    python3 tests/device/allocate.py "$OUT/expected.json" >"$OUT/report.json" 2>"$OUT/record.log"
echo "gputrace record exited $?"
tail -5 "$OUT/record.log"
python3 tests/device/compare.py "$OUT"
