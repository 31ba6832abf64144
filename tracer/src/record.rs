//! `gputrace record`: run a command (or attach to running processes), trace the NVIDIA driver
//! calls of it and its descendants, write the trace as it goes, and summarise at the end.

use std::io::{IsTerminal, Write as _};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::abi::{DriverVersion, Layout, NEWEST_KNOWN, OLDEST_KNOWN};
use crate::analysis::Phase;
use crate::decode::parse_record;
use crate::devices::Majors;
use crate::event::{Event, Record, Sample};
use crate::files::{KernelUpdate, ProcResolver};
use crate::gpus::Sampler;
use crate::mark::{Asked, MarkRequest, MarkServer, MAX_CONNECTIONS};
use crate::model::Model;
use crate::pipeline::Pipeline;
use crate::probe::{self, Probe};
use crate::procfs;
use crate::report::{FdFilter, Loss, Report};
use crate::signals::StopSignals;
use crate::trace::{Header, Writer, FORMAT, VERSION};
use crate::units::bytes;
use crate::user::User;
use crate::watch::Watcher;

pub struct Options {
    pub output: Option<PathBuf>,
    pub pids: Vec<u32>,
    pub all: bool,
    pub driver_version: Option<String>,
    pub raw: bool,
    pub json: bool,
    /// How long without activity makes a context a suspect holder.
    pub idle_ns: u64,
    pub command: Vec<String>,
    /// The gputrace command line, kept in the trace header.
    pub invocation: Vec<String>,
    /// Hide argument values and query strings (see [`crate::redact`]).
    pub redact: bool,
    /// Each GPU's capacity where NVML cannot tell it (no NVML, unified memory).
    pub capacity: Option<u64>,
    /// Also every process under this cgroup v2 directory, now and to come (`watch --cgroup`).
    pub cgroup: Option<PathBuf>,
    /// The eBPF programs' own diagnostics on stderr (`--kernel-log`).
    pub kernel_log: bool,
}

/// How often NVML and the host's memory are sampled into the trace.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);

/// The launched command's exit status, as a shell would report it.
pub struct Outcome {
    pub exit_code: i32,
}

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
pub(crate) fn check_running(pids: &[u32]) -> Result<()> {
    match pids.iter().find(|&&pid| procfs::stat(pid).is_none()) {
        Some(pid) => bail!("no process has pid {pid}: check it with `ps -p {pid}`"),
        None => Ok(()),
    }
}

pub fn run(opts: Options) -> Result<Outcome> {
    if opts.command.is_empty() && opts.pids.is_empty() && !opts.all {
        bail!("nothing to trace: give a command (`gputrace record -- CMD ARGS...`), --pid PID, or --all");
    }
    if let Some(program) = opts.command.first() {
        find_program(program)?;
    }
    check_running(&opts.pids)?;
    let path = opts.output.clone().unwrap_or_else(default_output);
    let exit_code = trace_into(&opts, |header, user| Ok(Sink::Trace { writer: Writer::create(&path, header, user)?, error: None }))?;
    Ok(Outcome { exit_code })
}

/// `gputrace watch`: every process, into the flight recorder `watcher` makes from the header.
pub fn watch(opts: Options, watcher: impl FnOnce(Header) -> Watcher) -> Result<()> {
    trace_into(&opts, |header, _| Ok(Sink::Watch(Box::new(watcher(header.clone())))))?;
    Ok(())
}

