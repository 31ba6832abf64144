use super::*;
use crate::event::{Alloc, Device, Seen, Via};

const S: u64 = 1_000_000_000;
const GIB: u64 = 1 << 30;

fn config() -> Config {
    Config { window_ns: 10 * S, max_bytes: 1 << 20, aftermath_ns: 2 * S, min_interval_ns: 60 * S }
}

fn rec(ts: u64, pid: u32, event: Event) -> Record {
    Record::new(ts, pid, pid, event)
}

fn alloc(ts: u64, pid: u32, client: u32, object: u32, bytes: u64, status: u32) -> Record {
    rec(ts, pid, Event::Alloc(Alloc { status, ..Alloc::video(client, client, object, bytes) }))
}

/// A process that opens the control file, makes a client and allocates `bytes`.
fn start(ts: u64, pid: u32, bytes: u64) -> Vec<Record> {
    let client = 0xc1d0_0000 + pid;
    vec![
        rec(ts, pid, Event::Process { ppid: 1, seen: Seen::Forked, command: vec![format!("worker{pid}")] }),
        rec(ts, pid, Event::Open { fd: 3, file: u64::from(pid), device: Device::Ctl, cloexec: false }),
        rec(ts, pid, Event::Object { fd: 3, client, parent: client, object: client, class: 0x41, status: 0, gpu: None }),
        alloc(ts, pid, client, 0x100, bytes, 0),
    ]
}

fn push_all(flight: &mut Flight, live: &mut Model, records: &[Record]) {
    for r in records {
        live.apply(r);
        flight.push(r, live);
    }
}

/// A holder set up long before the window, then a minute of churn, then a failure: the dump
/// holds the failure and, through its snapshot, the holder's memory from before its window.
#[test]
fn a_dump_carries_what_was_held_before_its_window() {
    let mut flight = Flight::new(config());
    let mut live = Model::new();
    push_all(&mut flight, &mut live, &start(S, 10, 60 * GIB));
    // Short-lived workers come and go, each past the window by the end.
    for i in 0..600u32 {
        let (ts, pid) = (2 * S + u64::from(i) * S / 10, 1000 + i);
        let mut records = start(ts, pid, GIB);
        records.push(rec(ts + 1, pid, Event::Exit { code: Some(0) }));
        push_all(&mut flight, &mut live, &records);
    }
    let failed_at = 70 * S;
    push_all(&mut flight, &mut live, &start(failed_at, 20, 0));
    push_all(&mut flight, &mut live, &[alloc(failed_at + 1, 20, 0xc1d0_0014, 0x200, 30 * GIB, 0x51)]);
    assert_eq!(flight.waiting().map(|(t, _)| t.clone()), Some(Trigger::FailedAllocation { pid: 20, bytes: 30 * GIB }));
    assert!(flight.take_dump(Some(failed_at + S)).is_none(), "waits for the aftermath");
    push_all(&mut flight, &mut live, &[rec(failed_at + 3 * S, 20, Event::Exit { code: Some(1) })]);
    let dump = flight.take_dump(Some(failed_at + 3 * S)).expect("due");
    assert!(dump.window_start > 50 * S, "the window is the last 10 s or so, not the run: {}", dump.window_start);
    let model = Model::from_records(&dump.records().collect::<Vec<_>>());
    let held: Vec<_> = model.live_allocations().map(|a| (a.pid, a.bytes, a.ts)).collect();
    assert_eq!(held, [(10, 60 * GIB, S)], "the holder's memory, with its own time");
    assert_eq!(model.failures.len(), 1);
    assert_eq!(model.processes[&20].exit_code, Some(1), "the aftermath is in");
    assert!(model.processes.len() < 100, "workers that came and went before the window are not: {}", model.processes.len());
    assert_eq!(flight.counters.dumps, 1);
}

const ROOTS: Option<ChargedTo> = Some(ChargedTo { service: 4, uid: Some(0) });

