//! What every end-to-end test needs: one run at a time, root, the gputrace binary.
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};

/// The start of every root-only test: one at a time (they share the kernel's tracepoints and the
/// machine), and root, or a failure that says so. Such tests are `#[ignore]`d, so without root
/// they show as skipped; `cargo xtask test` runs them with `--include-ignored` as root.
pub fn as_root() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "this end-to-end test loads eBPF programs: run it as root (`sudo cargo xtask test`)");
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn gputrace_bin() -> PathBuf {
    if let Ok(path) = std::env::var("GPUTRACE_BIN") {
        return PathBuf::from(path);
    }
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    let found = ["release", "debug"].iter().map(|p| target.join(p).join("gputrace")).find(|p| p.exists());
    found.expect("the gputrace binary is not built: run `cargo build --release -p tracer` (cargo xtask test does)")
}

/// Starts `gputrace ARGS` and returns once it says it is tracing (its stop signals are handled
/// from then on). Not every test crate that includes this module starts one.
#[allow(dead_code)]
pub fn start(args: &[&str], sudo_nobody: bool) -> Child {
    let mut cmd = Command::new(gputrace_bin());
    cmd.args(args).stderr(Stdio::piped()).process_group(0);
    if sudo_nobody {
        cmd.env("SUDO_UID", "65534").env("SUDO_GID", "65534").env("SUDO_USER", "nobody");
    }
    let mut child = cmd.spawn().unwrap();
    let mut seen = Vec::new();
    let mut byte = [0u8];
    let err = child.stderr.as_mut().unwrap();
    while !String::from_utf8_lossy(&seen).contains("gputrace: tracing") {
        assert_eq!(err.read(&mut byte).unwrap(), 1, "the recorder exited: {}", String::from_utf8_lossy(&seen));
        seen.push(byte[0]);
    }
    child
}
