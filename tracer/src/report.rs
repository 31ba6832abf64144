//! The report: the verdict first, its evidence and fix, then per process and per phase what was
//! allocated, and the contexts nobody freed. Text for a person at a terminal, JSON for scripts
//! (the schema is documented in docs/report-schema.md). `record` prints it at the end, `report`
//! prints it for a trace file.

use serde::Serialize;

use crate::analysis::accounts::{Accounts, LoadedBefore};
use crate::analysis::diagnosis::diagnose;
use crate::analysis::headroom::{headroom, Headroom};
pub use crate::analysis::holders::SuspectContext;
use crate::analysis::holders::{mps_server, suspects};
pub use crate::analysis::nvml::Disagreement;
use crate::analysis::nvml::{disagreements, nvml_peaks, unaccounted};
use crate::analysis::usage::{allocations_by_pid, gpu_reports, process_report};
pub use crate::analysis::usage::{GpuReport, KeptAlive, KindTotals, ProcessReport};
use crate::analysis::whatif::{whatif, Failed, Outcome, Settings, WhyNot};
use crate::model::Model;
use crate::trace::Header;
use block::Block;

pub mod block;
pub mod headroom;
pub mod reasons;
pub mod status;
mod text;
pub mod verdict;
pub mod whatif;

pub use text::colour_wanted;

use verdict::{verdicts, Verdict};

pub const SCHEMA: &str = "gputrace-report/1";

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn notes(header: &Header, model: &Model) -> Vec<String> {
    let mut notes = Vec::new();
    if let Some(pid) = mps_server(model, header) {
        notes.push(format!(
            "MPS is in use (nvidia-cuda-mps-server, pid {pid}): it makes every client's allocations, so GPU memory shows as the server's, not the clients'; trace the clients' requests and the server together to tell them apart."
        ));
    }
    notes.extend(unaccounted(model).iter().map(reasons::unaccounted));
    notes
}

/// What the trace may be missing, always reported.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Loss {
    /// Records the kernel had no ring buffer room for.
    pub lost_records: u64,
    /// Followed driver calls whose params could not be read.
    pub undecodable: u64,
    /// Lines of the trace file that were damaged or torn.
    pub damaged_lines: u64,
    pub torn_tail: bool,
    /// NVIDIA fds not followed: more than a million held at once (only a crafted trace has that).
    #[serde(skip_serializing_if = "is_zero")]
    pub fds_not_followed: u64,
    /// Handles of batched exports and imports past the 16 of each the kernel side copies.
    #[serde(skip_serializing_if = "is_zero")]
    pub handles_not_followed: u64,
    /// Calls on another file's RM client, ignored (RM refuses them).
    #[serde(skip_serializing_if = "is_zero")]
    pub foreign_client_calls: u64,
    /// Opens, closes, dups and ioctls of NVIDIA files in threads with a file table of their own,
    /// which the kernel side does not follow (counted since recording or watching began).
    #[serde(skip_serializing_if = "is_zero")]
    pub own_file_table: u64,
    /// Processes past the model's bound ([`crate::model::MAX_PROCESSES`] at once): exited ones
    /// that held nothing, forgotten (nothing judged was theirs), and the records of processes
    /// not kept for want of room (what they did is not judged).
    #[serde(skip_serializing_if = "is_zero")]
    pub processes_forgotten: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub records_of_processes_not_kept: u64,
    /// Why the recorder stopped writing the trace (a full disk), when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_error: Option<String>,
}

impl Loss {
    /// The trace lacks part of what happened: records lost in the kernel, lines damaged or
    /// torn, or the recorder stopped writing. `report` exits 3 then.
    pub fn incomplete(&self) -> bool {
        self.lost_records > 0
            || self.damaged_lines > 0
            || self.torn_tail
            || self.write_error.is_some()
            || self.records_of_processes_not_kept > 0
    }

