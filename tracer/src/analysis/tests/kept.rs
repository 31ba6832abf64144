//! kept-by-service: memory a service keeps request after request, told apart from a pool that
//! grows to the largest load and stays, and from a warm-up that stops.

use super::super::diagnosis::preconditions;
use super::super::kept::measure;
use super::*;

const MIB: u64 = 1 << 20;
/// What every request of these traces received, but the ones said otherwise.
const PROMPT: u64 = 6_000;

/// Requests of `sizes` served one at a time from 200 ms, 100 ms apart, the i-th allocating
/// `grows(i)` in its prefill, never freed. Returns when the next may come.
fn served(t: &mut Trace, sizes: &[u64], grows: impl Fn(usize) -> u64) -> u64 {
    let mut ts = 200 * MS;
    for (i, &bytes) in sizes.iter().enumerate() {
        let conn = 10 + i as u64;
        t.request(conn, ts, bytes, Some(ts + 30 * MS));
        if grows(i) > 0 {
            t.alloc(ts + 10 * MS, ENGINE, grows(i), 0);
        }
        t.at(ts + 60 * MS, API, Event::ConnClose { conn });
        ts += 100 * MS;
    }
    ts
}

/// A request of `bytes` at `ts`, alone in flight, whose allocation of `asked` fails.
fn fails(t: &mut Trace, ts: u64, bytes: u64, asked: u64) {
    t.request(999, ts, bytes, None);
    t.alloc(ts + 10 * MS, ENGINE, asked, 0x51);
}

/// vLLM with 16 GiB of weights serving 15 requests alike: the first sizes its 1 GiB workspace,
/// each keeps 256 MiB; the 16th (of `failing` bytes) finds 128 MiB free and fails on its entry.
fn keeping(failing: u64) -> (Trace, u64) {
    let mut t = Trace::vllm(16 * GIB);
    let next = served(&mut t, &[PROMPT; 15], |i| if i == 0 { GIB + 256 * MIB } else { 256 * MIB });
    fails(&mut t, next, failing, 256 * MIB);
    (t, 17 * GIB + 15 * 256 * MIB + 128 * MIB)
}

#[test]
fn a_server_that_keeps_memory_per_request_is_kept_by_service_never_a_context_cap() {
    let (mut t, capacity) = keeping(PROMPT);
    let d = &t.diagnose(capacity, &[], 0)[0];
    assert_eq!((d.category, d.symptom, d.pid), (Category::KeptByService, Symptom::FailedAllocation, Some(ENGINE)), "{}", d.fix.text);
    let kept = &d.evidence.fields["kept"];
    // The first request's entry is in with its workspace (the pool's first growth): not counted.
    assert_eq!(kept["kept_bytes"], 14 * 256 * MIB, "{kept:#}");
    assert_eq!((kept["kept_over_requests"].as_u64(), kept["requests_served"].as_u64()), (Some(14), Some(15)));
    assert_eq!(kept["kept_per_request_bytes"], 256 * MIB);
    assert_eq!(kept["ready_bytes"], 16 * GIB);
    assert_eq!(kept["now_bytes"], 17 * GIB + 15 * 256 * MIB);
    assert_eq!((kept["largest_served_load_bytes"].as_u64(), kept["failing_load_bytes"].as_u64()), (Some(PROMPT), Some(PROMPT)));
    assert_eq!(kept["allocations"]["count"], 14);
    assert_eq!(kept["allocations"]["by_phase"], serde_json::json!([["prefill", 14]]));
    assert_eq!(kept["since_attaching"], false);
    let fix = &d.fix.fields;
    assert_eq!((fix["per_request_bytes"].as_u64(), fix["requests_from_fresh_start"].as_u64()), (Some(256 * MIB), Some(15)));
    assert_eq!(fix["restart_frees_bytes"], 14 * 256 * MIB);
    for cap in ["--max-model-len", "--max-num-seqs", "max_parallel_requests", "-c "] {
        assert!(!d.fix.text.contains(cap), "no context or concurrency cap for this cause: {}", d.fix.text);
    }
    assert!(d.fix.text.contains("256.0 MiB a request") && d.fix.text.contains("about 15 requests"), "{}", d.fix.text);
    assert!(d.evidence.text.contains("no more than the 5.9 KiB served before it"), "{}", d.evidence.text);
}

