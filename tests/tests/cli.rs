//! How `gputrace record` behaves as a command: attaching to a running process, its errors, Ctrl-C,
//! a recorder killed mid-run, and running the command as the user behind sudo. Root only (skipped
//! with a message otherwise, failed when CI=true).

mod common;

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use gputrace::event::{Event, Seen};
use gputrace::model::{FreedBy, Model};
use gputrace::trace::Reader;

use common::{as_root, gputrace_bin};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gputrace-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs a shell script inside `fakegpu run`; G is gputrace, W the fake workload, D the scratch dir.
fn in_fake_gpu(dir: &Path, script: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["run", "--log"])
        .arg(dir.join("driver.jsonl"))
        .args(["--", "sh", "-c", script])
        .env("G", gputrace_bin())
        .env("W", env!("CARGO_BIN_EXE_fake-workload"))
        .env("D", dir)
        .output()
        .expect("running fakegpu")
}

/// The recorder starts after the process allocated: the /proc scan finds its device files, and
/// what it does from then on is followed, down to the implicit free at its exit.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn attaching_to_a_running_process() {
    let _root = as_root();
    let dir = scratch("attach");
    let out = in_fake_gpu(&dir, r#""$W" hold --ms 1500 & sleep 0.5; exec "$G" record --json -o "$D/run.trace" --pid $!"#);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (_, records, _) = Reader::read_all(&dir.join("run.trace")).unwrap();
    let model = Model::from_records(&records);
    let process = records.iter().find_map(|r| match &r.event {
        Event::Process { seen: Seen::Running, command, .. } => Some((r.pid, command.clone())),
        _ => None,
    });
    let (pid, command) = process.expect("the attached process, seen running");
    assert!(command.iter().any(|a| a == "hold"), "its command line: {command:?}");
    let found: Vec<_> = records.iter().filter(|r| r.pid == pid && matches!(r.event, Event::FdFound { .. })).collect();
    assert_eq!(found.len(), 3, "nvidiactl, nvidia0 and nvidia-uvm found by the scan");
    let later = model.allocations.iter().find(|a| a.pid == pid && a.bytes == 1 << 30).expect("the allocation made after attaching");
    assert_eq!(later.freed.map(|f| f.1), Some(FreedBy::FileRelease), "freed by the driver at exit");
    assert!(records.iter().any(|r| matches!(r.event, Event::Free { .. })), "the free of memory allocated before attaching is seen");
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["fd_filter"]["questions"], 0, "the scan told the kernel about every fd");
    // What it held before the recorder started is known from NVML (the fake one here).
    let header = Reader::open(&dir.join("run.trace")).unwrap().header;
    assert_eq!(header.nvml, "ok");
    assert_eq!(header.gpus[0].total_bytes, Some(80 << 30));
    let prior = header.prior_use.iter().find(|p| p.pid == pid).expect("the attached process in NVML's list");
    assert_eq!(prior.used_bytes, Some(2 << 30));
    std::fs::remove_dir_all(&dir).ok();
}

