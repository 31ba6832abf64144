"""Reads what check-real-driver.sh recorded and prints one verdict per question (README.md).

    python3 verdicts.py OUT GPUTRACE [API ...]   # the APIs named (and `overhead`), or all of them
    python3 verdicts.py --self-test              # every verdict on made-up data: no GPU needed

OUT holds, per API, API.trace (gputrace record --raw), API.json (workload.py's account),
API.report.json (record --json) and API.log; this writes API.csv (gputrace export --format csv)
beside them. microbench.untraced.json sits beside microbench.json. A verdict is YES, NO (a defect
to fix) or UNSETTLED (not run, or no pass mark); the exit status is 1 when any is NO.

The loading (files, the gputrace binary) is kept apart from the verdicts: each verdict function
takes a Run of parsed data and returns (question, ok, detail) triples, so --self-test can feed
them made-up traces, reports and checkpoints.
"""
import collections
import csv
import io
import json
import os
import subprocess
import sys

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
OOM_STATUSES = {0x51: "NV_ERR_NO_MEMORY", 0x1A: "NV_ERR_INSUFFICIENT_RESOURCES"}
APIS = ["cudaMalloc", "vmm", "vmm-release-while-mapped", "vmm-ipc", "cudaMallocAsync", "cudaHostAlloc", "cudaHostRegister",
        "cudaMallocManaged", "oom", "torch", "torch-expandable", "microbench", "attach"]
SAMPLE_MARGIN_NS = 100_000_000  # a sample's NVML query comes shortly before its record's ts


def human(n):
    n = int(n)
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n / MIB:.2f} MiB" if abs(n) >= MIB else f"{n} B"


def mib(n):
    return f"{n / MIB:+.0f} MiB"


def gib(n):
    return f"{n / GIB:.2f} GiB"


class Run:
    """One API's recording, parsed: the trace header and records, the CSV rows (the model's
    allocations with their lifetimes), the report's JSON and the workload's account."""

    def __init__(self, api, header=None, records=(), rows=(), report=None, account=None, why=None):
        self.api, self.header, self.records, self.rows = api, header, list(records), list(rows)
        self.report, self.account, self.why = report, account, why
        starts = ([header["monotonic_start_ns"]] if header else []) + [r["ts"] for r in self.records[:1]]
        self.zero = min(starts) if starts else 0  # the CSV's time zero (the model's time_zero)
        self.pid = self._pid()

    def _pid(self):
        """The workload's pid as the trace knows it (the host's, whatever its namespace)."""
        for r in self.records:
            if r.get("ev") == "process" and r.get("seen") == "launched":
                return r["pid"]
        for r in self.records:
            if r.get("ev") in ("process", "exec") and any("workload.py" in a for a in r.get("command", [])):
                return r["pid"]
        ns_pid = (self.account or {}).get("notes", {}).get("pid")
        for r in self.records:
            if r.get("ev") == "place" and ns_pid is not None and r.get("ns_pid") == ns_pid:
                return r["pid"]
        return ns_pid

    @property
    def notes(self):
        return (self.account or {}).get("notes", {})

    @property
    def checkpoints(self):
        return (self.account or {}).get("checkpoints", [])

    def asked(self, expect="ok"):
        return [a for a in (self.account or {}).get("asked", []) if a["expect"] == expect]

    def t(self, ts):
        return ts - self.zero

    def cp(self, prefix):
        return next((c for c in self.checkpoints if c["label"].startswith(prefix)), None)

    def live(self, t, kinds=("video",)):
        """Bytes of these kinds live in the workload's process at trace time t (ns since zero)."""
        return sum(int(r["bytes"]) for r in self.rows if alive(r, t) and int(r["pid"]) == self.pid and r["kind"] in kinds)

    def live_at(self, cp, kinds=("video",)):
        return self.live(self.t(cp["ts"]), kinds)

    def tracked(self, size, after_cp=None, kind="video"):
        """The rows of one allocation asked of size bytes (within the driver's 2 MiB rounding),
        made after after_cp: the specific memory a lifetime question follows."""
        after = self.t(after_cp["ts"]) if after_cp else -1
        return [r for r in self.rows if int(r["pid"]) == self.pid and r["kind"] == kind and r["status"] in ("", "0")
                and size <= int(r["bytes"]) <= size + 2 * MIB and int(r["allocated_ns"]) >= after]

    def samples(self):
        return [r for r in self.records if r.get("ev") == "sample"]

    def nvml_at(self, cp):
        """NVML's figure for the workload at a checkpoint: the recorder's sample inside its window
        (same pid namespace as the trace), else the workload's own nvidia-smi reading."""
        for s in self.samples():
            if cp["ts"] + SAMPLE_MARGIN_NS <= s["ts"] <= cp.get("ts_end", cp["ts"]):
                used = [p.get("used_bytes") for p in s.get("processes", []) if p["pid"] == self.pid]
                if used and None not in used:
                    return sum(used), "sample"
        if cp.get("nvml_bytes") is not None:
            return cp["nvml_bytes"], "nvidia-smi"
        return None, None

    def device_used_at(self, cp):
        for s in self.samples():
            if cp["ts"] + SAMPLE_MARGIN_NS <= s["ts"] <= cp.get("ts_end", cp["ts"]) and s.get("gpus"):
                return sum(g["used_bytes"] for g in s["gpus"])
        return None


def alive(row, t):
    if row["status"] not in ("", "0"):
        return False
    freed = int(row["freed_ns"]) if row["freed_ns"] else None
    return int(row["allocated_ns"]) <= t and (freed is None or freed > t)


# ---- what the real stack issues ----


def histogram(run):
    """Escapes and classes seen, with the sizes decoded, per kind of record: what the stack issues."""
    counts, sizes = collections.Counter(), collections.defaultdict(collections.Counter)
    for r in run.records:
        ev = r.get("ev")
        if ev == "alloc":
            status = "ok" if r["status"] == 0 else f"status {r['status']:#x}" + (f" errno {r['errno']}" if r.get("errno") else "")
            key = (r["via"], f"class {r.get('class', 0):#x}", r["memory"], status)
            sizes[key][r["bytes"]] += 1
        elif ev in ("uvm_map", "uvm_unmap"):
            key = (ev, "", "", "ok" if r.get("status", 0) == 0 else f"status {r['status']:#x}")
            sizes[key][r.get("length", 0)] += 1
        elif ev in ("free", "uvm_free", "dup_object", "register_fd", "export_object", "import_object", "export_objects",
                    "import_objects", "fabric_attach", "fabric_detach"):
            key = (ev, r.get("via", ""), "", "ok" if r.get("status", 0) == 0 else f"status {r['status']:#x}")
        elif ev == "undecodable":
            key = (ev, f"cmd {r.get('cmd', 0):#x}", r.get("reason", ""), "")
        else:
            continue
        counts[key] += 1
    lines = []
    for key, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        top = sizes[key].most_common(6)
        shown = ", ".join(f"{human(b)}" + (f" x{c}" if c > 1 else "") for b, c in top)
        more = len(sizes[key]) - len(top)
        lines.append(f"   {n:>5}  {'  '.join(k for k in key if k)}" + (f"  [{shown}{f', +{more} sizes' if more > 0 else ''}]" if top else ""))
    return lines


