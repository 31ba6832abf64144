//! What each category claims, as conditions on the figures its verdict prints (its evidence and
//! its fix). The diagnosis gives a category only where they hold, and says which one failed
//! where none does; the tests check every verdict with these same functions.
//! docs/report-schema.md lists them as written here.

use super::{Diagnosis, Evidence, Finding, Fix, KeptEvidence};
use crate::analysis::{Category, Phase, Symptom};

/// A precondition the figures do not meet, with the figures it was checked on.
#[derive(Clone, Debug, PartialEq)]
pub enum Unmet {
    /// held-by-other-process: freeing what others hold would not have made room for the
    /// allocation (free unknown: they hold less than it asked).
    OutsideShort {
        outside_bytes: u64,
        free_bytes: Option<u64>,
        asked_bytes: u64,
    },
    /// held-by-other-process: the holder the fix stops held nothing at the failure.
    HolderHoldsNothing {
        pid: u32,
    },
    /// held-by-other-process: the holders the fix stops hold less than the allocation lacked.
    HoldersShort {
        holders_bytes: u64,
        short_bytes: u64,
    },
    /// does-not-fit-at-load: the service had served; or its allocation asked no more than
    /// was free by the trace's account (memory the trace cannot see was in use).
    Served,
    LoadFitted {
        asked_bytes: u64,
        free_bytes: u64,
    },
    /// kept-by-service: the load in flight received more than an eighth over the most served.
    LargerThanServed {
        failing_load_bytes: u64,
        largest_served_load_bytes: u64,
    },
    /// kept-by-service: what it kept does not cover what the allocation lacked.
    KeptShort {
        kept_bytes: u64,
        free_bytes: Option<u64>,
        asked_bytes: Option<u64>,
    },
    /// long-request: the request that failed alone was no larger than one served (by a quarter).
    NoLargerThanServed {
        failed_request_bytes: u64,
        largest_served_request_bytes: u64,
    },
    /// long-request: the room left takes less than the largest request served: it shrank since.
    RoomShrank {
        largest_served_request_bytes: u64,
        largest_fitting_request_bytes: u64,
    },
    /// long-request: by what a request costs, the one that failed fits alone.
    FailedFits {
        failed_request_bytes: u64,
        largest_fitting_request_bytes: u64,
    },
    /// long-request, concurrent-load: not one request fits alone in the room for requests.
    NoneFitsAlone {
        bytes_per_request: Option<u64>,
        room_bytes: Option<u64>,
    },
    /// concurrent-load: fewer than two requests were in flight.
    NotConcurrent {
        in_flight: u64,
    },
    /// concurrent-load: by what a request costs, every one in flight fitted together.
    AllFit {
        in_flight: u64,
        bytes_per_request: u64,
        room_bytes: u64,
    },
}

/// A quarter larger: a request no larger than that is the same prompt in other words.
pub fn larger_than_served(failed: u64, served: Option<u64>) -> Result<(), Unmet> {
    match served {
        Some(served) if failed.saturating_mul(4) <= served.saturating_mul(5) => {
            Err(Unmet::NoLargerThanServed { failed_request_bytes: failed, largest_served_request_bytes: served })
        }
        _ => Ok(()),
    }
}

/// held-by-other-process, with NVML unavailable: a holder of unknown size is the suspect of a
/// failure while loading, never a confident does-not-fit-at-load while it may be what filled the
/// GPU. Once the service served, it fitted beside that holder: no explanation then.
pub fn unknown_suspect(symptom: Symptom, e: &Evidence) -> bool {
    e.holders_outside.iter().any(|h| h.bytes.is_none()) && (e.phase == Phase::Load || symptom == Symptom::StartupRefusal)
}

/// held-by-other-process, for a failed allocation: freeing what others hold makes room for it.
pub fn outside_covers(asked: u64, free: Option<u64>, outside: u64) -> Result<(), Unmet> {
    let covers = match free {
        Some(free) => free < asked && free.saturating_add(outside) >= asked,
        None => outside > 0 && outside >= asked,
    };
    covers.then_some(()).ok_or(Unmet::OutsideShort { outside_bytes: outside, free_bytes: free, asked_bytes: asked })
}

/// does-not-fit-at-load, for a failed allocation while loading: it asked more than was free.
pub fn load_exceeds(asked: u64, free: Option<u64>) -> Result<(), Unmet> {
    match free {
        Some(free) if asked <= free => Err(Unmet::LoadFitted { asked_bytes: asked, free_bytes: free }),
        _ => Ok(()),
    }
}