#[test]
fn the_fix_names_a_cache_bound_the_command_line_sets() {
    let (mut t, capacity) = keeping(PROMPT);
    let command: Vec<String> = "vllm serve m --prompt-cache-size 4096".split(' ').map(String::from).collect();
    if let Event::Process { command: c, .. } = &mut t.0[0].event {
        *c = command;
    }
    let d = &t.diagnose(capacity, &[], 0)[0];
    assert_eq!(d.category, Category::KeptByService);
    assert_eq!((d.fix.fields["flag"].as_str(), d.fix.fields["value"].as_str()), (Some("--prompt-cache-size"), Some("4096")));
    assert!(d.fix.text.contains("lower `--prompt-cache-size` (now 4096)"), "{}", d.fix.text);
}

#[test]
fn a_pool_that_grows_to_the_largest_request_and_stays_keeps_nothing() {
    let mut t = Trace::vllm(16 * GIB);
    // Eight of growing size, each growing the pool to its own; then eight no larger: no growth.
    let sizes: Vec<u64> = (1..=8).map(|i| i * 1_000).chain([4_000; 8]).collect();
    let next = served(&mut t, &sizes, |i| if i < 8 { 100 * MIB } else { 0 });
    fails(&mut t, next, 40_000, 4 * GIB);
    let d = &t.diagnose(24 * GIB, &[], 0)[0];
    assert_eq!(d.category, Category::LongRequest, "{}", d.evidence.text);
    let (header, model) = (header(24 * GIB, &[]), Model::from_records(&t.0));
    let accounts = Accounts::new(&header, &model);
    let k = measure(&accounts, &accounts.services.list[0], Some(0), next).expect("served");
    assert!(!k.keeps() && k.kept_bytes == 0, "{k:?}");
    no_forecast(&header, &model);
}

/// Headroom, and so /metrics, has no forecast of running out for the service.
fn no_forecast(header: &Header, model: &Model) {
    let rows = super::super::headroom::headroom(&Accounts::new(header, model));
    assert!(!rows.is_empty(), "a serving service has headroom");
    assert!(rows.iter().all(|h| h.kept.is_some_and(|k| k.bytes_per_request == 0 && k.requests_until_full.is_none())), "{rows:?}");
}

#[test]
fn a_warm_up_that_stops_keeps_nothing() {
    let mut t = Trace::vllm(16 * GIB);
    // The first four alike allocate (graphs captured lazily, a cache warming), then twelve do not.
    let next = served(&mut t, &[PROMPT; 16], |i| if i < 4 { 200 * MIB } else { 0 });
    fails(&mut t, next, PROMPT, GIB);
    let d = &t.diagnose(17 * GIB, &[], 0)[0];
    assert_ne!(d.category, Category::KeptByService, "{}", d.fix.text);
    let (header, model) = (header(17 * GIB, &[]), Model::from_records(&t.0));
    let accounts = Accounts::new(&header, &model);
    let k = measure(&accounts, &accounts.services.list[0], Some(0), next).expect("served");
    assert_eq!((k.rises, k.recent_rises), (3, 0), "{k:?}");
    assert!(!k.keeps());
    no_forecast(&header, &model);
}

#[test]
fn a_request_far_larger_than_any_served_is_long_even_at_a_server_that_keeps_memory() {
    let (mut t, capacity) = keeping(10 * PROMPT);
    let d = &t.diagnose(capacity, &[], 0)[0];
    assert_eq!(d.category, Category::LongRequest, "{}", d.evidence.text);
}

#[test]
fn attached_to_a_server_already_keeping_the_growth_is_since_attaching() {
    let (mut t, capacity) = keeping(PROMPT);
    for r in &mut t.0 {
        if let Event::Process { seen, .. } = &mut r.event {
            *seen = Seen::Running;
        }
    }
    // NVML counted 2 GiB for the engine when tracing began: what it had kept before.
    let d = &t.diagnose(capacity + 2 * GIB, &[(ENGINE, 2 * GIB)], 0)[0];
    assert_eq!(d.category, Category::KeptByService, "{}", d.evidence.text);
    assert_eq!(d.evidence.fields["kept"]["since_attaching"], true);
    assert!(d.evidence.text.contains("when tracing began (it was serving already)"), "{}", d.evidence.text);
    // From a fresh start: the 128 MiB free and the 14 entries kept since, at 256 MiB each.
    assert_eq!(d.fix.fields["requests_from_fresh_start"], 14);
}