/// Loads the probes, traces what `opts` asks into the sink made from the header, and closes.
fn trace_into(opts: &Options, sink: impl FnOnce(&Header, Option<&User>) -> Result<Sink>) -> Result<i32> {
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
    let sink = sink(&header, user.as_ref())?;

    let cgroup = opts.cgroup.as_deref().map(open_cgroup).transpose()?;
    let selection = probe::Selection { trace_all: opts.all, cgroup: cgroup.as_ref(), majors, kernel_log: opts.kernel_log };
    let mut probe = Probe::load(&layout, selection, &kernel)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the event loop")?;
    let mut session = Session {
        pipeline: Pipeline::new(layout, ProcResolver, opts.raw, Some(std::process::id())),
        majors: (majors, Instant::now()),
        model: Model::new(),
        sink,
        records: 0,
        out: Vec::new(),
        updates: Vec::new(),
        lost_seen: 0,
        decode_errors: 0,
        redact: opts.redact,
        user,
    };
    session.pipeline.files.set_majors(majors);
    let exit_code = runtime.block_on(session.trace(&mut probe, opts))?;

    session.close(&probe, &header, opts)?;
    Ok(exit_code)
}

/// Where records go: a trace file, or the flight recorder of `watch`.
pub enum Sink {
    Trace {
        writer: Writer,
        /// Why the trace file stopped (a full disk): recording then only waits for the command.
        error: Option<String>,
    },
    Watch(Box<Watcher>),
}

struct Session {
    pipeline: Pipeline<ProcResolver>,
    model: Model,
    sink: Sink,
    records: u64,
    out: Vec<Record>,
    updates: Vec<KernelUpdate>,
    lost_seen: u64,
    /// Ring buffer records that did not parse (a mismatched kernel object).
    decode_errors: u64,
    redact: bool,
    /// NVIDIA's device numbers, and when they were last read.
    majors: (Option<Majors>, Instant),
    /// Who the command runs as, under sudo.
    user: Option<User>,
}

impl Session {
    /// Flushes the trace and prints the closing report (JSON on stdout with --json); a watch
    /// writes the dump waiting for its aftermath.
    fn close(&mut self, probe: &Probe, header: &Header, opts: &Options) -> Result<()> {
        let counters = probe.counters();
        let (writer, write_error) = match &mut self.sink {
            Sink::Watch(w) => {
                w.finish();
                return Ok(());
            }
            Sink::Trace { writer, error } => (writer, error),
        };
        if write_error.is_none() {
            if let Err(e) = writer.flush() {
                *write_error = Some(e.to_string());
            }
        }
        let loss = Loss {
            undecodable: self.model.undecodable + self.decode_errors,
            write_error: write_error.clone(),
            own_file_table: counters.own_file_table,
            ..Loss::of(&self.model)
        };
        let mut summary = Report::new(header, &self.model, writer.path().display().to_string(), writer.records, loss, opts.idle_ns);
        let filter = FdFilter {
            questions: counters.questions,
            pending_dropped: self.pipeline.files.pending_dropped,
            map_inserts_failed: counters.insert_failed,
            impostors: counters.impostors + self.pipeline.files.impostors,
        };
        if opts.json {
            summary.fd_filter = Some(filter);
            println!("{}", serde_json::to_string_pretty(&summary)?);
        } else {
            eprint!("{}", crate::units::for_terminal(&summary.text()));
            if filter.map_inserts_failed > 0 {
                eprintln!(
                "gputrace: warning: the kernel refused {} map inserts (a map was full): some fds or processes may not have been followed",
                filter.map_inserts_failed
            );
            }
            if filter.impostors > 0 {
                eprintln!(
                    "gputrace: warning: {} files at NVIDIA's paths were not NVIDIA's devices (another device number: a file mounted there in a namespace, or a followed fd reused for another file by a close no tracepoint sees, as io_uring's) and were not followed",
                    filter.impostors
                );
            }
            if filter.questions > 0 {
                eprintln!(
                    "{} fds were met without their open and asked about once each; {} of their ioctls were not NVIDIA and dropped.",
                    filter.questions, filter.pending_dropped
                );
            }
        }
        Ok(())
    }

