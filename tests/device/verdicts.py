"""Reads what check-real-driver.sh recorded and prints one verdict per question (README.md).

    python3 verdicts.py OUT GPUTRACE

OUT holds, per API, API.trace (gputrace record --raw), API.json (workload.py's account) and
API.csv (gputrace export --format csv); microbench.untraced.json beside microbench.json.
"""
import collections
import csv
import json
import subprocess
import sys

out, gputrace = sys.argv[1], sys.argv[2]
MIB = 1 << 20
failures = 0


def verdict(question, ok, detail):
    global failures
    state = {True: "YES", False: "NO", None: "UNSETTLED"}[ok]
    failures += ok is False
    print(f"[{state}] {question}: {detail}")


def load(api):
    try:
        account = json.load(open(f"{out}/{api}.json"))
        lines = [json.loads(line) for line in open(f"{out}/{api}.trace")]
    except (OSError, ValueError) as e:
        return None, None, None, f"not recorded ({e})"
    header, records = lines[0], lines[1:]
    subprocess.run([gputrace, "export", f"{out}/{api}.trace", "--format", "csv", "-o", f"{out}/{api}.csv"], check=False)
    try:
        rows = list(csv.DictReader(open(f"{out}/{api}.csv")))
    except OSError:
        rows = []
    if not account["notes"].get("ran"):
        return account, records, rows, account["notes"].get("why", "did not run")
    zero = min([header["monotonic_start_ns"]] + [r["ts"] for r in records[:1]])
    for cp in account["checkpoints"]:
        cp["t"] = cp["ts"] - zero
    return account, records, rows, None


def histogram(records):
    """Escapes and classes seen, with the sizes asked: what the real stack issues."""
    counts = collections.Counter()
    for r in records:
        if r["ev"] == "alloc":
            counts[(r["via"], f"class {r.get('class', 0):#x}", r["memory"], "ok" if r["status"] == 0 else f"status {r['status']:#x}")] += 1
        elif r["ev"] in ("free", "uvm_map", "uvm_unmap", "uvm_free", "dup_object", "register_fd", "undecodable"):
            counts[(r["ev"], r.get("via", ""), "", "")] += 1
    return counts


def traced_live(rows, pid, t):
    """Video and system bytes live at trace time t in pid, from the CSV."""
    live = 0
    for row in rows:
        if int(row["pid"]) != pid or row["kind"] == "virtual" or row["status"] not in ("", "0"):
            continue
        freed = int(row["freed_ns"]) if row["freed_ns"] else None
        if int(row["allocated_ns"]) <= t and (freed is None or freed > t):
            live += int(row["bytes"])
    return live


def workload_pid(records, api):
    for r in records:
        if r["ev"] in ("exec", "process") and any(api in a for a in r.get("command", [])):
            return r["pid"]
    return None


def compare_nvml(api, account, records, rows, managed=False):
    """Traced live bytes against NVML's per-process figure, as changes from the last checkpoint
    (NVML also counts the context's own memory, which no allocation ioctl shows)."""
    pid = workload_pid(records, api)
    cps = [c for c in account["checkpoints"] if c["nvml_bytes"] is not None]
    if pid is None or len(cps) < 2:
        return None, "no NVML figures or no workload pid"
    base = cps[-1]
    worst, lines = 0.0, []
    for c in cps[:-1]:
        nvml = c["nvml_bytes"] - base["nvml_bytes"]
        traced = traced_live(rows, pid, c["t"]) - traced_live(rows, pid, base["t"])
        off = abs(traced - nvml) / max(nvml, MIB)
        worst = max(worst, off)
        lines.append(f"{c['label']}: NVML +{nvml / MIB:.0f} MiB, traced +{traced / MIB:.0f} MiB")
    if managed:
        return None, "; ".join(lines) + " (managed memory: no ioctl per allocation, the gap is expected and named)"
    return worst <= 0.01, "; ".join(lines) + f"; worst {worst:.1%} (target 1%)"


def found(records, asked, kind):
    allocs = [r for r in records if r["ev"] == "alloc" and r["memory"] == kind and r["status"] == 0]
    missing = [a["bytes"] for a in asked if not any(a["bytes"] <= r["bytes"] <= a["bytes"] + 2 * MIB for r in allocs)]
    return not missing, f"{len(asked) - len(missing)}/{len(asked)} asked sizes decoded" + (f", missing {missing}" if missing else "")


