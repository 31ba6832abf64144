//! The flight recorder behind `gputrace watch`: the state before a window (a model of
//! everything older, kept to live state by compaction), the window itself as encoded records in
//! shared `Bytes` segments, and the dumps that triggers ask for. Pure: records in, dumps out; the
//! event loop and the files are `watch`'s.
//!
//! Memory stays bounded however long it runs: the window is capped in time and bytes, records
//! leaving it go into the base model, and the base is rebuilt from its own snapshot (only what
//! is live) as often as the window turns over.

use std::collections::{HashMap, HashSet, VecDeque};

use bytes::{Bytes, BytesMut};

use crate::event::{Event, Record};
use crate::model::Model;

/// A segment is closed (and shareable with a dump) at this size.
const SEGMENT_BYTES: usize = 64 << 10;

#[derive(Clone, Debug)]
pub struct Config {
    /// How much history a dump holds before its trigger.
    pub window_ns: u64,
    /// The window's cap in encoded bytes, whatever its length in time.
    pub max_bytes: usize,
    /// How long after a trigger a dump waits, so the aftermath is in it.
    pub aftermath_ns: u64,
    /// The least time between two dumps of one kind of trigger for one service; triggers in
    /// between are counted. One user's services have [`DUMPS_PER_USER`] in such a time.
    pub min_interval_ns: u64,
}

/// The dumps of one kind of trigger that one user's services may have in `min_interval_ns`:
/// several services of one user each get theirs, and no user can spend everyone's.
pub const DUMPS_PER_USER: usize = 3;

/// Whom a trigger's dump is counted against: its service (by its root's pid) and the user it
/// runs as, together. One service's or user's failures never hold back another's dumps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChargedTo {
    pub service: u32,
    pub uid: Option<u32>,
}

impl ChargedTo {
    /// Whom a failure of `pid` is charged to, in the live model. A process whose user is not known is a service of
    /// its own, and shares one user's dumps with every other such process.
    pub fn of(live: &Model, pid: u32) -> ChargedTo {
        match live.processes.get(&pid).and_then(|p| p.place.as_ref()?.uid) {
            Some(uid) => ChargedTo { service: crate::analysis::services::service_root(live, pid), uid: Some(uid) },
            None => ChargedTo { service: pid, uid: None },
        }
    }
}

/// Why a dump was written.
#[derive(Clone, Debug, PartialEq)]
pub enum Trigger {
    /// The driver refused an allocation (pid, bytes).
    FailedAllocation { pid: u32, bytes: u64 },
    /// The kernel's OOM killer chose a traced process.
    OomKill { pid: u32 },
    /// A process that used the GPU exited with a failure status (a server refusing to start
    /// for want of memory exits so, with no allocation refused).
    FailedExit { pid: u32, code: i32 },
    /// A process exited and its memory lives on: a forked child or another process still holds
    /// its files (the stale holder a later server will run into).
    LeftBehind { pid: u32, bytes: u64 },
    /// `gputrace dump` or SIGUSR1.
    Manual,
}

impl Trigger {
    pub fn name(&self) -> &'static str {
        match self {
            Trigger::FailedAllocation { .. } => "failed-allocation",
            Trigger::OomKill { .. } => "oom-kill",
            Trigger::FailedExit { .. } => "failed-exit",
            Trigger::LeftBehind { .. } => "left-behind",
            Trigger::Manual => "manual",
        }
    }

    /// Whether `record` (already applied to `live`) calls for a dump; `used_gpu`: whether its
    /// process opened an NVIDIA device file or allocated since it started.
    fn of(record: &Record, live: &Model, used_gpu: bool) -> Option<Trigger> {
        let pid = record.pid;
        match &record.event {
            // Refused for want of memory: a bad argument or a probe of a feature is no OOM.
            Event::Alloc(a) if crate::abi::status::is_out_of_memory(a.status) || a.errno == Some(libc::ENOMEM) => {
                Some(Trigger::FailedAllocation { pid, bytes: a.bytes })
            }
            Event::OomKill => Some(Trigger::OomKill { pid }),
            Event::Exit { code } => {
                // Stopped on purpose (SIGINT, SIGTERM; SIGKILL is a person's or the OOM killer's,
                // which has its own trigger) is no failure.
                let failed = code.filter(|c| ![0, 130, 137, 143].contains(c));
                if let Some(code) = failed.filter(|_| used_gpu) {
                    return Some(Trigger::FailedExit { pid, code });
                }
                let p = live.processes.get(&pid)?;
                let bytes = p.usage.physical_live();
                (bytes > 0).then_some(Trigger::LeftBehind { pid, bytes })
            }
            _ => None,
        }
    }
}

