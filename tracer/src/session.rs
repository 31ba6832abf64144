//! One tracing session, whatever asked for it: loads the probes, attaches to what was asked,
//! launches the command, and runs the one loop that reads the kernel, decodes, names files and
//! feeds the model, handing each record to a [`Sink`]. It knows no subcommand: `record` is a
//! sink that writes a trace file and prints its summary, `watch` one that keeps a flight
//! recorder and answers its own asks (HTTP, SIGUSR1); each is its own module, above this one.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::abi::{DriverVersion, Layout, NEWEST_KNOWN, OLDEST_KNOWN};
use crate::analysis::Phase;
use crate::devices::Majors;
use crate::event::{Event, Record, Sample};
use crate::files::{KernelUpdate, ProcResolver};
use crate::gpus::Sampler;
use crate::mark::{Asked, MarkRequest, MarkServer, MAX_CONNECTIONS};
use crate::model::Model;
use crate::pipeline::Pipeline;
use crate::privileges::Needs;
use crate::probe::{self, Counters, Probe};
use crate::procfs;
use crate::signals::StopSignals;
use crate::trace::{Header, FORMAT, VERSION};
use crate::user::User;

/// What to trace and how to decode it: the same for `record` and `watch`.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Running processes to attach to, with their descendants.
    pub pids: Vec<u32>,
    /// Every process on the host.
    pub all: bool,
    /// Also every process under this cgroup v2 directory, now and to come (`watch --cgroup`).
    pub cgroup: Option<PathBuf>,
    /// A command to launch and trace from its first instruction.
    pub command: Vec<String>,
    pub driver_version: Option<String>,
    /// Keep each ioctl's params bytes in its record (`record --raw`).
    pub raw: bool,
    /// Hide argument values and query strings (see [`crate::redact`]).
    pub redact: bool,
    /// Each GPU's capacity where NVML cannot tell it (no NVML, unified memory).
    pub capacity: Option<u64>,
    /// The eBPF programs' own diagnostics on stderr (`--kernel-log`).
    pub kernel_log: bool,
    /// The gputrace command line, kept in the trace header.
    pub invocation: Vec<String>,
}

/// Where a session's records go, and what else the sink listens to.
pub trait Sink {
    /// What the sink is asked besides the kernel's events (a watch's HTTP requests, SIGUSR1).
    type Ask;
    /// Sets up what the sink listens to, before it is said that tracing began.
    fn start(&mut self) -> Result<()> {
        Ok(())
    }
    /// The end of the line that says tracing began: where the records go.
    fn destination(&self) -> String;
    /// What the sink goes on doing once tracing runs, for the capabilities kept (`sudo`: under
    /// sudo).
    fn needs(&self, sudo: bool) -> Needs;
    /// A record, already applied to the model.
    fn push(&mut self, record: &Record, model: &Model);
    /// A few times a second, with the kernel side's counters. The model may be replaced
    /// (compacted).
    fn tick(&mut self, model: &mut Model, counters: &Counters);
    /// The next ask: a future that never completes for a sink that takes none.
    fn ask(&mut self) -> impl Future<Output = Self::Ask>;
    /// Answers an ask on the model as the kernel's events so far left it.
    fn answer(&mut self, ask: Self::Ask, model: &Model);
    /// `DUMP` on the recorder's socket: what happens, or why nothing does.
    fn dump(&mut self) -> Result<String, String>;
    /// Tracing is over.
    fn close(&mut self, end: &End) -> Result<()>;
}

/// What a session ends with, for the sink's summary.
pub struct End<'a> {
    pub header: &'a Header,
    pub model: &'a Model,
    pub counters: Counters,
    /// Ring-buffer records that did not parse (a mismatched kernel object).
    pub decode_errors: u64,
    /// Ioctls on fds met without their open that were not NVIDIA's.
    pub pending_dropped: u64,
    /// Files at NVIDIA's paths that were not NVIDIA's devices, as userspace found them.
    pub impostors: u64,
}

/// The eBPF programs' log, woken on by the event loop.
type KernelLog = AsyncFd<aya_log::EbpfLogger<probe::KernelLog>>;

