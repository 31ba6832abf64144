//! A diagnosis in words: the fields a script reads and the same said for a person, for the
//! evidence and for the fix (the `diagnosis` and `diagnoses` of the report's JSON; the text's
//! `then` lines, the HTML's verdict box, Perfetto's verdict; the block (report/block.rs) is its glance).

use serde::Serialize;
use serde_json::{json, Value};

use super::headroom::{front_name, past_any_share};
use crate::analysis::cost::BYTES_PER_TOKEN;
use crate::analysis::diagnosis::preconditions::Unmet;
use crate::analysis::diagnosis::{
    BoundKept, CapConcurrency, Diagnosis, Evidence, Finding, Fix, KeptEvidence, Reserve, ShorterContext, SmallerLoad, StopHolder, Undecided,
};
use crate::analysis::{Category, Symptom};
use crate::units::bytes;

/// Fields a script reads, and the same said in words.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Worded {
    pub fields: Value,
    pub text: String,
}

impl Worded {
    fn new(fields: impl Serialize, text: String) -> Worded {
        Worded { fields: serde_json::to_value(fields).unwrap_or_default(), text }
    }
}

/// How many more times a failure came, said the same in every figure, and when the last did.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Repeated {
    pub times: u64,
    /// Nanoseconds since the trace start.
    pub last_ts: Option<u64>,
}

/// A diagnosis as the report gives it.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub category: Category,
    pub symptom: Symptom,
    /// Nanoseconds since the trace start.
    pub ts: Option<u64>,
    pub pid: Option<u32>,
    pub service: Option<String>,
    /// The GPU it happened on (as in the evidence), when one can be told.
    pub gpu: Option<u32>,
    pub evidence: Worded,
    pub fix: Worded,
    /// The same failure again right after (a framework's retries: PyTorch frees its cache and
    /// asks once more), folded into this one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeated: Option<Repeated>,
}

/// Every diagnosis in words, each run of failures said the same (one process, one GPU, the
/// same figures and fix as printed: a framework's retries) folded into its first.
pub fn verdicts(diagnoses: &[Diagnosis]) -> Vec<Verdict> {
    let mut out: Vec<Verdict> = Vec::new();
    for v in diagnoses.iter().map(verdict) {
        match out.last_mut() {
            Some(last) if last.said_as(&v) => {
                let r = last.repeated.get_or_insert(Repeated { times: 0, last_ts: None });
                r.times += 1;
                r.last_ts = v.ts;
            }
            _ => out.push(v),
        }
    }
    out
}

impl Verdict {
    /// The same failure said again: one process, one GPU, the same words.
    fn said_as(&self, other: &Verdict) -> bool {
        (self.category, self.symptom, self.pid, self.gpu) == (other.category, other.symptom, other.pid, other.gpu)
            && self.evidence.text == other.evidence.text
            && self.fix.text == other.fix.text
    }

    /// Worded after the evidence when the failure repeated as it was (" The same failure 3 more
    /// time(s), the last at 1.20 s (retries)."), or nothing.
    pub fn repeats(&self) -> String {
        self.repeated
            .as_ref()
            .map(|r| {
                let until = r.last_ts.map(|t| format!(", the last at {:.2} s", t as f64 / 1e9)).unwrap_or_default();
                format!(" The same failure {} more time(s){until} (retries).", r.times)
            })
            .unwrap_or_default()
    }
}

