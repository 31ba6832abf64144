//! A process's open files: what each fd refers to, its device number and close-on-exec flag,
//! and whether two fds are one open file.

use std::path::PathBuf;

use super::{cached_stat, read_bounded};

/// The path an open fd refers to, None when the process or fd is gone.
pub fn fd_path(pid: u32, fd: i32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok()
}

/// The device number (major, minor) of the character device behind a fd ((0, 0) for any other
/// file: a block device's number is another namespace); None when the fd is gone.
pub fn fd_device_number(pid: u32, fd: i32) -> Option<(u32, u32)> {
    // Attributes as cached (a device number never changes while the file is open).
    let stx = cached_stat(&format!("/proc/{pid}/fd/{fd}"))?;
    let character = u32::from(stx.stx_mode) & libc::S_IFMT == libc::S_IFCHR;
    Some(if character { (stx.stx_rdev_major, stx.stx_rdev_minor) } else { (0, 0) })
}

/// Whether a fd is close-on-exec: /proc/PID/fdinfo/FD's `flags`, in octal, hold O_CLOEXEC when
/// its bit is set. None when the fd is gone.
pub fn fd_cloexec(pid: u32, fd: i32) -> Option<bool> {
    let text = read_bounded(&format!("/proc/{pid}/fdinfo/{fd}"), 4096)?;
    cloexec_in_fdinfo(&text)
}

fn cloexec_in_fdinfo(text: &str) -> Option<bool> {
    let flags = text.lines().find_map(|l| l.strip_prefix("flags:"))?;
    let flags = u32::from_str_radix(flags.trim(), 8).ok()?;
    Some(flags & libc::O_CLOEXEC as u32 != 0)
}

/// The fds a process has open now.
pub fn open_fds(pid: u32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()
}

/// Whether a process's open files are hidden from us (another user's, without root).
pub fn hidden(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd")).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What an open with and without O_CLOEXEC shows in fdinfo, read from this process; and what
    /// a damaged or missing flags line gives.
    #[test]
    fn a_fds_close_on_exec_flag_from_fdinfo() {
        use std::os::fd::AsRawFd;
        let cloexec = std::fs::File::open("/proc/self/stat").unwrap();
        // SAFETY: open(2) of a C string, closed below.
        let plain = unsafe { libc::open(c"/proc/self/stat".as_ptr(), libc::O_RDONLY) };
        assert!(plain >= 0);
        let pid = std::process::id();
        assert_eq!((fd_cloexec(pid, cloexec.as_raw_fd()), fd_cloexec(pid, plain)), (Some(true), Some(false)));
        unsafe { libc::close(plain) };
        assert_eq!(fd_cloexec(pid, i32::MAX), None, "no such fd");
        assert_eq!(cloexec_in_fdinfo("pos:\t0\nflags:\t02100002\nmnt_id:\t25\n"), Some(true));
        assert_eq!(cloexec_in_fdinfo("pos:\t0\nflags:\t0100002\n"), Some(false));
        assert_eq!(cloexec_in_fdinfo("flags:\t9\n"), None);
        assert_eq!(cloexec_in_fdinfo("pos:\t0\n"), None);
    }
}
