//! The `gputrace` command line. Thin: each subcommand is a library call.
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, Parser, Subcommand};
use gputrace::analysis::{whatif, Category, Phase};
use gputrace::dir::create_private;
use gputrace::report;
use gputrace::user::User;

#[derive(Parser)]
#[command(
    name = "gputrace",
    version,
    about = "Trace NVIDIA GPU memory through the driver's ioctls, and tell which kind of CUDA out-of-memory it was"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Each subcommand's examples (a test parses every one) and exit statuses, in `--help` and the
// man pages. A usage error exits 2 everywhere, as does an error gputrace says on stderr.
const DOCTOR_HELP: &str = "\
Examples:
  sudo gputrace doctor                       # who holds each GPU, what is stale, what to kill
  sudo gputrace doctor --json                # the same for a script (docs/doctor-schema.md)
  sudo gputrace doctor --idle-minutes 30

Exit status: 0 nothing stale; 1 a stale holder found; 2 an error.";

const RECORD_HELP: &str = "\
Examples:
  sudo gputrace record -- vllm serve meta-llama/Llama-3.1-8B --max-num-seqs 64
  sudo gputrace record -o run.trace -- llama-server -m model.gguf -c 16384
  sudo gputrace record --pid 4242 -o late.trace   # a server already serving
  sudo gputrace record --all --json -- ./repro.sh # every process on the host

Exit status: the traced command's own (0 when attached with --pid or --all alone);
2 an error.";

const WATCH_HELP: &str = "\
Examples:
  sudo gputrace watch                               # every process; dumps in /var/lib/gputrace/dumps
  sudo gputrace watch --cgroup /sys/fs/cgroup/system.slice/vllm.service
  sudo gputrace watch --window 5m --budget 4GiB --listen 0.0.0.0:9431

Exit status: 0 when stopped (SIGINT, SIGTERM); 2 an error.";

const DUMP_HELP: &str = "\
Examples:
  sudo gputrace dump                          # every watch running here writes its window
  sudo gputrace dump --pid 1234

Exit status: 0 asked; 2 no watch running, or it refused.";

const MARK_HELP: &str = "\
Examples:
  gputrace mark load                          # from a server's start script, before loading
  gputrace mark idle --pid 4242

Exit status: 0 marked; 2 no recording to mark, or it refused.";

const EXPORT_HELP: &str = "\
Examples:
  gputrace export run.trace --format html -o run.html
  gputrace export run.trace --format perfetto -o run.json   # open in ui.perfetto.dev
  gputrace export run.trace --format csv --redact -o run.csv

Exit status: 0 written; 2 an error.";

const REPORT_HELP: &str = "\
Examples:
  gputrace report run.trace                   # the verdict first, then the evidence
  gputrace report --json run.trace           # docs/report-schema.md
  gputrace report --redact gputrace-dump-20261203-101532-1-failed-allocation-uid1001.trace

Exit status: 0 read whole; 3 the trace is incomplete (records lost, lines damaged or torn,
the recorder stopped writing, processes past the bound): what it lacks is said first; 2 an error.";

const WHATIF_HELP: &str = "\
Examples:
  gputrace whatif run.trace --max-num-seqs 17 # the concurrency cap the report names
  gputrace whatif run.trace -c 14928          # llama-server's context
  gputrace whatif run.trace -np 5 --search    # and the largest concurrency and context that fit
  gputrace whatif run.trace --quantize 8 --capacity 80GiB

Exit status: 0 it fits; 1 it would fail; 2 no replay can be made, or an error.";