/// The diagnosis in words.
pub fn verdict(d: &Diagnosis) -> Verdict {
    let (evidence, fix) = match &d.finding {
        Finding::NothingFailed { lost_records } => {
            let text = if *lost_records > 0 {
                format!("No failure was seen, but {lost_records} kernel records were lost: one may be among them.")
            } else {
                "No allocation failed, no server refused or was killed.".to_string()
            };
            let evidence = Worded { fields: json!({"failures": 0, "lost_records": lost_records}), text };
            (evidence, Worded { fields: json!({}), text: "Nothing to change.".into() })
        }
        Finding::Undecided { lost_records, why, evidence: e } => {
            let decides = decides(why);
            let why = undecided(why, e.as_ref());
            let text = match e {
                Some(e) => format!("{}; {why}", context(d, e)),
                None => why,
            };
            let evidence = Worded { fields: json!({"lost_records": lost_records}), text };
            (evidence, Worded { fields: json!({}), text: decides.into() })
        }
        Finding::Judged { evidence: e, fix } => {
            let kept = e.kept.as_ref().map(kept).unwrap_or_default();
            let text = format!("{}, with {} request(s) in flight.{kept}", context(d, e), e.requests_in_flight);
            (Worded::new(e, text), worded_fix(fix, e))
        }
    };
    Verdict {
        category: d.category,
        symptom: d.symptom,
        ts: d.ts,
        pid: d.pid,
        service: d.service.clone(),
        gpu: d.gpu,
        evidence,
        fix,
        repeated: None,
    }
}

/// What failed, where, and the memory on its GPU then.
fn context(d: &Diagnosis, e: &Evidence) -> String {
    let phase = e.phase.name();
    let pid = d.pid.unwrap_or(0);
    let mut context = match d.symptom {
        Symptom::FailedAllocation => format!("An allocation of {} failed during {phase}", bytes(e.failed_bytes.unwrap_or(0))),
        Symptom::StartupRefusal => "The server exited while loading, with no failed allocation (a refusal)".to_string(),
        Symptom::OomKill => format!("The kernel's OOM killer killed pid {pid} during {phase}"),
        Symptom::Crash | Symptom::None => format!("pid {pid} died with no failed allocation during {phase}"),
    };
    if let Some(g) = e.gpu.filter(|_| d.several_gpus || e.service_gpus.len() > 1) {
        context += &format!(" on GPU {g}");
    }
    match (e.capacity_bytes, e.host_memory) {
        (Some(c), true) => {
            let available = e.free_bytes.map_or_else(|| "?".to_string(), bytes);
            context += &format!(
                "; unified memory: the host's {} of RAM is the GPU's, {available} of it available, {} held by this service",
                bytes(c),
                bytes(e.service_bytes)
            );
        }
        (Some(c), false) => {
            let held = (bytes(e.service_bytes), bytes(e.held_outside_bytes));
            context += &format!("; the card has {}, {} held by this service, {} outside it", bytes(c), held.0, held.1);
        }
        (None, _) => {}
    }
    context
}

/// What would decide it, for each reason none could be told.
pub(super) fn decides(why: &Undecided) -> &'static str {
    match why {
        Undecided::RecordsLost(_) => "Record again with nothing lost (a larger ring buffer, fewer traced processes) to decide.",
        Undecided::NoService => {
            "Record the server from its start (`gputrace record -- CMD`, or `--pid` of the server itself) to tell which of its requests or processes it was."
        }
        Undecided::NotMemory => "Read the server's own log for why it exited: nothing in the trace points at GPU memory.",
        Undecided::NoRequestInFlight => {
            "Read the server's own log for what it was doing: no request was in flight, so neither a context nor a concurrency cap is the fix."
        }
        Undecided::Unmet { unmet, .. } => unmet_decides(unmet),
    }
}

/// Why no category could be told.
pub(super) fn undecided(why: &Undecided, e: Option<&Evidence>) -> String {
    let (service, free) = e.map_or((0, None), |e| (e.service_bytes, e.free_bytes));
    match why {
        Undecided::NoService => "the failing process belongs to no traced service".into(),
        Undecided::RecordsLost(lost) => format!("{lost} kernel records were lost, so what else held memory is not known"),
        Undecided::NotMemory => {
            let free = free.map_or_else(|| "an unknown amount".to_string(), bytes);
            format!(
                "nothing the driver saw points at memory ({} held by the service, {free} free): its own log says why it exited",
                bytes(service)
            )
        }
        Undecided::NoRequestInFlight => "no request was in flight, so neither one request nor concurrency explains it".into(),
        Undecided::Unmet { category, unmet } => unmet_words(*category, unmet, e),
    }
}

