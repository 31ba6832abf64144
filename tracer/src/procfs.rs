//! Everything gputrace reads from /proc, each read bounded: a process controls its own command
//! line and can make it megabytes long. This file: a process's state, parent and memory, the
//! host's memory, which processes there are; by concern, below: `mm` (the reads that take a
//! process's memory-map lock, on workers with a deadline), `command` (command lines and the
//! program run), `place` (cgroup, container, pod, owner), `fds` (a process's open files),
//! `net` (addresses, sockets, listening ports, reads blocked on a connection).

use std::io::Read;

pub mod command;
pub mod fds;
pub mod mm;
pub mod net;
pub mod place;

/// The fields of /proc/PID/stat gputrace uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Stat {
    /// R, S, D, Z, T...
    pub state: char,
    pub ppid: u32,
    /// Process group and session: a job's members share its leader's pid.
    pub pgrp: u32,
    pub session: u32,
    /// User + system CPU time, in clock ticks.
    pub cpu_ticks: u64,
    /// When it started, in clock ticks since boot.
    pub start_ticks: u64,
}

/// Parses /proc/PID/stat. The command name may hold spaces and parentheses: the fields start
/// after the last ')' (field 3, the state); a line cut short yields what it holds.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    let number = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    Some(Stat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        pgrp: number(2) as u32,
        session: number(3) as u32,
        cpu_ticks: number(11).saturating_add(number(12)),
        start_ticks: number(19),
    })
}

/// Clock ticks per second, the unit of /proc's times.
pub fn ticks_per_second() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as u64
    } else {
        100
    }
}

/// Seconds since boot, from /proc/uptime.
pub fn uptime_seconds() -> Option<f64> {
    read_bounded("/proc/uptime", 128)?.split_whitespace().next()?.parse().ok()
}

/// A /proc file's text, at most `limit` bytes of it.
pub fn read_bounded(path: &str, limit: u64) -> Option<String> {
    let mut raw = Vec::new();
    std::fs::File::open(path).ok()?.take(limit).read_to_end(&mut raw).ok()?;
    Some(String::from_utf8_lossy(&raw).into_owned())
}

/// The host's memory: MemTotal and MemAvailable, in bytes (what "free" means on unified memory).
pub fn meminfo() -> Option<(u64, u64)> {
    Some((meminfo_field("MemTotal:")?, meminfo_field("MemAvailable:")?))
}

/// One field of /proc/meminfo ("SwapFree:"), in bytes.
pub fn meminfo_field(name: &str) -> Option<u64> {
    let text = read_bounded("/proc/meminfo", 64 * 1024)?;
    let kib: u64 = text.lines().find_map(|l| l.strip_prefix(name)?.split_whitespace().next()?.parse().ok())?;
    Some(kib.saturating_mul(1024))
}

/// PSI's memory pressure, "some avg10": the share of the last 10 s in which some task waited for
/// memory. None where the kernel has no PSI.
pub fn memory_pressure() -> Option<f64> {
    let text = read_bounded("/proc/pressure/memory", 1024)?;
    text.lines().find(|l| l.starts_with("some "))?.split_whitespace().find_map(|f| f.strip_prefix("avg10=")?.parse().ok())
}

pub fn stat(pid: u32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Still running: present and not a zombie waiting for a parent that may never reap it.
pub fn running(pid: u32) -> bool {
    stat(pid).is_some_and(|s| s.state != 'Z')
}

pub fn parent(pid: u32) -> Option<u32> {
    stat(pid).map(|s| s.ppid)
}

/// Resident memory (VmRSS), in bytes.
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let status = read_bounded(&format!("/proc/{pid}/status"), 64 * 1024)?;
    let kib: u64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.split_whitespace().next()?.parse().ok())?;
    Some(kib.saturating_mul(1024))
}

/// A file's attributes as the kernel has them cached: a plain stat of a file on FUSE asks its
/// server, which may never answer.
pub(crate) fn cached_stat(path: &str) -> Option<libc::statx> {
    let path = std::ffi::CString::new(path).ok()?;
    // SAFETY: statx writes into the zeroed struct it is given; the path is NUL-terminated.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let mask = libc::STATX_TYPE | libc::STATX_MODE | libc::STATX_UID | libc::STATX_INO;
    let rc = unsafe { libc::statx(libc::AT_FDCWD, path.as_ptr(), libc::AT_STATX_DONT_SYNC, mask, &mut stx) };
    (rc == 0).then_some(stx)
}

/// Every process but gputrace itself.
pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).filter(|&pid| pid != std::process::id()).collect()
}

/// The given pids and every process below them now.
/// The processes in a cgroup v2 directory and those below it (cgroup.procs of each, bounded).
pub fn cgroup_pids(dir: &std::path::Path) -> Vec<u32> {
    let mut pids = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    // A few thousand cgroups at most: a pod or a container holds a handful.
    while let Some(d) = dirs.pop().filter(|_| pids.len() < 1 << 16) {
        let procs = read_bounded(&d.join("cgroup.procs").to_string_lossy(), 1 << 20).unwrap_or_default();
        pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        let subdirs = std::fs::read_dir(&d).into_iter().flatten().filter_map(Result::ok).take(4096);
        dirs.extend(subdirs.filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
    }
    pids
}

pub fn with_descendants(roots: &[u32]) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = all_pids().into_iter().filter_map(|pid| Some((pid, parent(pid)?))).collect();
    descendants(roots, &parents)
}

/// `roots` and every process below them, given (pid, parent) pairs.
fn descendants(roots: &[u32], parents: &[(u32, u32)]) -> Vec<u32> {
    let mut out: Vec<u32> = roots.to_vec();
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        let children: Vec<u32> = parents.iter().filter(|(pid, ppid)| *ppid == parent && !out.contains(pid)).map(|(pid, _)| *pid).collect();
        out.extend(children);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_after_the_last_parenthesis() {
        let line = "42 (a) b (c)) S 7 40 39 0 -1 4194560 10 0 0 0 250 50 0 0 20 0 3 0 12345 0 0";
        let s = parse_stat(line).unwrap();
        assert_eq!((s.state, s.ppid, s.pgrp, s.session, s.cpu_ticks, s.start_ticks), ('S', 7, 40, 39, 300, 12345));
        assert_eq!(parse_stat("43 (zombie) Z 1 43"), Some(Stat { state: 'Z', ppid: 1, pgrp: 43, ..Stat::default() }));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn a_tree_below_its_roots() {
        let parents = [(2, 1), (3, 2), (4, 3), (5, 1), (6, 5)];
        let mut found = descendants(&[2], &parents);
        found.sort();
        assert_eq!(found, vec![2, 3, 4]);
    }

    #[test]
    fn this_process_reads_back() {
        let me = std::process::id();
        assert!(running(me));
        assert!(command::command(me).is_some_and(|argv| !argv.is_empty()));
        // SAFETY: getuid has no preconditions.
        assert_eq!(place::owner(me), Some(unsafe { libc::getuid() }));
        assert!(!fds::open_fds(me).is_empty());
        let exe = command::executable(me).expect("its program");
        assert_eq!(exe, command::executable(me).unwrap());
        assert!(!exe.name().is_empty() && exe.ino != 0);
    }
}
