use bytes::{Bytes, BytesMut};
use proptest::prelude::*;

use super::{records, Encoder};
use crate::event::*;

fn round_trip(input: &[Record]) -> Vec<Record> {
    let mut out = BytesMut::new();
    let mut encoder = Encoder::default();
    for r in input {
        encoder.put(r, &mut out);
    }
    records(&out.freeze()).collect()
}

/// Every kind of event, each field set from `v` and `s` (built here, not from the codec's own
/// description of the fields: a field it forgot comes back empty and the comparison fails).
fn every_event(v: [u64; 8], s: [String; 2]) -> Vec<Event> {
    let (a, b, c, d) = (v[0] as u32, v[1] as u32, v[2] as u32, v[3] as u32);
    let (fd, fd2) = (v[4] as i32, v[5] as i32);
    let (x, y) = (v[6], v[7]);
    let odd = a % 2 == 1;
    let some = |n: u64| (!n.is_multiple_of(3)).then_some(n);
    vec![
        Event::Exit { code: some(x).map(|n| n as i32) },
        Event::Open { fd, file: x, device: Device::Uvm, cloexec: odd },
        Event::FdFound { fd, file: y, device: Device::Gpu },
        Event::Dup { old_fd: fd, new_fd: fd2, cloexec: !odd },
        Event::Close { fd },
        Event::SetCloexec { fd: fd2, cloexec: odd },
        Event::Object { fd, client: a, parent: b, object: c, class: d, status: a ^ d, gpu: some(y).map(|n| n as u32) },
        Event::Alloc(Alloc {
            fd,
            via: Via::UvmCreateExternalRange,
            memory: Memory::Virtual,
            bytes: x,
            status: d,
            client: a,
            parent: b,
            object: c,
            class: d ^ 1,
            base: some(y),
            errno: some(x).map(|n| n as i32),
            holds: some(y ^ x).map(|n| n as u32),
        }),
        Event::Free { fd, via: Via::VidHeapControl, client: b, parent: c, object: a, status: d },
        Event::DupObject { fd, client: a, parent: b, object: c, src_client: d, src_object: a ^ b, status: c ^ d },
        Event::ExportObject { fd, client: a, object: b, to_fd: fd2, status: c },
        Event::ImportObject { fd, client: a, parent: b, object: c, from_fd: fd2, status: d },
        Event::RegisterFd { fd, ctl_fd: fd2 },
        Event::UvmMap { fd, base: x, length: y, offset: x ^ y, client: a, memory: b, status: c },
        Event::UvmFree { fd, base: y, status: d },
        Event::UvmUnmap { fd, base: x, length: y, status: a },
        Event::Lost { records: x },
        Event::Bind { fd, port: a as u16 },
        Event::Listen { fd: fd2 },
        Event::Accept { fd, conn: x },
        Event::Received { conn: y, bytes: x, request: odd.then(|| s[0].clone()) },
        Event::Received { conn: x, bytes: y, request: Some(s[0].clone()) },
        Event::Sent { conn: x, bytes: y, status: some(x).map(|n| n as u16), data: odd },
        Event::ConnClose { conn: y },
        Event::OomKill,
        Event::Process { ppid: a, seen: Seen::Forked, command: vec![s[0].clone(), s[1].clone(), s[0].clone()] },
        Event::Exec { command: vec![s[1].clone()] },
        Event::CloseRange { first: a, last: b, cloexec_only: odd },
        // Carried as JSON.
        Event::Place(Place { cgroup: s[0].clone(), uid: Some(a), ns_pid: Some(b), ..Place::default() }),
        Event::Share { fd, client: a, object: b, share_type: c as u16, target: d, action: a as u8, status: b },
        Event::ClientMaker { client: a, maker: b },
        Event::ExportObjects { fd, client: a, objects: vec![b, c, 0], index: d as u16, more: 2, to_fd: fd2, status: 0 },
        Event::ImportObjects { fd, client: a, parent: b, objects: vec![c], index: 1, more: 0, from_fd: fd2, status: d },
        Event::FabricAttach { fd, client: a, fabric: b, subdevice: c, attachments: vec![(d, x)], attached: 1, more: 0, status: 0 },
        Event::FabricDetach { fd, client: a, fabric: b, subdevice: c, offsets: vec![x, y], detached: 2, more: 1, status: 0 },
        Event::Undecodable { fd, cmd: a, reason: s[1].clone() },
        Event::Attached { listening: vec![a as u16, 8000], gpus: vec![b, 0] },
        Event::Mark { phase: s[0].clone() },
        Event::Proxy {
            uid: b,
            command: vec![s[0].clone(), "--config".into()],
            config: s[1].clone(),
            deployments: vec![Deployment {
                model: s[0].clone(),
                host: s[1].clone(),
                port: a as u16,
                max_parallel_requests: some(x),
                limit_from: "rpm".into(),
                local: Some(a % 2 == 0),
            }],
            workers: some(x),
        },
        Event::Sample(Sample {
            gpus: vec![GpuUse { gpu: a, used_bytes: x }],
            processes: vec![ProcessUse { pid: b, gpu: 0, used_bytes: some(y), command: vec![s[1].clone()] }],
            host: Some(HostMemory { total_bytes: x, available_bytes: y, swap_free_bytes: 0, pressure_some_avg10: Some(0.25) }),
        }),
    ]
}

