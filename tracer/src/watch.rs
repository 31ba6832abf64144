//! `gputrace watch`: every process's NVIDIA calls, indefinitely, in bounded memory (see
//! [`crate::flight`]); when an allocation fails, the OOM killer strikes or someone asks, the
//! window around it goes to a dump file with its report beside it, and one line says where and
//! what the verdict was.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::mpsc;

use crate::dir::Dir;
use crate::event::Event;
use crate::flight::{Config, Dump, Flight, Trigger};
use crate::http::{Endpoint, Response, Route};
use crate::model::{display_command, Model};
use crate::privileges::Needs;
use crate::probe::Counters;
use crate::report::{Loss, Report};
use crate::session::{clocks, End, Sink};
use crate::trace::{Header, Writer};
use crate::units::bytes;
use crate::user::{as_user, User};

pub struct Options {
    /// What to trace: every process, those of `--pid` or of a cgroup.
    pub session: crate::session::Options,
    pub dump_dir: PathBuf,
    pub window: Duration,
    pub window_bytes: u64,
    pub budget: u64,
    pub aftermath: Duration,
    pub min_interval: Duration,
    pub idle_ns: u64,
    /// Where /metrics, /report and /healthz are served; None: nowhere.
    pub listen: Option<SocketAddr>,
}

/// Watches until SIGTERM or SIGINT; a dump waiting for its aftermath is written first.
pub fn run(mut opts: Options) -> Result<()> {
    let user = User::invoking()?;
    // Held open from here on: every dump is written, renamed and rotated relative to it.
    let dir = Arc::new(Dir::for_dumps(&opts.dump_dir, user.as_ref()).map_err(anyhow::Error::msg)?);
    let config = Config {
        window_ns: opts.window.as_nanos().min(u128::from(u64::MAX)) as u64,
        max_bytes: usize::try_from(opts.window_bytes).unwrap_or(usize::MAX),
        aftermath_ns: opts.aftermath.as_nanos().min(u128::from(u64::MAX)) as u64,
        min_interval_ns: opts.min_interval.as_nanos().min(u128::from(u64::MAX)) as u64,
    };
    let s = &mut opts.session;
    s.all = s.pids.is_empty() && s.cgroup.is_none();
    let what = if let Some(cgroup) = &s.cgroup {
        format!("the processes of cgroup {}", cgroup.display())
    } else if s.pids.is_empty() {
        "every process".to_string()
    } else {
        format!("pid {} and its children", s.pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", "))
    };
    eprintln!(
        "gputrace: watching {what}; dumps go to {} (window {}s or {}, budget {})",
        opts.dump_dir.display(),
        opts.window.as_secs(),
        bytes(opts.window_bytes),
        bytes(opts.budget)
    );
    crate::session::run(&opts.session, |header, _| {
        let mut w = Watcher::new(config, dir.clone(), header.clone(), opts.listen);
        (w.budget, w.user, w.idle_ns) = (opts.budget, user.clone(), opts.idle_ns);
        Ok(w)
    })?;
    Ok(())
}

/// The flight recorder a watch's session hands its records to, the dumps it writes, and what it
/// answers: HTTP (`--listen`), SIGUSR1 and `DUMP` on the recorder's socket.
pub struct Watcher {
    flight: Flight,
    dir: Arc<Dir>,
    budget: u64,
    header: Header,
    user: Option<User>,
    idle_ns: u64,
    /// Dumps being written off the event loop.
    writing: Vec<std::thread::JoinHandle<()>>,
    http: Endpoint,
    http_tx: mpsc::Sender<crate::http::Request>,
    http_rx: mpsc::Receiver<crate::http::Request>,
    /// SIGUSR1, from the start of the session (its default would end the watch).
    dump_asks: Option<Signal>,
    /// The verdicts of the dumps written, by category (for /metrics).
    diagnoses: Arc<Mutex<BTreeMap<String, u64>>>,
    /// fd events the kernel side counted and did not follow since watching began (threads with
    /// a file table of their own): every report says so.
    own_file_table: u64,
    /// Servers' limits found to let in more requests than memory takes: each said once in the
    /// log. Checked once a request sent data (its prefill, what it costs, is over), at most
    /// every LIMITS_EVERY_NS (each check reads the whole live model): when the last check was,
    /// and whether one is due.
    limits_warned: HashSet<(String, String, u64)>,
    limits_checked: (u64, bool),
    /// The last /metrics body and when it was made: anyone may ask, as often as they like, and
    /// each one made reads the whole live model on the event loop.
    metrics: Option<(Instant, String)>,
}