#[derive(Subcommand)]
enum Command {
    #[command(after_help = DOCTOR_HELP)]
    /// Who holds each GPU now, which holder is stale and why, and what to kill: no tracing, about
    /// a second. Exits 1 when something stale was found.
    Doctor {
        /// Print the findings as JSON (schema in docs/doctor-schema.md)
        #[arg(long)]
        json: bool,
        /// A holder up this long with no CPU and no listening socket gets a note
        #[arg(long, value_name = "MINUTES", default_value_t = 10)]
        idle_minutes: u64,
    },
    #[command(after_help = RECORD_HELP)]
    /// Run a command (or attach to running processes) and record every GPU memory allocation and free.
    Record {
        /// Where to write the trace [default: gputrace-YYYYmmdd-HHMMSS.trace]
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Trace every process on the host
        #[arg(long)]
        all: bool,
        /// Keep each ioctl's raw params bytes in the trace, for debugging the decoder
        #[arg(long)]
        raw: bool,
        /// Print the report as JSON on stdout
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        tracing: Tracing,
        /// The command to run and trace, after `--`
        #[arg(last = true, value_name = "CMD")]
        command: Vec<String>,
    },
    #[command(after_help = WATCH_HELP)]
    /// Trace every process indefinitely in bounded memory; when an allocation fails, the OOM
    /// killer strikes or `gputrace dump` asks, write the window around it and its report.
    Watch {
        /// Where dumps and their reports go (created private when missing)
        #[arg(long, value_name = "DIR", default_value = "/var/lib/gputrace/dumps")]
        dump_dir: PathBuf,
        /// How much history a dump holds before its trigger: 90s, 10m, 2h
        #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = gputrace::units::parse_duration)]
        window: std::time::Duration,
        /// The window's cap in memory, whatever its length in time
        #[arg(long, value_name = "BYTES", default_value = "24MiB", value_parser = gputrace::units::parse_bytes)]
        window_bytes: u64,
        /// Dumps beyond this size in all are removed: the oldest of the user whose dumps hold the most
        #[arg(long, value_name = "BYTES", default_value = "1GiB", value_parser = gputrace::units::parse_bytes)]
        budget: u64,
        /// How long after its trigger a dump waits, so the aftermath is in it
        #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = gputrace::units::parse_duration)]
        aftermath: std::time::Duration,
        /// The least time between two dumps; triggers in between are counted, not dumped
        #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = gputrace::units::parse_duration)]
        min_interval: std::time::Duration,
        #[command(flatten)]
        tracing: Tracing,
        /// Where to serve /metrics, /report and /healthz, or `off`
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9431", value_parser = listen_address)]
        listen: Listen,
        /// Watch only the processes under this cgroup v2 directory (a container's, a pod's),
        /// those there now and those that join it
        #[arg(long, value_name = "DIR")]
        cgroup: Option<PathBuf>,
    },
    #[command(after_help = DUMP_HELP)]
    /// Ask the running `gputrace watch` for a dump now, through its socket (SIGUSR1 does it too).
    Dump {
        /// The watch's pid [default: every watch running here]
        #[arg(long)]
        pid: Option<u32>,
    },
    #[command(after_help = MARK_HELP)]
    /// Mark the phase of a traced process's service in every running recording (overrides inference).
    Mark {
        #[arg(value_enum)]
        phase: MarkedPhase,
        /// The process whose service it is [default: the caller's parent, e.g. the wrapper script]
        #[arg(long)]
        pid: Option<u32>,
    },
    #[command(after_help = EXPORT_HELP)]
    /// Export a trace: Perfetto (Chrome Trace Event JSON) or a self-contained HTML page to look at, or CSV for scripts.
    Export {
        /// The trace file: from `record`, or a watch's dump
        trace: PathBuf,
        #[arg(long, value_enum)]
        format: Format,
        /// Where to write it [default: standard output]
        #[arg(short, long)]
        output: Option<PathBuf>,
        #[command(flatten)]
        judging: Judging,
    },
    #[command(after_help = REPORT_HELP)]
    /// Which "CUDA out of memory" a recorded trace shows, the evidence and the fix; per process
    /// and per phase what was allocated; the contexts nobody freed. Exits 3 when the trace is
    /// incomplete (records lost, lines damaged or torn, the recorder stopped writing).
    Report {
        /// The trace file: from `record`, or a watch's dump
        trace: PathBuf,
        /// Print the report as JSON (schema in docs/report-schema.md)
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        judging: Judging,
    },
    #[command(after_help = WHATIF_HELP)]
    /// The recorded load and requests replayed under changed settings, from the trace's own
    /// measures: would the OOM have happened, at which request, with what margin, and what it
    /// becomes. Several settings at once; `--search` adds the largest concurrency and context that
    /// fit. Exits 1 when it would fail.
    Whatif {
        /// The trace file: from `record`, or a watch's dump
        trace: PathBuf,
        /// Requests served at once; later ones wait (vLLM --max-num-seqs, llama-server -np or
        /// --parallel, SGLang --max-running-requests, TGI --max-concurrent-requests)
        /// (LiteLLM's max_parallel_requests in front of it alone replays the same)
        #[arg(long = "max-num-seqs", visible_aliases = ["parallel", "max-running-requests", "max-concurrent-requests", "max-parallel-requests"], value_name = "N", value_parser = at_least_one)]
        max_concurrency: Option<u64>,
        /// The longest prompt admitted, in tokens; for llama-server also its KV cache's size (vLLM
        /// --max-model-len, llama-server -c or --ctx-size, SGLang --context-length); 32k is 32,000,
        /// 32K 32,768, as vLLM reads them
        #[arg(short = 'c', long = "max-model-len", visible_aliases = ["ctx-size", "context-length"], value_name = "TOKENS", value_parser = tokens)]
        max_context: Option<u64>,
        /// The fraction of the card an engine reserves (vLLM --gpu-memory-utilization, SGLang
        /// --mem-fraction-static)
        #[arg(long = "gpu-memory-utilization", visible_alias = "mem-fraction-static", value_name = "FRACTION", value_parser = fraction)]
        utilization: Option<f64>,
        /// The weights at 8 or 4 bits a parameter (recorded at 16)
        #[arg(long, value_name = "BITS", value_parser = clap::builder::TypedValueParser::map(clap::builder::PossibleValuesParser::new(["8", "4"]), |b| b.parse::<u32>().unwrap_or(16)))]
        quantize: Option<u32>,
        /// The card's size: 80GiB, 141GiB
        #[arg(long, value_name = "BYTES", value_parser = card_size)]
        capacity: Option<u64>,
        /// The GPUs the model is sharded over (vLLM --tensor-parallel-size, SGLang --tp-size, TGI
        /// --num-shard; llama-server's --tensor-split entries): each holds its share of the
        /// weights and of what a request costs
        #[arg(long, visible_aliases = ["tensor-parallel-size", "tp-size", "num-shard"], value_name = "N", value_parser = clap::value_parser!(u64).range(1..=whatif::MAX_TENSOR_PARALLEL))]
        tensor_parallel: Option<u64>,
        /// Also find the largest concurrency and context that fit under these settings
        #[arg(long)]
        search: bool,
        /// Print the outcome as JSON
        #[arg(long)]
        json: bool,
    },
    /// The man pages and shell completions, generated from these definitions (for packagers:
    /// `cargo xtask dist` runs it).
    #[command(hide = true)]
    Generate {
        #[command(subcommand)]
        what: Generate,
    },
}

