//! Before a session creates anything: the checks a user can act on (the command, the pids, the
//! cgroup), the driver's version and the layouts to decode with, the descriptor limit, and what
//! the trace says of itself and of the machine before its first record (its header).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context as _, Result};

use crate::abi::{DriverVersion, Layout, NEWEST_KNOWN, OLDEST_KNOWN};
use crate::devices::Majors;
use crate::procfs;
use crate::trace::{clocks, Header, FORMAT, VERSION};

/// A cgroup v2 directory, opened for the kernel's cgroup array; refused with the reason a user
/// can act on when it is not one.
pub fn open_cgroup(path: &std::path::Path) -> Result<std::fs::File> {
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    let dir = std::fs::File::open(path).with_context(|| format!("cannot open the cgroup {}", path.display()))?;
    // SAFETY: fstatfs fills the struct for an open fd.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    let on_cgroup2 =
        unsafe { libc::fstatfs(std::os::fd::AsRawFd::as_raw_fd(&dir), &mut fs) } == 0 && fs.f_type as i64 == CGROUP2_SUPER_MAGIC;
    if !on_cgroup2 || !dir.metadata()?.is_dir() {
        bail!(
            "{} is not a cgroup v2 directory: give one under the unified hierarchy (/sys/fs/cgroup/... on cgroup v2 hosts, /sys/fs/cgroup/unified/... on hybrid ones), such as a container's `system.slice/docker-ID.scope`",
            path.display()
        );
    }
    Ok(dir)
}

/// Each pid to attach to names a process that is there.
pub fn check_running(pids: &[u32]) -> Result<()> {
    match pids.iter().find(|&&pid| procfs::stat(pid).is_none()) {
        Some(pid) => bail!("no process has pid {pid}: check it with `ps -p {pid}`"),
        None => Ok(()),
    }
}

/// What the trace says of itself and of the machine before the first record: clocks, driver,
/// NVML's view, and who held the device files already.
pub fn header(invocation: &[String], raw: bool, version: Option<DriverVersion>, source: String, majors: Option<Majors>) -> Header {
    let snapshot = crate::gpus::snapshot();
    let (wall, mono) = clocks();
    Header {
        format: FORMAT.into(),
        version: VERSION,
        tracer_version: env!("CARGO_PKG_VERSION").into(),
        host: read_trimmed("/proc/sys/kernel/hostname"),
        kernel: read_trimmed("/proc/sys/kernel/osrelease"),
        driver_version: version.map(|v| v.to_string()),
        driver_version_source: source,
        wall_clock_start_ns: wall,
        monotonic_start_ns: mono,
        gpus: snapshot.gpus,
        prior_use: snapshot.prior_use,
        holders_at_start: crate::devices::nvidia_holders(majors),
        device_check: Majors::describe(majors),
        nvml: snapshot.note,
        command: invocation.to_vec(),
        raw,
        rest_history: Vec::new(),
    }
}

/// Every open connection, device file and /proc entry is a descriptor: take the hard limit.
pub fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

pub fn find_program(program: &str) -> Result<PathBuf> {
    let is_executable = |p: &Path| {
        std::fs::metadata(p).map(|m| m.is_file() && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0).unwrap_or(false)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        return if is_executable(&p) { Ok(p) } else { Err(anyhow!("cannot run `{program}`: no such executable file")) };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| is_executable(p))
        .ok_or_else(|| anyhow!("cannot run `{program}`: command not found in PATH"))
}

/// The version to decode with: --driver-version, else the running driver's, else none.
pub fn driver_version(forced: Option<&str>) -> Result<(Option<DriverVersion>, String)> {
    if let Some(text) = forced {
        let v = DriverVersion::parse(text)
            .ok_or_else(|| anyhow!("--driver-version {text:?} is not a driver version: give it as 580.95.05 or 580"))?;
        return Ok((Some(v), "--driver-version".into()));
    }
    Ok(match DriverVersion::detect() {
        Some((v, source)) => (Some(v), source),
        None => (None, "none".into()),
    })
}

pub fn layout_for(version: Option<DriverVersion>) -> Layout {
    match version {
        None => {
            eprintln!(
                "gputrace: warning: no NVIDIA driver found (/sys/module/nvidia/version, /proc/driver/nvidia/version): decoding with the {NEWEST_KNOWN} layouts; give --driver-version to choose"
            );
            Layout::for_version(NEWEST_KNOWN)
        }
        Some(v) => {
            let layout = Layout::for_version(v);
            if layout.assumed {
                eprintln!(
                    "gputrace: warning: driver {v} is outside the versions whose layouts were checked ({OLDEST_KNOWN}–{NEWEST_KNOWN}): fields stable across versions decode, the rest uses the nearest known layout"
                );
            }
            layout
        }
    }
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_default()
}
