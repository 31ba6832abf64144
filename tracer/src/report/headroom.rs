//! Headroom in words: a line per serving service and GPU (the report's HEADROOM, the watch's
//! warning of a limit past what fits), each limit with the value to set, the LiteLLM deployments
//! in front by name.

use crate::analysis::cost::BYTES_PER_TOKEN;
use crate::analysis::headroom::{Bound, Headroom, KeptRate, Limit, Moment};
use crate::analysis::proxy::{counts, share, Front};
use crate::units::{bytes, one_line};

/// A limit: what it lets in against what memory takes, and the value to set.
pub fn limit(l: &Limit) -> String {
    let (setting, value, fits, cap) = (&l.setting, l.value, l.fits, l.cap);
    let slots = l.slots;
    match l.bounds {
        Bound::Concurrency if !l.proxies.is_empty() => {
            let fronts = &l.proxies;
            let each: Vec<String> = fronts
                .iter()
                .map(|f| {
                    let workers = if f.workers > 1 { format!(" in each of {} workers", f.workers) } else { String::new() };
                    format!("{} ({} by its `{}`{workers}, on port {})", front_name(f), f.max_parallel_requests.unwrap_or(0), f.limit_from, f.port)
                })
                .collect();
            let (verb, place) = if fronts.len() > 1 { ("let", "in each") } else { ("lets", "there") };
            let counts = if fronts.iter().any(|f| f.workers > 1) { " (each worker keeps its own count)" } else { "" };
            format!(
                "{} {verb} {value} requests at once through to it; memory fits {fits} of the largest served: set `max_parallel_requests: {}` {place}{counts}{}",
                each.join(" and "),
                share(fronts, cap),
                past_any_share(fronts, cap)
            )
        }
        Bound::Concurrency => format!("`{setting} {value}` lets {value} run at once; memory fits {fits} of the largest served: cap at {cap}"),
        Bound::Context if slots > 1 => format!(
            "`{setting} {value}` lets each of its {slots} slots take a prompt of {} tokens; memory fits one of {fits} alone (at {BYTES_PER_TOKEN} bytes a token): set it to {cap}",
            l.lets_in()
        ),
        Bound::Context => format!(
            "`{setting} {value}` lets in a prompt of {value} tokens; memory fits one of {fits} alone (at {BYTES_PER_TOKEN} bytes a token): set it to {cap}"
        ),
        Bound::BatchTokens => format!(
            "`{setting} {value}` lets {value} tokens into one batch; memory fits {fits} at once (at {BYTES_PER_TOKEN} bytes a token): set it to {cap}"
        ),
    }
}

/// One line: what a request costs, how many more fit now, and when it was tightest.
pub fn line(h: &Headroom) -> String {
    let gpu = h.gpu.map(|g| format!(" on GPU {g}")).unwrap_or_default();
    let size = bytes(h.largest_request_bytes);
    let how = if h.measured_alone { "measured alone" } else { "the batch's share" };
    let mut line = format!("`{}`{gpu}: a request of {size} (the largest served) costs {} ({how})", h.service, bytes(h.request_cost_bytes));
    let at = |m: &Moment| {
        format!(
            "{} fit at once in {} of room, {} more beside the {} in flight; the largest request that fits alone is {}",
            m.fit_at_once,
            bytes(m.room_bytes),
            m.more_requests,
            m.in_flight,
            bytes(m.largest_fitting_request_bytes)
        )
    };
    if let Some(now) = &h.now {
        line += &format!("; now {}", at(now));
    }
    if h.now.as_ref() != Some(&h.tightest) {
        line += &format!("; at its tightest, at {:.2} s, {}", h.tightest.ts as f64 / 1e9, at(&h.tightest));
    }
    for l in &h.limits_exceeded {
        line += &format!(". {}", limit(l));
    }
    if let Some(k) = h.kept.filter(|k| k.bytes_per_request > 0) {
        line += &format!(". It {}", kept(&k));
    }
    line
}

