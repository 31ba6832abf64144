use super::accounts::Accounts;
use super::diagnosis::diagnose;
use super::headroom::{Bound, Limit};
use super::services::Services;
use super::*;
use crate::event::{Alloc, Device, Event, Record, Seen, Via};
use crate::model::Model;
use crate::report::headroom::{limit, line};
use crate::report::verdict::{verdicts, Verdict};
use crate::report::whatif::outcome;
use crate::trace::{Gpu, Header, HolderAtStart, PriorUse};

mod kept;

const GIB: u64 = 1 << 30;
const API: u32 = 100;
const ENGINE: u32 = 101;
const MS: u64 = 1_000_000;

pub(crate) fn header(capacity: u64, prior: &[(u32, u64)]) -> Header {
    Header {
        gpus: vec![Gpu { index: 0, name: "test".into(), total_bytes: Some(capacity), used_bytes: None }],
        prior_use: prior
            .iter()
            .map(|&(pid, bytes)| PriorUse { pid, gpu: 0, used_bytes: Some(bytes), command: vec!["old-server".into()] })
            .collect(),
        holders_at_start: prior
            .iter()
            .map(|&(pid, _)| HolderAtStart { pid, ppid: 1, command: vec!["old-server".into()], devices: vec!["ctl".into()], exe: None })
            .collect(),
        nvml: "ok".into(),
        ..Header::default()
    }
}

/// A vLLM-like trace: an API server and its engine; the engine allocates `weights` during load,
/// then the API server listens at 100 ms.
#[derive(Clone)]
pub(crate) struct Trace(pub(crate) Vec<Record>, u32);

impl Trace {
    fn vllm(weights: u64) -> Trace {
        let mut t = Trace(vec![], 0x10);
        t.at(
            0,
            API,
            Event::Process {
                ppid: 1,
                seen: Seen::Launched,
                command: vec!["vllm".into(), "serve".into(), "--gpu-memory-utilization".into(), "0.9".into()],
            },
        );
        t.at(1, API, Event::Bind { fd: 3, port: 8000 });
        t.at(2, ENGINE, Event::Process { ppid: API, seen: Seen::Forked, command: vec!["vllm".into(), "engine".into()] });
        t.alloc(10, ENGINE, weights, 0);
        t.at(100 * MS, API, Event::Listen { fd: 3 });
        t
    }
    fn at(&mut self, ts: u64, pid: u32, event: Event) -> &mut Self {
        self.0.push(Record::new(ts, pid, pid, event));
        self
    }
    fn alloc(&mut self, ts: u64, pid: u32, bytes: u64, status: u32) -> &mut Self {
        self.alloc_in(ts, pid, 1, bytes, status)
    }
    /// An allocation in `client`, under its device (the handle client + 0x100).
    fn alloc_in(&mut self, ts: u64, pid: u32, client: u32, bytes: u64, status: u32) -> &mut Self {
        self.1 += 1;
        let a = Alloc { status, ..Alloc::video(client, client + 0x100, self.1, bytes) };
        self.at(ts, pid, Event::Alloc(a))
    }
    /// A completion request on connection `conn`: arrives at `ts`, headers at once, data at `data`.
    fn request(&mut self, conn: u64, ts: u64, bytes: u64, data: Option<u64>) -> &mut Self {
        self.at(ts, API, Event::Accept { fd: conn as i32, conn });
        self.at(ts, API, Event::Received { conn, bytes, request: Some("POST /v1/completions".into()) });
        self.at(ts + 1, API, Event::Sent { conn, bytes: 90, status: Some(200), data: false });
        if let Some(d) = data {
            self.at(d, API, Event::Sent { conn, bytes: 40, status: None, data: true });
        }
        self
    }
    fn diagnose(&mut self, capacity: u64, prior: &[(u32, u64)], lost: u64) -> Vec<Verdict> {
        verdicts(&self.diagnoses(capacity, prior, lost))
    }
    /// The same, typed: what the preconditions are checked on.
    fn diagnoses(&mut self, capacity: u64, prior: &[(u32, u64)], lost: u64) -> Vec<diagnosis::Diagnosis> {
        self.0.sort_by_key(|r| r.ts);
        let model = Model::from_records(&self.0);
        diagnose(&Accounts::new(&header(capacity, prior), &model), lost).list
    }
}

/// Every failure of a trace, in words.
fn diagnosed(header: &Header, model: &Model, lost: u64) -> Vec<Verdict> {
    verdicts(&diagnose(&Accounts::new(header, model), lost).list)
}

/// Seen by a watch, `gputrace record -- vllm serve` is vLLM's parent: a wrapper, not the service.
#[test]
fn a_recording_that_wraps_a_server_is_not_its_service() {
    let mut t = Trace::vllm(16 * GIB);
    let wrapper = vec!["/usr/bin/gputrace".to_string(), "record".into(), "--".into(), "vllm".into()];
    t.0.insert(0, Record::new(0, 4000, 4000, Event::Process { ppid: 1, seen: Seen::Running, command: wrapper }));
    for r in &mut t.0 {
        if let Event::Process { ppid, seen, .. } = &mut r.event {
            if r.pid == API {
                (*ppid, *seen) = (4000, Seen::Forked);
            }
        }
    }
    let m = Model::from_records(&t.0);
    assert_eq!(m.processes[&API].ppid, 4000, "vLLM runs under the wrapper");
    let services = Services::new(&m);
    assert_eq!(services.of(ENGINE).map(|s| s.root), Some(API), "the service is vLLM's, under its wrapper");
}

#[test]
fn phases_for_both_server_families() {
    let mut t = Trace::vllm(16 * GIB);
    t.request(7, 200 * MS, 4000, Some(260 * MS));
    t.at(300 * MS, API, Event::ConnClose { conn: 7 });
    t.0.sort_by_key(|r| r.ts);
    let m = Model::from_records(&t.0);
    let services = Services::new(&m);
    assert_eq!(services.list.len(), 1, "the engine belongs to its API server's service");
    let s = services.of(ENGINE).unwrap();
    assert_eq!(s.ready_at, Some(100 * MS), "vLLM: ready when it listens, after loading");
    let phase = |ms: u64| services.phase(s, ms * MS);
    assert_eq!(
        [phase(50), phase(150), phase(210), phase(280), phase(310)],
        [Phase::Load, Phase::Idle, Phase::Prefill, Phase::Decode, Phase::Idle]
    );

    // llama-server: listens first, 503 while loading, ready at its first 2xx.
    let mut t = Trace(vec![], 0);
    t.at(0, API, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["llama-server".into()] });
    t.at(1, API, Event::Listen { fd: 3 });
    t.alloc(10 * MS, API, 8 * GIB, 0);
    t.at(20 * MS, API, Event::Accept { fd: 5, conn: 5 });
    t.at(20 * MS, API, Event::Received { conn: 5, bytes: 60, request: Some("GET /health".into()) });
    t.at(21 * MS, API, Event::Sent { conn: 5, bytes: 90, status: Some(503), data: false });
    t.at(80 * MS, API, Event::Accept { fd: 6, conn: 6 });
    t.at(80 * MS, API, Event::Received { conn: 6, bytes: 60, request: Some("GET /health".into()) });
    t.at(81 * MS, API, Event::Sent { conn: 6, bytes: 90, status: Some(200), data: false });
    let m = Model::from_records(&t.0);
    let services = Services::new(&m);
    assert_eq!(services.of(API).unwrap().ready_at, Some(81 * MS));
}

#[test]
fn explicit_marks_override_inference() {
    let mut t = Trace::vllm(16 * GIB);
    t.at(150 * MS, API, Event::Mark { phase: "load".into() });
    t.at(170 * MS, API, Event::Mark { phase: "no-such-phase".into() });
    t.0.sort_by_key(|r| r.ts);
    let m = Model::from_records(&t.0);
    let services = Services::new(&m);
    let s = services.of(ENGINE).unwrap();
    assert_eq!(services.phase(s, 120 * MS), Phase::Idle, "inferred before the mark");
    assert_eq!(services.phase(s, 160 * MS), Phase::Load, "marked");
    assert_eq!(services.phase(s, 180 * MS), Phase::Load, "a mark naming no phase is ignored: the last one holds");
}

#[test]
fn nothing_failed_is_none() {
    let mut t = Trace::vllm(16 * GIB);
    let d = t.diagnose(80 * GIB, &[], 0);
    assert_eq!((d.len(), d[0].category, d[0].symptom), (1, Category::None, Symptom::None));
}

#[test]
fn one_request_in_flight_is_a_long_request() {
    let mut t = Trace::vllm(16 * GIB);
    t.request(7, 200 * MS, 4_000, Some(230 * MS));
    t.at(250 * MS, API, Event::ConnClose { conn: 7 });
    t.request(8, 300 * MS, 160_000, None);
    t.alloc(310 * MS, ENGINE, 70 * GIB, 0x51);
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!((d.category, d.symptom, d.pid), (Category::LongRequest, Symptom::FailedAllocation, Some(ENGINE)));
    assert_eq!(d.evidence.fields["requests_in_flight"], 1);
    assert_eq!(d.evidence.fields["phase"], "prefill");
    assert_eq!(d.fix.fields["largest_served_request_bytes"], 4_000);
    assert!(d.fix.text.contains("--max-model-len"), "{}", d.fix.text);
}

#[test]
fn a_long_request_among_small_ones_is_still_a_long_request() {
    let mut t = Trace::vllm(16 * GIB);
    t.request(7, 200 * MS, 4_000, None);
    t.request(8, 201 * MS, 200_000, None);
    t.alloc(210 * MS, ENGINE, 70 * GIB, 0x51);
    assert_eq!(t.diagnose(80 * GIB, &[], 0)[0].category, Category::LongRequest);
}