for api in ["cudaMalloc", "cudaMallocAsync", "vmm", "vmm-release-while-mapped", "vmm-ipc", "cudaHostAlloc", "cudaHostRegister",
            "cudaMallocManaged", "torch", "torch-expandable", "oom"]:
    account, records, rows, why = load(api)
    print(f"\n== {api}")
    if why:
        verdict(f"{api} recorded", None, why)
        continue
    for key, n in sorted(histogram(records).items(), key=lambda kv: -kv[1]):
        print(f"   {n:>5}  {'  '.join(k for k in key if k)}")
    try:
        impostors = json.load(open(f"{out}/{api}.report.json"))["fd_filter"]["impostors"]
        verdict(f"{api}: no NVIDIA file refused for its device number", impostors == 0, f"{impostors} refused")
    except (OSError, ValueError, KeyError, TypeError) as e:
        verdict(f"{api}: no NVIDIA file refused for its device number", None, f"no summary ({e})")
    undecodable = [r for r in records if r["ev"] == "undecodable"]
    verdict(f"{api}: every followed call decoded", not undecodable, f"{len(undecodable)} undecodable" + (f": {undecodable[:3]}" if undecodable else ""))
    asked = [a for a in account["asked"] if a["expect"] == "ok"]
    if api in ("cudaMalloc", "vmm", "vmm-release-while-mapped") and asked:
        verdict(f"{api}: the sizes asked are the sizes traced", *found(records, asked, "video"))
    if api == "cudaHostAlloc":
        verdict("cudaHostAlloc: pinned host memory traced as system memory", *found(records, asked, "system"))
    if api == "cudaHostRegister":
        regs = [r for r in records if r["ev"] == "alloc" and r["status"] == 0 and r["memory"] == "system"]
        verdict("cudaHostRegister: registered host memory seen", bool(regs) or None, f"{len(regs)} system allocations, classes {sorted({hex(r.get('class', 0)) for r in regs})}")
    if api == "vmm-release-while-mapped":
        pid = workload_pid(records, api)
        cps = {c["label"].split(":")[0]: c for c in account["checkpoints"]}
        held = traced_live(rows, pid, cps["handle released, still mapped"]["t"]) if pid else 0
        gone = traced_live(rows, pid, cps["unmapped"]["t"]) if pid else -1
        size = asked[0]["bytes"] if asked else 0
        verdict("VMM: memory released while mapped stays live until unmapped", held >= size and gone == 0,
                f"live {held / MIB:.0f} MiB while mapped, {gone / MIB:.0f} MiB after the unmap (asked {size / MIB:.0f} MiB)")
    if api == "vmm-ipc":
        forms = sorted({r["ev"] for r in records if r["ev"] in ("export_object", "export_objects", "import_object", "import_objects")})
        verdict("IPC: CUDA's export to a POSIX fd and its import are followed", len(forms) >= 2 or None, f"controls seen: {forms}")
        pid = workload_pid(records, api)
        cps = {c["label"].split(":")[0]: c for c in account["checkpoints"]}
        live = [traced_live(rows, pid, c["t"]) if pid else -1 for c in account["checkpoints"]]
        size = asked[0]["bytes"] if asked else 0
        verdict("IPC: the memory lives while the fd is open and goes with its close",
                len(live) == 3 and live[0] >= size and live[1] >= size and live[2] == 0 and len(cps) == 3,
                f"live {[f'{b / MIB:.0f} MiB' for b in live]} at {list(cps)} (asked {size / MIB:.0f} MiB)")
    if api == "oom":
        failed = [r for r in records if r["ev"] == "alloc" and r["status"] != 0]
        statuses = sorted({hex(r["status"]) for r in failed})
        report = subprocess.run([gputrace, "report", "--json", f"{out}/{api}.trace"], capture_output=True, text=True)
        category = json.loads(report.stdout)["diagnosis"]["category"] if report.returncode == 0 else "?"
        verdict("a real OOM: the refused allocation traced with its status", bool(failed), f"{len(failed)} refused, statuses {statuses}, verdict {category}")
    if api in ("cudaMalloc", "vmm", "cudaHostAlloc", "torch", "torch-expandable", "cudaMallocManaged"):
        ok, detail = compare_nvml(api, account, records, rows, managed=api == "cudaMallocManaged")
        verdict(f"{api}: traced live bytes against NVML's per-process figure", ok, detail)

print("\n== overhead")
try:
    traced = json.load(open(f"{out}/microbench.json"))["notes"]["us_per_alloc_free"]
    untraced = json.load(open(f"{out}/microbench.untraced.json"))["notes"]["us_per_alloc_free"]
    verdict("recorder overhead on a PyTorch allocation microbenchmark (uncached 4 MiB tensors)", None,
            f"{untraced:.1f} µs untraced, {traced:.1f} µs traced, ratio {traced / untraced:.2f}")
except (OSError, KeyError, ValueError) as e:
    verdict("overhead measured", None, f"not measured ({e})")
sys.exit(1 if failures else 0)
