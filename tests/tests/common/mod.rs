//! What every end-to-end test needs: one run at a time, root, the gputrace binary.
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};

/// The start of every root-only test: one at a time (they share the kernel's tracepoints and the
/// machine), and root, or a failure that says so. Such tests are `#[ignore]`d, so without root
/// they show as skipped; `cargo xtask test` runs them with `--include-ignored` as root. (A crate
/// whose tests need no root includes this module for the rest.)
#[allow(dead_code)]
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

/// Runs scenario `name` for `server` on the fake GPU (NVML as a discrete GPU's) with `env` set,
/// into a directory of its own; fails with its logs if the scenario does. The directory
/// (run.trace, record.json, the logs). Not every test crate that includes this module runs one.
#[allow(dead_code)]
pub fn scenario(name: &str, server: &str, env: &[(&str, &str)]) -> PathBuf {
    let tag: String = env.iter().map(|(_, v)| v.replace(|c: char| !c.is_ascii_alphanumeric(), "")).collect();
    let dir = std::env::temp_dir().join(format!("gputrace-{server}-{name}-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["scenario", name, "--server", server, "--nvml", "discrete", "--dir"])
        .arg(&dir)
        .arg("--gputrace")
        .arg(gputrace_bin())
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let logs = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    assert!(
        out.status.success(),
        "{server} {name} {env:?}: {}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        logs("server.log"),
        logs("load.log")
    );
    dir
}

/// The report a scenario's recording printed (record.json in its directory).
#[allow(dead_code)]
pub fn summary(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("record.json")).unwrap_or_default();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: record.json: {e}", dir.display()))
}

#[allow(dead_code)]
/// Whether `when` reads "2026-12-07 19:32:13.98 +0000 (+0.63 s)": local wall-clock time to the
/// hundredth, its UTC offset, and the offset into the trace.
pub fn is_wall_clock(when: &str) -> bool {
    let shape = "dddd-dd-dd dd:dd:dd.dd +dddd (+";
    let fits = when.len() > shape.len()
        && shape.bytes().zip(when.bytes()).enumerate().all(|(i, (s, w))| match s {
            b'd' => w.is_ascii_digit(),
            b'+' if i == 23 => w == b'+' || w == b'-',
            s => s == w,
        });
    fits && when.ends_with(" s)") && when[shape.len()..when.len() - 3].parse::<f64>().is_ok()
}

#[allow(dead_code)]
/// The block with what changes from run to run made stable: pids, the wall clock, the trace a
/// check replays (a dump's is named by its time) and the host's RAM.
pub fn stable(block: &str) -> String {
    let mut out = Vec::new();
    for line in block.lines() {
        let check = line.strip_prefix("   = check: gputrace whatif ").and_then(|l| l.split_once(' '));
        // On unified memory the capacity and what is free are this machine's RAM.
        let host = line
            .strip_prefix("   = unified memory (the host's RAM) has ")
            .and_then(|l| l.split_once(": "))
            .and_then(|(_, l)| l.rsplit_once(", "));
        let mut line = match (line.strip_prefix("  --> ").and_then(|l| l.rsplit_once(" · ")), check, host) {
            (Some((rest, when)), _, _) if is_wall_clock(when) => format!("  --> {rest} · WALL-CLOCK (+T s)"),
            (_, Some((_, setting)), _) => format!("   = check: gputrace whatif TRACE {setting}"),
            (_, _, Some((held, _))) => format!("   = unified memory (the host's RAM) has HOST: {held}, HOST free"),
            _ => line.to_string(),
        };
        for key in ["pid ", "kill "] {
            let (mut said, mut rest) = (String::new(), line.as_str());
            while let Some(at) = rest.find(key) {
                said.push_str(&rest[..at + key.len()]);
                rest = &rest[at + key.len()..];
                let digits = rest.chars().take_while(char::is_ascii_digit).count();
                if digits > 0 {
                    said.push('N');
                    rest = &rest[digits..];
                }
            }
            said.push_str(rest);
            line = said;
        }
        out.push(line);
    }
    out.join("\n") + "\n"
}

#[allow(dead_code)]
/// The verdict block a report's text starts with (after what it lacks, up to its first blank,
/// HEADROOM or NOTE line), made stable, against tests/snapshots/`name`.block; `GPUTRACE_BLESS=1` writes it.
pub fn matches_snapshot(report: &str, name: &str, what: &str) {
    let shown: String = report
        .lines()
        .skip_while(|l| l.starts_with("PARTIAL: "))
        .take_while(|l| !l.is_empty() && !l.starts_with("HEADROOM") && !l.starts_with("NOTE"))
        .map(|l| format!("{l}\n"))
        .collect();
    let shown = stable(&shown);
    let snapshot = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("snapshots/{name}.block"));
    if std::env::var_os("GPUTRACE_BLESS").is_some() {
        std::fs::create_dir_all(snapshot.parent().unwrap()).unwrap();
        std::fs::write(&snapshot, &shown).unwrap();
    }
    let expected = std::fs::read_to_string(&snapshot).unwrap_or_default();
    assert_eq!(shown, expected, "{what}: the block differs from {} (GPUTRACE_BLESS=1 writes it)", snapshot.display());
}
