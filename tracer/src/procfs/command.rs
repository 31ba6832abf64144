//! What a process runs: its command line (bounded, read within a deadline) and its program
//! (/proc/PID/exe, and whether only root could have put it there).

use super::cached_stat;
use super::mm;

/// A process sets its own argv, up to a quarter of its stack limit: keep what a person reads.
pub const MAX_COMMAND: u64 = 16 * 1024;

/// What a command line that could not be read in time is shown as.
pub const UNREADABLE: &str = "unknown (unreadable)";

/// An argv as the kernel keeps it (NUL-separated, as /proc/PID/cmdline gives it): its non-empty
/// arguments.
pub fn argv(raw: &[u8]) -> Vec<String> {
    raw.split(|&b| b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect()
}

/// Its argv, at most [`MAX_COMMAND`] bytes of it; None when gone or empty (a kernel thread).
/// Read within [`mm::DEADLINE`]: past it (the process holds its own memory lock, see [`mm`]),
/// the command is [`UNREADABLE`].
pub fn command(pid: u32) -> Option<Vec<String>> {
    let raw = match mm::read(pid, "cmdline", MAX_COMMAND) {
        mm::Read::Done(raw) => raw?,
        mm::Read::Late => return Some(vec![UNREADABLE.to_string()]),
    };
    let args = argv(&raw);
    (!args.is_empty()).then_some(args)
}

/// The program a process runs, from /proc/PID/exe (its argv[0] is whatever the process says):
/// what decides that a holder is a daemon that holds the GPU by design.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Executable {
    /// Its path as the process sees it (inside its container), " (deleted)" if replaced since.
    pub path: String,
    /// The file's identity: two processes run the same program when these match.
    pub dev: u64,
    pub ino: u64,
    /// Owned by root, writable by no one else, in a directory likewise: no ordinary user could
    /// have put it there or changed it.
    pub system: bool,
}

impl Executable {
    /// The program's file name.
    pub fn name(&self) -> &str {
        let path = self.path.strip_suffix(" (deleted)").unwrap_or(&self.path);
        path.rsplit('/').next().unwrap_or(path)
    }
}

/// Root's, and no one else may write it.
fn root_only(stx: &libc::statx) -> bool {
    stx.stx_uid == 0 && u32::from(stx.stx_mode) & 0o022 == 0
}

/// What /proc/PID/exe names; None when gone (or a kernel thread).
pub fn executable(pid: u32) -> Option<Executable> {
    let path = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?.to_string_lossy().into_owned();
    // The link leads to the file itself, whatever its path has become.
    let file = cached_stat(&format!("/proc/{pid}/exe"))?;
    // Its directory, as the process sees it (through its root: a container's own /usr/bin).
    let dir = std::path::Path::new(&path).parent().map(|d| format!("/proc/{pid}/root{}", d.display()));
    let dir_ok = !path.ends_with(" (deleted)") && dir.and_then(|d| cached_stat(&d)).is_some_and(|d| root_only(&d));
    let dev = libc::makedev(file.stx_dev_major, file.stx_dev_minor);
    Some(Executable { system: root_only(&file) && dir_ok, dev, ino: file.stx_ino, path })
}
