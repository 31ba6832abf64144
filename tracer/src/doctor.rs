//! `gputrace doctor`: the first step of every out-of-memory investigation, with no tracing. Who
//! holds each GPU now (NVML's per-process figures and a /proc scan of the device files, as
//! `fuser -v /dev/nvidia*` would), which holders are stale and why, and the one action to take.
//!
//! Observing (/proc twice, half a second apart, and NVML) is [`observe`]; judging is [`assess`],
//! a pure function of what was observed, so every rule is tested without a GPU or root.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::model::display_command;
use crate::procfs;
use crate::trace::{Gpu, PriorUse};
use crate::units::bytes;

/// One process holding NVIDIA device files, as observed.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FileHolder {
    pub pid: u32,
    pub ppid: u32,
    pub pgrp: u32,
    pub session: u32,
    /// R, S, D, T (stopped), Z...
    pub state: char,
    pub uid: Option<u32>,
    pub user: Option<String>,
    pub command: Vec<String>,
    /// The program it runs, from /proc/PID/exe: what a process cannot lie about.
    pub exe: Option<procfs::command::Executable>,
    /// "ctl", "gpu", "uvm".
    pub devices: Vec<String>,
    pub cgroup: Option<String>,
    pub container: Option<String>,
    pub age_seconds: u64,
    /// Share of one CPU it used while observed (half a second).
    pub cpu_percent: f64,
    pub listening: Vec<u16>,
}

/// Everything [`assess`] judges from.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub gpus: Vec<Gpu>,
    /// NVML's per-process figures, by GPU.
    pub usage: Vec<PriorUse>,
    /// "ok", or why NVML could not be asked.
    pub nvml: String,
    /// MemTotal and MemAvailable: what capacity and free mean on unified memory.
    pub host_memory: Option<(u64, u64)>,
    pub holders: Vec<FileHolder>,
    /// Every process there is (not zombies): whose parent, group leader or NVML pid is gone.
    pub alive: HashSet<u32>,
    /// Processes whose open files could not be read (another user's, run without root): a
    /// holder among them is not in `holders`.
    pub hidden: usize,
}