/// A watch compacts its model, which forgets ended requests (but those whose prefill made memory
/// still live): what it fed its series before carries the rest, so a dump's header gives the
/// figures of the whole. Here each request keeps its entry after its first data (in decode), so
/// compaction forgets every request but the first.
#[test]
fn a_watch_s_series_carries_what_compaction_forgets() {
    let mut t = Trace::vllm(16 * GIB);
    let mut ts = 200 * MS;
    for i in 0..15u64 {
        let conn = 10 + i;
        t.request(conn, ts, PROMPT, Some(ts + 30 * MS));
        if i == 0 {
            t.alloc(ts + 10 * MS, ENGINE, GIB, 0);
        }
        t.alloc(ts + 40 * MS, ENGINE, 256 * MIB, 0);
        t.at(ts + 60 * MS, API, Event::ConnClose { conn });
        ts += 100 * MS;
    }
    fails(&mut t, ts, PROMPT, 256 * MIB);
    t.0.sort_by_key(|r| r.ts);
    let capacity = 17 * GIB + 15 * 256 * MIB + 128 * MIB;
    let whole = Model::from_records(&t.0);
    let plain = header(capacity, &[]);
    let kept_of = |h: &Header, m: &Model| {
        let accounts = Accounts::new(h, m);
        let service = &accounts.services.list[0];
        measure(&accounts, service, Some(0), u64::MAX).map(|k| (k.kept_bytes, k.requests, k.rises, k.now.served, k.ready))
    };
    let expected = kept_of(&plain, &whole).expect("served");
    assert_eq!((expected.0, expected.1, expected.2, expected.3), (14 * 256 * MIB, 14, 14, 15));
    // Cut at rest after the eighth request: the watch feeds its series, then compacts.
    let cut = 200 * MS + 7 * 100 * MS + 80 * MS;
    let (before, after) = t.0.split_at(t.0.partition_point(|r| r.ts <= cut));
    let first = Model::from_records(before);
    let mut history = Vec::new();
    super::super::kept::feed(&mut history, &Accounts::new(&plain, &first), cut);
    assert_eq!(history.len(), 1, "{history:?}");
    let mut compacted = Model::from_records(&first.snapshot());
    for r in after {
        compacted.apply(r);
    }
    let forgot = kept_of(&plain, &compacted).expect("served");
    assert!(forgot.1 < 14, "compaction forgot the ended requests: {forgot:?}");
    let carried = Header { rest_history: history, ..plain.clone() };
    assert_eq!(kept_of(&carried, &compacted), Some(expected), "the series and the model after it make the whole");
    // And the dump's verdict is the whole's.
    let d = &diagnosed(&carried, &compacted, 0)[0];
    assert_eq!(d.category, Category::KeptByService, "{}", d.evidence.text);
    assert_eq!(d.evidence.fields["kept"]["kept_bytes"], 14 * 256 * MIB);
}

/// Before it fails: headroom says what the server keeps a request and how many more of the
/// largest served fit at that rate, and what it keeps is held, not room in its pool.
#[test]
fn headroom_forecasts_when_a_server_that_keeps_memory_runs_out() {
    // 1152 MiB free after the fifteenth: four more entries of 256 MiB fit, the fifth does not.
    let mut t = Trace::vllm(16 * GIB);
    served(&mut t, &[PROMPT; 15], |i| if i == 0 { GIB + 256 * MIB } else { 256 * MIB });
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let h = header(17 * GIB + 15 * 256 * MIB + 1152 * MIB, &[]);
    let rows = super::super::headroom::headroom(&Accounts::new(&h, &model));
    let row = &rows[0];
    let k = row.kept.expect("measured");
    assert_eq!((k.bytes_per_request, k.requests_until_full), (256 * MIB, Some(4)), "{k:?}");
    // Ten requests a second: four more in 0.4 s.
    assert_eq!(k.seconds_until_full, Some(0.4));
    // A request costs its workspace (and the first entry, in with it), not every entry kept.
    assert_eq!(row.request_cost_bytes, GIB + 256 * MIB);
    let said = crate::report::headroom::line(row);
    assert!(said.contains("It keeps 256.0 MiB a request") && said.contains("at that rate 4 more requests"), "{said}");
}

/// A server that gives everything back: 0 kept a request, and no forecast.
#[test]
fn headroom_of_a_server_that_keeps_nothing_has_no_forecast() {
    let mut t = Trace::vllm(16 * GIB);
    served(&mut t, &[PROMPT; 8], |i| if i == 0 { GIB } else { 0 });
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let h = header(24 * GIB, &[]);
    let rows = super::super::headroom::headroom(&Accounts::new(&h, &model));
    let k = rows[0].kept.expect("measured");
    assert_eq!((k.bytes_per_request, k.requests_until_full, k.seconds_until_full), (0, None, None));
    assert!(!crate::report::headroom::line(&rows[0]).contains("keeps"));
}

