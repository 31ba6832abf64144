//! Explicit phase marks, and dumps asked of a watch. A running `gputrace record` (or `watch`)
//! listens on a Unix socket, /run/gputrace/<recorder pid>.sock, for one line:
//! - `MARK <phase> <pid>\n`, phase one of load, prefill, decode, idle: it answers `OK\n` and
//!   records the mark for that process's service, or `ERR <why>\n`. An application can speak it
//!   with no gputrace library (`socat - UNIX:...`); `gputrace mark PHASE [--pid PID]` does it for
//!   wrapper scripts.
//! - `DUMP\n`, to a watch, from root or the user who started it: `OK <what happens>\n`, or
//!   `ERR <why>\n`. `gputrace dump` asks this way: a socket in a directory only root writes
//!   names the watch for as long as it runs (a pid checked and then signalled could belong to
//!   another process by the time the signal goes).
//!
//! A mark changes a verdict, so who may send one is checked: the directory belongs to root and
//! only root writes in it (nobody plants or removes a socket), and each connection's peer
//! (SO_PEERCRED) must be root, the user who started the recording, or the owner of the marked
//! process. A connection gets one short line, a deadline, and a place among a few at a time.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::analysis::Phase;
use crate::procfs;

pub const SOCKET_DIR: &str = "/run/gputrace";
/// A mark line is a few words; anything longer is refused unread.
pub const MAX_LINE: u64 = 256;
/// Connections served at once; more are answered `ERR busy` and closed.
pub const MAX_CONNECTIONS: usize = 16;
/// Connections one user other than root and the recorder's own user may hold at once: no one
/// else can take every slot and keep the wrapper scripts' marks out.
pub const MAX_CONNECTIONS_PER_USER: usize = 4;
/// Places only root and the recorder's own user may take: other users together (four of them
/// holding four each) can never take every one and keep `gputrace dump` out.
pub const KEPT_FOR_OWNERS: usize = 4;
/// How long a connection may take to send its line.
pub const DEADLINE: Duration = Duration::from_secs(2);

pub fn socket_path(recorder: u32) -> PathBuf {
    Path::new(SOCKET_DIR).join(format!("{recorder}.sock"))
}

/// What a connection asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    Mark { phase: Phase, pid: u32 },
    Dump,
}

/// A request line, checked.
pub fn parse(line: &str) -> Result<Asked, String> {
    let mut words = line.split_whitespace();
    match words.next() {
        Some("DUMP") if words.next().is_none() => return Ok(Asked::Dump),
        Some("MARK") => {}
        _ => return Err("expected `MARK <phase> <pid>` or `DUMP`".into()),
    }
    let phase = words.next().ok_or("no phase")?;
    let phase = Phase::parse(phase).ok_or_else(|| format!("{phase:?} is not a phase: load, prefill, decode or idle"))?;
    let pid = words.next().and_then(|p| p.parse().ok()).ok_or("no pid")?;
    Ok(Asked::Mark { phase, pid })
}

/// Who may ask a watch for a dump: root or the user who started it (as for SIGUSR1).
pub fn may_dump(peer_uid: u32, invoking_uid: Option<u32>) -> Result<(), String> {
    if peer_uid == 0 || Some(peer_uid) == invoking_uid {
        return Ok(());
    }
    Err(format!("uid {peer_uid} may not ask for a dump: only root or the user who started the watch may"))
}

/// Who may mark `pid`: root, the user who started the recording, or the process's owner.
pub fn may_mark(peer_uid: u32, invoking_uid: Option<u32>, owner_of_pid: Option<u32>, pid: u32) -> Result<(), String> {
    if peer_uid == 0 || Some(peer_uid) == invoking_uid || Some(peer_uid) == owner_of_pid {
        return Ok(());
    }
    Err(format!("uid {peer_uid} may not mark pid {pid}: only root, the user who started this recording, or the process's owner may"))
}

/// What the recorder is asked (checked for who asks), and where its answer goes.
pub struct MarkRequest {
    pub asked: Asked,
    pub reply: oneshot::Sender<String>,
}

