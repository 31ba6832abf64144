//! A trace cut short (the recorder killed, a disk full, a file copied while written) is read as
//! far as it goes, and said to be partial before the verdict: `report` puts what it lacks first
//! and exits 3. Needs no root.

mod common;

use std::process::Command;

use common::gputrace_bin;
use gputrace::event::{Alloc, Event, Record, Seen};
use gputrace::trace::{Gpu, Header, Writer};

/// A server that loads 10 GiB, then fails an allocation of 80 GiB at 2 s: the trace's bytes, and
/// where the failure's line begins.
fn trace() -> (Vec<u8>, usize) {
    let path = std::env::temp_dir().join(format!("gputrace-partial-{}.trace", std::process::id()));
    let gpus = vec![Gpu { index: 0, name: "test".into(), total_bytes: Some(80 << 30), used_bytes: None }];
    let header = Header { nvml: "ok".into(), gpus, ..Header::default() };
    let mut w = Writer::create(&path, &header, None).unwrap();
    let record = |ts: u64, event| Record::new(ts, 42, 42, event);
    w.write(&record(1, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["server".into()] })).unwrap();
    for i in 0..10 {
        w.write(&record(1_000_000 + i, Event::Alloc(Alloc::video(1, 2, 0x100 + i as u32, 1 << 30)))).unwrap();
    }
    w.flush().unwrap();
    let failure_at = std::fs::metadata(&path).unwrap().len() as usize;
    let failed = Alloc { status: 0x51, ..Alloc::video(1, 2, 0x200, 80 << 30) };
    w.write(&record(2_000_000_000, Event::Alloc(failed))).unwrap();
    w.write(&record(2_100_000_000, Event::Exit { code: Some(1) })).unwrap();
    w.flush().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).ok();
    (bytes, failure_at)
}

fn report(bytes: &[u8], name: &str) -> (Option<i32>, String) {
    let path = std::env::temp_dir().join(format!("gputrace-partial-{name}-{}.trace", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let out = Command::new(gputrace_bin()).arg("report").arg(&path).output().unwrap();
    std::fs::remove_file(&path).ok();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn a_cut_trace_says_so_before_its_verdict_and_exits_3() {
    let (whole, failure_at) = trace();
    let (code, text) = report(&whole, "whole");
    assert_eq!(code, Some(0), "{text}");
    assert!(text.starts_with("OOM ") && !text.contains("PARTIAL"), "{text}");
    // Cut mid-line before the failure, at several points: none failed in the part recorded.
    for cut in [failure_at / 2, failure_at - 10, failure_at + 5] {
        let (code, text) = report(&whole[..cut], &format!("cut{cut}"));
        assert_eq!(code, Some(3), "cut at {cut}: {text}");
        let first = text.lines().next().unwrap_or_default();
        assert!(first.starts_with("PARTIAL: the trace ends at ") && first.contains("cut mid-line"), "cut at {cut}: {text}");
        assert!(first.contains("nothing failed in the part recorded"), "cut at {cut}: {text}");
        assert!(text.lines().nth(1).is_some_and(|l| l == "OK: nothing failed"), "cut at {cut}: {text}");
    }
    // Cut after the failure, in the last line: the verdict stands, said partial first.
    let (code, text) = report(&whole[..whole.len() - 3], "after");
    assert_eq!(code, Some(3), "{text}");
    assert!(text.starts_with("PARTIAL: ") && !text.lines().next().unwrap().contains("nothing failed"), "{text}");
    assert!(text.lines().nth(1).is_some_and(|l| l.starts_with("OOM ")), "{text}");
}

/// `report` of a trace of `n` processes, each forked, opening nvidiactl and (with `exit`)
/// exiting 0, under `ulimit -v` of `kib`, then `export --format html` under the same: the
/// exit statuses and the report's text.
fn many_processes(n: u32, exit: bool, kib: u64) -> (Option<i32>, Option<i32>, String) {
    let path = std::env::temp_dir().join(format!("gputrace-partial-many-{n}-{exit}-{}.trace", std::process::id()));
    let gpus = vec![Gpu { index: 0, name: "test".into(), total_bytes: Some(80 << 30), used_bytes: None }];
    let mut w = Writer::create(&path, &Header { nvml: "ok".into(), gpus, ..Header::default() }, None).unwrap();
    for i in 0..n {
        let (pid, ts) = (10_000 + i, 1_000 + 10 * u64::from(i));
        let command = vec!["/usr/bin/python3".to_string(), "-m".into(), "worker".into(), i.to_string()];
        w.write(&Record::new(ts, pid, pid, Event::Process { ppid: 1, seen: Seen::Launched, command })).unwrap();
        let open = Event::Open { fd: 5, file: u64::from(i) + 1, device: gputrace::event::Device::Ctl, cloexec: true };
        w.write(&Record::new(ts + 1, pid, pid, open)).unwrap();
        if exit {
            w.write(&Record::new(ts + 2, pid, pid, Event::Exit { code: Some(0) })).unwrap();
        }
    }
    w.flush().unwrap();
    let under_limit = |args: &str| {
        let script = format!("ulimit -v {kib} && exec \"$0\" {args} \"$1\"");
        Command::new("sh").args(["-c", &script]).arg(gputrace_bin()).arg(&path).output().unwrap()
    };
    let report = under_limit("report");
    let html = under_limit("export --format html");
    assert!(html.status.success() || html.status.code() == Some(3), "{}", String::from_utf8_lossy(&html.stderr));
    std::fs::remove_file(&path).ok();
    (report.status.code(), html.status.code(), String::from_utf8_lossy(&report.stdout).into_owned())
}

/// SECURITY.md's bound: a million processes that come and go are read in bounded memory (256 MiB
/// of address space; 4.7 KB each once made it 4.7 GB, and an abort), each forgotten once it exited
/// having allocated nothing, and said so. Alive at once past the 65,536 kept, the rest's records
/// are counted and said first, and the status is 3.
#[test]
fn a_million_processes_are_read_in_bounded_memory() {
    let (report, html, text) = many_processes(1_000_000, true, 256 << 10);
    assert_eq!((report, html), (Some(0), Some(0)), "{text}");
    assert!(
        text.contains("exited processes that never allocated were forgotten as the trace went") && text.contains("Lost events: 0."),
        "{text}"
    );
    let (report, html, text) = many_processes(100_000, false, 256 << 10);
    assert_eq!((report, html), (Some(3), Some(0)), "{text}");
    let first = text.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("PARTIAL: the trace has more than 65536 processes at once that cannot be forgotten: ")
            && first.contains("records of processes past them were not followed"),
        "{text}"
    );
}
