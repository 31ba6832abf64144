//! The report: the verdict first, its evidence and fix, then per process and per phase what was
//! allocated, and the contexts nobody freed. Text for a person at a terminal, JSON for scripts
//! (the schema is documented in docs/report-schema.md). `record` prints it at the end, `report`
//! prints it for a trace file.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use serde::Serialize;

use crate::analysis::diagnosis::{Category, Diagnoser, Diagnosis};
use crate::analysis::headroom::Headroom;
use crate::analysis::sweep::LiveChanges;
use crate::analysis::{Phase, Services};
use crate::event::Memory;
use crate::model::{add, Model, Process};
use crate::trace::Header;
use crate::units::bytes;

pub const SCHEMA: &str = "gputrace-report/1";

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct KindTotals {
    pub allocated: u64,
    pub freed: u64,
    pub live: u64,
    /// The most of this kind live at once.
    pub peak: u64,
}

/// One GPU: what NVML said of it and the video memory traced on it. `gpu` is None for memory
/// whose device was set up before tracing began (which GPU it is on cannot be told).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct GpuReport {
    pub gpu: Option<u32>,
    pub name: Option<String>,
    pub capacity_bytes: Option<u64>,
    /// What NVML counted for processes on it when recording began.
    pub held_before_bytes: u64,
    /// Traced video memory: the most live at once (and when), and live at the end.
    pub peak_bytes: u64,
    pub peak_ts: Option<u64>,
    pub live_bytes: u64,
    pub failed_allocations: u64,
    /// Processes that allocated on it.
    pub pids: Vec<u32>,
    /// On the row of memory whose GPU cannot be told (`gpu` null): the GPUs it may be on, those
    /// whose device files its processes held when met running.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub one_of: Vec<u32>,
}

impl GpuReport {
    /// The GPU as a reader is told it: its index, or "one of 2, 3", or "?".
    pub fn label(&self) -> String {
        match (self.gpu, self.one_of.as_slice()) {
            (Some(i), _) => i.to_string(),
            (None, []) => "?".into(),
            (None, some) => format!("one of {}", some.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")),
        }
    }
}

/// Physical bytes are video + system; virtual address space is only in `by_kind`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ProcessReport {
    pub pid: u32,
    pub ppid: u32,
    pub command: String,
    /// The service (the process tree it belongs to), by its root's command.
    pub service: String,
    pub allocations: u64,
    pub failed_allocations: u64,
    pub bytes_allocated: u64,
    pub bytes_freed: u64,
    pub bytes_peak: u64,
    pub bytes_live: u64,
    pub by_kind: BTreeMap<&'static str, KindTotals>,
    /// Physical bytes allocated in each phase of its service.
    pub by_phase: BTreeMap<&'static str, u64>,
    /// Of those, what is live now.
    pub live_by_phase: BTreeMap<&'static str, u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    pub exited: bool,
    /// Its cgroup, container, pod and pid inside its container, where recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub place: Option<crate::event::Place>,
    /// The most device memory NVML counted for it at once (over every sample and GPU): beside the
    /// traced video peak, what no ioctl shows (the context's own, managed memory) is visible.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvml_peak_bytes: Option<u64>,
    /// Memory of exited processes that this one keeps alive by holding the file it lives on
    /// (not in its own figures above): who allocated it, and how much.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub keeps: Vec<Kept>,
}

/// Physical memory an exited process allocated, kept alive by another.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Kept {
    /// The process that allocated it (exited).
    pub pid: u32,
    pub command: String,
    pub bytes: u64,
}

impl ProcessReport {
    /// What it keeps alive for exited processes, in all.
    pub fn kept_bytes(&self) -> u64 {
        self.keeps.iter().map(|k| k.bytes).fold(0, u64::saturating_add)
    }
}

/// A driver context (an open nvidiactl file and the clients on it) still holding memory that no
/// live, active service accounts for; or memory held before recording by another process.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SuspectContext {
    pub pid: u32,
    pub command: String,
    /// None when nothing can tell (a holder from before recording, with NVML unavailable).
    pub bytes: Option<u64>,
    /// Nanoseconds since the trace start; None when it was already held before recording.
    pub since: Option<u64>,
    pub last_activity: Option<u64>,
    pub why: String,
}

/// Where NVML's count for a traced process and the traced allocations disagree, and why.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Disagreement {
    pub pid: u32,
    pub command: String,
    /// When NVML was asked (ns since the trace start).
    pub ts: u64,
    pub nvml_bytes: u64,
    /// Video memory the trace shows live for it at that moment.
    pub traced_bytes: u64,
    pub why: String,
}

