//! Which "CUDA out of memory" it was, with the evidence in numbers and what to change.
//!
//! The symptom (a failed allocation, a server refusing at start, an OOM kill, a crash) is not the
//! cause. Causes are checked in the order a careful engineer would:
//! 1. held-by-other-process: memory held outside the failing service covers the shortfall;
//! 2. does-not-fit-at-load: it failed before the service served a request;
//! 3. long-request: one request in flight, or one far larger than the others;
//! 4. concurrent-load: several in flight, each of which alone fits.
//!
//! Besides: host-oom (the kernel's OOM killer), none, and inconclusive (evidence missing or lost).

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{json, Value};

use super::{Phase, Service, Services};
use crate::abi::status;
use crate::event::Memory;
use crate::model::Model;
use crate::trace::Header;
use crate::units::bytes;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Category {
    HeldByOtherProcess,
    DoesNotFitAtLoad,
    LongRequest,
    ConcurrentLoad,
    HostOom,
    None,
    Inconclusive,
}

impl Category {
    /// The name reports and scripts use (the same as in JSON).
    pub fn name(self) -> &'static str {
        match self {
            Category::HeldByOtherProcess => "held-by-other-process",
            Category::DoesNotFitAtLoad => "does-not-fit-at-load",
            Category::LongRequest => "long-request",
            Category::ConcurrentLoad => "concurrent-load",
            Category::HostOom => "host-oom",
            Category::None => "none",
            Category::Inconclusive => "inconclusive",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Symptom {
    FailedAllocation,
    /// The server exited during load with no failed allocation (vLLM's free-memory check).
    StartupRefusal,
    OomKill,
    Crash,
    None,
}

/// Fields a script reads, and the same said in words.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Said {
    pub fields: Value,
    pub text: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Diagnosis {
    pub category: Category,
    pub symptom: Symptom,
    /// Nanoseconds since the trace start.
    pub ts: Option<u64>,
    pub pid: Option<u32>,
    pub service: Option<String>,
    pub evidence: Said,
    pub fix: Said,
}

impl Symptom {
    /// The name reports and scripts use (the same as in JSON).
    pub fn name(self) -> &'static str {
        match self {
            Symptom::FailedAllocation => "failed-allocation",
            Symptom::StartupRefusal => "startup-refusal",
            Symptom::OomKill => "oom-kill",
            Symptom::Crash => "crash",
            Symptom::None => "none",
        }
    }
}

struct Failure {
    ts: u64,
    pid: u32,
    symptom: Symptom,
    /// Bytes the failed allocation asked for.
    bytes: Option<u64>,
}

/// The value of `--flag V` or `--flag=V` on a command line.
fn flag(command: &[String], names: &[&str]) -> Option<String> {
    command.iter().enumerate().find_map(|(i, a)| {
        names.iter().find_map(|n| if a == n { command.get(i + 1).cloned() } else { a.strip_prefix(&format!("{n}=")).map(String::from) })
    })
}

pub struct Diagnoser<'a> {
    header: &'a Header,
    model: &'a Model,
    services: Services<'a>,
    lost: u64,
}

impl<'a> Diagnoser<'a> {
    pub fn new(header: &'a Header, model: &'a Model, lost: u64) -> Self {
        Diagnoser { header, model, services: Services::new(model), lost }
    }

