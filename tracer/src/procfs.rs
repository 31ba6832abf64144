//! Everything gputrace reads from /proc, in one place, each read bounded: a process controls its
//! own command line and can make it megabytes long.

use std::io::Read;
use std::path::PathBuf;

/// A process sets its own argv, up to a quarter of its stack limit: keep what a person reads.
pub const MAX_COMMAND: u64 = 16 * 1024;

/// The fields of /proc/PID/stat gputrace uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    /// R, S, D, Z, T...
    pub state: char,
    pub ppid: u32,
}

/// Parses /proc/PID/stat. The command name may hold spaces and parentheses: the fields start
/// after the last ')'.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let mut fields = text.rsplit_once(')')?.1.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some(Stat { state, ppid })
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

/// Its argv, at most [`MAX_COMMAND`] bytes of it; None when gone or empty (a kernel thread).
pub fn command(pid: u32) -> Option<Vec<String>> {
    let mut raw = Vec::new();
    std::fs::File::open(format!("/proc/{pid}/cmdline")).ok()?.take(MAX_COMMAND).read_to_end(&mut raw).ok()?;
    let args: Vec<String> = raw.split(|&b| b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    (!args.is_empty()).then_some(args)
}

/// The real uid that owns a process, from /proc/PID/status.
pub fn owner(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok()
}

/// The path an open fd refers to, None when the process or fd is gone.
pub fn fd_path(pid: u32, fd: i32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok()
}

/// The fds a process has open now.
pub fn open_fds(pid: u32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()
}

/// Whether two fds refer to the same open file description (kcmp(2)).
pub fn same_file(a: (u32, i32), b: (u32, i32)) -> bool {
    const KCMP_FILE: libc::c_long = 0;
    // SAFETY: kcmp only compares; invalid pids or fds return an error.
    let rc = unsafe {
        libc::syscall(libc::SYS_kcmp, a.0 as libc::pid_t, b.0 as libc::pid_t, KCMP_FILE, a.1 as libc::c_long, b.1 as libc::c_long)
    };
    rc == 0
}

/// Every process but gputrace itself.
pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).filter(|&pid| pid != std::process::id()).collect()
}

/// The given pids and every process below them now.
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
        assert_eq!(parse_stat("42 (a) b (c)) S 7 42 42 0"), Some(Stat { state: 'S', ppid: 7 }));
        assert_eq!(parse_stat("43 (zombie) Z 1 43"), Some(Stat { state: 'Z', ppid: 1 }));
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
        assert!(command(me).is_some_and(|argv| !argv.is_empty()));
        // SAFETY: getuid has no preconditions.
        assert_eq!(owner(me), Some(unsafe { libc::getuid() }));
        assert!(!open_fds(me).is_empty());
    }
}