/// NVML's per-process figures against the traced video memory of each traced process, at every
/// sample taken while recording (not only the last: a process that frees before it exits hides
/// its gap from the end): for each process, the sample where they differ most, when that is by
/// 256 MiB and 10% or more.
/// How long before its exit a process counts as exiting, for NVML comparisons.
const EXITING_NS: u64 = 1_000_000_000;

fn disagreements(header: &Header, model: &Model) -> Vec<Disagreement> {
    if header.nvml != "ok" {
        return Vec::new();
    }
    let start = model.time_zero(header.monotonic_start_ns);
    // Traced live video bytes per pid, swept forward through the samples: each allocation's
    // start and end in time order, applied up to each sample's time (what is live at `ts`).
    let mut changes = LiveChanges::of(model.allocations.iter().filter(|a| a.memory == Memory::Video).map(|a| (a, a.pid)));
    let mut samples: Vec<&(u64, crate::event::Sample)> = model.samples.iter().filter(|(_, s)| !s.processes.is_empty()).collect();
    samples.sort_by_key(|(ts, _)| *ts);
    let mut live: HashMap<u32, i128> = HashMap::new();
    let mut worst: BTreeMap<u32, (u64, u64, u64)> = BTreeMap::new();
    // Which way each pid's gap went at the previous sample (true: NVML above the trace). A gap
    // is judged only when it held over two samples: NVML lags the frees a process makes.
    let mut was_above: HashMap<u32, bool> = HashMap::new();
    for (ts, sample) in samples {
        while let Some((_, delta, pid)) = changes.next_if(|c| c.0 <= *ts) {
            let bytes = live.entry(pid).or_default();
            *bytes += delta;
            // Only what is live stays: each sample looks at NVML's pids and these, not at every
            // process ever seen (a day of `record --all` forks).
            if *bytes == 0 {
                live.remove(&pid);
            }
        }
        let mut nvml_of: BTreeMap<u32, u64> = BTreeMap::new();
        for u in &sample.processes {
            add(nvml_of.entry(u.pid).or_default(), u.used_bytes.unwrap_or(0));
        }
        let mut pids: Vec<u32> = nvml_of.keys().chain(live.keys()).copied().filter(|pid| model.processes.contains_key(pid)).collect();
        pids.sort_unstable();
        pids.dedup();
        let mut above_now = HashMap::new();
        for pid in pids {
            let nvml = nvml_of.get(&pid).copied().unwrap_or(0);
            let traced = u64::try_from(live.get(&pid).copied().unwrap_or(0).max(0)).unwrap_or(u64::MAX);
            let gap = nvml.abs_diff(traced);
            // A process in its last second is tearing down: its frees are traced before NVML sees them.
            let exiting = model.processes[&pid].exited.is_some_and(|exit| (*ts).saturating_add(EXITING_NS) >= exit);
            if gap < 256 << 20 || gap < nvml.max(traced) / 10 || exiting {
                continue;
            }
            above_now.insert(pid, nvml > traced);
            if was_above.get(&pid) != Some(&(nvml > traced)) {
                continue;
            }
            let entry = worst.entry(pid).or_insert((*ts, nvml, traced));
            if gap > entry.1.abs_diff(entry.2) {
                *entry = (*ts, nvml, traced);
            }
        }
        was_above = above_now;
    }
    let mut out = Vec::new();
    for (pid, (ts, nvml, traced)) in worst {
        let p = &model.processes[&pid];
        let before = header.prior_use.iter().any(|u| u.pid == pid && u.used_bytes.unwrap_or(0) > 0);
        let why = if nvml > traced && (before || p.seen == crate::event::Seen::Running) {
            "it allocated memory before recording began, which no traced ioctl shows".to_string()
        } else if nvml > traced {
            "NVML counts memory no traced ioctl shows: the CUDA context's own (a few hundred MiB), managed memory (cudaMallocManaged), or memory the driver allocates itself".to_string()
        } else {
            "the trace counts memory NVML does not count for it: memory shared with or handed to another process, or not yet backed"
                .to_string()
        };
        out.push(Disagreement {
            pid,
            command: p.command_line(),
            ts: ts.saturating_sub(start),
            nvml_bytes: nvml,
            traced_bytes: traced,
            why,
        });
    }
    out
}

fn notes(header: &Header, model: &Model) -> Vec<String> {
    let mut notes = Vec::new();
    if let Some(pid) = crate::analysis::mps_server(model, header) {
        notes.push(format!(
            "MPS is in use (nvidia-cuda-mps-server, pid {pid}): it makes every client's allocations, so GPU memory shows as the server's, not the clients'; trace the clients' requests and the server together to tell them apart."
        ));
    }
    notes.extend(unaccounted(model));
    notes
}

