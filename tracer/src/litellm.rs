//! LiteLLM proxies in front of the servers gputrace follows: found in /proc, their config read for
//! where each deployment sends requests and how many at once (`max_parallel_requests`). A proxy
//! is no GPU process; it is what caps a server's concurrency when the server itself does not.
//!
//! A config is named by a command line any user writes, and gputrace reads as root: it reads only
//! what the proxy's own user could (the file's mode and owner against the process's filesystem
//! ids, after the open, so a symbolic link cannot swap the file), only a regular file (a FIFO
//! would block), at most [`MAX_CONFIG`] bytes, and parses it as YAML events without building
//! a document (aliases are never expanded).

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::time::{Duration, Instant};

use yaml_rust2::parser::{Event as Yaml, Parser};

use crate::event::Deployment;
use crate::procfs;

/// A config is a few kilobytes; a hundred deployments fit in far less than this.
pub const MAX_CONFIG: u64 = 256 * 1024;
/// Deployments kept from one config, and proxies from one scan.
pub const MAX_DEPLOYMENTS: usize = 64;
pub const MAX_PROXIES: usize = 32;
/// Strings kept from a config (a model's name, a host).
const MAX_TEXT: usize = 128;

/// A LiteLLM proxy's command line: the `litellm` program (a script run by Python, or its
/// container's entry point), or `python -m litellm...`.
pub fn is_proxy(command: &[String]) -> bool {
    let name = |a: &String| a.rsplit('/').next() == Some("litellm");
    command.iter().take(2).any(name)
        || command.windows(2).take(3).any(|w| w[0] == "-m" && (w[1] == "litellm" || w[1].starts_with("litellm.")))
}

/// The config its command line names: `--config PATH`, `--config=PATH`, `-c PATH`.
pub fn config_arg(command: &[String]) -> Option<&str> {
    let mut args = command.iter();
    while let Some(a) = args.next() {
        if a == "--config" || a == "-c" {
            return args.next().map(String::as_str);
        }
        if let Some(path) = a.strip_prefix("--config=") {
            return Some(path);
        }
    }
    None
}

/// The deployments a config's `model_list` routes to a host and port, with the concurrency
/// LiteLLM gives each (see [`Deployment::max_parallel_requests`]). What is not a plain value
/// (an alias, `os.environ/...`) is taken as unset; text that is no YAML yields what came before.
pub fn deployments(config: &str) -> Vec<Deployment> {
    // Where the parser is: the keys (and sequence positions) from the top, and whether the next
    // scalar of the innermost mapping is a key.
    enum Frame {
        Map { key: Option<String> },
        Seq { next: usize },
    }
    let mut frames: Vec<Frame> = Vec::new();
    let mut entries: Vec<Entry> = Vec::new();
    let mut default: Option<Option<u64>> = None;
    let mut parser = Parser::new_from_str(config);
    // The path of the value about to be read, from the top: its keys and positions.
    // Only the first levels are ever looked at: deeper ones cost no path.
    fn path(frames: &[Frame]) -> Vec<PathStep<'_>> {
        if frames.len() > 4 {
            return Vec::new();
        }
        frames
            .iter()
            .map(|f| match f {
                Frame::Map { key } => PathStep::Key(key.as_deref().unwrap_or("")),
                Frame::Seq { next } => PathStep::Index(*next),
            })
            .collect()
    }
    while let Ok((event, _)) = parser.next_token() {
        // A value ends: its mapping awaits a key, its sequence the next position.
        let consumed = |frames: &mut Vec<Frame>| match frames.last_mut() {
            Some(Frame::Map { key }) => *key = None,
            Some(Frame::Seq { next }) => *next += 1,
            None => {}
        };
        match event {
            Yaml::StreamEnd => break,
            Yaml::MappingStart(..) | Yaml::SequenceStart(..) => {
                if matches!(frames.last(), Some(Frame::Map { key: None })) {
                    // A mapping or sequence as a key: not in any config; read no further.
                    break;
                }
                let mapping = matches!(event, Yaml::MappingStart(..));
                // A new model_list entry.
                if mapping && matches!(path(&frames)[..], [PathStep::Key("model_list"), PathStep::Index(_)]) {
                    if entries.len() >= MAX_DEPLOYMENTS {
                        break;
                    }
                    entries.push(Entry::default());
                }
                frames.push(if mapping { Frame::Map { key: None } } else { Frame::Seq { next: 0 } });
            }
            Yaml::MappingEnd | Yaml::SequenceEnd => {
                frames.pop();
                consumed(&mut frames);
            }
            Yaml::Scalar(text, ..) => {
                if let Some(Frame::Map { key: key @ None }) = frames.last_mut() {
                    *key = Some(text.chars().take(MAX_TEXT).collect());
                    continue;
                }
                match (&path(&frames)[..], entries.last_mut()) {
                    ([PathStep::Key("model_list"), PathStep::Index(_), PathStep::Key("model_name")], Some(e)) => {
                        e.model = text.chars().take(MAX_TEXT).collect()
                    }
                    ([PathStep::Key("model_list"), PathStep::Index(_), PathStep::Key("litellm_params"), PathStep::Key(k)], Some(e)) => {
                        if *k == "api_base" {
                            e.api_base = text.chars().take(MAX_TEXT).collect();
                        } else if let Some(i) = LIMITS.iter().position(|l| l == k) {
                            e.limits[i] = Some(text.trim().parse().ok());
                        }
                    }
                    ([PathStep::Key("router_settings"), PathStep::Key("default_max_parallel_requests")], _) => {
                        default = Some(text.trim().parse::<u64>().ok())
                    }
                    _ => {}
                }
                consumed(&mut frames);
            }
            Yaml::Alias(_) => {
                if matches!(frames.last(), Some(Frame::Map { key: None })) {
                    break;
                }
                consumed(&mut frames);
            }
            Yaml::Nothing | Yaml::StreamStart | Yaml::DocumentStart | Yaml::DocumentEnd => {}
        }
    }
    entries.into_iter().filter_map(|e| e.deployment(default)).collect()
}