/// How long a /metrics body is served again before it is made anew: scrapers see the state of
/// at most this long ago, and a user asking in a loop costs the event loop one making a second.
const METRICS_FRESH: Duration = Duration::from_secs(1);

const LIMITS_EVERY_NS: u64 = 10_000_000_000;

impl Watcher {
    /// Dumps unbudgeted, as root, no context ever idle: `run` sets those from the options.
    fn new(config: Config, dir: Arc<Dir>, header: Header, listen: Option<SocketAddr>) -> Watcher {
        let (http_tx, http_rx) = tokio::sync::mpsc::channel(crate::http::MAX_CONNECTIONS);
        Watcher {
            flight: Flight::new(config),
            dir,
            budget: 0,
            header,
            user: None,
            idle_ns: u64::MAX,
            writing: Vec::new(),
            http: Endpoint::new(listen),
            http_tx,
            http_rx,
            dump_asks: None,
            diagnoses: Arc::default(),
            own_file_table: 0,
            limits_warned: HashSet::new(),
            limits_checked: (0, false),
            metrics: None,
        }
    }

    /// A server whose own concurrency limit lets in more requests than memory takes, said once
    /// (the early form of a concurrent-load failure).
    fn warn_of_limits(&mut self, live: &Model) {
        for h in crate::analysis::diagnosis::Diagnoser::new(&self.header, live, 0).headroom() {
            let mut fresh = h.limits_exceeded.iter().map(|l| (h.service.clone(), l.setting.clone(), l.value));
            let warned = &mut self.limits_warned;
            if fresh.any(|key| warned.len() < MAX_LIMITS_WARNED && warned.insert(key)) {
                eprintln!("gputrace: warning: {}", h.text());
            }
        }
    }
}

/// Limit warnings remembered (and said) at most: a host of many servers says the first ones.
const MAX_LIMITS_WARNED: usize = 1000;

/// What a watch is asked besides the kernel's events.
pub enum Ask {
    Http(crate::http::Request),
    /// SIGUSR1.
    Dump,
}

impl Sink for Watcher {
    type Ask = Ask;

    fn start(&mut self) -> Result<()> {
        self.dump_asks = Some(signal(SignalKind::user_defined1()).context("listening for SIGUSR1")?);
        self.http.bind_when_due(&self.http_tx);
        Ok(())
    }

    fn destination(&self) -> String {
        " (`gputrace dump` or SIGUSR1 for a dump now)".into()
    }

    /// Under sudo, dumps are created as the user; a port below 1024 is bound again if it was
    /// taken at start.
    fn needs(&self, sudo: bool) -> Needs {
        Needs { open_as_user: sudo, bind_low_port: self.http.port().is_some_and(|p| (1..1024).contains(&p)) }
    }

    fn push(&mut self, record: &crate::event::Record, live: &Model) {
        if matches!(record.event, Event::Sent { data: true, .. }) {
            self.limits_checked.1 = true;
        }
        self.flight.push(record, live);
    }

    /// A dump whose aftermath is over is written (on a thread of its own), the models are
    /// compacted when due (the live one is replaced), and a port not had yet is asked for.
    fn tick(&mut self, live: &mut Model, counters: &Counters) {
        self.own_file_table = counters.own_file_table;
        let (_, now) = clocks();
        if let Some(dump) = self.flight.take_dump(Some(now)) {
            let job = self.job(dump);
            match std::thread::Builder::new().name("gputrace-dump".into()).spawn(move || job.run()) {
                Ok(handle) => self.writing.push(handle),
                Err(e) => eprintln!("gputrace: error: cannot start writing a dump: {e}"),
            }
        }
        self.writing.retain(|h| !h.is_finished());
        if self.limits_checked.1 && now >= self.limits_checked.0.saturating_add(LIMITS_EVERY_NS) {
            self.limits_checked = (now, false);
            self.warn_of_limits(live);
        }
        self.flight.compact(now, live);
        self.http.bind_when_due(&self.http_tx);
    }

    async fn ask(&mut self) -> Ask {
        tokio::select! {
            Some(request) = self.http_rx.recv() => Ask::Http(request),
            Some(()) = async { self.dump_asks.as_mut().unwrap().recv().await }, if self.dump_asks.is_some() => Ask::Dump,
        }
    }

    fn answer(&mut self, ask: Ask, model: &Model) {
        match ask {
            Ask::Http(request) => {
                let _ = request.reply.send(self.respond(request.route, request.peer_uid, model));
            }
            Ask::Dump => {
                self.dump_now();
            }
        }
    }