# ---- the verdicts: each takes a Run and returns [(question, ok, detail)] ----


def v_fd_filter(run):
    q = f"{run.api}: no NVIDIA file refused for its device number"
    try:
        impostors = run.report["fd_filter"]["impostors"]
    except (TypeError, KeyError):
        return [(q, None, "no fd_filter in the report (record --json did not finish)")]
    return [(q, impostors == 0, f"{impostors} refused")]


def v_refused(run):
    """The model refuses calls RM would refuse (another file's client, another process's memory
    not shared); on a real CUDA stack none should be, and none should go unfollowed."""
    q = f"{run.api}: no call refused as one RM would refuse, no fd event left unfollowed"
    loss = (run.report or {}).get("loss")
    if loss is None:
        return [(q, None, "no loss in the report (record --json did not finish)")]
    refused, own = loss.get("foreign_client_calls", 0), loss.get("own_file_table", 0)
    return [(q, refused == 0 and own == 0, f"{refused} refused, {own} in threads with a file table of their own")]


def v_decoded(run):
    undecodable = [r for r in run.records if r.get("ev") == "undecodable"]
    lost = sum(r.get("records", 0) for r in run.records if r.get("ev") == "lost")
    detail = f"{len(undecodable)} undecodable, {lost} records lost" + (f": {undecodable[:3]}" if undecodable else "")
    return [(f"{run.api}: every followed call decoded, nothing lost", not undecodable and lost == 0, detail)]


def v_sizes(run, kind="video"):
    asked = run.asked()
    if not asked:
        return [(f"{run.api}: the sizes asked are the sizes traced", None, "nothing asked")]
    allocs = [r for r in run.records if r.get("ev") == "alloc" and r["memory"] == kind and r["status"] == 0 and r["pid"] == run.pid]
    missing = [a["bytes"] for a in asked if not any(a["bytes"] <= r["bytes"] <= a["bytes"] + 2 * MIB for r in allocs)]
    return [(f"{run.api}: the sizes asked are the sizes traced ({kind} memory)", not missing,
             f"{len(asked) - len(missing)}/{len(asked)} asked sizes decoded" + (f", missing {[human(b) for b in missing]}" if missing else ""))]


def v_nvml(run):
    """Traced live video bytes against NVML's per-process figure (device memory only), as changes
    from the baseline checkpoint: NVML also counts the context's own memory, which no allocation
    ioctl shows. Within 1%, or 4 MiB for small changes (nvidia-smi counts whole MiB)."""
    q = f"{run.api}: traced live video bytes against NVML's per-process figure"
    base = run.cp("baseline")
    if base is None:
        return [(q, None, "no baseline checkpoint")]
    nvml_base, source = run.nvml_at(base)
    if nvml_base is None or run.pid is None:
        return [(q, None, "no NVML figure for the workload's pid (another pid namespace?) or no pid")]
    worst_ok, lines = True, []
    for c in run.checkpoints:
        if c is base:
            continue
        nvml, src = run.nvml_at(c)
        if nvml is None:
            lines.append(f"{c['label']}: no NVML figure")
            continue
        dn, dt = nvml - nvml_base, run.live_at(c) - run.live_at(base)
        ok = abs(dt - dn) <= max(0.01 * max(abs(dn), abs(dt)), 4 * MIB)
        worst_ok &= ok
        lines.append(f"{c['label'].split(':')[0]}: NVML {mib(dn)}, traced {mib(dt)} ({src}){'' if ok else ' OFF'}")
    if len(lines) == 0 or all(line.endswith("no NVML figure") for line in lines):
        return [(q, None, "; ".join(lines) or "one checkpoint only")]
    return [(q, worst_ok, "; ".join(lines) + " (target: within 1%, or 4 MiB)")]


def v_host_register(run):
    size = sum(a["bytes"] for a in run.asked())
    base = run.cp("baseline")
    after = run.t(base["ts"]) if base else -1
    regs = [r for r in run.records if r.get("ev") == "alloc" and r["status"] == 0 and r["memory"] == "system"
            and r["pid"] == run.pid and run.t(r["ts"]) >= after]
    got = sum(r["bytes"] for r in regs)
    classes = sorted({f"{r.get('class', 0):#x} via {r['via']}" for r in regs})
    return [("cudaHostRegister: registered host memory traced as system memory", got >= size > 0,
             f"{len(regs)} system allocations, {human(got)} of {human(size)} registered, classes {classes}")]