/// Memory used on a GPU that no process's NVML figure includes, beyond what was so at the first
/// sample, when it held over two samples: managed memory touched on the GPU is in the device's
/// used memory and in no process's figure (seen on the real driver). The widest per GPU.
fn unaccounted(model: &Model) -> Vec<String> {
    let start = model.first_ts.unwrap_or(0);
    let mut samples: Vec<&(u64, crate::event::Sample)> = model.samples.iter().filter(|(_, s)| !s.gpus.is_empty()).collect();
    samples.sort_by_key(|(ts, _)| *ts);
    // Per GPU: the figure at its first sample, at the previous one, and the widest that held.
    let mut first: BTreeMap<u32, u64> = BTreeMap::new();
    let mut previous: BTreeMap<u32, u64> = BTreeMap::new();
    let mut widest: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for (ts, sample) in samples {
        let mut now = BTreeMap::new();
        for g in &sample.gpus {
            let on_it = sample.processes.iter().filter(|p| p.gpu == g.gpu);
            // A process NVML gives no figure for: nothing can be told of this GPU at this sample.
            let Some(counted) = on_it.map(|p| p.used_bytes).try_fold(0u64, |sum, b| Some(sum.saturating_add(b?))) else {
                continue;
            };
            let beyond =
                g.used_bytes.saturating_sub(counted).saturating_sub(*first.entry(g.gpu).or_insert(g.used_bytes.saturating_sub(counted)));
            now.insert(g.gpu, beyond);
            let held = beyond.min(previous.get(&g.gpu).copied().unwrap_or(0));
            if held >= 256 << 20 && widest.get(&g.gpu).is_none_or(|w| held > w.1) {
                widest.insert(g.gpu, (*ts, held));
            }
        }
        previous = now;
    }
    widest
        .into_iter()
        .map(|(gpu, (ts, b))| {
            format!(
                "{} used on GPU {gpu} that no process's NVML figure includes (at {:.1} s, beyond what was so when sampling began): managed memory (cudaMallocManaged) touched on the GPU, which NVML counts for the device and not the process, or the driver's own.",
                bytes(b),
                ts.saturating_sub(start) as f64 / 1e9
            )
        })
        .collect()
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
    /// Why the recorder stopped writing the trace (a full disk), when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_error: Option<String>,
}

impl Loss {
    /// What the model itself counted as missing or refused; the caller adds what it knows of
    /// the trace file and the decoder.
    pub fn of(model: &Model) -> Loss {
        Loss {
            lost_records: model.lost_records,
            undecodable: model.undecodable,
            fds_not_followed: model.fd_refs_dropped,
            handles_not_followed: model.handles_not_followed,
            foreign_client_calls: model.foreign_client_calls,
            ..Loss::default()
        }
    }