    /// What the model itself counted as missing or refused; the caller adds what it knows of
    /// the trace file and the decoder.
    pub fn of(model: &Model) -> Loss {
        Loss {
            lost_records: model.lost_records,
            undecodable: model.undecodable,
            fds_not_followed: model.fd_refs_dropped,
            handles_not_followed: model.handles_not_followed,
            foreign_client_calls: model.foreign_client_calls,
            processes_forgotten: model.processes_forgotten,
            records_of_processes_not_kept: model.records_not_kept,
            ..Loss::default()
        }
    }

    /// Nothing lost (processes forgotten are none of it).
    pub fn is_lossless(&self) -> bool {
        Loss { processes_forgotten: 0, ..self.clone() } == Loss::default()
    }
}

/// How the kernel-side fd filter behaved while recording (absent for a report of a trace file).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct FdFilter {
    /// Fds the kernel met without their open and asked about, once each.
    pub questions: u64,
    /// ioctls on such fds sent before the answer, dropped because the fd was not NVIDIA.
    pub pending_dropped: u64,
    /// Kernel map inserts refused because a map was full: fds or processes that may have been
    /// followed no more.
    pub map_inserts_failed: u64,
    /// Files at NVIDIA's paths that were not NVIDIA's devices (their device number), not followed.
    pub impostors: u64,
    /// Followed calls kept for their exit in the kernel's LRU map of calls in flight, not in
    /// their thread's slot (another thread of the same slot was inside a call; or, on a kernel
    /// without BPF's atomics, every call).
    pub calls_in_map: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub schema: &'static str,
    pub trace: String,
    pub duration_ns: u64,
    pub events: u64,
    /// The first failure's diagnosis, or category `none`.
    pub diagnosis: Verdict,
    /// The same laid out as a compiler's diagnostic: headline, where, evidence, help, check.
    pub block: Block,
    /// Every failure, in time order (the first MAX_DIAGNOSED of them).
    pub diagnoses: Vec<Verdict>,
    /// Failures past those, counted.
    #[serde(skip_serializing_if = "is_zero")]
    pub failures_not_diagnosed: u64,
    pub gpus: Vec<GpuReport>,
    pub processes: Vec<ProcessReport>,
    pub contexts_never_freed: Vec<SuspectContext>,
    /// Where NVML and the trace disagree about a traced process (needs NVML samples).
    pub nvml_vs_traced: Vec<Disagreement>,
    /// What the reader must know to read the figures right (MPS, say).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Per serving service and GPU: what a request costs and how many more fit.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub headroom: Vec<Headroom>,
    pub loss: Loss,
    /// Services that had loaded before the trace began: their load is not in it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub loaded_before: Vec<LoadedBefore>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fd_filter: Option<FdFilter>,
}

/// Reads a trace into the model record by record (the records are never all held), with what
/// reading lost: the start of `report` and every export. `redact` hides the secrets of command
/// and request lines as they are read.
pub fn load(path: &std::path::Path, redact: bool) -> Result<(Header, Model, u64, Loss), crate::trace::TraceError> {
    let reader = crate::trace::Reader::open(path)?;
    let mut model = Model::new();
    let mut events: u64 = 0;
    let prepare = |record: &mut crate::event::Record| {
        if redact {
            crate::redact::record(record);
        }
    };
    let (mut header, damage) = reader.read_ahead(prepare, |record| {
        model.apply(record);
        events += 1;
    })?;
    if redact {
        crate::redact::header(&mut header);
    }
    let loss =
        Loss { damaged_lines: damage.bad_lines.saturating_add(damage.torn_tail as u64), torn_tail: damage.torn_tail, ..Loss::of(&model) };
    Ok((header, model, events, loss))
}

/// `gputrace whatif`: the replay under `settings` of the first failure's service, on the GPU its
/// diagnosis judged (the busiest serving one when nothing failed).
pub fn what_if(header: &Header, model: &Model, lost: u64, settings: &Settings, search: bool) -> Result<Outcome, WhyNot> {
    let accounts = Accounts::new(header, model);
    let diagnosed = diagnose(&accounts, lost);
    if diagnosed.list.first().is_some_and(|d| d.category == crate::analysis::Category::KeptByService) {
        return Err(WhyNot::KeptByService);
    }
    let failed = diagnosed.first_failure().map(|(pid, gpu)| Failed { pid, gpu });
    whatif(&accounts, failed, settings, search)
}

