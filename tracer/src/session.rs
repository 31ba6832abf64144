//! One tracing session, whatever asked for it: loads the probes, attaches to what was asked,
//! launches the command, and runs the one loop that reads the kernel, decodes, names files and
//! feeds the model, handing each record to a [`Sink`]. It knows no subcommand: `record` is a
//! sink that writes a trace file and prints its summary, `watch` one that keeps a flight
//! recorder and answers its own asks (HTTP, SIGUSR1); each is its own module, above this one.

use std::future::Future;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _, Result};
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::{AsyncFd, AsyncFdReadyMutGuard};
use tokio::sync::mpsc::{Receiver, Sender};

use crate::analysis::Phase;
use crate::devices::Majors;
use crate::event::{Event, Record, Sample};
use crate::files::{KernelUpdate, ProcResolver};
use crate::mark::{Asked, MarkRequest, MarkServer, MAX_CONNECTIONS};
use crate::model::Model;
use crate::pipeline::Pipeline;
use crate::privileges::Needs;
use crate::probe::{self, Counters, KernelLogRing, Probe};
use crate::procfs;
use crate::signals::{Delivered, StopSignals};
use crate::startup;
use crate::trace::{clocks, Header};
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

/// Records taken from the ring buffer between two yields to the other tasks.
const DRAIN_BATCH: u64 = 256;
/// How long the ring buffer is read before the loop looks at anything else (a stop signal, a
/// question, the tick).
const DRAIN_FOR: Duration = Duration::from_millis(50);

