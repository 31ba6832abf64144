#!/usr/bin/env bash
# The real-driver check, in one call, for the `device` tool of a session lent a GPU machine. Run
# from the repository root with the release binary carried:
#   run(command="bash tests/device/check-real-driver.sh", carry=["target/release/gputrace"], timeout_s=540)
# For each way real programs get GPU memory (README.md), it records workload.py under
# `gputrace record --raw --json` and prints that API's verdicts (verdicts.py) as soon as its run
# ends; then `attach`, a PyTorch server that `record --pid` attaches to once it serves. No network
# and no package install: the workloads call libcudart and libcuda through ctypes; only torch,
# torch-expandable, attach (and microbench, which falls back to cudart) use PyTorch.
# Everything lands in $OUT as it goes (verdicts.txt, per API: .trace .json .report.json .csv .log);
# nothing is written elsewhere but /tmp. The whole run keeps within GPUTRACE_DEVICE_BUDGET seconds
# (420 by default, under the tool's 540): each API gets at most its own limit and what is left of
# the budget; an API the budget no longer covers is skipped with an UNSETTLED line.
set -u
START=$SECONDS
BUDGET=${GPUTRACE_DEVICE_BUDGET:-420}
DEADLINE=$((START + BUDGET))
OUT=${OUT:-/tmp/gputrace-device}
GPUTRACE=${GPUTRACE:-./target/release/gputrace}
HERE=tests/device
APIS="cudaMalloc vmm vmm-release-while-mapped vmm-ipc cudaMallocAsync cudaHostAlloc cudaHostRegister cudaMallocManaged oom torch torch-expandable microbench"
mkdir -p "$OUT" /tmp/gputrace-device-cache
: >"$OUT/verdicts.txt"
# Nothing written beside the scripts or in $HOME: no __pycache__, CUDA's JIT cache under /tmp.
export PYTHONDONTWRITEBYTECODE=1 CUDA_CACHE_PATH=/tmp/gputrace-device-cache/nv XDG_CACHE_HOME=/tmp/gputrace-device-cache

# Each API's own limit in seconds (start-up of CUDA, the recorder, 0.8 s per checkpoint).
limit_of() {
    case $1 in
        torch | torch-expandable | oom | microbench) echo 60 ;;
        cudaMalloc | cudaMallocManaged) echo 35 ;;
        *) echo 30 ;;
    esac
}

# A workload the limit stopped may outlive its recorder: end it by its own pid, so it does not
# hold GPU memory into the next API.
reap() {
    local pid
    pid=$(cat "$OUT/$1.json.pid" 2>/dev/null) || return 0
    if [ -n "$pid" ] && grep -q workload.py "/proc/$pid/cmdline" 2>/dev/null; then
        kill -KILL "$pid" 2>/dev/null && echo "$1: killed the workload left running (pid $pid)"
    fi
}

# What is left of the budget for one more step, keeping 15 s for its verdicts.
time_for() {
    local want=$1 left=$((DEADLINE - SECONDS - 15))
    [ "$want" -gt "$left" ] && want=$left
    echo "$want"
}

if [ ! -x "$GPUTRACE" ]; then
    echo "[UNSETTLED] everything: $GPUTRACE is missing (carry target/release/gputrace)" | tee -a "$OUT/verdicts.txt"
    exit 2
fi
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
{
    echo "== the machine"
    uname -r
    cat /sys/module/nvidia/version 2>/dev/null || head -1 /proc/driver/nvidia/version 2>/dev/null
    timeout 30 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,persistence_mode --format=csv,noheader
    # The majors gputrace checks NVIDIA's files against (SECURITY.md), and the nodes' own numbers.
    grep -E ' nvidia(-frontend|-uvm)?$' /proc/devices
    ls -l /dev/nvidiactl /dev/nvidia0 /dev/nvidia-uvm 2>&1
    "$GPUTRACE" --version 2>&1
    python3 --version 2>&1
    timeout 30 python3 "$HERE/workload.py" --libs 2>&1
    timeout 45 python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1
} 2>&1 | tee "$OUT/machine.txt"

for api in $APIS; do
    t=$(time_for "$(limit_of "$api")")
    if [ "$t" -lt 12 ]; then
        echo "[UNSETTLED] $api: skipped, $((DEADLINE - SECONDS)) s of the $BUDGET s budget left" | tee -a "$OUT/verdicts.txt"
        continue
    fi
    conf=""
    [ "$api" = torch-expandable ] && conf=expandable_segments:True
    began=$SECONDS
    timeout -k 5 "$t" env ${conf:+PYTORCH_CUDA_ALLOC_CONF=$conf} "$GPUTRACE" record --raw --json -o "$OUT/$api.trace" -- \
        python3 "$HERE/workload.py" "$api" "$OUT/$api.json" >"$OUT/$api.report.json" 2>"$OUT/$api.log"
    rc=$?
    echo "$api: gputrace record exited $rc after $((SECONDS - began)) s (limit $t s)" | tee -a "$OUT/verdicts.txt"
    case $rc in 124 | 137) reap "$api" ;; esac
    timeout 30 python3 "$HERE/verdicts.py" "$OUT" "$GPUTRACE" "$api" 2>&1 | tee -a "$OUT/verdicts.txt"