/// One `model_list` entry as read.
#[derive(Default)]
struct Entry {
    model: String,
    api_base: String,
    /// Each key's value as written: None unset, Some(None) no plain count.
    limits: [Option<Option<u64>>; 3],
}

const LIMITS: [&str; 3] = ["max_parallel_requests", "rpm", "tpm"];

impl Entry {
    /// The deployment, where its `api_base` names a host and port; `default` is the router's
    /// `default_max_parallel_requests` as written.
    fn deployment(self, default: Option<Option<u64>>) -> Option<Deployment> {
        let (host, port) = host_and_port(&self.api_base)?;
        // LiteLLM's calculate_max_parallel_requests, in its order: the first key set decides.
        // A value that is no plain count (os.environ/..., an alias) leaves the limit unknown,
        // and 0 makes no semaphore: neither is checked.
        let [parallel, rpm, tpm] = self.limits;
        let keys = [(parallel, "max_parallel_requests"), (rpm, "rpm"), (tpm, "tpm"), (default, "default_max_parallel_requests")];
        let (max_parallel_requests, limit_from) = match keys.into_iter().find_map(|(v, key)| Some((v?, key))) {
            Some((Some(n), "tpm")) => (Some((n.saturating_mul(6) / 1000).max(1)), "tpm"),
            Some((Some(n), key)) if n > 0 => (Some(n), key),
            _ => (None, ""),
        };
        Some(Deployment { model: self.model, host, port, max_parallel_requests, limit_from: limit_from.into(), local: None })
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum PathStep<'f> {
    Key(&'f str),
    Index(usize),
}

/// `http://host:8000/v1` → ("host", 8000); the scheme's port where none is written; None for
/// what is no URL.
fn host_and_port(url: &str) -> Option<(String, u16)> {
    let (scheme, rest) = url.trim().split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let (host, port) = match authority.strip_prefix('[') {
        // [::1]:8000
        Some(v6) => {
            let (host, after) = v6.split_once(']')?;
            (host, after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        },
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None if scheme.eq_ignore_ascii_case("https") => 443,
        None if scheme.eq_ignore_ascii_case("http") => 80,
        None => return None,
    };
    (!host.is_empty()).then(|| (host.chars().take(MAX_TEXT).collect(), port))
}

/// Whether `host` is on this machine, given the addresses `local` holds: `localhost` and
/// loopback or unspecified addresses are, any other address is not unless it is one of them
/// (an IPv4-mapped IPv6 address as its IPv4 one); a name is not known (None: it is not resolved).
pub fn locality(host: &str, local: &[std::net::IpAddr]) -> Option<bool> {
    let name = host.trim_end_matches('.').to_ascii_lowercase();
    if name == "localhost" || name.ends_with(".localhost") {
        return Some(true);
    }
    let address = name.split('%').next()?.parse::<std::net::IpAddr>().ok()?.to_canonical();
    Some(address.is_loopback() || address.is_unspecified() || local.contains(&address))
}

/// Who a process is for file access, from /proc/PID/status: its uid, gid and groups, where its
/// real, effective, saved and filesystem ids agree (a setuid program's differ: it is refused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl Credentials {
    pub fn parse(status: &str) -> Result<Credentials, String> {
        let ids = |field: &str| -> Vec<u32> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .map(|v| v.split_whitespace().filter_map(|n| n.parse().ok()).collect())
                .unwrap_or_default()
        };
        // Uid: real effective saved filesystem.
        let (uids, gids) = (ids("Uid:"), ids("Gid:"));
        if uids.len() != 4 || gids.len() != 4 {
            return Err("its credentials are unreadable".into());
        }
        if uids.iter().any(|&u| u != uids[0]) || gids.iter().any(|&g| g != gids[0]) {
            return Err("it runs with changed ids (a setuid or setgid program): its config is not read".into());
        }
        Ok(Credentials { uid: uids[0], gid: gids[0], groups: ids("Groups:") })
    }

    /// Whether these credentials have `bit` (4 read, 1 search) on a file of this owner, group and
    /// mode by its permission bits (root has every one).
    pub fn may(&self, bit: u32, owner: u32, group: u32, mode: u32) -> bool {
        let shift = if self.uid == 0 {
            return true;
        } else if owner == self.uid {
            6
        } else if group == self.gid || self.groups.contains(&group) {
            3
        } else {
            0
        };
        mode & (bit << shift) != 0
    }
}

fn credentials(pid: u32) -> Result<Credentials, String> {
    Credentials::parse(&procfs::read_bounded(&format!("/proc/{pid}/status"), 64 * 1024).ok_or("the proxy is gone")?)
}

/// Symbolic links followed in one path at most, as the kernel allows.
const MAX_LINKS: usize = 40;

fn at(dir: &std::fs::File, name: &str, flags: libc::c_int) -> Result<std::fs::File, String> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let c = std::ffi::CString::new(name).map_err(|_| "its path holds a NUL".to_string())?;
    // SAFETY: openat on a valid directory fd and a NUL-terminated name; the fd returned is owned.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!("cannot open it: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a new fd, owned by nothing else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// What the symbolic link opened as `link` (O_PATH | O_NOFOLLOW) points to.
fn link_target(link: &std::fs::File) -> Result<String, String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: readlinkat with an empty name reads the link `link` itself refers to, into `buf`.
    let n = unsafe { libc::readlinkat(std::os::fd::AsRawFd::as_raw_fd(link), c"".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(format!("cannot read a link of it: {}", std::io::Error::last_os_error()));
    }
    buf.truncate(n as usize);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// The config `path` of proxy `pid`, as that process would open it: relative to its working
/// directory, absolute to its root (inside its container), symbolic links followed within that
/// root (a Kubernetes ConfigMap is one). Every directory on the way must be searchable and the
/// file readable by the proxy's ids, by their permission bits, each checked on what was opened
/// (O_PATH: nothing is opened for reading before it passes, a device never is), so a link
/// swapped meanwhile cannot take the read elsewhere.
pub fn read_config(pid: u32, path: &str) -> Result<String, String> {
    let who = credentials(pid)?;
    let opened = |p: String| std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH | libc::O_DIRECTORY).open(p);
    let root = opened(format!("/proc/{pid}/root")).map_err(|e| format!("cannot open its root: {e}"))?;
    let start = if path.starts_with('/') { root.try_clone() } else { opened(format!("/proc/{pid}/cwd")) };
    let mut dirs = vec![start.map_err(|e| format!("cannot open its directory: {e}"))?];
    let mut rest: std::collections::VecDeque<String> = path.split('/').filter(|c| !c.is_empty() && *c != ".").map(String::from).collect();
    let mut links = 0;
    let file = loop {
        let Some(name) = rest.pop_front() else { return Err("it names a directory".into()) };
        let dir = dirs.last().expect("never empty");
        let meta = dir.metadata().map_err(|e| format!("cannot stat a directory of it: {e}"))?;
        if !who.may(1, meta.uid(), meta.gid(), meta.mode()) {
            return Err(format!("its user (uid {}) may not search a directory of its path", who.uid));
        }
        if name == ".." {
            // Never above the proxy's root, as the kernel keeps it.
            if dirs.len() > 1 {
                dirs.pop();
            }
            continue;
        }
        let next = at(dir, &name, libc::O_PATH | libc::O_NOFOLLOW)?;
        let meta = next.metadata().map_err(|e| format!("cannot stat it: {e}"))?;
        if meta.file_type().is_symlink() {
            links += 1;
            if links > MAX_LINKS {
                return Err("its path has too many symbolic links".into());
            }
            let target = link_target(&next)?;
            if target.starts_with('/') {
                dirs = vec![root.try_clone().map_err(|e| format!("cannot open its root: {e}"))?];
            }
            for c in target.split('/').rev().filter(|c| !c.is_empty() && *c != ".") {
                rest.push_front(c.to_string());
            }
            continue;
        }
        if rest.is_empty() {
            break (next, meta);
        }
        if !meta.is_dir() {
            return Err("a part of its path is not a directory".into());
        }
        if dirs.len() >= 256 {
            return Err("its path is too deep".into());
        }
        dirs.push(next);
    };
    let (file, meta) = file;
    if !meta.file_type().is_file() {
        return Err("it is not a regular file".into());
    }
    if !who.may(4, meta.uid(), meta.gid(), meta.mode()) {
        return Err(format!("its user (uid {}) may not read it", who.uid));
    }
    if meta.len() > MAX_CONFIG {
        return Err(format!("it is larger than {} KiB", MAX_CONFIG / 1024));
    }
    // The very file checked, now opened to read.
    let file = crate::dir::reopen_to_read(&file, &meta).map_err(|e| format!("cannot open it: {e}"))?;
    let mut raw = Vec::new();
    file.take(MAX_CONFIG).read_to_end(&mut raw).map_err(|e| format!("cannot read it: {e}"))?;
    Ok(String::from_utf8_lossy(&raw).into_owned())
}

/// A LiteLLM proxy met in /proc.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proxy {
    pub pid: u32,
    pub uid: u32,
    pub command: Vec<String>,
    pub config: String,
    pub deployments: Vec<Deployment>,
    /// Its worker processes (see [`crate::event::Event::Proxy`]'s).
    pub workers: Option<u64>,
}