/// Loads the probes, traces what `opts` asks into the sink made from the header, and closes
/// it. The exit status of the launched command (0 without one).
pub fn run<S: Sink>(opts: &Options, sink: impl FnOnce(&Header, Option<&User>) -> Result<S>) -> Result<i32> {
    if let Some(program) = opts.command.first() {
        startup::find_program(program)?;
    }
    startup::check_running(&opts.pids)?;
    let user = User::invoking()?;
    let kernel = probe::preflight()?;
    startup::raise_fd_limit();
    let (version, source) = startup::driver_version(opts.driver_version.as_deref())?;
    let layout = startup::layout_for(version);
    let majors = Majors::of_host()?;

    let mut header = startup::header(&opts.invocation, opts.raw, version, source, majors);
    if let Some(bytes) = opts.capacity {
        header.assume_capacity(bytes);
    }
    if opts.redact {
        crate::redact::header(&mut header);
    }
    let cgroup = opts.cgroup.as_deref().map(startup::open_cgroup).transpose()?;
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
                    if !procfs::net::blocked_reads(pid).contains(&(tid, fd, buf)) {
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

    /// The loop: each input, as it comes, to its own handler, until the command exits, the
    /// attached processes are gone or a stop signal ends it; then what the kernel still holds.
    async fn trace(&mut self, probe: &mut Probe, opts: &Options) -> Result<i32> {
        let (ring, kernel_log) = probe::rings(probe)?;
        // Before anything is launched: a stop signal from then on reaches the command.
        let stops = StopSignals::install()?;
        // Listening before the command starts: a mark it sends at once is not refused.
        let invoking_uid = Some(self.user.as_ref().map_or(0, |u| u.uid));
        let marks = MarkServer::open(std::process::id(), invoking_uid);
        // What the sink listens to is set up before it is said that tracing began.
        self.sink.start()?;
        let child = self.begin(probe, opts)?;
        let (mark_tx, mark_rx) = tokio::sync::mpsc::channel::<MarkRequest>(MAX_CONNECTIONS);
        // A whole host's proxies where the whole host is traced; else (a command, pids, a
        // cgroup) only the invoking user's own: other users' configs stay out of their trace.
        let proxy_owner = if opts.all { None } else { Some(self.user.as_ref().map_or(0, |u| u.uid)) };
        let mut inputs = Inputs {
            ring,
            kernel_log,
            tick: tokio::time::interval(Duration::from_millis(100)),
            attached: if child.is_none() && !opts.all { opts.pids.clone() } else { Vec::new() },
            child,
            marks,
            mark_tx,
            mark_rx,
            samples: crate::gpus::sampler()?,
            proxies: crate::litellm::scanner(proxy_owner)?,
            stops,
            signals_to_command: 0,
        };
        let exit_code = loop {
            let input = match inputs.next(&mut self.sink).await? {
                Wake::Kernel(mut guard) => {
                    // Stopped at the bound, it stays ready: the loop comes back to it.
                    if !self.drain(guard.get_inner_mut(), probe).await {
                        guard.clear_ready();
                    }
                    continue;
                }
                Wake::Input(input) => input,
                Wake::Done => continue,
            };
            if let Some(code) = self.on(input, &mut inputs, probe).await? {
                break code;
            }
        };
        self.drain(inputs.ring.get_mut(), probe).await;
        self.check_lost(probe);
        if let Some(logger) = inputs.kernel_log.as_mut() {
            probe::flush_kernel_log(logger.get_mut());
        }
        Ok(exit_code)
    }

    /// One input; the exit status when it ends the loop.
    async fn on(&mut self, input: Input<S::Ask>, inputs: &mut Inputs, probe: &mut Probe) -> Result<Option<i32>> {
        match input {
            Input::Tick => return self.on_tick(inputs, probe).await,
            Input::CommandExited(status) => {
                let status = status.context("waiting for the command")?;
                let exit_code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
                let pid = inputs.child.take().map_or(0, |(_, pid)| pid);
                // The kernel's exit record is already in the ring buffer: read it first.
                self.drain(inputs.ring.get_mut(), probe).await;
                self.emit_now(pid, Event::Exit { code: Some(exit_code) });
                return Ok(Some(exit_code));
            }
            // Questions (the recorder socket's, and the sink's own: a watch's HTTP requests,
            // SIGUSR1) are answered on everything the kernel has recorded so far, not on what
            // the last wake-up brought (escapes wait for a batch or the tick).
            Input::Question(question) => {
                self.drain(inputs.ring.get_mut(), probe).await;
                self.answer(question);
            }
            Input::Sample(ts, sample) => self.emit(Record::new(ts, 0, 0, Event::Sample(sample))),
            Input::Proxy(proxy) => {
                let (uid, command, config, deployments, workers) =
                    (proxy.uid, proxy.command, proxy.config, proxy.deployments, proxy.workers);
                self.emit_now(proxy.pid, Event::Proxy { uid, command, config, deployments, workers });
            }
            Input::Stop(stop) => {
                let command = inputs.child.as_ref().map(|(_, pid)| *pid);
                match after_stop(stop, command, &mut inputs.signals_to_command) {
                    AfterStop::End(code) => return Ok(Some(code)),
                    AfterStop::Forward(pid) => {
                        // SAFETY: kill(2) on the command this recorder started and has not reaped.
                        unsafe { libc::kill(pid as libc::pid_t, stop.signal) };
                    }
                    AfterStop::Wait => {}
                }
            }
        }
        Ok(None)
    }

    /// A few times a second: what the kernel holds (it wakes the loop only once a batch of
    /// escapes has built up), the sink's tick, records lost, NVIDIA's device numbers; done when
    /// every attached process is gone.
    async fn on_tick(&mut self, inputs: &mut Inputs, probe: &mut Probe) -> Result<Option<i32>> {
        self.drain(inputs.ring.get_mut(), probe).await;
        self.sink.tick(&mut self.model, &probe.counters());
        self.check_lost(probe);
        self.read_majors_again(probe)?;
        if !inputs.attached.is_empty() {
            inputs.attached.retain(|&pid| procfs::running(pid));
            if inputs.attached.is_empty() {
                return Ok(Some(0));
            }
        }
        Ok(None)
    }

    /// A question on the recorder's socket (a mark, a dump) or the sink's own.
    fn answer(&mut self, question: Question<S::Ask>) {
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

/// What the event loop waits on: the kernel's ring buffer and log, the tick, the command, the
/// recorder's socket and the sink's asks, NVML's samples, the proxies found, stop signals.
struct Inputs {
    ring: AsyncFd<RingBuf<MapData>>,
    kernel_log: Option<KernelLogRing>,
    tick: tokio::time::Interval,
    child: Option<(tokio::process::Child, u32)>,
    marks: Option<MarkServer>,
    mark_tx: Sender<MarkRequest>,
    mark_rx: Receiver<MarkRequest>,
    samples: Receiver<(u64, Sample)>,
    proxies: Receiver<crate::litellm::Proxy>,
    stops: StopSignals,
    /// Attached with --pid and nothing launched: done when every attached process is gone.
    attached: Vec<u32>,
    /// Stop signals passed on to the command so far.
    signals_to_command: u32,
}

/// What woke the loop: the ring buffer (read through its guard, which says whether it stays
/// ready), an input, or something taken care of already (the kernel's log printed, a
/// connection to the recorder's socket taken).
enum Wake<'r, A> {
    Kernel(AsyncFdReadyMutGuard<'r, RingBuf<MapData>>),
    Input(Input<A>),
    Done,
}

enum Input<A> {
    Tick,
    CommandExited(std::io::Result<std::process::ExitStatus>),
    Question(Question<A>),
    Sample(u64, Sample),
    Proxy(crate::litellm::Proxy),
    Stop(Delivered),
}

impl Inputs {
    /// What wakes the loop next. The kernel's log is printed as it comes, and the recorder's
    /// socket takes its connections, on the way.
    async fn next<S: Sink>(&mut self, sink: &mut S) -> Result<Wake<'_, S::Ask>> {
        let Inputs { ring, kernel_log, tick, child, marks, mark_tx, mark_rx, samples, proxies, stops, .. } = self;
        Ok(tokio::select! {
            guard = ring.readable_mut() => Wake::Kernel(guard.context("waiting for kernel events")?),
            guard = async { kernel_log.as_mut().unwrap().readable_mut().await }, if kernel_log.is_some() => {
                let mut guard = guard.context("waiting for the kernel's log")?;
                // aya-log panics on a record it cannot parse: the log stops, recording goes on.
                let parsed = probe::flush_kernel_log(guard.get_inner_mut());
                guard.clear_ready();
                if !parsed {
                    *kernel_log = None;
                }
                Wake::Done
            }
            _ = tick.tick() => Wake::Input(Input::Tick),
            status = async { child.as_mut().map(|(c, _)| c.wait()).unwrap().await }, if child.is_some() => {
                Wake::Input(Input::CommandExited(status))
            }
            _ = async { marks.as_ref().unwrap().accept(mark_tx).await }, if marks.is_some() => Wake::Done,
            question = next_question(mark_rx, sink) => Wake::Input(Input::Question(question)),
            Some((ts, sample)) = samples.recv() => Wake::Input(Input::Sample(ts, sample)),
            Some(proxy) = proxies.recv() => Wake::Input(Input::Proxy(proxy)),
            stop = stops.next() => Wake::Input(Input::Stop(stop?)),
        })
    }
}

/// What a stop signal does.
#[derive(Debug, PartialEq, Eq)]
enum AfterStop {
    /// Recording ends, with this exit status.
    End(i32),
    /// The command gets it too.
    Forward(u32),
    /// The command got it already: recording ends with the command.
    Wait,
}

/// A stop signal, with the command running as `command` (if one was launched) and the signals
/// passed on to it so far: without a command recording ends; with one the signal is passed on
/// (unless it already got it) and recording ends with the command; a third signal stops waiting.
fn after_stop(stop: Delivered, command: Option<u32>, signals_to_command: &mut u32) -> AfterStop {
    let Some(pid) = command else { return AfterStop::End(stop.exit_code()) };
    *signals_to_command += 1;
    if *signals_to_command >= 3 {
        eprintln!("gputrace: pid {pid} has not exited after 3 signals; recording stops and it runs on untraced");
        return AfterStop::End(stop.exit_code());
    }
    if stop.to_forward(pid) {
        AfterStop::Forward(pid)
    } else {
        AfterStop::Wait
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
async fn next_question<S: Sink>(socket: &mut Receiver<MarkRequest>, sink: &mut S) -> Question<S::Ask> {
    tokio::select! {
        Some(request) = socket.recv() => Question::Socket(request),
        ask = sink.ask() => Question::Sink(ask),
    }
}

fn join(pids: &[u32]) -> String {
    pids.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what it is given; asked nothing.
    #[derive(Default)]
    struct Collected(Vec<Record>);

    impl Sink for Collected {
        type Ask = ();
        fn destination(&self) -> String {
            String::new()
        }
        fn needs(&self, _: bool) -> Needs {
            Needs::default()
        }
        fn push(&mut self, record: &Record, _: &Model) {
            self.0.push(record.clone());
        }
        fn tick(&mut self, _: &mut Model, _: &Counters) {}
        fn ask(&mut self) -> impl Future<Output = ()> {
            std::future::pending()
        }
        fn answer(&mut self, (): (), _: &Model) {}
        fn dump(&mut self) -> Result<String, String> {
            Err("a test".into())
        }
        fn close(&mut self, _: &End) -> Result<()> {
            Ok(())
        }
    }

    fn session() -> Session<Collected> {
        Session {
            pipeline: Pipeline::new(crate::abi::Layout::for_version(crate::abi::NEWEST_KNOWN), ProcResolver, false, None),
            model: Model::new(),
            sink: Collected::default(),
            out: Vec::new(),
            updates: Vec::new(),
            lost_seen: 0,
            redact: false,
            majors: (None, Instant::now()),
            user: None,
        }
    }

    /// A mark names a traced process that still runs: recorded for it, refused otherwise.
    #[test]
    fn a_mark_is_recorded_only_for_a_traced_process_that_runs() {
        let mut s = session();
        assert_eq!(s.mark(Phase::Prefill, 7), "ERR pid 7 is not traced by this recorder");
        s.emit(Record::new(1, 7, 7, Event::Process { ppid: 1, seen: crate::event::Seen::Running, command: vec!["server".into()] }));
        assert_eq!(s.mark(Phase::Prefill, 7), "OK");
        let marked = s.sink.0.iter().filter(|r| matches!(&r.event, Event::Mark { phase } if phase == "prefill")).count();
        assert_eq!(marked, 1, "{:?}", s.sink.0);
        s.emit(Record::new(2, 7, 7, Event::Exit { code: Some(0) }));
        assert!(s.mark(Phase::Idle, 7).starts_with("ERR pid 7 has exited"));
        assert_eq!(s.model.marks.len(), 1, "the refused marks are not in the model");
    }

    /// A mark and a dump on the recorder's socket are answered on it; a recording has no dump.
    #[test]
    fn a_question_on_the_socket_is_answered_there() {
        let mut s = session();
        let (reply, answer) = tokio::sync::oneshot::channel();
        s.answer(Question::Socket(MarkRequest { asked: Asked::Dump, reply }));
        assert_eq!(answer.blocking_recv().unwrap(), "ERR a test");
    }

    /// Without a command a stop signal ends recording; with one it is passed on, unless the
    /// command got it already, and the third ends recording whatever the command does.
    #[test]
    fn stop_signals_reach_the_command_and_the_third_ends_recording() {
        let kill = |sender| Delivered { signal: libc::SIGTERM, code: libc::SI_USER, sender };
        let terminal = Delivered { signal: libc::SIGINT, code: libc::SI_KERNEL, sender: 0 };
        let mut passed = 0;
        assert_eq!(after_stop(kill(1), None, &mut passed), AfterStop::End(128 + libc::SIGTERM));
        assert_eq!(after_stop(kill(1), Some(40), &mut passed), AfterStop::Forward(40));
        assert_eq!(after_stop(terminal, Some(40), &mut passed), AfterStop::Wait, "the terminal sent it to the whole group");
        assert_eq!(after_stop(kill(40), Some(40), &mut passed), AfterStop::End(128 + libc::SIGTERM), "the third");
        assert_eq!(passed, 3);
    }
}