/// What would decide it, for each precondition a category's figures did not meet.
fn unmet_decides(unmet: &Unmet) -> &'static str {
    match unmet {
        Unmet::LoadFitted { .. } | Unmet::OutsideShort { .. } | Unmet::HolderHoldsNothing { .. } | Unmet::HoldersShort { .. } | Unmet::Served => {
            "Run `gputrace doctor` (as root) to see who holds the GPU, and record with NVML available so that memory from before tracing is counted."
        }
        Unmet::RoomShrank { .. } => {
            "Find what took the room since the larger requests were served (`gputrace doctor`, the report's holders and the server's memory at rest) before capping the context: a cap would refuse what it served."
        }
        Unmet::NoLargerThanServed { .. } | Unmet::LargerThanServed { .. } | Unmet::KeptShort { .. } => {
            "Watch the server's memory at rest over its next requests (`gputrace watch`: gputrace_kept_bytes_per_request) and read its log (a fragmenting allocator, memory the trace cannot see): a lower context would refuse requests it served."
        }
        Unmet::NoneFitsAlone { .. } | Unmet::AllFit { .. } | Unmet::NotConcurrent { .. } | Unmet::FailedFits { .. } => {
            "Run `gputrace doctor` (as root) for memory the trace cannot see, and record the server from its start so that what one request costs is measured: neither a context nor a concurrency cap follows from these figures."
        }
    }
}

/// Which precondition of the category the failure's shape points at failed, on its figures.
fn unmet_words(category: Category, unmet: &Unmet, e: Option<&Evidence>) -> String {
    let (service, free, capacity, outside) =
        e.map_or((0, None, None, 0), |e| (e.service_bytes, e.free_bytes, e.capacity_bytes, e.held_outside_bytes));
    let maybe = |b: Option<u64>| b.map_or_else(|| "an unknown amount".to_string(), bytes);
    let name = category.name();
    match unmet {
        Unmet::LoadFitted { asked_bytes, free_bytes } => format!(
            "loading failed with {} free by the trace's account (the card's {} less {} held by this service and {} outside it), and it asked {}: memory the trace cannot see was in use; `gputrace doctor` shows who holds the GPU",
            bytes(*free_bytes),
            bytes(capacity.unwrap_or(0)),
            bytes(service),
            bytes(outside),
            bytes(*asked_bytes)
        ),
        Unmet::Served => format!("{name} needs a failure before the service served, and it had served"),
        Unmet::OutsideShort { outside_bytes, free_bytes, asked_bytes } => format!(
            "{name} needs what others hold to cover what the allocation lacked: {} held outside, {} free, {} asked",
            bytes(*outside_bytes),
            maybe(*free_bytes),
            bytes(*asked_bytes)
        ),
        Unmet::HolderHoldsNothing { pid } => format!("{name} needs a holder that holds memory at the failure, and pid {pid} held none"),
        Unmet::HoldersShort { holders_bytes, short_bytes } => format!(
            "{name} needs holders to stop that free what the allocation lacked, and those it would stop hold {} against {} lacking",
            bytes(*holders_bytes),
            bytes(*short_bytes)
        ),
        Unmet::LargerThanServed { failing_load_bytes, largest_served_load_bytes } => format!(
            "{name} needs a load no larger than those served, and the load in flight had received {}, over the {} served",
            bytes(*failing_load_bytes),
            bytes(*largest_served_load_bytes)
        ),
        Unmet::KeptShort { kept_bytes, free_bytes, asked_bytes } => format!(
            "{name} needs what the service kept to cover what the allocation lacked: {} kept, {} free, {} asked",
            bytes(*kept_bytes),
            maybe(*free_bytes),
            maybe(*asked_bytes)
        ),
        Unmet::NoLargerThanServed { failed_request_bytes, largest_served_request_bytes } => format!(
            "one request of {} failed alone, no larger than the {} served before it, and the service's memory at rest did not grow request after request: neither a long request nor memory it keeps explains it",
            bytes(*failed_request_bytes),
            bytes(*largest_served_request_bytes)
        ),
        Unmet::RoomShrank { largest_served_request_bytes, largest_fitting_request_bytes } => format!(
            "a request larger than those served failed alone, but the room left now takes one of {} at most, less than the {} served before: the room shrank since, so neither a long request nor a context cap explains it",
            bytes(*largest_fitting_request_bytes),
            bytes(*largest_served_request_bytes)
        ),
        Unmet::NoneFitsAlone { bytes_per_request, room_bytes } => format!(
            "{name} needs one request to fit alone, and by what a request costs ({}) not one fits in the room for requests ({}, {} free): memory the trace cannot see, or a cost mismeasured",
            maybe(*bytes_per_request),
            maybe(*room_bytes),
            maybe(free)
        ),
        Unmet::FailedFits { failed_request_bytes, largest_fitting_request_bytes } => format!(
            "{name} needs the request that failed to be past what fits alone, and by what a request costs one of {} fits, larger than its {}",
            bytes(*largest_fitting_request_bytes),
            bytes(*failed_request_bytes)
        ),
        Unmet::NotConcurrent { in_flight } => format!("{name} needs several requests in flight, and {in_flight} was"),
        Unmet::AllFit { in_flight, bytes_per_request, room_bytes } => format!(
            "{name} needs more in flight than fit together, and by what a request costs ({}) all {in_flight} fit in the room for requests ({}): the failure is not the concurrency's",
            bytes(*bytes_per_request),
            bytes(*room_bytes)
        ),
    }
}

