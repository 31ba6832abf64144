//! Which files are NVIDIA's devices. A path is not enough on a shared host: a user may mount any
//! file of their own at /dev/nvidiactl in a mount namespace of their own, and its "ioctls" would
//! be memory that never existed, charged to the GPU in the report. Where NVIDIA's driver is
//! loaded, a file is NVIDIA's when it is at one of its paths *and* has its device number's major
//! (195 for nvidiactl and nvidiaN, a dynamic one for nvidia-uvm), as /proc/devices lists them.
//! Where no driver is loaded (the fake GPU, whose files are FUSE files), the path stands alone.
//! Also here: what a path names, GPU indexes by minor, and who holds the device files now.

use anyhow::{bail, Result};

use crate::event::Device;
use crate::procfs;

/// The majors of NVIDIA's device numbers on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Majors {
    /// nvidiactl and nvidiaN (registered as "nvidia", or "nvidia-frontend" by older drivers).
    pub nvidia: u32,
    /// nvidia-uvm; 0 when its module is not loaded yet (CUDA loads it at its first use, often
    /// after gputrace started): then its path stands alone until a new reading finds it.
    pub uvm: u32,
}

/// Set to `MAJOR,UVM_MAJOR` (or `off`) to override /proc/devices: for tests, which put other
/// devices at NVIDIA's paths to check that the kernel side reads device numbers.
pub const OVERRIDE: &str = "GPUTRACE_DEVICE_MAJORS";

impl Majors {
    /// This host's, or None where no NVIDIA driver is loaded.
    pub fn of_host() -> Result<Option<Majors>> {
        if let Ok(value) = std::env::var(OVERRIDE) {
            return Majors::parse_override(&value);
        }
        Ok(crate::procfs::read_bounded("/proc/devices", 64 * 1024).and_then(|text| Majors::parse(&text)))
    }

    fn parse_override(value: &str) -> Result<Option<Majors>> {
        if value == "off" {
            return Ok(None);
        }
        let parsed = value.split_once(',').and_then(|(n, u)| Some(Majors { nvidia: n.trim().parse().ok()?, uvm: u.trim().parse().ok()? }));
        match parsed {
            Some(m) if m.nvidia > 0 => Ok(Some(m)),
            _ => bail!("{OVERRIDE}={value:?} is neither `off` nor two majors such as `195,509`: unset it to read /proc/devices"),
        }
    }

    /// The character devices of /proc/devices ("195 nvidia", "509 nvidia-uvm").
    pub fn parse(text: &str) -> Option<Majors> {
        let characters = text.split("Block devices:").next().unwrap_or_default();
        let major_of = |names: &[&str]| {
            characters.lines().find_map(|line| {
                let (major, name) = line.trim().split_once(' ')?;
                names.contains(&name.trim()).then(|| major.parse::<u32>().ok()).flatten()
            })
        };
        let nvidia = major_of(&["nvidia", "nvidia-frontend"]).filter(|&m| m > 0)?;
        Some(Majors { nvidia, uvm: major_of(&["nvidia-uvm"]).unwrap_or(0) })
    }

    /// Whether a file at `device`'s path with this device number is that device (minors from
    /// nv-chardev-numbers.h: 255 for nvidiactl, 0 to 247 for the GPUs; any of UVM's, since
    /// nvidia-uvm-tools, minor 1, fails every UVM command followed with -EINVAL: uvm_tools.c).
    pub fn admits(&self, device: Device, (major, minor): (u32, u32)) -> bool {
        match device {
            Device::Ctl => major == self.nvidia && minor == 255,
            Device::Gpu => major == self.nvidia && minor <= 247,
            Device::Uvm => self.uvm == 0 || major == self.uvm,
        }
    }

    /// The NVIDIA device a device number is, wherever its file is (a node made or bind-mounted
    /// at another path): nvidiactl, a GPU, or UVM (minor 0; nvidia-uvm-tools is minor 1). What
    /// the kernel side asks about when a fd it was told is not NVIDIA turns out to be.
    pub fn device_of(&self, (major, minor): (u32, u32)) -> Option<Device> {
        match (major, minor) {
            (m, 255) if m == self.nvidia => Some(Device::Ctl),
            (m, 0..=247) if m == self.nvidia => Some(Device::Gpu),
            (m, 0) if m == self.uvm && m != 0 => Some(Device::Uvm),
            _ => None,
        }
    }

    /// How files are told apart with these majors, for the trace's header.
    pub fn describe(majors: Option<Majors>) -> String {
        match majors {
            Some(Majors { nvidia, uvm: 0 }) => format!("device numbers (nvidia {nvidia}; nvidia-uvm not loaded: its path alone)"),
            Some(Majors { nvidia, uvm }) => format!("device numbers (nvidia {nvidia}, nvidia-uvm {uvm})"),
            None => "paths alone (no NVIDIA driver loaded)".into(),
        }
    }