/// A dump ready to write: the state at its window's start, then the window, in order.
pub struct Dump {
    pub trigger: Trigger,
    /// Whose failure it is (None: someone asked): the dump is kept within that one's share.
    pub charged_to: Option<ChargedTo>,
    pub trigger_ts: u64,
    /// Triggers that came while it waited for its aftermath, counted in it.
    pub joined: u64,
    pub window_start: u64,
    pub snapshot: Vec<Record>,
    pub segments: Vec<Bytes>,
}

impl Dump {
    /// The processes there when watching began that the dump still holds: those its snapshot
    /// holds that had not exited at the window's start, and those its window meets running (the
    /// watch started within it).
    pub fn alive_at_start(&self) -> HashSet<u32> {
        let mut alive = HashSet::new();
        for r in &self.snapshot {
            match r.event {
                Event::Process { .. } => {
                    alive.insert(r.pid);
                }
                Event::Exit { .. } => {
                    alive.remove(&r.pid);
                }
                _ => {}
            }
        }
        let met = self
            .segments
            .iter()
            .flat_map(codec::records)
            .filter(|r| matches!(r.event, Event::Process { seen: crate::event::Seen::Running, .. }));
        alive.extend(met.map(|r| r.pid));
        alive
    }

    /// Every record of the dump, the snapshot first.
    pub fn records(&self) -> impl Iterator<Item = Record> + '_ {
        self.snapshot.iter().cloned().chain(self.segments.iter().flat_map(codec::records))
    }
}

struct Segment {
    bytes: Bytes,
    last_ts: u64,
}

