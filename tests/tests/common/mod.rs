//! What every end-to-end test needs: one run at a time, root (or a clear skip), the gputrace binary.
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// End-to-end runs share the kernel's tracepoints and the machine: one at a time.
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// True as root. Otherwise skips with a message, or fails when CI=true (CI runs as root).
pub fn root_or_skip(name: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{name}: the end-to-end tests need root and CI runs as root");
    }
    eprintln!("skipping {name}: needs root (run `sudo cargo xtask test`)");
    false
}

pub fn gputrace_bin() -> PathBuf {
    if let Ok(path) = std::env::var("GPUTRACE_BIN") {
        return PathBuf::from(path);
    }
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    let found = ["release", "debug"].iter().map(|p| target.join(p).join("gputrace")).find(|p| p.exists());
    found.expect("the gputrace binary is not built: run `cargo build --release -p tracer` (cargo xtask test does)")
}