    fn dump(&mut self) -> Result<String, String> {
        Ok(self.dump_now())
    }

    fn close(&mut self, _: &End) -> Result<()> {
        self.finish();
        Ok(())
    }
}

impl Watcher {
    /// SIGUSR1 or `gputrace dump`: what happens, said on stderr and returned for the asker.
    fn dump_now(&mut self) -> String {
        let (_, now) = clocks();
        let already = self.flight.waiting().is_some();
        self.flight.trigger(Trigger::Manual, None, now);
        // Asking is never held back by --min-interval: it starts a dump or joins the one waiting.
        let what = match self.flight.waiting() {
            Some((_, until)) if !already => format!("dump asked for; written in {:.1} s", until.saturating_sub(now) as f64 / 1e9),
            _ => "a dump is already on its way; it holds this moment too".to_string(),
        };
        eprintln!("gputrace: {what}");
        what
    }

    /// Stopping: the dump waiting for its aftermath is written with what was seen, and every
    /// dump being written is finished.
    fn finish(&mut self) {
        if let Some(dump) = self.flight.take_dump(None) {
            self.job(dump).run();
        }
        for handle in self.writing.drain(..) {
            let _ = handle.join();
        }
        let c = &self.flight.counters;
        eprintln!(
            "gputrace: watched {} events ({} encoded, {} per event); {} dumps, {} triggers, {} too soon after a dump",
            c.records,
            bytes(c.encoded_bytes),
            bytes(c.encoded_bytes.checked_div(c.records).unwrap_or(0)),
            c.dumps,
            c.triggers,
            c.suppressed
        );
    }

    /// An HTTP request, answered from the live model.
    pub fn respond(&mut self, route: Route, peer_uid: Option<u32>, model: &Model) -> Response {
        match route {
            Route::Health => Response::text(200, "ok\n"),
            Route::Report => {
                let may = peer_uid.is_some_and(|uid| uid == 0 || self.user.as_ref().is_some_and(|u| u.uid == uid));
                if !may {
                    return Response::text(
                        403,
                        "the report holds command lines and request lines: only root and the user who started the watch may read it\n",
                    );
                }
                let body = serde_json::to_string_pretty(&self.report(model)).unwrap_or_default();
                Response { status: 200, content_type: "application/json", body }
            }
            Route::Metrics => {
                let body = match &self.metrics {
                    Some((made, body)) if made.elapsed() < METRICS_FRESH => body.clone(),
                    _ => {
                        let body = self.metrics(model);
                        self.metrics = Some((Instant::now(), body.clone()));
                        body
                    }
                };
                Response { status: 200, content_type: "text/plain; version=0.0.4", body }
            }
        }
    }

    /// The /metrics body, from the live model.
    fn metrics(&self, model: &Model) -> String {
        let mut report = self.report(model);
        // Anyone on the host may scrape: labels carry program and flag names, no values.
        let redacted: HashMap<String, String> =
            model.processes.values().map(|p| (p.command_line(), display_command(&crate::redact::command(&p.command)))).collect();
        // A label not found is hidden whole, never shown as it came.
        for p in &mut report.processes {
            for field in [&mut p.command, &mut p.service].into_iter().filter(|f| !f.is_empty()) {
                *field = redacted.get(field.as_str()).cloned().unwrap_or_else(|| crate::redact::HIDDEN.to_string());
            }
        }
        let diagnoses = self.diagnoses.lock().map(|d| d.clone()).unwrap_or_default();
        let figures = crate::metrics::Figures {
            report: &report,
            model,
            counters: &self.flight.counters,
            window_bytes: self.flight.window_bytes(),
            diagnoses: &diagnoses,
            now: clocks().1,
        };
        crate::metrics::exposition(&figures)
    }

    fn report(&self, model: &Model) -> Report {
        let loss = Loss { lost_records: self.flight.counters.lost, own_file_table: self.own_file_table, ..Loss::default() };
        Report::new(&self.header, model, "live".into(), self.flight.counters.records, loss, self.idle_ns)
    }

    fn job(&self, dump: Dump) -> DumpJob {
        DumpJob {
            dump,
            header: self.header.clone(),
            dir: self.dir.clone(),
            budget: self.budget,
            user: self.user.clone(),
            idle_ns: self.idle_ns,
            number: self.flight.counters.dumps,
            diagnoses: self.diagnoses.clone(),
            own_file_table: self.own_file_table,
        }
    }
}