fn worded_fix(fix: &Fix, e: &Evidence) -> Worded {
    match fix {
        Fix::StopHolder(f) => stop_holder(f, e),
        Fix::SmallerLoad(f) => smaller_load(f, e),
        Fix::ShorterContext(f) => shorter_context(f),
        Fix::CapConcurrency(f) => cap_concurrency(f),
        Fix::BoundKept(f) => bound_kept(f),
        Fix::MoreHostMemory { killed_pid, reserve } => {
            let reserve = reserve.map(|name| format!(", or lower {name}")).unwrap_or_default();
            let text = format!(
                "The kernel's OOM killer killed pid {killed_pid}: host memory ran out, not the GPU's (on unified-memory machines GPU memory is host RAM). Give it more host memory (the cgroup's limit), or load a smaller or quantized model{reserve}."
            );
            Worded::new(json!({"killed_pid": killed_pid}), text)
        }
    }
}

/// What the service kept at rest, request after request: " At rest it held ..."
fn kept(k: &KeptEvidence) -> String {
    let secs = |ts: u64| format!("{:.2} s", ts as f64 / 1e9);
    let from = if k.since_attaching { "when tracing began (it was serving already)" } else { "right after it became ready" };
    let began = k.began_ts.map(|t| format!(", from {} on", secs(t))).unwrap_or_default();
    let a = &k.allocations;
    let phases: Vec<String> = a.by_phase.iter().map(|(phase, n)| format!("{n} in {}", phase.name())).collect();
    let sizes = if a.smallest == a.largest { bytes(a.largest) } else { format!("{} to {}", bytes(a.smallest), bytes(a.largest)) };
    let first = a.first.first().map(|f| format!(", the first by pid {} (thread {}) at {}", f.pid, f.tid, secs(f.ts))).unwrap_or_default();
    format!(
        " At rest the service held {} {from} and {} after its last request before the failure, {} requests later: over the {} of them no larger than one served before, it kept {} ({} a request{began}). Still held: {} allocation(s) of {sizes} ({}){first}. The load that failed had received {}, no more than the {} served before it.",
        bytes(k.ready_bytes),
        bytes(k.now_bytes),
        k.requests_served,
        k.kept_over_requests,
        bytes(k.kept_bytes),
        bytes(k.kept_per_request_bytes),
        a.count,
        phases.join(", "),
        bytes(k.failing_load_bytes),
        bytes(k.largest_served_load_bytes),
    )
}

