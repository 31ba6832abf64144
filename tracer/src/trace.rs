//! The trace file: JSON Lines. The first line is a [`Header`]; every other line is one
//! [`Record`]. Append-only and flushed often, so a recorder killed with SIGKILL leaves a file that
//! reads up to its last flush. The format is documented in docs/trace-format.md.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::dir::{create_private, open_for_reading, Dir};
use crate::event::Record;
use crate::user::{as_user, User};

pub const FORMAT: &str = "gputrace-trace";
pub const VERSION: u32 = 1;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: u32,
    pub name: String,
    /// Device memory, when the driver reports it (unified-memory parts report none).
    pub total_bytes: Option<u64>,
    pub used_bytes: Option<u64>,
}

/// Memory a process held on a GPU when tracing began, as NVML reported it: what existed before
/// the first traced allocation.
pub type PriorUse = crate::event::ProcessUse;

impl Header {
    /// `--capacity`: each GPU whose capacity NVML could not tell gets `bytes`; with no GPU known at
    /// all (no NVML), GPU 0 is assumed, of that size.
    pub fn assume_capacity(&mut self, bytes: u64) {
        if self.gpus.is_empty() {
            self.gpus.push(Gpu { index: 0, name: "(capacity given with --capacity)".into(), total_bytes: None, used_bytes: None });
        }
        for g in self.gpus.iter_mut().filter(|g| g.total_bytes.is_none()) {
            g.total_bytes = Some(bytes);
        }
    }
}

/// A process that had NVIDIA device files open when tracing began: who holds GPU memory alive,
/// even when NVML names only a pid that is gone (a forked child keeps a dead parent's memory).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HolderAtStart {
    pub pid: u32,
    pub ppid: u32,
    pub command: Vec<String>,
    /// The device files it has open: "ctl", "gpu", "uvm".
    pub devices: Vec<String>,
    /// The program it runs (what says it is a daemon holding the GPU by design, not argv[0]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exe: Option<crate::procfs::command::Executable>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub format: String,
    pub version: u32,
    pub tracer_version: String,
    pub host: String,
    pub kernel: String,
    /// "580.95.05"; None when no driver was found and none was given.
    pub driver_version: Option<String>,
    /// Where the version came from: a file path, "--driver-version", or "none".
    pub driver_version_source: String,
    /// Wall clock (ns since the Unix epoch) and CLOCK_MONOTONIC (ns) read at the same moment:
    /// record times are monotonic; wall = wall_clock_start_ns + (ts - monotonic_start_ns).
    pub wall_clock_start_ns: u64,
    pub monotonic_start_ns: u64,
    /// What NVML said at start; empty with the reason in `nvml` when it could not be asked.
    pub gpus: Vec<Gpu>,
    pub prior_use: Vec<PriorUse>,
    /// Every process with NVIDIA device files open at start, from /proc.
    #[serde(default)]
    pub holders_at_start: Vec<HolderAtStart>,
    /// How NVIDIA's files were told from others at start: by device number, or by path alone
    /// (no driver loaded). Empty in traces older than the field.
    #[serde(default)]
    pub device_check: String,
    pub nvml: String,
    /// The gputrace command line that made this trace.
    pub command: Vec<String>,
    /// Records carry the raw params bytes.
    pub raw: bool,
    /// A dump of a watch: each serving service's level at rest over the requests it served,
    /// as the watch kept it beyond its window (see `analysis::kept`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rest_history: Vec<RestSeries>,
}

/// A moment a service was at rest: its last request in flight had just ended (or, for the first,
/// its first request was about to arrive).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AtRest {
    /// CLOCK_MONOTONIC, as records.
    pub ts: u64,
    /// The service's video memory on the GPU then: traced, and what it held before tracing.
    pub bytes: u64,
    /// Completions that had ended by then, since tracing began.
    pub served: u64,
}