/// How often NVML and the host's memory are sampled into the trace.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Records taken from the ring buffer between two yields to the other tasks.
const DRAIN_BATCH: u64 = 256;
/// How long the ring buffer is read before the loop looks at anything else (a stop signal, a
/// question, the tick).
const DRAIN_FOR: Duration = Duration::from_millis(50);
/// A proxy's config is read again this often: a change to it is seen within this.
const PROXY_SCAN_EVERY: Duration = Duration::from_secs(5);
const PROXY_RESEND_EVERY: Duration = Duration::from_secs(60);

/// A cgroup v2 directory, opened for the kernel's cgroup array; refused with the reason a user
/// can act on when it is not one.
fn open_cgroup(path: &std::path::Path) -> Result<std::fs::File> {
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    let dir = std::fs::File::open(path).with_context(|| format!("cannot open the cgroup {}", path.display()))?;
    // SAFETY: fstatfs fills the struct for an open fd.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    let on_cgroup2 =
        unsafe { libc::fstatfs(std::os::fd::AsRawFd::as_raw_fd(&dir), &mut fs) } == 0 && fs.f_type as i64 == CGROUP2_SUPER_MAGIC;
    if !on_cgroup2 || !dir.metadata()?.is_dir() {
        bail!(
            "{} is not a cgroup v2 directory: give one under the unified hierarchy (/sys/fs/cgroup/... on cgroup v2 hosts, /sys/fs/cgroup/unified/... on hybrid ones), such as a container's `system.slice/docker-ID.scope`",
            path.display()
        );
    }
    Ok(dir)
}

/// Each pid to attach to names a process that is there.
fn check_running(pids: &[u32]) -> Result<()> {
    match pids.iter().find(|&&pid| procfs::stat(pid).is_none()) {
        Some(pid) => bail!("no process has pid {pid}: check it with `ps -p {pid}`"),
        None => Ok(()),
    }
}

/// Loads the probes, traces what `opts` asks into the sink made from the header, and closes
/// it. The exit status of the launched command (0 without one).
pub fn run<S: Sink>(opts: &Options, sink: impl FnOnce(&Header, Option<&User>) -> Result<S>) -> Result<i32> {
    if let Some(program) = opts.command.first() {
        find_program(program)?;
    }
    check_running(&opts.pids)?;
    let user = User::invoking()?;
    let kernel = probe::preflight()?;
    raise_fd_limit();
    let (version, source) = driver_version(opts.driver_version.as_deref())?;
    let layout = layout_for(version);
    let majors = Majors::of_host()?;

    let mut header = header(opts, version, source, majors);
    if let Some(bytes) = opts.capacity {
        header.assume_capacity(bytes);
    }
    if opts.redact {
        crate::redact::header(&mut header);
    }
    let cgroup = opts.cgroup.as_deref().map(open_cgroup).transpose()?;
    let selection = probe::Selection { trace_all: opts.all, cgroup: cgroup.as_ref(), majors, kernel_log: opts.kernel_log };
    let mut probe = Probe::load(&layout, selection, &kernel)?;
    if let Some(refusal) = &probe.calls_in_map_only {
        eprintln!(
            "gputrace: this kernel refused the ioctl programs that keep each call in flight in its thread's slot (they need BPF's atomics: \
             Linux 5.12, 5.18 on arm64), so calls wait in an LRU map, about 300 ns more each: {}",
            refusal.lines().next().unwrap_or_default()
        );
    }
    // Once the probes are in: a start the kernel refused leaves no empty trace behind.
    let sink = sink(&header, user.as_ref())?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the event loop")?;
    let mut session = Session {
        pipeline: Pipeline::new(layout, ProcResolver, opts.raw, Some(std::process::id())),
        majors: (majors, Instant::now()),
        model: Model::new(),
        sink,
        out: Vec::new(),
        updates: Vec::new(),
        lost_seen: 0,
        redact: opts.redact,
        user,
    };
    session.pipeline.files.set_majors(majors);
    session.pipeline.files.set_gpu_indexes(crate::devices::GpuIndexes::of_host(header.gpus.len()));
    let exit_code = runtime.block_on(session.trace(&mut probe, opts))?;
    let end = End {
        header: &header,
        model: &session.model,
        counters: probe.counters(),
        decode_errors: session.pipeline.unparsed,
        pending_dropped: session.pipeline.files.pending_dropped,
        impostors: session.pipeline.files.impostors,
    };
    session.sink.close(&end)?;
    Ok(exit_code)
}