/// vLLM with `weights` loaded serves one request of 8,000 bytes, then `n` alike arrive together
/// and an allocation of `failed` fails.
fn burst(weights: u64, n: u64, failed: u64) -> Trace {
    let mut t = Trace::vllm(weights);
    t.request(6, 150 * MS, 8_000, Some(180 * MS));
    t.at(190 * MS, API, Event::ConnClose { conn: 6 });
    for conn in 7..7 + n {
        t.request(conn, 200 * MS, 8_000, None);
    }
    t.alloc(210 * MS, ENGINE, failed, 0x51);
    t
}

#[test]
fn several_alike_in_flight_is_concurrent_load() {
    let mut t = burst(60 * GIB, 8, 24 * GIB);
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!(d.category, Category::ConcurrentLoad);
    assert_eq!(d.evidence.fields["requests_in_flight"], 8);
    let cap = d.fix.fields["max_concurrency"].as_u64().unwrap();
    assert!((1..8).contains(&cap), "a cap below what failed: {cap}");
    assert!(d.fix.text.contains("--max-num-seqs") && d.fix.text.contains("max_parallel_requests"), "{}", d.fix.text);
    assert_eq!(d.fix.fields["cap_estimated"], false, "traced from its start");
    // Met after it loaded (NVML's 4 GiB for the engine from before tracing), no request
    // measured alone since: the cap is the batch's share, and said to be an estimate.
    let d = &t.diagnose(80 * GIB, &[(ENGINE, 4 * GIB)], 0)[0];
    assert_eq!(d.category, Category::ConcurrentLoad);
    assert_eq!(d.fix.fields["cap_estimated"], true);
    assert!(d.fix.text.contains("This cap is an estimate"), "{}", d.fix.text);
}

/// Several in flight, but the allocation that failed asked less than was free by the trace's
/// account: by the batch's own cost every request fitted, so a cap below them would contradict
/// the figures it prints. Inconclusive, saying which precondition failed and on what.
#[test]
fn a_concurrent_load_that_all_fitted_by_its_own_figures_is_inconclusive() {
    let mut t = burst(16 * GIB, 4, 4 * GIB);
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!(d.category, Category::Inconclusive, "{}", d.evidence.text);
    assert!(
        d.evidence.text.contains("concurrent-load needs more in flight than fit together") && d.evidence.text.contains("all 4 fit"),
        "{}",
        d.evidence.text
    );
    assert!(!d.fix.text.contains("--max-num-seqs") && !d.fix.text.contains("Record again"), "{}", d.fix.text);
    let typed = &t.diagnoses(80 * GIB, &[], 0)[0];
    let diagnosis::Finding::Undecided { why: diagnosis::Undecided::Unmet { category, unmet }, .. } = &typed.finding else {
        panic!("{typed:?}")
    };
    assert_eq!(*category, Category::ConcurrentLoad);
    assert!(matches!(unmet, diagnosis::preconditions::Unmet::AllFit { in_flight: 4, .. }), "{unmet:?}");
}

#[test]
fn a_failure_during_graph_capture_is_at_load() {
    let mut t = Trace::vllm(16 * GIB);
    t.alloc(20 * MS, ENGINE, 54 * GIB, 0);
    // Graph capture: medium allocations after the KV cache, still before listening.
    t.alloc(60 * MS, ENGINE, 12 * GIB, 0x51);
    t.0.retain(|r| !matches!(r.event, Event::Listen { .. }));
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!((d.category, d.evidence.fields["phase"].as_str()), (Category::DoesNotFitAtLoad, Some("load")));
    assert!(d.fix.text.contains("FP16") && d.fix.text.contains("4-bit"), "{}", d.fix.text);
}

/// A stale holder and a long request: what is held outside covers the shortfall, so killing the
/// holder is the first fix, as a careful engineer would check it first.
#[test]
fn a_stale_holder_comes_before_a_long_request() {
    let mut t = Trace::vllm(30 * GIB);
    t.request(7, 200 * MS, 200_000, None);
    t.alloc(210 * MS, ENGINE, 12 * GIB, 0x51);
    let d = &t.diagnose(80 * GIB, &[(4242, 40 * GIB)], 0)[0];
    assert_eq!(d.category, Category::HeldByOtherProcess);
    assert_eq!(d.fix.fields["kill"], 4242);
    assert!(d.fix.text.contains("kill 4242"), "{}", d.fix.text);
    // Without the holder it is the long request.
    assert_eq!(t.diagnose(80 * GIB, &[], 0)[0].category, Category::LongRequest);
}

/// Forty other services hold memory when the server fails: the evidence lists the biggest 16 (in
/// the order found) and counts the rest, whose memory is still in what is held outside; the fix
/// stops the biggest. (Every failure listed every service: thousands of `sleep`s a user forked
/// made a report of tens of megabytes.)
#[test]
fn the_biggest_holders_outside_are_listed_and_the_rest_counted() {
    let mut t = Trace::vllm(30 * GIB);
    for i in 0..40u32 {
        let pid = 1000 + i;
        t.at(MS, pid, Event::Process { ppid: 1, seen: Seen::Launched, command: vec![format!("job{i}")] });
        t.alloc_in(2 * MS, pid, 10 + i, u64::from(i % 20 + 1) * (GIB / 4), 0);
    }
    t.alloc(210 * MS, ENGINE, 12 * GIB, 0x51);
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!(d.category, Category::HeldByOtherProcess, "{}", d.evidence.text);
    let listed: Vec<u64> = d.evidence.fields["holders_outside"].as_array().unwrap().iter().map(|h| h["pid"].as_u64().unwrap()).collect();
    // Sizes 1 to 20 quarters of a GiB, twice over: the 16 biggest are 13 to 20 of each round.
    let biggest: Vec<u64> = (0..40).filter(|i| i % 20 >= 12).map(|i| 1000 + i).collect();
    assert_eq!(listed, biggest);
    assert_eq!(d.evidence.fields["holders_not_listed"], 24);
    assert_eq!(d.evidence.fields["held_outside_bytes"], 2 * (1..=20).sum::<u64>() * (GIB / 4));
    assert_eq!(d.fix.fields["kill"], 1039, "the biggest, the last found of two as big");
    // A few holders: all listed, none counted apart.
    let mut t = Trace::vllm(30 * GIB);
    t.alloc(210 * MS, ENGINE, 12 * GIB, 0x51);
    let d = &t.diagnose(80 * GIB, &[(4242, 40 * GIB)], 0)[0];
    assert_eq!(d.evidence.fields["holders_outside"].as_array().unwrap().len(), 1);
    assert!(d.evidence.fields.get("holders_not_listed").is_none());
}

#[test]
fn a_refusal_at_start_explained_by_another_holder() {
    let mut t = Trace(vec![], 0);
    t.at(0, API, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["vllm".into()] });
    // vLLM initialises CUDA (opens the device files) before it checks what is free.
    t.at(MS, API, Event::Open { fd: 3, file: 1, device: Device::Ctl, cloexec: false });
    t.at(5 * MS, API, Event::Exit { code: Some(1) });
    let d = &t.diagnose(80 * GIB, &[(4242, 71 * GIB)], 0)[0];
    assert_eq!((d.category, d.symptom), (Category::HeldByOtherProcess, Symptom::StartupRefusal));
    assert_eq!(d.evidence.fields["held_outside_bytes"], 71 * GIB);
}

/// `gputrace record -- false`, or a server that dies of a bad flag before touching the GPU: no
/// out-of-memory verdict, whatever else held memory.
#[test]
fn an_exit_that_never_touched_the_gpu_is_no_oom() {
    for code in [1, 3, 139] {
        let mut t = Trace(vec![], 0);
        t.at(0, API, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["false".into()] });
        t.at(5 * MS, API, Event::Exit { code: Some(code) });
        let d = &t.diagnose(80 * GIB, &[(4242, 71 * GIB)], 0)[0];
        assert_eq!((d.category, d.symptom), (Category::None, Symptom::None), "exit {code}");
    }
}

/// A server that opened the GPU, allocated a little and exited during load with the card nearly
/// empty (a bad flag, a missing file): inconclusive, saying why, not does-not-fit-at-load. The
/// same exit with the card nearly full is.
#[test]
fn a_startup_exit_needs_memory_running_short_to_be_an_oom() {
    let refusal = |weights: u64| {
        let mut t = Trace::vllm(weights);
        t.0.retain(|r| !matches!(r.event, Event::Listen { .. }));
        t.at(50 * MS, API, Event::Exit { code: Some(1) });
        t.diagnose(80 * GIB, &[], 0).remove(0)
    };
    let d = refusal(2 * GIB);
    assert_eq!((d.category, d.symptom), (Category::Inconclusive, Symptom::StartupRefusal), "{}", d.evidence.text);
    assert!(d.evidence.text.contains("nothing the driver saw points at memory"), "{}", d.evidence.text);
    let d = refusal(75 * GIB);
    assert_eq!(d.category, Category::DoesNotFitAtLoad, "{}", d.evidence.text);
}

