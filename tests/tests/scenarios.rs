//! Every scenario, for both server families, on the fake GPU (root; in CI): gputrace's view
//! agrees with both ground truths, the driver's log and the workload's own, and each scenario did
//! what it is named for.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use fakegpu::truth::{read_lines, DriverLine, DriverOp};
use gputrace::event::{Event, Memory, Record};
use gputrace::model::Model;
use gputrace::trace::{Header, Reader};
use serde_json::Value;

use common::{as_root, gputrace_bin, is_wall_clock};

struct Outcome {
    /// How NVML answered the recorder: discrete, unified or none.
    nvml: String,
    dir: PathBuf,
    header: Header,
    records: Vec<Record>,
    model: Model,
    driver: Vec<DriverLine>,
    workload: Vec<Value>,
    summary: Value,
}

fn run(name: &str, server: &str, nvml: &str) -> Outcome {
    let dir = std::env::temp_dir().join(format!("gputrace-scenario-{server}-{name}-{nvml}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["scenario", name, "--server", server, "--nvml", nvml, "--dir"])
        .arg(&dir)
        .arg("--gputrace")
        .arg(gputrace_bin())
        .output()
        .unwrap();
    let logs = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    assert!(
        out.status.success(),
        "{server} {name}: {}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        logs("server.log"),
        logs("load.log")
    );
    let (header, records, damage) = Reader::read_all(&dir.join("run.trace")).expect("the trace");
    assert!(damage.bad_lines == 0 && !damage.torn_tail);
    let summary = serde_json::from_str(&logs("record.json")).unwrap_or_else(|e| panic!("{server} {name}: record.json: {e}"));
    Outcome {
        nvml: nvml.to_string(),
        model: Model::from_records(&records),
        driver: read_lines(&dir.join("driver.jsonl")).unwrap(),
        workload: read_lines(&dir.join("workload.jsonl")).unwrap_or_default(),
        dir,
        header,
        records,
        summary,
    }
}

/// (pid, kind, bytes, ok) of every allocation request, counted.
type Allocs = BTreeMap<(u32, String, u64, bool), usize>;

fn count(items: impl Iterator<Item = (u32, String, u64, bool)>) -> Allocs {
    let mut m = Allocs::new();
    for i in items {
        *m.entry(i).or_default() += 1;
    }
    m
}

/// gputrace against the driver (everything from the traced processes) and against the workload
/// (every allocation it says it made), and no loss.
fn agrees_with_ground_truth(o: &Outcome, what: &str) {
    let traced_pids: Vec<u32> = o.model.processes.keys().copied().collect();
    let driver = count(o.driver.iter().filter(|l| traced_pids.contains(&l.pid)).filter_map(|l| match &l.op {
        DriverOp::Alloc { kind, bytes, status, .. } => Some((l.pid, kind.clone(), *bytes, *status == 0)),
        _ => None,
    }));
    let traced = count(o.records.iter().filter_map(|r| match &r.event {
        Event::Alloc(a) => Some((r.pid, a.memory.name().to_string(), a.bytes, a.succeeded())),
        _ => None,
    }));
    assert_eq!(traced, driver, "{what}: gputrace's allocations against the driver's");
    // Each video allocation on the GPU the driver took it from: (pid, bytes, ok, gpu), counted.
    let driver_gpus = o.driver.iter().filter(|l| traced_pids.contains(&l.pid)).filter_map(|l| match &l.op {
        DriverOp::Alloc { kind, bytes, status, gpu, .. } if kind == "video" => Some((l.pid, *bytes, *status == 0, gpu.map(|g| g as u32))),
        _ => None,
    });
    let allocated = o.model.allocations.iter().filter(|a| a.memory == Memory::Video).map(|a| (a.pid, a.bytes, true, a.gpu));
    let failed = o.model.failures.iter().filter(|f| f.memory == Memory::Video).map(|f| (f.pid, f.bytes, false, f.gpu));
    let counted = |items: &mut dyn Iterator<Item = (u32, u64, bool, Option<u32>)>| {
        let mut m = BTreeMap::new();
        for i in items {
            *m.entry(i).or_insert(0) += 1;
        }
        m
    };
    assert_eq!(counted(&mut allocated.chain(failed)), counted(&mut driver_gpus.into_iter()), "{what}: the GPU of every video allocation");
    // The workload's own account of the recorded processes (an earlier server that held the GPU
    // before recording began is in its file too).
    let recorded = |w: &&Value| traced_pids.contains(&(w["pid"].as_u64().unwrap_or(0) as u32));
    for w in o.workload.iter().filter(|w| w["event"] == "alloc" || w["event"] == "alloc_failed").filter(recorded) {
        let pid = w["pid"].as_u64().unwrap() as u32;
        let bytes = w["bytes"].as_u64().unwrap();
        let ok = w["event"] == "alloc";
        assert!(traced.keys().any(|(p, _, b, s)| *p == pid && *b == bytes && *s == ok), "{what}: the workload's {w} is not in the trace");
    }
    // Each RM allocation the driver freed, gputrace freed too (explicitly or implicitly).
    for l in o.driver.iter().filter(|l| traced_pids.contains(&l.pid) || l.pid == 0) {
        if let DriverOp::Free { object, .. } = &l.op {
            if let Some(a) = o.model.allocations.iter().find(|a| a.object == *object && *object != 0) {
                assert!(a.freed.is_some(), "{what}: the driver freed {object:#x}, gputrace thinks it is live");
            }
        }
    }
    assert_eq!(o.summary["loss"]["lost_records"], 0, "{what}");
    assert_eq!(o.summary["loss"]["undecodable"], 0, "{what}");
}

/// Requests as the kernel saw them on the server's sockets, against the load generator's account:
/// the same number of completions, the same time to first data, headers when each family sends
/// them, and requests in flight at a failure as the workload counted them.
fn requests_agree(o: &Outcome, server: &str, what: &str) {
    let completions: Vec<&gputrace::model::Request> = o.model.requests.iter().filter(|r| r.line == "POST /v1/completions").collect();
    // Only what went to the recorded server (an earlier one, not recorded, may have had requests).
    let ports: Vec<u64> = o.model.processes.values().flat_map(|p| p.bound.iter().map(|(_, port)| *port as u64)).collect();
    let to_recorded = |w: &&Value| ports.contains(&w["port"].as_u64().unwrap_or(0));
    let sent = workload_events(o, "request").filter(to_recorded).count();
    // A server that aborts may never read the last requests sent to it: those the server read
    // are a floor, those sent a ceiling, and when it did not die the two meet.
    let server_pids: Vec<u32> = o.model.processes.keys().copied().collect();
    let read = workload_events(o, "read")
        .filter(|w| w["path"] == "/v1/completions" && server_pids.contains(&(w["pid"].as_u64().unwrap_or(0) as u32)))
        .count();
    assert!(
        read <= completions.len() && completions.len() <= sent,
        "{what}: {} completions seen on the server's sockets, {read} read by it, {sent} sent",
        completions.len()
    );
    if workload_events(o, "fatal").next().is_none() {
        assert_eq!(completions.len(), sent, "{what}: completions seen on the server's sockets");
    }
    let ms = |ns: u64| ns as f64 / 1e6;
    let mut traced: Vec<f64> = completions.iter().filter_map(|r| Some(ms(r.first_data_at? - r.arrived))).collect();
    let mut client: Vec<f64> = workload_events(o, "response").filter(to_recorded).filter_map(|r| r["first_data_ms"].as_f64()).collect();
    traced.sort_by(f64::total_cmp);
    client.sort_by(f64::total_cmp);
    assert_eq!(traced.len(), client.len(), "{what}: responses that carried data");
    for (t, c) in traced.iter().zip(&client) {
        assert!((t - c).abs() < 20.0, "{what}: time to first data {t:.1} ms by the kernel's view, {c:.1} ms by the client's");
    }
    for r in completions.iter().filter(|r| r.first_data_at.is_some()) {
        let (headers, data) = (ms(r.headers_at.unwrap() - r.arrived), ms(r.first_data_at.unwrap() - r.arrived));
        if server == "vllm" {
            assert!(headers < 10.0 && data > 20.0, "{what}: vLLM sends headers at once, data at TTFT: {headers:.1} / {data:.1} ms");
        } else {
            assert!(data - headers < 5.0, "{what}: llama sends headers at TTFT: {headers:.1} / {data:.1} ms");
        }
    }
    for (failure, w) in o.model.failures.iter().zip(workload_events(o, "alloc_failed").filter(|w| w["phase"] == "prefill")) {
        let in_flight = o.model.in_flight(failure.ts, None) as u64;
        assert_eq!(in_flight, w["in_flight"].as_u64().unwrap(), "{what}: requests in flight at the failure, from the kernel's view");
    }
}

/// Phase attribution, with no marks: at least 95% of the bytes of each phase where the workload's
/// ground truth puts them (allocations matched by process, size and order).
fn phases_agree(o: &Outcome, what: &str) {
    let services = gputrace::analysis::services::Services::new(&o.model);
    let mut traced: BTreeMap<(u32, u64), Vec<&str>> = BTreeMap::new();
    for a in o.model.allocations.iter().filter(|a| a.memory != Memory::Virtual) {
        traced.entry((a.pid, a.bytes)).or_default().push(services.phase_of(a.pid, a.ts).name());
    }
    for list in traced.values_mut() {
        list.reverse();
    }
    let mut totals: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for w in workload_events(o, "alloc").filter(|w| w["path"] != "VirtualReserve") {
        let (pid, bytes) = (w["pid"].as_u64().unwrap() as u32, w["bytes"].as_u64().unwrap());
        let Some(phase) = traced.get_mut(&(pid, bytes)).and_then(|l| l.pop()) else { continue };
        let truth = w["phase"].as_str().unwrap().to_string();
        let entry = totals.entry(truth.clone()).or_default();
        entry.1 += bytes;
        if phase == truth {
            entry.0 += bytes;
        }
    }
    for (phase, (right, all)) in totals {
        let share = right as f64 / all as f64;
        assert!(share >= 0.95, "{what}: {:.1}% of the {phase} bytes attributed to {phase}", share * 100.0);
    }
}

/// `gputrace export` of the scenario's trace: the Perfetto JSON follows the Trace Event Format,
/// the CSV has one well-formed row per allocation.
fn exports_are_well_formed(o: &Outcome, what: &str) {
    let export = |format: &str| {
        let out = Command::new(gputrace_bin()).args(["export", "--format", format]).arg(o.dir.join("run.trace")).output().unwrap();
        assert!(out.status.success(), "{what}: export {format}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let perfetto: Value = serde_json::from_str(&export("perfetto")).unwrap_or_else(|e| panic!("{what}: Perfetto JSON: {e}"));
    let events = perfetto["traceEvents"].as_array().expect("traceEvents");
    let mut named = std::collections::BTreeSet::new();
    let mut used = std::collections::BTreeSet::new();
    let mut open: BTreeMap<(u64, u64), i64> = BTreeMap::new();
    for e in events {
        let ph = e["ph"].as_str().unwrap_or_else(|| panic!("{what}: no ph: {e}"));
        assert!(e["name"].is_string() && e["pid"].is_u64(), "{what}: name and pid on every event: {e}");
        let pid = e["pid"].as_u64().unwrap();
        match ph {
            "M" => {
                if e["name"] == "process_name" {
                    assert!(e["args"]["name"].is_string(), "{what}: {e}");
                    named.insert(pid);
                }
                continue;
            }
            "X" => assert!(e["dur"].as_f64().is_some_and(|d| d >= 0.0), "{what}: a complete event needs dur >= 0: {e}"),
            "C" => {
                for (k, v) in e["args"].as_object().expect("counter args") {
                    assert!(v.as_f64().is_some_and(|v| v >= 0.0), "{what}: counter {k} never negative: {e}");
                }
            }
            "i" => assert!(["g", "p", "t"].contains(&e["s"].as_str().unwrap_or("t")), "{what}: {e}"),
            "B" => *open.entry((pid, e["tid"].as_u64().unwrap_or(0))).or_default() += 1,
            "E" => *open.entry((pid, e["tid"].as_u64().unwrap_or(0))).or_default() -= 1,
            other => panic!("{what}: unexpected phase {other}"),
        }
        assert!(e["ts"].as_f64().is_some(), "{what}: ts on every event: {e}");
        used.insert(pid);
    }
    assert!(open.values().all(|&n| n == 0), "{what}: begin/end pairs matched");
    assert!(used.is_subset(&named), "{what}: every process named: {:?} vs {:?}", used, named);
    let failures = events.iter().filter(|e| e["name"] == "failed allocation").count();
    assert_eq!(failures, o.model.failures.len(), "{what}: an instant for every failed allocation");
    // A track group per GPU memory was traced on, with its own counter and its failures.
    let gpu_tracks: std::collections::BTreeSet<u64> =
        events.iter().filter(|e| e["name"] == "live video memory").map(|e| e["pid"].as_u64().unwrap()).collect();
    let traced_gpus: std::collections::BTreeSet<Option<u32>> =
        o.model.allocations.iter().filter(|a| a.memory == Memory::Video && a.gpu.is_some()).map(|a| a.gpu).collect();
    assert_eq!(gpu_tracks.len(), traced_gpus.len(), "{what}: GPU tracks {gpu_tracks:?} for {traced_gpus:?}");
    let here = events.iter().filter(|e| e["name"] == "out of memory here").count();
    assert_eq!(here, o.model.failures.iter().filter(|f| f.gpu.is_some()).count(), "{what}: failures on their GPU's track");
    let ooms = events.iter().filter(|e| e["name"] == "OOM kill").count();
    assert_eq!(ooms, o.model.processes.values().filter(|p| p.oom_killed.is_some()).count(), "{what}");

    let csv = export("csv");
    let mut lines = csv.lines();
    let columns = lines.next().unwrap().split(',').count();
    assert_eq!(columns, 14, "{what}");
    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), o.model.allocations.len() + o.model.failures.len(), "{what}: one row per allocation");
    for row in rows {
        let mut fields = 0;
        let mut quoted = false;
        for c in row.chars() {
            match c {
                '"' => quoted = !quoted,
                ',' if !quoted => fields += 1,
                _ => {}
            }
        }
        assert_eq!(fields + 1, 14, "{what}: {row}");
        let freed_by = row.rsplit(',').nth(2).unwrap();
        let known = ["explicit", "subtree", "file_release", "unmapped", "detached", "released_still_held", "never", "failed"];
        assert!(known.contains(&freed_by), "{what}: {row}");
    }
}

fn workload_events<'a>(o: &'a Outcome, event: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    o.workload.iter().filter(move |w| w["event"] == event)
}

/// The verdict: category, symptom, culprit and key figures.
fn diagnosed_right(o: &Outcome, name: &str, server: &str, what: &str) {
    let d = &o.summary["diagnosis"];
    let (category, symptom) = match (name, server) {
        ("clean", _) => ("none", "none"),
        ("held-by-other-process", "vllm") => ("held-by-other-process", "startup-refusal"),
        ("held-by-other-process", _) => ("held-by-other-process", "failed-allocation"),
        ("host-oom", _) => ("host-oom", "oom-kill"),
        ("tensor-parallel", _) => ("does-not-fit-at-load", "failed-allocation"),
        (other, _) => (other, "failed-allocation"),
    };
    assert_eq!((d["category"].as_str(), d["symptom"].as_str()), (Some(category), Some(symptom)), "{what}: {d:#}");
    let contexts = o.summary["contexts_never_freed"].as_array().unwrap();
    let e = &d["evidence"]["fields"];
    let fix = &d["fix"]["fields"];
    match name {
        "clean" => assert!(contexts.is_empty(), "{what}: no suspect context: {contexts:?}"),
        "held-by-other-process" => {
            let holder = o.header.holders_at_start[0].pid;
            assert_eq!(fix["kill"].as_u64(), Some(holder as u64), "{what}: the process to stop");
            assert!(d["fix"]["text"].as_str().unwrap().contains(&format!("kill {holder}")), "{what}");
            if o.nvml == "none" {
                // Started after the holder, with no NVML: a suspect of unknown size, never the model.
                let named = e["holders_outside"].as_array().unwrap().iter().find(|h| h["pid"].as_u64() == Some(holder as u64));
                assert!(named.is_some_and(|h| h["bytes"].is_null() && h["source"] == "proc"), "{what}: {e:#}");
                assert!(d["fix"]["text"].as_str().unwrap().contains("how much it holds is unknown"), "{what}");
            } else {
                assert!(e["held_outside_bytes"].as_u64().unwrap() > 16 << 30, "{what}");
            }
            assert!(
                contexts.iter().any(|c| c["pid"].as_u64() == Some(holder as u64)),
                "{what}: named among contexts never freed: {contexts:?}"
            );
        }
        "host-oom" => {
            let killed = o.model.processes.values().find(|p| p.oom_killed.is_some()).expect("the OOM killer's victim").pid;
            assert_eq!(d["pid"].as_u64(), Some(killed as u64), "{what}");
        }
        _ => {
            let failure = &o.model.failures[0];
            assert_eq!(d["pid"].as_u64(), Some(failure.pid as u64), "{what}: the failing process");
            assert_eq!(e["failed_bytes"].as_u64(), Some(failure.bytes), "{what}");
            let in_flight = workload_events(o, "alloc_failed").next().unwrap()["in_flight"].as_u64().unwrap();
            assert_eq!(e["requests_in_flight"].as_u64(), Some(in_flight), "{what}");
            if name == "concurrent-load" {
                let (cap, each, room) = (
                    fix["max_concurrency"].as_u64().unwrap(),
                    fix["bytes_per_request"].as_u64().unwrap(),
                    fix["room_bytes"].as_u64().unwrap(),
                );
                assert!(cap * each <= room && (cap + 1) * each > room && cap < in_flight, "{what}: cap {cap} of {each} bytes in {room}");
                let alone = workload_events(o, "prefill").find(|w| w["in_flight"] == 1).map(|w| w["bytes"].as_u64().unwrap()).unwrap();
                assert!(each >= alone && each < alone + alone / 10, "{what}: one request's cost {each}, the workload says {alone}");
            }
            if name == "kept-by-service" {
                kept_right(o, d, what);
            }
            if name == "does-not-fit-at-load" {
                assert!(fix["load_bytes"].as_u64().unwrap() > o.header.gpus[0].total_bytes.unwrap(), "{what}: more than the card");
            }
            if name == "tensor-parallel" {
                // Judged on the fourth, smaller card, with its capacity: what it needed fits any
                // of the other three.
                let (small, big) = (o.header.gpus[3].total_bytes.unwrap(), o.header.gpus[0].total_bytes.unwrap());
                assert_eq!((d["gpu"].as_u64(), e["gpu"].as_u64()), (Some(3), Some(3)), "{what}");
                assert_eq!(e["capacity_bytes"].as_u64(), Some(small), "{what}: GPU 3's capacity");
                assert_eq!(e["service_gpus"], serde_json::json!([0, 1, 2, 3]), "{what}");
                let load = fix["load_bytes"].as_u64().unwrap();
                assert!(load > small && load < big, "{what}: {load} needed on GPU 3");
                let flag = if server == "vllm" { "--tensor-parallel-size, now 4" } else { "--tensor-split, now 1,1,1,1" };
                assert!(d["fix"]["text"].as_str().unwrap().contains(flag), "{what}: {}", d["fix"]["text"]);
                let gpus = o.summary["gpus"].as_array().unwrap();
                assert_eq!(gpus.len(), 4, "{what}: {gpus:?}");
                let failed: Vec<u64> = gpus.iter().map(|g| g["failed_allocations"].as_u64().unwrap()).collect();
                assert_eq!(failed, [0, 0, 0, 1], "{what}");
                assert!(gpus.iter().all(|g| g["peak_bytes"].as_u64().unwrap() <= g["capacity_bytes"].as_u64().unwrap()), "{what}");
            }
        }
    }
}

/// kept-by-service against the fake's ground truth: what each request kept and what was kept in
/// all (the first request's entry is in with the pool's first growth, so not counted: within
/// 10%), the failing server's process named, and a fix that caps neither context nor concurrency.
fn kept_right(o: &Outcome, d: &Value, what: &str) {
    let kept = &d["evidence"]["fields"]["kept"];
    let truth: Vec<u64> = workload_events(o, "kept").map(|w| w["bytes"].as_u64().unwrap()).collect();
    let each = truth[0];
    assert!(truth.len() >= 10 && truth.iter().all(|&b| b == each), "{what}: {truth:?}");
    let total: u64 = truth.iter().sum();
    let (kept_bytes, per_request) = (kept["kept_bytes"].as_u64().unwrap(), kept["kept_per_request_bytes"].as_u64().unwrap());
    assert!(kept_bytes.abs_diff(total) * 10 <= total, "{what}: kept {kept_bytes} against the truth's {total}: {kept:#}");
    assert!(per_request.abs_diff(each) * 10 <= each, "{what}: {per_request} a request against the truth's {each}");
    assert_eq!(kept["requests_served"].as_u64(), Some(truth.len() as u64), "{what}: every request served kept an entry");
    assert_eq!(kept["since_attaching"], false, "{what}");
    let server = o.model.processes[&(d["pid"].as_u64().unwrap() as u32)].command.join(" ");
    assert!(server.contains("--keep-mib-per-request"), "{what}: the failing process is the server's: {server}");
    let fix = d["fix"]["text"].as_str().unwrap();
    for cap in ["--max-model-len", "--max-num-seqs", "-np", "--parallel", " -c ", "max_parallel_requests"] {
        assert!(!fix.contains(cap), "{what}: no context or concurrency cap for memory the server keeps: {fix}");
    }
    assert_eq!(d["fix"]["fields"]["requests_from_fresh_start"].as_u64(), Some(truth.len() as u64), "{what}: {fix}");
}

/// The verdict read at a glance: a headline of at most 72 characters naming the category, the
/// location with wall-clock time, one `help:` per setting with its value now, and the `check:`
/// run (whatif agrees the fix fits); then the block against its snapshot
/// (tests/snapshots/SERVER-NAME-NVML.block; `GPUTRACE_BLESS=1` writes them).
fn block_reads_at_a_glance(o: &Outcome, name: &str, server: &str, what: &str) {
    let b = &o.summary["block"];
    let strings = |v: &Value| v.as_array().map_or(vec![], |a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect::<Vec<_>>());
    let (headline, help) = (b["headline"].as_str().unwrap_or_default(), strings(&b["help"]));
    let category = o.summary["diagnosis"]["category"].as_str().unwrap_or_default();
    assert!(headline.chars().count() <= 72, "{what}: {headline}");
    if category == "none" {
        assert_eq!(headline, "OK: nothing failed", "{what}");
    } else {
        assert!(headline.starts_with(&format!("OOM {category}: ")), "{what}: {headline}");
        let location = b["location"].as_str().unwrap_or_default();
        let when = location.rsplit(" · ").next().unwrap_or_default();
        // Without NVML a refusal (a death names no GPU) is on no GPU known.
        assert!(is_wall_clock(when) && (location.starts_with("GPU ") || o.nvml == "none"), "{what}: {location}");
        assert!(!location.contains("--truth") && !location.contains("--port"), "{what}: no argument values but sizing flags: {location}");
    }
    let (concurrency, context) = if server == "llama" { ("-np ", "-c ") } else { ("--max-num-seqs ", "--max-model-len ") };
    match category {
        "long-request" => assert!(help.len() == 1 && help[0].starts_with(context) && help[0].contains("(now "), "{what}: {help:?}"),
        "concurrent-load" => {
            assert!(help[0].starts_with(concurrency) && help[0].contains("(now "), "{what}: {help:?}");
            assert!(help[1].starts_with("or LiteLLM max_parallel_requests: "), "{what}: {help:?}");
        }
        "held-by-other-process" => assert!(help.len() == 1 && help[0].starts_with("kill "), "{what}: {help:?}"),
        _ => {}
    }
    if let Some(check) = b["check"].as_str() {
        let args: Vec<&str> = check.split(' ').collect();
        assert_eq!(args[..2], ["gputrace", "whatif"], "{what}: {check}");
        let out = Command::new(gputrace_bin()).args(&args[1..]).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && said.starts_with("FITS with "), "{what}: `{check}` says {said}");
    }
    let text = Command::new(gputrace_bin()).arg("report").arg(o.dir.join("run.trace")).output().unwrap().stdout;
    common::matches_snapshot(&String::from_utf8_lossy(&text), &format!("{server}-{name}-{}", o.nvml), what);
}

