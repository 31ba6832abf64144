//! Ground truth, as JSON lines: what the fake driver did (every allocation, every free with how
//! it happened, every file release) and what a workload did (phases, requests, allocations).
//! Times are CLOCK_MONOTONIC nanoseconds, the clock gputrace's kernel side reads.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum DriverOp {
    /// An allocation request and its outcome. `kind` is video, system or virtual; `gpu` is the
    /// GPU whose video memory it asked for.
    Alloc {
        client: u32,
        object: u32,
        class: u32,
        kind: String,
        bytes: u64,
        status: u32,
        via: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu: Option<usize>,
    },
    /// Memory that went back: its last handle was freed. `how`: explicit, subtree or release.
    Free {
        client: u32,
        object: u32,
        kind: String,
        bytes: u64,
        how: String,
    },
    /// The kernel released an open file (FUSE RELEASE): the last reference is gone.
    Release {
        device: String,
        handle: u64,
    },
    Open {
        device: String,
        handle: u64,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriverLine {
    pub ts: u64,
    pub pid: u32,
    pub tid: u32,
    #[serde(flatten)]
    pub op: DriverOp,
}

pub fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime fills a timespec.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub struct Log {
    out: Option<File>,
}

impl Log {
    pub fn create(path: Option<&Path>) -> std::io::Result<Log> {
        Ok(Log { out: path.map(File::create).transpose()? })
    }

    /// One line, written at once: the log must survive the driver being killed.
    pub fn write<T: Serialize>(&mut self, line: &T) {
        if let Some(out) = &mut self.out {
            let mut text = serde_json::to_string(line).expect("plain data serialises");
            text.push('\n');
            let _ = out.write_all(text.as_bytes());
        }
    }
}

pub fn read_lines<T: for<'de> Deserialize<'de>>(path: &Path) -> std::io::Result<Vec<T>> {
    let reader = BufReader::new(File::open(path)?);
    let mut out = Vec::new();
    for line in reader.lines() {
        let line = line?;
        if let Ok(v) = serde_json::from_str(&line) {
            out.push(v);
        }
    }
    Ok(out)
}