struct DumpJob {
    dump: Dump,
    header: Header,
    dir: Arc<Dir>,
    budget: u64,
    user: Option<User>,
    idle_ns: u64,
    number: u64,
    diagnoses: Arc<Mutex<BTreeMap<String, u64>>>,
    own_file_table: u64,
}

impl DumpJob {
    fn run(self) {
        if let Err(e) = self.write() {
            eprintln!("gputrace: error: the {} dump was not written: {e:#}", self.dump.trigger.name());
        }
    }

    fn write(&self) -> Result<()> {
        let d = &self.dump;
        let mut header = self.header.clone();
        // The dump starts at its window: what came before is in its first records (the
        // snapshot). Of the holders and NVML figures of when watching began, only those of
        // processes still there stand: what they held before tracing is theirs still (a server
        // the watch met loaded and serving), and no record says otherwise.
        if d.window_start > header.monotonic_start_ns {
            header.wall_clock_start_ns += d.window_start - header.monotonic_start_ns;
            header.monotonic_start_ns = d.window_start;
        }
        let alive = d.alive_at_start();
        header.prior_use.retain(|p| alive.contains(&p.pid));
        header.holders_at_start.retain(|h| alive.contains(&h.pid));
        let wall = header.wall_clock_start_ns + d.trigger_ts.saturating_sub(header.monotonic_start_ns);
        let name = format!("gputrace-dump-{}-{}-{}", stamp(wall), self.number, d.trigger.name());
        let (trace, partial) = (format!("{name}.trace"), format!(".{name}.trace.partial"));
        let path = self.dir.display(&trace);
        let mut writer = Writer::create_in(&self.dir, partial.as_ref(), &header, self.user.as_ref())?;
        let mut model = Model::new();
        for record in d.records() {
            model.apply(&record);
            writer.write(&record)?;
        }
        writer.flush()?;
        // As the writer: under sudo the directory is the user's, and root keeps no right to it.
        let renamed = as_user(self.user.as_ref(), || self.dir.rename(partial.as_ref(), trace.as_ref()));
        if let Err(e) = renamed {
            let _ = as_user(self.user.as_ref(), || self.dir.remove(partial.as_ref()));
            return Err(e).with_context(|| format!("cannot rename {} to {}", writer.path().display(), path.display()));
        }
        let loss = Loss { own_file_table: self.own_file_table, ..Loss::of(&model) };
        let report = Report::new(&header, &model, path.display().to_string(), writer.records, loss, self.idle_ns);
        if let Ok(mut d) = self.diagnoses.lock() {
            *d.entry(report.diagnosis.category.name().to_string()).or_default() += 1;
        }
        let text = report.text();
        let report_name = format!("{name}.report.txt");
        let mut file = as_user(self.user.as_ref(), || self.dir.create_private(report_name.as_ref()))
            .with_context(|| format!("cannot write {}", self.dir.display(&report_name).display()))?;
        std::io::Write::write_all(&mut file, text.as_bytes())
            .with_context(|| format!("cannot write {}", self.dir.display(&report_name).display()))?;
        let verdict = text.lines().find(|l| l.starts_with("VERDICT")).unwrap_or("no failure diagnosed");
        let joined = if d.joined > 0 { format!(", {} more triggers in it", d.joined) } else { String::new() };
        eprintln!(
            "{}",
            crate::units::for_terminal(&format!("gputrace: dump {} ({}{joined}): {verdict}", path.display(), d.trigger.name()))
        );
        rotate(&self.dir, self.budget, &trace, self.user.as_ref());
        Ok(())
    }
}

/// Oldest dumps (trace and report) go until the directory's dumps fit the budget; the newest
/// always stays. Only names gputrace gives its dumps, only regular files, all relative to the
/// directory held open.
fn rotate(dir: &Dir, budget: u64, newest: &str, user: Option<&User>) {
    let entries = dir.entries(1 << 16);
    let size = |name: &str| entries.iter().find(|e| e.name == name).map_or(0, |e| e.len);
    let mut dumps: Vec<(i64, String, u64)> = entries
        .iter()
        .filter_map(|e| {
            let name = e.name.to_str()?;
            let stem = name.strip_suffix(".trace").filter(|s| s.starts_with("gputrace-dump-") && name != newest)?;
            Some((e.mtime, stem.to_string(), e.len + size(&format!("{stem}.report.txt"))))
        })
        .collect();
    let mut total: u64 = dumps.iter().map(|d| d.2).sum::<u64>() + size(newest);
    dumps.sort();
    for (_, stem, bytes_of) in dumps {
        if total <= budget {
            break;
        }
        let _ = as_user(user, || {
            let _ = dir.remove(format!("{stem}.report.txt").as_ref());
            dir.remove(format!("{stem}.trace").as_ref())
        });
        total = total.saturating_sub(bytes_of);
        eprintln!("gputrace: removed {} to keep dumps within {}", dir.display(&format!("{stem}.trace")).display(), bytes(budget));
    }
}