/// The requests served between two moments at rest, and what the level did over them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stretch {
    /// The moment at rest before.
    pub start: u64,
    pub end: AtRest,
    /// What the level rose (or, negative, fell) by.
    pub delta: i64,
    pub requests: u64,
    /// Its requests in flight together received more than any before: a pool may have grown.
    pub larger: bool,
}

/// Stretches that count (none larger) folded into one: what a long history keeps of its oldest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Folded {
    pub delta: i64,
    pub requests: u64,
    pub stretches: u64,
    pub rises: u64,
    /// When the first that rose ended.
    pub began_at: Option<u64>,
}

/// One service's history at rest on one GPU, as a watch keeps it: bounded, the latest stretches
/// one by one, the older folded, every larger one's span kept (where a pool may have grown).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RestSeries {
    /// The service's root process.
    pub root: u32,
    pub gpu: Option<u32>,
    pub ready: AtRest,
    pub earlier: Folded,
    pub stretches: Vec<Stretch>,
    /// The spans of the larger stretches folded away: (start, end).
    pub larger_spans: Vec<(u64, u64)>,
    /// The most the requests in flight together had received, so far.
    pub largest: u64,
}

impl Default for Header {
    /// A header that knows nothing but its format: what tests, benchmarks and the fuzzer start
    /// from (`Header { gpus, ..Header::default() }`).
    fn default() -> Header {
        Header {
            format: FORMAT.into(),
            version: VERSION,
            tracer_version: String::new(),
            host: String::new(),
            kernel: String::new(),
            driver_version: None,
            driver_version_source: "none".into(),
            wall_clock_start_ns: 0,
            monotonic_start_ns: 0,
            gpus: Vec::new(),
            prior_use: Vec::new(),
            holders_at_start: Vec::new(),
            device_check: String::new(),
            nvml: String::new(),
            command: Vec::new(),
            raw: false,
            rest_history: Vec::new(),
        }
    }
}

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("cannot open the trace {path}: {cause}")]
    Open { path: PathBuf, cause: io::Error },
    #[error("{path} is not a gputrace trace: its first line is not a gputrace header ({reason})")]
    NotATrace { path: PathBuf, reason: String },
    #[error("{path} is a gputrace trace of format version {found}; this gputrace reads version {VERSION}: use a gputrace at least as new as the one that recorded it")]
    Version { path: PathBuf, found: u64 },
    #[error("reading the trace {path}: {cause}")]
    Read { path: PathBuf, cause: io::Error },
    #[error("writing the trace {path}: {cause}")]
    Write { path: PathBuf, cause: io::Error },
}

pub struct Writer {
    out: BufWriter<File>,
    path: PathBuf,
    pub records: u64,
}

impl Writer {
    /// Creates the trace as `user` would (see [`crate::dir::create_private`]): mode 0600, never
    /// through a symbolic link, never over someone else's file.
    pub fn create(path: &Path, header: &Header, user: Option<&User>) -> Result<Writer, TraceError> {
        let file = create_private(path, user).map_err(|cause| TraceError::Open { path: path.into(), cause })?;
        Writer::start(file, path.into(), header)
    }

    /// The same, as `name` in a directory held open (a watch's dumps).
    pub fn create_in(dir: &Dir, name: &OsStr, header: &Header, user: Option<&User>) -> Result<Writer, TraceError> {
        let path = dir.path().join(name);
        let file = as_user(user, || dir.create_private(name)).map_err(|cause| TraceError::Open { path: path.clone(), cause })?;
        Writer::start(file, path, header)
    }

    fn start(file: File, path: PathBuf, header: &Header) -> Result<Writer, TraceError> {
        let mut w = Writer { out: BufWriter::with_capacity(1 << 16, file), path, records: 0 };
        w.line(header)?;
        w.flush()?;
        Ok(w)
    }

    fn line<T: Serialize>(&mut self, value: &T) -> Result<(), TraceError> {
        let err = |cause| TraceError::Write { path: self.path.clone(), cause };
        serde_json::to_writer(&mut self.out, value).map_err(|e| err(e.into()))?;
        self.out.write_all(b"\n").map_err(err)
    }

