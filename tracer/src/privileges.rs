//! Once its probes are attached and the command is started, the recorder keeps only the
//! capabilities it still uses, so a bug in the long-running part cannot become root's: nor can it
//! get them back, since the bounding set loses the rest, uid 0 gains nothing by exec any more
//! (securebits NOROOT, locked) and no exec can grant privileges (no_new_privs).
//!
//! Still needed while recording: updating its own BPF maps (CAP_BPF; CAP_SYS_ADMIN on kernels
//! older than 5.8, which lack CAP_BPF), reading other users' /proc/PID/fd and comparing their
//! files with kcmp (CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH), and passing a stop signal on to a
//! command that runs as another user (CAP_KILL); for `watch` under sudo, creating each dump as the
//! invoking user (CAP_SETUID, CAP_SETGID, used only for the filesystem identity of the thread
//! that opens it); for `watch` listening on a port below 1024 (one no ordinary user can take
//! first), binding it again if it was not free (CAP_NET_BIND_SERVICE). Everything else goes:
//! setuid, setgid, chown, file ownership overrides, modules, raw I/O, the network, mounts.

use std::io;

const CAP_DAC_READ_SEARCH: u32 = 2;
const CAP_KILL: u32 = 5;
const CAP_SETGID: u32 = 6;
const CAP_SETUID: u32 = 7;
const CAP_NET_BIND_SERVICE: u32 = 10;
const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

const VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// What recording goes on doing beyond tracing, and so which capabilities it keeps.
#[derive(Clone, Copy, Debug, Default)]
pub struct Needs {
    /// `watch` under sudo goes on creating dump files as the invoking user, which takes
    /// setfsuid/setgroups on the writing thread.
    pub open_as_user: bool,
    /// `watch --listen` on a port below 1024, bound again if it was taken at start.
    pub bind_low_port: bool,
}

/// The capabilities kept, as a 64-bit set, for a kernel whose highest capability is `last_cap`.
pub fn kept(last_cap: u32, needs: Needs) -> u64 {
    let mut keep = [CAP_DAC_READ_SEARCH, CAP_KILL, CAP_SYS_PTRACE, CAP_PERFMON, CAP_BPF].iter().fold(0u64, |set, &c| set | 1 << c);
    if needs.open_as_user {
        keep |= 1 << CAP_SETUID | 1 << CAP_SETGID;
    }
    if needs.bind_low_port {
        keep |= 1 << CAP_NET_BIND_SERVICE;
    }
    if last_cap < CAP_BPF {
        keep |= 1 << CAP_SYS_ADMIN;
    }
    keep
}

fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(CAP_BPF)
}

const PR_CAPBSET_DROP: libc::c_int = 24;
const PR_SET_SECUREBITS: libc::c_int = 28;
const PR_SET_NO_NEW_PRIVS: libc::c_int = 38;
/// SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP and SECBIT_KEEP_CAPS_LOCKED, each with its lock.
const SECUREBITS: libc::c_ulong = 0b10_1111;

fn prctl(option: libc::c_int, arg: libc::c_ulong) -> io::Result<()> {
    // SAFETY: prctl with integer arguments; it changes only this thread's credentials.
    if unsafe { libc::prctl(option, arg, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Drops every other capability from the calling thread's effective, permitted, inheritable and
/// bounding sets, and locks uid 0 out of regaining them. Call it while the recorder has one
/// thread: capabilities are per thread, and threads started later inherit them.
pub fn keep_only_what_recording_needs(needs: Needs) -> io::Result<()> {
    let keep = kept(last_cap(), needs);
    // These need CAP_SETPCAP, which goes last.
    prctl(PR_SET_SECUREBITS, SECUREBITS)?;
    for cap in (0..=last_cap()).filter(|&c| keep & 1 << c == 0) {
        prctl(PR_CAPBSET_DROP, libc::c_ulong::from(cap))?;
    }
    prctl(PR_SET_NO_NEW_PRIVS, 1)?;
    let mut header = CapHeader { version: VERSION_3, pid: 0 };
    let mut data = [Data::default(); 2];
    // SAFETY: capget fills two Data structs for version 3.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let (low, high) = (keep as u32, (keep >> 32) as u32);
    for (d, mask) in data.iter_mut().zip([low, high]) {
        d.effective &= mask;
        d.permitted &= mask;
        d.inheritable = 0;
    }
    // SAFETY: capset reads the two Data structs; it can only lower what this thread holds here.
    if unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_kept() {
        let modern = kept(40, Needs::default());
        for cap in [CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH, CAP_KILL] {
            assert!(modern & 1 << cap != 0, "{cap} kept");
        }
        const CAP_SYS_MODULE: u32 = 16;
        for cap in [CAP_SYS_ADMIN, CAP_SETUID, CAP_SYS_MODULE] {
            assert!(modern & 1 << cap == 0, "{cap} dropped");
        }
        assert!(modern & 1 << CAP_NET_BIND_SERVICE == 0);
        assert!(kept(37, Needs::default()) & 1 << CAP_SYS_ADMIN != 0, "before CAP_BPF existed, BPF needs CAP_SYS_ADMIN");
        let sudo = Needs { open_as_user: true, ..Needs::default() };
        assert!(kept(40, sudo) & (1 << CAP_SETUID | 1 << CAP_SETGID) != 0, "a watch under sudo writes dumps as the user");
        let low = Needs { bind_low_port: true, ..Needs::default() };
        assert!(kept(40, low) & 1 << CAP_NET_BIND_SERVICE != 0, "a watch on port 931 binds it again when it was taken");
    }
}
