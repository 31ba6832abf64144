//! `gputrace watch`: every process's NVIDIA calls, indefinitely, in bounded memory (see
//! [`crate::flight`]); when an allocation fails, the OOM killer strikes or someone asks, the
//! window around it goes to a dump file with its report beside it, and one line says where and
//! what the verdict was.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::mpsc;

use crate::dir::Dir;
use crate::event::Event;
use crate::flight::{ChargedTo, Config, Dump, Flight, Trigger};
use crate::http::{Endpoint, Response, Route};
use crate::model::{display_command, Model};
use crate::privileges::Needs;
use crate::probe::Counters;
use crate::report::{Loss, Report};
use crate::session::{End, Sink};
use crate::trace::{clocks, Header, Writer};
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
    // Nothing is created before the privileges are known to be there.
    crate::probe::check_privileges()?;
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
    /// Services (root pid and GPU) said to keep memory.
    kept_warned: HashSet<(u32, Option<u32>)>,
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
            kept_warned: HashSet::new(),
            limits_checked: (0, false),
            metrics: None,
        }
    }

    /// A server whose own concurrency limit lets in more requests than memory takes, said once
    /// (the early form of a concurrent-load failure).
    fn warn_of_limits(&mut self, live: &Model) {
        let accounts = crate::analysis::accounts::Accounts::new(&self.header, live);
        for h in crate::analysis::headroom::headroom(&accounts) {
            let mut fresh = h.limits_exceeded.iter().map(|l| (h.service.clone(), l.setting.clone(), l.value));
            let warned = &mut self.limits_warned;
            if fresh.any(|key| warned.len() < MAX_LIMITS_WARNED && warned.insert(key)) {
                eprintln!("gputrace: warning: {}", crate::report::headroom::line(&h));
            }
        }
    }
}

impl Watcher {
    /// A service that keeps memory request after request, said once with its figures and when
    /// it runs out at that rate (the early form of a kept-by-service failure).
    fn warn_of_keeping(&mut self, live: &Model, now: u64) {
        use crate::analysis::kept::{measure, Kept};
        let accounts = crate::analysis::accounts::Accounts::new(&self.header, live);
        let warned = &self.kept_warned;
        let fresh: Vec<(u32, Option<u32>)> = self
            .header
            .rest_history
            .iter()
            .filter(|s| !warned.contains(&(s.root, s.gpu)))
            .filter(|s| {
                accounts.services.of(s.root).and_then(|service| measure(&accounts, service, s.gpu, now)).is_some_and(|k| Kept::keeps(&k))
            })
            .map(|s| (s.root, s.gpu))
            .collect();
        if fresh.is_empty() || self.kept_warned.len() >= MAX_LIMITS_WARNED {
            return;
        }
        for h in crate::analysis::headroom::headroom(&accounts).iter().filter(|h| fresh.contains(&(h.pid, h.gpu))) {
            if let Some(line) = crate::report::headroom::keeping(h) {
                eprintln!("gputrace: warning: {line}");
            }
        }
        // Each judged once, said or not (a GPU of unknown size has no headroom to say it with):
        // the measure and the headroom are not made again at every compaction.
        self.kept_warned.extend(fresh);
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
        if self.flight.compaction_due(now) {
            // What the requests that ended showed of each service's level at rest, kept before
            // compaction forgets them (the header carries it into /metrics and every dump).
            let mut history = std::mem::take(&mut self.header.rest_history);
            crate::analysis::kept::feed(&mut history, &crate::analysis::accounts::Accounts::new(&self.header, live), now);
            self.header.rest_history = history;
            self.warn_of_keeping(live, now);
            self.flight.compact(now, live);
        }
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
        // Every field a label is made of that holds a command line; one not found is hidden
        // whole, never shown as it came.
        let processes = report
            .processes
            .iter_mut()
            .flat_map(|p| [&mut p.command, &mut p.service].into_iter().chain(p.keeps.iter_mut().map(|k| &mut k.command)));
        let headroom = report.headroom.iter_mut().map(|h| &mut h.service);
        for field in processes.chain(headroom).filter(|f| !f.is_empty()) {
            *field = redacted.get(field.as_str()).cloned().unwrap_or_else(|| crate::redact::HIDDEN.to_string());
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
            header: Header { rest_history: crate::analysis::kept::for_dump(&self.header.rest_history), ..self.header.clone() },
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
        let name = format!("gputrace-dump-{}-{}-{}{}", stamp(wall), self.number, d.trigger.name(), Share::of(d.charged_to).suffix());
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
        let verdict = report.headline();
        let joined = if d.joined > 0 { format!(", {} more triggers in it", d.joined) } else { String::new() };
        eprintln!(
            "{}",
            crate::units::for_terminal(&format!("gputrace: dump {} ({}{joined}): {verdict}", path.display(), d.trigger.name()))
        );
        rotate(&self.dir, self.budget, &trace, self.user.as_ref());
        Ok(())
    }
}

/// Dumps (trace and report) go until the directory's dumps fit the budget, each time the oldest
/// of the share that holds the most (see [`over_budget`]); the newest always stays. Only names
/// gputrace gives its dumps, only regular files, all relative to the directory held open.
fn rotate(dir: &Dir, budget: u64, newest: &str, user: Option<&User>) {
    let entries = dir.entries(1 << 16);
    // By name: looked up twice a dump, in a directory of up to 65,536 names.
    let sizes: HashMap<&std::ffi::OsStr, u64> = entries.iter().map(|e| (e.name.as_os_str(), e.len)).collect();
    let size = |name: String| sizes.get(std::ffi::OsStr::new(&name)).copied().unwrap_or(0);
    let with_report = |stem: &str| size(format!("{stem}.trace")) + size(format!("{stem}.report.txt"));
    let dumps: Vec<StoredDump> = entries
        .iter()
        .filter_map(|e| {
            let stem = e.name.to_str()?.strip_suffix(".trace").filter(|s| s.starts_with("gputrace-dump-"))?;
            Some(StoredDump { mtime: e.mtime, bytes: with_report(stem), share: Share::of_name(stem), stem: stem.to_string() })
        })
        .collect();
    let newest = newest.strip_suffix(".trace").unwrap_or(newest);
    for stem in over_budget(dumps, newest, budget) {
        let _ = as_user(user, || {
            let _ = dir.remove(format!("{stem}.report.txt").as_ref());
            dir.remove(format!("{stem}.trace").as_ref())
        });
        eprintln!("gputrace: removed {} to keep dumps within {}", dir.display(&format!("{stem}.trace")).display(), bytes(budget));
    }
}

/// Whose share of the dump budget a dump is kept in, as its name says: the user whose process
/// failed (`-uid1001`), a failure whose process's user could not be read (`-uid-unknown`, one
/// share for all of them), or a dump asked for by root or the watch's user (no suffix; dumps
/// named before names said whose they were count with these).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Share {
    Asked,
    User(u32),
    Unknown,
}