struct Session<S: Sink> {
    pipeline: Pipeline<ProcResolver>,
    model: Model,
    sink: S,
    out: Vec<Record>,
    updates: Vec<KernelUpdate>,
    lost_seen: u64,
    redact: bool,
    /// NVIDIA's device numbers, and when they were last read.
    majors: (Option<Majors>, Instant),
    /// Who the command runs as, under sudo.
    user: Option<User>,
}

impl<S: Sink> Session<S> {
    /// Into the model, then the sink.
    fn emit(&mut self, mut record: Record) {
        if self.redact {
            crate::redact::record(&mut record);
        }
        self.model.apply(&record);
        self.sink.push(&record, &self.model);
    }

    fn emit_now(&mut self, pid: u32, event: Event) {
        let (_, ts) = clocks();
        self.emit(Record::new(ts, pid, 0, event))
    }

    /// CUDA loads nvidia-uvm at its first use, often after gputrace started (and a service may
    /// start before the driver, or reload nvidia-uvm under a new major): /proc/devices is read
    /// again each second (64 KiB at most), and what a reading adds is taken.
    fn read_majors_again(&mut self, probe: &mut Probe) -> Result<()> {
        let (majors, read) = self.majors;
        if read.elapsed() < Duration::from_secs(1) {
            return Ok(());
        }
        let now = Majors::update(majors, Majors::of_host()?);
        self.majors = (now, Instant::now());
        if now != majors {
            probe.set_majors(now)?;
            self.pipeline.files.set_majors(now);
            if let Some(m) = now {
                eprintln!(
                    "gputrace: NVIDIA's device numbers are now nvidia {}, nvidia-uvm {} (a module was loaded or reloaded)",
                    m.nvidia, m.uvm
                );
            }
        }
        Ok(())
    }

    /// An answer the kernel's maps cannot take (one full: any user can fill the table of fds
    /// with fds of their own) is counted and said once; it never ends the session.
    fn apply_updates(&mut self, probe: &mut Probe) {
        for update in self.updates.drain(..) {
            let stored = match update {
                KernelUpdate::SetFd { pid, fd, state } => probe.set_fd(pid, fd, state),
                KernelUpdate::ForgetFd { pid, fd } => {
                    probe.forget_fd(pid, fd);
                    Ok(())
                }
                KernelUpdate::Traced { pid } => probe.trace_pid(pid),
                KernelUpdate::BlockedRead { pid, tid, fd, buf } => probe.set_reading(pid, tid, fd, buf).map(|()| {
                    // Returned between the look and the insert: the entry would wait for that
                    // thread's next read of anything, so it goes.
                    if !procfs::blocked_reads(pid).contains(&(tid, fd, buf)) {
                        probe.forget_reading(pid, tid);
                    }
                }),
            };
            if let Err(e) = stored {
                if probe.count_refused_answer() {
                    eprintln!("gputrace: warning: {e}; tracing goes on, and what the kernel side could not be told is not followed there (counted with the refused map inserts)");
                }
            }
        }
    }

    /// Takes what the ring buffer holds, for at most [`DRAIN_FOR`] (records keep coming while it
    /// is read: any user can make them faster than they are read), letting the other tasks
    /// (connections taken, /proc reads) run every [`DRAIN_BATCH`] records. Whether it stopped at
    /// the bound, with records left.
    async fn drain(&mut self, ring: &mut RingBuf<MapData>, probe: &mut Probe) -> bool {
        let began = Instant::now();
        let mut taken = 0u64;
        while let Some(item) = ring.next() {
            self.pipeline.take(&item, &mut self.out, &mut self.updates);
            drop(item);
            let records = std::mem::take(&mut self.out);
            for record in records {
                self.emit(record);
            }
            // Answers go to the kernel at once so the next ioctl on that fd is settled there.
            self.apply_updates(probe);
            taken += 1;
            if taken.is_multiple_of(DRAIN_BATCH) {
                if began.elapsed() >= DRAIN_FOR {
                    return true;
                }
                tokio::task::yield_now().await;
            }
        }
        false
    }

    fn check_lost(&mut self, probe: &Probe) {
        let lost = probe.counters().lost;
        if lost > self.lost_seen {
            let records = lost - self.lost_seen;
            self.lost_seen = lost;
            self.emit_now(0, Event::Lost { records });
        }
    }