/// Local time as YYYYmmdd-HHMMSS.
fn stamp(wall_ns: u64) -> String {
    let secs = (wall_ns / 1_000_000_000) as libc::time_t;
    // SAFETY: localtime_r fills a tm from a time_t.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    unsafe { libc::localtime_r(&secs, &mut tm) };
    format!("{:04}{:02}{:02}-{:02}{:02}{:02}", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Alloc, Device, Record, Seen};
    use std::path::Path;

    fn watcher() -> Watcher {
        let config = Config { window_ns: 1 << 40, max_bytes: 1 << 20, aftermath_ns: 0, min_interval_ns: 0 };
        Watcher::new(config, Arc::new(Dir::open(Path::new("/")).unwrap()), Header::default(), None)
    }

    /// A server whose command line holds a secret, holding 2 GiB.
    fn model() -> Model {
        let argv = ["vllm", "serve", "m", "--api-key", "sk-secret", "--max-model-len", "8192"];
        let alloc = Alloc::video(1, 1, 2, 2 << 30);
        let events = [
            Event::Process { ppid: 1, seen: Seen::Running, command: argv.iter().map(|a| a.to_string()).collect() },
            Event::Open { fd: 3, file: 1, device: Device::Ctl, cloexec: false },
            Event::Object { fd: 3, client: 1, parent: 1, object: 1, class: 0x41, status: 0, gpu: None },
            Event::Alloc(alloc),
        ];
        Model::from_records(&events.map(|event| Record::new(1, 77, 77, event)))
    }

    #[test]
    fn metrics_labels_carry_no_argument_values() {
        let body = watcher().respond(Route::Metrics, Some(1234), &model()).body;
        assert!(!body.contains("sk-secret"), "{body}");
        // Allocated before any listen: load memory.
        assert!(
            body.contains("gputrace_live_bytes_by_phase{service=\"vllm … … --api-key … --max-model-len 8192\",phase=\"load\"} 2147483648"),
            "{body}"
        );
        assert!(
            body.contains(
                "gputrace_process_live_bytes{pid=\"77\",container=\"\",namespace=\"\",pod=\"\",command=\"vllm … … --api-key … --max-model-len 8192\"} 2147483648"
            ),
            "{body}"
        );
        assert!(
            body.contains("gputrace_live_bytes{service=\"vllm … … --api-key … --max-model-len 8192\",memory=\"video\"} 2147483648"),
            "{body}"
        );
    }

    /// A user asking for /metrics in a loop costs the event loop one body a second: within it,
    /// the body made last is served again, after it, one of the state now.
    #[test]
    fn a_metrics_body_is_made_at_most_once_a_second() {
        let mut w = watcher();
        let first = w.respond(Route::Metrics, None, &model()).body;
        assert!(first.contains("2147483648"), "{first}");
        assert_eq!(w.respond(Route::Metrics, None, &Model::new()).body, first);
        w.metrics.as_mut().unwrap().0 -= METRICS_FRESH;
        let now = w.respond(Route::Metrics, None, &Model::new()).body;
        assert!(!now.contains("2147483648"), "{now}");
    }

    /// What the kernel side did not follow is in the live report's losses (and so in every
    /// dump's), not only in `record`'s closing lines.
    #[test]
    fn the_kernel_sides_own_table_count_reaches_the_report() {
        let mut w = watcher();
        assert_eq!(w.report(&model()).loss.own_file_table, 0);
        w.own_file_table = 3;
        let report = w.report(&model());
        assert_eq!(report.loss.own_file_table, 3);
        assert!(report.text().contains("3 fd events in threads with a file table of their own not followed"));
    }

    #[test]
    fn the_report_is_only_for_root_and_the_user_who_started_the_watch() {
        let mut w = watcher();
        assert_eq!(w.respond(Route::Report, Some(1234), &model()).status, 403);
        assert_eq!(w.respond(Route::Report, None, &model()).status, 403, "an unknown peer is refused");
        let ok = w.respond(Route::Report, Some(0), &model());
        assert_eq!(ok.status, 200);
        assert!(ok.body.contains("sk-secret"), "the report is the unredacted state");
    }
}