/// What to trace and how to decode it: the same for `record` and `watch`.
#[derive(Args)]
struct Tracing {
    /// Trace this running process and its children (repeatable; `record` combines it with a
    /// command). With no command, tracing ends once the given processes are gone, even if
    /// children run on; `watch` without it traces every process
    #[arg(long = "pid", value_name = "PID")]
    pids: Vec<u32>,
    /// Decode with this driver's layouts instead of the running driver's (e.g. 535.104.05)
    #[arg(long, value_name = "VERSION")]
    driver_version: Option<String>,
    /// Print the eBPF programs' own diagnostics (a kernel map full, a file it could not name)
    #[arg(long)]
    kernel_log: bool,
    #[command(flatten)]
    judging: Judging,
}

impl Tracing {
    /// The session's options; what only one command sets is left to it.
    fn session(self) -> gputrace::session::Options {
        gputrace::session::Options {
            pids: self.pids,
            driver_version: self.driver_version,
            kernel_log: self.kernel_log,
            redact: self.judging.redact,
            capacity: self.judging.capacity,
            invocation: std::env::args().collect(),
            ..Default::default()
        }
    }
}

/// How a recording is judged: the same for every command that makes a report.
#[derive(Args)]
struct Judging {
    /// A context with no allocation or request for this long is a suspect holder
    #[arg(long, value_name = "MINUTES", default_value_t = 10)]
    idle_minutes: u64,
    /// Leave argument values and query strings out of what is written (program and flag names stay)
    #[arg(long)]
    redact: bool,
    /// Each GPU's capacity where NVML cannot tell it (no NVML, unified memory): 80GiB, 128GiB...
    #[arg(long, value_name = "BYTES", value_parser = card_size)]
    capacity: Option<u64>,
}