/// Recorded with no NVML after an orphan set up its hold: the orphan, seen holding the device
/// files, is the suspect of a load failure, its size unknown; the model is not blamed.
#[test]
fn without_nvml_a_holder_from_before_is_the_suspect() {
    let mut t = Trace::vllm(12 * GIB);
    t.alloc(20 * MS, ENGINE, 4 * GIB, 0x51);
    t.0.retain(|r| !matches!(r.event, Event::Listen { .. }));
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let mut h = header(24 * GIB, &[(4242, 14 * GIB)]);
    (h.gpus, h.prior_use, h.nvml) = (vec![], vec![], "NVML unavailable (no library)".into());
    let program = |path: &str, system| Some(crate::procfs::command::Executable { path: path.into(), dev: 1, ino: 2, system });
    let persistenced = HolderAtStart {
        pid: 90,
        ppid: 1,
        command: vec!["nvidia-persistenced".into()],
        devices: vec!["ctl".into()],
        exe: program("/usr/bin/nvidia-persistenced", true),
    };
    h.holders_at_start.push(persistenced.clone());
    let d = diagnosed(&h, &model, 0).remove(0);
    assert_eq!(d.category, Category::HeldByOtherProcess, "{}", d.evidence.text);
    assert_eq!(d.fix.fields["kill"], 4242, "the orphan, never the benign daemon");
    assert!(d.fix.text.contains("how much it holds is unknown"), "{}", d.fix.text);
    assert_eq!(d.evidence.fields["holders_outside"].as_array().unwrap().len(), 1);
    // Named so by argv[0] only (`exec -a`), or a copy of the daemon in a user's directory: not
    // benign, a suspect like any other.
    for exe in [program("/usr/bin/sleep", true), program("/home/mallory/nvidia-persistenced", false), None] {
        h.holders_at_start.retain(|x| x.pid != 90);
        h.holders_at_start.push(HolderAtStart { exe, ..persistenced.clone() });
        let d = diagnosed(&h, &model, 0).remove(0);
        assert_eq!(d.evidence.fields["holders_outside"].as_array().unwrap().len(), 2, "{}", d.evidence.text);
    }
}

#[test]
fn a_lossy_trace_is_inconclusive_and_says_why() {
    let mut t = Trace::vllm(16 * GIB);
    t.request(7, 200 * MS, 4_000, None);
    t.alloc(210 * MS, ENGINE, 70 * GIB, 0x51);
    let d = &t.diagnose(80 * GIB, &[], 3)[0];
    assert_eq!(d.category, Category::Inconclusive);
    assert!(d.evidence.text.contains("3 kernel records were lost"), "{}", d.evidence.text);
}

#[test]
fn the_oom_killer_is_host_oom() {
    let mut t = Trace::vllm(16 * GIB);
    t.at(50 * MS, ENGINE, Event::OomKill);
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!((d.category, d.symptom, d.pid), (Category::HostOom, Symptom::OomKill, Some(ENGINE)));
}

/// A server that dies of a signal with no failed allocation (PyTorch can raise out-of-memory
/// under a memory fraction with no failed driver call): the symptom is a crash, and the cause is
/// judged by the same rules, here one request in flight.
#[test]
fn a_crash_without_a_failed_allocation() {
    let mut t = Trace::vllm(16 * GIB);
    t.request(7, 200 * MS, 200_000, None);
    t.at(220 * MS, API, Event::Exit { code: Some(134) });
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!((d.symptom, d.category, d.pid), (Symptom::Crash, Category::LongRequest, Some(API)));
    // A segfault with most of the card free is no OOM of any kind: inconclusive, its log decides.
    let mut t = Trace::vllm(16 * GIB);
    t.request(7, 200 * MS, 200_000, None);
    t.at(220 * MS, API, Event::Exit { code: Some(139) });
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!((d.symptom, d.category), (Symptom::Crash, Category::Inconclusive), "{}", d.evidence.text);
    assert!(d.fix.text.contains("server's own log"), "{}", d.fix.text);
    // Stopped by Ctrl-C, SIGTERM or kill -9 is no failure at all (the OOM killer's SIGKILL comes
    // with its own record).
    for code in [130, 137, 143] {
        let mut t = Trace::vllm(16 * GIB);
        t.at(220 * MS, API, Event::Exit { code: Some(code) });
        assert_eq!(t.diagnose(80 * GIB, &[], 0)[0].category, Category::None, "exit {code}");
    }
}

/// Reports print `name()`, scripts read the JSON: the two never differ.
#[test]
fn category_and_symptom_names_are_their_json_names() {
    let categories = [
        Category::HeldByOtherProcess,
        Category::DoesNotFitAtLoad,
        Category::LongRequest,
        Category::ConcurrentLoad,
        Category::HostOom,
        Category::None,
        Category::Inconclusive,
    ];
    for c in categories {
        assert_eq!(serde_json::to_value(c).unwrap(), c.name());
    }
    for s in [Symptom::FailedAllocation, Symptom::StartupRefusal, Symptom::OomKill, Symptom::Crash, Symptom::None] {
        assert_eq!(serde_json::to_value(s).unwrap(), s.name());
    }
}

/// A tensor-parallel vLLM: the engine's two workers each load `shard` onto their own GPU (0: 80
/// GiB, 1: 48 GiB); another server holds `other` on GPU 0 and NVML saw 2 GiB held on GPU 1 before
/// recording. Then `failing_pid` fails to allocate `bytes`; the diagnosis of it.
fn tensor_parallel(shard: u64, other: u64, failing_pid: u32, bytes: u64) -> Verdict {
    const OTHER: u32 = 300;
    let mut t = Trace::vllm(0);
    t.0.retain(|r| !matches!(r.event, Event::Alloc(_)));
    t.at(
        0,
        API,
        Event::Process {
            ppid: 1,
            seen: Seen::Launched,
            command: "vllm serve m --tensor-parallel-size 2".split(' ').map(String::from).collect(),
        },
    );
    t.0.remove(0);
    t.at(1, OTHER, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["other-server".into()] });
    let worker = |t: &mut Trace, pid: u32, gpu: u32, ts: u64| {
        let client = 0xc1d0_0000 + pid;
        t.at(ts, pid, Event::Object { fd: 3, client, parent: client, object: client, class: 0x41, status: 0, gpu: None });
        t.at(ts, pid, Event::Object { fd: 3, client, parent: client, object: client + 0x100, class: 0x80, status: 0, gpu: Some(gpu) });
        client
    };
    for (pid, gpu) in [(110, 0), (111, 1)] {
        t.at(3, pid, Event::Process { ppid: ENGINE, seen: Seen::Forked, command: vec!["VllmWorker".into(), format!("rank{gpu}")] });
        let client = worker(&mut t, pid, gpu, 4);
        t.alloc_in(10 + u64::from(gpu), pid, client, shard, 0);
    }
    let client = worker(&mut t, OTHER, 0, 5);
    t.alloc_in(12, OTHER, client, other, 0);
    t.alloc_in(50 * MS, failing_pid, 0xc1d0_0000 + failing_pid, bytes, 0x51);
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let mut h = header(80 * GIB, &[]);
    h.gpus.push(Gpu { index: 1, name: "smaller".into(), total_bytes: Some(48 * GIB), used_bytes: None });
    h.prior_use.push(PriorUse { pid: 400, gpu: 1, used_bytes: Some(2 * GIB), command: vec!["gone".into()] });
    diagnosed(&h, &model, 0).remove(0)
}

#[test]
fn a_tensor_parallel_rank_is_judged_on_its_own_gpu() {
    // Rank 1 fills its 48 GiB card: 40 GiB loaded, 2 GiB held before, 10 GiB asked: freeing the
    // 2 GiB would not make room. GPU 0's other server (30 GiB) is beside the point: judged against
    // GPU 0's capacity, or all GPUs together, it would be blamed.
    let d = tensor_parallel(40 * GIB, 30 * GIB, 111, 10 * GIB);
    let f = &d.evidence.fields;
    assert_eq!((d.category, d.gpu), (Category::DoesNotFitAtLoad, Some(1)), "{}", d.evidence.text);
    assert_eq!(f["capacity_bytes"], 48 * GIB);
    assert_eq!(f["service_bytes"], 40 * GIB, "only what the service holds on GPU 1");
    assert_eq!(f["held_outside_bytes"], 2 * GIB, "NVML's figure for GPU 1, not the other server on GPU 0");
    assert_eq!(f["service_gpus"], serde_json::json!([0, 1]));
    assert!(d.evidence.text.contains("on GPU 1"), "{}", d.evidence.text);
    assert!(d.fix.text.contains("GPU 1") && d.fix.text.contains("--tensor-parallel-size, now 2"), "{}", d.fix.text);
    assert_eq!(d.fix.fields["gpus"], 2);

    // Rank 0 on the 80 GiB card: 40 GiB its own, 30 GiB the other server's, 20 GiB asked for.
    let d = tensor_parallel(40 * GIB, 30 * GIB, 110, 20 * GIB);
    assert_eq!((d.category, d.gpu), (Category::HeldByOtherProcess, Some(0)), "{}", d.evidence.text);
    assert_eq!(d.fix.fields["kill"], 300);
    assert_eq!(d.evidence.fields["held_outside_bytes"], 30 * GIB, "GPU 1's 2 GiB held before recording is not on GPU 0");
}

/// A process that started on the GPU after recording began, outside the traced command, shows
/// only in NVML's samples: a load failure beside it names it, with NVML's latest figure.
#[test]
fn a_holder_that_came_after_the_start_is_seen_in_the_samples() {
    use crate::event::{ProcessUse, Sample};
    let mut t = Trace::vllm(30 * GIB);
    t.0.retain(|r| !matches!(r.event, Event::Listen { .. }));
    let sample = |used: u64, command: Vec<String>| {
        Event::Sample(Sample { processes: vec![ProcessUse { pid: 777, gpu: 0, used_bytes: Some(used), command }], ..Sample::default() })
    };
    t.at(15 * MS, 0, sample(20 * GIB, vec!["other-server".into(), "--port".into(), "9000".into()]));
    t.at(25 * MS, 0, sample(45 * GIB, vec![]));
    t.alloc(30 * MS, ENGINE, 8 * GIB, 0x51);
    let d = t.diagnose(80 * GIB, &[], 0).remove(0);
    assert_eq!(d.category, Category::HeldByOtherProcess, "{}", d.evidence.text);
    assert_eq!(d.evidence.fields["held_outside_bytes"], 45 * GIB, "the latest sample before the failure");
    assert_eq!(d.fix.fields["kill"], 777);
    assert!(d.fix.text.contains("other-server --port 9000"), "its command from the sample that first named it: {}", d.fix.text);
}

