//! The verdict laid out as a compiler's diagnostic (rustc's): a headline of the cause and the one
//! figure that decides it, a `-->` line saying where and when (wall-clock time, as the server's
//! own log has it), `=` lines of evidence, one `= help:` line per setting to change with its
//! value now, and a `= check:` line that replays that fix with whatif. Worded from the typed
//! diagnosis; the text report prints it first, and the JSON carries it as `block`.

use serde::Serialize;

use super::reasons::{is_figure, short_command};
use super::verdict::{decides, undecided};
use crate::analysis::cost::BYTES_PER_TOKEN;
use crate::analysis::diagnosis::{
    BoundKept, CapConcurrency, Diagnosis, Evidence, Finding, Fix, Reserve, ShorterContext, SmallerLoad, StopHolder, Undecided,
};
use crate::analysis::proxy::share;
use crate::analysis::server::Setting;
use crate::analysis::Category;
use crate::units::{bytes, one_line, wall_clock};

/// A headline longer than this is cut: it is read at a glance.
pub const HEADLINE: usize = 72;

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Block {
    pub headline: String,
    /// GPU, pid, the service's short command, phase, wall-clock time and offset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    pub evidence: Vec<String>,
    pub help: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub check: Option<String>,
}

impl Block {
    /// As the terminal shows it.
    pub fn text(&self) -> String {
        let mut out = format!("{}\n", self.headline);
        if let Some(l) = &self.location {
            out += &format!("  --> {l}\n");
        }
        for e in &self.evidence {
            out += &format!("   = {e}\n");
        }
        for h in &self.help {
            out += &format!("   = help: {h}\n");
        }
        if let Some(c) = &self.check {
            out += &format!("   = check: {c}\n");
        }
        out
    }
}

/// Where the diagnosis happened and what it was recorded in: what the block needs besides it.
pub struct Recorded<'a> {
    /// The failing service's engine command line (empty when none).
    pub engine: &'a [String],
    /// The trace's wall clock at `start` (ns since the epoch): times are offsets from `start`.
    pub wall_at_start: Option<u64>,
    /// The trace file a `check:` replays; None for a live watch's report, which has none.
    pub trace: Option<&'a str>,
}

/// The block of a diagnosis.
pub fn block(d: &Diagnosis, at: &Recorded) -> Block {
    let (headline, evidence, help, check) = match &d.finding {
        Finding::NothingFailed { lost_records: 0 } => ("OK: nothing failed".to_string(), vec![], vec![], None),
        Finding::NothingFailed { lost_records } => (
            format!("UNKNOWN: nothing failed in what was recorded, {lost_records} records lost"),
            vec![format!("{lost_records} kernel records were lost: a failure may be among them")],
            vec!["record again with nothing lost (a larger ring buffer, fewer traced processes)".to_string()],
            None,
        ),
        Finding::Undecided { why, evidence, .. } => {
            let mut lines: Vec<String> = evidence.iter().flat_map(memory).collect();
            lines.push(undecided(why, evidence.as_ref()));
            (format!("UNDECIDED: {}", short_reason(why)), lines, vec![decides(why).to_string()], None)
        }
        Finding::Judged { evidence: e, fix } => judged(d.category, e, fix, at),
    };
    // Every line one line: a command line, a flag's value or a proxy's config holds what its
    // process wrote, which may hold a newline and a forged `= help:` after it.
    let lines = |v: Vec<String>| v.iter().map(|l| one_line(l)).collect();
    Block {
        headline: cut(&one_line(&headline)),
        location: location(d, at).map(|l| one_line(&l)),
        evidence: lines(evidence),
        help: lines(help),
        check: check.map(|c| one_line(&c)),
    }
}

/// The trace's path as one shell word: quoted where it needs to be, `./` before one that would
/// read as an option; None where it holds what a terminal would not show as typed (a control or
/// format character): a check the reader cannot paste is none.
fn trace(at: &Recorded) -> Option<String> {
    let path = at.trace?;
    if path.is_empty() || path.chars().any(|c| c.is_control() || crate::units::for_terminal(&c.to_string()) != c.to_string()) {
        return None;
    }
    let path = if path.starts_with('-') { format!("./{path}") } else { path.to_string() };
    Some(if path.chars().all(|c| c.is_ascii_alphanumeric() || "_./:@%+=,-".contains(c)) {
        path
    } else {
        format!("'{}'", path.replace('\'', "'\\''"))
    })
}

/// The `check:` that replays `settings` on the trace; none where there is no trace to name.
fn whatif(at: &Recorded, settings: &str) -> Option<String> {
    trace(at).map(|path| format!("gputrace whatif {path} {settings}"))
}

/// One line: at most [`HEADLINE`] characters.
fn cut(text: &str) -> String {
    if text.chars().count() <= HEADLINE {
        return text.to_string();
    }
    text.chars().take(HEADLINE - 1).collect::<String>() + "…"
}