fn check(name: &str, server: &str, nvml: &str) {
    let o = run(name, server, nvml);
    let what = format!("{server} {name} (NVML {nvml})");
    block_reads_at_a_glance(&o, name, server, &what);
    agrees_with_ground_truth(&o, &what);
    requests_agree(&o, server, &what);
    phases_agree(&o, &what);
    diagnosed_right(&o, name, server, &what);
    exports_are_well_formed(&o, &what);
    let failures = &o.model.failures;
    let failed_phase = workload_events(&o, "alloc_failed").next().map(|w| w["phase"].as_str().unwrap_or("").to_string());
    match name {
        "clean" => {
            assert!(failures.is_empty(), "{what}: {failures:?}");
            assert_eq!(o.model.live(Memory::Video), 0, "{what}: everything freed when the server stopped");
            assert!(workload_events(&o, "response").all(|r| r["status"] == "HTTP/1.1 200 OK"), "{what}: every request served");
        }
        "does-not-fit-at-load" | "tensor-parallel" => {
            assert_eq!(failures.len(), 1, "{what}");
            assert_eq!(failed_phase.as_deref(), Some("load"), "{what}");
            assert_eq!(failures[0].status, 0x51, "{what}: NV_ERR_NO_MEMORY");
        }
        "kept-by-service" => {
            assert_eq!(failures.len(), 1, "{what}");
            assert_eq!(failed_phase.as_deref(), Some("prefill"), "{what}");
            // An ordinary request: every one sent was alike, and those before it were served.
            let prompts: Vec<u64> = workload_events(&o, "request").map(|w| w["prompt_tokens"].as_u64().unwrap()).collect();
            assert!(prompts.iter().all(|&p| p == prompts[0]), "{what}: {prompts:?}");
            let served = workload_events(&o, "response").filter(|r| r["status"] == "HTTP/1.1 200 OK").count();
            assert!(served >= 10, "{what}: {served} served before it failed");
        }
        "long-request" | "concurrent-load" => {
            assert_eq!(failures.len(), 1, "{what}");
            assert_eq!(failed_phase.as_deref(), Some("prefill"), "{what}");
            let in_flight = workload_events(&o, "alloc_failed").next().unwrap()["in_flight"].as_u64().unwrap();
            if name == "long-request" {
                assert_eq!(in_flight, 1, "{what}: one request in flight");
                assert!(workload_events(&o, "response").any(|r| r["status"] == "HTTP/1.1 200 OK"), "{what}: shorter ones served");
            } else {
                assert!(in_flight > 1, "{what}: several in flight, got {in_flight}");
            }
        }
        "held-by-other-process" => {
            // The holder allocated before the recording began; NVML, where there is one, still
            // names it.
            match o.header.prior_use.iter().max_by_key(|p| p.used_bytes) {
                Some(prior) => {
                    assert!(prior.used_bytes.unwrap() > 16 << 30, "{what}: {prior:?}");
                    assert!(!o.model.processes.contains_key(&prior.pid), "{what}: not part of the recorded command");
                    if server == "vllm" {
                        assert_eq!(o.header.holders_at_start[0].pid, prior.pid, "{what}: the orphaned engine holds what it allocated");
                    } else {
                        assert_ne!(o.header.holders_at_start[0].pid, prior.pid, "{what}: the killed server's helper holds its memory");
                    }
                }
                None => assert!(o.nvml == "none" && o.header.nvml.starts_with("NVML unavailable"), "{what}: {}", o.header.nvml),
            }
            // Who keeps it: the orphaned engine itself, or the forked helper of a dead server.
            let holders = &o.header.holders_at_start;
            assert_eq!(holders.len(), 1, "{what}: {holders:?}");
            let holder = &holders[0];
            assert!(holder.command.iter().any(|a| a.contains("fake-server")), "{what}: {holder:?}");
            assert_eq!(holder.devices, vec!["ctl", "gpu", "uvm"], "{what}");
            if server == "vllm" {
                assert!(holder.command.iter().any(|a| a == "engine"), "{what}: {holder:?}");
                assert!(failures.is_empty(), "{what}: a refusal, not a failed allocation");
                assert!(workload_events(&o, "refused").count() == 1, "{what}");
            } else {
                assert!(holder.command.iter().any(|a| a == "--helper"), "{what}: {holder:?}");
                assert_eq!(failures.len(), 1, "{what}: the new server's weights");
            }
        }
        "host-oom" => {
            assert!(failures.is_empty(), "{what}: no allocation failed");
            assert!(o.header.gpus[0].total_bytes.is_none(), "{what}: unified memory reports no capacity");
            assert_eq!(workload_events(&o, "listen").filter(|w| w["server"] == "vllm").count(), 0, "{what}: never served");
        }
        _ => unreachable!(),
    }
    std::fs::remove_dir_all(&o.dir).ok();
}