/// A trace of 150 failed allocations: the first 100 are diagnosed one by one, the rest counted.
#[test]
fn failures_past_the_first_hundred_are_counted() {
    let mut t = Trace::vllm(16 * GIB);
    // Each asks for a quarter GiB more: no two are the same failure.
    for i in 0..150 {
        t.alloc(10 * MS + i, ENGINE, 70 * GIB + i * (GIB / 4), 0x51);
    }
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let report = crate::report::Report::new(&header(80 * GIB, &[]), &model, String::new(), 0, crate::report::Loss::default(), 0);
    assert_eq!((report.diagnoses.len(), report.failures_not_diagnosed), (100, 50));
    assert!(report.text().contains("and 50 more failures"), "{}", report.text());
}

/// PyTorch retries a failed allocation after emptying its cache: the same failure four times is
/// one diagnosis with a count and the last time, said once in the report.
#[test]
fn a_framework_s_retries_fold_into_one_failure() {
    let mut t = Trace::vllm(16 * GIB);
    t.request(8, 300 * MS, 160_000, None);
    for i in 0..4 {
        t.alloc(310 * MS + i * MS, ENGINE, 70 * GIB, 0x51);
    }
    // A different one after: its own line.
    t.alloc(400 * MS, ENGINE, 75 * GIB, 0x51);
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let report = crate::report::Report::new(&header(80 * GIB, &[]), &model, String::new(), 0, crate::report::Loss::default(), 0);
    let folded: Vec<_> = report.diagnoses.iter().map(|d| d.repeated.as_ref().map(|r| (r.times, r.last_ts))).collect();
    assert_eq!(folded, [Some((3, Some(313 * MS))), None]);
    let text = report.text();
    assert_eq!(text.matches("= the same failure 3 more times, the last at +0.31 s (retries)").count(), 1, "{text}");
    assert_eq!(text.matches("then at").count(), 1, "{text}");
}

/// Memory held outside by the MPS server is its other clients': the fix says to stop them (or
/// restart MPS), never to kill the server under every client.
#[test]
fn memory_held_by_the_mps_server_is_not_fixed_by_killing_it() {
    let mut t = Trace::vllm(30 * GIB);
    t.alloc(110 * MS, ENGINE, 40 * GIB, 0x51);
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let mut h = header(80 * GIB, &[(4242, 40 * GIB)]);
    for prior in &mut h.prior_use {
        prior.command = vec!["/usr/bin/nvidia-cuda-mps-server".into()];
    }
    for holder in &mut h.holders_at_start {
        holder.command = vec!["/usr/bin/nvidia-cuda-mps-server".into()];
    }
    let d = &diagnosed(&h, &model, 0)[0];
    assert_eq!(d.category, Category::HeldByOtherProcess);
    assert!(d.fix.text.contains("MPS server") && d.fix.text.contains("nvidia-cuda-mps-control"), "{}", d.fix.text);
    assert!(!d.fix.text.contains("kill 4242"), "{}", d.fix.text);
}

/// Under MPS the server makes every client's allocations: the report says so.
#[test]
fn mps_is_named_in_the_report() {
    let mut t = Trace(vec![], 0);
    t.at(0, 900, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["/usr/bin/nvidia-cuda-mps-server".into()] });
    t.alloc(10, 900, 8 * GIB, 0);
    let model = Model::from_records(&t.0);
    let report = crate::report::Report::new(&header(80 * GIB, &[]), &model, String::new(), 0, crate::report::Loss::default(), 0);
    assert_eq!(report.notes.len(), 1);
    assert!(report.text().contains("NOTE: MPS is in use (nvidia-cuda-mps-server, pid 900)"), "{}", report.text());
    let plain = Model::from_records(&Trace::vllm(GIB).0);
    assert!(crate::report::Report::new(&header(80 * GIB, &[]), &plain, String::new(), 0, crate::report::Loss::default(), 0)
        .notes
        .is_empty());
    // A server started after recording began, never traced: NVML's samples name it.
    let mut t = Trace::vllm(GIB);
    let server = crate::event::ProcessUse { pid: 950, gpu: 0, used_bytes: Some(GIB), command: vec!["nvidia-cuda-mps-server".into()] };
    let sample = crate::event::Sample { gpus: vec![], processes: vec![server], host: None };
    t.at(5, 0, Event::Sample(sample));
    let model = Model::from_records(&t.0);
    let report = crate::report::Report::new(&header(80 * GIB, &[]), &model, String::new(), 0, crate::report::Loss::default(), 0);
    assert!(report.text().contains("MPS is in use (nvidia-cuda-mps-server, pid 950)"), "{}", report.text());
}

/// Met running by a watch: the server is what the person started (the python server below the
/// login shell and the script, its engine with it), it was already listening, so it is ready
/// (serving, never loading) from then on; and the engine's memory made on a device it set up
/// before tracing is on the one GPU it held.
#[test]
fn a_server_met_serving_is_ready_named_below_its_shell_and_on_its_gpu() {
    let rec = |ts: u64, pid: u32, event| Record::new(ts, pid, pid, event);
    let process = |ppid, seen, command: &str| Event::Process { ppid, seen, command: command.split(' ').map(String::from).collect() };
    let records = vec![
        rec(1, 10, process(1, Seen::Running, "-bash")),
        rec(1, 11, process(10, Seen::Running, "bash run.sh")),
        rec(1, API, process(11, Seen::Running, "python3 -m vllm.entrypoints.openai.api_server")),
        rec(1, API, Event::Attached { listening: vec![8000], gpus: vec![] }),
        rec(1, ENGINE, process(API, Seen::Running, "python3 -m vllm.v1.engine.core")),
        rec(1, ENGINE, Event::FdFound { fd: 3, file: 1, device: Device::Ctl }),
        rec(1, ENGINE, Event::Attached { listening: vec![], gpus: vec![2] }),
        // A client made before tracing: its device's GPU is not in the trace.
        rec(5 * MS, ENGINE, Event::Alloc(Alloc::video(7, 8, 9, GIB))),
    ];
    let model = Model::from_records(&records);
    let services = Services::new(&model);
    let service = services.of(ENGINE).expect("the engine's service");
    assert_eq!(service.root, API, "below the script and the shell, with its engine");
    assert_eq!(service.ready_at, Some(1), "listening when met: serving from then on");
    assert_ne!(services.phase_of(ENGINE, 5 * MS), Phase::Load);
    assert_eq!(model.allocations[0].gpu, None, "the trace names no GPU for it");
    assert_eq!(model.gpu_for(ENGINE, model.allocations[0].gpu), Some(2), "the one GPU the engine held");
}

/// A vLLM-like server on an 80 GiB card with 60 GiB of weights and KV cache: one request of
/// 8 KB alone grows the engine's pool by 512 MiB; then another of 4 KB is in flight.
pub(crate) fn serving(command_flags: &[&str]) -> Trace {
    let mut t = Trace::vllm(60 * GIB);
    if let Event::Process { command, .. } = &mut t.0[0].event {
        command.extend(command_flags.iter().map(|f| f.to_string()));
    }
    t.request(6, 200 * MS, 8_000, Some(260 * MS));
    t.alloc(210 * MS, ENGINE, GIB / 2, 0);
    t.at(300 * MS, API, Event::ConnClose { conn: 6 });
    t.request(7, 400 * MS, 4_000, Some(460 * MS));
    t
}

/// [`serving`], the server a llama-server.
fn llama_serving(command_flags: &[&str]) -> Trace {
    let mut t = serving(command_flags);
    for r in &mut t.0 {
        if let Event::Process { command, .. } = &mut r.event {
            command.retain(|w| w != "serve");
            for w in command.iter_mut().filter(|w| *w == "vllm") {
                *w = "llama-server".into();
            }
        }
    }
    t
}

fn headroom(t: &mut Trace, prior: &[(u32, u64)]) -> Vec<super::headroom::Headroom> {
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let h = header(80 * GIB, prior);
    super::headroom::headroom(&Accounts::new(&h, &model))
}

#[test]
fn headroom_counts_requests_of_the_largest_size_by_what_one_cost_alone() {
    let mut t = serving(&[]);
    let [h] = &headroom(&mut t, &[])[..] else { panic!("one service on one GPU") };
    assert!(h.measured_alone);
    assert_eq!((h.measured_pool_bytes, h.measured_request_bytes, h.largest_request_bytes), (GIB / 2, 8_000, 8_000));
    assert_eq!(h.request_cost_bytes, GIB / 2);
    let now = h.now.expect("the server runs");
    // 80 GiB less 60 held: 20 GiB free with the pool counted as room, 40 requests of 8 KB.
    assert_eq!((now.room_bytes, now.fit_at_once, now.in_flight, now.more_requests), (20 * GIB, 40, 1, 39));
    // The largest alone: 20 GiB at 64 KiB per byte received.
    assert_eq!(now.largest_fitting_request_bytes, 320_000);
    assert!(h.limits_exceeded.is_empty(), "no limit on its command line");
    // What others hold is no room: NVML's 4 GiB for a process from before tracing.
    let mut t = serving(&[]);
    let [h] = &headroom(&mut t, &[(900, 4 * GIB)])[..] else { panic!() };
    assert_eq!(h.now.unwrap().fit_at_once, 32);
}

