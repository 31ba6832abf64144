//! `gputrace watch` on the fake GPU, beside `gputrace record` of the same run: the dump a failure
//! triggers, with a window far shorter than the run, gives the report the whole recording gives.

mod common;

use std::path::Path;
use std::process::Command;

use common::{as_root, gputrace_bin};
use serde_json::Value;

fn report(trace: &Path) -> Value {
    let out = Command::new(gputrace_bin()).args(["report", "--json"]).arg(trace).output().unwrap();
    assert!(out.status.success(), "report {}: {}", trace.display(), String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn watched(name: &str) {
    let _root = as_root();
    let dir = std::env::temp_dir().join(format!("gputrace-watch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dumps = dir.join("dumps");
    let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["scenario", name, "--server", "vllm", "--nvml", "discrete", "--dir"])
        .arg(&dir)
        .arg("--gputrace")
        .arg(gputrace_bin())
        .env("GPUTRACE_WATCH_DUMPS", &dumps)
        .output()
        .unwrap();
    let log = std::fs::read_to_string(dir.join("watch.log")).unwrap_or_default();
    assert!(out.status.success(), "{name}: {}\n{log}", String::from_utf8_lossy(&out.stderr));
    let traces: Vec<_> =
        std::fs::read_dir(&dumps).unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "trace")).collect();
    assert_eq!(traces.len(), 1, "one dump for the failure (the rest joined it or came too soon): {traces:?}\n{log}");
    let dump = &traces[0];
    assert!(dump.file_name().unwrap().to_string_lossy().contains("failed-allocation"), "{}", dump.display());
    assert!(dump.with_extension("report.txt").exists(), "its report is beside it");
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(dump).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    assert!(log.contains("gputrace: dump ") && log.contains("VERDICT"), "one line says where and what: {log}");

    let (whole, window) = (report(&dir.join("run.trace")), report(dump));
    // The window (200 ms) is a fraction of the run: the load before it is in the dump only
    // through its snapshot.
    let span = |r: &Value| r["duration_ns"].as_f64().unwrap_or(0.0) / 1e9;
    assert!(span(&whole) > 0.4, "the run is longer than the window: {} s", span(&whole));
    let (w, d) = (&whole["diagnosis"], &window["diagnosis"]);
    assert_ne!(w["category"], "none");
    for field in ["category", "symptom", "gpu", "fix", "evidence"] {
        assert_eq!(d[field], w[field], "{name}: the dump's {field} is the recording's\nwhole: {w:#}\ndump: {d:#}");
    }
    // The recording leaves itself out; the watch sees `gputrace record` as the server's parent,
    // so its service is named from there: the same server under its wrapper.
    let (ws, ds) = (w["service"].as_str().unwrap(), d["service"].as_str().unwrap());
    let args = ws.split_once(' ').map_or(ws, |(_, args)| args);
    assert!(ds == ws || (ds.starts_with("gputrace record") && ds.ends_with(args)), "{name}: service {ds:?}, recorded {ws:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_dump_of_a_long_request_reports_what_the_recording_does() {
    watched("long-request");
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_dump_of_a_concurrent_load_reports_what_the_recording_does() {
    watched("concurrent-load");
}