/// The recorder's socket; removed when recording ends.
pub struct MarkServer {
    listener: tokio::net::UnixListener,
    path: PathBuf,
    invoking_uid: Option<u32>,
    permits: Arc<Semaphore>,
    /// The places other users may take, all of them together.
    others: Arc<Semaphore>,
    /// Connections open now, per user outside root and the invoking user.
    per_user: Arc<std::sync::Mutex<std::collections::HashMap<u32, usize>>>,
}

/// One connection of a user counted in `per_user`, given back when it ends.
struct UserSlot(Arc<std::sync::Mutex<std::collections::HashMap<u32, usize>>>, u32);

impl Drop for UserSlot {
    fn drop(&mut self) {
        if let Ok(mut open) = self.0.lock() {
            if let Some(n) = open.get_mut(&self.1) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

impl MarkServer {
    /// Without it, recording goes on: marks are a convenience, and why there are none is said once.
    pub fn open(recorder: u32, invoking_uid: Option<u32>) -> Option<MarkServer> {
        match Self::try_open(recorder, invoking_uid) {
            Ok(server) => Some(server),
            Err(why) => {
                eprintln!("gputrace: warning: no phase marks this time: {why}");
                None
            }
        }
    }

    fn try_open(recorder: u32, invoking_uid: Option<u32>) -> Result<MarkServer, String> {
        let dir = Path::new(SOCKET_DIR);
        // Created with its mode, never writable by others even for an instant (whatever the umask).
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => std::fs::set_permissions(dir, PermissionsExt::from_mode(0o755))
                .map_err(|e| format!("cannot set the mode of {SOCKET_DIR}: {e}"))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot create {SOCKET_DIR}: {e}")),
        }
        let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("cannot read {SOCKET_DIR}: {e}"))?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !meta.file_type().is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
            return Err(format!(
                "{SOCKET_DIR} is not a directory that only uid {me} may write (owner uid {}, mode {:o}): someone else could plant sockets there; remove it and start again",
                meta.uid(),
                meta.mode() & 0o7777
            ));
        }
        remove_stale_sockets(dir);
        let path = socket_path(recorder);
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
        // Anyone may connect; each peer is checked (SO_PEERCRED) before its mark counts.
        std::fs::set_permissions(&path, PermissionsExt::from_mode(0o666))
            .map_err(|e| format!("cannot set the mode of {}: {e}", path.display()))?;
        let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let others = Arc::new(Semaphore::new(MAX_CONNECTIONS - KEPT_FOR_OWNERS));
        Ok(MarkServer { listener, path, invoking_uid, permits, others, per_user: Arc::default() })
    }

    /// Takes the next connection and serves it on its own task; marks that pass the checks go
    /// to `to_recorder`.
    pub async fn accept(&self, to_recorder: &mpsc::Sender<MarkRequest>) {
        let Ok((stream, _)) = self.listener.accept().await else { return };
        let uid = stream.peer_cred().map(|c| c.uid()).ok();
        let owner = uid.is_some_and(|u| u == 0 || Some(u) == self.invoking_uid);
        // Another user's takes one of the places left to others, or is answered at once.
        let other = match owner {
            true => None,
            false => match self.others.clone().try_acquire_owned() {
                Ok(place) => Some(place),
                Err(_) => {
                    if let Ok(stream) = stream.into_std() {
                        crate::serving::refuse(stream, b"ERR busy: too many connections from other users; try again\n");
                    }
                    return;
                }
            },
        };
        let slot = match uid.filter(|_| !owner) {
            Some(u) => {
                let mut open = self.per_user.lock().unwrap_or_else(|e| e.into_inner());
                let n = open.entry(u).or_default();
                if *n >= MAX_CONNECTIONS_PER_USER {
                    if let Ok(stream) = stream.into_std() {
                        crate::serving::refuse(stream, b"ERR busy: too many connections from your user; try again\n");
                    }
                    return;
                }
                *n += 1;
                Some(UserSlot(self.per_user.clone(), u))
            }
            None => None,
        };
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            // Full: answered, and never waited on.
            if let Ok(stream) = stream.into_std() {
                crate::serving::refuse(stream, b"ERR busy: too many connections to this recorder; try again\n");
            }
            return;
        };
        let to_recorder = to_recorder.clone();
        let invoking_uid = self.invoking_uid;
        tokio::spawn(async move {
            let _held = (permit, other, slot);
            let _ = tokio::time::timeout(DEADLINE, serve(stream, invoking_uid, to_recorder)).await;
        });
    }
}

