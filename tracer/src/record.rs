//! `gputrace record`: run a command (or attach to running processes), trace the NVIDIA driver
//! calls of it and its descendants, write the trace as it goes, and summarise at the end. A
//! [`crate::session`] into a trace file.

use std::io::{IsTerminal, Write as _};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::analysis::accounts::Accounts;
use crate::analysis::headroom::headroom;
use crate::model::Model;
use crate::privileges::Needs;
use crate::probe::Counters;
use crate::report::{FdFilter, Loss, Report};
use crate::session::{End, Sink};
use crate::trace::{Header, Writer};

pub struct Options {
    /// What to trace.
    pub session: crate::session::Options,
    pub output: Option<PathBuf>,
    /// The closing report as JSON on stdout.
    pub json: bool,
    /// How long without activity makes a context a suspect holder.
    pub idle_ns: u64,
}

/// The launched command's exit status, as a shell would report it.
pub struct Outcome {
    pub exit_code: i32,
}

pub fn run(opts: Options) -> Result<Outcome> {
    let s = &opts.session;
    if s.command.is_empty() && s.pids.is_empty() && !s.all {
        bail!("nothing to trace: give a command (`gputrace record -- CMD ARGS...`), --pid PID, or --all");
    }
    let path = opts.output.clone().unwrap_or_else(default_output);
    let exit_code = crate::session::run(s, |header, user| {
        Ok(TraceFile {
            writer: Writer::create(&path, header, user)?,
            error: None,
            json: opts.json,
            idle_ns: opts.idle_ns,
            // A recording on a terminal shows a status line; a watch logs in lines.
            status_line: std::io::stderr().is_terminal() && !opts.json,
            last_status: Instant::now(),
            header: header.clone(),
            headroom: (Instant::now() + HEADROOM_EVERY, None),
        })
    })?;
    Ok(Outcome { exit_code })
}

/// The trace file, and the summary printed at the end.
struct TraceFile {
    writer: Writer,
    /// Why the trace file stopped (a full disk): recording then only waits for the command.
    error: Option<String>,
    json: bool,
    idle_ns: u64,
    status_line: bool,
    last_status: Instant,
    header: Header,
    /// The tightest service's headroom on the status line, and when to compute it again.
    headroom: (Instant, Option<String>),
}

/// How often the status line's headroom is computed again (a pass over the allocations, on the
/// loop that drains the kernel): every 5 s, or 20 times as long as it last took, whichever is
/// longer, so a long recording's growing model never keeps the loop busy.
const HEADROOM_EVERY: Duration = Duration::from_secs(5);

impl TraceFile {
    /// A write error stops the trace loudly, once; the model (and so the closing report) goes
    /// on, and so does the command.
    fn stop_on(&mut self, result: Result<(), crate::trace::TraceError>) {
        if let Err(e) = result {
            eprintln!("gputrace: error: {e}: the trace stops here; waiting for the command to finish");
            self.error = Some(e.to_string());
        }
    }

    fn status_line(&self, model: &Model) {
        let line = crate::report::status::line(self.writer.records, model, self.headroom.1.as_deref());
        let width = terminal_width();
        let line: String = crate::units::for_terminal(&line).chars().take(width.saturating_sub(1)).collect();
        eprint!("\r\x1b[2K{line}");
        let _ = std::io::stderr().flush();
    }
}

impl Sink for TraceFile {
    /// A recording is asked nothing but marks, which the session answers.
    type Ask = ();

    fn destination(&self) -> String {
        format!(", writing {} (Ctrl-C to stop)", self.writer.path().display())
    }

    fn needs(&self, _sudo: bool) -> Needs {
        Needs::default()
    }

    fn push(&mut self, record: &crate::event::Record, _: &Model) {
        if self.error.is_none() {
            let written = self.writer.write(record);
            self.stop_on(written);
        }
    }

    fn tick(&mut self, model: &mut Model, _: &Counters) {
        if self.error.is_none() {
            let flushed = self.writer.flush();
            self.stop_on(flushed);
        }
        if self.status_line && self.last_status.elapsed() >= Duration::from_millis(250) {
            self.last_status = Instant::now();
            if Instant::now() >= self.headroom.0 {
                let began = Instant::now();
                let shown = crate::report::status::headroom(&headroom(&Accounts::new(&self.header, model)));
                self.headroom = (Instant::now() + HEADROOM_EVERY.max(began.elapsed() * 20), shown);
            }
            self.status_line(model);
        }
    }

    fn ask(&mut self) -> impl std::future::Future<Output = ()> {
        std::future::pending()
    }

    fn answer(&mut self, (): (), _: &Model) {}

    fn dump(&mut self) -> Result<String, String> {
        Err("this is a recording, not a watch: it writes its trace as it goes".into())
    }

    /// Flushes the trace and prints the closing report (JSON on stdout with --json).
    fn close(&mut self, end: &End) -> Result<()> {
        if self.status_line {
            eprint!("\r\x1b[2K");
        }
        if self.error.is_none() {
            let flushed = self.writer.flush();
            self.stop_on(flushed);
        }
        let counters = &end.counters;
        let loss = Loss {
            undecodable: end.model.undecodable + end.decode_errors,
            write_error: self.error.clone(),
            own_file_table: counters.own_file_table,
            ..Loss::of(end.model)
        };
        let path = self.writer.path().display().to_string();
        let mut summary = Report::new(end.header, end.model, path, self.writer.records, loss, self.idle_ns);
        let filter = FdFilter {
            questions: counters.questions,
            pending_dropped: end.pending_dropped,
            map_inserts_failed: counters.insert_failed,
            impostors: counters.impostors + end.impostors,
            calls_in_map: counters.calls_in_map,
        };
        if self.json {
            summary.fd_filter = Some(filter);
            // A reader gone (`| head`) leaves the trace written: nothing more to say.
            let mut out = std::io::stdout().lock();
            return match writeln!(out, "{}", serde_json::to_string_pretty(&summary)?) {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                done => Ok(done?),
            };
        }
        eprint!("{}", summary.for_terminal(crate::report::colour_wanted(std::io::stderr().is_terminal())));
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
        Ok(())
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