done

# The microbenchmark's baseline, untraced, right after the traced run.
if [ -s "$OUT/microbench.json" ]; then
    t=$(time_for 45)
    if [ "$t" -ge 12 ]; then
        timeout -k 5 "$t" python3 "$HERE/workload.py" microbench "$OUT/microbench.untraced.json" 2>>"$OUT/microbench.log"
        case $? in 124 | 137) reap microbench.untraced ;; esac
    fi
fi
timeout 30 python3 "$HERE/verdicts.py" "$OUT" "$GPUTRACE" overhead 2>&1 | tee -a "$OUT/verdicts.txt"

# attach (issue 24): a PyTorch server loads 16 GiB and serves a prompt untraced, then `record --pid`
# attaches to it; five short prompts, a long one that fails with an OOM in the server, a short one
# after. SIGTERM ends the server normally, and the recorder ends when it is gone (100 ms ticks).
# The server's, the recorder's and the client's lines go to attach.log, each appending.
attach() {
    local t end began server rec port rc src n
    t=$(time_for 60)
    if [ "$t" -lt 30 ]; then
        echo "[UNSETTLED] attach: skipped, $((DEADLINE - SECONDS)) s of the $BUDGET s budget left" | tee -a "$OUT/verdicts.txt"
        return
    fi
    began=$SECONDS
    end=$((SECONDS + t))
    rm -f "$OUT/attach.json.port"
    : >"$OUT/attach.log"
    python3 "$HERE/workload.py" attach "$OUT/attach.json" 2>>"$OUT/attach.log" &
    server=$!
    rec=""
    # Listening once the port is written (after PyTorch's start and the load).
    while [ ! -s "$OUT/attach.json.port" ] && kill -0 "$server" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 0.5; done
    port=$(cat "$OUT/attach.json.port" 2>/dev/null)
    if [ -n "$port" ]; then
        timeout 30 python3 "$HERE/workload.py" ask "$port" 300 | tee -a "$OUT/attach.log"
        "$GPUTRACE" record --pid "$server" --raw --json -o "$OUT/attach.trace" >"$OUT/attach.report.json" 2>>"$OUT/attach.log" &
        rec=$!
        # Tracing once it says so (the probes in, the server's files and sockets scanned); then a
        # second, so its first NVML sample (every 500 ms) comes before the prompts.
        while ! grep -q '^gputrace: tracing pid' "$OUT/attach.log" && kill -0 "$rec" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 0.2; done
        sleep 1
        if kill -0 "$rec" 2>/dev/null; then
            for n in 300 600 1200 2400 4800 204800 300; do
                [ "$SECONDS" -lt "$end" ] && timeout 30 python3 "$HERE/workload.py" ask "$port" "$n" | tee -a "$OUT/attach.log"
            done
        else
            echo "attach: the recorder did not start ($(grep '^gputrace' "$OUT/attach.log" | tail -2 | tr '\n' ' '))"
        fi
    else
        echo "attach: the server did not listen (log: $(tail -2 "$OUT/attach.log" | tr '\n' ' '))"
    fi
    kill -TERM "$server" 2>/dev/null
    while { kill -0 "$server" || { [ -n "$rec" ] && kill -0 "$rec"; }; } 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 0.2; done
    # Past the limit: the recorder stopped by a signal (it writes its report), the server killed by
    # its pid, so it holds no GPU memory into what follows.
    if [ -n "$rec" ] && kill -0 "$rec" 2>/dev/null; then
        kill -TERM "$rec"
        for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$rec" 2>/dev/null && sleep 0.5; done
        kill -KILL "$rec" 2>/dev/null
    fi
    kill -0 "$server" 2>/dev/null && reap attach
    wait "$server"
    src=$?
    rc="not started"
    [ -n "$rec" ] && { wait "$rec"; rc=$?; }
    echo "attach: the server exited $src, gputrace record --pid exited $rc after $((SECONDS - began)) s (limit $t s)" | tee -a "$OUT/verdicts.txt"
    timeout 30 python3 "$HERE/verdicts.py" "$OUT" "$GPUTRACE" attach 2>&1 | tee -a "$OUT/verdicts.txt"
    # Whatever still holds GPU memory now (nothing should).
    timeout 10 nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null |
        grep '^[0-9]' | sed 's/^/attach: still on the GPU: /'
}
attach

# Every verdict again, one line each, so the end of the output holds them all (details above and
# in $OUT/verdicts.txt).
echo
echo "== summary: $(grep -c '^\[YES\]' "$OUT/verdicts.txt") YES, $(grep -c '^\[NO\]' "$OUT/verdicts.txt") NO, $(grep -c '^\[UNSETTLED\]' "$OUT/verdicts.txt") UNSETTLED in $((SECONDS - START)) s"
grep '^\[' "$OUT/verdicts.txt" | cut -c1-170
! grep -q '^\[NO\]' "$OUT/verdicts.txt"