impl Judging {
    fn idle_ns(&self) -> u64 {
        self.idle_minutes.saturating_mul(60_000_000_000)
    }
}

#[derive(Subcommand)]
enum Generate {
    /// Write gputrace.1 and a gputrace-COMMAND.1 page for each command into DIR
    Man { dir: PathBuf },
    /// Print the completion script for SHELL
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// `--listen`: an address, or off.
#[derive(Clone, Copy)]
struct Listen(Option<std::net::SocketAddr>);

fn listen_address(text: &str) -> Result<Listen, String> {
    if text == "off" {
        return Ok(Listen(None));
    }
    text.parse()
        .map(|a| Listen(Some(a)))
        .map_err(|_| format!("{text:?} is not an address: give it as 127.0.0.1:9431 or [::1]:9431, or off"))
}

/// A phase as `gputrace mark` takes it, with what each means.
#[derive(Clone, Copy)]
struct MarkedPhase(Phase);

impl clap::ValueEnum for MarkedPhase {
    fn value_variants<'a>() -> &'a [Self] {
        &[MarkedPhase(Phase::Load), MarkedPhase(Phase::Prefill), MarkedPhase(Phase::Decode), MarkedPhase(Phase::Idle)]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let help = match self.0 {
            Phase::Load => "From start until the service can serve: weights, KV reservation, warm-up",
            Phase::Prefill => "A request has arrived and has not yet received its first data",
            Phase::Decode => "Requests are receiving data, none is in prefill",
            Phase::Idle => "Serving, with no request in flight",
        };
        Some(clap::builder::PossibleValue::new(self.0.name()).help(help))
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Perfetto,
    Html,
    Csv,
}

/// A recording read back from its trace, judged as `judging` says.
fn load(path: &std::path::Path, judging: &Judging) -> anyhow::Result<(gputrace::trace::Header, gputrace::model::Model, report::Report)> {
    let (mut header, model, events, loss) = report::load(path, judging.redact)?;
    if let Some(bytes) = judging.capacity {
        header.assume_capacity(bytes);
    }
    let summary = report::Report::new(&header, &model, path.display().to_string(), events, loss, judging.idle_ns());
    Ok((header, model, summary))
}

fn export(path: PathBuf, format: Format, output: Option<PathBuf>, judging: Judging) -> anyhow::Result<()> {
    // The output is opened first, as the invoking user: a refused name costs no reading.
    let mut out: Box<dyn std::io::Write> = match &output {
        Some(file) => {
            Box::new(create_private(file, User::invoking()?.as_ref()).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", file.display()))?)
        }
        None => Box::new(std::io::stdout().lock()),
    };
    let (header, model, report) = load(&path, &judging)?;
    let mut out = std::io::BufWriter::with_capacity(1 << 16, &mut out);
    match format {
        Format::Perfetto => gputrace::export::perfetto(&header, &model, &report, &mut out)?,
        Format::Html => gputrace::export::html(&header, &model, &report, &mut out)?,
        Format::Csv => gputrace::export::csv(&header, &model, &mut out)?,
    }
    std::io::Write::flush(&mut out)?;
    Ok(())
}

/// The report; exits 3 where the trace is incomplete (see `Loss::incomplete`).
fn print_report(path: PathBuf, json: bool, judging: Judging) -> anyhow::Result<ExitCode> {
    let (_, _, summary) = load(&path, &judging)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        use std::io::IsTerminal;
        print!("{}", summary.for_terminal(report::colour_wanted(std::io::stdout().is_terminal())));
    }
    Ok(ExitCode::from(if summary.loss.incomplete() { 3 } else { 0 }))
}

/// llama-server's `-np` is two letters after one dash, which no parser of options takes: the
/// same as `--parallel` to `whatif` (and nothing to any other command: `record -- mpirun -np`).
fn llama_spellings(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    if args.get(1).is_some_and(|a| a == "whatif") {
        for a in args.iter_mut().skip(2).filter(|a| *a == "-np") {
            *a = "--parallel".into();
        }
    }
    args
}

/// A fraction of the card: above 0, at most 1.
fn fraction(text: &str) -> Result<f64, String> {
    let value: f64 = text.parse().map_err(|_| format!("{text:?} is not a number"))?;
    if value > 0.0 && value <= 1.0 {
        Ok(value)
    } else {
        Err(format!("{value} is not a fraction of the card: give one above 0 and at most 1 (0.9)"))
    }
}

/// A context as vLLM takes it: 131072, 32k (32,000), 32K (32,768); at least one token.
fn tokens(text: &str) -> Result<u64, String> {
    match gputrace::analysis::server::count(text) {
        Some(0) => Err("a context of 0 tokens admits no prompt: give 1 or more".into()),
        Some(n) => Ok(n),
        None => Err(format!("{text:?} is not a number of tokens: give one as 131072, 32k (32,000) or 32K (32,768)")),
    }
}

/// Requests at once: at least one (none would serve nothing).
fn at_least_one(text: &str) -> Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(0) => Err("0 requests at once serves none: give 1 or more".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{text:?} is not a number of requests: give one as 8")),
    }
}

/// A card's size, with its unit: 80GiB. A bare number would be bytes, and GB names a unit NVML
/// does not count in (an 80 GB card is 80 GiB): both refused with what to write.
fn card_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let number = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).trim();
    let unit = t[number.len()..].trim().to_ascii_lowercase();
    match unit.as_str() {
        "" => Err(format!("{t:?} has no unit: write the card's size as {number}GiB")),
        "kb" | "mb" | "gb" | "tb" => {
            let binary = format!("{}iB", &t[number.len()..].trim()[..1].to_ascii_uppercase());
            Err(format!("{t:?}: write {number}{binary} (an 80 GB card is 80 GiB, as nvidia-smi counts it), or the bytes with B"))
        }
        _ => gputrace::units::parse_bytes(t),
    }
}