    pub fn is_lossless(&self) -> bool {
        *self == Loss::default()
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
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub schema: &'static str,
    pub trace: String,
    pub duration_ns: u64,
    pub events: u64,
    /// The first failure's diagnosis, or category `none`.
    pub diagnosis: Diagnosis,
    /// Every failure, in time order (the first MAX_DIAGNOSED of them).
    pub diagnoses: Vec<Diagnosis>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fd_filter: Option<FdFilter>,
}

fn physical(map: &BTreeMap<Memory, u64>) -> u64 {
    map.get(&Memory::Video).copied().unwrap_or(0).saturating_add(map.get(&Memory::System).copied().unwrap_or(0))
}

/// Per pid, the most device memory NVML counted for it in one sample (summed over its GPUs).
fn nvml_peaks(model: &Model) -> HashMap<u32, u64> {
    let mut peaks: HashMap<u32, u64> = HashMap::new();
    for (_, sample) in &model.samples {
        let mut used: HashMap<u32, u64> = HashMap::new();
        for u in &sample.processes {
            add(used.entry(u.pid).or_default(), u.used_bytes.unwrap_or(0));
        }
        for (pid, bytes) in used {
            let peak = peaks.entry(pid).or_default();
            *peak = (*peak).max(bytes);
        }
    }
    peaks
}

fn process_report(
    p: &Process,
    model: &Model,
    services: &Services,
    nvml_peak_bytes: Option<u64>,
    keeps: Option<&BTreeMap<u32, u64>>,
) -> ProcessReport {
    let u = &p.usage;
    let by_kind = Memory::ALL
        .iter()
        .map(|m| {
            let get = |map: &BTreeMap<Memory, u64>| map.get(m).copied().unwrap_or(0);
            (m.name(), KindTotals { allocated: get(&u.allocated), freed: get(&u.freed), live: get(&u.live), peak: get(&u.peak) })
        })
        .collect();
    let mut by_phase: BTreeMap<&'static str, u64> = Phase::ALL.iter().map(|ph| (ph.name(), 0)).collect();
    let mut live_by_phase = by_phase.clone();
    for a in model.allocations.iter().filter(|a| a.pid == p.pid && a.memory != Memory::Virtual) {
        let phase = services.phase_of(a.pid, a.ts).name();
        add(by_phase.entry(phase).or_default(), a.bytes);
        if a.freed.is_none() {
            add(live_by_phase.entry(phase).or_default(), a.bytes);
        }
    }
    ProcessReport {
        pid: p.pid,
        ppid: p.ppid,
        command: p.command_line(),
        service: services.of(p.pid).map(|s| s.name.clone()).unwrap_or_default(),
        allocations: u.allocations,
        failed_allocations: u.failed,
        bytes_allocated: physical(&u.allocated),
        bytes_freed: physical(&u.freed),
        bytes_peak: u.peak_physical,
        bytes_live: physical(&u.live),
        by_kind,
        by_phase,
        live_by_phase,
        exit_code: p.exit_code,
        exited: p.exited.is_some(),
        place: p.place.clone(),
        nvml_peak_bytes,
        keeps: keeps
            .into_iter()
            .flatten()
            .map(|(&pid, &bytes)| Kept { pid, command: model.processes.get(&pid).map(Process::command_line).unwrap_or_default(), bytes })
            .collect(),
    }
}

/// Every GPU NVML described and every GPU memory was traced on, in order (memory on a GPU that
/// cannot be told last): each one's own peak, so a tensor-parallel rank that filled up shows.
fn gpu_reports(header: &Header, model: &Model) -> Vec<GpuReport> {
    let start = model.time_zero(header.monotonic_start_ns);
    // The GPUs in order, allocations on a GPU not known last.
    let mut keys: BTreeSet<(bool, Option<u32>)> = header.gpus.iter().map(|g| (false, Some(g.index))).collect();
    let video_gpus = model.allocations.iter().filter(|a| a.memory == Memory::Video).map(|a| model.gpu_for(a.pid, a.gpu));
    let failed_gpus = model.failures.iter().filter(|f| f.memory == Memory::Video).map(|f| model.gpu_for(f.pid, f.gpu));
    keys.extend(video_gpus.chain(failed_gpus).map(|k| (k.is_none(), k)));
    keys.into_iter()
        .map(|(_, gpu)| {
            let card = gpu.and_then(|g| header.gpus.iter().find(|c| c.index == g));
            let video = || model.allocations.iter().filter(move |a| model.gpu_for(a.pid, a.gpu) == gpu && a.memory == Memory::Video);
            let (mut live, mut peak, mut peak_ts) = (0i128, 0i128, None);
            for (t, d, ()) in LiveChanges::of(video().map(|a| (a, ()))) {
                live += d;
                if live > peak {
                    (peak, peak_ts) = (live, Some(t.saturating_sub(start)));
                }
            }
            let mut pids: Vec<u32> = video().map(|a| a.pid).collect();
            pids.sort();
            pids.dedup();
            let clamp = |v: i128| v.clamp(0, u64::MAX.into()) as u64;
            let mut one_of: Vec<u32> = match gpu {
                Some(_) => Vec::new(),
                None => pids.iter().filter_map(|pid| model.processes.get(pid)?.attached.as_ref()).flat_map(|a| a.gpus.clone()).collect(),
            };
            one_of.sort_unstable();
            one_of.dedup();
            GpuReport {
                gpu,
                name: card.map(|c| c.name.clone()),
                capacity_bytes: card.and_then(|c| c.total_bytes),
                held_before_bytes: header
                    .prior_use
                    .iter()
                    .filter(|p| Some(p.gpu) == gpu)
                    .map(|p| p.used_bytes.unwrap_or(0))
                    .fold(0, u64::saturating_add),
                peak_bytes: clamp(peak),
                peak_ts,
                live_bytes: clamp(live),
                failed_allocations: model
                    .failures
                    .iter()
                    .filter(|f| model.gpu_for(f.pid, f.gpu) == gpu && f.memory == Memory::Video)
                    .count() as u64,
                pids,
                one_of,
            }
        })
        .collect()
}

/// Contexts still holding memory at the end that no live, active service accounts for, and
/// memory other processes held before recording.
fn suspects(header: &Header, model: &Model, services: &Services, idle_ns: u64) -> Vec<SuspectContext> {
    let start = model.time_zero(header.monotonic_start_ns);
    let end = model.last_ts;
    let mut out = Vec::new();
    // Live memory grouped by the files that keep it: its client's, and those it was exported to
    // or mapped through (memory shared with another process is a suspect of its own).
    let keeping = model.other_files_keeping();
    let mut by_files: BTreeMap<(Option<u64>, Vec<u64>), Vec<&crate::model::Allocation>> = BTreeMap::new();
    for (id, a) in model.allocations.iter().enumerate().filter(|(_, a)| a.freed.is_none() && a.memory != Memory::Virtual) {
        let mut others: Vec<u64> = keeping.get(&id).into_iter().flatten().copied().filter(|&f| Some(f) != a.file).collect();
        others.sort_unstable();
        others.dedup();
        by_files.entry((a.file, others)).or_default().push(a);
    }
    for ((file, others), allocs) in by_files {
        let owner = allocs[0].pid;
        let bytes = allocs.iter().map(|a| a.bytes).fold(0, u64::saturating_add);
        let since = allocs.iter().map(|a| a.ts).min().unwrap_or(start);
        // Whoever holds the client's file comes first; then whoever holds a file it went to.
        let mut holders: Vec<u32> = Vec::new();
        for f in file.into_iter().chain(others) {
            let mut these = model.holders(f);
            these.sort_unstable();
            holders.extend(these.into_iter().filter(|h| !holders.contains(h)).collect::<Vec<_>>());
        }
        let last_activity = model
            .allocations
            .iter()
            .filter(|a| holders.contains(&a.pid))
            .map(|a| a.ts)
            .chain(model.requests.iter().filter(|r| holders.contains(&r.pid)).map(|r| r.ended.unwrap_or(r.arrived)))
            .max();
        let owner_exited = model.processes.get(&owner).is_some_and(|p| p.exited.is_some());
        let orphan =
            holders.iter().find(|&&h| model.processes.get(&model.processes[&h].ppid).is_some_and(|parent| parent.exited.is_some()));
        let why = if owner_exited && !holders.is_empty() {
            let h = holders[0];
            format!(
                "its owner pid {owner} exited; pid {h} (`{}`) still holds the device file, without having allocated it",
                model.processes[&h].command_line()
            )
        } else if let Some(&h) = orphan {
            format!("pid {h} is an orphan: its parent pid {} exited", model.processes[&h].ppid)
        } else if last_activity.is_some_and(|t| end.saturating_sub(t) >= idle_ns) {
            format!("no allocation or request for {} s", end.saturating_sub(last_activity.unwrap_or(end)) / 1_000_000_000)
        } else {
            continue;
        };
        let holder = holders.first().copied().unwrap_or(owner);
        let command = model.processes.get(&holder).map(|p| p.command_line()).unwrap_or_default();
        out.push(SuspectContext {
            pid: holder,
            command,
            bytes: Some(bytes),
            since: Some(since.saturating_sub(start)),
            last_activity: last_activity.map(|t| t.saturating_sub(start)),
            why,
        });
    }
    for prior in &header.prior_use {
        if services.of(prior.pid).is_some() {
            continue;
        }
        let (pid, command) = crate::analysis::prior_holder(header, prior, |pid| services.of(pid).is_some());
        let why = if pid == prior.pid {
            "held before recording began, by a process outside the traced ones".to_string()
        } else {
            format!("NVML counts it for pid {}, which is gone; pid {pid} keeps the device files open", prior.pid)
        };
        out.push(SuspectContext { pid, command, bytes: prior.used_bytes, since: None, last_activity: None, why });
    }
    // Without NVML: who had the device files open before recording, outside the traced ones.
    if header.nvml != "ok" {
        let outside = |h: &&crate::trace::HolderAtStart| services.of(h.pid).is_none() && crate::analysis::benign(h.exe.as_ref()).is_none();
        for h in header.holders_at_start.iter().filter(outside) {
            out.push(SuspectContext {
                pid: h.pid,
                command: crate::model::display_command(&h.command),
                bytes: None,
                since: None,
                last_activity: None,
                why: "had the GPU's device files open before recording began; NVML was unavailable, so how much it holds is unknown".into(),
            });
        }
    }
    out
}

/// Reads a trace into the model record by record (the records are never all held), with what
/// reading lost: the start of `report` and every export. `redact` hides the secrets of command
/// and request lines as they are read.
pub fn load(path: &std::path::Path, redact: bool) -> Result<(Header, Model, u64, Loss), crate::trace::TraceError> {
    let mut reader = crate::trace::Reader::open(path)?;
    let mut model = Model::new();
    let mut events: u64 = 0;
    for record in reader.by_ref() {
        let mut record = record?;
        if redact {
            crate::redact::record(&mut record);
        }
        model.apply(&record);
        events += 1;
    }
    if redact {
        crate::redact::header(&mut reader.header);
    }
    let damage = &reader.damage;
    let loss =
        Loss { damaged_lines: damage.bad_lines.saturating_add(damage.torn_tail as u64), torn_tail: damage.torn_tail, ..Loss::of(&model) };
    Ok((reader.header, model, events, loss))
}

impl Report {
    pub fn new(header: &Header, model: &Model, trace: String, events: u64, loss: Loss, idle_ns: u64) -> Report {
        let diagnoser = Diagnoser::new(header, model, loss.lost_records);
        let diagnoses = diagnoser.diagnose();
        let services = diagnoser.services();
        let nvml_peaks = nvml_peaks(model);
        let kept = model.kept_alive();
        let processes = model
            .processes
            .values()
            .filter(|p| p.usage.allocations > 0 || p.usage.failed > 0 || kept.contains_key(&p.pid))
            .map(|p| process_report(p, model, services, nvml_peaks.get(&p.pid).copied(), kept.get(&p.pid)))
            .collect();
        let duration_ns = model.first_ts.map(|f| model.last_ts - f).unwrap_or(0);
        Report {
            schema: SCHEMA,
            trace,
            duration_ns,
            events,
            diagnosis: diagnoses[0].clone(),
            failures_not_diagnosed: diagnoser.undiagnosed() as u64,
            contexts_never_freed: suspects(header, model, services, idle_ns),
            diagnoses,
            gpus: gpu_reports(header, model),
            nvml_vs_traced: disagreements(header, model),
            notes: notes(header, model),
            headroom: diagnoser.headroom(),
            processes,
            loss,
            fd_filter: None,
        }
    }

