//! End to end, as root, against the fake GPU: `gputrace record` sees every allocation and free a
//! workload made, with the right sizes, kinds, pids and statuses, and implicit frees when the
//! driver itself released the file. Compared with both ground truths: the driver's log and the
//! workload's own. Skipped with a message when not root, failed when CI=true.

mod common;

use std::path::PathBuf;
use std::process::Command;

use fakegpu::truth::{read_lines, DriverLine, DriverOp};
use gputrace::event::{Event, Memory, Record};
use gputrace::model::{FreedBy, Model};
use gputrace::trace::Reader;

use common::{as_root, gputrace_bin};

struct Run {
    dir: PathBuf,
    status: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn trace(&self) -> (Vec<Record>, Model) {
        let (_, records, damage) = Reader::read_all(&self.dir.join("run.trace")).expect("the trace reads");
        assert!(damage.bad_lines == 0 && !damage.torn_tail, "damaged trace: {damage:?}");
        let model = Model::from_records(&records);
        (records, model)
    }
    fn driver(&self) -> Vec<DriverLine> {
        read_lines(&self.dir.join("driver.jsonl")).expect("the driver log reads")
    }
    fn summary(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("record --json printed no JSON ({e}): {}\n{}", self.stdout, self.stderr))
    }
}

/// `fakegpu run -- gputrace record --json -o DIR/run.trace -- fake-workload ARGS --truth DIR/workload.jsonl`
fn record(name: &str, version: &str, workload: &[&str]) -> Run {
    record_then_wait(name, version, workload, None)
}