#[test]
fn a_limit_above_what_memory_fits_is_named_with_the_cap() {
    let mut t = serving(&["--max-num-seqs", "256"]);
    let [h] = &headroom(&mut t, &[])[..] else { panic!() };
    let concurrency = |value, fits| Limit {
        setting: "--max-num-seqs".into(),
        value,
        bounds: Bound::Concurrency,
        fits,
        cap: fits,
        slots: 1,
        proxies: vec![],
    };
    assert_eq!(h.limits_exceeded, [concurrency(256, 40)]);
    assert!(line(h).contains("`--max-num-seqs 256` lets 256 run at once; memory fits 40 of the largest served: cap at 40"), "{}", line(h));
    // The terminal's table: a row of figures under its header, the limit under the row, the
    // service by its program and sizing flags.
    let table = crate::report::headroom::table(std::slice::from_ref(h));
    let rows: Vec<&str> = table.lines().collect();
    assert!(rows[0].starts_with("HEADROOM  GPU") && rows[0].ends_with("LARGEST ALONE  SERVICE"), "{table}");
    assert!(rows[1].contains(" 40 at ") && rows[1].ends_with("vllm serve ... --max-num-seqs 256 --gpu-memory-utilization 0.9"), "{table}");
    assert!(rows[2].starts_with("  limit: `--max-num-seqs 256` lets 256 run at once"), "{table}");
    let mut t = serving(&["--max-num-seqs", "32"]);
    assert!(headroom(&mut t, &[])[0].limits_exceeded.is_empty(), "32 fit");
}

/// A LiteLLM proxy (pid 500) whose config sends `local` to port 8000 with this limit (None: none).
fn litellm(t: &mut Trace, port: u16, limit: Option<u64>) {
    litellm_proxy(t, 500, &[], &[("local", port, limit)]);
}

/// A LiteLLM proxy with these extra arguments, whose config sends each (model, port, limit).
fn litellm_proxy(t: &mut Trace, pid: u32, args: &[&str], sends: &[(&str, u16, Option<u64>)]) {
    let deployments = sends
        .iter()
        .map(|&(model, port, limit)| crate::event::Deployment {
            model: model.into(),
            host: "localhost".into(),
            port,
            max_parallel_requests: limit,
            limit_from: "max_parallel_requests".into(),
            local: None,
        })
        .collect();
    let mut command: Vec<String> = vec!["litellm".into(), "--config".into(), "/srv/litellm.yaml".into()];
    command.extend(args.iter().map(|a| a.to_string()));
    t.at(150 * MS, pid, Event::Proxy { uid: 0, command, config: "/srv/litellm.yaml".into(), deployments, workers: None });
}

/// Deployments that each fit but together do not (two model names for one server, a second
/// proxy, a proxy's workers that each count on their own) are one limit, with a share to set.
#[test]
fn litellm_deployments_to_one_server_count_together() {
    // 40 fit: 25 + 25 do not; each gets 20.
    let mut t = serving(&[]);
    litellm_proxy(&mut t, 500, &[], &[("local", 8000, Some(25)), ("alias", 8000, Some(25))]);
    let [h] = &headroom(&mut t, &[])[..] else { panic!() };
    let [l] = &h.limits_exceeded[..] else { panic!("{:?}", h.limits_exceeded) };
    assert_eq!((l.value, l.cap, l.proxies.len()), (50, 40, 2));
    assert!(line(h).contains("`alias` (25 by its `max_parallel_requests`, on port 8000) let 50 requests at once through to it; memory fits 40 of the largest served: set `max_parallel_requests: 20` in each"), "{}", line(h));
    // 12 in each of 4 workers: 48, each gets 10.
    let mut t = serving(&[]);
    litellm_proxy(&mut t, 500, &["--num_workers", "4"], &[("local", 8000, Some(12))]);
    let [h] = &headroom(&mut t, &[])[..] else { panic!() };
    let [l] = &h.limits_exceeded[..] else { panic!("{:?}", h.limits_exceeded) };
    assert_eq!(l.value, 48);
    assert!(line(h).contains("/srv/litellm.yaml, 4 workers) deployment `local` (12 by its `max_parallel_requests` in each of 4 workers, on port 8000) lets 48"), "{}", line(h));
    assert!(line(h).contains("set `max_parallel_requests: 10` there (each worker keeps its own count)"), "{}", line(h));
    // Workers counted when it was read stand over the command line's: 3 of 20 are 60.
    let mut t = serving(&[]);
    let deployment = crate::event::Deployment {
        model: "local".into(),
        host: "localhost".into(),
        port: 8000,
        max_parallel_requests: Some(20),
        limit_from: "rpm".into(),
        local: Some(true),
    };
    let command = vec!["litellm".into(), "--num_workers".into(), "8".into()];
    t.at(150 * MS, 500, Event::Proxy { uid: 0, command, config: "c".into(), deployments: vec![deployment], workers: Some(3) });
    let [h] = &headroom(&mut t, &[])[..] else { panic!() };
    assert_eq!(h.limits_exceeded.iter().map(|l| l.value).collect::<Vec<_>>(), [60]);
    // Two proxies, one of them without a limit: nothing bounds what they send, no LiteLLM limit.
    let mut t = serving(&[]);
    litellm_proxy(&mut t, 500, &[], &[("local", 8000, Some(25))]);
    litellm_proxy(&mut t, 501, &[], &[("other", 8000, None)]);
    assert!(headroom(&mut t, &[])[0].limits_exceeded.is_empty());
    // Together within what fits: nothing said.
    let mut t = serving(&[]);
    litellm_proxy(&mut t, 500, &[], &[("local", 8000, Some(20))]);
    litellm_proxy(&mut t, 501, &["--num_workers=2"], &[("other", 8000, Some(10))]);
    assert!(headroom(&mut t, &[])[0].limits_exceeded.is_empty());
}

#[test]
fn a_litellm_limit_past_what_fits_is_named_where_the_server_sets_none_that_fits() {
    let mut t = serving(&[]);
    litellm(&mut t, 8000, Some(50));
    let [h] = &headroom(&mut t, &[])[..] else { panic!() };
    let [l] = &h.limits_exceeded[..] else { panic!("{:?}", h.limits_exceeded) };
    assert_eq!((l.setting.as_str(), l.value, l.fits, l.cap, l.bounds), ("LiteLLM max_parallel_requests", 50, 40, 40, Bound::Concurrency));
    assert_eq!(l.proxies.iter().map(|p| (p.pid, p.port, p.workers)).collect::<Vec<_>>(), [(500, 8000, 1)]);
    assert!(
        line(h).contains(
            "LiteLLM (pid 500 of uid 0, /srv/litellm.yaml) deployment `local` (50 by its `max_parallel_requests`, on port 8000) lets 50 requests at once through to it; memory fits 40 of the largest served: set `max_parallel_requests: 40` there"
        ),
        "{}",
        line(h)
    );
    // The server's own limit past what fits too: both named.
    let mut t = serving(&["--max-num-seqs", "256"]);
    litellm(&mut t, 8000, Some(50));
    assert_eq!(headroom(&mut t, &[])[0].limits_exceeded.len(), 2);
    // A server that caps itself within what fits queues what the proxy lets through.
    let mut t = serving(&["--max-num-seqs", "32"]);
    litellm(&mut t, 8000, Some(50));
    assert!(headroom(&mut t, &[])[0].limits_exceeded.is_empty());
    // Another user's proxy says nothing of this server (root's would).
    let mut t = serving(&[]);
    t.at(1, API, Event::Place(crate::event::Place { uid: Some(1000), ..Default::default() }));
    let deployment = crate::event::Deployment {
        model: "x".into(),
        host: "h".into(),
        port: 8000,
        max_parallel_requests: Some(99),
        limit_from: "rpm".into(),
        local: None,
    };
    t.at(150 * MS, 600, Event::Proxy { uid: 2000, command: vec![], config: "c".into(), deployments: vec![deployment], workers: None });
    assert!(headroom(&mut t, &[])[0].limits_exceeded.is_empty());
    // A deployment to another machine's address at the same port (read as the proxy saw its
    // own) is not this server's; one to the proxy's own address, or to a name, is.
    for (local, tied) in [(Some(false), false), (Some(true), true), (None, true)] {
        let mut t = serving(&[]);
        let deployment = crate::event::Deployment {
            model: "remote".into(),
            host: "10.0.0.12".into(),
            port: 8000,
            max_parallel_requests: Some(99),
            limit_from: "rpm".into(),
            local,
        };
        t.at(150 * MS, 600, Event::Proxy { uid: 0, command: vec![], config: "c".into(), deployments: vec![deployment], workers: None });
        assert_eq!(headroom(&mut t, &[])[0].limits_exceeded.len(), usize::from(tied), "{local:?}");
    }
    // Within what fits, no limit at all, or another port: nothing said.
    for (port, limit) in [(8000, Some(40)), (8000, None), (9000, Some(50))] {
        let mut t = serving(&[]);
        litellm(&mut t, port, limit);
        assert!(headroom(&mut t, &[])[0].limits_exceeded.is_empty(), "{port} {limit:?}");
    }
}