    /// Into the model and the sink. A write error stops the trace loudly, once; the model (and
    /// so the closing report) goes on, and so does the command.
    fn emit(&mut self, mut record: Record) {
        if self.redact {
            crate::redact::record(&mut record);
        }
        self.model.apply(&record);
        self.records += 1;
        match &mut self.sink {
            Sink::Watch(w) => w.push(&record, &self.model),
            Sink::Trace { error: Some(_), .. } => {}
            Sink::Trace { writer, error } => {
                if let Err(e) = writer.write(&record) {
                    eprintln!("gputrace: error: {e}: the trace stops here; waiting for the command to finish");
                    *error = Some(e.to_string());
                }
            }
        }
    }

    fn emit_now(&mut self, pid: u32, event: Event) {
        let (_, ts) = clocks();
        self.emit(Record { ts, pid, tid: 0, event, raw: None })
    }

    /// A few times a second: the trace is flushed, or the flight recorder does its rounds.
    fn tick(&mut self) {
        match &mut self.sink {
            Sink::Watch(w) => w.tick(&mut self.model),
            Sink::Trace { error: Some(_), .. } => {}
            Sink::Trace { writer, error } => {
                if let Err(e) = writer.flush() {
                    eprintln!("gputrace: error: {e}: the trace stops here; waiting for the command to finish");
                    *error = Some(e.to_string());
                }
            }
        }
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

    fn apply_updates(&mut self, probe: &mut Probe) -> Result<()> {
        for update in self.updates.drain(..) {
            match update {
                KernelUpdate::SetFd { pid, fd, state } => probe.set_fd(pid, fd, state)?,
                KernelUpdate::ForgetFd { pid, fd } => probe.forget_fd(pid, fd),
                KernelUpdate::Traced { pid } => probe.trace_pid(pid)?,
            }
        }
        Ok(())
    }

    fn drain(&mut self, ring: &mut RingBuf<MapData>, probe: &mut Probe) -> Result<()> {
        while let Some(item) = ring.next() {
            match parse_record(&item) {
                Ok(raw) => self.pipeline.handle(raw, &mut self.out, &mut self.updates),
                Err(_) => self.decode_errors += 1,
            }
            drop(item);
            let records = std::mem::take(&mut self.out);
            for record in records {
                self.emit(record);
            }
            // Answers go to the kernel at once so the next ioctl on that fd is settled there.
            self.apply_updates(probe)?;
        }
        Ok(())
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
            let events = self.pipeline.files.scan(pid, &mut self.updates);
            // With --all, only the processes that hold NVIDIA files are worth a record now.
            if opts.all && events.len() == 1 {
                self.updates.clear();
                continue;
            }
            for event in events {
                self.emit_now(pid, event);
            }
            self.apply_updates(probe)?;
        }

        let what = if opts.all {
            "every process".to_string()
        } else if let Some(cgroup) = &opts.cgroup {
            format!("cgroup {}", cgroup.display())
        } else if opts.command.is_empty() {
            format!("pid {}", join(&opts.pids))
        } else {
            format!("`{}`", crate::units::one_line(&opts.command.join(" ")))
        };
        match &self.sink {
            Sink::Trace { writer, .. } => eprintln!("gputrace: tracing {what}, writing {} (Ctrl-C to stop)", writer.path().display()),
            Sink::Watch(_) => eprintln!("gputrace: tracing {what} (`gputrace dump` or SIGUSR1 for a dump now)"),
        }
        let child = match opts.command.is_empty() {
            true => None,
            false => Some(self.launch(probe, &opts.command)?),
        };

        // Launched, so nothing below needs to change identity or own files any more.
        let needs = crate::privileges::Needs {
            open_as_user: matches!(self.sink, Sink::Watch(_)) && self.user.is_some(),
            bind_low_port: matches!(&self.sink, Sink::Watch(w) if w.listen.is_some_and(|a| (1..1024).contains(&a.port()))),
        };
        if let Err(e) = crate::privileges::keep_only_what_recording_needs(needs) {
            eprintln!("gputrace: warning: could not drop the capabilities recording no longer needs: {e}");
        }
        Ok(child)
    }