/// On a unified-memory part NVML has no device memory to report; per-process figures remain.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn unified_memory_reports_no_capacity_but_still_per_process_use() {
    let _root = as_root();
    let dir = scratch("unified");
    let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["run", "--unified", "--", "sh", "-c", r#""$W" hold --ms 1200 & sleep 0.4; exec "$G" record -o "$D/run.trace" --pid $!"#])
        .env("G", gputrace_bin())
        .env("W", env!("CARGO_BIN_EXE_fake-workload"))
        .env("D", &dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let header = Reader::open(&dir.join("run.trace")).unwrap().header;
    assert_eq!(header.gpus[0].name, "NVIDIA GB10");
    assert_eq!(header.gpus[0].total_bytes, None, "unknown, not zero");
    assert_eq!(header.prior_use.len(), 1);
    assert_eq!(header.prior_use[0].used_bytes, Some(2 << 30));
    std::fs::remove_dir_all(&dir).ok();
}

/// A recorder killed with SIGKILL leaves a trace that reads up to its last flush.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_killed_recorder_leaves_a_readable_trace() {
    let _root = as_root();
    let dir = scratch("sigkill");
    in_fake_gpu(&dir, r#""$G" record -o "$D/run.trace" -- "$W" hold --ms 2000 & sleep 1; kill -9 $!; sleep 0.1"#);
    let (header, records, _) = Reader::read_all(&dir.join("run.trace")).expect("the trace of a killed recorder reads");
    assert_eq!(header.driver_version.as_deref(), Some("580.95.05"));
    let model = Model::from_records(&records);
    assert!(model.allocations.iter().any(|a| a.bytes == 2 << 30), "the allocation made before the kill was flushed");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn ctrl_c_stops_cleanly() {
    let _root = as_root();
    let dir = scratch("sigint");
    // A terminal's Ctrl-C signals the whole foreground process group: the recorder and the command.
    let child = Command::new(gputrace_bin())
        .args(["record", "-o"])
        .arg(dir.join("run.trace"))
        .args(["--", "sleep", "30"])
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    // SAFETY: signal the process group of our own child.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Lost events: 0."));
    let (_, records, damage) = Reader::read_all(&dir.join("run.trace")).unwrap();
    assert!(!damage.torn_tail);
    assert!(records.iter().any(|r| matches!(r.event, Event::Exec { .. })));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn errors_say_what_to_do() {
    let _root = as_root();
    let run = |args: &[&str], unprivileged: bool| {
        let mut cmd = if unprivileged {
            let mut c = Command::new("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--"]).arg(gputrace_bin());
            c
        } else {
            Command::new(gputrace_bin())
        };
        let out = cmd.args(args).current_dir(std::env::temp_dir()).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = run(&["record", "--", "true"], true);
    assert_eq!(code, Some(2));
    assert!(err.contains("needs root or CAP_BPF+CAP_PERFMON") && err.contains("sudo"), "{err}");
    // A watch checks first, and creates no dump directory it would then fail on.
    let dumps = std::env::temp_dir().join(format!("gputrace-unprivileged-dumps-{}", std::process::id()));
    let (code, err) = run(&["watch", "--listen", "off", "--dump-dir", dumps.to_str().unwrap()], true);
    assert_eq!(code, Some(2));
    assert!(err.contains("needs root or CAP_BPF+CAP_PERFMON"), "{err}");
    assert!(!dumps.exists(), "no directory created: {}", dumps.display());
    // doctor, as nobody, cannot see root's processes' files: it says so before anything else.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--"])
        .arg(gputrace_bin())
        .arg("doctor")
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("PARTIAL: run as uid 65534, gputrace could not read the open files of "), "{text}");
    assert!(!text.contains("No process holds"), "{text}");
    let (code, err) = run(&["record", "--", "no-such-command-here"], false);
    assert_eq!(code, Some(2));
    assert!(err.contains("cannot run `no-such-command-here`: command not found"), "{err}");
    let (_, err) = run(&["record"], false);
    assert!(err.contains("nothing to trace"), "{err}");
    let (_, err) = run(&["record", "--pid", "999999999"], false);
    assert!(err.contains("no process has pid 999999999"), "{err}");
    let (_, err) = run(&["record", "--driver-version", "banana", "--", "true"], false);
    assert!(err.contains("is not a driver version"), "{err}");
}

/// Under sudo the command runs as the invoking user, and the trace is theirs.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn runs_the_command_as_the_user_behind_sudo() {
    let _root = as_root();
    let dir = scratch("sudo");
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let uid_file = dir.join("uid");
    let out = Command::new(gputrace_bin())
        .args(["record", "--", "sh", "-c"])
        .arg(format!("id -u > {}", uid_file.display()))
        .env("SUDO_UID", "65534")
        .env("SUDO_GID", "65534")
        .env("SUDO_USER", "nobody")
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(&uid_file).unwrap().trim(), "65534");
    let trace = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().starts_with("gputrace-") && e.file_name().to_string_lossy().ends_with(".trace"))
        .expect("the default gputrace-YYYYmmdd-HHMMSS.trace in the current directory");
    assert_eq!(trace.metadata().unwrap().uid(), 65534, "owned by the invoking user");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--all` finds a process that already held the GPU by scanning every process, and follows it.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn all_finds_every_process_holding_the_gpu() {
    let _root = as_root();
    let dir = scratch("all");
    let script = r#""$W" hold --ms 1200 & W_PID=$!; sleep 0.4; "$G" record --all -o "$D/run.trace" & G_PID=$!; wait $W_PID; sleep 0.3; kill -INT $G_PID; wait $G_PID; echo "$W_PID" > "$D/pid""#;
    let out = in_fake_gpu(&dir, script);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let pid: u32 = std::fs::read_to_string(dir.join("pid")).unwrap().trim().parse().unwrap();
    let (_, records, _) = Reader::read_all(&dir.join("run.trace")).unwrap();
    assert!(records.iter().any(|r| r.pid == pid && matches!(r.event, Event::Process { seen: Seen::Running, .. })));
    assert_eq!(records.iter().filter(|r| r.pid == pid && matches!(r.event, Event::FdFound { .. })).count(), 3);
    let model = Model::from_records(&records);
    let later = model.allocations.iter().find(|a| a.pid == pid && a.bytes == 1 << 30).expect("its allocation after the scan");
    assert_eq!(later.freed.map(|f| f.1), Some(FreedBy::FileRelease));
    std::fs::remove_dir_all(&dir).ok();
}

/// `--raw` keeps the params bytes each event was decoded from.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn raw_keeps_the_bytes_behind_each_event() {
    let _root = as_root();
    let dir = scratch("raw");
    let out = in_fake_gpu(&dir, r#"exec "$G" record --raw -o "$D/run.trace" -- "$W" paths"#);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (header, records, _) = Reader::read_all(&dir.join("run.trace")).unwrap();
    assert!(header.raw);
    let hex = |s: &str| (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect::<Vec<u8>>();
    let mut checked = 0;
    for r in &records {
        if let Event::Alloc(a) = &r.event {
            let raw = r.raw.as_deref().expect("every ioctl event carries its bytes");
            if a.via == gputrace::event::Via::RmAllocNvos64 {
                let (params, class_params) = raw.split_once('|').expect("RM_ALLOC has its class params");
                assert_eq!(hex(params).len(), 48);
                let size = u64::from_le_bytes(hex(class_params)[64..72].try_into().unwrap());
                assert_eq!(size, a.bytes, "NV_MEMORY_ALLOCATION_PARAMS.size@64 is the decoded size");
                checked += 1;
            }
        }
        if matches!(r.event, Event::Process { .. } | Event::Exec { .. } | Event::Open { .. } | Event::Close { .. } | Event::Exit { .. }) {
            assert!(r.raw.is_none());
        }
    }
    assert_eq!(checked, 1);
    std::fs::remove_dir_all(&dir).ok();
}

/// `gputrace mark` from a wrapper script: recorded, and it overrides the inferred phase.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn explicit_marks_reach_the_trace_and_override_phases() {
    let _root = as_root();
    let dir = scratch("mark");
    let script = r#""$G" record -o "$D/run.trace" -- sh -c '"$W" hold --ms 800 & P=$!; sleep 0.3; "$G" mark decode --pid $P 2>"$D/ok"; "$G" mark decode --pid 1 2>"$D/refused"; wait $P'"#;
    let out = in_fake_gpu(&dir, script);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    assert!(read("ok").contains("marked pid"), "{}", read("ok"));
    assert!(read("refused").contains("pid 1 is not traced by this recorder"), "{}", read("refused"));
    let (_, records, _) = Reader::read_all(&dir.join("run.trace")).unwrap();
    let mark = records.iter().find(|r| matches!(&r.event, Event::Mark { phase } if phase == "decode")).expect("the mark in the trace");
    let model = Model::from_records(&records);
    let services = gputrace::analysis::services::Services::new(&model);
    let later = model.allocations.iter().find(|a| a.pid == mark.pid && a.ts > mark.ts).expect("an allocation after the mark");
    assert_eq!(services.phase_of(later.pid, later.ts), gputrace::analysis::Phase::Decode);
    let before = model.allocations.iter().find(|a| a.pid == mark.pid && a.ts < mark.ts).unwrap();
    assert_eq!(services.phase_of(before.pid, before.ts), gputrace::analysis::Phase::Load);
    let none = Command::new(gputrace_bin()).args(["mark", "idle", "--pid", "1"]).output().unwrap();
    assert!(String::from_utf8_lossy(&none.stderr).contains("no gputrace record is running"));
    std::fs::remove_dir_all(&dir).ok();
}

/// Any user can fill the kernel's table of followed fds with fds of their own. An answer it then
/// cannot take (here: a fork of a process holding 12 NVIDIA files, whose copies userspace adds
/// to a table of 16) ended the recording, and would end a watch; now it is counted with the
/// refused inserts and tracing goes on to the command's end.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_full_kernel_map_never_ends_tracing() {
    let _root = as_root();
    let dir = scratch("full-map-fork");
    let script = r#"GPUTRACE_FDS_ENTRIES=16 "$G" record -o "$D/fork.trace" -- bash -c 'for i in $(seq 12); do exec {fd}</dev/nvidiactl; done; (sleep 0.3) & wait; echo done' > "$D/fork.out" 2> "$D/fork.err""#;
    let out = in_fake_gpu(&dir, script);
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), read("fork.err"));
    assert_eq!(read("fork.out").trim(), "done");
    let err = read("fork.err");
    assert!(err.contains("tracing goes on") && err.contains("gputrace: warning: the kernel refused"), "{err}");
    let trace = read("fork.trace");
    assert!(trace.lines().any(|l| l.contains("\"seen\":\"forked\"")) && trace.lines().any(|l| l.contains("\"ev\":\"exit\"")), "{trace}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A full kernel table is said, never silent: with the table of followed fds shrunk to 16 entries
/// (GPUTRACE_FDS_ENTRIES), a process opening 31 NVIDIA files has some refused; the summary warns
/// of it, and with --kernel-log the programs' own diagnostics name the map and the process (off by
/// default: not a line of them without it).
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_full_kernel_map_is_warned_of_and_logged_with_kernel_log() {
    let _root = as_root();
    let dir = scratch("kernel-log");
    let script = r#"for log in plain --kernel-log; do
        flag=; [ "$log" = plain ] || flag=$log
        GPUTRACE_FDS_ENTRIES=16 "$G" record $flag -o "$D/$log.trace" -- bash -c 'for i in $(seq 31); do exec {fd}</dev/nvidiactl; done; echo "pid $$"' > "$D/$log.out" 2> "$D/$log.err" || exit 1
    done"#;
    let out = in_fake_gpu(&dir, script);
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    assert!(out.status.success(), "{}\n{}\n{}", String::from_utf8_lossy(&out.stderr), read("plain.err"), read("--kernel-log.err"));
    for log in ["plain", "--kernel-log"] {
        assert!(read(&format!("{log}.err")).contains("gputrace: warning: the kernel refused"), "{log}: {}", read(&format!("{log}.err")));
    }
    assert!(!read("plain.err").contains("gputrace: kernel:"), "no diagnostics unless asked: {}", read("plain.err"));
    let pid = read("--kernel-log.out").trim().strip_prefix("pid ").unwrap_or_default().to_string();
    let err = read("--kernel-log.err");
    let lines = err.lines().filter(|l| l.starts_with("gputrace: kernel: the map FDS is full")).collect::<Vec<_>>();
    assert!(!lines.is_empty() && lines.iter().all(|l| l.contains(&format!("pid {pid} "))), "pid {pid}: {err}");
    // A start refused leaves no trace file behind (the default name, in the current directory).
    let empty = dir.join("refused");
    std::fs::create_dir(&empty).unwrap();
    let bad = Command::new(gputrace_bin())
        .args(["record", "--", "true"])
        .env("GPUTRACE_FDS_ENTRIES", "lots")
        .current_dir(&empty)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("GPUTRACE_FDS_ENTRIES=\"lots\" is not a number"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    let left: Vec<_> = std::fs::read_dir(&empty).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "a refused start left {left:?}");
    std::fs::remove_dir_all(&dir).ok();
}