fn location(d: &Diagnosis, at: &Recorded) -> Option<String> {
    let pid = d.pid?;
    let mut parts = Vec::new();
    let e = match &d.finding {
        Finding::Judged { evidence, .. } | Finding::Undecided { evidence: Some(evidence), .. } => Some(evidence),
        _ => None,
    };
    if let Some(g) = d.gpu.or(e.and_then(|e| e.gpu)) {
        let name = e.and_then(|e| e.gpu_name.as_deref()).map(|n| format!(" ({n})")).unwrap_or_default();
        parts.push(format!("GPU {g}{name}"));
    }
    let command = if at.engine.is_empty() { String::new() } else { format!(" `{}`", short_command(at.engine)) };
    parts.push(format!("pid {pid}{command}"));
    if let Some(e) = e {
        parts.push(e.phase.name().to_string());
    }
    if let Some(ts) = d.ts {
        let offset = format!("+{:.2} s", ts as f64 / 1e9);
        parts.push(match at.wall_at_start {
            Some(wall) => format!("{} ({offset})", wall_clock(wall.saturating_add(ts))),
            None => offset,
        });
    }
    Some(parts.join(" · "))
}

/// A setting's value now as the block shows it: a figure, or its default; what else follows a
/// flag of that name on the command line is no engine's setting, and may be a secret.
fn shown(value: &str) -> &str {
    if is_figure(value) || value == "its default" {
        value
    } else {
        "not a number"
    }
}

/// The memory on the failing GPU, one line.
fn memory(e: &Evidence) -> Option<String> {
    let capacity = e.capacity_bytes?;
    let free = e.free_bytes.map_or_else(|| "? free".to_string(), |f| format!("{} free", bytes(f)));
    let what = if e.host_memory { "unified memory (the host's RAM)" } else { "the card" };
    Some(format!(
        "{what} has {}: {} held by this service, {} outside it, {free}",
        bytes(capacity),
        bytes(e.service_bytes),
        bytes(e.held_outside_bytes)
    ))
}

/// A command's program, and `...` where it has arguments (their values may be secrets).
fn program(command: &str) -> String {
    let mut words = command.split_whitespace();
    let first = words.next().unwrap_or_default();
    let name = first.rsplit('/').next().unwrap_or(first);
    if words.next().is_some() {
        format!("{name} ...")
    } else {
        name.to_string()
    }
}

fn short_reason(why: &Undecided) -> String {
    match why {
        Undecided::NoService => "the failing process is in no traced service".into(),
        Undecided::RecordsLost(n) => format!("{n} kernel records were lost"),
        Undecided::NotMemory => "it died with nothing pointing at GPU memory".into(),
        Undecided::NoRequestInFlight => "no request was in flight".into(),
        Undecided::Unmet { category, .. } => format!("{} does not hold on its figures", category.name()),
    }
}

type Lines = (String, Vec<String>, Vec<String>, Option<String>);

fn judged(category: Category, e: &Evidence, fix: &Fix, at: &Recorded) -> Lines {
    let mut evidence: Vec<String> = memory(e).into_iter().collect();
    if let Some(failed) = e.failed_bytes {
        let in_flight = match e.requests_in_flight {
            0 => String::new(),
            1 => ", 1 request in flight".to_string(),
            n => format!(", {n} requests in flight"),
        };
        evidence.push(format!("an allocation of {} failed{in_flight}", bytes(failed)));
    }
    let name = category.name();
    let (headline, more, help, check) = match fix {
        Fix::StopHolder(f) => held(f, e),
        Fix::SmallerLoad(f) => load(f, e, at),
        Fix::ShorterContext(f) => long(f, at),
        Fix::CapConcurrency(f) => concurrent(f, at),
        Fix::BoundKept(f) => kept(f),
        Fix::MoreHostMemory { killed_pid, reserve } => (
            format!("the kernel's OOM killer killed pid {killed_pid}"),
            vec!["host memory ran out, not the GPU's (on unified memory the GPU's is the host's)".to_string()],
            ["more host memory for it (its cgroup's limit), or a smaller or quantized model".to_string()]
                .into_iter()
                .chain(reserve.map(|r| format!("or lower {r}")))
                .collect(),
            None,
        ),
    };
    evidence.extend(more);
    (format!("OOM {name}: {headline}"), evidence, help, check)
}