    async fn trace(&mut self, probe: &mut Probe, opts: &Options) -> Result<i32> {
        let ring = probe.events.take().ok_or_else(|| anyhow!("the ring buffer was already taken"))?;
        // SAFETY: the ring buffer's fd stays open as long as the AsyncFd that owns it.
        let mut ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(|e| anyhow!("watching the ring buffer: {}", e.into_parts().1))?;
        let mut kernel_log = match probe.kernel_log.take() {
            // SAFETY: the log ring's fd stays open as long as the AsyncFd that owns the logger.
            Some(logger) => Some(
                unsafe { AsyncFd::register_with_interest(logger, Interest::READABLE) }
                    .map_err(|e| anyhow!("watching the kernel's log: {}", e.into_parts().1))?,
            ),
            None => None,
        };

        // Before anything is launched: a stop signal from then on reaches the command.
        let stops = StopSignals::install()?;
        // Listening before the command starts: a mark it sends at once is not refused.
        let invoking_uid = Some(self.user.as_ref().map_or(0, |u| u.uid));
        let marks = MarkServer::open(std::process::id(), invoking_uid);
        // A watch dumps on SIGUSR1, from before it says it is tracing (the signal's default would
        // end it); elsewhere SIGUSR1 keeps its default meaning.
        let mut dump_asks = match self.sink {
            Sink::Watch(_) => {
                Some(tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1()).context("listening for SIGUSR1")?)
            }
            Sink::Trace { .. } => None,
        };
        // A watch serves /metrics, /report and /healthz where asked, from before it says it is
        // tracing; a port someone else holds is asked for again on the tick.
        let (http_tx, mut http_rx) = tokio::sync::mpsc::channel::<crate::http::Request>(crate::http::MAX_CONNECTIONS);
        let mut http = crate::http::Endpoint::new(match &self.sink {
            Sink::Watch(w) => w.listen,
            Sink::Trace { .. } => None,
        });
        http.bind_when_due();
        let mut child = self.begin(probe, opts)?;
        let (mark_tx, mut mark_rx) = tokio::sync::mpsc::channel::<MarkRequest>(MAX_CONNECTIONS);
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        // NVML and /proc/meminfo on a thread of their own: a slow NVML call never holds up events.
        let (sample_tx, mut sample_rx) = tokio::sync::mpsc::channel::<Sample>(4);
        std::thread::Builder::new()
            .name("gputrace-sampler".into())
            .spawn(move || {
                let mut sampler = Sampler::new();
                while sample_tx.blocking_send(sampler.sample()).is_ok() {
                    std::thread::sleep(SAMPLE_EVERY);
                }
            })
            .context("starting the sampler thread")?;
        // A watch logs in lines (journald, a terminal alike); a recording shows a status line.
        let status_line = std::io::stderr().is_terminal() && !opts.json && matches!(self.sink, Sink::Trace { .. });
        let mut last_status = Instant::now();
        // Attached with --pid and nothing launched: done when every attached process is gone.
        let mut attached: Vec<u32> = if child.is_none() && !opts.all { opts.pids.clone() } else { Vec::new() };
        let mut signals_to_command = 0;
        let exit_code;
        loop {
            tokio::select! {
                guard = ring.readable_mut() => {
                    let mut guard = guard.context("waiting for kernel events")?;
                    self.drain(guard.get_inner_mut(), probe)?;
                    guard.clear_ready();
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
                    self.drain(ring.get_mut(), probe)?;
                    if let Sink::Watch(w) = &mut self.sink {
                        w.kernel_counters(probe.counters());
                    }
                    self.tick();
                    self.check_lost(probe);
                    self.read_majors_again(probe)?;
                    http.bind_when_due();
                    if !attached.is_empty() {
                        attached.retain(|&pid| procfs::running(pid));
                        if attached.is_empty() {
                            exit_code = 0;
                            break;
                        }
                    }
                    if status_line && last_status.elapsed() >= Duration::from_millis(250) {
                        last_status = Instant::now();
                        self.status_line();
                    }
                }
                status = async { child.as_mut().map(|(c, _)| c.wait()).unwrap().await }, if child.is_some() => {
                    let status = status.context("waiting for the command")?;
                    exit_code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
                    let (_, pid) = child.take().unwrap();
                    // The kernel's exit record is already in the ring buffer: read it first.
                    self.drain(ring.get_mut(), probe)?;
                    self.emit_now(pid, Event::Exit { code: Some(exit_code) });
                    break;
                }
                _ = async { marks.as_ref().unwrap().accept(&mark_tx).await }, if marks.is_some() => {}
                // Questions are answered on everything the kernel has recorded so far, not on
                // what the last wake-up brought (escapes wait for a batch or the tick).
                Some(request) = mark_rx.recv() => {
                    self.drain(ring.get_mut(), probe)?;
                    let answer = match (request.asked, &mut self.sink) {
                        (Asked::Mark { phase, pid }, _) => self.mark(phase, pid),
                        (Asked::Dump, Sink::Watch(w)) => format!("OK {}", w.ask()),
                        (Asked::Dump, Sink::Trace { .. }) => "ERR this is a recording, not a watch: it writes its trace as it goes".into(),
                    };
                    let _ = request.reply.send(answer);
                }
                Some(sample) = sample_rx.recv() => self.emit_now(0, Event::Sample(sample)),
                _ = async { http.server.as_ref().unwrap().accept(&http_tx).await }, if http.server.is_some() => {}
                Some(request) = http_rx.recv() => {
                    self.drain(ring.get_mut(), probe)?;
                    if let Sink::Watch(w) = &self.sink {
                        let _ = request.reply.send(w.respond(request.route, request.peer_uid, &self.model));
                    }
                }
                Some(()) = async { dump_asks.as_mut().unwrap().recv().await }, if dump_asks.is_some() => {
                    self.drain(ring.get_mut(), probe)?;
                    if let Sink::Watch(w) = &mut self.sink {
                        w.ask();
                    }
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
        self.drain(ring.get_mut(), probe)?;
        self.check_lost(probe);
        if let Some(logger) = kernel_log.as_mut() {
            flush_kernel_log(logger.get_mut());
        }
        if status_line {
            eprint!("\r\x1b[2K");
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

    fn status_line(&self) {
        let mut line = format!("gputrace: {} events", self.records);
        let mut top: Vec<_> = self.model.processes.values().filter(|p| p.usage.physical_live() > 0).collect();
        top.sort_by_key(|p| std::cmp::Reverse(p.usage.physical_live()));
        for p in top.iter().take(3) {
            let name = p.command.first().map(|c| c.rsplit('/').next().unwrap_or(c)).unwrap_or("?");
            line += &format!(" · {} {}: {}", p.pid, crate::units::one_line(name), bytes(p.usage.physical_live()));
        }
        if self.model.lost_records > 0 {
            line += &format!(" · LOST {}", self.model.lost_records);
        }
        let width = terminal_width();
        let line: String = crate::units::for_terminal(&line).chars().take(width.saturating_sub(1)).collect();
        eprint!("\r\x1b[2K{line}");
        let _ = std::io::stderr().flush();
    }
}

fn terminal_width() -> usize {
    // SAFETY: TIOCGWINSZ fills a winsize struct.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::ioctl(2, libc::TIOCGWINSZ, &mut ws) } == 0;
    if ok && ws.ws_col > 0 {
        ws.ws_col as usize
    } else {
        100
    }
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
        holders_at_start: crate::files::nvidia_holders(majors),
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

fn default_output() -> PathBuf {
    // SAFETY: localtime_r fills a tm from a time_t.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let now = unsafe { libc::time(std::ptr::null_mut()) };
    unsafe { libc::localtime_r(&now, &mut tm) };
    PathBuf::from(format!(
        "gputrace-{:04}{:02}{:02}-{:02}{:02}{:02}.trace",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    ))
}

fn join(pids: &[u32]) -> String {
    pids.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")
}