fn bound_kept(f: &BoundKept) -> Worded {
    #[derive(Serialize)]
    struct BoundKeptFields<'f> {
        kept_bytes: u64,
        requests: u64,
        per_request_bytes: u64,
        restart_frees_bytes: u64,
        requests_from_fresh_start: Option<u64>,
        /// A setting on the command line that bounds a cache (empty: none named).
        flag: &'f str,
        value: &'f str,
    }
    let again = f
        .requests_from_fresh_start
        .map(|n| format!(", and from a fresh start it fails again after about {n} requests like these"))
        .unwrap_or_default();
    let bound = match &f.cache_setting {
        Some((flag, value)) => format!("lower `{flag}` (now {value}) so the cache stays within what is free, or fix the leak"),
        None => "bound the cache (its size or entry limit) or fix the leak".to_string(),
    };
    let text = format!(
        "The server keeps memory request after request and never gives it back (a cache with no bound, or a leak in the server): {} over {} requests, {} a request. Restarting frees the {} it kept{again}: {bound}. A lower context or concurrency limit would not help: the failing request was no larger than those served.",
        bytes(f.kept_bytes),
        f.requests,
        bytes(f.per_request_bytes),
        bytes(f.restart_frees_bytes),
    );
    let (flag, value) = f.cache_setting.as_ref().map_or(("", ""), |(f, v)| (f.as_str(), v.as_str()));
    let fields = BoundKeptFields {
        kept_bytes: f.kept_bytes,
        requests: f.requests,
        per_request_bytes: f.per_request_bytes,
        restart_frees_bytes: f.restart_frees_bytes,
        requests_from_fresh_start: f.requests_from_fresh_start,
        flag,
        value,
    };
    Worded::new(fields, text)
}

fn stop_holder(f: &StopHolder, e: &Evidence) -> Worded {
    #[derive(Serialize)]
    struct StopHolderFields<'h> {
        kill: u32,
        holders: &'h [crate::analysis::accounts::Holder],
        held_outside_bytes: u64,
    }
    let (pid, command) = (f.kill, &f.command);
    let text = match f.held {
        // The MPS server holds its clients' memory: killing it takes every client down with it.
        Some(held) if f.mps_server => format!(
            "pid {pid} is the MPS server, which holds {} for MPS clients other than this server: stop those clients (`nvidia-smi` lists each with its memory), or, if none should be running, restart MPS: `echo quit | nvidia-cuda-mps-control`. Then start the server again.",
            bytes(held)
        ),
        Some(held) if !f.also.is_empty() => {
            let pids: Vec<String> = f.also.iter().map(|(p, _)| p.to_string()).collect();
            let together = f.together().unwrap_or(held);
            format!(
                "Stop pid {pid} (`{command}`), which holds {} outside this server, and pids {} after it, which together hold {}: no one of them frees what the allocation lacked. `kill {pid} {}`. Then start the server again.",
                bytes(held),
                pids.join(", "),
                bytes(together),
                pids.join(" ")
            )
        }
        Some(held) => format!(
            "Stop pid {pid} (`{command}`), which holds {} outside this server: `kill {pid}`. Then start the server again.",
            bytes(held)
        ),
        None => format!(
            "Stop pid {pid} (`{command}`), which held the GPU's device files before recording began (NVML was unavailable, so how much it holds is unknown; `gputrace doctor` says more): `kill {pid}`. Then start the server again."
        ),
    };
    Worded::new(StopHolderFields { kill: pid, holders: &e.holders_outside, held_outside_bytes: e.held_outside_bytes }, text)
}

