//! Explicit phase marks. A running `gputrace record` listens on a Unix socket,
//! /run/gputrace/<recorder pid>.sock, for one line: `MARK <phase> <pid>\n`, phase one of load,
//! prefill, decode, idle. It answers `OK\n` and records the mark for that process's service, or
//! `ERR <why>\n`. An application can speak it with no gputrace library (`socat - UNIX:...`);
//! `gputrace mark PHASE [--pid PID]` does it for wrapper scripts.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Result};

use crate::analysis::Phase;

pub const SOCKET_DIR: &str = "/run/gputrace";

pub fn socket_path(recorder: u32) -> PathBuf {
    Path::new(SOCKET_DIR).join(format!("{recorder}.sock"))
}

/// A request line, checked: the phase and the process it is for.
pub fn parse(line: &str) -> Result<(Phase, u32), String> {
    let mut words = line.split_whitespace();
    if words.next() != Some("MARK") {
        return Err("expected `MARK <phase> <pid>`".into());
    }
    let phase = words.next().ok_or("no phase")?;
    let phase = Phase::parse(phase).ok_or_else(|| format!("{phase:?} is not a phase: load, prefill, decode or idle"))?;
    let pid = words.next().and_then(|p| p.parse().ok()).ok_or("no pid")?;
    Ok((phase, pid))
}

/// `gputrace mark`: sends the mark to every running recorder; done when one of them traces `pid`.
pub fn send(phase: &str, pid: u32) -> Result<String> {
    if Phase::parse(phase).is_none() {
        bail!("{phase:?} is not a phase: give load, prefill, decode or idle");
    }
    let sockets: Vec<PathBuf> = std::fs::read_dir(SOCKET_DIR)
        .map(|d| d.filter_map(|e| Some(e.ok()?.path())).filter(|p| p.extension().is_some_and(|x| x == "sock")).collect())
        .unwrap_or_default();
    let mut refusals = Vec::new();
    for socket in &sockets {
        let Ok(mut stream) = UnixStream::connect(socket) else { continue };
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        writeln!(stream, "MARK {phase} {pid}")?;
        let mut reply = String::new();
        BufReader::new(&stream).read_line(&mut reply)?;
        match reply.trim() {
            "OK" => return Ok(format!("marked pid {pid}'s service as {phase}")),
            other => refusals.push(other.trim_start_matches("ERR ").to_string()),
        }
    }
    match refusals.first() {
        Some(why) => bail!("no running gputrace record took the mark: {why}"),
        None => bail!("no gputrace record is running (no socket in {SOCKET_DIR}): start one with `sudo gputrace record`"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_protocol_line() {
        assert_eq!(parse("MARK prefill 42\n"), Ok((Phase::Prefill, 42)));
        assert!(parse("MARK warmup 42").unwrap_err().contains("not a phase"));
        assert!(parse("MARK load").is_err());
        assert!(parse("HELLO").is_err());
    }
}