fn held(f: &StopHolder, e: &Evidence) -> Lines {
    let headline = match f.held {
        Some(held) if !f.also.is_empty() => format!("{} holders hold {} outside it", f.also.len() + 1, bytes(f.together().unwrap_or(held))),
        Some(held) => format!("pid {} holds {} outside it", f.kill, bytes(held)),
        None => format!("pid {} holds an unknown amount", f.kill),
    };
    let listed: Vec<String> = e
        .holders_outside
        .iter()
        .take(3)
        .map(|h| format!("pid {} `{}` {}", h.pid, program(&h.command), h.bytes.map_or("(size unknown)".into(), bytes)))
        .collect();
    let help = if f.mps_server {
        "stop the MPS clients other than this server, or restart MPS: `echo quit | nvidia-cuda-mps-control`".to_string()
    } else {
        let also: String = f.also.iter().map(|(pid, _)| format!(" {pid}")).collect();
        format!("kill {}{also}  (then start the server again)", f.kill)
    };
    let mut evidence = vec![format!("held outside: {}", listed.join("; "))];
    if f.held.is_none() {
        evidence.push("it had the GPU's files open before recording, and NVML was unavailable to say how much it holds".to_string());
    }
    (headline, evidence, vec![help], None)
}

fn load(f: &SmallerLoad, e: &Evidence, at: &Recorded) -> Lines {
    let card = e.capacity_bytes.map_or_else(|| "?".to_string(), bytes);
    let mut help =
        vec![format!("a smaller model, or quantized: about {} at 8-bit, {} at 4-bit", bytes(f.load_bytes / 2), bytes(f.load_bytes / 4))];
    let mut check = whatif(at, "--quantize 8");
    match &f.reserve {
        Reserve::Fraction { flag, now, to } => {
            help.push(format!("{flag} {to}  (now {})", shown(&now.to_string())));
            check = whatif(at, &format!("--gpu-memory-utilization {to}"));
        }
        Reserve::Context { setting, now } => help.push(format!("lower {}  (now {})", setting.name(), shown(now))),
        Reserve::None => {}
    }
    if let (Some((setting, now)), 2.., Some(capacity)) = (&f.sharding, f.gpus, e.capacity_bytes) {
        // As many GPUs as the whole load needs at this card's size, a power of two (attention
        // heads split evenly); llama.cpp's split is one proportion per GPU.
        let needed = (f.load_bytes as u128 * f.gpus as u128).div_ceil(capacity.max(1) as u128).max(f.gpus as u128 + 1) as u64;
        let value = match setting {
            Setting::Flag("--tensor-split") => vec!["1"; needed.min(64) as usize].join(","),
            _ => needed.next_power_of_two().to_string(),
        };
        help.push(format!("or shard it over more GPUs: {}  (now {})", setting.with(value), shown(now)));
    }
    let over = if f.gpus == 1 { "1 GPU".to_string() } else { format!("{} GPUs", f.gpus) };
    let params = format!("about {:.1}B parameters at FP16 over {over}", f.parameters_fp16);
    (format!("needs {} to load; card: {card}", bytes(f.load_bytes)), vec![params], help, check)
}