fn smaller_load(f: &SmallerLoad, e: &Evidence) -> Worded {
    #[derive(Serialize)]
    struct SmallerLoadFields {
        load_bytes: u64,
        parameters_fp16_billions: f64,
        bytes_8bit: u64,
        bytes_4bit: u64,
        shortfall_bytes: u64,
        gpus: usize,
    }
    let (wanted, gpus, params) = (f.load_bytes, f.gpus, f.parameters_fp16);
    let reserve = match &f.reserve {
        Reserve::Fraction { flag, now, to } => format!("; or lower {flag} from {now} to {to}, what is free"),
        Reserve::Context { setting, now } => {
            format!("; the weights fit, so a smaller context reserve may: lower {} (now {now})", setting.name())
        }
        Reserve::None => String::new(),
    };
    let card = e.capacity_bytes.map(bytes).unwrap_or_else(|| "?".into());
    let text = match (e.gpu, gpus) {
        (Some(g), 2..) => {
            let more = f.sharding.as_ref().map_or_else(String::new, |(setting, now)| {
                format!(", or shard it over more GPUs ({}, now {now})", setting.name())
            });
            format!(
                "Loading needed at least {} on GPU {g}, a {card} card, one of the {gpus} GPUs the model is sharded over ({params:.1}B parameters at FP16 in all): use a smaller model or quantize it (about {} per GPU at 8-bit, {} at 4-bit){more}{reserve}.",
                bytes(wanted),
                bytes(wanted / 2),
                bytes(wanted / 4)
            )
        }
        _ => format!(
            "Loading needed at least {} ({params:.1}B parameters at FP16) on a {card} card: use a smaller model or quantize it (about {} at 8-bit, {} at 4-bit){reserve}.",
            bytes(wanted),
            bytes(wanted / 2),
            bytes(wanted / 4)
        ),
    };
    let fields = SmallerLoadFields {
        load_bytes: wanted,
        parameters_fp16_billions: (params * 10.0).round() / 10.0,
        bytes_8bit: wanted / 2,
        bytes_4bit: wanted / 4,
        shortfall_bytes: f.shortfall_bytes,
        gpus,
    };
    Worded::new(fields, text)
}

fn shorter_context(f: &ShorterContext) -> Worded {
    #[derive(Serialize)]
    struct ShorterContextFields<'s> {
        failed_request_bytes: u64,
        largest_served_request_bytes: u64,
        /// The largest prompt that fits alone, in bytes received, and in tokens at
        /// [`BYTES_PER_TOKEN`]; null when no request's cost was measured.
        largest_fitting_request_bytes: Option<u64>,
        context_tokens: Option<u64>,
        /// llama-server's slots that share the setting's value (1: it is one request's).
        context_slots: u64,
        /// No request's cost was measured (met serving): the figures are estimates from what
        /// the failing request needed at least.
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        fits_estimated: bool,
        flag: &'s str,
    }
    let slots = f.context_slots;
    let how = match &f.setting {
        Some((setting, now)) => {
            let shared = if slots > 1 { format!(", shared by its {slots} slots") } else { String::new() };
            match f.context_tokens {
                Some(tokens) => {
                    format!(" to about {tokens} tokens a request ({}, now {now}{shared})", setting.with(tokens.saturating_mul(slots)))
                }
                None => format!(" ({}, now {now}{shared})", setting.name()),
            }
        }
        None => " (the server's setting for it)".to_string(),
    };
    let why = match (f.largest_fitting_request_bytes, f.prompt_tokens) {
        (Some(fits), Some(prompt)) => format!(
            ": a request of {} fits alone, a prompt of about {prompt} tokens at {BYTES_PER_TOKEN} bytes a token of English text (fewer for code or other scripts), less 3% for the allocator's rounding",
            bytes(fits)
        ),
        _ => String::new(),
    };
    let why = if f.grows_faster {
        format!(
            ": below about {} tokens, the failing prompt's; by what smaller requests cost it fits alone, yet alone it failed: its cost grows faster than its length (attention at long context), so no larger context is computed from that cost",
            f.failed_request_bytes / BYTES_PER_TOKEN
        )
    } else {
        why
    };
    let why = match &f.estimate {
        Some(c) => format!(
            "{why}. No request was measured since tracing began: this is an estimate from what the failing one needed at least ({} for its {}: what it allocated in prefill and the allocation refused; what it would have asked for after and what it reused from before tracing are not in it), and a request served while traced measures it",
            bytes(c.pool_bytes),
            bytes(c.received)
        ),
        None => why,
    };
    // Attached to a server already serving, the prompts it served before are not in the trace.
    let against = match f.largest_served_request_bytes {
        Some(served) => format!("while prompts up to {} were served", bytes(served)),
        None => "alone, the first request seen since tracing began (the server was serving already)".to_string(),
    };
    let text = format!(
        "One request of {} received failed {against}: lower the maximum context{how} so longer requests are refused cleanly instead of failing the server{why}.",
        bytes(f.failed_request_bytes)
    );
    let fields = ShorterContextFields {
        failed_request_bytes: f.failed_request_bytes,
        largest_served_request_bytes: f.largest_served_request_bytes.unwrap_or(0),
        largest_fitting_request_bytes: f.largest_fitting_request_bytes,
        context_tokens: f.context_tokens,
        context_slots: slots,
        fits_estimated: f.estimate.is_some(),
        flag: f.setting.as_ref().map_or("", |(s, _)| s.name()),
    };
    Worded::new(fields, text)
}