def _lifetime(run, size, base, keep, gone):
    """Whether the tracked allocation is live at each `keep` checkpoint and gone at `gone`: by the
    allocation itself when found, else by the change of live video bytes from the baseline."""
    rows = run.tracked(size, base)
    if rows:
        def at(c):
            return sum(int(r["bytes"]) for r in rows if alive(r, run.t(c["ts"])))
        how = ", ".join(f"{human(int(r['bytes']))} freed {'never' if not r['freed_ns'] else r['freed_by']}" for r in rows)
    else:
        def at(c):
            return run.live_at(c) - run.live_at(base)
        how = "no allocation of that size traced: live bytes against the baseline"
    held = [at(c) for c in keep]
    left = at(gone)
    ok = all(h >= size for h in held) and (left == 0 if rows else left < size // 2)
    detail = ", ".join(f"{human(h)} live at {c['label'].split(':')[0]!r}" for h, c in zip(held, keep))
    return ok, f"{detail}, {human(left)} at {gone['label'].split(':')[0]!r} (asked {human(size)}; {how})"


def v_release_while_mapped(run):
    q = "VMM: memory released while mapped stays live until unmapped"
    base, released, unmapped = run.cp("baseline"), run.cp("handle released"), run.cp("unmapped")
    asked = run.asked()
    if not (base and released and unmapped and asked):
        return [(q, None, f"checkpoints {[c['label'] for c in run.checkpoints]}")]
    return [(q, *_lifetime(run, asked[0]["bytes"], base, [released], unmapped))]


def v_ipc(run):
    out = []
    forms = sorted({r["ev"] for r in run.records if r.get("ev") in ("export_object", "export_objects", "import_object", "import_objects")})
    exported = [f for f in forms if f.startswith("export")]
    imported = [f for f in forms if f.startswith("import")]
    did = run.notes.get("exported_and_imported")
    out.append(("IPC: CUDA's export to a POSIX fd and its import are followed",
                (bool(exported) and bool(imported)) if did else None,
                f"controls seen: {forms}" + ("" if did else " (the workload did not export and import)")))
    q = "IPC: the memory lives while the fd is open and goes with its close"
    base, rel, imp, closed = run.cp("baseline"), run.cp("released"), run.cp("the import released"), run.cp("fd closed")
    asked = run.asked()
    if not (base and rel and imp and closed and asked):
        out.append((q, None, f"checkpoints {[c['label'] for c in run.checkpoints]}"))
    else:
        out.append((q, *_lifetime(run, asked[0]["bytes"], base, [rel, imp], closed)))
    return out


def v_malloc_async(run):
    q = "cudaMallocAsync: the pool's memory is traced (live video bytes rise by the pool allocations)"
    base, held, freed = run.cp("baseline"), run.cp("pool holds"), run.cp("freed to the pool")
    asked = sum(a["bytes"] for a in run.asked())
    if not (base and held and asked):
        return [(q, None, f"checkpoints {[c['label'] for c in run.checkpoints]}")]
    rise = run.live_at(held) - run.live_at(base)
    t0, t1 = run.t(base["ts"]), run.t(held["ts"])
    vias = sorted({f"{r['via']} {r['memory']}" for r in run.records if r.get("ev") == "alloc" and r["pid"] == run.pid
                   and r["status"] == 0 and t0 <= run.t(r["ts"]) <= t1})
    after = f", {mib(run.live_at(freed) - run.live_at(base))} after the frees and a sync" if freed else ""
    return [(q, rise >= asked, f"{mib(rise)} live for {human(asked)} asked{after}; through {vias}")]


def v_oom(run):
    q = "a real OOM: the refused allocation traced with an out-of-memory status (0x51 or 0x1a)"
    failed = [r for r in run.records if r.get("ev") == "alloc" and r["status"] != 0 and r["pid"] == run.pid]
    big = [r for r in failed if r["memory"] == "video" and GIB <= r["bytes"] <= GIB + 2 * MIB] or failed
    statuses = sorted({r["status"] for r in big})
    named = [f"{s:#x} {OOM_STATUSES.get(s, '')}".strip() for s in statuses]
    try:
        category = run.report["diagnosis"]["category"]
    except (TypeError, KeyError):
        category = "?"
    detail = (f"{len(failed)} refused in the trace ({', '.join(human(r['bytes']) for r in big[:3])}), statuses {named}; "
              f"workload: {run.notes.get('error', 'never refused')}; report's verdict: {category}")
    if not run.notes.get("refused"):
        return [(q, None if not failed else all(s in OOM_STATUSES for s in statuses), detail)]
    return [(q, bool(big) and all(s in OOM_STATUSES for s in statuses), detail)]


def v_managed(run):
    """The report must name the gap between NVML's per-process figure and the traced bytes that
    managed memory makes, when NVML counts managed memory for the process at all."""
    q = "cudaMallocManaged: the report names the gap between NVML and the traced bytes"
    base, touched = run.cp("baseline"), run.cp("managed")
    size = sum(a["bytes"] for a in run.asked("no ioctl per allocation"))
    if not (base and touched and size):
        return [(q, None, f"checkpoints {[c['label'] for c in run.checkpoints]}")]
    n0, _ = run.nvml_at(base)
    n1, src = run.nvml_at(touched)
    if n0 is None or n1 is None:
        return [(q, None, "no NVML figure for the workload's pid")]
    traced = run.live_at(touched) - run.live_at(base)
    d0, d1 = run.device_used_at(base), run.device_used_at(touched)
    device = f", the device's used memory {mib(d1 - d0)}" if d0 is not None and d1 is not None else ""
    seen = f"NVML {mib(n1 - n0)} for the workload, traced {mib(traced)}{device} ({src}), {human(size)} managed touched"
    if n1 - n0 < size // 2:
        return [(q, None, seen + ": NVML does not count managed memory per process here, so there is no gap to name")]
    # What the report compares: the last NVML sample that lists processes, against traced video then.
    last = next((s for s in reversed(run.samples()) if s.get("processes")), None)
    entry = next((d for d in (run.report or {}).get("nvml_vs_traced", []) if d.get("pid") == run.pid), None)
    if run.report is None:
        return [(q, None, seen + "; no report")]
    if entry is not None:
        why, gap = entry.get("why", ""), entry["nvml_bytes"] - entry["traced_bytes"]
        said = seen + f"; report: NVML {human(entry['nvml_bytes'])}, traced {human(entry['traced_bytes'])}: {why}"
        if "managed" not in why:
            return [(q, False, said)]
        return [(q, True if gap >= size // 2 else None, said + ("" if gap >= size // 2 else " (a gap smaller than the managed memory: the last sample came at the exit?)"))]
    if last is None:
        return [(q, None, seen + "; no NVML sample listing processes in the trace")]
    nvml_last = sum(p.get("used_bytes") or 0 for p in last["processes"] if p["pid"] == run.pid)
    traced_last = run.live(run.t(last["ts"]))
    gap = abs(nvml_last - traced_last)
    expected = gap >= 256 * MIB and gap >= max(nvml_last, traced_last) // 10
    last_at = f"the last sample ({(last['ts'] - touched['ts']) / 1e9:+.1f} s from the touch): NVML {human(nvml_last)}, traced {human(traced_last)}"
    if expected:
        return [(q, False, seen + f"; {last_at}, a gap the report should name and does not")]
    return [(q, None, seen + f"; {last_at}: the last sample came when the memory was no longer counted (the exit?)")]


def v_managed_on_device(run):
    """Where NVML does not count managed memory per process (the real driver, issue 24), the
    device's used memory still rises when it is touched on the GPU: the report's notes must name
    memory no process's figure includes."""
    q = "cudaMallocManaged: the report names device memory no process's NVML figure includes"
    base, touched = run.cp("baseline"), run.cp("managed")
    size = sum(a["bytes"] for a in run.asked("no ioctl per allocation"))
    if not (base and touched and size):
        return [(q, None, f"checkpoints {[c['label'] for c in run.checkpoints]}")]
    n0, _ = run.nvml_at(base)
    n1, _ = run.nvml_at(touched)
    d0, d1 = run.device_used_at(base), run.device_used_at(touched)
    if d0 is None or d1 is None:
        return [(q, None, "no sample of the device's used memory at the checkpoints")]
    seen = f"the device's used memory {mib(d1 - d0)}, NVML for the workload {mib((n1 or 0) - (n0 or 0))}, {human(size)} touched"
    if n0 is not None and n1 is not None and n1 - n0 >= size // 2:
        return [(q, None, seen + ": NVML counts it per process here (v_managed judges that)")]
    if d1 - d0 < size // 2:
        return [(q, None, seen + ": the device's used memory did not rise by it either")]
    if run.report is None:
        return [(q, None, seen + "; no report")]
    said = [n for n in run.report.get("notes", []) if "no process's NVML figure includes" in n]
    return [(q, bool(said), seen + ("; report: " + said[0][:120] if said else "; the report's notes say nothing of it"))]


def v_exit_agrees(run):
    """A normal exit frees everything in the trace a moment before NVML's figure falls: the report
    must not call the teardown a disagreement (issue 24: 'NVML 17.2 GiB, traced 0 B' on every run).
    A server met running holds what it loaded before the recording until it is told to stop
    (`stopping_ns` in its notes): that gap, named as memory from before recording, is no teardown."""
    q = f"{run.api}: a normal exit is no NVML disagreement (nothing reported as NVML >= 1 GiB against 0 B traced)"
    if run.report is None:
        return [(q, None, "no report")]
    stop = run.notes.get("stopping_ns")

    def before_the_stop(d):
        return stop is not None and d.get("ts", 0) < run.t(stop) and "before recording" in d.get("why", "")

    listed = run.report.get("nvml_vs_traced", [])
    teardown = [d for d in listed if d.get("traced_bytes") == 0 and d.get("nvml_bytes", 0) >= GIB and not before_the_stop(d)]
    said = "; ".join(f"pid {d['pid']}: NVML {human(d['nvml_bytes'])}, traced 0 B at {d.get('ts', 0) / 1e9:.2f} s" for d in teardown)
    kept = sum(before_the_stop(d) for d in listed)
    return [(q, not teardown, said or f"{len(listed)} disagreement(s), none of them a teardown"
             + (f" ({kept} of memory from before recording, before the stop)" if kept else ""))]


def v_attach(run):
    """A PyTorch server met serving (`record --pid` once it had loaded and served a prompt), then a
    prompt too long for the GPU: a long request on GPU 0, with what it loaded before the attach
    held by it (issue 24: 'does-not-fit-at-load', its allocations on a `?` GPU row, 1.0 GiB held
    by the service instead of 17.5 GiB)."""
    qs = ["attach: the long prompt's OOM is a long request (not does-not-fit-at-load)",
          "attach: the failure is on GPU 0, and no GPU row of unknown GPU holds the server's memory",
          "attach: what the server loaded before the attach is held by it on GPU 0 (>= 90% of its weights)"]
    requests, oom, weights = run.notes.get("requests", []), run.notes.get("oom"), run.notes.get("weights_bytes", 0)
    start = (run.header or {}).get("monotonic_start_ns")
    served_before = [r for r in requests if r["status"] == 200 and start is not None and r["ts_end"] < start]
    asked = ", ".join(f"{r['bytes']} B: {r['status']}{' (before the attach)' if r in served_before else ''}" for r in requests)
    why = None
    if not oom:
        why = "the long prompt did not fail with an OOM in the server" + "".join(f"; {e}" for e in run.notes.get("errors", [])[:2])
    elif not served_before:
        why = "no prompt was served before the recording began: the server was not met serving"
    elif run.report is None:
        why = "no report"
    if why:
        return [(q, None, f"{why} (prompts {asked or 'none'})") for q in qs]
    def fields_of(d):
        return (d.get("evidence") or {}).get("fields") or {}

    # The long prompt's failure, by its size (the caching allocator rounds to 2 MiB), else the first.
    headline = run.report.get("diagnosis") or {}
    d = next((x for x in run.report.get("diagnoses", []) if oom["asked"] <= (fields_of(x).get("failed_bytes") or 0) <= oom["asked"] + 2 * MIB),
             headline)
    fields = fields_of(d)
    said = (d.get("evidence") or {}).get("text", "")[:240]
    first = "" if d == headline else f" (the report's first diagnosis is another: {headline.get('category')})"
    out = [(qs[0], d.get("category") == "long-request",
            f"{d.get('category')} ({d.get('symptom')}){first}: {fields.get('requests_in_flight')} request(s) in flight in "
            f"{fields.get('phase')}, {gib(fields.get('failed_bytes') or 0)} refused; the server asked {gib(oom['asked'])} for "
            f"{oom['bytes']} bytes after {len(served_before)} prompt(s) served before the attach (prompts {asked}); report: {said}")]

    def row(g):
        label = g.get("gpu") if g.get("gpu") is not None else ("one of " + ", ".join(map(str, g["one_of"])) if g.get("one_of") else "?")
        return (f"GPU {label}: held before {gib(g.get('held_before_bytes', 0))}, peak {gib(g.get('peak_bytes', 0))}, "
                f"{g.get('failed_allocations', 0)} failed, pids {g.get('pids', [])}")

    rows = run.report.get("gpus", [])
    unknown = [g for g in rows if g.get("gpu") is None and (g.get("held_before_bytes") or g.get("peak_bytes") or g.get("failed_allocations"))]
    out.append((qs[1], d.get("gpu") == 0 and not unknown, f"the failure on GPU {d.get('gpu')}; " + "; ".join(map(row, rows))))
    held = fields.get("service_bytes") or 0
    out.append((qs[2], fields.get("gpu") == 0 and held >= 0.9 * weights > 0,
                f"held by this service on GPU {fields.get('gpu')}: {gib(held)}, weights loaded before the attach {gib(weights)} "
                f"(torch reserved {gib(run.notes.get('reserved_after_load', 0))} after the load, {gib(oom.get('reserved', 0))} at the OOM)"))
    return out


def v_overhead(traced, untraced):
    q = "recorder overhead on an allocation microbenchmark (uncached 4 MiB allocations)"
    try:
        a, b = traced["notes"]["us_per_alloc_free"], untraced["notes"]["us_per_alloc_free"]
    except (TypeError, KeyError) as e:
        return [(q, None, f"not measured ({e!r})")]
    return [(q, None, f"{b:.1f} us untraced, {a:.1f} us traced, ratio {a / b:.2f} ({traced['notes'].get('via', '?')})")]


SPECIFIC = {
    "cudaMalloc": [v_sizes, v_nvml],
    "cudaMallocAsync": [v_malloc_async, v_nvml],
    "vmm": [v_sizes, v_nvml],
    "vmm-release-while-mapped": [v_sizes, v_release_while_mapped],
    "vmm-ipc": [v_sizes, v_ipc],
    "cudaHostAlloc": [lambda run: v_sizes(run, "system"), v_nvml],
    "cudaHostRegister": [v_host_register, v_nvml],
    "cudaMallocManaged": [v_managed, v_managed_on_device],
    "torch": [v_nvml, v_exit_agrees],
    "torch-expandable": [v_nvml, v_exit_agrees],
    "oom": [v_oom],
    "microbench": [],
    "attach": [v_attach, v_exit_agrees],
}


def verdicts_for(run, safe=True):
    """Every verdict on one API's run: the tracer's own two, then the API's."""
    if run.header is None:
        return [(f"{run.api} recorded", None, run.why or "no trace")]
    out = []
    checks = [v_fd_filter, v_refused, v_decoded]
    if run.notes.get("ran"):
        checks += SPECIFIC.get(run.api, [])
    else:
        out.append((f"{run.api}: the workload ran", None, run.why or run.notes.get("why", "no account")))
    for check in checks:
        try:
            out += check(run)
        except Exception as e:
            if not safe:
                raise
            out.append((f"{run.api}: {getattr(check, '__name__', 'verdict')}", None, f"could not judge: {type(e).__name__}: {e}"))
    return out


# ---- loading what the device run left ----


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_report(path):
    """record --json's report; anything the workload printed on stdout before it is skipped."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    for start in [0] + [i + 1 for i in range(len(text)) if text.startswith("\n{", i)]:
        try:
            return json.loads(text[start:])
        except ValueError:
            continue
    return None


def tail(path, n=3):
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-n:])
    except OSError:
        return ""


def parse_trace(text):
    lines = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue  # a torn last line (a recorder killed mid-write)
    if not lines or lines[0].get("format") != "gputrace-trace":
        return None, []
    return lines[0], lines[1:]


def parse_csv(text):
    return list(csv.DictReader(io.StringIO(text)))


def load(out, gputrace, api):
    trace, account = f"{out}/{api}.trace", read_json(f"{out}/{api}.json")
    try:
        with open(trace, errors="replace") as f:
            header, records = parse_trace(f.read())
    except OSError as e:
        return Run(api, account=account, why=f"not recorded ({e.strerror}); log: {tail(f'{out}/{api}.log')}")
    if header is None:
        return Run(api, account=account, why=f"no trace header; log: {tail(f'{out}/{api}.log')}")
    rows, report = [], read_report(f"{out}/{api}.report.json")
    try:
        subprocess.run([gputrace, "export", trace, "--format", "csv", "-o", f"{out}/{api}.csv"], capture_output=True, timeout=60)
        with open(f"{out}/{api}.csv") as f:
            rows = parse_csv(f.read())
    except (OSError, subprocess.TimeoutExpired):
        pass
    if report is None:  # the recorder cut short: the report from the trace (no fd_filter then)
        try:
            done = subprocess.run([gputrace, "report", "--json", trace], capture_output=True, text=True, timeout=60)
            report = json.loads(done.stdout) if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
    why = None if account else f"the workload wrote no account; log: {tail(f'{out}/{api}.log')}"
    return Run(api, header, records, rows, report, account, why)


class Printer:
    def __init__(self):
        self.failures = 0

    def verdict(self, question, ok, detail):
        self.failures += ok is False
        print(f"[{ {True: 'YES', False: 'NO', None: 'UNSETTLED'}[ok]}] {question}: {detail}", flush=True)


def judge(out, gputrace, apis):
    p = Printer()
    for api in apis:
        if api == "overhead":
            print("\n== overhead")
            for v in v_overhead(read_json(f"{out}/microbench.json"), read_json(f"{out}/microbench.untraced.json")):
                p.verdict(*v)
            continue
        run = load(out, gputrace, api)
        print(f"\n== {api}" + (f" (pid {run.pid})" if run.pid else ""))
        facts = {k: v for k, v in run.notes.items() if k not in ("ran", "why", "pid")}
        if facts:
            print(f"   workload: {json.dumps(facts)[:600]}")
        for line in histogram(run)[:14]:
            print(line)
        for v in verdicts_for(run):
            p.verdict(*v)
    return p.failures


# ---- the self-test: every verdict on made-up data ----


def synth(api, allocs=(), checkpoints=(), asked=(), notes=None, report=None, samples=(), extra=(), pid=4242):
    """A Run as the loader would build it. allocs: dicts with t, bytes, and optionally freed, kind,
    via, cls, status, freed_by; times in ms since the trace start; checkpoints: (label, t_ms,
    nvml_mib or None); samples: (t_ms, {pid: MiB}, device_MiB)."""
    zero, ms = 10**12, 10**6
    header = {"format": "gputrace-trace", "version": 1, "monotonic_start_ns": zero, "nvml": "ok"}
    records = [{"ts": zero, "pid": pid, "ev": "process", "ppid": 1, "seen": "launched",
                "command": ["python3", "tests/device/workload.py", api, "x.json"]}]
    rows = []
    for a in allocs:
        status, kind = a.get("status", 0), a.get("kind", "video")
        records.append({"ts": zero + a["t"] * ms, "pid": pid, "ev": "alloc", "fd": 5, "via": a.get("via", "rm_alloc_nvos64"),
                        "memory": kind, "bytes": a["bytes"], "status": status, "client": 1, "parent": 2, "object": 3,
                        "class": a.get("cls", 0x40)})
        freed = a.get("freed")
        rows.append({"allocated_ns": str(a["t"] * ms), "freed_ns": "" if freed is None else str(freed * ms), "pid": str(pid),
                     "kind": kind, "bytes": str(a["bytes"]), "freed_by": a.get("freed_by", "explicit" if freed is not None else "never"),
                     "status": "0" if status == 0 else f"{status:#x}"})
    for t, procs, device in samples:
        records.append({"ts": zero + t * ms, "pid": 0, "ev": "sample", "gpus": [{"gpu": 0, "used_bytes": device * MIB}],
                        "processes": [{"pid": p, "gpu": 0, "used_bytes": m * MIB} for p, m in procs.items()]})
    records += [dict(r, ts=zero + r["ts"] * ms, pid=r.get("pid", pid)) for r in extra]
    records.sort(key=lambda r: r["ts"])
    cps = [{"label": label, "ts": zero + t * ms, "ts_end": zero + (t + 800) * ms, "nvml_bytes": None if n is None else n * MIB}
           for label, t, n in checkpoints]
    account = {"api": api, "asked": [{"api": api, "bytes": b, "expect": e} for b, e in asked], "checkpoints": cps,
               "notes": dict({"ran": True, "pid": 77}, **(notes or {}))}
    report = {"fd_filter": {"impostors": 0}, "diagnosis": {"category": "does-not-fit-at-load"}, "nvml_vs_traced": []} if report is None else report
    return Run(api, header, records, rows, report, account)


def self_test():
    failures, checks = [], 0

    def expect(name, results, want, index=0):
        nonlocal checks
        checks += 1
        got = results[index][1]
        if got is not want:
            failures.append(f"{name}: got {got}, want {want}: {results[index]}")

    ctx = {"t": 10, "bytes": 64 * MIB}  # the context's own traced memory, live throughout
    # Sizes and NVML for cudaMalloc.
    asked = [(MIB, "ok"), (64 * MIB, "ok"), (GIB, "ok")]
    cps = [("baseline", 100, 500), ("4 allocations live", 1000, 500 + 2 + 64 + 1024), ("all freed", 2000, 500)]
    good = [ctx, {"t": 200, "bytes": 2 * MIB, "freed": 1500}, {"t": 210, "bytes": 64 * MIB, "freed": 1500},
            {"t": 220, "bytes": GIB, "freed": 1500}]
    run = synth("cudaMalloc", good, cps, asked)
    expect("sizes all found", v_sizes(run), True)
    expect("nvml agrees", v_nvml(run), True)
    run = synth("cudaMalloc", good[:3], cps, asked)
    expect("a size missing", v_sizes(run), False)
    expect("nvml 1 GiB short", v_nvml(run), False)
    run = synth("cudaMalloc", good, [(label, t, None) for label, t, _ in cps], asked)
    expect("no nvml", v_nvml(run), None)
    # NVML from the recorder's samples when nvidia-smi could not name the pid.
    run = synth("cudaMalloc", good, [(label, t, None) for label, t, _ in cps], asked,
                samples=[(350, {4242: 500}, 600), (1350, {4242: 1590}, 1690), (2350, {4242: 500}, 600)])
    expect("nvml from samples", v_nvml(run), True)
    # cudaHostAlloc: system memory, none of it NVML's: video only is compared.
    run = synth("cudaHostAlloc", [ctx, {"t": 200, "bytes": 256 * MIB, "kind": "system", "via": "rm_alloc_memory", "cls": 0x3e, "freed": 1500}],
                [("baseline", 100, 500), ("pinned host memory live", 1000, 500), ("freed", 2000, 500)], [(256 * MIB, "ok")])
    expect("host alloc sizes", v_sizes(run, "system"), True)
    expect("host alloc nvml, video only", v_nvml(run), True)
    expect("host alloc sizes as video", v_sizes(run, "video"), False)
    # cudaHostRegister.
    reg = {"t": 200, "bytes": 256 * MIB, "kind": "system", "via": "rm_alloc_memory", "cls": 0x71, "freed": 1500}
    cps = [("baseline", 100, 500), ("registered", 1000, 500), ("unregistered", 2000, 500)]
    expect("register traced", v_host_register(synth("cudaHostRegister", [ctx, reg], cps, [(256 * MIB, "ok")])), True)
    expect("register not traced", v_host_register(synth("cudaHostRegister", [ctx], cps, [(256 * MIB, "ok")])), False)
    # Released while mapped: the context's memory and the UVM pool stay live throughout, which the
    # old check (all live bytes == 0 after the unmap) took for a leak.
    cps = [("baseline", 100, 500), ("created and mapped", 1000, 1524), ("handle released, still mapped: x", 2000, 1524),
           ("unmapped: memory must be gone", 3000, 500)]
    pool = {"t": 20, "bytes": 2 * MIB, "via": "uvm_alloc_semaphore_pool"}
    run = synth("vmm-release-while-mapped", [ctx, pool, {"t": 200, "bytes": GIB, "freed": 2500, "freed_by": "unmapped"}], cps, [(GIB, "ok")])
    expect("released while mapped: kept until the unmap", v_release_while_mapped(run), True)
    run = synth("vmm-release-while-mapped", [ctx, pool, {"t": 200, "bytes": GIB, "freed": 1500}], cps, [(GIB, "ok")])
    expect("released while mapped: freed at the release", v_release_while_mapped(run), False)
    run = synth("vmm-release-while-mapped", [ctx, pool, {"t": 200, "bytes": GIB}], cps, [(GIB, "ok")])
    expect("released while mapped: never freed", v_release_while_mapped(run), False)
    # IPC.
    cps = [("baseline", 100, 500), ("created and mapped", 1000, 1524), ("released, the import's handle", 2000, 1524),
           ("the import released, the fd open", 3000, 1524), ("fd closed: memory must be gone", 4000, 500)]
    forms = [{"ts": 1100, "ev": "export_objects", "fd": 5, "client": 1, "objects": [3], "index": 0, "to_fd": 9, "status": 0},
             {"ts": 1200, "ev": "import_objects", "fd": 5, "client": 1, "parent": 2, "objects": [7], "index": 0, "from_fd": 9, "status": 0}]
    notes = {"exported_and_imported": True}
    run = synth("vmm-ipc", [ctx, pool, {"t": 200, "bytes": GIB, "freed": 3500, "freed_by": "file_release"}], cps, [(GIB, "ok")], notes, extra=forms)
    expect("ipc forms seen", v_ipc(run), True, 0)
    expect("ipc lives until the close", v_ipc(run), True, 1)
    run = synth("vmm-ipc", [ctx, pool, {"t": 200, "bytes": GIB, "freed": 2500}], cps, [(GIB, "ok")], notes)
    expect("ipc forms missing", v_ipc(run), False, 0)
    expect("ipc freed with the import", v_ipc(run), False, 1)
    # The pool behind cudaMallocAsync.
    cps = [("baseline", 100, 500), ("pool holds 1 GiB+", 1000, 1600), ("freed to the pool (x)", 2000, 500)]
    asked = [(64 * MIB, "ok"), (GIB, "ok")]
    run = synth("cudaMallocAsync", [ctx, {"t": 200, "bytes": GIB + 64 * MIB + 32 * MIB, "freed": 1500}], cps, asked)
    expect("pool traced", v_malloc_async(run), True)
    expect("pool traced, not yet at the first checkpoint", v_malloc_async(synth("cudaMallocAsync", [ctx, {"t": 1200, "bytes": 2 * GIB}], cps, asked)), False)
    expect("pool not traced", v_malloc_async(synth("cudaMallocAsync", [ctx], cps, asked)), False)
    # OOM.
    cps = [("140 GiB held, the next refused", 5000, 140 * 1024)]
    refused = {"notes": None}
    for status, want in [(0x51, True), (0x1A, True), (0x72, False)]:
        run = synth("oom", [ctx, {"t": 4000, "bytes": GIB, "status": status}], cps, [(GIB, "fails")], {"refused": True, "error": "2"})
        expect(f"oom status {status:#x}", v_oom(run), want)
    expect("oom refused, not traced", v_oom(synth("oom", [ctx], cps, [(GIB, "fails")], {"refused": True})), False)
    expect("oom never refused", v_oom(synth("oom", [ctx], cps, [], {})), None)
    del refused
    # Managed memory: NVML counts it, the report names the gap; or does not; or NVML does not count it.
    cps = [("baseline", 100, 500), ("managed, touched on the GPU", 1000, 1012), ("still live", 2000, 1012)]
    samples = [(400, {4242: 500}, 600), (1400, {4242: 1012}, 1112), (2400, {4242: 1012}, 1112), (3000, {}, 100)]
    managed = [(512 * MIB, "no ioctl per allocation")]
    named = {"fd_filter": {"impostors": 0}, "nvml_vs_traced": [{"pid": 4242, "nvml_bytes": 1012 * MIB, "traced_bytes": 64 * MIB,
                                                               "why": "NVML counts memory no traced ioctl shows: ... managed memory (cudaMallocManaged) ..."}]}
    expect("managed gap named", v_managed(synth("cudaMallocManaged", [ctx], cps, managed, report=named, samples=samples)), True)
    unnamed = {"fd_filter": {"impostors": 0}, "nvml_vs_traced": []}
    expect("managed gap not named", v_managed(synth("cudaMallocManaged", [ctx], cps, managed, report=unnamed, samples=samples)), False)
    wrong = {"nvml_vs_traced": [dict(named["nvml_vs_traced"][0], why="it allocated memory before recording began")]}
    expect("managed gap misnamed", v_managed(synth("cudaMallocManaged", [ctx], cps, managed, report=wrong, samples=samples)), False)
    flat = [(400, {4242: 500}, 600), (1400, {4242: 500}, 1112), (2400, {4242: 500}, 1112)]
    expect("NVML does not count managed", v_managed(synth("cudaMallocManaged", [ctx], cps, managed, report=unnamed, samples=flat)), None)
    exiting = samples[:2] + [(2400, {4242: 300}, 400)]
    expect("last sample at the exit", v_managed(synth("cudaMallocManaged", [ctx], cps, managed, report=unnamed, samples=exiting)), None)
    # Managed memory the device counts and no process does: named in the notes, or not.
    device_only = [(400, {4242: 500}, 600), (1400, {4242: 500}, 1112), (2400, {4242: 500}, 1112)]
    noted = dict(unnamed, notes=["512.0 MiB used on GPU 0 that no process's NVML figure includes (at 1.4 s, ...)"])
    expect("device gap named", v_managed_on_device(synth("cudaMallocManaged", [ctx], cps, managed, report=noted, samples=device_only)), True)
    expect("device gap not named", v_managed_on_device(synth("cudaMallocManaged", [ctx], cps, managed, report=unnamed, samples=device_only)), False)
    expect("NVML counts it per process", v_managed_on_device(synth("cudaMallocManaged", [ctx], cps, managed, report=unnamed, samples=samples)), None)
    # A normal exit: the teardown's lag is no disagreement; a context's own gap may be.
    lag = {"nvml_vs_traced": [{"pid": 4242, "ts": 9 * 10**9, "nvml_bytes": 17 * GIB, "traced_bytes": 0, "why": "..."}]}
    expect("teardown called a disagreement", v_exit_agrees(synth("torch", [ctx], report=lag)), False)
    own = {"nvml_vs_traced": [{"pid": 4242, "ts": 10**9, "nvml_bytes": GIB + 500 * MIB, "traced_bytes": GIB, "why": "..."}]}
    expect("the context's own is no teardown", v_exit_agrees(synth("torch", [ctx], report=own)), True)
    # Attached to a server that loaded 16 GiB and served (issue 24): the long prompt's OOM is a long
    # request on GPU 0, its weights held by it; or, as before the fix, does not fit at load, on a
    # `?` row, 1 GiB held.
    zero, per = 10**12, 800 * KIB
    served = [{"bytes": b, "asked": b * per, "status": st, "ts": zero + t * 10**9, "ts_end": zero + t * 10**9 + 10**8}
              for b, st, t in [(300, 200, -5), (300, 200, 2), (4800, 200, 3), (204800, 500, 4), (300, 200, 5)]]
    oom = {"bytes": 204800, "asked": 204800 * per, "reserved": 20 * GIB}
    notes = {"weights_bytes": 16 * GIB, "reserved_after_load": 16 * GIB, "requests": served, "oom": oom, "stopping_ns": zero + 9 * 10**9}

    def attached(category="long-request", gpu=0, held=int(17.5 * GIB), unknown_row=False):
        rows = [{"gpu": 0, "held_before_bytes": int(16.8 * GIB), "peak_bytes": 4 * GIB, "failed_allocations": 2, "pids": [4242]}]
        if unknown_row:
            rows = [dict(rows[0], peak_bytes=0, failed_allocations=0, pids=[]), {"gpu": None, "held_before_bytes": 0, "peak_bytes": 4 * GIB,
                                                                                "failed_allocations": 2, "pids": [4242]}]
        fields = {"gpu": gpu, "service_bytes": held, "failed_bytes": 204800 * per, "phase": "prefill", "requests_in_flight": 1}
        d = {"category": category, "symptom": "failed-allocation", "gpu": gpu, "evidence": {"fields": fields, "text": "..."}}
        return {"fd_filter": {"impostors": 0}, "gpus": rows, "nvml_vs_traced": [], "diagnosis": d, "diagnoses": [d]}

    for i in range(3):
        expect(f"attach: all right ({i})", v_attach(synth("attach", notes=notes, report=attached())), True, i)
    expect("attach: does not fit at load", v_attach(synth("attach", notes=notes, report=attached("does-not-fit-at-load"))), False, 0)
    # The long prompt's failure is judged, found by its size, whatever failed before it.
    small = {"category": "does-not-fit-at-load", "gpu": 0, "evidence": {"fields": {"gpu": 0, "failed_bytes": 2 * MIB}}}
    death = {"category": "inconclusive", "gpu": None, "evidence": {"fields": {"gpu": None, "failed_bytes": None}}}
    report = attached()
    report = dict(report, diagnosis=small, diagnoses=[small, death] + report["diagnoses"])
    expect("attach: the long prompt's failure after another", v_attach(synth("attach", notes=notes, report=report)), True, 0)
    misjudged = attached("does-not-fit-at-load")
    misjudged = dict(misjudged, diagnosis=small, diagnoses=[small] + misjudged["diagnoses"])
    expect("attach: the long prompt's failure, misjudged, after another", v_attach(synth("attach", notes=notes, report=misjudged)), False, 0)
    on_unknown = attached(gpu=None, held=GIB, unknown_row=True)
    expect("attach: on a `?` row", v_attach(synth("attach", notes=notes, report=on_unknown)), False, 1)
    expect("attach: on a `?` row, not held on GPU 0", v_attach(synth("attach", notes=notes, report=on_unknown)), False, 2)
    expect("attach: failed on GPU 0, a `?` row beside", v_attach(synth("attach", notes=notes, report=attached(unknown_row=True))), False, 1)
    expect("attach: held below the weights", v_attach(synth("attach", notes=notes, report=attached(held=GIB))), False, 2)
    expect("attach: held, the weights' 90%", v_attach(synth("attach", notes=notes, report=attached(held=int(14.5 * GIB)))), True, 2)
    no_oom = dict(notes, oom=None, errors=["204800 bytes: RuntimeError: CUDA error"])
    expect("attach: the long prompt served", v_attach(synth("attach", notes=no_oom, report=attached())), None, 0)
    late = dict(notes, requests=served[1:])
    expect("attach: nothing served before the attach", v_attach(synth("attach", notes=late, report=attached())), None, 2)
    # Its exit: the gap of memory from before the recording, until the stop, is no teardown; a
    # 0 B traced after the stop is.
    gap = {"pid": 4242, "ts": 2 * 10**9, "nvml_bytes": int(16.8 * GIB), "traced_bytes": 0,
           "why": "it allocated memory before recording began, which no traced ioctl shows"}
    for name, entry, want in [("memory from before recording, before the stop", gap, True),
                              ("0 B traced after the stop", dict(gap, ts=9 * 10**9 + 5 * 10**8), False),
                              ("misnamed before the stop", dict(gap, why="..."), False)]:
        expect(f"attach: {name}", v_exit_agrees(synth("attach", notes=notes, report={"nvml_vs_traced": [entry]})), want)
    # The tracer's own checks.
    run = synth("cudaMalloc", [ctx], [], [], extra=[{"ts": 50, "ev": "undecodable", "fd": 5, "cmd": 0x2a, "reason": "fault"}])
    expect("undecodable", v_decoded(run), False)
    expect("decoded", v_decoded(synth("cudaMalloc", [ctx])), True)
    expect("lost", v_decoded(synth("cudaMalloc", [ctx], extra=[{"ts": 50, "ev": "lost", "records": 3}])), False)
    expect("impostors", v_fd_filter(synth("cudaMalloc", report={"fd_filter": {"impostors": 2}})), False)
    expect("no impostor", v_fd_filter(synth("cudaMalloc")), True)
    expect("no fd_filter", v_fd_filter(synth("cudaMalloc", report={})), None)
    expect("refused", v_refused(synth("cudaMalloc", report={"loss": {"foreign_client_calls": 3}})), False)
    expect("own table", v_refused(synth("cudaMalloc", report={"loss": {"own_file_table": 1}})), False)
    expect("none refused", v_refused(synth("cudaMalloc", report={"loss": {"lost_records": 0}})), True)
    expect("no loss", v_refused(synth("cudaMalloc", report={})), None)
    expect("overhead", v_overhead({"notes": {"us_per_alloc_free": 120.0}}, {"notes": {"us_per_alloc_free": 100.0}}), None)
    checks += 1
    if "ratio 1.20" not in v_overhead({"notes": {"us_per_alloc_free": 120.0}}, {"notes": {"us_per_alloc_free": 100.0}})[0][2]:
        failures.append("overhead ratio")
    # The histogram names escapes, classes and the sizes decoded.
    lines = histogram(synth("cudaMalloc", good + [{"t": 300, "bytes": GIB, "status": 0x51}]))
    checks += 1
    if not any("rm_alloc_nvos64  class 0x40  video  ok" in line and "64 MiB x2" in line for line in lines) or \
            not any("status 0x51" in line and "1 GiB" in line for line in lines):
        failures.append(f"histogram: {lines}")
    # Every API's verdicts run on data that lacks what they look for, without raising.
    for api in APIS:
        checks += 1
        try:
            verdicts_for(synth(api), safe=False)
            verdicts_for(Run(api, why="not recorded"), safe=False)
        except Exception as e:
            failures.append(f"verdicts_for({api}) raised {type(e).__name__}: {e}")
    # A trace torn mid-line still parses; a workload pid in another namespace is found by place.
    checks += 1
    header, records = parse_trace('{"format":"gputrace-trace","version":1,"monotonic_start_ns":5}\n{"ts":6,"pid":9,"ev":"place","cgroup":"/","ns_pid":77}\n{"ts":7,"pi')
    if header is None or len(records) != 1 or Run("x", header, records, account={"notes": {"pid": 77}}).pid != 9:
        failures.append("parse_trace / pid by place")
    # The workload's own pieces: cuda.h's layouts, and nvidia-smi's list read right.
    checks += 1
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import ctypes
        import workload
        layout = (ctypes.sizeof(workload.CUmemAllocationProp), workload.CUmemAllocationProp.location.offset,
                  workload.CUmemAllocationProp.win32HandleMetaData.offset, workload.CUmemAllocationProp.allocFlags.offset,
                  ctypes.sizeof(workload.CUmemAccessDesc), workload.CUmemAccessDesc.flags.offset,
                  workload.CUmemAllocFlags.usage.offset, workload.CUmemAllocFlags.reserved.offset)
        if layout != (32, 8, 16, 24, 12, 8, 2, 4):
            failures.append(f"struct layouts {layout}")
        workload.cudart_candidates()  # the search itself runs anywhere
        smi = "123, 700\n77, 1536\n88, [N/A]\n"
        if (workload.parse_compute_apps(smi, 77), workload.parse_compute_apps(smi, 5), workload.parse_compute_apps(smi, 88)) != (1536 * MIB, None, None):
            failures.append("parse_compute_apps")
    except Exception as e:
        failures.append(f"workload: {type(e).__name__}: {e}")
    for f in failures:
        print(f"FAIL {f}")
    print(f"self-test: {checks - len(failures)}/{checks} checks passed")
    return 1 if failures else 0


def main(argv):
    if argv[1:2] == ["--self-test"]:
        return self_test()
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, gputrace, apis = argv[1], argv[2], argv[3:] or APIS + ["overhead"]
    return 1 if judge(out, gputrace, apis) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