    /// Attaches to what was asked (the processes of --pid and their descendants, or everyone's
    /// NVIDIA files with --all), launches the command, then drops what recording no longer needs.
    fn begin(&mut self, probe: &mut Probe, opts: &Options) -> Result<Option<(tokio::process::Child, u32)>> {
        let mut roots = opts.pids.clone();
        roots.extend(opts.cgroup.as_deref().map(procfs::cgroup_pids).unwrap_or_default());
        let attach: Vec<u32> = if opts.all { procfs::all_pids() } else { procfs::with_descendants(&roots) };
        for pid in attach {
            if !opts.all {
                probe.trace_pid(pid)?;
            }
            let mut events = self.pipeline.files.scan(pid, &mut self.updates);
            // With --all, only the processes that hold NVIDIA files or serve are worth a record
            // now (a server's API process may hold none; its engine does).
            let worth = events.iter().any(|e| matches!(e, Event::FdFound { .. } | Event::Attached { .. }));
            if opts.all && !worth {
                self.updates.clear();
                continue;
            }
            // Asked only now: a place kept for a process never recorded would be no news at its
            // children's forks, and the model would never learn where (and as whom) they run.
            if let Some(place) = self.pipeline.files.place_if_new(pid, None) {
                events.insert(1, Event::Place(place));
            }
            for event in events {
                self.emit_now(pid, event);
            }
            self.apply_updates(probe);
        }
        self.pipeline.files.attached();
        probe.attached()?;

        let what = if opts.all {
            "every process".to_string()
        } else if let Some(cgroup) = &opts.cgroup {
            format!("cgroup {}", cgroup.display())
        } else if opts.command.is_empty() {
            format!("pid {}", join(&opts.pids))
        } else {
            format!("`{}`", crate::units::one_line(&opts.command.join(" ")))
        };
        eprintln!("gputrace: tracing {what}{}", self.sink.destination());
        let child = match opts.command.is_empty() {
            true => None,
            false => Some(self.launch(probe, &opts.command)?),
        };

        // Launched, so nothing below needs to change identity or own files any more.
        // The /proc readers started so far would keep every capability: they end first.
        crate::procfs::mm::retire();
        if let Err(e) = crate::privileges::keep_only_what_recording_needs(self.sink.needs(self.user.is_some())) {
            eprintln!("gputrace: warning: could not drop the capabilities recording no longer needs: {e}");
        }
        Ok(child)
    }