fn cap_concurrency(f: &CapConcurrency) -> Worded {
    #[derive(Serialize)]
    struct CapConcurrencyFields<'f> {
        in_flight: u64,
        bytes_per_request: u64,
        per_request_measured_alone: bool,
        cap_estimated: bool,
        room_bytes: u64,
        max_concurrency: u64,
        flag: String,
        litellm_max_parallel_requests: u64,
        /// The LiteLLM deployments met that send to this server, where to set it.
        #[serde(skip_serializing_if = "<[_]>::is_empty")]
        litellm_deployments: &'f [crate::analysis::proxy::Front],
    }
    let (n, cap, fronts) = (f.in_flight, f.max_concurrency, &f.litellm_deployments);
    let setting = f.setting.map_or_else(|| format!("the server's concurrency limit at {cap}"), |s| s.with(cap));
    let how = if f.per_request_measured_alone { "one request alone needed" } else { "the batch needed, per request," };
    let estimate = if f.cap_estimated {
        " This cap is an estimate: the cost is a batch's share, and the server held memory before tracing began, so what its allocator cached from earlier requests is counted as held instead of as room, and is in no share; it is off by about as many requests as that cache holds. The first request served alone while traced measures the cost."
    } else {
        ""
    };
    let litellm_cap = f.litellm_max_parallel_requests;
    let litellm = if fronts.is_empty() {
        format!("LiteLLM max_parallel_requests: {cap} in front of it")
    } else {
        let each: Vec<String> = fronts
            .iter()
            .map(|f| {
                let now = f.max_parallel_requests.map_or_else(|| "no limit".to_string(), |v| format!("{v} by its `{}`", f.limit_from));
                format!("{} (now {now})", front_name(f))
            })
            .collect();
        let (sends, together) = match (fronts.len(), fronts.iter().map(|f| f.workers).sum::<u64>()) {
            (1, 1) => ("sends to its port", String::new()),
            (1, _) => ("sends to its port", format!(": {cap} together over its workers")),
            (_, _) => ("send to its port", format!(": {cap} together")),
        };
        let past = past_any_share(fronts, cap);
        format!("`max_parallel_requests: {litellm_cap}` for {}, which {sends}{together}{past}", each.join(" and for "))
    };
    let text = format!(
        "{n} requests were in flight; {how} {}, and {} was free for requests: cap concurrency at {cap} ({setting}, or {litellm}).{estimate}",
        bytes(f.bytes_per_request),
        bytes(f.room_bytes)
    );
    let fields = CapConcurrencyFields {
        in_flight: n,
        bytes_per_request: f.bytes_per_request,
        per_request_measured_alone: f.per_request_measured_alone,
        cap_estimated: f.cap_estimated,
        room_bytes: f.room_bytes,
        max_concurrency: cap,
        flag: setting,
        litellm_max_parallel_requests: litellm_cap,
        litellm_deployments: fronts,
    };
    Worded::new(fields, text)
}