struct Pending {
    trigger: Trigger,
    charged_to: Option<ChargedTo>,
    trigger_ts: u64,
    joined: u64,
    window_start: u64,
    snapshot: Vec<Record>,
    segments: Vec<Bytes>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counters {
    pub records: u64,
    pub allocations: u64,
    pub failures: u64,
    pub frees: u64,
    /// Records the kernel side dropped, as its Lost records said.
    pub lost: u64,
    pub encoded_bytes: u64,
    pub triggers: u64,
    pub dumps: u64,
    /// Triggers inside the least interval between dumps: not dumped.
    pub suppressed: u64,
    pub compactions: u64,
}

pub struct Flight {
    config: Config,
    /// Everything before the window.
    base: Model,
    segments: VecDeque<Segment>,
    bytes_in_segments: usize,
    current: BytesMut,
    /// What the open segment's records are written against.
    encoder: codec::Encoder,
    current_first_ts: Option<u64>,
    current_last_ts: u64,
    /// The first record's time in the window (the base's end).
    window_start: u64,
    pending: Option<Pending>,
    /// Running processes that opened an NVIDIA file or allocated (compaction keeps no history).
    gpu_users: HashSet<u32>,
    /// When each kind of trigger last started a dump, per service and user (a process another
    /// user runs below a service is charged on its own).
    last_trigger: HashMap<(&'static str, ChargedTo), u64>,
    /// When each kind of trigger started a dump for each user's services, the last few (None:
    /// every process whose user is not known).
    user_dumps: HashMap<(&'static str, Option<u32>), VecDeque<u64>>,
    last_compaction: u64,
    records_at_compaction: u64,
    pub counters: Counters,
}

/// Records between compactions at most, whatever the rate.
pub const COMPACT_EVERY: u64 = 100_000;

impl Flight {
    pub fn new(config: Config) -> Flight {
        Flight {
            config,
            base: Model::new(),
            segments: VecDeque::new(),
            bytes_in_segments: 0,
            current: BytesMut::with_capacity(SEGMENT_BYTES),
            encoder: codec::Encoder::default(),
            current_first_ts: None,
            current_last_ts: 0,
            window_start: 0,
            pending: None,
            last_trigger: HashMap::new(),
            user_dumps: HashMap::new(),
            gpu_users: HashSet::new(),
            last_compaction: 0,
            records_at_compaction: 0,
            counters: Counters::default(),
        }
    }

    /// Takes one record, already applied to the live model `live`: into the window, and a
    /// trigger if it is one.
    pub fn push(&mut self, record: &Record, live: &Model) {
        let c = &mut self.counters;
        c.records += 1;
        match &record.event {
            Event::Alloc(a) if a.succeeded() => c.allocations += 1,
            Event::Alloc(_) => c.failures += 1,
            Event::Free { .. } | Event::UvmFree { .. } => c.frees += 1,
            Event::Lost { records } => c.lost = c.lost.saturating_add(*records),
            _ => {}
        }
        let start = self.current.len();
        self.encoder.put(record, &mut self.current);
        self.counters.encoded_bytes += (self.current.len() - start) as u64;
        self.current_first_ts.get_or_insert(record.ts);
        self.current_last_ts = self.current_last_ts.max(record.ts);
        // Closed by size, or by age at a slow rate, so the window turns over in steps of an
        // eighth of it either way.
        let aged = self.current_first_ts.is_some_and(|first| record.ts.saturating_sub(first) > self.config.window_ns / 8);
        if self.current.len() >= SEGMENT_BYTES || aged {
            self.close_segment();
        }
        let used_gpu = match &record.event {
            Event::Open { .. } | Event::FdFound { .. } | Event::Alloc(_) => {
                self.gpu_users.insert(record.pid);
                true
            }
            Event::Exit { .. } => self.gpu_users.remove(&record.pid),
            _ => self.gpu_users.contains(&record.pid),
        };
        if let Some(trigger) = Trigger::of(record, live, used_gpu) {
            self.trigger(trigger, Some(ChargedTo::of(live, record.pid)), record.ts);
        }
        self.evict(record.ts);
    }

    /// A trigger at `ts`, charged to `charged_to` (None: someone asked): a dump starts waiting for its
    /// aftermath, or the one waiting counts it, or it is too soon after the last of its service
    /// or its user has had their share, and it is counted only.
    pub fn trigger(&mut self, trigger: Trigger, charged_to: Option<ChargedTo>, ts: u64) {
        self.counters.triggers += 1;
        if let Some(p) = &mut self.pending {
            p.joined += 1;
            return;
        }
        // Each kind on its own: a dump of memory left behind never holds back the failure's.
        if let Some(charged_to) = charged_to {
            let kind = trigger.name();
            let interval = self.config.min_interval_ns;
            let recent = |t: &u64| ts < t.saturating_add(interval);
            if self.last_trigger.get(&(kind, charged_to)).is_some_and(recent) {
                self.counters.suppressed += 1;
                return;
            }
            // Processes whose user could not be read share one user's dumps: each such
            // process is a service of its own, and one that exits at once is what a user racing
            // the watch's read of /proc would make in a loop.
            let times = self.user_dumps.entry((kind, charged_to.uid)).or_default();
            times.retain(recent);
            if times.len() >= DUMPS_PER_USER {
                self.counters.suppressed += 1;
                return;
            }
            times.push_back(ts);
            // Parties whose interval is over are forgotten: the books hold the last interval's.
            self.last_trigger.retain(|_, t| recent(t));
            self.user_dumps.retain(|_, times| times.back().is_some_and(recent));
            self.last_trigger.insert((kind, charged_to), ts);
        }
        self.close_segment();
        let segments = self.segments.iter().map(|s| s.bytes.clone()).collect();
        // The state at the window's start: the base, as the window's first record found it.
        self.pending = Some(Pending {
            trigger,
            charged_to,
            trigger_ts: ts,
            joined: 0,
            window_start: self.window_start,
            snapshot: self.base.snapshot(),
            segments,
        });
    }

    /// What a dump waiting for its aftermath is for, and until when.
    pub fn waiting(&self) -> Option<(&Trigger, u64)> {
        self.pending.as_ref().map(|p| (&p.trigger, p.trigger_ts.saturating_add(self.config.aftermath_ns)))
    }

    /// The dump whose aftermath is over at `now` (or any waiting one, with `now` None: the
    /// watch is stopping).
    pub fn take_dump(&mut self, now: Option<u64>) -> Option<Dump> {
        let (_, until) = self.waiting()?;
        if now.is_some_and(|now| now < until) {
            return None;
        }
        // What is in the open segment goes in too (closing it hands it to the waiting dump).
        self.close_segment();
        let p = self.pending.take()?;
        self.counters.dumps += 1;
        Some(Dump {
            trigger: p.trigger,
            charged_to: p.charged_to,
            trigger_ts: p.trigger_ts,
            joined: p.joined,
            window_start: p.window_start,
            snapshot: p.snapshot,
            segments: p.segments,
        })
    }

    fn close_segment(&mut self) {
        if self.current.is_empty() {
            return;
        }
        // Copied out at its size: the open buffer grows past the segment's size when the last
        // record crosses it, and a sealed segment would keep all of that alive. The buffer is
        // reused.
        let bytes = Bytes::copy_from_slice(&self.current);
        self.current.clear();
        self.bytes_in_segments += bytes.len();
        // A waiting dump keeps every segment closed since its trigger, evicted or not.
        if let Some(p) = &mut self.pending {
            p.segments.push(bytes.clone());
        }
        self.segments.push_back(Segment { bytes, last_ts: self.current_last_ts });
        self.current_first_ts = None;
        self.encoder = codec::Encoder::default();
    }

    /// Segments older than the window, or past its byte cap, go into the base.
    fn evict(&mut self, now: u64) {
        let oldest_kept = now.saturating_sub(self.config.window_ns);
        while let Some(first) = self.segments.front() {
            let too_old = first.last_ts < oldest_kept;
            let too_big = self.bytes_in_segments + self.current.len() > self.config.max_bytes;
            if !(too_old || too_big) {
                break;
            }
            let segment = self.segments.pop_front().expect("front exists");
            self.bytes_in_segments -= segment.bytes.len();
            let mut next_start = segment.last_ts;
            for record in codec::records(&segment.bytes) {
                next_start = record.ts;
                self.base.apply(&record);
            }
            self.window_start = next_start;
        }
    }

    /// Both models keep only what is live, each rebuilt from its own snapshot: the base (what
    /// came before the window) and the caller's live model, which is replaced. Often enough that
    /// neither grows far (every eighth of a window, or every [`COMPACT_EVERY`] records), cheap
    /// since a snapshot is only what is live. What compaction forgets (freed allocations, ended
    /// requests, failures) is in the window for a dump.
    pub fn compact(&mut self, now: u64, live: &mut Model) -> bool {
        if !self.compaction_due(now) {
            return false;
        }
        self.last_compaction = now;
        self.records_at_compaction = self.counters.records;
        self.counters.compactions += 1;
        self.base = Model::from_records(&self.base.snapshot());
        *live = Model::from_records(&live.snapshot());
        true
    }

    /// The next [`Flight::compact`] compacts: what the live model forgets is to be read first.
    pub fn compaction_due(&self, now: u64) -> bool {
        now >= self.last_compaction.saturating_add(self.config.window_ns / 8)
            || self.counters.records >= self.records_at_compaction + COMPACT_EVERY
    }

    /// Bytes the window holds now.
    pub fn window_bytes(&self) -> usize {
        self.bytes_in_segments + self.current.len()
    }
}

pub mod codec;
pub mod stream;

#[cfg(test)]
mod tests;