/// Headroom as a table for the terminal: per service and GPU, what the largest request served
/// costs, how many fit now and at the tightest moment, and the largest request that fits alone;
/// under each row, its limits past what fits and what it keeps, one line each.
pub fn table(all: &[Headroom]) -> String {
    let mut out = format!(
        "{:<10}{:<5}{:>11}{:>19}{:>9}{:>18}{:>15}  SERVICE\n",
        "HEADROOM", "GPU", "REQUEST", "COSTS", "FIT NOW", "AT TIGHTEST", "LARGEST ALONE"
    );
    for h in all {
        let how = if h.measured_alone { "alone" } else { "batch" };
        let now = h.now.as_ref().map_or_else(|| "-".to_string(), |n| n.fit_at_once.to_string());
        let tightest = format!("{} at {:.2} s", h.tightest.fit_at_once, h.tightest.ts as f64 / 1e9);
        // Its program and sizing flags, as the verdict's location names it.
        let words: Vec<String> = h.service.split_whitespace().map(String::from).collect();
        let service = super::reasons::short_command(&words);
        out += &format!(
            "{:<10}{:<5}{:>11}{:>19}{:>9}{:>18}{:>15}  {service}\n",
            "",
            h.gpu.map_or_else(|| "?".to_string(), |g| g.to_string()),
            bytes(h.largest_request_bytes),
            format!("{} ({how})", bytes(h.request_cost_bytes)),
            now,
            tightest,
            bytes(h.tightest.largest_fitting_request_bytes)
        );
        for l in &h.limits_exceeded {
            out += &format!("  limit: {}\n", limit(l));
        }
        if let Some(k) = h.kept.filter(|k| k.bytes_per_request > 0) {
            out += &format!("  keeps: it {}\n", kept(&k));
        }
    }
    out
}

/// The watch's warning that a service keeps memory: "`vllm serve m` on GPU 0 keeps ...".
pub fn keeping(h: &Headroom) -> Option<String> {
    let k = h.kept.filter(|k| k.bytes_per_request > 0)?;
    let gpu = h.gpu.map(|g| format!(" on GPU {g}")).unwrap_or_default();
    Some(format!("`{}`{gpu} {}", h.service, kept(&k)))
}

/// What a service keeps, and when it runs out at that rate: "keeps 256.0 MiB a request ...".
fn kept(k: &KeptRate) -> String {
    let since = if k.since_attaching { "since tracing began" } else { "since it was ready" };
    let mut text = format!(
        "keeps {} a request and gives none back (a cache with no bound, or a leak): {} {since}, over {} requests",
        bytes(k.bytes_per_request),
        bytes(k.kept_bytes),
        k.requests
    );
    if let Some(n) = k.requests_until_full {
        text += &format!("; at that rate {n} more requests of the largest size fit before one fails");
        if let Some(s) = k.seconds_until_full {
            text += &format!(", {} at the recent request rate", duration(s));
        }
    }
    text
}

/// "45 s", "12 min", "3.5 h".
fn duration(seconds: f64) -> String {
    if seconds < 120.0 {
        format!("{seconds:.0} s")
    } else if seconds < 7200.0 {
        format!("{:.0} min", seconds / 60.0)
    } else {
        format!("{:.1} h", seconds / 3600.0)
    }
}

/// "LiteLLM (pid 77 of uid 0, /srv/litellm.yaml, 4 workers) deployment `local-llama`".
pub fn front_name(f: &Front) -> String {
    let (config, model) = (one_line(&f.config), one_line(&f.model));
    let workers = if f.workers > 1 { format!(", {} workers", f.workers) } else { String::new() };
    format!("LiteLLM (pid {} of uid {}, {config}{workers}) deployment `{model}`", f.pid, f.uid)
}

/// Where even a share of one in each lets more through than `cap`: what to say of it.
pub fn past_any_share(fronts: &[Front], cap: u64) -> String {
    let counts = counts(fronts);
    if counts > cap {
        format!(" (even that lets {counts} through, one in each of {counts} counts, past the {cap} that fit: fewer deployments or workers)")
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::proxy::tests::front;

    /// Where even one request in each of a proxy's counts lets more through than fits, it says so.
    #[test]
    fn a_share_of_one_past_what_fits_is_said() {
        assert!(past_any_share(&[front(Some(10), 8)], 3).contains("even that lets 8 through, one in each of 8 counts, past the 3 that fit"));
        assert_eq!(past_any_share(&[front(Some(10), 3)], 3), "");
    }
}