fn scenario(name: &str, server: &str, nvml: &str) {
    let _root = as_root();
    check(name, server, nvml);
    let leftovers = Command::new("pgrep").args(["-f", "fake-server --server"]).output().unwrap();
    assert!(String::from_utf8_lossy(&leftovers.stdout).trim().is_empty(), "{server} {name}: no server process left behind");
}

macro_rules! scenarios {
    ($($test:ident: $name:literal, $server:literal, $nvml:literal;)*) => {
        $(#[test] #[ignore = "needs root: `sudo cargo xtask test` runs it"] fn $test() { scenario($name, $server, $nvml) })*

        /// The table above covers every scenario the fake GPU knows, for both families, with NVML
        /// on a discrete GPU; and holders set up before recording in every NVML mode.
        #[test]
        fn every_scenario_is_tested() {
            let tested = [$(($name, $server, $nvml)),*];
            for server in fakegpu::scenario::SERVERS {
                for name in fakegpu::scenario::NAMES {
                    assert!(tested.contains(&(name, server, "discrete")), "{server} {name} has no test");
                }
                for nvml in fakegpu::scenario::NVML_MODES {
                    assert!(tested.contains(&("held-by-other-process", server, nvml)), "{server} held-by-other-process with NVML {nvml}");
                }
            }
        }
    };
}

scenarios! {
    vllm_clean: "clean", "vllm", "discrete";
    vllm_held_by_other_process: "held-by-other-process", "vllm", "discrete";
    vllm_held_by_other_process_unified: "held-by-other-process", "vllm", "unified";
    vllm_held_by_other_process_without_nvml: "held-by-other-process", "vllm", "none";
    vllm_does_not_fit_at_load: "does-not-fit-at-load", "vllm", "discrete";
    vllm_long_request: "long-request", "vllm", "discrete";
    vllm_concurrent_load: "concurrent-load", "vllm", "discrete";
    vllm_kept_by_service: "kept-by-service", "vllm", "discrete";
    vllm_host_oom: "host-oom", "vllm", "discrete";
    vllm_tensor_parallel: "tensor-parallel", "vllm", "discrete";
    llama_clean: "clean", "llama", "discrete";
    llama_held_by_other_process: "held-by-other-process", "llama", "discrete";
    llama_held_by_other_process_unified: "held-by-other-process", "llama", "unified";
    llama_held_by_other_process_without_nvml: "held-by-other-process", "llama", "none";
    llama_does_not_fit_at_load: "does-not-fit-at-load", "llama", "discrete";
    llama_long_request: "long-request", "llama", "discrete";
    llama_concurrent_load: "concurrent-load", "llama", "discrete";
    llama_kept_by_service: "kept-by-service", "llama", "discrete";
    llama_host_oom: "host-oom", "llama", "discrete";
    llama_tensor_parallel: "tensor-parallel", "llama", "discrete";
}