/// Whether a command is a worker Python's multiprocessing spawned (uvicorn's `--workers`): its
/// parent is the program it works for.
fn is_spawned_worker(command: &[String]) -> bool {
    command.iter().any(|a| a == "--multiprocessing-fork")
}

/// The proxies that are not a worker forked from another (gunicorn's workers show their master's
/// command line), each with its workers counted: the spawned workers under it and the proxies
/// of the same config forked from it. `parent` gives each pid's.
fn fold_workers(mut found: Vec<Proxy>, spawned: &[u32], parent: impl Fn(u32) -> Option<u32>) -> Vec<Proxy> {
    let masters: Vec<(u32, String)> = found.iter().map(|p| (p.pid, p.config.clone())).collect();
    let forked: Vec<(u32, u32)> = found
        .iter()
        .filter_map(|p| {
            let up = parent(p.pid)?;
            masters.iter().any(|(pid, config)| *pid == up && *config == p.config).then_some((p.pid, up))
        })
        .collect();
    let spawned_by: Vec<u32> = spawned.iter().filter_map(|&pid| parent(pid)).collect();
    found.retain(|p| !forked.iter().any(|(pid, _)| *pid == p.pid));
    for p in &mut found {
        let workers = forked.iter().filter(|(_, up)| *up == p.pid).count() + spawned_by.iter().filter(|&&up| up == p.pid).count();
        p.workers = (workers > 0).then_some(workers as u64);
    }
    found
}