/// kept-by-service: the load no larger than loads served (an eighth over at most), and what was
/// kept covers what the allocation lacked.
pub fn kept_covers(load: u64, largest_load: u64, asked: Option<u64>, free: Option<u64>, kept: u64) -> Result<(), Unmet> {
    if load > largest_load.saturating_add(largest_load / 8) {
        return Err(Unmet::LargerThanServed { failing_load_bytes: load, largest_served_load_bytes: largest_load });
    }
    let covers = match (asked, free) {
        (Some(b), Some(free)) => free < b && free.saturating_add(kept) >= b,
        (Some(b), None) => kept > 0 && kept >= b,
        (None, _) => false,
    };
    covers.then_some(()).ok_or(Unmet::KeptShort { kept_bytes: kept, free_bytes: free, asked_bytes: asked })
}

/// What a fix claims, against its own figures: the holders it stops hold memory at the failure,
/// what the allocation lacked together; the context it sets admits the largest request served (and one request at least);
/// the concurrency it caps is below what was in flight, which did not all fit, and one fits.
pub fn fix_holds(e: &Evidence, fix: &Fix) -> Result<(), Unmet> {
    match fix {
        Fix::StopHolder(f) => {
            let holds = e.holders_outside.iter().any(|h| h.pid == f.kill && h.bytes != Some(0));
            if !holds {
                return Err(Unmet::HolderHoldsNothing { pid: f.kill });
            }
            // Those it stops free what the allocation lacked (where their sizes are known).
            let together = f.together().unwrap_or(u64::MAX);
            let short = e.failed_bytes.map_or(0, |asked| asked.saturating_sub(e.free_bytes.unwrap_or(0)));
            if together < short {
                return Err(Unmet::HoldersShort { holders_bytes: together, short_bytes: short });
            }
            Ok(())
        }
        Fix::ShorterContext(f) => match (f.largest_fitting_request_bytes, f.largest_served_request_bytes) {
            (Some(fits), Some(served)) if fits < served => {
                Err(Unmet::RoomShrank { largest_served_request_bytes: served, largest_fitting_request_bytes: fits })
            }
            (Some(0), None) => Err(Unmet::NoneFitsAlone { bytes_per_request: None, room_bytes: None }),
            // The request that failed alone is larger than the largest that fits.
            (Some(fits), _) if fits >= f.failed_request_bytes => {
                Err(Unmet::FailedFits { failed_request_bytes: f.failed_request_bytes, largest_fitting_request_bytes: fits })
            }
            _ => larger_than_served(f.failed_request_bytes, f.largest_served_request_bytes),
        },
        Fix::CapConcurrency(f) => {
            let (n, per, room) = (f.in_flight, f.bytes_per_request.max(1), f.room_bytes);
            if n < 2 {
                Err(Unmet::NotConcurrent { in_flight: n })
            } else if per > room {
                Err(Unmet::NoneFitsAlone { bytes_per_request: Some(per), room_bytes: Some(room) })
            } else if room / per >= n {
                Err(Unmet::AllFit { in_flight: n, bytes_per_request: per, room_bytes: room })
            } else {
                Ok(())
            }
        }
        Fix::SmallerLoad(_) | Fix::BoundKept(_) | Fix::MoreHostMemory { .. } => Ok(()),
    }
}

/// Every precondition of a judged diagnosis's category, on the figures it prints. What a
/// refusal's holders leave unused depends on the engine's reserve, which is not printed: a
/// refusal's check here is that others held memory (or a holder of unknown size).
pub fn check(d: &Diagnosis) -> Result<(), Unmet> {
    let Finding::Judged { evidence: e, fix } = &d.finding else { return Ok(()) };
    match d.category {
        Category::HeldByOtherProcess => match (d.symptom, e.failed_bytes) {
            _ if unknown_suspect(d.symptom, e) => Ok(()),
            (Symptom::FailedAllocation, Some(asked)) => outside_covers(asked, e.free_bytes, e.held_outside_bytes),
            _ if e.held_outside_bytes == 0 => {
                Err(Unmet::OutsideShort { outside_bytes: 0, free_bytes: e.free_bytes, asked_bytes: e.failed_bytes.unwrap_or(0) })
            }
            _ => Ok(()),
        }?,
        Category::DoesNotFitAtLoad if e.phase != Phase::Load => return Err(Unmet::Served),
        Category::DoesNotFitAtLoad => load_exceeds(e.failed_bytes.unwrap_or(u64::MAX), e.free_bytes)?,
        Category::KeptByService => {
            let k: &KeptEvidence =
                e.kept.as_ref().ok_or(Unmet::KeptShort { kept_bytes: 0, free_bytes: e.free_bytes, asked_bytes: e.failed_bytes })?;
            kept_covers(k.failing_load_bytes, k.largest_served_load_bytes, e.failed_bytes, e.free_bytes, k.kept_bytes)?;
        }
        _ => {}
    }
    fix_holds(e, fix)
}
