//! whatif in words: the outcome of a replay, and why one cannot be made.

use crate::analysis::whatif::{Outcome, WhyNot};
use crate::analysis::Category;
use crate::units::bytes;

/// The outcome: FITS or OOM, where and by how much, the load before and after; what fits with
/// `--search`.
pub fn outcome(o: &Outcome) -> String {
    let gpu = match (o.gpu, o.settings.tensor_parallel) {
        (Some(g), Some(1)) => format!(" on GPU {g}, the one it is on"),
        (Some(g), Some(n)) => format!(" on GPU {g} (one of the {n} it is sharded over; the others' holders are not judged)"),
        (None, Some(n)) => format!(" on each of the {n} GPUs it is sharded over"),
        (Some(g), None) => format!(" on GPU {g}"),
        (None, None) => String::new(),
    };
    let at_least = if o.load_complete && !o.weights_at_least { "" } else { "at least " };
    let load = format!(
        "{at_least}weights {} -> {}, KV cache {} -> {}",
        bytes(o.weights_bytes),
        bytes(o.weights_after_bytes),
        bytes(o.kv_bytes),
        bytes(o.kv_after_bytes)
    );
    let refused = if o.refused > 0 { format!("; {} request(s) past the context refused cleanly", o.refused) } else { String::new() };
    let tried = tried(o);
    let mut out = match (o.category, o.failing_request) {
        (Category::None, _) => format!(
            "FITS {tried}: `{}`{gpu} serves every recorded request, with {} to spare at the tightest moment; peak {} ({load}){refused}.",
            o.service,
            bytes(o.margin_bytes.max(0) as u64),
            bytes(o.peak_bytes)
        ),
        (category, Some(n)) => format!(
            "OOM {tried}: `{}`{gpu} would fail at request {n} ({} received, at {:.2} s), short by {}: {} ({load}){refused}.",
            o.service,
            bytes(o.failing_request_bytes.unwrap_or(0)),
            o.failing_ts.unwrap_or(0) as f64 / 1e9,
            bytes(o.margin_bytes.unsigned_abs()),
            category.name()
        ),
        (category, None) => format!(
            "OOM {tried}: `{}`{gpu} would fail loading, short by {}: {} ({load}).",
            o.service,
            bytes(o.margin_bytes.unsigned_abs()),
            category.name()
        ),
    };
    if let (Some(names), Some(c)) = (o.kv_unscaled, o.settings.max_context) {
        out += &format!(
            "\nNOTE: the recorded command line does not say its context ({}), so the KV cache is replayed as recorded: a context of {c} below the one it ran with only shrinks it, and leaves more room than replayed; above it, less.",
            if names.is_empty() { "its server takes it from the environment".to_string() } else { format!("{}; llama-server's default is the model's own", names.join(", ")) }
        );
    }
    if let Some(s) = &o.search {
        let shared = match s.context_slots {
            1 => String::new(),
            slots => {
                format!(" a request (a context setting of {}, shared by {slots} slots)", s.max_context_tokens.saturating_mul(slots))
            }
        };
        out += &if s.max_concurrency == 0 || s.max_context_tokens == 0 {
            "\nSEARCH: under these settings not one request of the largest size served fits, at any concurrency or context: the load leaves too little room (try --quantize, --gpu-memory-utilization or a larger --capacity)".to_string()
        } else {
            format!(
                "\nSEARCH: at most {} requests of the largest size at once; a context of at most {} tokens{shared}.",
                s.max_concurrency, s.max_context_tokens
            )
        };
    }
    out
}

/// The settings tried, as given: "with --max-num-seqs 2, -c 2048", or "as recorded".
fn tried(o: &Outcome) -> String {
    let s = &o.settings;
    let given = [
        s.max_concurrency.map(|n| format!("--max-num-seqs {n}")),
        s.max_context.map(|n| format!("-c {n}")),
        s.utilization.map(|u| format!("--gpu-memory-utilization {u}")),
        s.quantize.map(|b| format!("--quantize {b}")),
        s.capacity.map(|c| format!("--capacity {}", bytes(c))),
        s.tensor_parallel.map(|n| format!("--tensor-parallel {n}")),
    ];
    let given: Vec<String> = given.into_iter().flatten().collect();
    if given.is_empty() {
        "as recorded".into()
    } else {
        format!("with {}", given.join(", "))
    }
}

/// Why no replay can be made of a trace.
pub fn why_not(why: &WhyNot) -> String {
    match why {
        WhyNot::NothingToReplay => {
            "no service served a request with its cost measured (what it allocated during a prefill), so there is nothing to replay".into()
        }
        WhyNot::CapacityUnknown => "the GPU's size is not in the trace: give it with --capacity".into(),
        WhyNot::KeptByService => "the failure was memory the server keeps request after request (kept-by-service): no setting whatif replays bounds what it keeps, so under any of them it fails again once it has served enough requests; the report's fix says how many a fresh start serves".into(),
    }
}