impl Report {
    pub fn new(header: &Header, model: &Model, trace: String, events: u64, loss: Loss, idle_ns: u64) -> Report {
        let accounts = Accounts::new(header, model);
        let diagnosed = diagnose(&accounts, loss.lost_records);
        let diagnoses = verdicts(&diagnosed.list);
        let services = &accounts.services;
        let nvml_peaks = nvml_peaks(model);
        let kept = model.kept_alive();
        let allocations = allocations_by_pid(model);
        let processes = model
            .processes
            .values()
            .filter(|p| p.usage.allocations > 0 || p.usage.failed > 0 || kept.contains_key(&p.pid))
            .map(|p| {
                let own = allocations.get(&p.pid).map_or(&[][..], Vec::as_slice);
                process_report(p, own, model, services, nvml_peaks.get(&p.pid).copied(), kept.get(&p.pid))
            })
            .collect();
        let duration_ns = model.first_ts.map(|f| model.last_ts - f).unwrap_or(0);
        let first = &diagnosed.list[0];
        let engine = first.pid.and_then(|pid| services.of(pid)).map_or(&[][..], |s| accounts.engine(s));
        // The wall clock at the trace's start (the earliest record, a dump's snapshot's too).
        let wall_at_start = (header.wall_clock_start_ns > 0)
            .then(|| (header.wall_clock_start_ns as i128 + accounts.start() as i128 - header.monotonic_start_ns as i128).max(0) as u64);
        // A live watch's report ("live") has no file to replay.
        let file = Some(trace.as_str()).filter(|t| !t.is_empty() && *t != "live");
        let block = block::block(first, &block::Recorded { engine, wall_at_start, trace: file });
        Report {
            schema: SCHEMA,
            trace,
            duration_ns,
            events,
            diagnosis: diagnoses[0].clone(),
            block,
            failures_not_diagnosed: diagnosed.not_diagnosed as u64,
            contexts_never_freed: suspects(header, model, services, idle_ns),
            diagnoses,
            gpus: gpu_reports(header, model),
            nvml_vs_traced: disagreements(header, model),
            notes: notes(header, model),
            headroom: headroom(&accounts),
            processes,
            loss,
            loaded_before: accounts.loaded_before(),
            fd_filter: None,
        }
    }

    /// The report as text, for a terminal.
    pub fn text(&self) -> String {
        text::text(self)
    }

    /// The text as a terminal shows it: made safe (see [`crate::units::for_terminal`]), and in
    /// colour where `colour` (see [`colour_wanted`]).
    pub fn for_terminal(&self, colour: bool) -> String {
        let safe = crate::units::for_terminal(&self.text());
        if colour {
            text::painted(&safe)
        } else {
            safe
        }
    }

    /// The verdict in one line.
    pub fn headline(&self) -> String {
        text::headline(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Alloc, Device, Event, Memory, Record, Seen};

    fn header() -> Header {
        Header::default()
    }

    /// On a terminal the headline and the `help:` labels are coloured, nothing else; a command
    /// line's escape sequences were made harmless before (`^[`), so none can forge colour.
    #[test]
    fn the_verdicts_headline_and_help_are_coloured_on_a_terminal_only() {
        let text = "PARTIAL: cut\nOOM long-request: a 1 KiB prompt\n  --> pid 1\n   = help: -c 10  (now 20)\nHEADROOM: OOM x\n";
        let painted = text::painted(text);
        assert_eq!(
            painted,
            "\x1b[1;33mPARTIAL: cut\x1b[0m\n\x1b[1;31mOOM long-request: a 1 KiB prompt\x1b[0m\n  --> pid 1\n   = \x1b[1;36mhelp:\x1b[0m -c 10  (now 20)\nHEADROOM: OOM x\n"
        );
        let model = Model::from_records(&[Record::new(
            1,
            9,
            9,
            Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["\x1b[1;31mOOM".into()] },
        )]);
        let report = Report::new(&header(), &model, String::new(), 1, Loss::default(), u64::MAX);
        assert!(report.for_terminal(true).starts_with("\x1b[1;32mOK: nothing failed\x1b[0m\n"));
        assert!(!report.for_terminal(false).contains('\x1b') && !colour_wanted(false));
    }

