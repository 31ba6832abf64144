//! `cargo bench -p tracer --bench flight`: what `gputrace watch` costs, beside what keeping a
//! whole trace in the model (as `record` does) costs, on the same synthetic stream: a server
//! answering requests (allocating scratch in each, freeing it after) and short-lived workers
//! coming and going with reused pids. Each run is a child process of its own (its CPU time and
//! peak resident memory from getrusage); the stream's timestamps say the event rate.
use std::process::Command;
use std::time::Instant;

use gputrace::event::{Alloc, Device, Event, Memory, Record, Seen, Via};
use gputrace::flight::{Config, Flight, Trigger};
use gputrace::model::Model;

const EVENTS: u64 = 3_000_000;
const SERVER: u32 = 4242;

/// The stream, `rate` events a second, handed to `f` one record at a time.
fn stream(rate: u64, mut f: impl FnMut(&Record)) {
    let step = 1_000_000_000 / rate;
    let mut ts = 0u64;
    let n = std::cell::Cell::new(0u64);
    let mut put = |pid: u32, event: Event| {
        ts += step;
        n.set(n.get() + 1);
        f(&Record { ts, pid, tid: pid, event, raw: None });
    };
    let alloc = |client: u32, object: u32, bytes: u64| {
        Event::Alloc(Alloc {
            fd: 3,
            via: Via::RmAllocNvos64,
            memory: Memory::Video,
            bytes,
            status: 0,
            client,
            parent: client,
            object,
            class: 0x40,
            base: None,
            errno: None,
        })
    };
    let start = |put: &mut dyn FnMut(u32, Event), pid: u32| {
        put(pid, Event::Process { ppid: 1, seen: Seen::Forked, command: vec![format!("worker-{pid}"), "--model".into(), "x".into()] });
        put(pid, Event::Open { fd: 3, file: u64::from(pid), device: Device::Ctl, cloexec: true });
        put(pid, Event::Object { fd: 3, client: pid, parent: pid, object: pid, class: 0x41, status: 0, gpu: Some(0) });
    };
    start(&mut put, SERVER);
    put(SERVER, alloc(SERVER, 1, 40 << 30));
    put(SERVER, Event::Listen { fd: 5 });
    let mut object = 100u32;
    let mut worker = 0u32;
    let mut requests = 0u64;
    while n.get() < EVENTS {
        let conn = u64::from(object);
        put(SERVER, Event::Accept { fd: 9, conn });
        put(SERVER, Event::Received { conn, bytes: 4096, request: Some("POST /v1/completions".into()) });
        put(SERVER, Event::Sent { conn, bytes: 96, status: Some(200), data: false });
        for i in 0..3 {
            put(SERVER, alloc(SERVER, object + i, 2 << 20));
        }
        put(SERVER, Event::Sent { conn, bytes: 40, status: None, data: true });
        for i in 0..3 {
            put(SERVER, Event::Free { fd: 3, via: Via::RmFree, client: SERVER, parent: SERVER, object: object + i, status: 0 });
        }
        put(SERVER, Event::ConnClose { conn });
        object = object.wrapping_add(3);
        requests += 1;
        // A worker every few requests: pids come round again, as the kernel's do.
        if requests.is_multiple_of(10) {
            let pid = 10_000 + worker % 5_000;
            worker += 1;
            start(&mut put, pid);
            put(pid, alloc(pid, 7, 1 << 30));
            put(pid, Event::Exit { code: Some(0) });
        }
        if requests.is_multiple_of(100) {
            put(0, Event::Sample(Default::default()));
        }
    }
}

/// The child: one way of keeping the stream.
fn run(op: &str) {
    match op {
        "model" => {
            let mut model = Model::new();
            stream(1_000, |r| model.apply(r));
            assert!(model.allocations.len() as u64 > EVENTS / 5, "the model keeps every allocation");
        }
        "watch-1k" | "watch-100k" => {
            let rate = if op == "watch-1k" { 1_000 } else { 100_000 };
            let config = Config { window_ns: 600_000_000_000, max_bytes: 24 << 20, aftermath_ns: 0, min_interval_ns: 0 };
            let mut flight = Flight::new(config);
            let mut live = Model::new();
            let mut last = 0;
            stream(rate, |r| {
                live.apply(r);
                flight.push(r, &live);
                last = r.ts;
                // As watch's event loop does a few times a second.
                if r.ts / 100_000_000 != (r.ts - 1_000_000_000 / rate) / 100_000_000 {
                    flight.compact(r.ts, &mut live);
                }
            });
            let started = Instant::now();
            flight.trigger(Trigger::Manual, last);
            let dump = flight.take_dump(None).unwrap();
            let mut sink = std::io::sink();
            let mut n = 0u64;
            for record in dump.records() {
                serde_json::to_writer(&mut sink, &record).unwrap();
                n += 1;
            }
            let c = &flight.counters;
            println!(
                "{} encoded bytes per event; a dump of {n} records ({} in its snapshot) made in {:.2} s; window {:.1} MiB; {} compactions",
                c.encoded_bytes / c.records,
                dump.snapshot.len(),
                started.elapsed().as_secs_f64(),
                flight.window_bytes() as f64 / (1 << 20) as f64,
                c.compactions
            );
        }
        other => panic!("no operation {other}"),
    }
}

/// CPU seconds and peak resident kilobytes of one child running `op`.
fn measure(op: &str) -> (f64, i64) {
    // Reaped by wait4 below, which std cannot see: it also gives the child's CPU and peak memory.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(std::env::current_exe().unwrap()).args(["--op", op]).spawn().unwrap();
    let mut status = 0;
    // SAFETY: wait4 fills the child's rusage.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(status, 0, "{op} failed");
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (seconds(usage.ru_utime) + seconds(usage.ru_stime), usage.ru_maxrss)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--op") {
        return run(&args[i + 1]);
    }
    println!("{EVENTS} events of a server and short-lived workers; CPU and peak memory of each way of keeping them:");
    let (model_s, model_kb) = measure("model");
    println!("{:<34} {:>9} {:>10} {:>12} {:>13} {:>14}", "", "CPU s", "peak MiB", "ns / event", "CPU / model", "memory / model");
    let row = |name: &str, s: f64, kb: i64| {
        println!(
            "{name:<34} {s:>9.2} {:>10.1} {:>12.0} {:>13.2} {:>14.2}",
            kb as f64 / 1024.0,
            s * 1e9 / EVENTS as f64,
            s / model_s,
            kb as f64 / model_kb as f64
        )
    };
    row("model of everything (as record)", model_s, model_kb);
    for (op, what) in [("watch-1k", "watch, 1k events/s (50 min)"), ("watch-100k", "watch, 100k events/s (30 s)")] {
        let (s, kb) = measure(op);
        row(what, s, kb);
        println!("{:<34} {:.3}% of a core at 1,000 events a second", "", s / EVENTS as f64 * 1_000.0 * 100.0);
    }
}