    pub fn write(&mut self, record: &Record) -> Result<(), TraceError> {
        self.records += 1;
        self.line(record)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn flush(&mut self) -> Result<(), TraceError> {
        self.out.flush().map_err(|cause| TraceError::Write { path: self.path.clone(), cause })
    }
}

/// The longest line a reader takes: far above any record gputrace writes (a record with `--raw`
/// bytes is a few KiB), far below what would exhaust memory. Longer lines are skipped unread.
pub const MAX_LINE: usize = 1 << 20;
/// Damaged lines named by number in a report; the rest are counted.
const NAMED_BAD_LINES: usize = 20;

/// What reading left out: a torn last line (the recorder died mid-write) or damaged lines
/// (not JSON, not UTF-8, longer than [`MAX_LINE`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ReadDamage {
    pub torn_tail: bool,
    /// How many lines did not parse, other than a torn last line.
    pub bad_lines: u64,
    /// The first of them, 1-based line numbers.
    pub first_bad_lines: Vec<u64>,
}

impl ReadDamage {
    fn bad(&mut self, line: u64) {
        self.bad_lines += 1;
        if self.first_bad_lines.len() < NAMED_BAD_LINES {
            self.first_bad_lines.push(line);
        }
    }
}

/// A line as read: its bytes, or the fact that it was too long to keep.
enum Line {
    Kept,
    TooLong,
}

/// Reads lines as bytes, keeping at most [`MAX_LINE`] of each: a file with no newline at all
/// (`/dev/zero`) costs a MiB and an answer, not all the memory and time there is. A line whole in
/// what was read is taken where it lies, not copied (reading a trace is most of loading it).
struct Lines<R> {
    input: R,
    /// What was read: the unread part is `buf[start..end]`, the current line `buf[line]`.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    line: std::ops::Range<usize>,
    /// Where the search for the next newline goes on from (all before it was searched).
    searched: usize,
    /// The rest of a line already reported too long, to pass over before the next one.
    skipping: bool,
    at_end: bool,
}

/// Bytes read at a time.
const READ_CHUNK: usize = 1 << 16;

impl<R: io::Read> Lines<R> {
    fn new(input: R) -> Self {
        Lines { input, buf: vec![0; READ_CHUNK], start: 0, end: 0, line: 0..0, searched: 0, skipping: false, at_end: false }
    }

    /// The current line (without its newline).
    fn line(&self) -> &[u8] {
        &self.buf[self.line.clone()]
    }

    /// The next line (see [`Lines::line`]); None at the end (the first end met: a file written
    /// meanwhile is read as it was then). A line longer than [`MAX_LINE`] is reported as soon as
    /// it is known to be, and its rest skipped on the next call.
    fn next(&mut self) -> io::Result<Option<Line>> {
        self.line = 0..0;
        loop {
            let from = self.searched.max(self.start);
            if let Some(i) = self.buf[from..self.end].iter().position(|&b| b == b'\n') {
                let newline = from + i;
                let line = self.start..newline;
                (self.start, self.searched) = (newline + 1, newline + 1);
                if std::mem::take(&mut self.skipping) {
                    continue;
                }
                if line.len() > MAX_LINE {
                    return Ok(Some(Line::TooLong));
                }
                self.line = line;
                return Ok(Some(Line::Kept));
            }
            self.searched = self.end;
            if self.skipping {
                (self.start, self.searched) = (self.end, self.end);
            } else if self.end - self.start > MAX_LINE {
                (self.start, self.searched, self.skipping) = (self.end, self.end, true);
                return Ok(Some(Line::TooLong));
            }
            if self.at_end {
                // A last line with no newline after it.
                if self.start == self.end {
                    return Ok(None);
                }
                self.line = self.start..self.end;
                self.start = self.end;
                return Ok(Some(Line::Kept));
            }
            self.fill()?;
        }
    }

