//! Holders: the programs that hold the device files by design (benign), the MPS server, who
//! keeps memory NVML counted before recording; and holders nobody accounts for: driver contexts
//! still holding memory at the end that no live, active service accounts for, and memory other
//! processes held before recording.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use super::services::Services;
use crate::event::Memory;
use crate::model::{display_command, Model};
use crate::trace::{Header, PriorUse};

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
    /// Worded by the report (`report/reasons.rs`), in its text and its JSON alike.
    pub why: Suspicion,
}

/// Why a context is a suspect holder.
#[derive(Clone, Debug, PartialEq)]
pub enum Suspicion {
    /// Its owner exited; another process still holds the device file without having allocated.
    OwnerExited { owner: u32, holder: u32, command: String },
    /// Its holder's parent exited.
    Orphan { pid: u32, parent: u32 },
    /// No allocation or request for this long.
    Idle { seconds: u64 },
    /// Held before recording began, by a process outside the traced ones.
    HeldBefore,
    /// NVML counts it for a process that is gone; another keeps the device files open.
    CountedForGone { counted: u32, holder: u32 },
    /// Had the device files open before recording began, NVML unavailable.
    OpenBefore,
}

/// Contexts still holding memory at the end that no live, active service accounts for, and
/// memory other processes held before recording.
pub fn suspects(header: &Header, model: &Model, services: &Services, idle_ns: u64) -> Vec<SuspectContext> {
    let start = model.time_zero(header.monotonic_start_ns);
    let end = model.last_ts;
    let mut out = Vec::new();
    // Live memory grouped by the files that keep it: its client's, and those it was exported to
    // or mapped through (memory shared with another process is a suspect of its own).
    let keeping = model.other_files_keeping();
    let holders_of = model.holders_by_file();
    // Each process's last allocation or request, in one pass (not one per group below).
    let mut active: HashMap<u32, u64> = HashMap::new();
    let times = model.allocations.iter().map(|a| (a.pid, a.ts)).chain(model.requests.iter().map(|r| (r.pid, r.ended.unwrap_or(r.arrived))));
    for (pid, ts) in times {
        let last = active.entry(pid).or_insert(ts);
        *last = (*last).max(ts);
    }
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
        let (mut holders, mut listed): (Vec<u32>, HashSet<u32>) = (Vec::new(), HashSet::new());
        for f in file.into_iter().chain(others) {
            let these = holders_of.get(&f).map_or(&[][..], Vec::as_slice);
            holders.extend(these.iter().copied().filter(|&h| listed.insert(h)));
        }
        let last_activity = holders.iter().filter_map(|h| active.get(h)).max().copied();
        let owner_exited = model.processes.get(&owner).is_some_and(|p| p.exited.is_some());
        let orphan =
            holders.iter().find(|&&h| model.processes.get(&model.processes[&h].ppid).is_some_and(|parent| parent.exited.is_some()));
        let why = if owner_exited && !holders.is_empty() {
            let holder = holders[0];
            Suspicion::OwnerExited { owner, holder, command: model.processes[&holder].command_line() }
        } else if let Some(&pid) = orphan {
            Suspicion::Orphan { pid, parent: model.processes[&pid].ppid }
        } else if last_activity.is_some_and(|t| end.saturating_sub(t) >= idle_ns) {
            Suspicion::Idle { seconds: end.saturating_sub(last_activity.unwrap_or(end)) / 1_000_000_000 }
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
        let (pid, command) = prior_holder(header, prior, |pid| services.of(pid).is_some());
        let why = if pid == prior.pid { Suspicion::HeldBefore } else { Suspicion::CountedForGone { counted: prior.pid, holder: pid } };
        out.push(SuspectContext { pid, command, bytes: prior.used_bytes, since: None, last_activity: None, why });
    }
    // Without NVML: who had the device files open before recording, outside the traced ones.
    if header.nvml != "ok" {
        let outside = |h: &&crate::trace::HolderAtStart| services.of(h.pid).is_none() && benign(h.exe.as_ref()).is_none();
        for h in header.holders_at_start.iter().filter(outside) {
            out.push(SuspectContext {
                pid: h.pid,
                command: display_command(&h.command),
                bytes: None,
                since: None,
                last_activity: None,
                why: Suspicion::OpenBefore,
            });
        }
    }
    out
}

/// Programs that hold the device files by design or briefly, never a cause to kill: the
/// persistence daemon, monitoring tools, the display server. With why.
const BENIGN: [(&str, &str); 10] = [
    ("nvidia-persistenced", "keeps the driver loaded by design"),
    ("nvidia-smi", "NVIDIA's monitoring tool, holds the files while it runs"),
    ("nv-hostengine", "DCGM's host engine (monitoring)"),
    ("dcgm-exporter", "DCGM's Prometheus exporter (monitoring)"),
    ("nvidia-powerd", "NVIDIA's power daemon"),
    ("nv-fabricmanager", "NVIDIA's NVSwitch fabric manager"),
    ("Xorg", "the display server"),
    ("Xwayland", "the display server"),
    ("gnome-shell", "the desktop's compositor"),
    ("gputrace", "this tool"),
];

/// Why a holder of the device files is benign, when it is: by the program it runs
/// (/proc/PID/exe), a system one (root's, where only root writes), never by argv[0], which any
/// process sets (`exec -a nvidia-persistenced`).
pub fn benign(exe: Option<&crate::procfs::command::Executable>) -> Option<&'static str> {
    let exe = exe.filter(|e| e.system)?;
    BENIGN.iter().find(|(name, _)| exe.name() == *name).map(|(_, why)| *why)
}

/// The MPS server (nvidia-cuda-mps-server), traced or holding the device files when recording
/// began: under MPS it makes every client's allocations, so they are its, not the clients'.
pub fn mps_server(model: &Model, header: &Header) -> Option<u32> {
    let is_mps = |command: &[String]| command.first().is_some_and(|p| is_mps_server(p));
    model
        .processes
        .values()
        .find(|p| is_mps(&p.command))
        .map(|p| p.pid)
        .or_else(|| header.holders_at_start.iter().find(|h| is_mps(&h.command)).map(|h| h.pid))
        // Started after recording began and not traced: NVML still lists it with its command.
        .or_else(|| model.samples.iter().flat_map(|(_, s)| &s.processes).find(|u| is_mps(&u.command)).map(|u| u.pid))
}

/// Whether a program (argv[0], or a command line starting with it) is the MPS server, which
/// makes the allocations of every MPS client.
pub fn is_mps_server(command: &str) -> bool {
    command.split_whitespace().next().and_then(|p| p.rsplit('/').next()) == Some("nvidia-cuda-mps-server")
}

/// Who keeps memory NVML counted before recording: the process it names when that is still there
/// with the device files open, else the process outside `inside` that keeps them open (a forked
/// child of a dead owner, an orphaned worker). Its pid and command.
pub fn prior_holder(header: &Header, prior: &PriorUse, inside: impl Fn(u32) -> bool) -> (u32, String) {
    let holder = header
        .holders_at_start
        .iter()
        .find(|h| h.pid == prior.pid)
        .or_else(|| header.holders_at_start.iter().find(|h| !inside(h.pid) && prior.command.is_empty()));
    match holder {
        Some(h) => (h.pid, display_command(&h.command)),
        None => (prior.pid, display_command(&prior.command)),
    }
}