    /// A server met running (`record --pid`): its load is not in the trace, and the report says
    /// so first, with what NVML counted for it. A watch's dump: what its snapshot holds from
    /// before the window. A server recorded from its start: nothing said.
    #[test]
    fn a_trace_that_began_after_a_server_loaded_says_so_first() {
        use crate::trace::PriorUse;
        const GIB: u64 = 1 << 30;
        let rec = |ts: u64, pid: u32, event| Record::new(ts, pid, pid, event);
        let server = |seen: Seen, alloc_ts: u64| {
            vec![
                rec(alloc_ts, 40, Event::Process { ppid: 1, seen, command: vec!["vllm".into(), "serve".into()] }),
                rec(alloc_ts, 40, Event::Object { fd: 3, client: 40, parent: 40, object: 40, class: 0x41, status: 0, gpu: None }),
                rec(alloc_ts + 1, 40, Event::Alloc(Alloc::video(40, 40, 0xa, GIB))),
                rec(1000, 40, Event::Bind { fd: 5, port: 8000 }),
            ]
        };
        let prior = vec![PriorUse { pid: 40, gpu: 0, used_bytes: Some(30 * GIB), command: vec![] }];
        let at = |start: u64, prior: Vec<PriorUse>| Header { monotonic_start_ns: start, prior_use: prior, nvml: "ok".into(), ..header() };
        // Met running, NVML's 30 GiB from before tracing.
        let model = Model::from_records(&server(Seen::Running, 500));
        let text = Report::new(&at(400, prior.clone()), &model, String::new(), 4, Loss::default(), u64::MAX).text();
        let first = text.lines().next().unwrap();
        assert!(
            first.starts_with("PARTIAL: `vllm serve` (pid 40) was running when tracing began: its load and the requests it served before are not in the trace; NVML counted 30.0 GiB for it when tracing began"),
            "{text}"
        );
        assert_eq!(text.lines().nth(1), Some("OK: nothing failed"), "{text}");
        // A dump: its allocation from before the window (ts 100 < the window's 400) is the
        // snapshot's.
        let model = Model::from_records(&server(Seen::Launched, 100));
        let report = Report::new(&at(400, vec![]), &model, String::new(), 4, Loss::default(), u64::MAX);
        assert!(
            report.text().starts_with("PARTIAL: `vllm serve` (pid 40) had loaded before this window began: the snapshot at its start holds its 1 allocation(s) of 1.0 GiB from before;"),
            "{}",
            report.text()
        );
        assert_eq!(serde_json::to_value(&report).unwrap()["loaded_before"][0]["snapshot_bytes"], GIB);
        // Launched while recorded: nothing to say.
        let model = Model::from_records(&server(Seen::Launched, 500));
        let report = Report::new(&at(400, vec![]), &model, String::new(), 4, Loss::default(), u64::MAX);
        assert!(report.text().starts_with("OK: nothing failed") && report.loaded_before.is_empty(), "{}", report.text());
    }

