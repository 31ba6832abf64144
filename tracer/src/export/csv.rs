//! CSV: one row per allocation, failed ones too, for scripts and spreadsheets.

use std::io::{self, Write};

use super::rows;
use crate::analysis::services::Services;
use crate::model::{FreedBy, Model};
use crate::trace::Header;

/// How the memory went; `released_still_held` while its handles are gone and the driver still
/// holds it (mapped, exported, attached), the time of that release in `released_ns`.
fn freed_by(f: Option<(u64, FreedBy)>, released: Option<u64>) -> &'static str {
    match f.map(|(_, how)| how) {
        Some(FreedBy::Explicit) => "explicit",
        Some(FreedBy::Subtree) => "subtree",
        Some(FreedBy::FileRelease) => "file_release",
        Some(FreedBy::Unseen) => "unseen",
        Some(FreedBy::Unmapped) => "unmapped",
        Some(FreedBy::Detached) => "detached",
        None if released.is_some() => "released_still_held",
        None => "never",
    }
}

/// The GPU's index; empty where it cannot be told.
fn gpu(gpu: Option<u32>) -> String {
    gpu.map(|g| g.to_string()).unwrap_or_default()
}

fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

/// One row per allocation (failed ones too, with their status). Times are ns since the trace start.
pub fn csv(header: &Header, model: &Model, out: &mut dyn Write) -> io::Result<()> {
    let start = model.time_zero(header.monotonic_start_ns);
    let services = Services::new(model);
    // released_ns last: scripts that read the columns by position keep working.
    writeln!(out, "allocated_ns,freed_ns,pid,command,service,context,gpu,kind,bytes,phase,requests_in_flight,freed_by,status,released_ns")?;
    for r in rows(model, &services) {
        let a = r.allocation;
        let context = if a.client != 0 { format!("client {:#x}", a.client) } else { "uvm".into() };
        let since_start = |t: Option<u64>| t.map(|t| t.saturating_sub(start).to_string()).unwrap_or_default();
        writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},0,{}",
            a.ts.saturating_sub(start),
            since_start(a.freed.map(|(t, _)| t)),
            a.pid,
            csv_field(&r.command),
            csv_field(&r.service),
            context,
            gpu(model.gpu_for(a.pid, a.gpu)),
            a.memory.name(),
            a.bytes,
            r.phase.name(),
            r.in_flight,
            freed_by(a.freed, a.released),
            since_start(a.released),
        )?;
    }
    for f in &model.failures {
        let command = model.processes.get(&f.pid).map(|p| p.command_line()).unwrap_or_default();
        let service = services.of(f.pid).map(|s| s.name.clone()).unwrap_or_default();
        let in_flight = services.of(f.pid).map(|s| services.in_flight_count(s, f.ts)).unwrap_or(0);
        writeln!(
            out,
            "{},,{},{},{},,{},{},{},{},{},failed,{:#x},",
            f.ts.saturating_sub(start),
            f.pid,
            csv_field(&command),
            csv_field(&service),
            gpu(model.gpu_for(f.pid, f.gpu)),
            f.memory.name(),
            f.bytes,
            services.phase_of(f.pid, f.ts).name(),
            in_flight,
            f.status
        )?;
    }
    Ok(())
}