/// Proxies read a scan: root's, and every other user's together, each user at most
/// [`PER_USER`] of them. One user's crowd of proxies never keeps root's (or another user's
/// first ones) from being read.
#[derive(Default)]
struct Shares {
    root: usize,
    others: usize,
    by_user: std::collections::HashMap<u32, usize>,
}

/// A user's share of the proxies read in a scan (root's own are [`MAX_PROXIES`]).
const PER_USER: usize = 8;

impl Shares {
    /// Whether a proxy of `uid` is read, counting it if so.
    fn admit(&mut self, uid: u32) -> bool {
        if uid == 0 {
            self.root += 1;
            return self.root <= MAX_PROXIES;
        }
        let mine = self.by_user.entry(uid).or_default();
        if *mine >= PER_USER || self.others >= MAX_PROXIES {
            return false;
        }
        *mine += 1;
        self.others += 1;
        true
    }
}

/// The LiteLLM proxies running now (those of `owner` only, where given), with the deployments
/// their configs name: root's up to [`MAX_PROXIES`], and as many of other users' together, each
/// user's at most [`PER_USER`]. A config that cannot be read is said once on stderr per (pid,
/// reason), through `said`.
pub fn scan(owner: Option<u32>, said: &mut std::collections::HashSet<(u32, String)>) -> Vec<Proxy> {
    let (mut found, mut spawned) = (Vec::new(), Vec::new());
    let mut shares = Shares::default();
    // Every namespace's addresses, read once a scan where a deployment names an address that is
    // not its proxy's.
    let mut host_wide: Option<Option<Vec<std::net::IpAddr>>> = None;
    for pid in procfs::all_pids() {
        // comm needs no lock of the process's memory: only candidates' argv is read.
        let comm = procfs::read_bounded(&format!("/proc/{pid}/comm"), 64).unwrap_or_default();
        let comm = comm.trim();
        if comm != "litellm" && !comm.starts_with("python") {
            continue;
        }
        let uid = procfs::place::owner(pid);
        if owner.is_some_and(|o| uid != Some(o)) {
            continue;
        }
        let Some(command) = procfs::command::command(pid) else { continue };
        if is_spawned_worker(&command) {
            if spawned.len() < MAX_PROXIES * 64 {
                spawned.push(pid);
            }
            continue;
        }
        if !is_proxy(&command) {
            continue;
        }
        // A worker forked from a proxy read (gunicorn's show their master's command line) counts
        // with it, not against its user's share; at most as many as spawned workers.
        let forked = procfs::parent(pid).is_some_and(|up| found.iter().any(|p: &Proxy| p.pid == up));
        let admitted = if forked { found.len() < MAX_PROXIES * 64 } else { uid.is_some_and(|u| shares.admit(u)) };
        if !admitted {
            continue;
        }
        let Some(config) = config_arg(&command).map(String::from) else { continue };
        match credentials(pid).and_then(|who| Ok((who.uid, read_config(pid, &config)?))) {
            Ok((uid, text)) => {
                let mut deployments = deployments(&text);
                // An address is the proxy's own (its network namespace's), else another
                // namespace's here (a container's, the host's from a container), else another
                // machine's; unknown where the namespaces cannot all be read.
                let own = procfs::net::local_addresses(pid);
                for d in &mut deployments {
                    d.local = match locality(&d.host, own.as_deref().unwrap_or_default()) {
                        Some(false) if own.is_none() => None,
                        Some(false) => {
                            host_wide.get_or_insert_with(procfs::net::host_addresses).as_deref().and_then(|all| locality(&d.host, all))
                        }
                        judged => judged,
                    };
                }
                found.push(Proxy { pid, uid, deployments, command, config, workers: None })
            }
            Err(why) => {
                if said.len() < MAX_PROXIES * 4 && said.insert((pid, why.clone())) {
                    eprintln!(
                        "gputrace: LiteLLM proxy pid {pid}'s config {}: {why}; its limits are not checked",
                        crate::units::one_line(&config)
                    );
                }
            }
        }
    }
    fold_workers(found, &spawned, procfs::parent)
}