    /// NVML's figure against the traced one, at every sample: a process whose managed memory
    /// NVML counts shows the gap at the sample where it was widest, even when it freed
    /// everything before the last sample; a gap under 256 MiB, or a process NVML agrees with,
    /// says nothing.
    #[test]
    fn the_widest_gap_to_nvml_is_named_wherever_it_fell() {
        use crate::event::{Alloc, Event, ProcessUse, Sample, Seen};
        let rec = |ts: u64, pid: u32, event| Record::new(ts, pid, pid, event);
        let nvml = |ts: u64, used: &[(u32, u64)]| {
            let processes = used.iter().map(|&(pid, bytes)| ProcessUse { pid, gpu: 0, used_bytes: Some(bytes), command: vec![] }).collect();
            rec(ts, 0, Event::Sample(Sample { gpus: vec![], processes, host: None }))
        };
        let (managed, plain) = (10, 20);
        let mut t = vec![];
        for pid in [managed, plain] {
            t.push(rec(1, pid, Event::Process { ppid: 1, seen: Seen::Launched, command: vec![format!("p{pid}")] }));
            t.push(rec(2, pid, Event::Object { fd: 3, client: pid, parent: pid, object: pid, class: 0x41, status: 0, gpu: None }));
        }
        t.push(rec(3, managed, Event::Alloc(Alloc::video(managed, managed, 0xa, 1 << 30))));
        t.push(rec(3, plain, Event::Alloc(Alloc::video(plain, plain, 0xa, 1 << 30))));
        // Managed memory NVML counts and no ioctl shows: 3 GiB over the traced 1, then 100 MiB.
        t.push(nvml(10, &[(managed, 2 << 30), (plain, (1 << 30) + (100 << 20))]));
        t.push(nvml(20, &[(managed, 4 << 30), (plain, 1 << 30)]));
        t.push(rec(25, managed, Event::Free { fd: 3, via: crate::event::Via::RmFree, client: managed, parent: 0, object: 0xa, status: 0 }));
        t.push(nvml(30, &[(managed, 0), (plain, 1 << 30)]));
        let model = Model::from_records(&t);
        let with_nvml = Header { nvml: "ok".into(), ..header() };
        let report = Report::new(&with_nvml, &model, String::new(), 9, Loss::default(), u64::MAX);
        assert_eq!(report.nvml_vs_traced.len(), 1, "{:?}", report.nvml_vs_traced);
        let d = &report.nvml_vs_traced[0];
        assert_eq!((d.pid, d.ts, d.nvml_bytes, d.traced_bytes), (managed, 20, 4 << 30, 1 << 30), "the widest gap, not the last sample");
        assert!(d.why.to_string().contains("managed memory"), "{}", d.why);
        assert!(report.text().contains("managed memory"), "named in the text too");
        // NVML's own peak stands beside the traced one for every process it counted.
        let peaks: Vec<_> = report.processes.iter().map(|p| (p.pid, p.nvml_peak_bytes)).collect();
        assert_eq!(peaks, [(managed, Some(4 << 30)), (plain, Some((1 << 30) + (100 << 20)))]);
        assert!(report.text().contains("NVML PEAK"), "{}", report.text());
        // Without NVML, nothing is compared.
        assert!(Report::new(&header(), &model, String::new(), 9, Loss::default(), u64::MAX).nvml_vs_traced.is_empty());
    }