/// The same, with the workload run by a shell that waits `wait` before exiting, so the recording
/// outlives what the workload left running.
fn record_then_wait(name: &str, version: &str, workload: &[&str], wait: Option<&str>) -> Run {
    let dir = std::env::temp_dir().join(format!("gputrace-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |f: &str| dir.join(f).to_str().unwrap().to_string();
    let output = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["run", "--driver-version", version, "--video", "80GiB", "--log", &path("driver.jsonl"), "--"])
        .arg(gputrace_bin())
        .args(["record", "--json", "-o", &path("run.trace"), "--"])
        .args(wait.map(|seconds| ["sh".to_string(), "-c".into(), format!("\"$0\" \"$@\"; sleep {seconds}")]).into_iter().flatten())
        .arg(env!("CARGO_BIN_EXE_fake-workload"))
        .args(workload)
        .args(["--truth", &path("workload.jsonl")])
        .output()
        .expect("running fakegpu");
    Run {
        dir,
        status: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn kind(memory: Memory) -> &'static str {
    memory.name()
}

/// Every allocation the driver saw, as (pid, kind, bytes, status), sorted.
fn driver_allocs(driver: &[DriverLine]) -> Vec<(u32, String, u64, u32)> {
    let mut v: Vec<_> = driver
        .iter()
        .filter_map(|l| match &l.op {
            DriverOp::Alloc { kind, bytes, status, .. } => Some((l.pid, kind.clone(), *bytes, *status)),
            _ => None,
        })
        .collect();
    v.sort();
    v
}

fn traced_allocs(records: &[Record]) -> Vec<(u32, String, u64, u32)> {
    let mut v: Vec<_> = records
        .iter()
        .filter_map(|r| match &r.event {
            Event::Alloc(a) => Some((r.pid, kind(a.memory).to_string(), a.bytes, a.status)),
            _ => None,
        })
        .collect();
    v.sort();
    v
}

/// Frees of RM memory objects as the driver logged them: (object, how, ts).
fn driver_frees(driver: &[DriverLine]) -> Vec<(u32, String, u64)> {
    driver
        .iter()
        .filter_map(|l| match &l.op {
            DriverOp::Free { object, how, .. } if *object != 0 => Some((*object, how.clone(), l.ts)),
            _ => None,
        })
        .collect()
}

fn release_times(driver: &[DriverLine]) -> Vec<u64> {
    driver.iter().filter(|l| matches!(l.op, DriverOp::Release { .. })).map(|l| l.ts).collect()
}

/// gputrace's view of each RM allocation's end must match the driver's: same objects freed, the
/// same way, and implicit frees no later than the driver's release and close to it.
fn check_frees_match(model: &Model, driver: &[DriverLine]) {
    let releases = release_times(driver);
    for (object, how, ts) in driver_frees(driver) {
        let a = model.allocations.iter().find(|a| a.object == object).unwrap_or_else(|| panic!("gputrace has no allocation {object:#x}"));
        let (freed_ts, freed_by) =
            a.freed.unwrap_or_else(|| panic!("gputrace thinks {object:#x} is still live; the driver freed it ({how})"));
        let expected = match how.as_str() {
            "explicit" => FreedBy::Explicit,
            "subtree" => FreedBy::Subtree,
            "unmapped" => FreedBy::Unmapped,
            "detached" => FreedBy::Detached,
            _ => FreedBy::FileRelease,
        };
        assert_eq!(freed_by, expected, "how {object:#x} was freed");
        if expected == FreedBy::FileRelease {
            // The kernel drops the last reference (close, exit) just before FUSE's RELEASE reaches the driver.
            let release = releases.iter().copied().filter(|&r| r >= freed_ts).min().expect("a release after gputrace's free");
            assert!(
                release - freed_ts < 1_000_000_000,
                "implicit free {freed_ts} is {} ns before the driver's release",
                release - freed_ts
            );
            assert!(ts >= freed_ts);
        } else {
            let skew = freed_ts.abs_diff(ts);
            assert!(skew < 50_000_000, "explicit free of {object:#x} at {freed_ts}, driver logged {ts}");
        }
    }
    let freed_by_driver: Vec<u32> = driver_frees(driver).iter().map(|f| f.0).collect();
    for a in model.allocations.iter().filter(|a| a.object != 0) {
        if a.freed.is_some() {
            assert!(freed_by_driver.contains(&a.object), "gputrace freed {:#x} but the driver never did", a.object);
        }
    }
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn every_path_every_driver_version() {
    let _root = as_root();
    for version in fakegpu::abi::VERSIONS {
        let run = record(&format!("paths-{version}"), version, &["paths"]);
        assert_eq!(run.status, 0, "{version}: {}", run.stderr);
        let (records, model) = run.trace();
        let driver = run.driver();

        let traced = traced_allocs(&records);
        assert_eq!(traced, driver_allocs(&driver), "{version}: allocations (pid, kind, bytes, status)");
        assert_eq!(traced.len(), 7, "{version}: 4 RM allocations, 2 UVM ranges, 1 semaphore pool");
        let vias: std::collections::BTreeSet<String> = records
            .iter()
            .filter_map(|r| match &r.event {
                Event::Alloc(a) => Some(format!("{:?}", a.via)),
                _ => None,
            })
            .collect();
        assert_eq!(vias.len(), 6, "{version}: every allocation path: {vias:?}");
        assert!(records.iter().any(|r| matches!(r.event, Event::DupObject { status: 0, .. })), "{version}: the dup");
        check_frees_match(&model, &driver);
        assert_eq!(model.live(Memory::Video) + model.live(Memory::System) + model.live(Memory::Virtual), 0, "{version}: all freed at exit");

        // The workload's own account: each allocation it made, with its pid and size.
        let workload: Vec<serde_json::Value> = read_lines(&run.dir.join("workload.jsonl")).unwrap();
        for w in workload.iter().filter(|w| w["op"] == "alloc") {
            let (pid, bytes) = (w["pid"].as_u64().unwrap() as u32, w["bytes"].as_u64().unwrap());
            assert!(traced.iter().any(|t| t.0 == pid && t.2 == bytes), "{version}: workload alloc {w} not traced");
        }
        let summary = run.summary();
        assert_eq!(summary["loss"]["lost_records"], 0, "{version}");
        assert_eq!(summary["loss"]["undecodable"], 0, "{version}");
        let header = Reader::open(&run.dir.join("run.trace")).unwrap().header;
        assert_eq!(header.driver_version.as_deref(), Some(version), "version read as a real host exposes it");
        assert_eq!(header.driver_version_source, "/proc/driver/nvidia/version");
        std::fs::remove_dir_all(&run.dir).ok();
    }
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_forked_child_keeps_the_memory_until_it_exits() {
    let _root = as_root();
    let run = record_then_wait("fork-holder", "580.95.05", &["fork-holder", "--hold-ms", "700"], Some("1.5"));
    assert_eq!(run.status, 0, "{}", run.stderr);
    let (records, model) = run.trace();
    let driver = run.driver();
    let weights = model.allocations.iter().find(|a| a.memory == Memory::Video).expect("the 4 GiB allocation");
    assert_eq!(weights.bytes, 4 << 30);
    let parent = weights.pid;
    let child = model.processes.values().find(|p| p.ppid == parent).expect("the forked child").pid;
    let parent_exit = model.processes[&parent].exited.expect("the parent exited");
    let child_exit = model.processes[&child].exited.expect("the child exited");
    let (freed_ts, how) = weights.freed.expect("freed when the child exited");
    assert_eq!(how, FreedBy::FileRelease);
    assert!(freed_ts > parent_exit + 500_000_000, "still live after the parent exited: freed {freed_ts}, parent exit {parent_exit}");
    assert_eq!(freed_ts, child_exit, "freed at the child's exit");
    check_frees_match(&model, &driver);
    assert_eq!(traced_allocs(&records), driver_allocs(&driver));
    std::fs::remove_dir_all(&run.dir).ok();
}

/// Recording ends with the command; a child it left holding the files still holds the memory at
/// the end of the trace, and the model names it as the holder.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn memory_a_child_still_holds_when_recording_ends_is_live() {
    let _root = as_root();
    let run = record("fork-holder-live", "580.95.05", &["fork-holder", "--hold-ms", "1500"]);
    assert_eq!(run.status, 0, "{}", run.stderr);
    let (_, model) = run.trace();
    let weights = model.allocations.iter().find(|a| a.memory == Memory::Video).expect("the 4 GiB allocation");
    assert!(weights.freed.is_none(), "the child still holds it when the recording ends");
    let parent = weights.pid;
    assert!(model.processes[&parent].exited.is_some());
    let child = model.processes.values().find(|p| p.ppid == parent).expect("the forked child").pid;
    assert_eq!(model.holders(weights.file.unwrap()), vec![child]);
    let summary = run.summary();
    let p = summary["processes"].as_array().unwrap().iter().find(|p| p["pid"] == parent).unwrap();
    assert_eq!(p["bytes_live"], 4u64 << 30);
    let contexts = summary["contexts_never_freed"].as_array().unwrap();
    let suspect = contexts.iter().find(|c| c["pid"] == child).expect("the child is named among contexts never freed");
    assert_eq!(suspect["bytes"], 4u64 << 30);
    assert!(suspect["why"].as_str().unwrap().contains(&format!("its owner pid {parent} exited")), "{suspect}");
    std::fs::remove_dir_all(&run.dir).ok();
}

/// Device files passed over a unix socket: the receiver's fds are new to the kernel, asked about
/// once, and known (kcmp) to share the sender's files, so the sender's exit frees nothing.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn files_received_over_a_socket_keep_the_senders_memory() {
    let _root = as_root();
    let run = record_then_wait("pass-fd", "580.95.05", &["pass-fd"], Some("1.5"));
    assert_eq!(run.status, 0, "{}", run.stderr);
    let (records, model) = run.trace();
    let driver = run.driver();
    assert_eq!(traced_allocs(&records), driver_allocs(&driver));
    let sender_alloc = model.allocations.iter().find(|a| a.memory == Memory::Video && a.bytes == 2 << 30).unwrap();
    let receiver_alloc = model.allocations.iter().find(|a| a.memory == Memory::Video && a.bytes == 1 << 30).unwrap();
    assert_ne!(sender_alloc.pid, receiver_alloc.pid);
    assert_eq!(sender_alloc.file, receiver_alloc.file, "the received fd is the sender's nvidiactl file");
    // Of the three files received (in whatever order they were first used), the nvidiactl one is
    // known to be the sender's.
    let found: Vec<Option<u64>> = records
        .iter()
        .filter(|r| r.pid == receiver_alloc.pid)
        .filter_map(|r| match r.event {
            Event::FdFound { file, .. } => Some(Some(file)),
            _ => None,
        })
        .collect();
    assert!(found.contains(&sender_alloc.file), "the received fds, asked about: {found:?}");
    let sender_exit = model.processes[&sender_alloc.pid].exited.unwrap();
    let receiver_exit = model.processes[&receiver_alloc.pid].exited.unwrap();
    let (freed_ts, how) = sender_alloc.freed.expect("freed when the receiver let go");
    assert_eq!(how, FreedBy::FileRelease);
    assert!(
        freed_ts > sender_exit + 500_000_000 && freed_ts <= receiver_exit,
        "freed by the receiver's last reference ({freed_ts}), not the sender's exit ({sender_exit})"
    );
    check_frees_match(&model, &driver);
    std::fs::remove_dir_all(&run.dir).ok();
}

/// Two threads whose numbers share a slot of the kernel side's calls in flight, inside an RM_FREE
/// each at the same time (the first one's answered after 500 ms; the second starts once the
/// first is inside its call): the second keeps its call where the slot is taken, and each free is
/// recorded with its own params, by its own thread.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn two_threads_sharing_a_slot_of_calls_in_flight_each_keep_their_own() {
    let _root = as_root();
    let run = record("collide", "580.95.05", &["collide"]);
    assert_eq!(run.status, 0, "{}", run.stderr);
    let (records, model) = run.trace();
    let frees: Vec<(u32, u32, u32)> = records
        .iter()
        .filter_map(|r| match r.event {
            Event::Free { object, status, .. } => Some((r.tid, object, status)),
            _ => None,
        })
        .collect();
    // Which ends first is the fake driver's order of the two (the first may be preempted between
    // its call's entry and the driver's read of it): each is its own, whatever the order.
    let (slow, other): (Vec<_>, Vec<_>) = frees.iter().partition(|f| f.1 == fakegpu::driver::SLOW_FREE_HANDLE);
    let ([&(slow_tid, _, 0)], [&(tid, object, 0)]) = (&slow[..], &other[..]) else {
        panic!("the slow free and the buffer's, each with its status: {frees:?}\n{}", run.stderr)
    };
    assert_ne!(slow_tid, tid, "two threads: {frees:?}");
    assert_eq!(slow_tid % tracer_common::CALL_SLOTS, tid % tracer_common::CALL_SLOTS, "one slot: {frees:?}");
    let freed = model.allocations.iter().find(|a| a.object == object).expect("the buffer's allocation");
    assert!(freed.freed.is_some(), "the buffer freed: {freed:?}");
    check_frees_match(&model, &run.driver());
    let summary = run.summary();
    assert_eq!(summary["loss"]["lost_records"], 0);
    // One of the two calls waited in the map (the other took the slot): the slots' programs were
    // loaded, and the two calls were in flight at once.
    assert_eq!(summary["fd_filter"]["calls_in_map"], 1, "{}\n{frees:?}", run.stderr);
    std::fs::remove_dir_all(&run.dir).ok();
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_million_ioctls_on_other_fds_cost_one_question_each_and_no_events() {
    let _root = as_root();
    let run = record("storm", "580.95.05", &["storm", "--count", "1000000"]);
    assert_eq!(run.status, 0, "{}", run.stderr);
    let (records, _) = run.trace();
    let summary = run.summary();
    // The child uses 5 fds: /dev/null, two socket ends (inherited) and a dup of two of them.
    let questions = summary["fd_filter"]["questions"].as_u64().unwrap();
    assert!(questions <= 5, "at most one question per fd, got {questions}");
    assert!(questions >= 1, "the NVIDIA-looking commands on unknown fds are asked about");
    let driver_calls = records
        .iter()
        .filter(|r| {
            matches!(
                r.event,
                Event::Alloc(_)
                    | Event::Free { .. }
                    | Event::Undecodable { .. }
                    | Event::UvmMap { .. }
                    | Event::UvmFree { .. }
                    | Event::FdFound { .. }
            )
        })
        .count();
    assert_eq!(driver_calls, 0, "no ioctl events for non-NVIDIA fds");
    assert_eq!(summary["loss"]["lost_records"], 0);
    eprintln!("storm: {questions} questions, {} pending ioctls dropped", summary["fd_filter"]["pending_dropped"]);
    std::fs::remove_dir_all(&run.dir).ok();
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_failed_allocation_is_recorded_with_its_status() {
    let _root = as_root();
    let run = record("oom", "535.104.05", &["oom", "--bytes", "100GiB"]);
    assert_eq!(run.status, 1, "the workload reports the OOM: {}", run.stderr);
    let (records, model) = run.trace();
    assert_eq!(traced_allocs(&records), driver_allocs(&run.driver()));
    assert_eq!(model.failures.len(), 1);
    let f = &model.failures[0];
    assert_eq!((f.bytes, f.status, f.memory), (100 << 30, 0x51, Memory::Video));
    let summary = run.summary();
    let p = summary["processes"].as_array().unwrap().iter().find(|p| p["failed_allocations"] == 1).expect("the failing process");
    assert_eq!(p["exit_code"], 1);
    std::fs::remove_dir_all(&run.dir).ok();
}

/// No out-of-memory verdict for a command that failed for other reasons: `false`, a shell's
/// `exit 3`, and a server that exits 1 before touching the GPU (its port is taken), each recorded
/// on the fake GPU.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_command_that_fails_without_the_gpu_gets_no_oom_verdict() {
    let _root = as_root();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let server = [env!("CARGO_BIN_EXE_fake-server"), "--server", "vllm", "--port", &port];
    for (command, code) in [(&["false"][..], 1), (&["sh", "-c", "exit 3"][..], 3), (&server[..], 1)] {
        let dir = std::env::temp_dir().join(format!("gputrace-no-oom-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
            .args(["run", "--video", "80GiB", "--"])
            .arg(gputrace_bin())
            .args(["record", "--json", "-o"])
            .arg(dir.join("run.trace"))
            .arg("--")
            .args(command)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(code), "{command:?}: the command's status: {}", String::from_utf8_lossy(&out.stderr));
        let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{command:?}: {e}"));
        let d = &summary["diagnosis"];
        assert_eq!(d["category"], "none", "{command:?}: {d:#}");
        std::fs::remove_dir_all(&dir).ok();
    }
    drop(taken);
}

/// What is not memory counts nothing, and what is memory of another kind counts as that kind,
/// in the trace as in the driver's own log, across the versions where the layouts and the EGM
/// flag differ: LOCAL_PHYSICAL and RM_ALLOC_MEMORY's LOCAL_USER and LOCAL_PRIVILEGED (objects),
/// EGM (host memory), a multicast fabric object (address space, its params grown at 545), and
/// VID_HEAP_CONTROL's USE_EGM (EGM from 550 to 590, video memory elsewhere).
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn objects_count_nothing_and_egm_and_multicast_count_as_what_they_are() {
    let _root = as_root();
    for (version, egm_heap) in [("535.183.01", "video"), ("580.95.05", "system"), ("595.45.04", "video")] {
        let run = record(&format!("classes-{version}"), version, &["classes"]);
        assert_eq!(run.status, 0, "{version}: {}", run.stderr);
        let (records, _) = run.trace();
        let driver = run.driver();
        let traced = traced_allocs(&records);
        assert_eq!(traced, driver_allocs(&driver), "{version}: allocations (pid, kind, bytes, status)");
        let sized = |bytes: u64| traced.iter().filter(|a| a.2 == bytes).map(|a| a.1.as_str()).collect::<Vec<_>>();
        assert_eq!(sized(1 << 30), ["system"], "{version}: EGM is host memory");
        assert_eq!(sized(2 << 30), ["virtual"], "{version}: a multicast object is address space");
        assert_eq!(sized(512 << 20), [egm_heap], "{version}: VID_HEAP_CONTROL with USE_EGM");
        assert!(sized(80 << 30).is_empty() && sized(4 << 30).is_empty() && sized(0).is_empty(), "{version}: objects counted: {traced:?}");
        std::fs::remove_dir_all(&run.dir).ok();
    }
}

/// cuMemRelease while mapped: the driver keeps the memory until the UVM range goes, and so does
/// gputrace (freed `unmapped`, at the unmap, not at the handle's free).
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn memory_released_while_mapped_lives_until_unmapped() {
    let _root = as_root();
    let run = record("vmm", "580.95.05", &["vmm", "--ms", "300"]);
    assert_eq!(run.status, 0, "{}", run.stderr);
    let (_, model) = run.trace();
    let driver = run.driver();
    check_frees_match(&model, &driver);
    let segment = model.allocations.iter().find(|a| a.bytes == 4 << 30).expect("the 4 GiB segment");
    let (freed_at, how) = segment.freed.expect("freed by the unmap");
    assert_eq!(how, FreedBy::Unmapped);
    let workload: Vec<serde_json::Value> = read_lines(&run.dir.join("workload.jsonl")).unwrap();
    let released = workload.iter().find(|w| w["op"] == "release_mapped").unwrap()["ts"].as_u64().unwrap();
    assert!(
        freed_at >= released + 250_000_000,
        "live for the 300 ms it stayed mapped: freed {} ms after its release",
        (freed_at - released) / 1_000_000
    );
    let range_freed = workload.iter().find(|w| w["op"] == "free_range").unwrap()["ts"].as_u64().unwrap();
    assert!(freed_at < range_freed, "freed by the unmap (cuMemUnmap), before its address range went");
    // Shown as released (its handle freed) at cuMemRelease, still mapped until the unmap.
    let released_at = segment.released.expect("released while mapped");
    assert!(released_at <= released && released - released_at < 100_000_000, "released at cuMemRelease: {released_at} vs {released}");
    std::fs::remove_dir_all(&run.dir).ok();
}

/// Memory attached to a flexible fabric object, or to a multicast one at its GPU, and released
/// while attached: before 570 the driver holds it (a dup) until DETACH_MEM, from 570 it goes with
/// its handle; the trace agrees with the fake driver's ground truth on all four.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn memory_attached_to_a_fabric_object_lives_until_detached_before_570() {
    let cases = [("550.54.14", true), ("580.95.05", false)];
    for ((version, held), kind) in cases.into_iter().flat_map(|c| [(c, "flexible"), (c, "multicast")]) {
        let args: &[&str] = if kind == "multicast" { &["fabric", "--ms", "300", "--multicast"] } else { &["fabric", "--ms", "300"] };
        let run = record(&format!("fabric-{kind}-{version}"), version, args);
        assert_eq!(run.status, 0, "{}", run.stderr);
        let (_, model) = run.trace();
        check_frees_match(&model, &run.driver());
        let memory = model.allocations.iter().find(|a| a.bytes == 2 << 30 && a.memory == Memory::Video).expect("the 2 GiB");
        let (freed_at, how) = memory.freed.expect("freed");
        let workload: Vec<serde_json::Value> = read_lines(&run.dir.join("workload.jsonl")).unwrap();
        let at = |op: &str| workload.iter().find(|w| w["op"] == op).unwrap()["ts"].as_u64().unwrap();
        if held {
            assert_eq!(how, FreedBy::Detached, "{kind} {version}");
            assert!(freed_at >= at("release_attached") + 250_000_000 && freed_at <= at("detach"), "{kind} {version}: freed at the detach");
        } else {
            assert_eq!(how, FreedBy::Explicit, "{kind} {version}");
            assert!(freed_at <= at("release_attached"), "{kind} {version}: freed with its handle");
        }
        std::fs::remove_dir_all(&run.dir).ok();
    }
}

/// CUDA IPC through a file descriptor: the exporter frees its handle and exits, the importer
/// frees its own handle, and the memory lives on until the importer closes the export file it
/// received over a socket, as the driver's does (freed with that file's release); with the single
/// controls and with the batched ones current libcuda issues, and with the export file closed by
/// the exporter as soon as it is sent (in flight over the socket at that close, the last seen).
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn memory_exported_to_a_file_lives_until_the_files_last_close() {
    for (batched, in_flight) in [(false, false), (true, false), (true, true)] {
        let (shared, at) = exported_memory(false, batched, in_flight);
        freed_at_the_export_files_close(&shared, &at);
    }
}

fn freed_at_the_export_files_close(shared: &gputrace::model::Allocation, at: &impl Fn(&str) -> u64) {
    let (freed_at, how) = shared.freed.expect("freed when the export file went");
    assert_eq!(how, FreedBy::FileRelease);
    assert!(
        freed_at > at("free_import") && freed_at >= at("close_share").saturating_sub(50_000_000),
        "freed at the close of the export file ({} ms after the importer freed its handle), not at a handle's free",
        (freed_at - at("free_import")) / 1_000_000
    );
}

/// The same, with the importer closing the export file at once (microseconds after the import,
/// before a recorder has read the import's record): that close is seen, so the memory goes with
/// the importer's handle, not with the importer's exit (batched controls).
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn an_export_file_closed_right_after_its_import_is_seen_closed() {
    let (shared, at) = exported_memory(true, true, false);
    let (freed_at, how) = shared.freed.expect("freed with the importer's handle");
    assert_ne!(how, FreedBy::FileRelease, "the export file was closed 300 ms before the handle's free");
    assert!(
        freed_at >= at("free_import").saturating_sub(50_000_000) && freed_at < at("free_import") + 50_000_000,
        "freed at the importer's free of its handle, {} ms away",
        (freed_at as i64 - at("free_import") as i64) / 1_000_000
    );
}

/// Runs `fake-workload ipc` under the recorder and checks what both ways share; returns the
/// exported allocation and the importer's ground truth (the time of each of its steps).
fn exported_memory(close_first: bool, batched: bool, in_flight: bool) -> (gputrace::model::Allocation, impl Fn(&str) -> u64) {
    let _root = as_root();
    let mut args = vec!["ipc", "--ms", "300"];
    args.extend(close_first.then_some("--close-first"));
    args.extend(batched.then_some("--batched"));
    args.extend(in_flight.then_some("--in-flight"));
    let run = record_then_wait("ipc", "580.95.05", &args, Some("1.2"));
    assert_eq!(run.status, 0, "{}", run.stderr);
    let (records, model) = run.trace();
    let driver = run.driver();
    assert_eq!(traced_allocs(&records), driver_allocs(&driver));
    let shared = model.allocations.iter().find(|a| a.bytes == 3 << 30).expect("the 3 GiB exported").clone();
    let imported = records.iter().any(|r| {
        r.pid != shared.pid
            && match &r.event {
                Event::ImportObject { status: 0, .. } => !batched,
                Event::ImportObjects { status: 0, objects, .. } => batched && objects.len() == 1 && objects[0] != 0,
                _ => false,
            }
    });
    assert!(imported, "the importer's RM_CONTROL is recorded (batched: {batched})");
    // The importer received the export file with MSG_CMSG_CLOEXEC and met it only in the import:
    // the kernel read its flag there.
    let from = records.iter().find_map(|r| match r.event {
        Event::ImportObject { from_fd, status: 0, .. } | Event::ImportObjects { from_fd, status: 0, .. } => Some((r.pid, from_fd)),
        _ => None,
    });
    let (importer, from_fd) = from.expect("the import");
    assert!(
        records.iter().any(|r| r.pid == importer && r.event == Event::SetCloexec { fd: from_fd, cloexec: true }),
        "the export file the importer received is close-on-exec"
    );
    let exported = records.iter().any(|r| {
        r.pid == shared.pid
            && match &r.event {
                Event::ExportObject { status: 0, .. } => !batched,
                Event::ExportObjects { status: 0, objects, .. } => batched && objects.len() == 1,
                _ => false,
            }
    });
    assert!(exported, "the exporter's RM_CONTROL is recorded (batched: {batched})");
    let importer: Vec<serde_json::Value> = read_lines(&run.dir.join("workload.jsonl.receiver")).unwrap();
    let at = move |op: &str| {
        importer.iter().find(|w| w["op"] == op).unwrap_or_else(|| panic!("no {op} in {importer:?}"))["ts"].as_u64().unwrap()
    };
    let (freed_at, _) = shared.freed.expect("the exported memory is freed");
    assert!(model.processes[&shared.pid].exited.unwrap() < at("free_import"), "the exporter was gone long before");
    assert!(freed_at < model.processes.values().filter_map(|p| p.exited).max().unwrap(), "freed before the importer's exit");
    check_frees_match(&model, &driver);
    std::fs::remove_dir_all(&run.dir).ok();
    (shared, at)
}

/// A cgroup as a container runtime names it (`docker-<64 hex>.scope`), in the pids hierarchy of
/// cgroup v1 or in cgroup v2; returns its cgroup.procs.
fn container_cgroup(id: &str) -> std::path::PathBuf {
    for root in ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"] {
        let parent = std::path::Path::new(root).join(format!("gputrace-test-{}", std::process::id()));
        let dir = parent.join(format!("docker-{id}.scope"));
        if std::fs::create_dir_all(&dir).is_ok() && dir.join("cgroup.procs").exists() {
            return dir.join("cgroup.procs");
        }
        let _ = std::fs::remove_dir(&dir);
        let _ = std::fs::remove_dir(&parent);
    }
    panic!("no cgroup could be made under /sys/fs/cgroup (v1 pids or v2)");
}

/// A command that joins a container's cgroup and starts a child in a pid namespace of its own:
/// the trace says the container and the child's pid inside it.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn processes_in_a_container_show_its_id_and_their_pid_inside() {
    let _root = as_root();
    let dir = std::env::temp_dir().join(format!("gputrace-container-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("run.trace");
    let id = format!("{:0>64x}", 0xc0ffee_u64 + u64::from(std::process::id()));
    let procs = container_cgroup(&id);
    let script = format!("echo $$ > {} && exec unshare --pid --fork sh -c 'sleep 0.1; true'", procs.display());
    let out = Command::new(gputrace_bin()).args(["record", "-o", trace.to_str().unwrap(), "--", "sh", "-c", &script]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (_, records, _) = Reader::read_all(&trace).unwrap();
    let places: Vec<&gputrace::event::Place> = records
        .iter()
        .filter_map(|r| match &r.event {
            Event::Place(p) => Some(p),
            _ => None,
        })
        .collect();
    assert!(places.iter().any(|p| p.container.as_deref() == Some(&id[..12])), "the container's id: {places:?}");
    assert!(places.iter().any(|p| p.ns_pid == Some(1) && p.container.as_deref() == Some(&id[..12])), "pid 1 in its namespace: {places:?}");
    let cgroup = procs.parent().unwrap();
    let _ = std::fs::remove_dir(cgroup);
    let _ = std::fs::remove_dir(cgroup.parent().unwrap());
    std::fs::remove_dir_all(&dir).ok();
}