    pub fn services(&self) -> &Services<'a> {
        &self.services
    }

    fn start(&self) -> u64 {
        self.header.monotonic_start_ns.min(self.model.first_ts.unwrap_or(u64::MAX))
    }

    fn capacity(&self) -> Option<u64> {
        self.header.gpus.first().and_then(|g| g.total_bytes)
    }

    /// Video memory live at `ts`, by the processes `keep` selects.
    fn live_at(&self, ts: u64, keep: impl Fn(u32) -> bool) -> u64 {
        self.model
            .allocations
            .iter()
            .filter(|a| a.memory == Memory::Video && a.ts <= ts && a.freed.is_none_or(|(f, _)| f > ts) && keep(a.pid))
            .map(|a| a.bytes)
            .fold(0, u64::saturating_add)
    }

    /// Memory held outside `service` at `ts`: other traced services, and what NVML said other
    /// processes held when recording began. With who holds it.
    fn held_outside(&self, service: &Service, ts: u64) -> (u64, Vec<Value>) {
        let mut total = self.live_at(ts, |pid| !service.pids.contains(&pid));
        let mut holders = Vec::new();
        for other in self.services.list.iter().filter(|s| s.root != service.root) {
            let held = self.live_at(ts, |pid| other.pids.contains(&pid));
            if held > 0 {
                holders.push(json!({"pid": other.root, "command": other.name, "bytes": held, "source": "traced"}));
            }
        }
        for prior in self.header.prior_use.iter().filter(|p| !service.pids.contains(&p.pid)) {
            let used = prior.used_bytes.unwrap_or(0);
            total = total.saturating_add(used);
            let (pid, command) = super::prior_holder(self.header, prior, |pid| service.pids.contains(&pid));
            holders.push(json!({"pid": pid, "command": command, "bytes": used, "source": "nvml", "nvml_pid": prior.pid}));
        }
        (total, holders)
    }

    fn failures(&self) -> Vec<Failure> {
        let mut failures: Vec<Failure> = self
            .model
            .failures
            .iter()
            .filter(|f| status::is_out_of_memory(f.status) && f.memory != Memory::Virtual)
            .map(|f| Failure { ts: f.ts, pid: f.pid, symptom: Symptom::FailedAllocation, bytes: Some(f.bytes) })
            .collect();
        for p in self.model.processes.values() {
            if let Some(ts) = p.oom_killed {
                failures.push(Failure { ts, pid: p.pid, symptom: Symptom::OomKill, bytes: None });
            }
        }
        // A server that exited badly with no failure above: a refusal during load, or a crash.
        for s in &self.services.list {
            let root = &self.model.processes[&s.root];
            let (Some(code), Some(ts)) = (root.exit_code, root.exited) else { continue };
            let explained = failures.iter().any(|f| s.pids.contains(&f.pid) && f.ts <= ts);
            if code == 0 || explained {
                continue;
            }
            let symptom = if code > 128 && code != 130 && code != 143 {
                Symptom::Crash
            } else if self.services.phase(s, ts) == Phase::Load {
                Symptom::StartupRefusal
            } else {
                continue;
            };
            failures.push(Failure { ts, pid: s.root, symptom, bytes: None });
        }
        failures.sort_by_key(|f| f.ts);
        failures
    }

    /// Every failure, in time order; `none` when nothing failed.
    pub fn diagnose(&self) -> Vec<Diagnosis> {
        let failures = self.failures();
        if failures.is_empty() {
            let fields = json!({"failures": 0, "lost_records": self.lost});
            let (category, text) = if self.lost > 0 {
                (Category::Inconclusive, format!("No failure was seen, but {} kernel records were lost: one may be among them.", self.lost))
            } else {
                (Category::None, "No allocation failed, no server refused or was killed.".to_string())
            };
            return vec![Diagnosis {
                category,
                symptom: Symptom::None,
                ts: None,
                pid: None,
                service: None,
                evidence: Said { fields, text },
                fix: Said { fields: json!({}), text: "Nothing to change.".into() },
            }];
        }
        failures.iter().map(|f| self.diagnose_one(f)).collect()
    }

    fn diagnose_one(&self, f: &Failure) -> Diagnosis {
        let Some(service) = self.services.of(f.pid) else {
            return self.inconclusive(f, "the failing process belongs to no traced service".into());
        };
        let capacity = self.capacity();
        let ts = f.ts;
        // A death is judged by the state just before it: its exit ends its requests at once.
        let before = if f.symptom == Symptom::FailedAllocation { ts } else { ts.saturating_sub(1) };
        let phase = self.services.phase(service, before);
        let in_flight = self.services.in_flight(service, before);
        let (outside, holders) = self.held_outside(service, ts);
        let own = self.live_at(ts, |pid| service.pids.contains(&pid));
        let free = capacity.map(|c| c.saturating_sub(outside.saturating_add(own)));
        let evidence = json!({
            "capacity_bytes": capacity,
            "service_bytes": own,
            "held_outside_bytes": outside,
            "holders_outside": holders,
            "free_bytes": free,
            "failed_bytes": f.bytes,
            "phase": phase.name(),
            "requests_in_flight": in_flight.len(),
            "request_bytes_received": in_flight.iter().map(|r| r.bytes_in).collect::<Vec<_>>(),
        });
        let command = &self.model.processes[&service.root].command;
        let engine = self
            .model
            .processes
            .values()
            .filter(|p| service.pids.contains(&p.pid))
            .map(|p| &p.command)
            .find(|c| !c.is_empty())
            .unwrap_or(command);
        let mut context = match f.symptom {
            Symptom::FailedAllocation => format!("An allocation of {} failed during {}", bytes(f.bytes.unwrap_or(0)), phase.name()),
            Symptom::StartupRefusal => "The server exited while loading, with no failed allocation (a refusal)".to_string(),
            Symptom::OomKill => format!("The kernel's OOM killer killed pid {} during {}", f.pid, phase.name()),
            Symptom::Crash | Symptom::None => format!("pid {} died with no failed allocation during {}", f.pid, phase.name()),
        };
        if let Some(c) = capacity {
            context += &format!("; the card has {}, {} held by this service, {} outside it", bytes(c), bytes(own), bytes(outside));
        }

        let category = if f.symptom == Symptom::OomKill {
            Category::HostOom
        } else if self.lost > 0 {
            return self
                .inconclusive(f, format!("{context}; {} kernel records were lost, so what else held memory is not known", self.lost));
        } else if self.held_by_other(f, outside, free, command) {
            Category::HeldByOtherProcess
        } else if phase == Phase::Load {
            Category::DoesNotFitAtLoad
        } else if in_flight.len() == 1 || self.one_much_larger(&in_flight).is_some() {
            Category::LongRequest
        } else if in_flight.len() > 1 {
            Category::ConcurrentLoad
        } else {
            return self
                .inconclusive(f, format!("{context}; no request was in flight, so neither one request nor concurrency explains it"));
        };
        let fix = self.fix(category, f, service, engine, &in_flight, own, outside, free, &holders);
        Diagnosis {
            category,
            symptom: f.symptom,
            ts: Some(ts.saturating_sub(self.start())),
            pid: Some(f.pid),
            service: Some(service.name.clone()),
            evidence: Said { text: format!("{context}, with {} request(s) in flight.", in_flight.len()), fields: evidence },
            fix,
        }
    }

    fn held_by_other(&self, f: &Failure, outside: u64, free: Option<u64>, command: &[String]) -> bool {
        if outside == 0 {
            return false;
        }
        match (f.symptom, f.bytes, free) {
            // Freeing what is held outside would have made room.
            (Symptom::FailedAllocation, Some(b), Some(free)) => free < b && free.saturating_add(outside) >= b,
            (Symptom::FailedAllocation, Some(b), None) => outside >= b,
            // A refusal at start: what others held exceeds what the engine leaves unused.
            (Symptom::StartupRefusal, _, _) => {
                let util: f64 = flag(command, &["--gpu-memory-utilization"]).and_then(|v| v.parse().ok()).unwrap_or(0.9);
                self.capacity().is_none_or(|c| outside as f64 >= c as f64 * (1.0 - util))
            }
            _ => false,
        }
    }

    /// The in-flight request that received far more than the others (4x their median), if any.
    fn one_much_larger<'r>(&self, in_flight: &[&'r crate::model::Request]) -> Option<&'r crate::model::Request> {
        if in_flight.len() < 2 {
            return None;
        }
        let mut sizes: Vec<u64> = in_flight.iter().map(|r| r.bytes_in).collect();
        sizes.sort();
        let largest = *sizes.last()?;
        let median_of_rest = sizes[(sizes.len() - 1) / 2];
        (largest >= median_of_rest.max(1).saturating_mul(4)).then(|| *in_flight.iter().max_by_key(|r| r.bytes_in).unwrap())
    }

    fn inconclusive(&self, f: &Failure, why: String) -> Diagnosis {
        Diagnosis {
            category: Category::Inconclusive,
            symptom: f.symptom,
            ts: Some(f.ts.saturating_sub(self.start())),
            pid: Some(f.pid),
            service: self.services.of(f.pid).map(|s| s.name.clone()),
            evidence: Said { fields: json!({"lost_records": self.lost}), text: why },
            fix: Said {
                fields: json!({}),
                text: "Record again with nothing lost (a larger ring buffer, fewer traced processes) to decide.".into(),
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn fix(
        &self,
        category: Category,
        f: &Failure,
        service: &Service,
        engine: &[String],
        in_flight: &[&crate::model::Request],
        own: u64,
        outside: u64,
        free: Option<u64>,
        holders: &[Value],
    ) -> Said {
        let vllm = engine.iter().any(|a| a.contains("vllm"));
        match category {
            Category::HeldByOtherProcess => {
                let biggest = holders.iter().max_by_key(|h| h["bytes"].as_u64().unwrap_or(0)).cloned().unwrap_or(json!({}));
                let pid = biggest["pid"].as_u64().unwrap_or(0);
                Said {
                    text: format!(
                        "Stop pid {pid} (`{}`), which holds {} outside this server: `kill {pid}`. Then start the server again.",
                        biggest["command"].as_str().unwrap_or("?"),
                        bytes(biggest["bytes"].as_u64().unwrap_or(outside))
                    ),
                    fields: json!({"kill": pid, "holders": holders, "held_outside_bytes": outside}),
                }
            }
            Category::DoesNotFitAtLoad => {
                let wanted = own.saturating_add(f.bytes.unwrap_or(0));
                let params = wanted as f64 / 2.0 / 1e9;
                let shortfall = f.bytes.unwrap_or(0).saturating_sub(free.unwrap_or(0));
                // A smaller reserve helps only when the model itself fit: vLLM refusing at start
                // (its budget exceeds what is free), or a failure after the weights were loaded.
                let reserve = if vllm && f.symptom == Symptom::StartupRefusal {
                    let util: f64 = flag(engine, &["--gpu-memory-utilization"]).and_then(|v| v.parse().ok()).unwrap_or(0.9);
                    let fits = self.capacity().zip(free).map(|(c, free)| (free as f64 / c as f64 * 100.0).floor() / 100.0);
                    fits.map(|u| format!("; or lower --gpu-memory-utilization from {util} to {u}, what is free")).unwrap_or_default()
                } else if !vllm && own > f.bytes.unwrap_or(u64::MAX) {
                    let ctx = flag(engine, &["-c", "--ctx-size", "--ctx"]).unwrap_or_else(|| "its default".into());
                    format!("; the weights fit, so a smaller context reserve may: lower -c (now {ctx})")
                } else {
                    String::new()
                };
                Said {
                    text: format!(
                        "Loading needed at least {} ({:.1}B parameters at FP16) on a {} card: use a smaller model or quantize it (about {} at 8-bit, {} at 4-bit){reserve}.",
                        bytes(wanted),
                        params,
                        self.capacity().map(bytes).unwrap_or_else(|| "?".into()),
                        bytes(wanted / 2),
                        bytes(wanted / 4)
                    ),
                    fields: json!({"load_bytes": wanted, "parameters_fp16_billions": (params * 10.0).round() / 10.0, "bytes_8bit": wanted / 2, "bytes_4bit": wanted / 4, "shortfall_bytes": shortfall}),
                }
            }
            Category::LongRequest => {
                let culprit = self.one_much_larger(in_flight).or_else(|| in_flight.first().copied());
                let failed_in = culprit.map(|r| r.bytes_in).unwrap_or(0);
                let served = self
                    .model
                    .requests
                    .iter()
                    .filter(|r| service.pids.contains(&r.pid) && r.first_data_at.is_some_and(|d| d < f.ts))
                    .map(|r| r.bytes_in)
                    .max()
                    .unwrap_or(0);
                let flag_text = if vllm {
                    "--max-model-len".to_string()
                } else {
                    match flag(engine, &["-c", "--ctx-size", "--ctx"]) {
                        Some(c) => {
                            let suggested = (c.parse::<f64>().unwrap_or(0.0) * served as f64 / failed_in.max(1) as f64) as u64;
                            format!("-c (now {c}; about {suggested} keeps the longest prompt that was served)")
                        }
                        None => "-c".into(),
                    }
                };
                Said {
                    text: format!(
                        "One request of {} received failed while prompts up to {} were served: lower the maximum context ({flag_text}) so requests that long are refused cleanly instead of failing the server.",
                        bytes(failed_in),
                        bytes(served)
                    ),
                    fields: json!({"failed_request_bytes": failed_in, "largest_served_request_bytes": served, "flag": if vllm { "--max-model-len" } else { "-c" }}),
                }
            }
            Category::ConcurrentLoad => {
                let prefill = |a: &&crate::model::Allocation| {
                    a.memory == Memory::Video && service.pids.contains(&a.pid) && self.services.phase(service, a.ts) == Phase::Prefill
                };
                let prefill_live: u64 = self
                    .model
                    .allocations
                    .iter()
                    .filter(prefill)
                    .filter(|a| a.ts <= f.ts && a.freed.is_none_or(|(t, _)| t > f.ts))
                    .map(|a| a.bytes)
                    .fold(0, u64::saturating_add);
                // What one request costs: what a prefill allocated while it was alone in flight.
                let mut alone: BTreeMap<u64, u64> = BTreeMap::new();
                // The timeline's count rules most allocations out without looking at requests.
                for a in self.model.allocations.iter().filter(prefill).filter(|a| a.ts < f.ts) {
                    if self.services.in_flight_count(service, a.ts) != 1 {
                        continue;
                    }
                    if let [only] = self.services.in_flight(service, a.ts)[..] {
                        crate::model::add(alone.entry(only.arrived).or_default(), a.bytes);
                    }
                }
                let n = in_flight.len().max(1) as u64;
                let measured = alone.values().copied().max();
                let per_request = measured.unwrap_or(prefill_live.saturating_add(f.bytes.unwrap_or(0)) / n).max(1);
                let room = free.unwrap_or(0).saturating_add(prefill_live);
                let cap = (room / per_request).clamp(1, n.saturating_sub(1).max(1));
                let flag_text = if vllm { format!("--max-num-seqs {cap}") } else { format!("-np {cap}") };
                let how = if measured.is_some() { "one request alone needed" } else { "the batch needed, per request," };
                Said {
                    text: format!(
                        "{n} requests were in flight; {how} {}, and {} was free for requests: cap concurrency at {cap} ({flag_text}, or LiteLLM max_parallel_requests: {cap} in front of it).",
                        bytes(per_request),
                        bytes(room)
                    ),
                    fields: json!({"in_flight": n, "bytes_per_request": per_request, "per_request_measured_alone": measured.is_some(), "room_bytes": room, "max_concurrency": cap, "flag": flag_text, "litellm_max_parallel_requests": cap}),
                }
            }
            Category::HostOom => Said {
                text: format!(
                    "The kernel's OOM killer killed pid {}: host memory ran out, not the GPU's (on unified-memory machines GPU memory is host RAM). Give it more host memory (the cgroup's limit), or load a smaller or quantized model{}.",
                    f.pid,
                    if vllm { ", or lower --gpu-memory-utilization" } else { "" }
                ),
                fields: json!({"killed_pid": f.pid}),
            },
            Category::None | Category::Inconclusive => Said { fields: json!({}), text: String::new() },
        }
    }
}