fn what_if(path: &std::path::Path, settings: &whatif::Settings, search: bool, json: bool) -> anyhow::Result<ExitCode> {
    let (mut header, model, _, loss) = report::load(path, false)?;
    // A trace without the card's size (no NVML) takes the one tried as the recorded one too.
    if let Some(bytes) = settings.capacity {
        header.assume_capacity(bytes);
    }
    let outcome = report::what_if(&header, &model, loss.lost_records, settings, search)
        .map_err(|why| anyhow::anyhow!("{}: {}", path.display(), report::whatif::why_not(&why)))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&outcome)?);
    } else {
        println!("{}", gputrace::units::for_terminal(&report::whatif::outcome(&outcome)));
    }
    Ok(ExitCode::from(u8::from(outcome.category != Category::None)))
}

/// The man pages (gputrace.1, gputrace-record.1, ...) into `dir`, written as the invoking user
/// would, readable by all as man pages are; or a shell's completions on standard output.
fn generate(what: Generate) -> anyhow::Result<()> {
    let mut cli = Cli::command().disable_help_subcommand(true);
    cli.build();
    match what {
        Generate::Completions { shell } => clap_complete::generate(shell, &mut cli, "gputrace", &mut std::io::stdout()),
        Generate::Man { dir } => {
            let user = User::invoking()?;
            let pages = std::iter::once(cli.clone()).chain(cli.get_subcommands().filter(|c| !c.is_hide_set()).cloned());
            for page in pages {
                let man = clap_mangen::Man::new(page).manual("gputrace manual");
                let path = dir.join(man.get_filename());
                let mut file = create_private(&path, user.as_ref()).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
                man.render(&mut file)?;
                file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
            }
        }
    }
    Ok(())
}