/// A dump's header is one line of at most `trace::MAX_LINE`: the history it carries at its
/// fullest, every figure at its widest, stays well under it.
#[test]
fn the_history_a_dump_carries_fits_its_header_line() {
    use crate::trace::{AtRest, Folded, RestSeries, Stretch};
    let widest = AtRest { ts: u64::MAX, bytes: u64::MAX, served: u64::MAX };
    let stretch = Stretch { start: u64::MAX, end: widest, delta: i64::MIN, requests: u64::MAX, larger: false };
    let full = RestSeries {
        root: u32::MAX,
        gpu: Some(u32::MAX),
        ready: widest,
        earlier: Folded { delta: i64::MIN, requests: u64::MAX, stretches: u64::MAX, rises: u64::MAX, began_at: Some(u64::MAX) },
        stretches: vec![stretch; 10_000],
        larger_spans: vec![(u64::MAX, u64::MAX); 10_000],
        largest: u64::MAX,
    };
    // A watch's own history is bounded as it is fed; a dump takes the latest series of it.
    let mut history: Vec<RestSeries> = Vec::new();
    for root in 0..200u32 {
        let mut s = RestSeries { root, stretches: Vec::new(), larger_spans: Vec::new(), ..full.clone() };
        s.extend(full.stretches.clone());
        for _ in 0..100 {
            s.extend(vec![Stretch { larger: true, ..stretch }]);
        }
        s.extend(full.stretches[..128].to_vec());
        history.push(s);
    }
    let dumped = super::super::kept::for_dump(&history);
    assert_eq!(dumped.len(), 16);
    assert!(dumped.iter().all(|s| s.stretches.len() <= 128 && s.larger_spans.len() <= 32), "bounded as fed");
    let line = serde_json::to_string(&Header { rest_history: dumped, ..Header::default() }).unwrap();
    assert!(line.len() < crate::trace::MAX_LINE / 2, "{} bytes", line.len());
}

/// A crafted dump's history (any figure, at its widest or out of order) never panics: the
/// diagnosis and headroom read it as far as it goes.
#[test]
fn a_crafted_history_never_panics() {
    use crate::trace::{AtRest, Folded, RestSeries, Stretch};
    let (mut t, capacity) = keeping(PROMPT);
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let wide = AtRest { ts: 1, bytes: u64::MAX, served: u64::MAX };
    for (delta, requests) in [(i64::MAX, u64::MAX), (i64::MIN, 0), (0, u64::MAX)] {
        let stretch = Stretch { start: 5, end: wide, delta, requests, larger: false };
        let series = RestSeries {
            root: API,
            gpu: None,
            ready: AtRest { ts: 0, ..wide },
            earlier: Folded { delta, requests, stretches: u64::MAX, rises: u64::MAX, began_at: Some(u64::MAX) },
            stretches: vec![stretch, Stretch { larger: true, ..stretch }, stretch],
            larger_spans: vec![(u64::MAX, 0); 3],
            largest: u64::MAX,
        };
        let crafted = Header { rest_history: vec![series; 100], ..header(capacity, &[]) };
        let d = diagnosed(&crafted, &model, 0);
        assert_eq!(d.len(), 1);
        let _ = super::super::headroom::headroom(&Accounts::new(&crafted, &model));
    }
}