impl Drop for MarkServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Sockets of recorders that are gone (killed with SIGKILL, the machine's power cut).
fn remove_stale_sockets(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let pid = path.file_stem().and_then(|s| s.to_str()).and_then(|s| s.parse::<u32>().ok());
        if path.extension().is_some_and(|x| x == "sock") && pid.is_some_and(|pid| !procfs::running(pid)) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// One client: one bounded line in, the answer out.
async fn serve(stream: tokio::net::UnixStream, invoking_uid: Option<u32>, to_recorder: mpsc::Sender<MarkRequest>) {
    let peer = stream.peer_cred().map(|c| c.uid()).ok();
    let (read, mut write) = stream.into_split();
    let mut line = Vec::new();
    let mut reader = tokio::io::BufReader::new(read.take(MAX_LINE + 1));
    if reader.read_until(b'\n', &mut line).await.is_err() {
        return;
    }
    let answer = if line.len() as u64 > MAX_LINE {
        format!("ERR the line is longer than {MAX_LINE} bytes: send `MARK <phase> <pid>`")
    } else {
        answer(&line, peer, invoking_uid, &to_recorder).await
    };
    let _ = write.write_all(format!("{answer}\n").as_bytes()).await;
}

async fn answer(line: &[u8], peer: Option<u32>, invoking_uid: Option<u32>, to_recorder: &mpsc::Sender<MarkRequest>) -> String {
    let Some(peer) = peer else { return "ERR cannot tell who is connecting (no SO_PEERCRED)".into() };
    let asked = match parse(&String::from_utf8_lossy(line)) {
        Ok(asked) => asked,
        Err(why) => return format!("ERR {why}"),
    };
    let allowed = match asked {
        Asked::Mark { pid, .. } => may_mark(peer, invoking_uid, procfs::place::owner(pid), pid),
        Asked::Dump => may_dump(peer, invoking_uid),
    };
    if let Err(why) = allowed {
        return format!("ERR {why}");
    }
    let (reply, answer) = oneshot::channel();
    if to_recorder.send(MarkRequest { asked, reply }).await.is_err() {
        return "ERR the recording is ending".into();
    }
    answer.await.unwrap_or_else(|_| "ERR the recording is ending".into())
}

/// The live recorders' sockets: all of them, or the one of `recorder`.
fn sockets(recorder: Option<u32>) -> Vec<PathBuf> {
    if let Some(pid) = recorder {
        return vec![socket_path(pid)];
    }
    std::fs::read_dir(SOCKET_DIR)
        .map(|d| d.filter_map(|e| Some(e.ok()?.path())).filter(|p| p.extension().is_some_and(|x| x == "sock")).take(4096).collect())
        .unwrap_or_default()
}

/// What came of one exchange with a recorder's socket.
enum Exchange {
    Answer(String),
    /// A recorder that died left it (or there is none at that path).
    Stale,
    Failed(String),
}

/// One line to the recorder behind `socket`, one line back. The socket must be root's (the
/// directory only root writes; checked again here: the peer's credentials).
fn exchange(socket: &Path, line: &str) -> Exchange {
    let recorder = socket.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let mut stream = match UnixStream::connect(socket) {
        Ok(stream) => stream,
        Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound) => return Exchange::Stale,
        Err(e) => return Exchange::Failed(format!("cannot reach the recording of pid {recorder}: {e}")),
    };
    if peer_of(&stream).is_some_and(|uid| uid != 0) {
        return Exchange::Failed(format!("the socket of pid {recorder} is not root's: not asked"));
    }
    let mut reply = String::new();
    let asked = stream
        .set_read_timeout(Some(DEADLINE + Duration::from_secs(1)))
        .and_then(|()| writeln!(stream, "{line}"))
        .and_then(|()| BufReader::new((&stream).take(MAX_LINE * 4)).read_line(&mut reply));
    match asked {
        Ok(_) => Exchange::Answer(reply.trim().to_string()),
        Err(e) => Exchange::Failed(format!("the recording of pid {recorder} did not answer: {e}")),
    }
}

fn peer_of(stream: &UnixStream) -> Option<u32> {
    use std::os::fd::AsRawFd;
    // SAFETY: getsockopt(SO_PEERCRED) fills a ucred of the size given.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    (rc == 0).then_some(cred.uid)
}

fn leftovers(stale: usize) -> String {
    if stale > 0 {
        format!("; {stale} socket(s) of recorders that died are left there, and the next recording removes them")
    } else {
        String::new()
    }
}

/// `gputrace mark`: sends the mark to every running recorder; done when one of them traces `pid`.
pub fn send(phase: Phase, pid: u32) -> Result<String> {
    let mut refusals = Vec::new();
    let mut stale = 0;
    // One recorder that fails to answer (gone mid-way, a broken pipe) is one refusal, not the
    // end: the next may trace the pid.
    for socket in sockets(None) {
        match exchange(&socket, &format!("MARK {} {pid}", phase.name())) {
            Exchange::Answer(ok) if ok == "OK" => return Ok(format!("marked pid {pid}'s service as {}", phase.name())),
            Exchange::Answer(other) => {
                refusals.push(format!("the recording of {} refused: {}", recorder_of(&socket), other.trim_start_matches("ERR ")))
            }
            Exchange::Stale => stale += 1,
            Exchange::Failed(why) => refusals.push(why),
        }
    }
    if !refusals.is_empty() {
        bail!("{}", refusals.join("; "));
    }
    bail!("no gputrace record is running (no live socket in {SOCKET_DIR}{}): start one with `sudo gputrace record`", leftovers(stale))
}

fn recorder_of(socket: &Path) -> String {
    format!("pid {}", socket.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default())
}

/// `gputrace dump`: asks every running watch (or the one of `watch`) for a dump now, through its
/// socket; recordings that are not watches say so and are passed over.
pub fn ask_dump(watch: Option<u32>) -> Result<String> {
    let (mut asked, mut refusals, mut stale) = (Vec::new(), Vec::new(), 0);
    for socket in sockets(watch) {
        match exchange(&socket, "DUMP") {
            Exchange::Answer(ok) if ok.starts_with("OK") => {
                asked.push(format!("{}: {}", recorder_of(&socket), ok.trim_start_matches("OK").trim()))
            }
            Exchange::Answer(not) if not.contains("not a watch") && watch.is_none() => {}
            Exchange::Answer(other) => refusals.push(format!("{} refused: {}", recorder_of(&socket), other.trim_start_matches("ERR "))),
            Exchange::Stale if watch.is_some() => refusals.push(format!("no gputrace watch runs as {}", recorder_of(&socket))),
            Exchange::Stale => stale += 1,
            Exchange::Failed(why) => refusals.push(why),
        }
    }
    match (asked.is_empty(), refusals.is_empty()) {
        (false, _) => Ok(format!("asked gputrace watch ({}); it logs where the dump goes", asked.join("; "))),
        (true, false) => bail!("{}", refusals.join("; ")),
        (true, true) => bail!("no `gputrace watch` is running here{}: start one with `sudo gputrace watch`", leftovers(stale)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_protocol_line() {
        assert_eq!(parse("MARK prefill 42\n"), Ok(Asked::Mark { phase: Phase::Prefill, pid: 42 }));
        assert!(parse("MARK warmup 42").unwrap_err().contains("not a phase"));
        assert!(parse("MARK load").is_err());
        assert!(parse("HELLO").is_err());
        assert_eq!(parse("DUMP\n"), Ok(Asked::Dump));
        assert!(parse("DUMP now").is_err());
    }

    #[test]
    fn who_may_mark() {
        assert!(may_mark(0, Some(1000), Some(2000), 7).is_ok(), "root");
        assert!(may_mark(1000, Some(1000), Some(2000), 7).is_ok(), "the invoking user");
        assert!(may_mark(2000, Some(1000), Some(2000), 7).is_ok(), "the process's owner");
        let e = may_mark(3000, Some(1000), Some(2000), 7).unwrap_err();
        assert!(e.contains("uid 3000 may not mark pid 7"), "{e}");
        assert!(may_mark(3000, None, None, 7).is_err(), "a gone process's mark is root's or the recorder's user's");
        assert!(may_dump(0, Some(1000)).is_ok() && may_dump(1000, Some(1000)).is_ok());
        assert!(
            may_dump(2000, Some(1000)).unwrap_err().contains("uid 2000 may not ask for a dump"),
            "owning a traced process is not enough"
        );
    }
}
