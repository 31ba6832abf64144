//! Synthetic streams for the flight recorder's benchmark and memory test: a server answering
//! requests (allocating scratch in each, freeing it after), and short-lived workers coming and
//! going with reused pids, a sample now and then; and one shaped like a PyTorch server's on the
//! real driver.

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
        f(&Record::new(ts, pid, pid, event));
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

/// `events` records at `rate` a second shaped like a PyTorch HTTP server's on the real driver
/// (issue 22's H200 measurement): requests on its sockets, each allocating through
/// cuMemCreate/cuMemMap (RM_ALLOC of class 0x40, UVM_CREATE_EXTERNAL_RANGE, UVM_MAP) and freeing
/// after (UVM_FREE, RM_FREE), from several threads, with RM's own handle values; a device file
/// opened and registered now and then.
pub fn pytorch_server(rate: u64, events: u64, mut f: impl FnMut(&Record)) {
    const CLIENT: u32 = 0xc1d0_004c;
    const DEVICE: u32 = 0xcaf0_0002;
    let step = 1_000_000_000 / rate;
    let mut ts = 0u64;
    let mut n = 0u64;
    let mut put = |tid: u32, event: Event| {
        ts += step;
        n += 1;
        f(&Record::new(ts, SERVER, tid, event));
        n
    };
    put(
        SERVER,
        Event::Process {
            ppid: 1,
            seen: Seen::Launched,
            command: vec!["python3".into(), "serve.py".into(), "--port".into(), "8000".into()],
        },
    );
    put(SERVER, Event::Open { fd: 7, file: 1, device: Device::Ctl, cloexec: true });
    put(SERVER, Event::Object { fd: 7, client: CLIENT, parent: CLIENT, object: DEVICE, class: 0x80, status: 0, gpu: Some(0) });
    let mut object = 0x5c00_0040u32;
    let mut base = 0x7f3a_0000_0000u64;
    let mut conn = 1u64;
    let mut requests = 0u64;
    let mut fd = 20;
    loop {
        // The HTTP thread reads and answers; a CUDA worker thread allocates.
        let (http, worker) = (SERVER + 1 + (requests % 4) as u32, SERVER + 8);
        put(http, Event::Accept { fd: 31, conn });
        put(http, Event::Received { conn, bytes: 2048, request: Some("POST /generate HTTP/1.1".into()) });
        let mut ranges = Vec::new();
        for _ in 0..3 {
            let length = 2 << 20;
            put(worker, Event::Alloc(Alloc { via: Via::RmAllocNvos21, parent: DEVICE, ..Alloc::video(CLIENT, DEVICE, object, length) }));
            put(worker, Event::Alloc(Alloc::uvm_range(9, base, length)));
            put(worker, Event::UvmMap { fd: 9, base, length, offset: 0, client: CLIENT, memory: object, status: 0 });
            ranges.push((base, object));
            object += 1;
            base += length;
        }
        put(http, Event::Sent { conn, bytes: 120, status: Some(200), data: false });
        put(http, Event::Sent { conn, bytes: 512, status: None, data: true });
        for (range, handle) in ranges {
            put(worker, Event::UvmFree { fd: 9, base: range, status: 0 });
            put(worker, Event::Free { fd: 7, via: Via::RmFree, client: CLIENT, parent: DEVICE, object: handle, status: 0 });
        }
        if put(http, Event::ConnClose { conn }) >= events {
            return;
        }
        conn += 1;
        requests += 1;
        if requests.is_multiple_of(50) {
            put(worker, Event::Open { fd, file: 2 + requests, device: Device::Gpu, cloexec: true });
            put(worker, Event::RegisterFd { fd, ctl_fd: 7 });
            put(worker, Event::Close { fd });
            fd = 20 + (fd + 1) % 8;
        }
        if requests.is_multiple_of(100) {
            put(0, Event::Sample(Default::default()));
        }
    }
}