/// whatif replays requests under other settings: of a failure that was memory the server kept,
/// it says that no such setting bounds it, instead of a replay that fits.
#[test]
fn whatif_of_memory_a_server_kept_says_no_setting_bounds_it() {
    let (mut t, capacity) = keeping(PROMPT);
    t.0.sort_by_key(|r| r.ts);
    let model = Model::from_records(&t.0);
    let settings = super::super::whatif::Settings { max_concurrency: Some(1), ..Default::default() };
    let answer = crate::report::what_if(&header(capacity, &[]), &model, 0, &settings, true);
    assert!(matches!(answer, Err(super::super::whatif::WhyNot::KeptByService)), "{:?}", answer.map(|o| o.category));
    let said = crate::report::whatif::why_not(&super::super::whatif::WhyNot::KeptByService);
    assert!(said.contains("no setting whatif replays bounds what it keeps"), "{said}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
    /// Over generated serving traces (requests of a few sizes one at a time, a pool that grows with
    /// the largest, a warm-up, memory kept per request or not, then a load that fails): no verdict
    /// whose category's preconditions fail on its own figures, and no fix that contradicts them.
    #[test]
    fn no_verdict_contradicts_its_own_figures(
        sizes in proptest::collection::vec(0usize..4, 1..24),
        keep in 0usize..3,
        warm_up in 0usize..5,
        failing in 0usize..5,
        burst in 1usize..4,
        asked_mib in 16u64..4096,
        free_mib in 0u64..4096,
    ) {
        const SIZES: [u64; 5] = [2_000, 4_000, 6_000, 8_000, 40_000];
        let kept_each = [0, 64 * MIB, 256 * MIB][keep];
        let mut t = Trace::vllm(16 * GIB);
        let (mut ts, mut pool, mut held) = (200 * MS, 0u64, 16 * GIB);
        for (i, &s) in sizes.iter().enumerate() {
            let bytes = SIZES[s];
            let conn = 10 + i as u64;
            t.request(conn, ts, bytes, Some(ts + 30 * MS));
            // The pool grows to the largest request (100 KiB a byte received, rounded to 2 MiB).
            let need = (bytes * 100 * 1024).next_multiple_of(2 * MIB);
            let grow = need.saturating_sub(pool) + if i < warm_up { 128 * MIB } else { 0 } + kept_each;
            if grow > 0 {
                t.alloc(ts + 10 * MS, ENGINE, grow, 0);
            }
            (pool, held) = (pool.max(need), held + grow);
            t.at(ts + 60 * MS, API, Event::ConnClose { conn });
            ts += 100 * MS;
        }
        for b in 0..burst {
            t.request(900 + b as u64, ts, SIZES[failing], None);
        }
        t.alloc(ts + 10 * MS, ENGINE, asked_mib * MIB, 0x51);
        let largest_served = sizes.iter().map(|&s| SIZES[s]).max().unwrap_or(0);
        // The preconditions the diagnosis checks, on each verdict's printed figures; and below,
        // the same said again in the test's own words.
        for d in t.diagnoses(held + free_mib * MIB, &[], 0) {
            proptest::prop_assert_eq!(preconditions::check(&d), Ok(()), "{:?}", d);
        }
        for d in t.diagnose(held + free_mib * MIB, &[], 0) {
            let (e, f) = (&d.evidence.fields, &d.fix.fields);
            match d.category {
                Category::KeptByService => {
                    let k = &e["kept"];
                    let (kept, load) = (k["kept_bytes"].as_u64().unwrap(), k["failing_load_bytes"].as_u64().unwrap());
                    let (free, asked) = (e["free_bytes"].as_u64().unwrap(), e["failed_bytes"].as_u64().unwrap());
                    proptest::prop_assert!(kept > 0 && k["kept_per_request_bytes"].as_u64().unwrap() > 0, "{k:#}");
                    proptest::prop_assert!(load * 8 <= k["largest_served_load_bytes"].as_u64().unwrap() * 9, "{k:#}");
                    proptest::prop_assert!(free < asked && asked <= free + kept, "{e:#}");
                    for cap in ["--max-model-len", "--max-num-seqs", "max_parallel_requests"] {
                        proptest::prop_assert!(!d.fix.text.contains(cap), "{}", d.fix.text);
                    }
                }
                Category::LongRequest => {
                    let (failed, served) = (f["failed_request_bytes"].as_u64().unwrap(), f["largest_served_request_bytes"].as_u64().unwrap());
                    proptest::prop_assert!(served == 0 || failed * 4 > served * 5, "{failed} failed against {served} served: {}", d.fix.text);
                    // The context it says to set admits the largest request served.
                    let fits = f["largest_fitting_request_bytes"].as_u64();
                    proptest::prop_assert!(fits.is_none_or(|fits| fits >= served), "{fits:?} fits, {served} served: {}", d.fix.text);
                    proptest::prop_assert_eq!(served, largest_served);
                }
                Category::ConcurrentLoad => {
                    let (cap, n) = (f["max_concurrency"].as_u64().unwrap(), f["in_flight"].as_u64().unwrap());
                    proptest::prop_assert!(cap >= 1 && cap < n, "cap {cap} of {n} in flight: {}", d.fix.text);
                    // One fits alone, and not all of them together.
                    let (per, room) = (f["bytes_per_request"].as_u64().unwrap(), f["room_bytes"].as_u64().unwrap());
                    proptest::prop_assert!(per <= room && room / per < n, "{per} a request in {room} of room, {n} in flight: {}", d.fix.text);
                }
                _ => {}
            }
        }
    }
}