    /// Reads more after the unread part, moved to the front; room grows only for a line longer
    /// than what was read at a time (up to MAX_LINE and a chunk).
    fn fill(&mut self) -> io::Result<()> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            (self.end, self.searched) = (self.end - self.start, self.searched - self.start);
            self.start = 0;
        }
        if self.buf.len() - self.end < READ_CHUNK {
            // Exactly: a long line's room is at most MAX_LINE and a chunk, kept for the rest.
            self.buf.reserve_exact(self.end + READ_CHUNK - self.buf.len());
            self.buf.resize(self.end + READ_CHUNK, 0);
        }
        loop {
            match self.input.read(&mut self.buf[self.end..]) {
                Ok(0) => self.at_end = true,
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            return Ok(());
        }
    }
}

/// Streams the records of a trace: one at a time, so a trace larger than memory still reads.
pub struct Reader {
    lines: Lines<File>,
    path: PathBuf,
    line_no: u64,
    pending_error: Option<u64>,
    pub header: Header,
    pub damage: ReadDamage,
}

impl Reader {
    /// Opens a trace with the rights of the user who ran gputrace (under sudo, not root's).
    pub fn open(path: &Path) -> Result<Reader, TraceError> {
        let open_error = |cause| TraceError::Open { path: path.into(), cause };
        let user = User::invoking().map_err(|e| open_error(io::Error::other(e.to_string())))?;
        let file = open_for_reading(path, user.as_ref()).map_err(open_error)?;
        let mut lines = Lines::new(file);
        let not_a_trace = |reason: String| TraceError::NotATrace { path: path.into(), reason };
        match lines.next() {
            Ok(Some(Line::Kept)) => {}
            Ok(Some(Line::TooLong)) => return Err(not_a_trace(format!("the first line is longer than {} MiB", MAX_LINE >> 20))),
            Ok(None) => return Err(not_a_trace("the file is empty".into())),
            Err(cause) => return Err(TraceError::Read { path: path.into(), cause }),
        }
        let value: serde_json::Value = serde_json::from_slice(lines.line()).map_err(|e| not_a_trace(e.to_string()))?;
        if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(not_a_trace(format!("no \"format\": \"{FORMAT}\"")));
        }
        let found = value.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
        if found != u64::from(VERSION) {
            return Err(TraceError::Version { path: path.into(), found });
        }
        let header: Header = serde_json::from_value(value).map_err(|e| not_a_trace(e.to_string()))?;
        Ok(Reader { lines, path: path.into(), line_no: 1, pending_error: None, header, damage: ReadDamage::default() })
    }

    /// Passes every record to `apply`, in order, while the records after it are parsed on a
    /// thread of its own: parsing is most of what loading a trace costs, and the model can take
    /// each record as the next is parsed. `prepare` runs on the parsing thread, before `apply`.
    /// At most a few batches are parsed ahead, so memory stays flat whatever the trace's size;
    /// where no thread can be made (a pids limit), each record is parsed and applied in turn.
    /// Stops at the first read error (the records before it applied); returns the header and what
    /// reading left out.
    pub fn read_ahead(
        mut self,
        mut prepare: impl FnMut(&mut Record) + Send,
        mut apply: impl FnMut(&Record),
    ) -> Result<(Header, ReadDamage), TraceError> {
        // A batch is cut at this many records or past this many bytes of lines: a few hundred
        // KiB in flight, a few MiB where a hostile trace's lines are a MiB each.
        const BATCH: usize = 1024;
        const BATCH_BYTES: usize = 256 << 10;
        let ahead = std::thread::scope(|s| {
            let (parsed, batches) = std::sync::mpsc::sync_channel::<Vec<Record>>(2);
            // Applied batches go back to be emptied where their records were made: freed by the
            // thread whose allocator made them, each batch's room used again.
            let (applied, emptied) = std::sync::mpsc::channel::<Vec<Record>>();
            let (reader, prepare) = (&mut self, &mut prepare);
            let parse = move || {
                let next_batch = || emptied.try_recv().map(|mut b| (b.clear(), b).1).unwrap_or_else(|_| Vec::with_capacity(BATCH));
                let (mut batch, mut bytes) = (next_batch(), 0);
                while let Some(record) = reader.next() {
                    let mut record = match record {
                        Ok(record) => record,
                        Err(e) => {
                            let _ = parsed.send(batch);
                            return Err(e);
                        }
                    };
                    prepare(&mut record);
                    batch.push(record);
                    bytes += reader.lines.line().len();
                    if batch.len() < BATCH && bytes < BATCH_BYTES {
                        continue;
                    }
                    bytes = 0;
                    // The receiver gone (apply panicked): nothing left to parse for.
                    if parsed.send(std::mem::replace(&mut batch, next_batch())).is_err() {
                        break;
                    }
                }
                let _ = parsed.send(batch);
                Ok(())
            };
            let parsing = std::thread::Builder::new().name("trace reader".into()).spawn_scoped(s, parse).ok()?;
            for batch in batches {
                batch.iter().for_each(&mut apply);
                // The parser gone (it stopped at an error): the batch is dropped here.
                let _ = applied.send(batch);
            }
            Some(parsing.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
        });
        match ahead {
            Some(done) => done?,
            None => {
                for record in self.by_ref() {
                    let mut record = record?;
                    prepare(&mut record);
                    apply(&record);
                }
            }
        }
        Ok((self.header, self.damage))
    }

    /// Reads a whole trace into memory.
    pub fn read_all(path: &Path) -> Result<(Header, Vec<Record>, ReadDamage), TraceError> {
        let mut reader = Reader::open(path)?;
        let mut records = Vec::new();
        for r in reader.by_ref() {
            records.push(r?);
        }
        Ok((reader.header, records, reader.damage))
    }
}