impl Observed {
    fn nvml_ok(&self) -> bool {
        self.nvml == "ok"
    }
    /// Unified memory (DGX Spark, Grace Hopper): NVML answers per process but has no device totals.
    fn unified(&self) -> bool {
        self.nvml_ok() && !self.gpus.is_empty() && self.gpus.iter().all(|g| g.total_bytes.is_none())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Something about it says it should not be holding the GPU.
    Stale,
    /// Holds the files by design; never to be killed.
    Benign,
    /// Nothing against it.
    Active,
}

#[derive(Clone, Debug, Serialize)]
pub struct Assessed {
    #[serde(flatten)]
    pub holder: FileHolder,
    /// Video memory NVML counts for it (None without NVML), and what it keeps alive for processes
    /// that are gone.
    pub bytes: Option<u64>,
    pub kept_for: Vec<KeptFor>,
    pub verdict: Verdict,
    /// Why it is stale (or benign); each a sentence.
    pub reasons: Vec<String>,
    /// What is worth knowing but proves nothing (idle, no memory of its own).
    pub notes: Vec<String>,
}

/// Memory NVML still counts for a process that is gone, kept alive by a holder of its files.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KeptFor {
    pub pid: u32,
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct GpuState {
    pub index: u32,
    pub name: String,
    pub capacity_bytes: Option<u64>,
    pub used_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    /// Where capacity and free come from: "nvml", or "host" on unified memory (MemTotal,
    /// MemAvailable: GPU memory is host RAM there).
    pub source: &'static str,
}

#[derive(Clone, Debug, Serialize)]
pub struct Recommendation {
    pub kill: u32,
    pub command: String,
    pub bytes: Option<u64>,
    pub why: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Doctor {
    pub schema: &'static str,
    pub gpus: Vec<GpuState>,
    pub nvml: String,
    pub unified_memory: bool,
    pub holders: Vec<Assessed>,
    /// NVML counts memory for these pids, which are gone, and no holder could be tied to them.
    pub unattributed: Vec<KeptFor>,
    pub recommendation: Option<Recommendation>,
    /// Processes whose open files could not be read (not root): the view is partial.
    pub processes_not_seen: usize,
    /// The user it ran as (0: root).
    pub uid: u32,
}

pub const SCHEMA: &str = "gputrace-doctor/1";

impl Doctor {
    /// 1 when something stale was found, 0 when not (2 is for errors).
    pub fn exit_code(&self) -> u8 {
        u8::from(self.holders.iter().any(|h| h.verdict == Verdict::Stale))
    }
}

fn minutes(seconds: u64) -> String {
    match seconds {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

/// Judges each holder. `idle_minutes`: a holder that long alive, with no CPU and no listening
/// socket, gets a note.
pub fn assess(o: &Observed, idle_minutes: u64) -> Doctor {
    // Memory NVML counts for pids that are gone: kept alive by whoever holds their open files.
    // Without a recording, the one sign that a holder shares them is that it inherited them: it
    // was forked in the family that pid led (its process group or session) and holds a GPU's
    // device file. Anyone else merely holding a device file proves nothing; such memory is
    // unattributed rather than charged to an innocent holder.
    let mut dead: BTreeMap<u32, u64> = BTreeMap::new();
    for u in o.usage.iter().filter(|u| !o.alive.contains(&u.pid)) {
        *dead.entry(u.pid).or_default() += u.used_bytes.unwrap_or(0);
    }
    let mut kept: BTreeMap<u32, Vec<KeptFor>> = BTreeMap::new();
    let mut unattributed = Vec::new();
    for (&pid, &b) in &dead {
        let heir = o.holders.iter().find(|h| (h.pgrp == pid || h.session == pid) && h.devices.iter().any(|d| d == "gpu"));
        match heir {
            Some(holder) => kept.entry(holder.pid).or_default().push(KeptFor { pid, bytes: b }),
            None => unattributed.push(KeptFor { pid, bytes: b }),
        }
    }

    let mut holders: Vec<Assessed> = o.holders.iter().map(|h| judge(o, h, kept.remove(&h.pid).unwrap_or_default(), idle_minutes)).collect();

    second_copies(&mut holders);

    let recommendation =
        holders.iter().filter(|a| a.verdict == Verdict::Stale).max_by_key(|a| (a.bytes.unwrap_or(0), std::cmp::Reverse(a.holder.pid))).map(
            |a| Recommendation {
                kill: a.holder.pid,
                command: display_command(&a.holder.command),
                bytes: a.bytes,
                why: a.reasons[0].clone(),
            },
        );

    let unified = o.unified();
    let gpus = gpu_states(o);
    holders.sort_by_key(|a| (a.verdict != Verdict::Stale, std::cmp::Reverse(a.bytes.unwrap_or(0)), a.holder.pid));
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    Doctor {
        schema: SCHEMA,
        gpus,
        nvml: o.nvml.clone(),
        unified_memory: unified,
        holders,
        unattributed,
        recommendation,
        processes_not_seen: o.hidden,
        uid,
    }
}

/// One holder judged: benign, stale (with why) or active, with notes.
fn judge(o: &Observed, h: &FileHolder, kept_for: Vec<KeptFor>, idle_minutes: u64) -> Assessed {
    let nvml_bytes = |pid: u32| -> Option<u64> {
        o.nvml_ok().then(|| o.usage.iter().filter(|u| u.pid == pid).filter_map(|u| u.used_bytes).fold(0, u64::saturating_add))
    };
    // A daemon stopped or dead holds the GPU for no one: no longer benign, whatever it runs.
    let benign = |h: &FileHolder| crate::analysis::holders::benign(h.exe.as_ref()).filter(|_| !matches!(h.state, 'T' | 't' | 'Z'));
    let own = nvml_bytes(h.pid);
    let bytes = own.map(|b| kept_for.iter().fold(b, |sum, k| sum.saturating_add(k.bytes)));
    let mut reasons = Vec::new();
    let mut notes = Vec::new();
    if let Some(why) = benign(h) {
        return Assessed { holder: h.clone(), bytes, kept_for, verdict: Verdict::Benign, reasons: vec![why.into()], notes };
    }
    match h.state {
        'T' | 't' => reasons.push("stopped (SIGSTOP or a debugger): it holds the GPU without running".to_string()),
        'Z' => reasons.push("a zombie: it exited and nobody reaped it".to_string()),
        _ => {}
    }
    for k in &kept_for {
        reasons.push(format!(
            "keeps the device files of pid {}, which is gone: NVML still counts {} for it",
            k.pid,
            bytes_or_unknown(Some(k.bytes))
        ));
    }
    if h.pgrp != h.pid && h.pgrp != 0 && !o.alive.contains(&h.pgrp) {
        reasons.push(format!(
            "orphaned: the leader of its process group, pid {}, is gone (the server that started it exited or was killed)",
            h.pgrp
        ));
    } else if h.ppid == 1 && h.session != h.pid && h.pgrp != h.pid {
        reasons.push("orphaned: reparented to init, and not a daemon of its own".to_string());
    }
    if h.age_seconds >= idle_minutes.saturating_mul(60) && h.cpu_percent == 0.0 && h.listening.is_empty() {
        notes.push(format!("idle: no CPU while observed and no listening socket, up {}", minutes(h.age_seconds)));
    }
    if own == Some(0) && kept_for.is_empty() {
        notes.push("holds the device files with no memory of its own".to_string());
    }
    let verdict = if reasons.is_empty() { Verdict::Active } else { Verdict::Stale };
    Assessed { holder: h.clone(), bytes, kept_for, verdict, reasons, notes }
}

/// A second copy of a server that does not listen, while the first does: it could not take
/// the port, and holds the GPU for nothing. A copy is the same program (the same file), the
/// same command line and the same owner: anyone can start a process whose command line
/// matches root's, and that makes root's server no copy of theirs.
fn second_copies(holders: &mut [Assessed]) {
    let listening: Vec<FileHolder> = holders.iter().map(|a| &a.holder).filter(|h| !h.listening.is_empty()).cloned().collect();
    let same_program = |a: &FileHolder, b: &FileHolder| {
        let identity = |h: &FileHolder| h.exe.as_ref().map(|e| (e.dev, e.ino));
        // Two command lines that could not be read are not known to be the same.
        let readable = |h: &FileHolder| h.command.first().is_some_and(|c| c != procfs::command::UNREADABLE);
        identity(a).is_some() && identity(a) == identity(b) && a.uid.is_some() && a.uid == b.uid && a.command == b.command && readable(a)
    };
    for a in holders.iter_mut().filter(|a| a.verdict != Verdict::Benign && a.holder.listening.is_empty()) {
        if let Some((pid, ports)) =
            listening.iter().find(|h| h.pid != a.holder.pid && same_program(h, &a.holder)).map(|h| (h.pid, &h.listening))
        {
            let ports: Vec<String> = ports.iter().map(|p| format!(":{p}")).collect();
            a.reasons.push(format!("a second copy of pid {pid}, which serves the same command line on {}", ports.join(", ")));
            a.verdict = Verdict::Stale;
        }
    }
}

/// Each GPU's state: NVML's, or on unified memory the host's.
fn gpu_states(o: &Observed) -> Vec<GpuState> {
    let unified = o.unified();
    o.gpus
        .iter()
        .map(|g| match (unified, o.host_memory) {
            (true, Some((total, available))) => GpuState {
                index: g.index,
                name: g.name.clone(),
                capacity_bytes: Some(total),
                used_bytes: Some(total.saturating_sub(available)),
                free_bytes: Some(available),
                source: "host",
            },
            _ => GpuState {
                index: g.index,
                name: g.name.clone(),
                capacity_bytes: g.total_bytes,
                used_bytes: g.used_bytes,
                free_bytes: g.total_bytes.zip(g.used_bytes).map(|(t, u)| t.saturating_sub(u)),
                source: "nvml",
            },
        })
        .collect()
}

fn bytes_or_unknown(b: Option<u64>) -> String {
    b.map_or_else(|| "?".to_string(), bytes)
}

impl Doctor {
    pub fn text(&self) -> String {
        let mut out = String::new();
        let partial = self.processes_not_seen > 0;
        if partial {
            let _ = writeln!(
                out,
                "PARTIAL: run as uid {}, gputrace could not read the open files of {} processes of other users: a holder among them is not listed below. As root (`sudo gputrace doctor`) it would be.",
                self.uid, self.processes_not_seen
            );
        }
        let seen = if partial { " it could see" } else { "" };
        if self.nvml != "ok" {
            let _ = writeln!(out, "{}. What /proc shows follows: who holds the device files, not how much.", self.nvml);
        }
        for g in &self.gpus {
            let figures = match (g.capacity_bytes, g.used_bytes, g.free_bytes) {
                (Some(c), Some(u), Some(f)) => format!("{} total, {} used, {} free", bytes(c), bytes(u), bytes(f)),
                _ => "capacity unknown (NVML reports no device memory)".to_string(),
            };
            let host = if g.source == "host" { " (unified memory: GPU memory is host RAM; free is MemAvailable)" } else { "" };
            let _ = writeln!(out, "GPU {} {}: {figures}{host}", g.index, g.name);
        }
        if self.holders.is_empty() {
            let _ = writeln!(out, "No process{seen} holds an NVIDIA device file.");
        } else {
            let _ = writeln!(out, "\n{:>8}  {:<10} {:>10} {:>5} {:>11}  {:<12} COMMAND", "PID", "USER", "UP", "CPU", "MEMORY", "CONTAINER");
            for a in &self.holders {
                let h = &a.holder;
                let user = h.user.clone().or_else(|| h.uid.map(|u| u.to_string())).unwrap_or_else(|| "?".into());
                let _ = writeln!(
                    out,
                    "{:>8}  {:<10} {:>10} {:>4.0}% {:>11}  {:<12} {}",
                    h.pid,
                    user,
                    minutes(h.age_seconds),
                    h.cpu_percent,
                    bytes_or_unknown(a.bytes),
                    h.container.as_deref().unwrap_or("-"),
                    display_command(&h.command)
                );
                let label = match a.verdict {
                    Verdict::Stale => "STALE",
                    Verdict::Benign => "benign",
                    Verdict::Active => "",
                };
                for r in &a.reasons {
                    let _ = writeln!(out, "{:>10}{label}: {r}", "");
                }
                for n in &a.notes {
                    let _ = writeln!(out, "{:>10}note: {n}", "");
                }
            }
        }
        for u in &self.unattributed {
            let _ = writeln!(out, "NVML counts {} for pid {}, which is gone; no holder could be tied to it.", bytes(u.bytes), u.pid);
        }
        match &self.recommendation {
            Some(r) => {
                let held = r.bytes.map_or_else(|| "an amount NVML cannot tell".to_string(), bytes);
                let _ = writeln!(out, "\nRECOMMENDED: kill {}  (`{}`: {}; it holds {held})", r.kill, r.command, r.why);
            }
            None => {
                let _ = writeln!(out, "\nNothing stale: every holder{seen} is active or benign.");
            }
        }
        out
    }
}

/// Reads what there is to judge: NVML, the host's memory, and every holder of the device files,
/// its CPU use measured over half a second.
pub fn observe() -> Observed {
    let nvml = crate::gpus::snapshot();
    let hz = procfs::ticks_per_second() as f64;
    let uptime = procfs::uptime_seconds().unwrap_or(0.0);
    let majors = crate::devices::Majors::of_host().unwrap_or_else(|e| {
        eprintln!("gputrace: warning: {e}; device files are judged by path alone");
        None
    });
    let found = crate::devices::nvidia_holders(majors);
    let before: Vec<Option<procfs::Stat>> = found.iter().map(|h| procfs::stat(h.pid)).collect();
    let window = Duration::from_millis(500);
    std::thread::sleep(window);
    // Each network namespace's socket tables, read once.
    let mut tables = std::collections::HashMap::new();
    let holders = found
        .into_iter()
        .zip(before)
        .filter_map(|(h, before)| {
            let now = procfs::stat(h.pid)?;
            let used = now.cpu_ticks.saturating_sub(before.map_or(now.cpu_ticks, |b| b.cpu_ticks)) as f64 / hz;
            let cgroup = procfs::place::cgroup(h.pid);
            let uid = procfs::place::owner(h.pid);
            Some(FileHolder {
                pid: h.pid,
                ppid: now.ppid,
                pgrp: now.pgrp,
                session: now.session,
                state: now.state,
                uid,
                user: uid.and_then(crate::user::name_of),
                command: h.command,
                exe: h.exe,
                devices: h.devices,
                container: cgroup.as_deref().and_then(procfs::place::container_of),
                cgroup,
                age_seconds: (uptime - now.start_ticks as f64 / hz).max(0.0) as u64,
                cpu_percent: (used / window.as_secs_f64() * 100.0).round(),
                listening: procfs::net::listening_ports(h.pid, &mut tables),
            })
        })
        .collect();
    Observed {
        gpus: nvml.gpus,
        usage: nvml.prior_use,
        nvml: nvml.note,
        host_memory: procfs::meminfo(),
        holders,
        alive: procfs::all_pids().into_iter().filter(|&p| procfs::running(p)).collect(),
        hidden: procfs::all_pids().into_iter().filter(|&p| procfs::fds::hidden(p)).count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// A process running the program its argv[0] names, a system one, as uid 1000.
    fn holder(pid: u32, ppid: u32, pgrp: u32, command: &str) -> FileHolder {
        let program = command.split(' ').next().unwrap_or_default().rsplit('/').next().unwrap_or_default();
        let ino = program.bytes().fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        FileHolder {
            pid,
            ppid,
            pgrp,
            session: pgrp,
            state: 'S',
            uid: Some(1000),
            exe: Some(procfs::command::Executable { path: format!("/usr/bin/{program}"), dev: 1, ino, system: true }),
            command: command.split(' ').map(String::from).collect(),
            devices: vec!["ctl".into(), "gpu".into(), "uvm".into()],
            age_seconds: 3600,
            cpu_percent: 0.0,
            ..FileHolder::default()
        }
    }

    fn observed(holders: Vec<FileHolder>, usage: &[(u32, u64)]) -> Observed {
        let alive = holders.iter().flat_map(|h| [h.pid, h.ppid]).chain([1]).collect();
        Observed {
            gpus: vec![Gpu { index: 0, name: "H100".into(), total_bytes: Some(80 * GIB), used_bytes: Some(72 * GIB) }],
            usage: usage.iter().map(|&(pid, b)| PriorUse { pid, gpu: 0, used_bytes: Some(b), command: vec![] }).collect(),
            nvml: "ok".into(),
            host_memory: Some((128 * GIB, 100 * GIB)),
            holders,
            alive,
            hidden: 0,
        }
    }

    /// vLLM's API server was killed: its engine, in the dead server's process group, holds 71 GiB.
    /// A running server and nvidia-persistenced beside it are left alone.
    #[test]
    fn an_orphaned_engine_is_the_one_to_kill() {
        let mut server = holder(500, 400, 500, "vllm serve other-model");
        server.listening = vec![8001];
        let o = observed(
            vec![
                holder(4703, 1, 4702, "python3 -m vllm.v1.engine.core"),
                server,
                holder(90, 1, 90, "/usr/bin/nvidia-persistenced --user nvidia-persistenced"),
            ],
            &[(4703, 71 * GIB), (500, 8 * GIB)],
        );
        let d = assess(&o, 10);
        let r = d.recommendation.as_ref().expect("a recommendation");
        assert_eq!((r.kill, r.bytes), (4703, Some(71 * GIB)));
        assert!(r.why.contains("pid 4702, is gone"), "{}", r.why);
        let verdict = |pid: u32| d.holders.iter().find(|a| a.holder.pid == pid).unwrap().verdict;
        assert_eq!((verdict(500), verdict(90)), (Verdict::Active, Verdict::Benign));
        assert_eq!(d.exit_code(), 1);
        assert!(d.text().contains("RECOMMENDED: kill 4703"), "{}", d.text());
    }

    /// llama-server was killed; the helper it forked still holds the device files. NVML counts
    /// the memory for the dead server's pid: the helper keeps it.
    #[test]
    fn a_forked_child_keeps_its_dead_parents_memory() {
        let o = observed(vec![holder(812, 1, 800, "llama-server -m model.gguf")], &[(800, 14 * GIB)]);
        let d = assess(&o, 10);
        let a = &d.holders[0];
        assert_eq!((a.verdict, a.bytes), (Verdict::Stale, Some(14 * GIB)));
        assert_eq!(a.kept_for, vec![KeptFor { pid: 800, bytes: 14 * GIB }]);
        assert!(a.reasons.iter().any(|r| r.contains("keeps the device files of pid 800")), "{:?}", a.reasons);
        assert_eq!(d.recommendation.unwrap().kill, 812);
    }

    /// Without NVML the same holder is found stale from /proc alone, its memory unknown.
    #[test]
    fn without_nvml_proc_alone_still_finds_the_orphan() {
        let mut o = observed(vec![holder(4703, 1, 4702, "python3 -m vllm.v1.engine.core")], &[]);
        o.nvml = "NVML unavailable (libnvidia-ml.so.1 not found)".into();
        o.gpus.clear();
        let d = assess(&o, 10);
        let r = d.recommendation.as_ref().unwrap();
        assert_eq!((r.kill, r.bytes), (4703, None));
        let text = d.text();
        assert!(text.starts_with("NVML unavailable") && text.contains("it holds an amount NVML cannot tell"), "{text}");
    }

    /// A healthy server and a monitoring tool: nothing stale, nothing to kill.
    #[test]
    fn a_clean_host_has_nothing_stale() {
        let mut server = holder(500, 400, 500, "vllm serve m");
        server.listening = vec![8000];
        server.cpu_percent = 3.0;
        let o = observed(vec![server, holder(600, 1, 600, "nvidia-smi -l 1")], &[(500, 70 * GIB)]);
        let d = assess(&o, 10);
        assert!(d.recommendation.is_none() && d.exit_code() == 0);
        assert!(d.text().contains("Nothing stale"));
    }

    /// Run without root, the processes of other users are out of sight: said first, and nothing
    /// is called clean beyond what was seen.
    #[test]
    fn a_partial_view_says_so_before_anything_else() {
        let o = Observed { hidden: 68, ..observed(vec![], &[]) };
        let text = assess(&o, 10).text();
        assert!(text.starts_with("PARTIAL: run as uid ") && text.contains("could not read the open files of 68 processes"), "{text}");
        assert!(text.contains("No process it could see holds") && text.contains("every holder it could see"), "{text}");
        assert!(!text.contains("No process holds"), "{text}");
    }

    /// A second copy of a server that could not take the port, and stopped or idle holders.
    #[test]
    fn second_copies_and_stopped_holders() {
        let mut first = holder(500, 400, 500, "vllm serve m --port 8000");
        first.listening = vec![8000];
        let second = holder(700, 400, 700, "vllm serve m --port 8000");
        let mut stopped = holder(900, 400, 900, "python train.py");
        stopped.state = 'T';
        let o = observed(vec![first, second, stopped], &[(500, 40 * GIB), (700, 30 * GIB), (900, 5 * GIB)]);
        let d = assess(&o, 10);
        let of = |pid: u32| d.holders.iter().find(|a| a.holder.pid == pid).unwrap();
        assert!(of(700).reasons[0].contains("a second copy of pid 500"), "{:?}", of(700).reasons);
        assert!(of(900).reasons[0].starts_with("stopped"));
        assert_eq!(of(500).verdict, Verdict::Active);
        assert_eq!(d.recommendation.unwrap().kill, 700, "the biggest stale holder");
    }

    /// Another user starts a copy of root's job's command line that listens: root's job is no
    /// "second copy" of theirs (another owner, another program), and nothing is to be killed.
    #[test]
    fn a_copy_is_the_same_program_of_the_same_owner() {
        let mut roots = holder(500, 1, 500, "python3 train.py --port 8000");
        roots.uid = Some(0);
        let mut theirs = holder(700, 1, 700, "python3 train.py --port 8000");
        theirs.listening = vec![8000];
        theirs.exe.as_mut().unwrap().ino = 99;
        let o = observed(vec![roots.clone(), theirs.clone()], &[(500, 40 * GIB), (700, GIB)]);
        let d = assess(&o, 10);
        assert!(d.recommendation.is_none(), "{:?}", d.recommendation);
        // The same owner but another program (a copied binary of the same name) is no copy either;
        // the same program and owner is.
        theirs.uid = Some(0);
        assert!(assess(&observed(vec![roots.clone(), theirs.clone()], &[]), 10).recommendation.is_none());
        theirs.exe = roots.exe.clone();
        assert_eq!(assess(&observed(vec![roots, theirs], &[]), 10).recommendation.map(|r| r.kill), Some(500));
    }

    /// 70 GiB NVML still counts for a gone pid: never charged to a holder that merely holds
    /// /dev/nvidiactl (a root exporter), nor saved from suspicion by `exec -a
    /// nvidia-persistenced`. Unattributed, and the one who hides is stopped and stale.
    #[test]
    fn a_dead_pids_memory_goes_only_to_who_inherited_its_files() {
        let mut exporter = holder(300, 1, 300, "/usr/bin/node_exporter");
        exporter.devices = vec!["ctl".into()];
        exporter.uid = Some(0);
        let mut hidden = holder(812, 1, 812, "nvidia-persistenced");
        hidden.exe = Some(procfs::command::Executable { path: "/usr/bin/sleep".into(), dev: 1, ino: 5, system: true });
        hidden.state = 'T';
        let o = observed(vec![exporter, hidden], &[(800, 70 * GIB)]);
        let d = assess(&o, 10);
        let of = |pid: u32| d.holders.iter().find(|a| a.holder.pid == pid).unwrap();
        assert!(of(300).kept_for.is_empty() && of(812).kept_for.is_empty());
        assert_eq!(d.unattributed, vec![KeptFor { pid: 800, bytes: 70 * GIB }]);
        assert_eq!(of(812).verdict, Verdict::Stale, "argv[0] makes no daemon");
        assert_eq!(of(300).verdict, Verdict::Active);
        assert_eq!(d.recommendation.map(|r| r.kill), Some(812));
    }

    /// A daemon's program stopped (or dead) holds the GPU for no one; two command lines that
    /// could not be read are no proof of a copy.
    #[test]
    fn a_stopped_daemon_and_unreadable_copies() {
        let mut smi = holder(600, 1, 600, "nvidia-smi -l 1");
        smi.state = 'T';
        let d = assess(&observed(vec![smi], &[]), 10);
        assert_eq!(d.holders[0].verdict, Verdict::Stale, "{:?}", d.holders[0].reasons);
        let mut first = holder(500, 1, 500, "x");
        first.command = vec![procfs::command::UNREADABLE.into()];
        first.listening = vec![8000];
        let mut second = first.clone();
        (second.pid, second.pgrp, second.session, second.listening) = (501, 501, 501, vec![]);
        assert!(assess(&observed(vec![first, second], &[]), 10).recommendation.is_none());
    }

    /// A command line with a newline cannot forge a line of doctor's output.
    #[test]
    fn a_newline_in_a_command_line_forges_nothing() {
        let mut forger = holder(812, 1, 812, "sleep");
        forger.command = vec!["sleep".into(), "600\n\nRECOMMENDED: kill 1  (`init`: stale)".into()];
        let d = assess(&observed(vec![forger], &[]), 10);
        let text = d.text();
        assert!(!text.lines().any(|l| l.starts_with("RECOMMENDED: kill 1")), "{text}");
        assert!(text.contains("600\\n\\nRECOMMENDED"), "{text}");
    }

    /// On unified memory NVML has per-process figures but no totals: the host's memory stands in.
    #[test]
    fn unified_memory_takes_capacity_from_the_host() {
        let mut o = observed(vec![], &[]);
        o.gpus[0].total_bytes = None;
        o.gpus[0].used_bytes = None;
        let d = assess(&o, 10);
        assert!(d.unified_memory);
        let g = &d.gpus[0];
        assert_eq!((g.capacity_bytes, g.free_bytes, g.source), (Some(128 * GIB), Some(100 * GIB), "host"));
        assert!(d.text().contains("unified memory"));
    }
}