    /// What is known after a new reading: what it adds (a driver or UVM module loaded since, a
    /// UVM module reloaded under a new major), never what it lacks. A failed read, or a module
    /// unloaded meanwhile (no file of it can be open then), leaves the known majors checked:
    /// only losing them would let paths stand alone again.
    pub fn update(known: Option<Majors>, reading: Option<Majors>) -> Option<Majors> {
        match (known, reading) {
            (known, None) => known,
            (None, reading) => reading,
            (Some(k), Some(r)) => Some(Majors { nvidia: r.nvidia, uvm: if r.uvm != 0 { r.uvm } else { k.uvm } }),
        }
    }
}

/// Which GPU (NVML's index) each /dev/nvidiaN is: what a process met running holds tells the
/// GPU of the handles it made before tracing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuIndexes {
    /// The host has one GPU: every device file is it.
    pub only: Option<u32>,
    /// Minor number to index, where the driver lists its GPUs (/proc/driver/nvidia/gpus/BUS/
    /// information names each one's minor; NVML counts GPUs in PCI bus order). Elsewhere (the
    /// fake GPU) a minor is its index.
    pub by_minor: std::collections::BTreeMap<u32, u32>,
}

impl GpuIndexes {
    /// This host's, given how many GPUs NVML counted (0: NVML could not tell).
    pub fn of_host(nvml_gpus: usize) -> GpuIndexes {
        let dir = std::path::Path::new("/proc/driver/nvidia/gpus");
        let mut buses: Vec<(String, u32)> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .take(256)
            .filter_map(|e| {
                let info = crate::procfs::read_bounded(&e.path().join("information").to_string_lossy(), 16 * 1024)?;
                Some((e.file_name().to_string_lossy().into_owned(), GpuIndexes::minor_in(&info)?))
            })
            .collect();
        buses.sort();
        GpuIndexes::from_parts(nvml_gpus, &buses)
    }

    /// From NVML's count and the driver's (bus id, minor) list.
    pub fn from_parts(nvml_gpus: usize, buses: &[(String, u32)]) -> GpuIndexes {
        let by_minor = buses.iter().enumerate().map(|(index, (_, minor))| (*minor, index as u32)).collect();
        let only = (nvml_gpus == 1 || (nvml_gpus == 0 && buses.len() == 1)).then_some(0);
        GpuIndexes { only, by_minor }
    }

    /// "Device Minor: 3" in a GPU's information file.
    fn minor_in(info: &str) -> Option<u32> {
        info.lines().find_map(|l| l.strip_prefix("Device Minor:")?.trim().parse().ok())
    }

    /// The GPU a /dev/nvidiaN file is.
    pub fn of_minor(&self, minor: u32) -> u32 {
        self.only.or_else(|| self.by_minor.get(&minor).copied()).unwrap_or(minor)
    }
}

/// Whether a file at `device`'s path is that device: by its device number where the driver is
/// loaded (`majors`), by the path alone elsewhere. None when the number cannot be read (the fd
/// is gone).
pub fn admitted(majors: Option<Majors>, device: Device, number: impl FnOnce() -> Option<(u32, u32)>) -> Option<bool> {
    match majors {
        None => Some(true),
        Some(m) => Some(m.admits(device, number()?)),
    }
}

/// The minor of a GPU's device file by its path: 3 for /dev/nvidia3.
pub fn gpu_minor_of_path(path: &str) -> Option<u32> {
    path.strip_prefix("/dev/nvidia")?.parse().ok()
}

/// The NVIDIA device a path names: /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia<N>.
pub fn device_of_path(path: &str) -> Option<Device> {
    let rest = path.strip_prefix("/dev/nvidia")?;
    match rest {
        "ctl" => Some(Device::Ctl),
        "-uvm" => Some(Device::Uvm),
        digits if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => Some(Device::Gpu),
        _ => None,
    }
}

