//! A synthetic stream for the flight recorder's benchmark and memory test: a server answering
//! requests (allocating scratch in each, freeing it after), and short-lived workers coming and
//! going with reused pids, a sample now and then.

use crate::event::{Alloc, Device, Event, Record, Seen, Via};

const SERVER: u32 = 4242;

/// `events` records at `rate` a second, handed to `f` one at a time.
pub fn stream(rate: u64, events: u64, mut f: impl FnMut(&Record)) {
    let step = 1_000_000_000 / rate;
    let mut ts = 0u64;
    let n = std::cell::Cell::new(0u64);
    let mut put = |pid: u32, event: Event| {
        ts += step;
        n.set(n.get() + 1);
        f(&Record { ts, pid, tid: pid, event, raw: None });
    };
    let alloc = |client: u32, object: u32, bytes: u64| Event::Alloc(Alloc::video(client, client, object, bytes));
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
    while n.get() < events {
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