impl Iterator for Reader {
    type Item = Result<Record, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let line = match self.lines.next() {
                Ok(None) => {
                    // A bad line with nothing after it is a torn tail, not damage.
                    if self.pending_error.take().is_some() {
                        self.damage.torn_tail = true;
                    }
                    return None;
                }
                Err(cause) => return Some(Err(TraceError::Read { path: self.path.clone(), cause })),
                Ok(Some(line)) => line,
            };
            self.line_no += 1;
            if let Some(bad) = self.pending_error.take() {
                self.damage.bad(bad);
            }
            let bytes = self.lines.line();
            if matches!(line, Line::Kept) && bytes.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            // The line is checked to be UTF-8 once, whole (quick for ASCII), so that serde_json
            // need not check each string in it; invalid UTF-8 is damage like any other.
            match line {
                Line::Kept => match std::str::from_utf8(bytes).map(serde_json::from_str) {
                    Ok(Ok(record)) => return Some(Ok(record)),
                    _ => self.pending_error = Some(self.line_no),
                },
                Line::TooLong => self.pending_error = Some(self.line_no),
            }
        }
    }
}

/// Wall clock and CLOCK_MONOTONIC in nanoseconds, read together.
pub fn clocks() -> (u64, u64) {
    let read = |clock| {
        // SAFETY: clock_gettime fills a timespec.
        let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
        unsafe { libc::clock_gettime(clock, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    };
    (read(libc::CLOCK_REALTIME), read(libc::CLOCK_MONOTONIC))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, Seen};

    fn header() -> Header {
        Header {
            tracer_version: "test".into(),
            host: "h".into(),
            kernel: "k".into(),
            driver_version: Some("580.95.05".into()),
            driver_version_source: "test".into(),
            wall_clock_start_ns: 1,
            monotonic_start_ns: 2,
            nvml: "not asked".into(),
            ..Header::default()
        }
    }

    fn record(ts: u64) -> Record {
        Record::new(ts, 1, 1, Event::Process { ppid: 0, seen: Seen::Launched, command: vec!["x".into()] })
    }

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("gputrace-test-{}-{name}", std::process::id()))
    }

    #[test]
    fn round_trip() {
        let path = temp("round-trip");
        let mut w = Writer::create(&path, &header(), None).unwrap();
        for ts in 0..100 {
            w.write(&record(ts)).unwrap();
        }
        w.flush().unwrap();
        let (h, records, damage) = Reader::read_all(&path).unwrap();
        assert_eq!(h, header());
        assert_eq!(records.len(), 100);
        assert_eq!(records[42], record(42));
        assert_eq!(damage, ReadDamage::default());
        std::fs::remove_file(path).ok();
    }

    /// A recorder killed mid-write leaves half a line: everything before it still reads.
    #[test]
    fn a_torn_tail_loses_only_the_torn_line() {
        let path = temp("torn");
        let mut w = Writer::create(&path, &header(), None).unwrap();
        for ts in 0..10 {
            w.write(&record(ts)).unwrap();
        }
        w.flush().unwrap();
        drop(w);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"ts\":10,\"pid\":1,\"ev\":\"pro");
        std::fs::write(&path, text).unwrap();
        let (_, records, damage) = Reader::read_all(&path).unwrap();
        assert_eq!(records.len(), 10);
        assert!(damage.torn_tail);
        assert_eq!(damage.bad_lines, 0);
        std::fs::remove_file(path).ok();
    }

    #[test]
    fn a_damaged_line_in_the_middle_is_skipped_and_named() {
        let path = temp("damaged");
        let mut text = serde_json::to_string(&header()).unwrap() + "\n";
        text += &(serde_json::to_string(&record(1)).unwrap() + "\n");
        text += "not json\n";
        text += &(serde_json::to_string(&record(2)).unwrap() + "\n");
        std::fs::write(&path, text).unwrap();
        let (_, records, damage) = Reader::read_all(&path).unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!((damage.bad_lines, damage.first_bad_lines), (1, vec![3]));
        assert!(!damage.torn_tail);
        std::fs::remove_file(path).ok();
    }

    /// Bytes as they come: a line that is not UTF-8, or longer than the cap, is counted and
    /// skipped; the records around it are kept.
    #[test]
    fn bad_bytes_and_long_lines_lose_only_themselves() {
        let path = temp("bytes");
        let mut text = (serde_json::to_string(&header()).unwrap() + "\n").into_bytes();
        text.extend((serde_json::to_string(&record(1)).unwrap() + "\n").into_bytes());
        text.extend(b"{\"ts\":2,\"pid\":1,\"ev\":\"exec\",\"command\":[\"\xff\"]}\n");
        text.extend(vec![b'x'; MAX_LINE + 10]);
        text.push(b'\n');
        text.extend((serde_json::to_string(&record(3)).unwrap() + "\n").into_bytes());
        std::fs::write(&path, text).unwrap();
        let (_, records, damage) = Reader::read_all(&path).unwrap();
        assert_eq!(records, vec![record(1), record(3)]);
        assert_eq!((damage.bad_lines, damage.first_bad_lines, damage.torn_tail), (2, vec![3, 4], false));
        std::fs::remove_file(path).ok();
    }

    /// Lines come out whole however the bytes are read: in one piece, or a few bytes at a time
    /// with interrupted reads between (a line then spans many reads, and the room grows for it):
    /// a line longer than a read, an empty one, one of exactly MAX_LINE bytes (kept), one a byte
    /// longer and one longer by several reads (each reported once, its rest passed over, one
    /// byte at a time too), and a last line with no newline; at the end, a last line too long,
    /// one of exactly MAX_LINE bytes, nothing, and nothing but newlines.
    #[test]
    fn lines_come_out_whole_however_they_are_read() {
        struct Trickle<'a>(&'a [u8], usize, bool);
        impl io::Read for Trickle<'_> {
            fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
                self.2 = !self.2;
                if self.2 {
                    return Err(io::ErrorKind::Interrupted.into());
                }
                let n = self.1.min(out.len()).min(self.0.len());
                out[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let long = vec![b'l'; 3 * READ_CHUNK + 5];
        let (max, over, far_over) = (vec![b'm'; MAX_LINE], vec![b'o'; MAX_LINE + 1], vec![b'f'; MAX_LINE + 3 * READ_CHUNK]);
        let mut text = Vec::new();
        for line in [&b"first"[..], &long, b"", &max, &over, b"after", &far_over, b"last"] {
            text.extend_from_slice(line);
            text.push(b'\n');
        }
        text.pop();
        let read = |mut lines: Lines<Trickle>| {
            let mut out = Vec::new();
            while let Some(line) = lines.next().unwrap() {
                out.push(match line {
                    Line::Kept => Some(lines.line().to_vec()),
                    Line::TooLong => None,
                });
            }
            out
        };
        let want = vec![
            Some(b"first".to_vec()),
            Some(long.clone()),
            Some(vec![]),
            Some(max.clone()),
            None,
            Some(b"after".to_vec()),
            None,
            Some(b"last".to_vec()),
        ];
        for step in [usize::MAX, 1, 7, READ_CHUNK - 1] {
            assert_eq!(read(Lines::new(Trickle(&text, step, false))), want, "read {step} bytes at a time");
        }
        for step in [usize::MAX, 1] {
            let whole = |text: &[u8]| read(Lines::new(Trickle(text, step, false)));
            assert_eq!(whole(&over), [None], "a last line too long, read {step} at a time");
            assert_eq!(whole(&max), [Some(max.clone())]);
            assert_eq!(whole(b""), [] as [Option<Vec<u8>>; 0]);
            assert_eq!(whole(b"\n\n"), [Some(vec![]), Some(vec![])]);
        }
    }

    /// Reading ahead gives what reading in turn gives: every record in order, over several
    /// batches, each prepared once, and the same damage. Two traces: short lines, cut into
    /// batches by count, a bad line right at a cut; every third line long, cut by bytes. Both
    /// end in a torn tail.
    #[test]
    fn reading_ahead_applies_every_record_in_order_with_the_damage() {
        let path = temp("ahead");
        for (records, long_every, bad_after) in [(3000, None, 1023), (2000, Some(3), 700)] {
            let mut text = serde_json::to_string(&header()).unwrap() + "\n";
            for ts in 0..records {
                let mut record = record(ts);
                if long_every.is_some_and(|n| ts % n == 0) {
                    record.event = Event::Process { ppid: 0, seen: Seen::Launched, command: vec!["x".repeat(4000)] };
                }
                text += &(serde_json::to_string(&record).unwrap() + "\n");
                if ts == bad_after {
                    text += "not json\n";
                }
            }
            text += "{\"ts\":9999,\"pid\":1,\"ev\":\"pro";
            std::fs::write(&path, text).unwrap();
            let mut applied = Vec::new();
            let (h, damage) = Reader::open(&path).unwrap().read_ahead(|r| r.tid += 1, |r| applied.push(r.clone())).unwrap();
            let (read_header, mut read, read_damage) = Reader::read_all(&path).unwrap();
            read.iter_mut().for_each(|r| r.tid += 1);
            assert_eq!((h, damage), (read_header, read_damage.clone()));
            assert_eq!(applied, read);
            assert_eq!((applied.len() as u64, read_damage.bad_lines, read_damage.torn_tail), (records, 1, true));
        }
        std::fs::remove_file(path).ok();
    }

    #[test]
    fn errors_name_the_file_and_the_fix() {
        let path = temp("not-a-trace");
        std::fs::write(&path, "hello\n").unwrap();
        let e = Reader::open(&path).err().unwrap().to_string();
        assert!(e.contains("is not a gputrace trace"), "{e}");
        let mut h = serde_json::to_value(header()).unwrap();
        h["version"] = 99.into();
        std::fs::write(&path, h.to_string() + "\n").unwrap();
        let e = Reader::open(&path).err().unwrap().to_string();
        assert!(e.contains("version 99") && e.contains("at least as new"), "{e}");
        std::fs::remove_file(&path).ok();
        let e = Reader::open(&path).err().unwrap().to_string();
        assert!(e.contains("cannot open the trace"), "{e}");
    }
}
