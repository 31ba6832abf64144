//! `cargo bench -p tracer --bench flight`: what `gputrace watch` costs, beside what keeping a
//! whole trace in the model (as `record` does) costs, on the same synthetic stream: a server
//! answering requests (allocating scratch in each, freeing it after) and short-lived workers
//! coming and going with reused pids. Each run is a child process of its own (its CPU time and
//! peak resident memory from getrusage); the stream's timestamps say the event rate.
use std::process::Command;
use std::time::Instant;

use bytes::BytesMut;
use gputrace::event::Record;
use gputrace::flight::codec::{self, Encoder};
use gputrace::flight::stream::{pytorch_server, stream};
use gputrace::flight::{Config, Flight, Trigger};
use gputrace::model::Model;

const EVENTS: u64 = 3_000_000;

/// The child: one way of keeping the stream.
fn run(op: &str) {
    match op {
        "model" => {
            let mut model = Model::new();
            stream(1_000, EVENTS, |r| model.apply(r));
            assert!(model.allocations.len() as u64 > EVENTS / 5, "the model keeps every allocation");
        }
        "watch-1k" | "watch-100k" | "watch-100k-pytorch" => {
            let rate = if op == "watch-1k" { 1_000 } else { 100_000 };
            let config = Config { window_ns: 600_000_000_000, max_bytes: 24 << 20, aftermath_ns: 0, min_interval_ns: 0 };
            let mut flight = Flight::new(config);
            let mut live = Model::new();
            let mut last = 0;
            let mut each = |r: &Record| {
                live.apply(r);
                flight.push(r, &live);
                last = r.ts;
                // As watch's event loop does a few times a second.
                if r.ts / 100_000_000 != (r.ts - 1_000_000_000 / rate) / 100_000_000 {
                    flight.compact(r.ts, &mut live);
                }
            };
            match op.ends_with("pytorch") {
                true => pytorch_server(rate, EVENTS, &mut each),
                false => stream(rate, EVENTS, &mut each),
            }
            let started = Instant::now();
            flight.trigger(Trigger::Manual, None, last);
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
    for (op, what) in [
        ("watch-1k", "watch, 1k events/s (50 min)"),
        ("watch-100k", "watch, 100k events/s (30 s)"),
        ("watch-100k-pytorch", "watch, PyTorch's shape, 100k/s"),
    ] {
        let (s, kb) = measure(op);
        row(what, s, kb);
        println!("{:<34} {:.3}% of a core at 1,000 events a second", "", s / EVENTS as f64 * 1_000.0 * 100.0);
    }
    let mut records = Vec::new();
    stream(1_000, 300_000, |r| records.push(r.clone()));
    encodings("the same stream", &records);
    records.clear();
    pytorch_server(1_000, 300_000, |r| records.push(r.clone()));
    encodings("a PyTorch server's shape", &records);
}

/// The window's encoding against JSON Lines (what it held before), each encoding the same
/// records once and decoding them back, as the window does.
fn encodings(stream: &str, records: &[Record]) {
    let n = records.len() as f64;
    let per_event = |started: Instant| started.elapsed().as_secs_f64() * 1e9 / n;
    let started = Instant::now();
    let mut json = Vec::new();
    for r in records {
        serde_json::to_writer(&mut json, r).unwrap();
        json.push(b'\n');
    }
    let json_encode = per_event(started);
    let started = Instant::now();
    let back: Vec<Record> = json.split(|&b| b == b'\n').filter(|l| !l.is_empty()).map(|l| serde_json::from_slice(l).unwrap()).collect();
    let json_decode = per_event(started);
    assert_eq!(back, records);
    // In segments of the window's size, each with an encoder of its own.
    let started = Instant::now();
    let mut segments = Vec::new();
    let (mut current, mut encoder) = (BytesMut::new(), Encoder::default());
    for r in records {
        encoder.put(r, &mut current);
        if current.len() >= 64 << 10 {
            segments.push(current.split().freeze());
            encoder = Encoder::default();
        }
    }
    segments.push(current.freeze());
    let window_encode = per_event(started);
    let started = Instant::now();
    let back: Vec<Record> = segments.iter().flat_map(codec::records).collect();
    let window_decode = per_event(started);
    assert_eq!(back, records, "the window's encoding gives back what it was given");
    let window_bytes: usize = segments.iter().map(|s| s.len()).sum();
    println!("\nthe window's encoding, {} records of {stream}:", records.len());
    println!("{:<34} {:>12} {:>12} {:>12} {:>14} {:>14}", "", "bytes/event", "encode ns", "decode ns", "bytes / JSON", "CPU / JSON");
    for (name, bytes, enc, dec) in
        [("JSON Lines (before)", json.len(), json_encode, json_decode), ("the window's own", window_bytes, window_encode, window_decode)]
    {
        println!(
            "{name:<34} {:>12.1} {enc:>12.0} {dec:>12.0} {:>14.2} {:>14.2}",
            bytes as f64 / n,
            bytes as f64 / json.len() as f64,
            (enc + dec) / (json_encode + json_decode)
        );
    }
    // The default --window-bytes at three rates.
    let per_event = window_bytes as f64 / n;
    for rate in [1_000.0, 10_000.0, 100_000.0] {
        println!("{:<34} 24 MiB hold {:.1} minutes at {rate} events/s", "", (24 << 20) as f64 / per_event / rate / 60.0);
    }
}