impl Share {
    fn of(charged_to: Option<ChargedTo>) -> Share {
        match charged_to {
            None => Share::Asked,
            Some(ChargedTo { uid: Some(uid), .. }) => Share::User(uid),
            Some(ChargedTo { uid: None, .. }) => Share::Unknown,
        }
    }

    fn suffix(self) -> String {
        match self {
            Share::Asked => String::new(),
            Share::User(uid) => format!("-uid{uid}"),
            Share::Unknown => "-uid-unknown".into(),
        }
    }

    fn of_name(stem: &str) -> Share {
        if stem.ends_with("-uid-unknown") {
            return Share::Unknown;
        }
        match stem.rsplit_once("-uid").and_then(|(_, uid)| uid.parse().ok()) {
            Some(uid) => Share::User(uid),
            None => Share::Asked,
        }
    }
}

/// A dump in the directory: its trace's name without `.trace`, its and its report's bytes.
#[derive(Clone, Debug)]
struct StoredDump {
    mtime: i64,
    stem: String,
    bytes: u64,
    share: Share,
}

/// The dumps to remove, in order, so that all of `dumps` fit `budget`: each time the oldest
/// of the share holding the most bytes (ties: the share whose oldest dump is oldest). One
/// user's failures in a loop then remove their own dumps, never the evidence of another's
/// failure; with one share it is oldest first. `newest` (just written) counts in its share but
/// is never removed.
fn over_budget(mut dumps: Vec<StoredDump>, newest: &str, budget: u64) -> Vec<String> {
    dumps.sort_by(|a, b| (a.mtime, &a.stem).cmp(&(b.mtime, &b.stem)));
    let mut total: u64 = dumps.iter().map(|d| d.bytes).sum();
    // Each share's bytes, and its dumps that may go, oldest first.
    let mut shares: HashMap<Share, (u64, VecDeque<StoredDump>)> = HashMap::new();
    for d in dumps {
        let share = shares.entry(d.share).or_default();
        share.0 += d.bytes;
        if d.stem != newest {
            share.1.push_back(d);
        }
    }
    let mut removed = Vec::new();
    while total > budget {
        let heaviest = shares
            .values_mut()
            .filter(|(_, left)| !left.is_empty())
            .max_by(|a, b| a.0.cmp(&b.0).then_with(|| (b.1[0].mtime, &b.1[0].stem).cmp(&(a.1[0].mtime, &a.1[0].stem))));
        let Some((held, left)) = heaviest else { break };
        let Some(gone) = left.pop_front() else { break };
        *held -= gone.bytes;
        total -= gone.bytes;
        removed.push(gone.stem);
    }
    removed
}

