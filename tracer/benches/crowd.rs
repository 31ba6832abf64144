//! `cargo bench -p tracer --bench crowd`: what a host crowded by one user costs the analysis. An
//! ordinary user can fork thousands of processes (each a service of its own in a watch's live
//! model), make allocations, and have workers OOM-killed; a watch builds its report from that
//! state for every dump and `/metrics`, and an admin runs `report` and `export --format html` on
//! such a trace. For each crowd, twice the one before, the report's and the HTML page's time and
//! size: the ratio to the crowd before is 2 where the cost grows as the crowd does, 4 where it
//! grows as its square.
use std::time::Instant;

use gputrace::event::{Alloc, Device, Event, Record, Seen};
use gputrace::model::Model;
use gputrace::report::{Loss, Report};
use gputrace::trace::{Gpu, Header};

/// GPUs of the server whose workers are killed (a death names no GPU: each is a candidate).
const GPUS: u32 = 16;
/// Workers killed, each diagnosed.
const DEATHS: u32 = 100;

/// `crowd` single-process services each holding 1 MiB, and a server holding memory on every GPU
/// whose workers the OOM killer kills one after another.
fn crowded(crowd: u32) -> (Header, Model) {
    let gpus = (0..GPUS).map(|index| Gpu { index, name: "bench".into(), total_bytes: Some(80 << 30), used_bytes: None }).collect();
    let header = Header { gpus, nvml: "ok".into(), ..Header::default() };
    let mut records = Vec::new();
    let mut at = |ts: u64, pid: u32, event: Event| records.push(Record::new(ts, pid, pid, event));
    for i in 0..crowd {
        let (pid, client, ts) = (10_000 + i, 0x100_0000 + i, u64::from(i) * 1_000);
        at(ts, pid, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["job".into(), i.to_string()] });
        at(ts, pid, Event::Open { fd: 3, file: u64::from(i) + 10, device: Device::Ctl, cloexec: false });
        at(ts, pid, Event::Object { fd: 3, client, parent: client, object: client, class: 0x41, status: 0, gpu: None });
        at(ts, pid, Event::Object { fd: 3, client, parent: client, object: 0x100, class: 0x80, status: 0, gpu: Some(i % GPUS) });
        at(ts, pid, Event::Alloc(Alloc::video(client, 0x100, 0x200, 1 << 20)));
    }
    let (server, client, ts) = (500, 0xc000_0001, u64::from(crowd) * 1_000);
    at(ts, server, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["server".into()] });
    at(ts, server, Event::Open { fd: 3, file: 1, device: Device::Ctl, cloexec: false });
    at(ts, server, Event::Object { fd: 3, client, parent: client, object: client, class: 0x41, status: 0, gpu: None });
    for g in 0..GPUS {
        at(ts, server, Event::Object { fd: 3, client, parent: client, object: 0x100 + g, class: 0x80, status: 0, gpu: Some(g) });
        at(ts, server, Event::Alloc(Alloc::video(client, 0x100 + g, 0x1_0000 + g, 1 << 30)));
    }
    for k in 0..DEATHS {
        let worker = server + 1 + k;
        at(ts + 10 + u64::from(k), worker, Event::Process { ppid: server, seen: Seen::Forked, command: vec!["server".into()] });
        at(ts + 1_000 + u64::from(k), worker, Event::OomKill);
    }
    (header, Model::from_records(&records))
}

fn main() {
    println!("{:>7} {:>10} {:>6} {:>10} {:>10} {:>6} {:>10}", "crowd", "report s", "ratio", "report KB", "html s", "ratio", "html KB");
    let mut before: Option<(f64, f64)> = None;
    for crowd in [500, 1_000, 2_000, 4_000] {
        let (header, model) = crowded(crowd);
        let began = Instant::now();
        let report = Report::new(&header, &model, String::new(), 0, Loss::default(), u64::MAX);
        let report_s = began.elapsed().as_secs_f64();
        let json = serde_json::to_string(&report).unwrap().len();
        let began = Instant::now();
        let mut page = Vec::new();
        gputrace::export::html(&header, &model, &report, &mut page).unwrap();
        let html_s = began.elapsed().as_secs_f64();
        let ratio = |now: f64, then: Option<f64>| then.map_or("-".to_string(), |t| format!("{:.1}", now / t));
        println!(
            "{crowd:>7} {report_s:>10.3} {:>6} {:>10} {html_s:>10.3} {:>6} {:>10}",
            ratio(report_s, before.map(|b| b.0)),
            json / 1000,
            ratio(html_s, before.map(|b| b.1)),
            page.len() / 1000
        );
        before = Some((report_s, html_s));
    }
}