/// Triggers while a dump waits join it; one of the same kind for the same service soon after it
/// is counted, not dumped; asking always works, and another kind has its own interval.
#[test]
fn dumps_are_rate_limited() {
    let mut flight = Flight::new(config());
    flight.trigger(Trigger::OomKill { pid: 4 }, ROOTS, S);
    flight.trigger(Trigger::Manual, None, 2 * S);
    let dump = flight.take_dump(Some(3 * S)).expect("due");
    assert_eq!((dump.trigger, dump.joined), (Trigger::OomKill { pid: 4 }, 1));
    flight.trigger(Trigger::OomKill { pid: 5 }, ROOTS, 30 * S);
    assert!(flight.waiting().is_none());
    assert_eq!(flight.counters.suppressed, 1);
    flight.trigger(Trigger::Manual, None, 31 * S);
    assert!(flight.take_dump(Some(33 * S)).is_some(), "someone asked: the least interval does not hold it back");
    flight.trigger(Trigger::FailedAllocation { pid: 5, bytes: GIB }, ROOTS, 40 * S);
    assert!(flight.take_dump(Some(42 * S)).is_some(), "a failure is not held back by an OOM kill's dump");
    flight.trigger(Trigger::OomKill { pid: 6 }, ROOTS, 62 * S);
    assert!(flight.waiting().is_some(), "past the least interval");
}

/// One user's failure never spends another's dump: root's server fails 5 s after another
/// user's and gets its own dump; a user with many services gets a few dumps an interval, not
/// every one.
#[test]
fn one_party_never_spends_anothers_dumps() {
    let mut flight = Flight::new(config());
    let mallory = |service| Some(ChargedTo { service, uid: Some(1001) });
    flight.trigger(Trigger::FailedAllocation { pid: 70, bytes: GIB }, mallory(70), S);
    assert!(flight.take_dump(Some(3 * S)).is_some());
    flight.trigger(Trigger::FailedAllocation { pid: 4, bytes: GIB }, ROOTS, 6 * S);
    assert!(flight.take_dump(Some(8 * S)).is_some(), "root's failure is dumped");
    for (i, service) in (71..80).enumerate() {
        flight.trigger(Trigger::FailedAllocation { pid: service, bytes: GIB }, mallory(service), (10 + 3 * i as u64) * S);
        let _ = flight.take_dump(Some((12 + 3 * i as u64) * S));
    }
    assert_eq!(flight.counters.dumps, 2 + (DUMPS_PER_USER as u64 - 1), "the user's share, the first already spent");
    flight.trigger(Trigger::FailedAllocation { pid: 5, bytes: GIB }, Some(ChargedTo { service: 5, uid: Some(0) }), 45 * S);
    assert!(flight.take_dump(Some(47 * S)).is_some(), "another of root's services still gets its dump");
    // Another user's process below root's service (started through it) is charged on its own.
    flight.trigger(Trigger::FailedAllocation { pid: 90, bytes: GIB }, Some(ChargedTo { service: 5, uid: Some(1002) }), 50 * S);
    assert!(flight.waiting().is_some());
}

/// Processes whose user could not be read (each exited before the watch read /proc, a race a
/// user can run in a loop) are services of their own but one user: a few dumps an interval, and
/// a known user's failure is still dumped.
#[test]
fn processes_of_unknown_users_share_one_users_dumps() {
    let mut flight = Flight::new(config());
    let unknown = |pid| Some(ChargedTo { service: pid, uid: None });
    for (i, pid) in (100..110).enumerate() {
        flight.trigger(Trigger::FailedAllocation { pid, bytes: GIB }, unknown(pid), (1 + 3 * i as u64) * S);
        let _ = flight.take_dump(Some((3 + 3 * i as u64) * S));
    }
    assert_eq!(flight.counters.dumps, DUMPS_PER_USER as u64);
    assert_eq!(flight.counters.suppressed, 10 - DUMPS_PER_USER as u64);
    flight.trigger(Trigger::FailedAllocation { pid: 4, bytes: GIB }, ROOTS, 40 * S);
    assert!(flight.waiting().is_some(), "root's failure is dumped");
}

/// A process forked from another user's runs as that user until a Place says otherwise: a
/// failure of a workload nobody started from their shell (forked under a shared parent, no
/// Place of its own) is nobody's, not root's.
#[test]
fn a_fork_is_its_parents_user() {
    let place = |uid| Event::Place(crate::event::Place { cgroup: "/".into(), uid: Some(uid), ..Default::default() });
    let process = |ppid, seen| Event::Process { ppid, seen, command: vec!["p".into()] };
    let records = [
        rec(1, 1, process(0, Seen::Running)),
        rec(1, 1, place(0)),
        rec(2, 10, process(1, Seen::Forked)),
        rec(2, 10, place(65534)),
        rec(3, 11, process(10, Seen::Forked)),
        rec(4, 12, process(1, Seen::Forked)),
    ];
    let live = Model::from_records(&records);
    assert_eq!(ChargedTo::of(&live, 11).uid, Some(65534), "nobody's workload");
    assert_eq!(ChargedTo::of(&live, 12).uid, Some(0), "root's");
    assert_ne!(ChargedTo::of(&live, 11), ChargedTo::of(&live, 12));
    // Unknown users' processes are services of their own.
    let unknown = Model::from_records(&[rec(1, 20, process(0, Seen::Running)), rec(1, 21, process(0, Seen::Running))]);
    assert_ne!(ChargedTo::of(&unknown, 20), ChargedTo::of(&unknown, 21));
}

