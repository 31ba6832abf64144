//! The recording's status line: events so far, the processes holding the most, records lost,
//! and the tightest headroom, in a few words.

use crate::analysis::headroom::Headroom;
use crate::model::Model;
use crate::units::{bytes, one_line};

/// "gputrace: 1200 events · 4242 vllm: 70.0 GiB · LOST 3 · headroom vllm GPU 0: 16 more, ...":
/// lost records before the headroom, as a narrow terminal cuts the line's end.
pub fn line(records: u64, model: &Model, headroom: Option<&str>) -> String {
    let mut line = format!("gputrace: {records} events");
    let mut top: Vec<_> = model.processes.values().filter(|p| p.usage.physical_live() > 0).collect();
    top.sort_by_key(|p| std::cmp::Reverse(p.usage.physical_live()));
    for p in top.iter().take(3) {
        let name = p.command.first().map(|c| c.rsplit('/').next().unwrap_or(c)).unwrap_or("?");
        line += &format!(" · {} {}: {}", p.pid, one_line(name), bytes(p.usage.physical_live()));
    }
    if model.lost_records > 0 {
        line += &format!(" · LOST {}", model.lost_records);
    }
    if let Some(headroom) = headroom {
        line += &format!(" · {headroom}");
    }
    line
}

/// For the status line: the serving service with the fewest more requests fitting now, in a few
/// words ("headroom vllm GPU 0: 16 more, 142.0 KiB alone"); with a limit past it, the cap.
pub fn headroom(headroom: &[Headroom]) -> Option<String> {
    let h = headroom.iter().filter(|h| h.now.is_some()).min_by_key(|h| h.now.map(|m| (m.more_requests, m.room_bytes)))?;
    let now = h.now?;
    let name = h.service.split_whitespace().next().map_or("?", |c| c.rsplit('/').next().unwrap_or(c));
    let gpu = h.gpu.map(|g| format!(" GPU {g}")).unwrap_or_default();
    let mut text =
        format!("headroom {}{gpu}: {} more, {} alone", one_line(name), now.more_requests, bytes(now.largest_fitting_request_bytes));
    if let Some(l) = h.limits_exceeded.first() {
        text += &format!(" (set {} {})", l.setting, l.cap);
    }
    // A service that keeps memory: when it runs out at that rate, the service's own.
    let keeping = headroom.iter().filter_map(|h| Some((h, h.kept?.requests_until_full?))).min_by_key(|(_, n)| *n);
    if let Some((k, n)) = keeping {
        let name = k.service.split_whitespace().next().map_or("?", |c| c.rsplit('/').next().unwrap_or(c));
        let each = k.kept.map_or(0, |r| r.bytes_per_request);
        text += &format!(" · {} keeps {} a request: full in {n} requests", one_line(name), bytes(each));
    }
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::headroom::{Bound, Limit, Moment};

    fn served(service: &str, more: Option<u64>) -> Headroom {
        let moment = |more_requests| Moment {
            ts: 1,
            room_bytes: 8 << 30,
            in_flight: 1,
            fit_at_once: more_requests + 1,
            more_requests,
            largest_fitting_request_bytes: 142 << 10,
        };
        Headroom {
            service: service.into(),
            pid: 7,
            gpu: Some(0),
            measured_pool_bytes: 1 << 29,
            measured_request_bytes: 8_000,
            measured_alone: true,
            largest_request_bytes: 8_000,
            request_cost_bytes: 1 << 29,
            now: more.map(moment),
            tightest: moment(0),
            limits_exceeded: vec![],
            kept: None,
        }
    }

    #[test]
    fn the_status_line_shows_the_service_with_the_least_headroom_now() {
        assert_eq!(headroom(&[]), None);
        assert_eq!(headroom(&[served("gone", None)]), None, "a server gone has no headroom now");
        let mut tight = served("/usr/bin/vllm serve m --max-num-seqs 256", Some(3));
        tight.limits_exceeded = vec![Limit {
            setting: "--max-num-seqs".into(),
            value: 256,
            bounds: Bound::Concurrency,
            fits: 4,
            cap: 4,
            slots: 1,
            proxies: vec![],
        }];
        let shown = headroom(&[served("llama-server -m m", Some(16)), tight, served("gone", None)]);
        assert_eq!(shown.as_deref(), Some("headroom vllm GPU 0: 3 more, 142.0 KiB alone (set --max-num-seqs 4)"));
    }

    #[test]
    fn the_status_line_says_when_a_server_that_keeps_memory_runs_out() {
        let mut keeping = served("llama-server -m m", Some(16));
        let rate = crate::analysis::headroom::KeptRate {
            bytes_per_request: 256 << 20,
            kept_bytes: 1 << 30,
            requests: 4,
            since_attaching: false,
            requests_until_full: Some(9),
            seconds_until_full: Some(30.0),
        };
        keeping.kept = Some(rate);
        let shown = headroom(&[served("vllm serve m", Some(3)), keeping]);
        assert_eq!(
            shown.as_deref(),
            Some("headroom vllm GPU 0: 3 more, 142.0 KiB alone · llama-server keeps 256.0 MiB a request: full in 9 requests")
        );
    }
}