#[test]
fn a_concurrent_load_fix_names_the_litellm_deployment_in_front() {
    let mut t = burst(60 * GIB, 8, 24 * GIB);
    litellm(&mut t, 8000, Some(64));
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!(d.category, Category::ConcurrentLoad);
    let cap = d.fix.fields["max_concurrency"].as_u64().unwrap();
    let expected = format!(
        "`max_parallel_requests: {cap}` for LiteLLM (pid 500 of uid 0, /srv/litellm.yaml) deployment `local` (now 64 by its `max_parallel_requests`), which sends to its port"
    );
    assert!(d.fix.text.contains(&expected), "{}", d.fix.text);
    assert_eq!(d.fix.fields["litellm_deployments"][0]["pid"], 500);
    assert_eq!(d.fix.fields["litellm_max_parallel_requests"].as_u64(), Some(cap));
    // A second proxy with 3 workers sending there too: the cap is shared over 4 counts.
    let mut two = t.clone();
    litellm_proxy(&mut two, 501, &["--num_workers", "3"], &[("other", 8000, Some(64))]);
    let d = &two.diagnose(80 * GIB, &[], 0)[0];
    let share = (cap / 4).max(1);
    assert_eq!(d.fix.fields["litellm_max_parallel_requests"].as_u64(), Some(share));
    assert!(d.fix.text.contains(&format!("`max_parallel_requests: {share}` for LiteLLM (pid 500")), "{}", d.fix.text);
    assert!(
        d.fix.text.contains(&format!(
            "3 workers) deployment `other` (now 64 by its `max_parallel_requests`), which send to its port: {cap} together"
        )),
        "{}",
        d.fix.text
    );
    // Two services listening on the port: no deployment is tied to either.
    t.at(1, 700, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["other".into()] });
    t.at(2, 700, Event::Attached { listening: vec![8000], gpus: vec![] });
    // Its own RM client: a client handle is the host's, never two processes'.
    t.alloc_in(3, 700, 2, GIB, 0);
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert!(
        d.fix.text.contains("LiteLLM max_parallel_requests:") && d.fix.fields.get("litellm_deployments").is_none(),
        "{} {}",
        d.evidence.text,
        d.fix.text
    );
}

/// One request's context and one batch's tokens against the prompt that fits in the room: 20 GiB
/// at 64 KiB a byte received is 320,000 bytes, 80,000 tokens at 4 bytes a token.
#[test]
fn a_context_or_batch_limit_past_the_prompt_that_fits_is_named_with_the_value_to_set() {
    let flags = ["--max-num-seqs", "256", "--max-model-len", "131072", "--max-num-batched-tokens=100000"];
    let mut t = serving(&flags);
    let [h] = &headroom(&mut t, &[])[..] else { panic!() };
    let limit =
        |setting: &str, value, bounds, fits, cap| Limit { setting: setting.into(), value, bounds, fits, cap, slots: 1, proxies: vec![] };
    assert_eq!(
        h.limits_exceeded,
        [
            limit("--max-num-seqs", 256, Bound::Concurrency, 40, 40),
            limit("--max-model-len", 131_072, Bound::Context, 80_000, 77_600),
            limit("--max-num-batched-tokens", 100_000, Bound::BatchTokens, 80_000, 77_600),
        ]
    );
    let text = line(h);
    assert!(
        text.contains("`--max-model-len 131072` lets in a prompt of 131072 tokens; memory fits one of 80000 alone (at 4 bytes a token): set it to 77600")
            && text.contains("`--max-num-batched-tokens 100000` lets 100000 tokens into one batch; memory fits 80000 at once"),
        "{text}"
    );
    // At or under what fits: nothing said.
    let mut t = serving(&["--max-model-len", "80000", "--max-num-batched-tokens", "8192"]);
    assert!(headroom(&mut t, &[])[0].limits_exceeded.is_empty());
    // As vLLM reads them: 128K is 131,072 tokens, 80k is 80,000 (fits).
    let mut t = serving(&["--max-model-len", "128K", "--max-num-batched-tokens", "80k"]);
    assert_eq!(headroom(&mut t, &[])[0].limits_exceeded, [limit("--max-model-len", 131_072, Bound::Context, 80_000, 77_600)]);
}

/// llama-server's `-c` given with `-np` is its slots' together: a slot's share is checked, and
/// the value to set is what fits times the slots. Unified, or with `-np` left to auto, it is one
/// request's.
#[test]
fn llama_servers_context_is_checked_per_slot() {
    let llama = |flags: &[&str]| headroom(&mut llama_serving(flags), &[]).remove(0).limits_exceeded;
    let context =
        |value, slots, cap| Limit { setting: "-c".into(), value, bounds: Bound::Context, fits: 80_000, cap, slots, proxies: vec![] };
    // 8 slots of 100,000 tokens each: past the 80,000 that fit; -c 620,800 gives each 77,600.
    assert_eq!(llama(&["-c", "800000", "-np", "8"]), [context(800_000, 8, 620_800)]);
    let limits = llama(&["-c", "800000", "-np", "8"]);
    assert!(
        limit(&limits[0]).contains("`-c 800000` lets each of its 8 slots take a prompt of 100000 tokens; memory fits one of 80000 alone")
            && limit(&limits[0]).ends_with("set it to 620800"),
        "{}",
        limit(&limits[0])
    );
    // 8 slots of 40,000: each fits. (The concurrency check is the other half: -np 8 fits 40.)
    assert!(llama(&["-c", "320000", "-np", "8"]).is_empty());
    // One request may take the whole -c: unified, or -np left to auto.
    assert_eq!(llama(&["-c", "320000", "-np", "8", "-kvu"]), [context(320_000, 1, 77_600)]);
    assert_eq!(llama(&["--ctx-size", "100000"]).len(), 1);
}

/// The long-request fix for a llama-server whose `-c` its 4 slots share: the prompt that fits
/// is one slot's share, so the `-c` to set is 4 times it.
#[test]
fn the_long_request_fix_for_llama_names_the_context_its_slots_share() {
    let mut t = llama_serving(&["-c", "800000", "-np", "4"]);
    t.request(8, 600 * MS, 400_000, None);
    t.alloc(610 * MS, ENGINE, 25 * GIB, 0x51);
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!(d.category, Category::LongRequest);
    // 20 GiB of room at 64 KiB a byte: 80,000 tokens, less 3%.
    assert_eq!((d.fix.fields["context_tokens"].as_u64(), d.fix.fields["context_slots"].as_u64()), (Some(77_600), Some(4)));
    assert!(d.fix.text.contains("about 77600 tokens a request (-c 310400, now 800000, shared by its 4 slots)"), "{}", d.fix.text);
}

#[test]
fn the_tightest_moment_is_when_another_service_held_most() {
    let mut t = serving(&[]);
    t.at(450 * MS, 300, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["trainer".into()] });
    t.alloc_in(500 * MS, 300, 2, 10 * GIB, 0);
    let object = t.1;
    t.at(600 * MS, 300, Event::Free { fd: 3, via: Via::RmFree, client: 2, parent: 0, object, status: 0 });
    let h = headroom(&mut t, &[]).into_iter().find(|h| h.pid == API).unwrap();
    let tightest = h.tightest;
    assert_eq!((tightest.ts, tightest.fit_at_once, tightest.more_requests), (500 * MS, 20, 19), "{tightest:?}");
    assert_eq!(h.now.unwrap().fit_at_once, 40, "freed since");
    assert!(line(&h).contains("at its tightest, at 0.50 s, 20 fit at once"), "{}", line(&h));
}

#[test]
fn a_batch_costs_its_share_when_no_request_was_alone() {
    let mut t = Trace::vllm(60 * GIB);
    for conn in 6..10 {
        t.request(conn, 200 * MS, 8_000, Some(260 * MS));
    }
    t.alloc(210 * MS, ENGINE, 2 * GIB, 0);
    let [h] = &headroom(&mut t, &[])[..] else { panic!() };
    assert!(!h.measured_alone);
    assert_eq!((h.measured_request_bytes, h.request_cost_bytes), (32_000, GIB / 2));
}

#[test]
fn a_server_gone_has_no_headroom_now_but_its_tightest() {
    let mut t = serving(&[]);
    t.at(700 * MS, ENGINE, Event::Exit { code: Some(0) });
    t.at(710 * MS, API, Event::Exit { code: Some(0) });
    let [h] = &headroom(&mut t, &[])[..] else { panic!() };
    assert!(h.now.is_none());
    assert_eq!(h.tightest.fit_at_once, 40);
    assert!(!line(h).contains("; now "), "{}", line(h));
}

#[test]
fn no_request_no_headroom() {
    let mut t = Trace::vllm(60 * GIB);
    assert!(headroom(&mut t, &[]).is_empty());
    // A request, but nothing allocated while in prefill: no measure.
    t.request(6, 200 * MS, 8_000, Some(260 * MS));
    assert!(headroom(&mut t, &[]).is_empty());
}

/// Two requests measured alone, 4,200 and 8,200 bytes, growing the pool to 256 and 512 MiB: of
/// each request's bytes 200 are no prompt (headers, JSON) and cost nothing; the long one that
/// fails is told the context that fits, in tokens, with the margin.
#[test]
fn two_sizes_measured_alone_make_a_line_and_the_context_that_fits() {
    let mut t = Trace::vllm(60 * GIB);
    t.request(6, 200 * MS, 4_200, Some(260 * MS));
    t.alloc(210 * MS, ENGINE, GIB / 4, 0);
    t.at(300 * MS, API, Event::ConnClose { conn: 6 });
    t.request(7, 400 * MS, 8_200, Some(460 * MS));
    t.alloc(410 * MS, ENGINE, GIB / 4, 0);
    t.at(500 * MS, API, Event::ConnClose { conn: 7 });
    let [h] = &headroom(&mut t, &[])[..] else { panic!() };
    // 20 GiB of room at 256 MiB per 4,000 bytes of prompt: 320,000 bytes of prompt.
    assert_eq!((h.request_cost_bytes, h.now.unwrap().largest_fitting_request_bytes), (GIB / 2, 320_000 + 200));
    t.request(8, 600 * MS, 400_000, None);
    t.alloc(610 * MS, ENGINE, 25 * GIB, 0x51);
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!(d.category, Category::LongRequest);
    assert_eq!(d.fix.fields["largest_fitting_request_bytes"], 320_200);
    // 320,000 bytes of prompt at 4 a token, less 3%.
    assert_eq!(d.fix.fields["context_tokens"], 77_600);
    assert!(d.fix.text.contains("--max-model-len 77600") && d.fix.text.contains("about 80000 tokens"), "{}", d.fix.text);
}