/// The flag whatif takes for a setting: the engine's own where whatif knows it.
fn whatif_flag(setting: Setting, canonical: &'static str) -> &'static str {
    const KNOWN: [&str; 9] = [
        "--max-num-seqs",
        "-np",
        "--parallel",
        "--max-running-requests",
        "--max-concurrent-requests",
        "-c",
        "--max-model-len",
        "--ctx-size",
        "--context-length",
    ];
    match setting {
        Setting::Flag(f) if KNOWN.contains(&f) => f,
        _ => canonical,
    }
}

fn long(f: &ShorterContext, at: &Recorded) -> Lines {
    let tokens = |b: u64| b / BYTES_PER_TOKEN;
    let served = f.largest_served_request_bytes.map_or_else(|| "none seen served".to_string(), |s| format!("{} served", bytes(s)));
    let headline = match f.largest_fitting_request_bytes {
        Some(fits) => format!("a {} prompt, {} fits, {served}", bytes(f.failed_request_bytes), bytes(fits)),
        None => format!("a {} prompt failed alone, {served}", bytes(f.failed_request_bytes)),
    };
    let mut evidence = vec![format!(
        "the request that failed had received {} (about {} tokens); the largest served {}",
        bytes(f.failed_request_bytes),
        tokens(f.failed_request_bytes),
        f.largest_served_request_bytes.map_or_else(|| "none (it was serving when tracing began)".to_string(), bytes)
    )];
    if let (Some(fits), Some(prompt)) = (f.largest_fitting_request_bytes, f.prompt_tokens) {
        evidence.push(format!("a request of {} fits alone: about {prompt} tokens at {BYTES_PER_TOKEN} bytes a token", bytes(fits)));
    }
    if f.estimate.is_some() {
        evidence.push("no request was measured since tracing began: the figures are an estimate".to_string());
    }
    if f.grows_faster {
        evidence.push(
            "by what smaller requests cost it fits alone, yet alone it failed: its cost grows faster than its length (attention at long context)".to_string(),
        );
    }
    let (mut help, mut check) = (vec![], None);
    match (f.setting.as_ref(), f.context_tokens) {
        (Some((setting, now)), Some(tokens)) => {
            let value = tokens.saturating_mul(f.context_slots);
            let shared = if f.context_slots > 1 { format!(", shared by {} slots", f.context_slots) } else { String::new() };
            help.push(format!("{}  (now {}{shared})", setting.with(value), shown(now)));
            check = whatif(at, &format!("{} {value}", whatif_flag(*setting, "--max-model-len")));
        }
        (Some((setting, now)), None) if f.grows_faster => {
            help.push(format!("{} below {}  (now {})", setting.name(), tokens(f.failed_request_bytes), shown(now)))
        }
        (Some((setting, now)), None) => help.push(format!("lower {}  (now {})", setting.name(), shown(now))),
        (None, _) if f.grows_faster => {
            help.push(format!("lower the server's maximum context below {} tokens", tokens(f.failed_request_bytes)))
        }
        (None, _) => help.push("lower the server's maximum context".to_string()),
    }
    (headline, evidence, help, check)
}

fn concurrent(f: &CapConcurrency, at: &Recorded) -> Lines {
    let how = if f.per_request_measured_alone { "measured alone" } else { "a batch's share" };
    let mut evidence =
        vec![format!("one request costs {} ({how}); {} was free for requests", bytes(f.bytes_per_request), bytes(f.room_bytes))];
    if f.cap_estimated {
        evidence.push("the cost is a batch's share of a server met serving: the cap is an estimate".to_string());
    }
    let cap = f.max_concurrency;
    let mut help = Vec::new();
    let mut check = None;
    match f.setting {
        Some(setting) => {
            let now = format!("  (now {})", shown(f.now.as_deref().unwrap_or("its default")));
            help.push(format!("{}{now}", setting.with(cap)));
            check = whatif(at, &format!("{} {cap}", whatif_flag(setting, "--max-num-seqs")));
        }
        None => help.push(format!("cap the server's concurrency at {cap}")),
    }
    let litellm = share(&f.litellm_deployments, cap);
    if f.litellm_deployments.is_empty() {
        help.push(format!("or LiteLLM max_parallel_requests: {cap}"));
    } else {
        for d in &f.litellm_deployments {
            let now = d.max_parallel_requests.map_or_else(|| "no limit".to_string(), |v| v.to_string());
            help.push(format!("LiteLLM max_parallel_requests: {litellm}  (now {now}, deployment `{}` in {})", d.model, d.config));
        }
    }
    (format!("{} requests at once, memory fits {cap}", f.in_flight), evidence, help, check)
}

fn kept(f: &BoundKept) -> Lines {
    let again = f.requests_from_fresh_start.map(|n| format!(", and a fresh start serves about {n} requests")).unwrap_or_default();
    let mut help = match &f.cache_setting {
        Some((flag, value)) => vec![format!("lower {flag}  (now {value})")],
        None => vec!["bound the server's cache (its size or entry limit) or fix the leak".to_string()],
    };
    help.push(format!("a restart frees {}{again}; a context or concurrency cap would not help", bytes(f.restart_frees_bytes)));
    (
        format!("{} kept a request, {} over {}", bytes(f.per_request_bytes), bytes(f.kept_bytes), f.requests),
        vec![format!("it kept {} over {} requests no larger than those served before", bytes(f.kept_bytes), f.requests)],
        help,
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The program, its subcommand or module, and the sizing flags with their values: never a
    /// model path, a key or a token.
    #[test]
    fn a_short_command_holds_no_argument_values_but_the_sizing_flags() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let vllm = argv(&[
            "/usr/bin/vllm",
            "serve",
            "/models/secret-model",
            "--api-key",
            "sk-1234",
            "--max-num-seqs",
            "256",
            "--gpu-memory-utilization=0.8",
        ]);
        assert_eq!(short_command(&vllm), "vllm serve ... --max-num-seqs 256 --gpu-memory-utilization 0.8");
        let sglang = argv(&["python3", "-m", "sglang.launch_server", "--model-path", "/m", "--context-length", "8192"]);
        assert_eq!(short_command(&sglang), "python3 -m sglang.launch_server ... --context-length 8192");
        let llama = argv(&["llama-server", "-m", "/models/x.gguf", "-c", "16384", "-np", "4", "--api-key", "k"]);
        assert_eq!(short_command(&llama), "llama-server ... -c 16384 -np 4");
        // A word `llama` makes the family llama.cpp's; a value after its `-c` that is no figure is
        // no context, and may be a password.
        let leak = argv(&["python3", "serve.py", "--arch", "llama", "-c", "postgres://svc:Pa55w0rd@db/x"]);
        assert_eq!(short_command(&leak), "python3 ...");
    }
}