    /// A server's normal exit: its frees are traced as they happen, NVML's figure falls a moment
    /// later. A gap seen at one sample only, or in the last second before the exit, is no
    /// disagreement; one that holds over two samples while it runs is.
    #[test]
    fn nvml_lagging_a_teardown_is_no_disagreement() {
        use crate::event::{Alloc, Event, ProcessUse, Sample, Seen, Via};
        const S: u64 = 1_000_000_000;
        let rec = |ts: u64, pid: u32, event| Record::new(ts, pid, pid, event);
        let nvml = |ts: u64, pid: u32, bytes: u64| {
            let processes = vec![ProcessUse { pid, gpu: 0, used_bytes: Some(bytes), command: vec![] }];
            rec(ts, 0, Event::Sample(Sample { gpus: vec![], processes, host: None }))
        };
        let free =
            |ts: u64, pid: u32| rec(ts, pid, Event::Free { fd: 3, via: Via::RmFree, client: pid, parent: 0, object: 0xa, status: 0 });
        let server = |pid: u32, exit: u64, samples: &[(u64, u64)]| {
            let mut t = vec![
                rec(1, pid, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["server".into()] }),
                rec(2, pid, Event::Object { fd: 3, client: pid, parent: pid, object: pid, class: 0x41, status: 0, gpu: None }),
                rec(3, pid, Event::Alloc(Alloc::video(pid, pid, 0xa, 16 << 30))),
                nvml(S, pid, 16 << 30),
                free(10 * S, pid),
            ];
            t.extend(samples.iter().map(|&(ts, bytes)| nvml(ts, pid, bytes)));
            t.push(rec(exit, pid, Event::Exit { code: Some(0) }));
            let model = Model::from_records(&t);
            Report::new(&Header { nvml: "ok".into(), ..header() }, &model, String::new(), 9, Loss::default(), u64::MAX).nvml_vs_traced
        };
        // One late sample, then the exit long after: a lag, not a disagreement.
        assert_eq!(server(7, 20 * S, &[(10 * S + 1, 16 << 30)]), []);
        // Two samples in its last second: it is exiting.
        assert_eq!(server(7, 11 * S, &[(10 * S + 1, 16 << 30), (10 * S + S / 2, 16 << 30)]), []);
        // Two samples while it still runs for long after: NVML counts what the trace freed.
        let held = server(7, 20 * S, &[(10 * S + 1, 16 << 30), (10 * S + S / 2, 16 << 30)]);
        assert_eq!(held.iter().map(|d| (d.pid, d.nvml_bytes, d.traced_bytes)).collect::<Vec<_>>(), [(7, 16 << 30, 0)]);
    }

    /// A process met running with two GPUs' files: what it allocates under a device made before
    /// tracing is on one of them, and the row says which, never a bare '?'.
    #[test]
    fn memory_of_a_process_met_with_two_gpus_is_on_one_of_them() {
        use crate::event::{Alloc, Event, Seen};
        let rec = |ts: u64, event| Record::new(ts, 7, 7, event);
        let records = [
            rec(1, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["llama-server".into()] }),
            rec(2, Event::Attached { listening: vec![], gpus: vec![2, 3] }),
            rec(3, Event::Alloc(Alloc::video(0xc1, 0xd1, 0xa, 1 << 30))),
        ];
        let report = Report::new(&header(), &Model::from_records(&records), String::new(), 3, Loss::default(), u64::MAX);
        let row = report.gpus.iter().find(|g| g.gpu.is_none()).expect("a row of its own");
        assert_eq!(row.one_of, [2, 3]);
        assert!(report.text().lines().any(|l| l.starts_with("one of 2, 3 ")), "{}", report.text());
    }

    /// Managed memory touched on the GPU: the device's used memory rises, no process's NVML figure
    /// does. Named once it held over two samples, beyond the driver's own at the first sample; a
    /// one-sample blip is not.
    #[test]
    fn memory_no_process_accounts_for_is_named() {
        use crate::event::{Event, GpuUse, ProcessUse, Sample};
        const MIB: u64 = 1 << 20;
        let sample = |ts: u64, device: u64, process: u64| Record {
            ts,
            pid: 0,
            tid: 0,
            event: Event::Sample(Sample {
                gpus: vec![GpuUse { gpu: 0, used_bytes: device }],
                processes: vec![ProcessUse { pid: 7, gpu: 0, used_bytes: Some(process), command: vec![] }],
                host: None,
            }),
            raw: None,
        };
        let notes = |t: &[Record]| unaccounted(&Model::from_records(t)).iter().map(reasons::unaccounted).collect::<Vec<_>>();
        // The driver's own 500 MiB from the start, a process's 1 GiB, then 512 MiB more on the device.
        let base = [sample(0, 1524 * MIB, 1024 * MIB), sample(10, 1524 * MIB, 1024 * MIB)];
        let blip = [&base[..], &[sample(20, 2036 * MIB, 1024 * MIB), sample(30, 1524 * MIB, 1024 * MIB)]].concat();
        assert_eq!(notes(&blip), Vec::<String>::new());
        let managed = [&base[..], &[sample(20, 2036 * MIB, 1024 * MIB), sample(30, 2036 * MIB, 1024 * MIB)]].concat();
        let said = notes(&managed);
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0].starts_with("512.0 MiB used on GPU 0 that no process's NVML figure includes"), "{}", said[0]);
        assert!(said[0].contains("cudaMallocManaged"), "{}", said[0]);
    }

    /// Every loss is named, the rare ones only when they happened; none at all reads as none.
    #[test]
    fn losses_are_named_in_the_text() {
        let model = Model::new();
        let text = |loss: Loss| Report::new(&header(), &model, String::new(), 0, loss, u64::MAX).text();
        assert!(text(Loss::default()).contains("Lost events: 0."));
        let some = text(Loss { lost_records: 3, foreign_client_calls: 2, torn_tail: true, ..Loss::default() });
        assert!(some.contains("INCOMPLETE: 3 records lost in the kernel"), "{some}");
        assert!(some.contains(", torn last line, 2 calls RM refuses ignored (on another file's client"), "{some}");
        assert!(!some.contains("handles not followed") && !some.contains("device fds not followed"), "{some}");
        let own = text(Loss { own_file_table: 4, ..Loss::default() });
        assert!(
            own.contains("INCOMPLETE") && own.contains(", 4 fd events in threads with a file table of their own not followed"),
            "{own}"
        );
    }

    /// A process that allocated, then did nothing for longer than the threshold, is a suspect;
    /// one active within it is not.
    #[test]
    fn an_idle_context_is_a_suspect_after_the_threshold() {
        let rec = |ts: u64, event| Record::new(ts, 7, 7, event);
        let minute = 60_000_000_000u64;
        let records = vec![
            rec(0, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["old-server".into()] }),
            rec(1, Event::FdFound { fd: 3, file: 1, device: Device::Ctl }),
            rec(2, Event::Alloc(Alloc::video(1, 2, 3, 1 << 30))),
            rec(15 * minute, Event::Lost { records: 0 }),
        ];
        let model = Model::from_records(&records);
        let report = Report::new(&header(), &model, String::new(), 4, Loss::default(), 10 * minute);
        assert_eq!(report.contexts_never_freed.len(), 1);
        assert!(
            report.contexts_never_freed[0].why.to_string().contains("no allocation or request for 899 s"),
            "{:?}",
            report.contexts_never_freed
        );
        let report = Report::new(&header(), &model, String::new(), 4, Loss::default(), 20 * minute);
        assert!(report.contexts_never_freed.is_empty(), "active within the threshold");
    }

    /// The text report says where each GPU user ran when one ran in a container or a pid
    /// namespace of its own, with its pid there beside the host's; none of it for a host process.
    #[test]
    fn the_text_report_shows_the_container_and_the_pid_inside() {
        let rec = |pid: u32, event| Record::new(1, pid, pid, event);
        let user = |pid: u32, client: u32| {
            [
                rec(pid, Event::Process { ppid: 1, seen: Seen::Running, command: vec![format!("server{pid}")] }),
                rec(pid, Event::Open { fd: 3, file: u64::from(pid), device: Device::Ctl, cloexec: false }),
                rec(pid, Event::Object { fd: 3, client, parent: client, object: client, class: 0x41, status: 0, gpu: Some(0) }),
                rec(pid, Event::Alloc(Alloc::video(client, client, client + 1, 1 << 30))),
            ]
        };
        let inside = crate::event::Place {
            cgroup: "/kubepods/podabc/cri-containerd-0123456789ab.scope".into(),
            container: Some("0123456789ab".into()),
            pod: Some("6f1f7b9e-1111-2222-3333-444455556666".into()),
            namespace: Some("llm".into()),
            pod_name: Some("vllm-0".into()),
            ns_pid: Some(1),
            uid: None,
        };
        let mut records: Vec<Record> = user(4000, 10).into_iter().chain(user(5000, 20)).collect();
        records.insert(1, rec(4000, Event::Place(inside)));
        let model = Model::from_records(&records);
        let text = Report::new(&header(), &model, String::new(), 8, Loss::default(), u64::MAX).text();
        let table = text.split("(where each ran)").nth(1).expect("a table of where each ran");
        let row = table.lines().find(|l| l.trim_start().starts_with("4000")).expect("the containerised process's row");
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells, ["4000", "1", "0123456789ab", "llm/vllm-0"], "{text}");
        assert!(!table.split("(bytes allocated").next().unwrap().contains("5000"), "a host process has no row: {text}");

        let host_only = Model::from_records(&user(5000, 20));
        assert!(!Report::new(&header(), &host_only, String::new(), 4, Loss::default(), u64::MAX).text().contains("where each ran"));
    }

    /// Memory its owner exported to a file before exiting is held by whoever holds that file
    /// now: that process is named as the holder, though it never allocated it.
    #[test]
    fn the_holder_of_an_exported_file_holds_the_memory() {
        let rec = |ts: u64, pid: u32, event| Record::new(ts, pid, pid, event);
        let (exporter, importer) = (100, 200);
        let records = vec![
            rec(1, exporter, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["trainer".into()] }),
            rec(1, exporter, Event::Open { fd: 3, file: 1, device: Device::Ctl, cloexec: false }),
            rec(2, exporter, Event::Object { fd: 3, client: 1, parent: 1, object: 1, class: 0x41, status: 0, gpu: None }),
            rec(3, exporter, Event::Alloc(Alloc::video(1, 1, 2, 8 << 30))),
            rec(4, exporter, Event::Open { fd: 4, file: 2, device: Device::Ctl, cloexec: false }),
            rec(5, exporter, Event::ExportObject { fd: 3, client: 1, object: 2, to_fd: 4, status: 0 }),
            rec(6, importer, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["peer".into()] }),
            rec(7, importer, Event::FdFound { fd: 9, file: 2, device: Device::Ctl }),
            rec(8, exporter, Event::Exit { code: Some(0) }),
        ];
        let model = Model::from_records(&records);
        assert_eq!(model.live(Memory::Video), 8 << 30);
        let report = Report::new(&header(), &model, String::new(), 9, Loss::default(), u64::MAX);
        let suspect = report.contexts_never_freed.iter().find(|c| c.pid == importer).expect("the export file's holder is a suspect");
        assert_eq!(suspect.bytes, Some(8 << 30));
        let why = suspect.why.to_string();
        assert!(why.contains("owner pid 100 exited") && why.contains("pid 200"), "{why}");
    }

    /// Of an exited owner's memory, what it exported is a suspect of its own: the process that
    /// holds only the export file is not charged with the rest, which a forked child keeps.
    #[test]
    fn exported_memory_and_the_rest_are_told_apart() {
        let rec = |ts: u64, pid: u32, event| Record::new(ts, pid, pid, event);
        let (owner, peer, child) = (300, 200, 400);
        let records = vec![
            rec(1, owner, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["server".into()] }),
            rec(1, owner, Event::Open { fd: 3, file: 1, device: Device::Ctl, cloexec: false }),
            rec(2, owner, Event::Object { fd: 3, client: 1, parent: 1, object: 1, class: 0x41, status: 0, gpu: None }),
            rec(3, owner, Event::Alloc(Alloc::video(1, 1, 2, 10 << 30))),
            rec(3, owner, Event::Alloc(Alloc::video(1, 1, 5, 1 << 30))),
            rec(4, owner, Event::Open { fd: 4, file: 2, device: Device::Ctl, cloexec: false }),
            rec(5, owner, Event::ExportObject { fd: 3, client: 1, object: 5, to_fd: 4, status: 0 }),
            rec(6, peer, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["peer".into()] }),
            rec(7, peer, Event::FdFound { fd: 9, file: 2, device: Device::Ctl }),
            rec(8, child, Event::Process { ppid: owner, seen: Seen::Forked, command: vec!["server".into()] }),
            rec(9, owner, Event::Close { fd: 4 }),
            rec(10, owner, Event::Exit { code: Some(0) }),
        ];
        let model = Model::from_records(&records);
        assert_eq!(model.live(Memory::Video), 11 << 30);
        let report = Report::new(&header(), &model, String::new(), 9, Loss::default(), u64::MAX);
        let of = |pid: u32| report.contexts_never_freed.iter().filter(|c| c.pid == pid).map(|c| c.bytes).collect::<Vec<_>>();
        assert_eq!(of(child), [Some(10 << 30), Some(1 << 30)], "the child keeps the client: all of it, the export too");
        assert_eq!(of(peer), Vec::<Option<u64>>::new(), "named after the client's holder: {:?}", report.contexts_never_freed);
    }
}