/// Hours of pid churn (a server restarted, workers by the thousand): the window stays under its
/// cap, and the models stay the size of what is live.
#[test]
fn memory_stays_bounded_under_churn() {
    let mut flight = Flight::new(config());
    let mut live = Model::new();
    push_all(&mut flight, &mut live, &start(0, 10, GIB));
    for i in 0..20_000u32 {
        let ts = S + u64::from(i) * S / 20;
        // pids come round again, as the kernel's do.
        let pid = 100 + i % 3000;
        let mut records = start(ts, pid, GIB);
        records.push(rec(
            ts + 1,
            pid,
            Event::Free { fd: 3, via: Via::RmFree, client: 0xc1d0_0000 + pid, parent: 0, object: 0x100, status: 0 },
        ));
        records.push(rec(ts + 2, pid, Event::Exit { code: Some(0) }));
        push_all(&mut flight, &mut live, &records);
        flight.compact(ts, &mut live);
        assert!(flight.window_bytes() <= config().max_bytes + SEGMENT_BYTES, "{}", flight.window_bytes());
    }
    assert!(flight.counters.compactions > 10);
    // The base holds the living, and what left the window since the last compaction (at most
    // an eighth of a window: 1.25 s of 20 workers a second), not the 20,000 that came and went.
    let since = 2 * 20 + 10;
    assert!(flight.base.processes.len() <= since, "the base keeps the living: {}", flight.base.processes.len());
    assert!(flight.base.allocations.len() <= since, "and live memory: {}", flight.base.allocations.len());
    assert!(live.processes.len() <= since, "the live model keeps the living too: {}", live.processes.len());
    assert_eq!(live.live_allocations().map(|a| (a.pid, a.bytes)).collect::<Vec<_>>(), [(10, GIB)]);
}

/// A server exits and a forked child it left still holds its file: its memory lives on, and
/// that is worth a dump before anyone runs into it.
#[test]
fn memory_left_behind_by_an_exit_triggers_a_dump() {
    let mut flight = Flight::new(config());
    let mut live = Model::new();
    let mut records = start(S, 10, 70 * GIB);
    records.push(rec(2 * S, 11, Event::Process { ppid: 10, seen: Seen::Forked, command: vec!["helper".into()] }));
    records.push(rec(3 * S, 10, Event::Exit { code: None }));
    push_all(&mut flight, &mut live, &records);
    assert_eq!(flight.waiting().map(|(t, _)| t.clone()), Some(Trigger::LeftBehind { pid: 10, bytes: 70 * GIB }));
    // An exit that takes its memory with it is no reason.
    let mut flight = Flight::new(config());
    let mut live = Model::new();
    let mut records = start(S, 20, GIB);
    records.push(rec(2 * S, 20, Event::Exit { code: Some(0) }));
    push_all(&mut flight, &mut live, &records);
    assert!(flight.waiting().is_none());
}

/// A server that used the GPU and exits with a failure status (a refusal at start allocates
/// nothing that fails) is a reason for a dump; one stopped with SIGTERM is not.
#[test]
fn a_failed_exit_of_a_gpu_user_triggers_a_dump() {
    for (code, dumps) in [(Some(1), true), (Some(143), false), (Some(137), false), (None, false)] {
        let mut flight = Flight::new(config());
        let mut live = Model::new();
        let mut records = start(S, 30, GIB);
        records.push(rec(2 * S, 30, Event::Free { fd: 3, via: Via::RmFree, client: 0xc1d0_001e, parent: 0, object: 0x100, status: 0 }));
        records.push(rec(3 * S, 30, Event::Exit { code }));
        push_all(&mut flight, &mut live, &records);
        let expected = dumps.then_some(Trigger::FailedExit { pid: 30, code: 1 });
        assert_eq!(flight.waiting().map(|(t, _)| t.clone()), expected, "exit code {code:?}");
    }
}
