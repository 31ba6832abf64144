//! `cargo bench -p tracer --bench export`: for a trace of a million events, each export's time
//! and peak memory, and its ratio to merely reading the trace. Each operation runs in a child
//! process of its own, so its peak resident memory is its own (getrusage of that child).
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use gputrace::event::{Alloc, Device, Event, Memory, Record, Seen, Via};
use gputrace::model::Model;
use gputrace::report::{Loss, Report};
use gputrace::trace::{Header, Reader, Writer};

const EVENTS: u64 = 1_000_000;
const SERVER: u32 = 4242;

/// A server's life: load allocations, then requests, each allocating scratch in prefill and
/// freeing it after, with its socket traffic.
fn write_trace(path: &Path) {
    let header = Header {
        tracer_version: "bench".into(),
        driver_version: Some("580.95.05".into()),
        driver_version_source: "bench".into(),
        wall_clock_start_ns: 1_800_000_000_000_000_000,
        nvml: "bench".into(),
        ..Header::default()
    };
    let mut w = Writer::create(path, &header, None).unwrap();
    let mut ts = 0u64;
    let mut put = |w: &mut Writer, event: Event| {
        ts += 10_000;
        w.write(&Record { ts, pid: SERVER, tid: SERVER, event, raw: None }).unwrap();
    };
    put(&mut w, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["server".into()] });
    put(&mut w, Event::Open { fd: 3, file: 1, device: Device::Ctl, cloexec: true });
    put(&mut w, Event::Object { fd: 3, client: 1, parent: 0, object: 1, class: 0x41, status: 0, gpu: None });
    put(&mut w, Event::Object { fd: 3, client: 1, parent: 1, object: 2, class: 0x80, status: 0, gpu: None });
    let alloc = |object: u32, bytes: u64| {
        Event::Alloc(Alloc {
            fd: 3,
            via: Via::RmAllocNvos64,
            memory: Memory::Video,
            bytes,
            status: 0,
            client: 1,
            parent: 2,
            object,
            class: 0x40,
            base: None,
            errno: None,
            holds: None,
        })
    };
    let mut written = 4;
    let mut object = 100u32;
    put(&mut w, Event::Listen { fd: 5 });
    while written < EVENTS {
        let conn = object as u64;
        put(&mut w, Event::Accept { fd: 9, conn });
        put(&mut w, Event::Received { conn, bytes: 4096, request: Some("POST /v1/completions".into()) });
        put(&mut w, Event::Sent { conn, bytes: 96, status: Some(200), data: false });
        for i in 0..3 {
            put(&mut w, alloc(object + i, 2 << 20));
        }
        put(&mut w, Event::Sent { conn, bytes: 40, status: None, data: true });
        for i in 0..3 {
            put(&mut w, Event::Free { fd: 3, via: Via::RmFree, client: 1, parent: 2, object: object + i, status: 0 });
        }
        put(&mut w, Event::ConnClose { conn });
        object += 3;
        written += 11;
    }
    w.flush().unwrap();
}

fn load(path: &Path) -> (Header, Model, u64) {
    let (header, model, events, _) = gputrace::report::load(path, false).unwrap();
    (header, model, events)
}

/// The child: one operation on the trace.
fn run(op: &str, path: &Path) {
    let mut sink = std::io::sink();
    match op {
        "read" => {
            let n = Reader::open(path).unwrap().inspect(|r| assert!(r.is_ok(), "a record that does not read")).count();
            assert_eq!(n as u64 + 1, EVENTS.next_multiple_of(11) - 6 + 1);
        }
        "model" => {
            let (_, m, _) = load(path);
            assert!(m.allocations.len() > 250_000);
        }
        "report" => {
            let (h, m, n) = load(path);
            let _ = Report::new(&h, &m, String::new(), n, Loss::default(), u64::MAX).text();
        }
        // The same report with the card's size known: each serving service's headroom too (a
        // trace without NVML has none, as the plain report's).
        "report-80GiB" => {
            let (mut h, m, n) = load(path);
            h.assume_capacity(80 << 30);
            let report = Report::new(&h, &m, String::new(), n, Loss::default(), u64::MAX);
            assert_eq!(report.headroom.len(), 1, "the server's headroom");
        }
        "whatif" => {
            let (mut h, m, _) = load(path);
            h.assume_capacity(80 << 30);
            let settings = gputrace::analysis::whatif::Settings { max_concurrency: Some(8), ..Default::default() };
            let _ = gputrace::report::whatif::outcome(&gputrace::report::what_if(&h, &m, 0, &settings, true).unwrap());
        }
        "perfetto" => {
            let (h, m, n) = load(path);
            let report = Report::new(&h, &m, String::new(), n, Loss::default(), u64::MAX);
            gputrace::export::perfetto(&h, &m, &report, &mut sink).unwrap();
        }
        "html" => {
            let (h, m, n) = load(path);
            let report = Report::new(&h, &m, String::new(), n, Loss::default(), u64::MAX);
            gputrace::export::html(&h, &m, &report, &mut sink).unwrap();
        }
        "csv" => {
            let (h, m, _) = load(path);
            gputrace::export::csv(&h, &m, &mut sink).unwrap();
        }
        other => panic!("no operation {other}"),
    }
}

/// Seconds and peak resident kilobytes of one child running `op`.
fn measure(op: &str, path: &Path) -> (f64, i64) {
    let start = Instant::now();
    // Reaped by wait4 below, which std cannot see: it also gives the child's peak memory.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(std::env::current_exe().unwrap()).args(["--op", op]).arg(path).spawn().unwrap();
    let mut status = 0;
    // SAFETY: wait4 fills the child's rusage.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(status, 0, "{op} failed");
    (start.elapsed().as_secs_f64(), usage.ru_maxrss)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--op") {
        return run(&args[i + 1], Path::new(&args[i + 2]));
    }
    let path: PathBuf = std::env::temp_dir().join(format!("gputrace-bench-{}.trace", std::process::id()));
    let started = Instant::now();
    write_trace(&path);
    let size = std::fs::metadata(&path).unwrap().len();
    println!("a trace of {EVENTS} events ({:.0} MiB), written in {:.2} s", size as f64 / (1 << 20) as f64, started.elapsed().as_secs_f64());
    let (read_s, read_kb) = measure("read", &path);
    println!("{:<10} {:>9} {:>12} {:>13} {:>14}", "operation", "seconds", "peak MiB", "time / read", "memory / read");
    println!("{:<10} {:>9.2} {:>12.1} {:>13.2} {:>14.2}", "read", read_s, read_kb as f64 / 1024.0, 1.0, 1.0);
    for op in ["model", "report", "report-80GiB", "whatif", "perfetto", "html", "csv"] {
        let (s, kb) = measure(op, &path);
        println!("{op:<10} {s:>9.2} {:>12.1} {:>13.2} {:>14.2}", kb as f64 / 1024.0, s / read_s, kb as f64 / read_kb as f64);
    }
    std::fs::remove_file(&path).ok();
}