/// A long request that fails with no request measured before it (a server met serving): the
/// context is estimated from what it needed at least, said to be an estimate. 25 GiB refused
/// for 400,000 bytes, 20 GiB of room: 320,000 bytes fit, 80,000 tokens, less 3%.
#[test]
fn a_long_request_with_none_measured_before_is_estimated_from_itself() {
    let mut t = Trace::vllm(60 * GIB);
    t.request(8, 600 * MS, 400_000, None);
    t.alloc(610 * MS, ENGINE, 25 * GIB, 0x51);
    let d = &t.clone().diagnose(80 * GIB, &[], 0)[0];
    assert_eq!(d.category, Category::LongRequest);
    assert_eq!(
        (d.fix.fields["largest_fitting_request_bytes"].as_u64(), d.fix.fields["context_tokens"].as_u64()),
        (Some(320_000), Some(77_600))
    );
    assert_eq!(d.fix.fields["fits_estimated"], true);
    assert!(
        d.fix.text.contains("--max-model-len 77600")
            && d.fix.text.contains("this is an estimate from what the failing one needed at least (25.0 GiB for its 390.6 KiB"),
        "{}",
        d.fix.text
    );
    // What it grew the pool by in prefill counts too: 5 GiB allocated, then 20 refused.
    let mut t = Trace::vllm(60 * GIB);
    t.request(8, 600 * MS, 400_000, None);
    t.alloc(605 * MS, ENGINE, 5 * GIB, 0);
    t.alloc(610 * MS, ENGINE, 20 * GIB, 0x51);
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!(
        (d.fix.fields["largest_fitting_request_bytes"].as_u64(), d.fix.fields["fits_estimated"].as_bool()),
        (Some(320_000), Some(true))
    );
    // With another request in flight beside it, nothing is made up.
    let mut t = Trace::vllm(60 * GIB);
    t.request(7, 590 * MS, 8_000, None);
    t.request(8, 600 * MS, 400_000, None);
    t.alloc(610 * MS, ENGINE, 25 * GIB, 0x51);
    let d = &t.diagnose(80 * GIB, &[], 0)[0];
    assert_eq!(d.category, Category::LongRequest);
    assert!(d.fix.fields["context_tokens"].is_null() && d.fix.fields.get("fits_estimated").is_none(), "{}", d.fix.fields);
}

fn whatif(t: &mut Trace, settings: super::whatif::Settings) -> super::whatif::Outcome {
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let h = header(80 * GIB, &[]);
    crate::report::what_if(&h, &model, 0, &settings, true).unwrap()
}

/// A burst of 48 requests of 8 KB (512 MiB each, one measured alone before) on 20 GiB of room:
/// the 41st at once fails; capped at 40 it fits, the rest waiting.
#[test]
fn whatif_replays_a_burst_under_a_cap() {
    let mut t = serving(&[]);
    for conn in 10..58 {
        t.request(conn, 600 * MS, 8_000, Some(700 * MS));
        t.at(800 * MS, API, Event::ConnClose { conn });
    }
    let recorded = whatif(&mut t, super::whatif::Settings::default());
    assert_eq!((recorded.category, recorded.failing_request), (Category::ConcurrentLoad, Some(43)), "{}", outcome(&recorded));
    let capped = whatif(&mut t, super::whatif::Settings { max_concurrency: Some(40), ..Default::default() });
    assert_eq!(capped.category, Category::None, "{}", outcome(&capped));
    assert_eq!(capped.search.map(|s| s.max_concurrency), Some(40));
    let past = whatif(&mut t, super::whatif::Settings { max_concurrency: Some(41), ..Default::default() });
    assert_eq!(past.category, Category::ConcurrentLoad, "{}", outcome(&past));
    // A card 10 GiB bigger: vLLM reserves 0.9 of it for its KV cache, requests get the rest,
    // two more at once.
    let bigger = whatif(&mut t, super::whatif::Settings { capacity: Some(90 * GIB), ..Default::default() });
    assert_eq!((bigger.category, bigger.kv_after_bytes), (Category::ConcurrentLoad, 9 * GIB), "{}", outcome(&bigger));
    assert_eq!(bigger.search.map(|s| s.max_concurrency), Some(42));
}

/// vLLM fills the fraction of the card it reserves: quantized weights leave it more KV cache,
/// not more room for requests; a smaller fraction does.
#[test]
fn whatif_of_a_reserving_engine_moves_its_kv_cache() {
    let mut t = Trace::vllm(0);
    t.0.retain(|r| !matches!(r.event, Event::Alloc(_)));
    // 16 GiB of weights, then a KV cache of 8 identical blocks: 0.9 of the card in all.
    t.alloc(10, ENGINE, 16 * GIB, 0);
    for i in 0..8 {
        t.alloc(20 + i, ENGINE, 7 * GIB, 0);
    }
    t.request(6, 200 * MS, 8_000, Some(260 * MS));
    t.alloc(210 * MS, ENGINE, GIB / 2, 0);
    let quantized = whatif(&mut t, super::whatif::Settings { quantize: Some(8), ..Default::default() });
    assert_eq!((quantized.weights_bytes, quantized.kv_bytes), (16 * GIB, 56 * GIB));
    assert_eq!((quantized.weights_after_bytes, quantized.kv_after_bytes), (8 * GIB, 64 * GIB), "{}", outcome(&quantized));
    let before = whatif(&mut t, super::whatif::Settings::default()).search.unwrap().max_concurrency;
    assert_eq!(quantized.search.unwrap().max_concurrency, before, "the KV cache took what quantizing freed");
    let smaller = whatif(&mut t, super::whatif::Settings { utilization: Some(0.8), ..Default::default() });
    assert_eq!(smaller.kv_after_bytes, 56 * GIB - 8 * GIB);
    assert!(smaller.search.unwrap().max_concurrency > before + 10, "{}", outcome(&smaller));
    // Sharded over 2 GPUs: each holds half the weights (its KV cache takes the rest of the
    // budget) and half of what a request costs, so twice as many fit at once.
    let sharded = whatif(&mut t, super::whatif::Settings { tensor_parallel: Some(2), ..Default::default() });
    assert_eq!((sharded.weights_after_bytes, sharded.kv_after_bytes), (8 * GIB, 64 * GIB), "{}", outcome(&sharded));
    let twice = sharded.search.unwrap().max_concurrency;
    assert!(twice.abs_diff(2 * before) <= 1, "{twice} against {before}: {}", outcome(&sharded));
    assert!(outcome(&sharded).contains("on each of the 2 GPUs it is sharded over serves"), "{}", outcome(&sharded));
    let same = whatif(&mut t, super::whatif::Settings { tensor_parallel: Some(1), ..Default::default() });
    assert_eq!((same.weights_after_bytes, same.search.unwrap().max_concurrency), (16 * GIB, before), "as recorded");
}

/// vLLM that failed loading a model in chunks of one size (as a layer's tensors repeat): the
/// chunks are weights, not its KV cache (allocated once the weights are in), so the replay of
/// the recording fails as it did, and quantized or sharded over 2 GPUs it loads.
#[test]
fn whatif_of_a_load_that_failed_counts_its_chunks_as_weights() {
    let mut t = Trace::vllm(0);
    t.0.retain(|r| !matches!(r.event, Event::Alloc(_) | Event::Listen { .. }));
    for i in 0..160 {
        t.alloc(10 + i, ENGINE, GIB / 2, 0);
    }
    t.alloc(200, ENGINE, GIB / 2, 0x51);
    let recorded = whatif(&mut t, super::whatif::Settings::default());
    assert_eq!(
        (recorded.category, recorded.weights_bytes, recorded.kv_bytes),
        (Category::DoesNotFitAtLoad, 80 * GIB + GIB / 2, 0),
        "{}",
        outcome(&recorded)
    );
    for settings in [
        super::whatif::Settings { quantize: Some(8), ..Default::default() },
        super::whatif::Settings { tensor_parallel: Some(2), ..Default::default() },
    ] {
        let fits = whatif(&mut t, settings.clone());
        // 0.9 of 80 GiB, less 40.25 GiB of weights, is its KV cache.
        assert_eq!(
            (fits.category, fits.weights_after_bytes, fits.kv_after_bytes),
            (Category::None, 40 * GIB + GIB / 4, 72 * GIB - 40 * GIB - GIB / 4),
            "{settings:?}: {}",
            outcome(&fits)
        );
    }
}

/// vLLM that failed allocating its KV cache (identical blocks after a model of other sizes):
/// its weights were all in, the blocks are its KV cache.
#[test]
fn whatif_of_a_load_that_failed_in_its_kv_cache() {
    let mut t = Trace::vllm(0);
    t.0.retain(|r| !matches!(r.event, Event::Alloc(_) | Event::Listen { .. }));
    t.alloc(10, ENGINE, 16 * GIB, 0);
    for i in 0..4 {
        t.alloc(20 + i, ENGINE, 7 * GIB, 0);
    }
    t.alloc(200, ENGINE, 7 * GIB, 0x51);
    let recorded = whatif(&mut t, super::whatif::Settings::default());
    assert_eq!(
        (recorded.weights_bytes, recorded.kv_bytes, recorded.weights_at_least),
        (16 * GIB, 28 * GIB, false),
        "{}",
        outcome(&recorded)
    );
    // Chunks of one size from the start are weights, known only as at least.
    let mut t = Trace::vllm(0);
    t.0.retain(|r| !matches!(r.event, Event::Alloc(_) | Event::Listen { .. }));
    for i in 0..8 {
        t.alloc(10 + i, ENGINE, 7 * GIB, 0);
    }
    t.alloc(200, ENGINE, 7 * GIB, 0x51);
    let recorded = whatif(&mut t, super::whatif::Settings::default());
    assert_eq!((recorded.weights_bytes, recorded.kv_bytes, recorded.weights_at_least), (63 * GIB, 0, true), "{}", outcome(&recorded));
    assert!(outcome(&recorded).contains("at least weights 63.0 GiB"), "{}", outcome(&recorded));
}