    async fn trace(&mut self, probe: &mut Probe, opts: &Options) -> Result<i32> {
        let (mut ring, mut kernel_log) = rings(probe)?;

        // Before anything is launched: a stop signal from then on reaches the command.
        let stops = StopSignals::install()?;
        // Listening before the command starts: a mark it sends at once is not refused.
        let invoking_uid = Some(self.user.as_ref().map_or(0, |u| u.uid));
        let marks = MarkServer::open(std::process::id(), invoking_uid);
        // What the sink listens to is set up before it is said that tracing began.
        self.sink.start()?;
        let mut child = self.begin(probe, opts)?;
        let (mark_tx, mut mark_rx) = tokio::sync::mpsc::channel::<MarkRequest>(MAX_CONNECTIONS);
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        let mut sample_rx = sampler()?;
        // A whole host's proxies where the whole host is traced; else (a command, pids, a
        // cgroup) only the invoking user's own: other users' configs stay out of their trace.
        let proxy_owner = if opts.all { None } else { Some(self.user.as_ref().map_or(0, |u| u.uid)) };
        let mut proxy_rx = proxy_scanner(proxy_owner)?;
        // Attached with --pid and nothing launched: done when every attached process is gone.
        let mut attached: Vec<u32> = if child.is_none() && !opts.all { opts.pids.clone() } else { Vec::new() };
        let mut signals_to_command = 0;
        let exit_code;
        loop {
            tokio::select! {
                guard = ring.readable_mut() => {
                    let mut guard = guard.context("waiting for kernel events")?;
                    // Stopped at the bound, it stays ready: the loop comes back to it.
                    if !self.drain(guard.get_inner_mut(), probe).await {
                        guard.clear_ready();
                    }
                }
                guard = async { kernel_log.as_mut().unwrap().readable_mut().await }, if kernel_log.is_some() => {
                    let mut guard = guard.context("waiting for the kernel's log")?;
                    // aya-log panics on a record it cannot parse: the log stops, recording goes on.
                    let parsed = flush_kernel_log(guard.get_inner_mut());
                    guard.clear_ready();
                    if !parsed {
                        kernel_log = None;
                    }
                }
                _ = tick.tick() => {
                    // The kernel wakes this loop only once a batch of escapes has built up.
                    self.drain(ring.get_mut(), probe).await;
                    self.sink.tick(&mut self.model, &probe.counters());
                    self.check_lost(probe);
                    self.read_majors_again(probe)?;
                    if !attached.is_empty() {
                        attached.retain(|&pid| procfs::running(pid));
                        if attached.is_empty() {
                            exit_code = 0;
                            break;
                        }
                    }
                }
                status = async { child.as_mut().map(|(c, _)| c.wait()).unwrap().await }, if child.is_some() => {
                    let status = status.context("waiting for the command")?;
                    exit_code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
                    let (_, pid) = child.take().unwrap();
                    // The kernel's exit record is already in the ring buffer: read it first.
                    self.drain(ring.get_mut(), probe).await;
                    self.emit_now(pid, Event::Exit { code: Some(exit_code) });
                    break;
                }
                _ = async { marks.as_ref().unwrap().accept(&mark_tx).await }, if marks.is_some() => {}
                // Questions (the recorder socket's, and the sink's own: a watch's HTTP requests,
                // SIGUSR1) are answered on everything the kernel has recorded so far, not on
                // what the last wake-up brought (escapes wait for a batch or the tick).
                question = next_question(&mut mark_rx, &mut self.sink) => {
                    self.drain(ring.get_mut(), probe).await;
                    match question {
                        Question::Socket(request) => {
                            let answer = match request.asked {
                                Asked::Mark { phase, pid } => self.mark(phase, pid),
                                Asked::Dump => self.sink.dump().map_or_else(|why| format!("ERR {why}"), |what| format!("OK {what}")),
                            };
                            let _ = request.reply.send(answer);
                        }
                        Question::Sink(ask) => self.sink.answer(ask, &self.model),
                    }
                }
                Some((ts, sample)) = sample_rx.recv() => self.emit(Record::new(ts, 0, 0, Event::Sample(sample))),
                Some(proxy) = proxy_rx.recv() => {
                    let (uid, command, config, deployments, workers) = (proxy.uid, proxy.command, proxy.config, proxy.deployments, proxy.workers);
                    let event = Event::Proxy { uid, command, config, deployments, workers };
                    self.emit_now(proxy.pid, event);
                }
                stop = stops.next() => {
                    let stop = stop?;
                    // A command is waited for: the signal is passed on (unless it already got it)
                    // and recording ends with the command. A third signal stops waiting.
                    let Some((_, pid)) = child.as_ref() else { exit_code = stop.exit_code(); break };
                    signals_to_command += 1;
                    if signals_to_command >= 3 {
                        eprintln!("gputrace: pid {pid} has not exited after 3 signals; recording stops and it runs on untraced");
                        exit_code = stop.exit_code();
                        break;
                    }
                    if stop.to_forward(*pid) {
                        // SAFETY: kill(2) on the command this recorder started and has not reaped.
                        unsafe { libc::kill(*pid as libc::pid_t, stop.signal) };
                    }
                }
            }
        }
        self.drain(ring.get_mut(), probe).await;
        self.check_lost(probe);
        if let Some(logger) = kernel_log.as_mut() {
            flush_kernel_log(logger.get_mut());
        }
        Ok(exit_code)
    }

    /// A phase mark from the socket (already checked for who sent it): recorded for a traced
    /// process, refused otherwise.
    fn mark(&mut self, phase: Phase, pid: u32) -> String {
        match self.model.processes.get(&pid) {
            None => return format!("ERR pid {pid} is not traced by this recorder"),
            // Its pid may belong to someone else's process by now: who may mark was checked
            // against that one.
            Some(p) if p.exited.is_some() => return format!("ERR pid {pid} has exited; its service can be marked through a live pid"),
            Some(_) => {}
        }
        self.emit_now(pid, Event::Mark { phase: phase.name().into() });
        "OK".into()
    }