/// Every process, other than gputrace, with NVIDIA device files open now: a /proc scan, what
/// `fuser -v /dev/nvidia*` shows.
pub fn nvidia_holders(majors: Option<Majors>) -> Vec<crate::trace::HolderAtStart> {
    let mut holders: Vec<crate::trace::HolderAtStart> = procfs::all_pids()
        .into_iter()
        .filter_map(|pid| {
            let mut devices: Vec<String> = procfs::fds::open_fds(pid)
                .into_iter()
                .filter_map(|fd| {
                    procfs::fds::fd_path(pid, fd)?
                        .to_str()
                        .and_then(device_of_path)
                        .filter(|&d| admitted(majors, d, || procfs::fds::fd_device_number(pid, fd)) == Some(true))
                })
                .map(|d| format!("{d:?}").to_lowercase())
                .collect();
            devices.sort();
            devices.dedup();
            (!devices.is_empty()).then(|| crate::trace::HolderAtStart {
                pid,
                ppid: procfs::parent(pid).unwrap_or(0),
                command: procfs::command::command(pid).unwrap_or_default(),
                devices,
                exe: procfs::command::executable(pid),
            })
        })
        .collect();
    holders.sort_by_key(|h| h.pid);
    holders
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_gpu_each_device_file_is() {
        let info = "Model: \t\t NVIDIA H200\nIRQ:   \t\t 190\nDevice Minor: \t 3\n";
        assert_eq!(GpuIndexes::minor_in(info), Some(3));
        let buses = [("0000:19:00.0".to_string(), 1), ("0000:3b:00.0".to_string(), 0), ("0000:9a:00.0".to_string(), 2)];
        let several = GpuIndexes::from_parts(3, &buses);
        assert_eq!((several.of_minor(1), several.of_minor(0), several.of_minor(2)), (0, 1, 2), "NVML counts in bus order");
        assert_eq!(GpuIndexes::from_parts(1, &[]).of_minor(5), 0, "one GPU: every file is it");
        assert_eq!(GpuIndexes::from_parts(0, &[]).of_minor(2), 2, "no driver listing (the fake GPU): the minor");
    }

    #[test]
    fn majors_from_proc_devices() {
        let text = "Character devices:\n  1 mem\n  4 /dev/vc/0\n195 nvidia\n195 nvidia-modeset\n509 nvidia-uvm\n510 nvidia-nvlink\n\nBlock devices:\n  7 loop\n509 nvidia\n";
        let m = Majors::parse(text).unwrap();
        assert_eq!(m, Majors { nvidia: 195, uvm: 509 });
        assert!(m.admits(Device::Ctl, (195, 255)) && m.admits(Device::Gpu, (195, 0)) && m.admits(Device::Gpu, (195, 247)));
        assert!(m.admits(Device::Uvm, (509, 0)) && m.admits(Device::Uvm, (509, 1)));
        assert!(!m.admits(Device::Ctl, (0, 255)) && !m.admits(Device::Uvm, (195, 0)) && !m.admits(Device::Gpu, (1, 3)));
        // The modeset device and a GPU's minor at the control path, the control's at a GPU's.
        assert!(!m.admits(Device::Ctl, (195, 254)) && !m.admits(Device::Ctl, (195, 0)) && !m.admits(Device::Gpu, (195, 255)));
        assert_eq!(Majors::describe(Some(m)), "device numbers (nvidia 195, nvidia-uvm 509)");
        assert_eq!(Majors::describe(None), "paths alone (no NVIDIA driver loaded)");
        // Older drivers' name; no UVM module loaded yet: its path stands alone, and a later
        // reading is worth taking.
        let old = Majors::parse("Character devices:\n195 nvidia-frontend\n").unwrap();
        assert_eq!(old, Majors { nvidia: 195, uvm: 0 });
        assert!(old.admits(Device::Uvm, (0, 0)) && old.admits(Device::Uvm, (1, 3)));
        // By number alone, wherever the node is.
        assert_eq!(m.device_of((195, 255)), Some(Device::Ctl));
        assert_eq!(m.device_of((195, 3)), Some(Device::Gpu));
        assert_eq!(m.device_of((509, 0)), Some(Device::Uvm));
        assert_eq!(m.device_of((509, 1)), None, "nvidia-uvm-tools");
        assert_eq!(m.device_of((195, 254)), None, "nvidia-modeset");
        assert_eq!(old.device_of((0, 0)), None, "no UVM major known");
        // Readings add what they know and never take away.
        assert_eq!(Majors::update(Some(old), Some(m)), Some(m), "UVM loaded since");
        assert_eq!(Majors::update(Some(m), None), Some(m), "a failed read (or the driver unloaded) keeps the check");
        assert_eq!(Majors::update(Some(m), Some(old)), Some(m), "UVM unloaded: its last major is still checked");
        assert_eq!(Majors::update(Some(m), Some(Majors { nvidia: 195, uvm: 511 })), Some(Majors { nvidia: 195, uvm: 511 }), "reloaded");
        assert_eq!(Majors::update(None, Some(old)), Some(old), "the driver loaded after gputrace started");
        // No driver (the fake GPU): no majors, paths alone.
        assert_eq!(Majors::parse("Character devices:\n  1 mem\n 10 misc\n\nBlock devices:\n195 nvidia\n"), None);
        assert_eq!(Majors::parse(""), None);
    }

    #[test]
    fn the_override_is_checked() {
        assert_eq!(Majors::parse_override("off").unwrap(), None);
        assert_eq!(Majors::parse_override("1, 5").unwrap(), Some(Majors { nvidia: 1, uvm: 5 }));
        for bad in ["", "195", "0,1", "x,1", "195;509"] {
            assert!(Majors::parse_override(bad).unwrap_err().to_string().contains("unset it"), "{bad}");
        }
    }

    #[test]
    fn paths_that_are_nvidia_devices() {
        assert_eq!(device_of_path("/dev/nvidiactl"), Some(Device::Ctl));
        assert_eq!(device_of_path("/dev/nvidia-uvm"), Some(Device::Uvm));
        assert_eq!(device_of_path("/dev/nvidia0"), Some(Device::Gpu));
        assert_eq!(device_of_path("/dev/nvidia17"), Some(Device::Gpu));
        for other in ["/dev/nvidia-uvm-tools", "/dev/nvidia-modeset", "/dev/nvidia", "/dev/null", "socket:[123]", "/dev/nvidia0x"] {
            assert_eq!(device_of_path(other), None, "{other}");
        }
    }
}