/// The sharding a command line records: a count, llama's proportions above 0 (`,` or `/`), and
/// without them llama splits over the GPUs it used.
#[test]
fn whatif_reads_how_many_gpus_a_command_line_shards_over() {
    let shards = |command: &str, gpus| {
        let argv: Vec<String> = command.split(' ').map(String::from).collect();
        super::whatif::shards(&argv, super::server::ServerFamily::of(&argv), gpus)
    };
    assert_eq!(shards("vllm serve m --tensor-parallel-size 4", 1), 4);
    assert_eq!(shards("vllm serve m -tp 2", 8), 2);
    assert_eq!(shards("vllm serve m", 8), 1);
    assert_eq!(shards("vllm serve m -tp 0", 1), 1);
    assert_eq!(shards("vllm serve m -tp 99999999", 1), super::whatif::MAX_TENSOR_PARALLEL);
    assert_eq!(shards("llama-server -m m --tensor-split 1,1", 1), 2);
    assert_eq!(shards("llama-server -m m -ts 3/1", 1), 2);
    assert_eq!(shards("llama-server -m m -ts 1,0", 2), 1, "0: no share on that GPU");
    assert_eq!(shards("llama-server -m m -ts x,y", 2), 1);
    assert_eq!(shards("llama-server -m m", 3), 3, "every GPU it used");
    assert_eq!(shards("llama-server -m m", 0), 1);
}

/// A model recorded on 2 GPUs (`--tensor-parallel-size 2`; llama's `--tensor-split 1,1`) tried
/// on 1: each byte a shard held is held twice over; a KV cache sized by the context too.
#[test]
fn whatif_reads_the_recorded_sharding() {
    let mut t = serving(&["--tensor-parallel-size", "2"]);
    for conn in 10..20 {
        t.request(conn, 600 * MS, 8_000, Some(700 * MS));
        t.at(800 * MS, API, Event::ConnClose { conn });
    }
    let recorded = whatif(&mut t, super::whatif::Settings::default());
    assert_eq!(recorded.category, Category::None, "{}", outcome(&recorded));
    let one = whatif(&mut t, super::whatif::Settings { tensor_parallel: Some(1), ..Default::default() });
    assert_eq!(one.weights_after_bytes, 2 * recorded.weights_bytes, "{}", outcome(&one));
    let (before, after) = (recorded.search.unwrap().max_concurrency, one.search.map_or(0, |s| s.max_concurrency));
    assert!(after < before, "{after} at once on one GPU against {before} on 2: {}", outcome(&one));
}

/// A watch's window moves on past the request that measured what a request costs: its
/// snapshot keeps it (a live allocation was made during its prefill), so the headroom holds.
#[test]
fn what_a_request_costs_outlives_the_window() {
    let mut t = serving(&[]);
    // The server's first answer (kept by every snapshot) is another one's.
    t.request(5, 150 * MS, 100, Some(160 * MS));
    t.at(170 * MS, API, Event::ConnClose { conn: 5 });
    t.0.sort_by_key(|r| r.ts);
    let whole = headroom(&mut t, &[]);
    let rebuilt = Model::from_records(&Model::from_records(&t.0).snapshot());
    let h = header(80 * GIB, &[]);
    let after = super::headroom::headroom(&Accounts::new(&h, &rebuilt));
    assert_eq!(after.len(), 1, "the measure outlived the window");
    assert_eq!(
        (after[0].request_cost_bytes, after[0].now.map(|n| n.fit_at_once)),
        (whole[0].request_cost_bytes, whole[0].now.map(|n| n.fit_at_once))
    );
}

/// llama-server's `-c` given with `-np` is shared by the slots: a what-if of either admits a
/// request up to a slot's share (its prompts of 2,000 and 1,000 tokens, at 4 bytes a token).
#[test]
fn whatif_of_llama_admits_a_slots_share_of_its_context() {
    let mut t = llama_serving(&["-c", "8000", "-np", "2"]);
    let refused = |t: &mut Trace, max_context, max_concurrency| {
        let settings = super::whatif::Settings { max_context, max_concurrency, ..Default::default() };
        whatif(t, settings).refused
    };
    // 4 slots of 8,000: 2,000 each, both admitted; 8 slots: 1,000 each, the long one refused.
    assert_eq!(refused(&mut t, None, Some(4)), 0);
    assert_eq!(refused(&mut t, None, Some(8)), 1);
    // -c 3,000 over the recorded 2 slots: 1,500 each.
    assert_eq!(refused(&mut t, Some(3_000), None), 1);
    assert_eq!(refused(&mut t, Some(4_000), None), 0);
    // The search's context is one request's, and the setting that gives it names the slots.
    let searched = whatif(&mut t, super::whatif::Settings { max_concurrency: Some(4), ..Default::default() });
    let s = searched.search.unwrap();
    assert_eq!(s.context_slots, 4);
    assert!(
        outcome(&searched).contains(&format!("a context setting of {}, shared by 4 slots", s.max_context_tokens * 4)),
        "{}",
        outcome(&searched)
    );
    // A unified cache: each request may take all of it.
    let mut unified = llama_serving(&["-c", "8000", "-np", "2", "--kv-unified"]);
    assert_eq!(refused(&mut unified, None, Some(8)), 0);
    // -c 0 is the model's own context, unknown here: nothing is refused for it.
    let mut from_model = llama_serving(&["-c", "0", "-np", "2"]);
    assert_eq!(refused(&mut from_model, None, Some(8)), 0);
}

/// Odd settings and odd traces answer, never panic: a cap past any count is no cap; a request of
/// no bytes measures nothing (no infinite cost, no "cap at 0").
#[test]
fn whatif_and_headroom_take_odd_input() {
    let mut t = serving(&[]);
    let huge = whatif(&mut t, super::whatif::Settings { max_concurrency: Some(u64::MAX), ..Default::default() });
    assert_eq!(huge.category, Category::None, "{}", outcome(&huge));
    let refused_all = whatif(&mut t, super::whatif::Settings { max_context: Some(1), ..Default::default() });
    assert_eq!(refused_all.refused, 2);
    assert!(refused_all.margin_bytes < 80 * GIB as i64, "what loading left, not an unbounded spare: {}", outcome(&refused_all));
    // The pool grew during a request that brought no bytes; the one after brought some.
    let mut empty = Trace::vllm(60 * GIB);
    empty.request(6, 200 * MS, 0, Some(260 * MS));
    empty.alloc(210 * MS, ENGINE, GIB / 2, 0);
    empty.at(300 * MS, API, Event::ConnClose { conn: 6 });
    empty.request(7, 400 * MS, 8_000, Some(460 * MS));
    assert!(headroom(&mut empty, &[]).is_empty(), "no cost from a request of no bytes");
}

/// A kept request on a keep-alive connection whose next request is in flight: the snapshot ends
/// the first, so only the second is in flight after it (a watch's compactions never pile up
/// requests that never end).
#[test]
fn a_kept_request_on_a_live_connection_still_ends() {
    let mut t = Trace::vllm(60 * GIB);
    t.request(6, 200 * MS, 8_000, Some(260 * MS));
    t.alloc(210 * MS, ENGINE, GIB / 2, 0);
    t.at(400 * MS, API, Event::Received { conn: 6, bytes: 2_000, request: Some("POST /v1/completions".into()) });
    t.0.sort_by_key(|r| r.ts);
    let whole = Model::from_records(&t.0);
    let rebuilt = Model::from_records(&whole.snapshot());
    let in_flight = |m: &Model| m.requests.iter().filter(|r| r.ended.is_none()).count();
    assert_eq!((in_flight(&whole), in_flight(&rebuilt)), (1, 1));
    let again = Model::from_records(&rebuilt.snapshot());
    assert_eq!(in_flight(&again), 1, "a second compaction adds none");
}

/// One request fails alone, no larger than the three served before it, and the server keeps
/// nothing request after request: no long request (a lower context would refuse what it served),
/// and said so, with what would decide it.
#[test]
fn a_request_no_larger_than_those_served_is_no_long_request() {
    let mut t = Trace::vllm(16 * GIB);
    for (i, conn) in (7..10).enumerate() {
        let at = 200 * MS + i as u64 * 100 * MS;
        t.request(conn, at, 6_000, Some(at + 30 * MS));
        if i == 0 {
            t.alloc(at + 10 * MS, ENGINE, GIB, 0);
        }
        t.at(at + 60 * MS, API, Event::ConnClose { conn });
    }
    t.request(10, 600 * MS, 6_000, None);
    t.alloc(610 * MS, ENGINE, 2 * GIB, 0x51);
    let d = &t.diagnose(18 * GIB, &[], 0)[0];
    assert_eq!(d.category, Category::Inconclusive, "{}", d.fix.text);
    assert!(d.evidence.text.contains("no larger than the 5.9 KiB served before it"), "{}", d.evidence.text);
    assert!(!d.fix.text.contains("--max-model-len") && d.fix.text.contains("gputrace_kept_bytes_per_request"), "{}", d.fix.text);
    // A quarter larger than any served: a long request.
    let mut t = Trace::vllm(16 * GIB);
    t.request(7, 200 * MS, 6_000, Some(230 * MS));
    t.at(260 * MS, API, Event::ConnClose { conn: 7 });
    t.request(8, 300 * MS, 7_600, None);
    t.alloc(310 * MS, ENGINE, 2 * GIB, 0x51);
    assert_eq!(t.diagnose(18 * GIB, &[], 0)[0].category, Category::LongRequest);
}