    /// Starts the command with nothing it does missed: gputrace marks itself traced for the
    /// moment of the fork, so the kernel's own fork hook traces the child before it can exec.
    /// With sudo the command runs as the invoking user: their uid, gid, supplementary groups
    /// (`video` opens /dev/nvidia* on many hosts), HOME, USER and LOGNAME.
    fn launch(&mut self, probe: &mut Probe, command: &[String]) -> Result<(tokio::process::Child, u32)> {
        let mut cmd = tokio::process::Command::new(&command[0]);
        cmd.args(&command[1..]);
        if let Some(user) = self.user.clone() {
            cmd.env("HOME", &user.home).env("USER", &user.name).env("LOGNAME", &user.name);
            // std's uid()/gid() would drop the supplementary groups; set all three in the child.
            // SAFETY: between fork and exec, only async-signal-safe syscalls on owned data.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setgroups(user.groups.len(), user.groups.as_ptr()) != 0
                        || libc::setgid(user.gid) != 0
                        || libc::setuid(user.uid) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let me = std::process::id();
        probe.trace_pid(me)?;
        let spawned = cmd.spawn();
        probe.untrace_pid(me);
        let child = spawned.with_context(|| format!("cannot run `{}`", command[0]))?;
        let pid = child.id().ok_or_else(|| anyhow!("the command exited before it could be traced"))?;
        Ok((child, pid))
    }
}

/// The kernel's ring buffer of events, and its log's where `--kernel-log` asked for it, each
/// woken on by the event loop.
fn rings(probe: &mut Probe) -> Result<(AsyncFd<RingBuf<MapData>>, Option<KernelLog>)> {
    let ring = probe.events.take().ok_or_else(|| anyhow!("the ring buffer was already taken"))?;
    // SAFETY: the ring buffer's fd stays open as long as the AsyncFd that owns it.
    let ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
        .map_err(|e| anyhow!("watching the ring buffer: {}", e.into_parts().1))?;
    let kernel_log = match probe.kernel_log.take() {
        // SAFETY: the log ring's fd stays open as long as the AsyncFd that owns the logger.
        Some(logger) => Some(
            unsafe { AsyncFd::register_with_interest(logger, Interest::READABLE) }
                .map_err(|e| anyhow!("watching the kernel's log: {}", e.into_parts().1))?,
        ),
        None => None,
    };
    Ok((ring, kernel_log))
}

/// NVML and /proc/meminfo on a thread of their own, every [`SAMPLE_EVERY`]: a slow NVML call
/// never holds up events. A sample is stamped with the time its query began: what was traced
/// after that may be missing from NVML's answer.
fn sampler() -> Result<tokio::sync::mpsc::Receiver<(u64, Sample)>> {
    let (sample_tx, sample_rx) = tokio::sync::mpsc::channel::<(u64, Sample)>(4);
    std::thread::Builder::new()
        .name("gputrace-sampler".into())
        .spawn(move || {
            let mut sampler = Sampler::new();
            while sample_tx.blocking_send((clocks().1, sampler.sample())).is_ok() {
                std::thread::sleep(SAMPLE_EVERY);
            }
        })
        .context("starting the sampler thread")?;
    Ok(sample_rx)
}

/// LiteLLM proxies (of `owner` only, where given), scanned for on a thread of their own every
/// [`PROXY_SCAN_EVERY`]: each one new, or whose config now says something else (at most once a
/// [`PROXY_RESEND_EVERY`]: a config rewritten in a loop cannot flood the window), is sent; one
/// gone is sent with no deployments. A read that hangs (a config on a FUSE mount of the proxy's
/// user) stops only this scan.
fn proxy_scanner(owner: Option<u32>) -> Result<tokio::sync::mpsc::Receiver<crate::litellm::Proxy>> {
    let (tx, rx) = tokio::sync::mpsc::channel(crate::litellm::MAX_PROXIES);
    std::thread::Builder::new()
        .name("gputrace-proxies".into())
        .spawn(move || {
            let mut sent: HashMap<u32, (Instant, crate::litellm::Proxy)> = HashMap::new();
            let mut said = HashSet::new();
            loop {
                let found = crate::litellm::scan(owner, &mut said);
                let gone: Vec<u32> = sent.keys().filter(|pid| !found.iter().any(|p| p.pid == **pid)).copied().collect();
                let mut out: Vec<crate::litellm::Proxy> = Vec::new();
                for pid in gone {
                    let (_, last) = sent.remove(&pid).expect("listed");
                    out.push(crate::litellm::Proxy { deployments: Vec::new(), ..last });
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
        .context("starting the LiteLLM proxy scan")?;
    Ok(rx)
}

/// What the trace says of itself and of the machine before the first record: clocks, driver,
/// NVML's view, and who held the device files already.
fn header(opts: &Options, version: Option<DriverVersion>, source: String, majors: Option<Majors>) -> Header {
    let snapshot = crate::gpus::snapshot();
    let (wall, mono) = clocks();
    Header {
        format: FORMAT.into(),
        version: VERSION,
        tracer_version: env!("CARGO_PKG_VERSION").into(),
        host: read_trimmed("/proc/sys/kernel/hostname"),
        kernel: read_trimmed("/proc/sys/kernel/osrelease"),
        driver_version: version.map(|v| v.to_string()),
        driver_version_source: source,
        wall_clock_start_ns: wall,
        monotonic_start_ns: mono,
        gpus: snapshot.gpus,
        prior_use: snapshot.prior_use,
        holders_at_start: crate::devices::nvidia_holders(majors),
        device_check: Majors::describe(majors),
        nvml: snapshot.note,
        command: opts.invocation.clone(),
        raw: opts.raw,
    }
}

/// Prints what the eBPF programs logged. aya-log panics on a record it cannot parse: then the log
/// stops (false), recording goes on.
fn flush_kernel_log(logger: &mut aya_log::EbpfLogger<probe::KernelLog>) -> bool {
    let parsed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| logger.flush())).is_ok();
    if !parsed {
        eprintln!("gputrace: the kernel's log had a record that could not be read; --kernel-log stops here, recording goes on");
    }
    parsed
}

/// Every open connection, device file and /proc entry is a descriptor: take the hard limit.
fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

fn find_program(program: &str) -> Result<PathBuf> {
    let is_executable = |p: &Path| {
        std::fs::metadata(p).map(|m| m.is_file() && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0).unwrap_or(false)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        return if is_executable(&p) { Ok(p) } else { Err(anyhow!("cannot run `{program}`: no such executable file")) };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| is_executable(p))
        .ok_or_else(|| anyhow!("cannot run `{program}`: command not found in PATH"))
}

/// The version to decode with: --driver-version, else the running driver's, else none.
fn driver_version(forced: Option<&str>) -> Result<(Option<DriverVersion>, String)> {
    if let Some(text) = forced {
        let v = DriverVersion::parse(text)
            .ok_or_else(|| anyhow!("--driver-version {text:?} is not a driver version: give it as 580.95.05 or 580"))?;
        return Ok((Some(v), "--driver-version".into()));
    }
    Ok(match DriverVersion::detect() {
        Some((v, source)) => (Some(v), source),
        None => (None, "none".into()),
    })
}

fn layout_for(version: Option<DriverVersion>) -> Layout {
    match version {
        None => {
            eprintln!(
                "gputrace: warning: no NVIDIA driver found (/sys/module/nvidia/version, /proc/driver/nvidia/version): decoding with the {NEWEST_KNOWN} layouts; give --driver-version to choose"
            );
            Layout::for_version(NEWEST_KNOWN)
        }
        Some(v) => {
            let layout = Layout::for_version(v);
            if layout.assumed {
                eprintln!(
                    "gputrace: warning: driver {v} is outside the versions whose layouts were checked ({OLDEST_KNOWN}–{NEWEST_KNOWN}): fields stable across versions decode, the rest uses the nearest known layout"
                );
            }
            layout
        }
    }
}

/// A question to answer once the ring is drained.
enum Question<A> {
    /// On the recorder's socket: a mark or a dump.
    Socket(MarkRequest),
    Sink(A),
}

/// The next question from either source. The socket's channel is never closed while the loop
/// runs (it holds a sender), so its `None` never comes.
async fn next_question<S: Sink>(socket: &mut tokio::sync::mpsc::Receiver<MarkRequest>, sink: &mut S) -> Question<S::Ask> {
    tokio::select! {
        Some(request) = socket.recv() => Question::Socket(request),
        ask = sink.ask() => Question::Sink(ask),
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

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_default()
}

fn join(pids: &[u32]) -> String {
    pids.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")
}