/// Local time as YYYYmmdd-HHMMSS.
fn stamp(wall_ns: u64) -> String {
    let tm = crate::units::local_time(wall_ns);
    format!("{:04}{:02}{:02}-{:02}{:02}{:02}", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Alloc, Device, Record, Seen};
    use std::path::Path;

    fn watcher() -> Watcher {
        watcher_of(Header::default())
    }

    fn watcher_of(header: Header) -> Watcher {
        let config = Config { window_ns: 1 << 40, max_bytes: 1 << 20, aftermath_ns: 0, min_interval_ns: 0 };
        Watcher::new(config, Arc::new(Dir::open(Path::new("/")).unwrap()), header, None)
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

    /// Every label made of a command line is redacted, whichever part of the report it comes
    /// from: a serving server's headroom rows and the memory a process keeps alive for one that
    /// exited both showed the whole command line to anyone who scrapes.
    #[test]
    fn no_metrics_label_holds_an_argument_value() {
        let mut served = crate::analysis::tests::serving(&["--api-key", "sk-served-secret"]);
        served.0.sort_by_key(|r| r.ts);
        let header = crate::analysis::tests::header(80 << 30, &[]);
        let body = watcher_of(header).respond(Route::Metrics, None, &Model::from_records(&served.0)).body;
        assert!(body.contains("gputrace_headroom_requests{service=\"vllm … --gpu-memory-utilization 0.9 --api-key …\""), "{body}");
        assert!(!body.contains("secret"), "{body}");
        // The server (pid 77) forked a worker that holds its files, then exited: the worker
        // keeps its 2 GiB alive.
        let mut kept = model();
        let fork = Event::Process { ppid: 77, seen: Seen::Forked, command: vec!["worker".into(), "--token".into(), "tk-secret".into()] };
        kept.apply(&Record::new(2, 78, 78, fork));
        kept.apply(&Record::new(3, 77, 77, Event::Exit { code: Some(1) }));
        let body = watcher().respond(Route::Metrics, None, &kept).body;
        assert!(body.contains("gputrace_kept_bytes{pid=\"78\",command=\"worker --token …\",allocator_pid=\"77\""), "{body}");
        assert!(!body.contains("secret"), "{body}");
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

    fn kept(mtime: i64, share: Share) -> StoredDump {
        StoredDump { mtime, stem: format!("gputrace-dump-{mtime}{}", share.suffix()), bytes: 10, share }
    }

    /// A user whose processes fail in a loop fills the budget with dumps of their own: theirs
    /// go, the one dump of another user's failure stays, however old.
    #[test]
    fn one_users_failures_in_a_loop_never_remove_the_dump_of_anothers() {
        let (victim, mallory) = (Share::User(1002), Share::User(1001));
        let mut dumps = vec![kept(1, victim)];
        dumps.extend((2..=11).map(|t| kept(t, mallory)));
        let newest = dumps[10].stem.clone();
        // 110 bytes in all; 60 fit: five of mallory's, the oldest first.
        let removed = over_budget(dumps.clone(), &newest, 60);
        assert_eq!(removed, (2..=6).map(|t| kept(t, mallory).stem).collect::<Vec<_>>());
        // Down to the newest alone: mallory's go while they hold more, then the victim's.
        let removed = over_budget(dumps, &newest, 10);
        assert_eq!(removed[..9], (2..=10).map(|t| kept(t, mallory).stem).collect::<Vec<_>>());
        assert_eq!(removed[9..], [kept(1, victim).stem]);
        // Shares holding as much: the one whose oldest dump is oldest gives way.
        let even = vec![kept(2, mallory), kept(1, victim), kept(3, Share::Asked)];
        assert_eq!(over_budget(even, &kept(3, Share::Asked).stem, 20), [kept(1, victim).stem]);
    }

    #[test]
    fn with_one_share_the_oldest_dumps_go_and_the_newest_always_stays() {
        let dumps: Vec<StoredDump> = [3, 1, 2].map(|t| kept(t, Share::Asked)).into();
        assert_eq!(over_budget(dumps.clone(), &kept(3, Share::Asked).stem, 15), [kept(1, Share::Asked).stem, kept(2, Share::Asked).stem]);
        assert_eq!(over_budget(dumps.clone(), &kept(1, Share::Asked).stem, 0), [kept(2, Share::Asked).stem, kept(3, Share::Asked).stem]);
        assert!(over_budget(dumps, "", 30).is_empty());
    }

    /// The share is read back from the name (a watch started again finds its dumps' shares);
    /// names from before they said whose they were count as asked for.
    #[test]
    fn a_dumps_share_is_in_its_name() {
        let charged_to = |uid| Some(ChargedTo { service: 7, uid });
        for share in [Share::of(None), Share::of(charged_to(Some(0))), Share::of(charged_to(Some(1001))), Share::of(charged_to(None))] {
            assert_eq!(Share::of_name(&format!("gputrace-dump-20261207-101532-3-failed-allocation{}", share.suffix())), share);
        }
        assert_eq!(Share::of(charged_to(None)), Share::Unknown);
        assert_eq!(Share::of_name("gputrace-dump-20261203-101532-1-failed-allocation"), Share::Asked);
        assert_eq!(Share::of_name("gputrace-dump-20261203-101532-1-oom-kill-uidx"), Share::Asked);
    }
}