/// Records of every kind, from several processes and threads, times going back and forth.
fn records_of(v: [u64; 8], s: [String; 2], pids: [u32; 3]) -> Vec<Record> {
    every_event(v, s)
        .into_iter()
        .enumerate()
        .map(|(i, event)| {
            let pid = pids[i % 3];
            let tid = if i % 4 == 0 { pid.wrapping_add(i as u32) } else { pid };
            let ts = v[6].wrapping_add((i as u64).wrapping_mul(v[7] | 1));
            Record { ts, pid, tid, event, raw: (i == 5).then(|| "deadbeef".to_string()) }
        })
        .collect()
}

#[test]
fn every_kind_of_event_comes_back_as_it_went_in() {
    let extremes = [[u64::MAX; 8], [0; 8], [1, 2, 3, 4, 5, 6, 7, 8], [0xc1d0_0001, 0xc1d0_0001, 0x5c00_0003, 0x40, 3, 7, 1 << 40, 2 << 20]];
    for v in extremes {
        for s in [["POST /v1/completions".to_string(), "--model".to_string()], [String::new(), "é\u{0}\n\"".to_string()]] {
            let input = records_of(v, s, [4242, 0, u32::MAX]);
            assert_eq!(round_trip(&input), input);
        }
    }
}

#[test]
fn a_request_line_is_written_once_a_segment() {
    let request = "POST /v1/completions HTTP/1.1".to_string();
    let received = |i: u64| Record {
        ts: i * 1000,
        pid: 42,
        tid: 42,
        event: Event::Received { conn: 100 + i, bytes: 4096, request: Some(request.clone()) },
        raw: None,
    };
    let input: Vec<Record> = (0..1000).map(received).collect();
    let mut out = BytesMut::new();
    let mut encoder = Encoder::default();
    for r in &input {
        encoder.put(r, &mut out);
    }
    // A header, the time, the connection, the size, the presence and the string's number: 8 or 9
    // bytes each; written out each time the line alone would be 29.
    assert!(out.len() < 1000 * 10, "{} bytes for 1000 requests", out.len());
    assert_eq!(records(&out.freeze()).collect::<Vec<_>>(), input);
}

#[test]
fn more_strings_than_a_segment_interns_still_come_back() {
    let input: Vec<Record> = (0..super::MAX_INTERNED as u32 * 2 + 3)
        .map(|i| Record {
            ts: u64::from(i),
            pid: i % 7,
            tid: i % 7,
            event: Event::Exec { command: vec![format!("worker-{i}"), format!("worker-{}", i / 2)] },
            raw: None,
        })
        .collect();
    assert_eq!(round_trip(&input), input);
}

proptest! {
    #[test]
    fn any_fields_come_back(v in any::<[u64; 8]>(), s0 in ".{0,40}", s1 in "\\PC{0,8}", pids in any::<[u32; 3]>()) {
        let input = records_of(v, [s0, s1], pids);
        prop_assert_eq!(round_trip(&input), input);
    }

    /// A segment cut anywhere gives back the records before the cut, at most one damaged one
    /// after them, and never panics; nor do bytes that were never a segment.
    #[test]
    fn cut_or_garbage_never_panics(v in any::<[u64; 8]>(), cut in any::<prop::sample::Index>(), garbage in prop::collection::vec(any::<u8>(), 0..512)) {
        let input = records_of(v, ["GET /health".into(), "python3".into()], [1, 2, 3]);
        let mut out = BytesMut::new();
        let mut encoder = Encoder::default();
        let mut ends = Vec::new();
        for r in &input {
            encoder.put(r, &mut out);
            ends.push(out.len());
        }
        let whole = out.freeze();
        let at = cut.index(whole.len() + 1);
        let back: Vec<Record> = records(&whole.slice(..at)).collect();
        let complete = ends.iter().filter(|&&end| end <= at).count();
        prop_assert!(back.len() >= complete && back.len() <= complete + 1, "{} of {} complete", back.len(), complete);
        prop_assert_eq!(&back[..complete], &input[..complete]);
        let _ = records(&Bytes::from(garbage)).count();
    }
}
