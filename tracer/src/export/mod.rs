//! Exports of a trace for looking at and for scripts, one module per format: Perfetto (Chrome
//! Trace Event JSON), a self-contained HTML page, CSV. Exporters only read the model, its
//! analysis and the report, and write as they go.

mod csv;
mod html;
mod perfetto;

pub use csv::csv;
pub use html::html;
pub use perfetto::perfetto;

use crate::analysis::services::Services;
use crate::analysis::sweep::LiveChanges;
use crate::analysis::Phase;
use crate::event::Memory;
use crate::model::Model;

/// One allocation as an export shows it.
pub struct Row<'a> {
    pub allocation: &'a crate::model::Allocation,
    pub command: String,
    pub service: String,
    pub phase: Phase,
    pub in_flight: usize,
}

/// Every allocation with its process, service, phase and requests in flight, in time order,
/// made one at a time as the export writes it.
pub fn rows<'a>(model: &'a Model, services: &'a Services<'a>) -> impl Iterator<Item = Row<'a>> + 'a {
    model.allocations.iter().map(move |a| {
        let service = services.of(a.pid);
        Row {
            allocation: a,
            command: model.processes.get(&a.pid).map(|p| p.command_line()).unwrap_or_default(),
            service: service.map(|s| s.name.clone()).unwrap_or_default(),
            phase: services.phase_of(a.pid, a.ts),
            in_flight: service.map(|s| services.in_flight_count(s, a.ts)).unwrap_or(0),
        }
    })
}

/// A change of live memory: +bytes at an allocation, -bytes at its free.
pub struct Change {
    pub ts: u64,
    pub pid: u32,
    pub memory: Memory,
    pub gpu: Option<u32>,
    /// The phase the allocation was made in (its free counts against the same phase).
    pub phase: Phase,
    pub delta: i128,
}

/// Every change of live memory, in time order, frees before allocations at the same instant:
/// what both timelines (Perfetto's counters, the HTML chart) are summed from, one at a time.
pub fn live_changes<'a>(model: &'a Model, services: &'a Services) -> impl Iterator<Item = Change> + 'a {
    LiveChanges::of(model.allocations.iter().map(|a| (a, a))).map(|(ts, delta, a)| Change {
        ts,
        pid: a.pid,
        memory: a.memory,
        gpu: a.gpu,
        phase: services.phase_of(a.pid, a.ts),
        delta,
    })
}

/// Byte sums are kept exact in i128 and written as JSON's 64-bit integers, saturated: a trace
/// with absurd sizes still exports.
fn saturate(v: i128) -> i64 {
    v.clamp(i64::MIN.into(), i64::MAX.into()) as i64
}