/// A reader that leaves first (`| head`, `| grep -q`) ends the command as it ends `cat`: quietly,
/// by SIGPIPE's default action (Rust ignores the signal, and the write's error would be a panic).
/// Not for `record` and `watch`, which write to sockets of their own and have a trace to finish,
/// nor `dump` and `mark`, whose peer is the watch: they say a write that failed.
fn end_quietly_on_a_closed_pipe() {
    // SAFETY: restores the default action of a signal; no handler runs.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(llama_spellings(std::env::args_os().collect()));
    if matches!(
        cli.command,
        Command::Doctor { .. } | Command::Export { .. } | Command::Report { .. } | Command::Whatif { .. } | Command::Generate { .. }
    ) {
        end_quietly_on_a_closed_pipe();
    }
    let result = match cli.command {
        Command::Doctor { json, idle_minutes } => {
            let findings = gputrace::doctor::assess(&gputrace::doctor::observe(), idle_minutes);
            if json {
                serde_json::to_string_pretty(&findings).map(|text| println!("{text}")).map_err(anyhow::Error::from)
            } else {
                print!("{}", gputrace::units::for_terminal(&findings.text()));
                Ok(())
            }
            .map(|()| ExitCode::from(findings.exit_code()))
        }
        Command::Record { output, all, raw, json, tracing, command } => {
            let idle_ns = tracing.judging.idle_ns();
            let session = gputrace::session::Options { all, raw, command, ..tracing.session() };
            let opts = gputrace::record::Options { session, output, json, idle_ns };
            gputrace::record::run(opts).map(|outcome| ExitCode::from(outcome.exit_code.clamp(0, 255) as u8))
        }
        Command::Watch { dump_dir, window, window_bytes, budget, aftermath, min_interval, tracing, listen, cgroup } => {
            let idle_ns = tracing.judging.idle_ns();
            let session = gputrace::session::Options { cgroup, ..tracing.session() };
            let opts = gputrace::watch::Options {
                session,
                dump_dir,
                window,
                window_bytes,
                budget,
                aftermath,
                min_interval,
                idle_ns,
                listen: listen.0,
            };
            gputrace::watch::run(opts).map(|()| ExitCode::SUCCESS)
        }
        Command::Dump { pid } => gputrace::mark::ask_dump(pid).map(|done| {
            eprintln!("gputrace: {done}");
            ExitCode::SUCCESS
        }),
        Command::Mark { phase, pid } => {
            // SAFETY: getppid has no preconditions.
            let pid = pid.unwrap_or_else(|| unsafe { libc::getppid() } as u32);
            gputrace::mark::send(phase.0, pid).map(|done| {
                eprintln!("gputrace: {done}");
                ExitCode::SUCCESS
            })
        }
        Command::Export { trace, format, output, judging } => export(trace, format, output, judging).map(|()| ExitCode::SUCCESS),
        Command::Report { trace, json, judging } => print_report(trace, json, judging),
        Command::Whatif { trace, max_concurrency, max_context, utilization, quantize, capacity, tensor_parallel, search, json } => {
            let settings = whatif::Settings { max_concurrency, max_context, utilization, quantize, capacity, tensor_parallel };
            what_if(&trace, &settings, search, json)
        }
        Command::Generate { what } => generate(what).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gputrace: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every subcommand's `--help` (and man page) ends with examples and its exit statuses, and
    /// every example parses as written (less `sudo` and its comment).
    #[test]
    fn every_example_in_the_help_parses() {
        let cli = Cli::command();
        for sub in cli.get_subcommands().filter(|c| !c.is_hide_set()) {
            let name = sub.get_name();
            let help = sub.get_after_help().map(ToString::to_string).unwrap_or_default();
            assert!(help.starts_with("Examples:\n") && help.contains("\n\nExit status: "), "{name}: {help}");
            let examples: Vec<&str> = help.lines().skip(1).take_while(|l| !l.is_empty()).collect();
            assert!(examples.len() >= 2, "{name}: {help}");
            for line in examples {
                let command = line.split(" # ").next().unwrap_or_default();
                let words: Vec<std::ffi::OsString> = command.split_whitespace().skip_while(|w| *w == "sudo").map(Into::into).collect();
                assert_eq!(words.get(1).and_then(|w| w.to_str()), Some(name), "{line}");
                if let Err(e) = Cli::try_parse_from(llama_spellings(words)) {
                    panic!("{name}: `{line}` does not parse: {e}");
                }
            }
        }
        // A positional trace says what it is.
        for sub in ["report", "export", "whatif"] {
            let cmd = cli.find_subcommand(sub).unwrap();
            let trace = cmd.get_positionals().find(|a| a.get_id() == "trace").unwrap();
            assert!(trace.get_help().is_some(), "{sub}");
        }
    }
}