/// A proxy's config is read again this often: a change to it is seen within this.
const PROXY_SCAN_EVERY: Duration = Duration::from_secs(5);
const PROXY_RESEND_EVERY: Duration = Duration::from_secs(60);

/// LiteLLM proxies (of `owner` only, where given), scanned for on a thread of their own every
/// [`PROXY_SCAN_EVERY`]: each one new, or whose config now says something else (at most once a
/// [`PROXY_RESEND_EVERY`]: a config rewritten in a loop cannot flood the window), is sent; one
/// gone is sent with no deployments. A read that hangs (a config on a FUSE mount of the proxy's
/// user) stops only this scan.
pub fn scanner(owner: Option<u32>) -> anyhow::Result<tokio::sync::mpsc::Receiver<Proxy>> {
    let (tx, rx) = tokio::sync::mpsc::channel(MAX_PROXIES);
    std::thread::Builder::new()
        .name("gputrace-proxies".into())
        .spawn(move || {
            let mut sent: HashMap<u32, (Instant, Proxy)> = HashMap::new();
            let mut said = HashSet::new();
            loop {
                let found = scan(owner, &mut said);
                let gone: Vec<u32> = sent.keys().filter(|pid| !found.iter().any(|p| p.pid == **pid)).copied().collect();
                let mut out: Vec<Proxy> = Vec::new();
                for pid in gone {
                    let (_, last) = sent.remove(&pid).expect("listed");
                    out.push(Proxy { deployments: Vec::new(), ..last });
                }
                for proxy in found {
                    let due = sent.get(&proxy.pid).is_none_or(|(at, last)| *last != proxy && at.elapsed() >= PROXY_RESEND_EVERY);
                    if due {
                        sent.insert(proxy.pid, (Instant::now(), proxy.clone()));
                        out.push(proxy);
                    }
                }
                for proxy in out {
                    if tx.blocking_send(proxy).is_err() {
                        return;
                    }
                }
                std::thread::sleep(PROXY_SCAN_EVERY);
            }
        })
        .map_err(|e| anyhow::anyhow!("starting the LiteLLM proxy scan: {e}"))?;
    Ok(rx)
}

#[cfg(test)]
mod tests;
