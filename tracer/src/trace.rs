//! The trace file: JSON Lines. The first line is a [`Header`]; every other line is one
//! [`Record`]. Append-only and flushed often, so a recorder killed with SIGKILL leaves a file that
//! reads up to its last flush. The format is documented in docs/trace-format.md.

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::event::Record;

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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PriorUse {
    pub pid: u32,
    pub gpu: u32,
    pub used_bytes: Option<u64>,
    /// Its command line when tracing began (empty if it could not be read).
    #[serde(default)]
    pub command: Vec<String>,
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
    pub nvml: String,
    /// The gputrace command line that made this trace.
    pub command: Vec<String>,
    /// Records carry the raw params bytes.
    pub raw: bool,
}

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("cannot open the trace {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("{path} is not a gputrace trace: its first line is not a gputrace header ({reason})")]
    NotATrace { path: PathBuf, reason: String },
    #[error("{path} is a gputrace trace of format version {found}; this gputrace reads version {VERSION}: use a gputrace at least as new as the one that recorded it")]
    Version { path: PathBuf, found: u32 },
    #[error("reading the trace {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("writing the trace {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

pub struct Writer {
    out: BufWriter<File>,
    path: PathBuf,
    pub records: u64,
}

impl Writer {
    pub fn create(path: &Path, header: &Header) -> Result<Writer, TraceError> {
        let file = File::create(path).map_err(|source| TraceError::Open { path: path.into(), source })?;
        let mut w = Writer { out: BufWriter::with_capacity(1 << 16, file), path: path.into(), records: 0 };
        w.line(header)?;
        w.flush()?;
        Ok(w)
    }

    fn line<T: Serialize>(&mut self, value: &T) -> Result<(), TraceError> {
        let err = |source| TraceError::Write { path: self.path.clone(), source };
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
        self.out.flush().map_err(|source| TraceError::Write { path: self.path.clone(), source })
    }
}

/// What reading left out: a torn last line (the recorder died mid-write) or damaged lines.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ReadDamage {
    pub torn_tail: bool,
    /// 1-based line numbers of lines that did not parse, other than a torn last line.
    pub bad_lines: Vec<u64>,
}

/// Streams the records of a trace: one at a time, so a trace larger than memory still reads.
pub struct Reader {
    lines: io::Lines<BufReader<File>>,
    path: PathBuf,
    line_no: u64,
    pending_error: Option<u64>,
    pub header: Header,
    pub damage: ReadDamage,
}

impl Reader {
    pub fn open(path: &Path) -> Result<Reader, TraceError> {
        let file = File::open(path).map_err(|source| TraceError::Open { path: path.into(), source })?;
        let mut lines = BufReader::with_capacity(1 << 16, file).lines();
        let not_a_trace = |reason: String| TraceError::NotATrace { path: path.into(), reason };
        let first = match lines.next() {
            Some(Ok(line)) => line,
            Some(Err(source)) => return Err(TraceError::Read { path: path.into(), source }),
            None => return Err(not_a_trace("the file is empty".into())),
        };
        let value: serde_json::Value = serde_json::from_str(&first).map_err(|e| not_a_trace(e.to_string()))?;
        if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(not_a_trace(format!("no \"format\": \"{FORMAT}\"")));
        }
        let found = value.get("version").and_then(|v| v.as_u64()).unwrap_or(0) as u32;
        if found != VERSION {
            return Err(TraceError::Version { path: path.into(), found });
        }
        let header: Header = serde_json::from_value(value).map_err(|e| not_a_trace(e.to_string()))?;
        Ok(Reader { lines, path: path.into(), line_no: 1, pending_error: None, header, damage: ReadDamage::default() })
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
                None => {
                    // A bad line with nothing after it is a torn tail, not damage.
                    if self.pending_error.take().is_some() {
                        self.damage.torn_tail = true;
                    }
                    return None;
                }
                Some(Err(source)) => return Some(Err(TraceError::Read { path: self.path.clone(), source })),
                Some(Ok(line)) => line,
            };
            self.line_no += 1;
            if let Some(bad) = self.pending_error.take() {
                self.damage.bad_lines.push(bad);
            }
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<Record>(&line) {
                Ok(record) => return Some(Ok(record)),
                Err(_) => self.pending_error = Some(self.line_no),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, Seen};

    fn header() -> Header {
        Header {
            format: FORMAT.into(),
            version: VERSION,
            tracer_version: "test".into(),
            host: "h".into(),
            kernel: "k".into(),
            driver_version: Some("580.95.05".into()),
            driver_version_source: "test".into(),
            wall_clock_start_ns: 1,
            monotonic_start_ns: 2,
            gpus: vec![],
            prior_use: vec![],
            holders_at_start: vec![],
            nvml: "not asked".into(),
            command: vec![],
            raw: false,
        }
    }

    fn record(ts: u64) -> Record {
        Record { ts, pid: 1, tid: 1, event: Event::Process { ppid: 0, seen: Seen::Launched, command: vec!["x".into()] }, raw: None }
    }

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("gputrace-test-{}-{name}", std::process::id()))
    }

    #[test]
    fn round_trip() {
        let path = temp("round-trip");
        let mut w = Writer::create(&path, &header()).unwrap();
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
        let mut w = Writer::create(&path, &header()).unwrap();
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
        assert!(damage.bad_lines.is_empty());
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
        assert_eq!(damage.bad_lines, vec![3]);
        assert!(!damage.torn_tail);
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