    pub fn text(&self) -> String {
        let mut out = String::new();
        let d = &self.diagnosis;

        let when = d.ts.map(|t| format!(" at {:.2} s", t as f64 / 1e9)).unwrap_or_default();
        let service = d.service.as_ref().map(|s| format!(" in `{s}`")).unwrap_or_default();
        if d.category == Category::None {
            let _ = writeln!(out, "VERDICT: none. {}", d.evidence.text);
        } else {
            let _ = writeln!(out, "VERDICT: {} ({}){service}{when}", d.category.name(), d.symptom.name());
            let _ = writeln!(out, "  {}{}", d.evidence.text, d.repeats());
            let _ = writeln!(out, "FIX: {}", d.fix.text);
        }
        for note in &self.notes {
            let _ = writeln!(out, "NOTE: {note}");
        }
        for later in self.diagnoses.iter().skip(1) {
            let _ = writeln!(
                out,
                "then{}: {} — {}{}",
                later.ts.map(|t| format!(" at {:.2} s", t as f64 / 1e9)).unwrap_or_default(),
                later.category.name(),
                later.evidence.text,
                later.repeats()
            );
        }
        if self.failures_not_diagnosed > 0 {
            let _ = writeln!(out, "and {} more failures, not diagnosed one by one", self.failures_not_diagnosed);
        }
        for h in &self.headroom {
            let _ = writeln!(out, "HEADROOM: {}.", h.text());
        }
        let seconds = self.duration_ns as f64 / 1e9;
        let _ = writeln!(out, "\n{} events over {seconds:.1} s in {}", self.events, self.trace);
        let traced = |g: &&GpuReport| g.peak_bytes > 0 || g.held_before_bytes > 0 || g.failed_allocations > 0;
        if self.gpus.iter().filter(traced).count() > 0 {
            let _ = writeln!(
                out,
                "\n{:<5} {:<24} {:>11} {:>11} {:>11} {:>9} {:>11} {:>6}",
                "GPU", "NAME", "CAPACITY", "BEFORE", "PEAK", "AT", "LIVE", "FAILED"
            );
            for g in self.gpus.iter().filter(traced) {
                let _ = writeln!(
                    out,
                    "{:<5} {:<24} {:>11} {:>11} {:>11} {:>9} {:>11} {:>6}",
                    g.label(),
                    clip(g.name.as_deref().unwrap_or(if g.gpu.is_some() { "?" } else { "(device set up before tracing)" }), 24),
                    g.capacity_bytes.map_or("?".into(), bytes),
                    bytes(g.held_before_bytes),
                    bytes(g.peak_bytes),
                    g.peak_ts.map_or("-".into(), |t| format!("{:.2} s", t as f64 / 1e9)),
                    bytes(g.live_bytes),
                    g.failed_allocations
                );
            }
        }
        if !self.processes.is_empty() {
            // PEAK is video memory, what runs out on a discrete GPU; pinned host memory beside it.
            // NVML's own peak beside the traced one, where NVML counted any traced process.
            let nvml = self.processes.iter().any(|p| p.nvml_peak_bytes.is_some());
            let _ = writeln!(
                out,
                "\n{:>8}  {:<28} {:>7} {:>11} {:>11} {:>11} {:>11} {:>11} {:>6}{}",
                "PID",
                "COMMAND",
                "ALLOCS",
                "ALLOCATED",
                "FREED",
                "PEAK",
                "HOST PEAK",
                "LIVE",
                "FAILED",
                if nvml { format!(" {:>11}", "NVML PEAK") } else { String::new() }
            );
            for p in &self.processes {
                let peak = |kind: Memory| bytes(p.by_kind.get(kind.name()).map_or(0, |k| k.peak));
                let _ = writeln!(
                    out,
                    "{:>8}  {:<28} {:>7} {:>11} {:>11} {:>11} {:>11} {:>11} {:>6}{}",
                    p.pid,
                    clip(&p.command, 28),
                    p.allocations,
                    bytes(p.bytes_allocated),
                    bytes(p.bytes_freed),
                    peak(Memory::Video),
                    peak(Memory::System),
                    bytes(p.bytes_live),
                    p.failed_allocations,
                    if nvml { format!(" {:>11}", p.nvml_peak_bytes.map_or_else(|| "-".into(), bytes)) } else { String::new() }
                );
            }
            // Memory whose allocator exited, under the live process that keeps it.
            for p in &self.processes {
                for k in &p.keeps {
                    let _ = writeln!(
                        out,
                        "{:>8}  keeps {} alive for pid {} (`{}`), which exited: it holds the file that memory lives on",
                        p.pid,
                        bytes(k.bytes),
                        k.pid,
                        clip(&k.command, 60)
                    );
                }
            }
            // Where each ran, only when some ran in a container, a pod or a pid namespace of its own.
            let placed: Vec<(&ProcessReport, &crate::event::Place)> = self
                .processes
                .iter()
                .filter_map(|p| Some((p, p.place.as_ref()?)))
                .filter(|(_, w)| w.container.is_some() || w.pod.is_some() || w.ns_pid.is_some())
                .collect();
            if !placed.is_empty() {
                let _ = writeln!(out, "\n{:>8}  {:>8}  {:<13} {:<36}   (where each ran)", "PID", "NS PID", "CONTAINER", "POD");
                for (p, w) in placed {
                    let ns_pid = w.ns_pid.map_or_else(|| "-".to_string(), |n| n.to_string());
                    // NAMESPACE/NAME where the node names the pod, else its UID.
                    let pod = match (&w.namespace, &w.pod_name, &w.pod) {
                        (Some(namespace), Some(name), _) => format!("{namespace}/{name}"),
                        (_, _, Some(uid)) => uid.clone(),
                        _ => "-".into(),
                    };
                    let _ = writeln!(out, "{:>8}  {:>8}  {:<13} {:<36}", p.pid, ns_pid, w.container.as_deref().unwrap_or("-"), pod);
                }
            }
            let _ = writeln!(
                out,
                "\n{:>8}  {:>11} {:>11} {:>11} {:>11}   (bytes allocated in each phase)",
                "PID", "LOAD", "PREFILL", "DECODE", "IDLE"
            );
            for p in &self.processes {
                let get = |ph: &str| bytes(p.by_phase.get(ph).copied().unwrap_or(0));
                let _ = writeln!(out, "{:>8}  {:>11} {:>11} {:>11} {:>11}", p.pid, get("load"), get("prefill"), get("decode"), get("idle"));
            }
        }
        if !self.contexts_never_freed.is_empty() {
            let _ = writeln!(out, "\nCONTEXTS NEVER FREED");
            for c in &self.contexts_never_freed {
                let since = c.since.map(|s| format!("since {:.2} s", s as f64 / 1e9)).unwrap_or_else(|| "since before recording".into());
                let held = c.bytes.map_or_else(|| "? bytes".to_string(), bytes);
                let _ = writeln!(out, "  pid {} `{}`: {held} {since}: {}", c.pid, clip(&c.command, 60), c.why);
            }
        }
        if !self.nvml_vs_traced.is_empty() {
            let _ = writeln!(out, "\nNVML AND THE TRACE DISAGREE");
            for d in &self.nvml_vs_traced {
                let _ = writeln!(
                    out,
                    "  pid {} `{}`: NVML {}, traced {} at {:.2} s: {}",
                    d.pid,
                    clip(&d.command, 40),
                    bytes(d.nvml_bytes),
                    bytes(d.traced_bytes),
                    d.ts as f64 / 1e9,
                    d.why
                );
            }
        }
        let l = &self.loss;
        if let Some(why) = &l.write_error {
            let _ =
                writeln!(out, "TRACE CUT SHORT: {why}; the report above still covers the whole run, the trace file only up to the error.");
        }
        if l.is_lossless() {
            let _ = writeln!(out, "Lost events: 0.");
        } else {
            // The rarer losses, each named only when it happened.
            let rare = [
                (l.fds_not_followed, "device fds not followed (over a million held)"),
                (
                    l.handles_not_followed,
                    "exported or imported handles not followed (past the first 16 of a batch: their memory's lifetime is not known)",
                ),
                (
                    l.own_file_table,
                    "fd events in threads with a file table of their own not followed (unshare(CLONE_FILES), close_range(CLOSE_RANGE_UNSHARE): their fd numbers are not their process's)",
                ),
                (
                    l.foreign_client_calls,
                    "calls RM refuses ignored (on another file's client, or taking another process's memory it did not share: params or a fd changed by another thread while the call ran, records lost before, or an edited trace)",
                ),
            ];
            let rare: String = rare.iter().filter(|(n, _)| *n > 0).map(|(n, what)| format!(", {n} {what}")).collect();
            let _ = writeln!(
                out,
                "INCOMPLETE: {} records lost in the kernel (ring buffer full), {} driver calls unreadable, {} damaged trace lines{}{rare}.",
                l.lost_records,
                l.undecodable,
                l.damaged_lines,
                if l.torn_tail { ", torn last line" } else { "" },
            );
        }
        out
    }
}

fn clip(text: &str, width: usize) -> String {
    if text.chars().count() > width {
        text.chars().take(width - 1).collect::<String>() + "…"
    } else {
        text.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Alloc, Device, Event, Record, Seen, Via};

    fn header() -> Header {
        Header::default()
    }

    /// NVML's figure against the traced one, at every sample: a process whose managed memory
    /// NVML counts shows the gap at the sample where it was widest, even when it freed
    /// everything before the last sample; a gap under 256 MiB, or a process NVML agrees with,
    /// says nothing.
    #[test]
    fn the_widest_gap_to_nvml_is_named_wherever_it_fell() {
        use crate::event::{Alloc, Event, ProcessUse, Sample, Seen};
        let rec = |ts: u64, pid: u32, event| Record { ts, pid, tid: pid, event, raw: None };
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
        assert!(d.why.contains("managed memory"), "{}", d.why);
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
        let rec = |ts: u64, pid: u32, event| Record { ts, pid, tid: pid, event, raw: None };
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
        let rec = |ts: u64, event| Record { ts, pid: 7, tid: 7, event, raw: None };
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
        let notes = |t: &[Record]| unaccounted(&Model::from_records(t));
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
        let rec = |ts: u64, event| Record { ts, pid: 7, tid: 7, event, raw: None };
        let minute = 60_000_000_000u64;
        let records = vec![
            rec(0, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["old-server".into()] }),
            rec(1, Event::FdFound { fd: 3, file: 1, device: Device::Ctl }),
            rec(
                2,
                Event::Alloc(Alloc {
                    fd: 3,
                    via: Via::RmAllocNvos64,
                    memory: Memory::Video,
                    bytes: 1 << 30,
                    status: 0,
                    client: 1,
                    parent: 2,
                    object: 3,
                    class: 0x40,
                    base: None,
                    errno: None,
                    holds: None,
                }),
            ),
            rec(15 * minute, Event::Lost { records: 0 }),
        ];
        let model = Model::from_records(&records);
        let report = Report::new(&header(), &model, String::new(), 4, Loss::default(), 10 * minute);
        assert_eq!(report.contexts_never_freed.len(), 1);
        assert!(report.contexts_never_freed[0].why.contains("no allocation or request for 899 s"), "{:?}", report.contexts_never_freed);
        let report = Report::new(&header(), &model, String::new(), 4, Loss::default(), 20 * minute);
        assert!(report.contexts_never_freed.is_empty(), "active within the threshold");
    }

    /// The text report says where each GPU user ran when one ran in a container or a pid
    /// namespace of its own, with its pid there beside the host's; none of it for a host process.
    #[test]
    fn the_text_report_shows_the_container_and_the_pid_inside() {
        let rec = |pid: u32, event| Record { ts: 1, pid, tid: pid, event, raw: None };
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
        let rec = |ts: u64, pid: u32, event| Record { ts, pid, tid: pid, event, raw: None };
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
        assert!(suspect.why.contains("owner pid 100 exited") && suspect.why.contains("pid 200"), "{}", suspect.why);
    }

    /// Of an exited owner's memory, what it exported is a suspect of its own: the process that
    /// holds only the export file is not charged with the rest, which a forked child keeps.
    #[test]
    fn exported_memory_and_the_rest_are_told_apart() {
        let rec = |ts: u64, pid: u32, event| Record { ts, pid, tid: pid, event, raw: None };
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
