//! What each fuzz target does with its bytes. The targets (fuzz_targets/) are built with
//! libFuzzer's coverage by `cargo xtask fuzz`; the same functions replay every input that once
//! crashed (regressions/<target>/), as ordinary tests.

use std::io::Write;
use std::path::PathBuf;

use gputrace::abi::{DriverVersion, Layout};
use gputrace::decode::{decode_ioctl, RawIoctl};
use gputrace::event::Device;
use gputrace::files::{KernelUpdate, Resolver};
use gputrace::model::{generate, Model};
use gputrace::pipeline::Pipeline;
use gputrace::report::{Loss, Report};
use gputrace::trace::{Gpu, Header};
use tracer_common::{escape, rm_cmd};

/// The driver versions whose layouts differ, and one outside the known range.
const VERSIONS: [(u32, u32, u32); 9] =
    [(515, 65, 1), (525, 60, 13), (535, 104, 5), (545, 23, 6), (550, 40, 53), (550, 54, 14), (580, 95, 5), (590, 44, 1), (610, 1, 1)];
/// Every followed escape, and the XFER wrapper around them.
const ESCAPES: [u32; 7] = {
    let f = escape::FOLLOWED;
    [f[0], f[1], f[2], f[3], f[4], f[5], escape::IOCTL_XFER_CMD]
};

/// A /proc with nothing in it: the pipeline's questions get no answers.
struct NoProc;

impl Resolver for NoProc {
    fn fd_path(&self, _: u32, _: i32) -> Option<PathBuf> {
        None
    }
    fn same_file(&self, _: (u32, i32), _: (u32, i32)) -> bool {
        false
    }
    fn command(&self, _: u32) -> Option<Vec<String>> {
        None
    }
    fn parent(&self, _: u32) -> Option<u32> {
        None
    }
    fn open_fds(&self, _: u32) -> Vec<i32> {
        Vec::new()
    }
}

fn u32_at(data: &[u8], at: usize) -> u32 {
    data.get(at..at + 4).map_or(0, |b| u32::from_le_bytes(b.try_into().unwrap()))
}

/// The decoder: any escape (a known one most of the time), any params bytes, any driver version,
/// both straight to `decode_ioctl` and as whole ring buffer records through the pipeline.
pub fn decode(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else { return };
    let (major, minor, patch) = VERSIONS[usize::from(pick) % VERSIONS.len()];
    let layout = Layout::for_version(DriverVersion::new(major, minor, patch));
    let nr = ESCAPES[usize::from(pick >> 4) % ESCAPES.len()];
    let size = u32_at(rest, 0) & 0x3fff;
    let cmd = if pick & 0x80 != 0 { u32_at(rest, 4) } else { rm_cmd(nr, size) };
    let device = [Some(Device::Ctl), Some(Device::Gpu), Some(Device::Uvm), None][usize::from(pick >> 2) % 4];
    let params = rest.get(8..).unwrap_or_default();
    let split = params.len().min(usize::from(rest.get(1).copied().unwrap_or(0)));
    let raw = RawIoctl {
        fd: u32_at(rest, 2) as i32,
        cmd,
        escape_cmd: cmd,
        // What ioctl() returned: any errno, and the extremes.
        ret: match rest.get(7).copied().unwrap_or(0) % 4 {
            0 => i64::MIN,
            1 => i64::MAX,
            _ => i64::from(u32_at(rest, 3) as i32),
        },
        device,
        flags: rest.get(5).copied().unwrap_or(0),
        file: u64::from(u32_at(rest, 6)),
        named_file: u64::from(u32_at(rest, 1)),
        params: params[..split].to_vec(),
        class_params: params[split..].to_vec(),
    };
    let _ = decode_ioctl(&layout, &raw);
    let mut pipeline = Pipeline::new(layout, NoProc, pick & 2 != 0, Some(1));
    let (mut out, mut updates): (Vec<_>, Vec<KernelUpdate>) = (Vec::new(), Vec::new());
    for chunk in rest.chunks(usize::from(pick).max(16) * 8) {
        pipeline.take(chunk, &mut out, &mut updates);
    }
}

fn header() -> Header {
    let card = Gpu { index: 0, name: "fuzz".into(), total_bytes: Some(80 << 30), used_bytes: None };
    Header { gpus: vec![card], ..Header::default() }
}

/// Everything a person runs on a model: the report in both forms and every export.
fn every_output(header: &Header, model: &Model, events: u64, loss: Loss) {
    let report = Report::new(header, model, "fuzz".into(), events, loss, 600_000_000_000);
    let _ = report.text();
    let _ = serde_json::to_string(&report).expect("the report serializes");
    let mut sink = std::io::sink();
    gputrace::export::perfetto(header, model, &report, &mut sink).expect("perfetto");
    gputrace::export::html(header, model, &report, &mut sink).expect("html");
    gputrace::export::csv(header, model, &mut sink).expect("csv");
}

/// The trace reader and everything after it: any bytes as a trace file.
pub fn trace(data: &[u8]) {
    let path = std::env::temp_dir().join(format!("gputrace-fuzz-{}.trace", std::process::id()));
    let written = std::fs::File::create(&path).and_then(|mut f| f.write_all(data));
    if written.is_err() {
        return;
    }
    if let Ok((header, model, events, loss)) = gputrace::report::load(&path, data.first().is_some_and(|b| b & 1 != 0)) {
        every_output(&header, &model, events, loss);
    }
}

/// The model, the diagnosis and the exports on any sequence of events, whose books must balance.
pub fn model(data: &[u8]) {
    let records = generate::records(data);
    let model = Model::from_records(&records);
    if let Err(e) = model.check_books() {
        panic!("the books do not balance: {e}");
    }
    every_output(&header(), &model, records.len() as u64, Loss::default());
}

#[cfg(test)]
mod tests {
    /// Every input that once crashed a target still runs clean.
    #[test]
    fn regressions_replay_clean() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
        type Target = fn(&[u8]);
        let targets: [(&str, Target); 3] = [("decode", super::decode), ("trace", super::trace), ("model", super::model)];
        let mut replayed = 0;
        for (name, target) in targets {
            for entry in std::fs::read_dir(root.join(name)).into_iter().flatten().flatten() {
                target(&std::fs::read(entry.path()).unwrap());
                replayed += 1;
            }
        }
        assert!(replayed > 0, "no regression inputs under {}", root.display());
    }
}
