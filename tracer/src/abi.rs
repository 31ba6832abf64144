//! The NVIDIA driver's ioctl ABI as data: what moves between driver versions, the memory classes,
//! the status codes. Offsets are the ones verified by compiling against NVIDIA's open kernel module
//! headers per release tag (NVIDIA's open-gpu-kernel-modules: `src/common/sdk/nvidia/inc/nvos.h`
//! for the RM structs, `kernel-open/nvidia-uvm/uvm_ioctl.h` for UVM).

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tracer_common::{uvm, UvmWindow};

/// A driver version such as 580.95.05. Ordered, so layout changes are version comparisons.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DriverVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl DriverVersion {
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        DriverVersion { major, minor, patch }
    }

    /// Accepts "580", "580.95" and "580.95.05"; also finds the version inside the text of
    /// /proc/driver/nvidia/version ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05 ...").
    pub fn parse(text: &str) -> Option<Self> {
        text.split_whitespace().find_map(|word| {
            let mut parts = word.split('.');
            let major: u32 = parts.next()?.parse().ok()?;
            if !(100..10000).contains(&major) {
                return None;
            }
            let minor = parts.next().map(|p| p.parse().ok()).unwrap_or(Some(0))?;
            let patch = parts.next().map(|p| p.parse().ok()).unwrap_or(Some(0))?;
            Some(DriverVersion { major, minor, patch })
        })
    }

    /// The running driver's version, from the module's sysfs entry or procfs. None without a driver.
    pub fn detect() -> Option<(Self, String)> {
        ["/sys/module/nvidia/version", "/proc/driver/nvidia/version"].iter().find_map(|path| {
            let text = std::fs::read_to_string(Path::new(path)).ok()?;
            Some((DriverVersion::parse(&text)?, path.to_string()))
        })
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:02}.{:02}", self.major, self.minor, self.patch)
    }
}

/// The offsets and sizes that differ between driver versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// NVOS21 (always 32 bytes): status @24 before 535, @28 after.
    pub nvos21_status: usize,
    /// NVOS64: 40 bytes before 535 (status @32 in 515, @36 in 525), 48 bytes with status @40 after.
    pub nvos64_size: u32,
    pub nvos64_status: usize,
    /// NV_MEMORY_ALLOCATION_PARAMS: 120 bytes before 545, 128 after (size@64 and attr@24 never move).
    pub memory_params_size: u32,
    /// UVM_MAP_EXTERNAL_ALLOCATION: 1200 bytes (UVM_MAX_GPUS 32) before 550.40.53, 9264 from it
    /// (uvm_ioctl.h of the open kernel modules at that tag).
    pub uvm_map_external_size: u32,
    /// UVM_ALLOC_SEMAPHORE_POOL: 1184 bytes before 550.40.53, 9248 from it.
    pub uvm_semaphore_pool_size: u32,
    /// UVM_FREE: 24 bytes (base, length, status) before 590, 16 (base, status) from 590.
    pub uvm_free_size: u32,
    /// NV00FD_ALLOCATION_PARAMETERS (multicast fabric): 40 bytes with allocSize@8 before 545,
    /// 80 with allocSize@48 from 545 (an export packet and index come first; cl00fd.h).
    pub multicast_params: (u32, usize),
    /// VID_HEAP_CONTROL's ALLOC_SIZE with attr2 USE_EGM allocates EGM (class 0x42): 550 to 590
    /// (rmapi_deprecated_vidheapctrl.c); before and after, the bit is not read.
    pub vid_heap_egm: bool,
    /// ATTACH_MEM on a fabric object (flexible 0xf8, multicast 0xfd) dups the memory into the
    /// fabric's internal client, held until DETACH_MEM or the fabric object goes: up to 565.77;
    /// from 570.86.15 it is an inter-mapping, torn down when the memory is freed (mem_fabric.c,
    /// mem_multicast_fabric.c at those tags).
    pub fabric_attach_holds: bool,
    /// True when the version is outside every range compiled and checked: fields stable across
    /// versions still decode, the rest is the nearest known layout.
    pub assumed: bool,
}

/// The oldest and newest branches whose layouts were verified.
pub const OLDEST_KNOWN: DriverVersion = DriverVersion::new(515, 0, 0);
pub const NEWEST_KNOWN: DriverVersion = DriverVersion::new(595, 99, 99);

impl Layout {
    pub fn for_version(v: DriverVersion) -> Layout {
        let at_least = |major, minor, patch| v >= DriverVersion::new(major, minor, patch);
        let (nvos21_status, nvos64_size, nvos64_status) = if at_least(535, 0, 0) {
            (28, 48, 40)
        } else if at_least(525, 0, 0) {
            (24, 40, 36)
        } else {
            (24, 40, 32)
        };
        let big_uvm = at_least(550, 40, 53);
        Layout {
            nvos21_status,
            nvos64_size,
            nvos64_status,
            memory_params_size: if at_least(545, 0, 0) { 128 } else { 120 },
            uvm_map_external_size: if big_uvm { 9264 } else { 1200 },
            uvm_semaphore_pool_size: if big_uvm { 9248 } else { 1184 },
            uvm_free_size: if at_least(590, 0, 0) { 16 } else { 24 },
            multicast_params: if at_least(545, 0, 0) { (80, 48) } else { (40, 8) },
            vid_heap_egm: at_least(550, 0, 0) && !at_least(595, 0, 0),
            fabric_attach_holds: !at_least(570, 0, 0),
            assumed: v < OLDEST_KNOWN || v > NEWEST_KNOWN,
        }
    }

    /// Which bytes the kernel copies for each traced UVM command: the fields at the start (base,
    /// length, offset) and the last 16 bytes, where rmCtrlFd, hClient, hMemory and rmStatus sit
    /// (or gpuAttributesCount and rmStatus for the semaphore pool).
    pub fn uvm_windows(&self) -> [(u32, UvmWindow); 5] {
        let tail = |size: u32| UvmWindow { head_len: 24, tail_offset: size - 16, tail_len: 16, _pad: 0 };
        [
            (uvm::CREATE_EXTERNAL_RANGE, UvmWindow { head_len: 24, tail_offset: 0, tail_len: 0, _pad: 0 }),
            (uvm::MAP_EXTERNAL_ALLOCATION, tail(self.uvm_map_external_size)),
            (uvm::ALLOC_SEMAPHORE_POOL, UvmWindow { head_len: 16, ..tail(self.uvm_semaphore_pool_size) }),
            (uvm::FREE, UvmWindow { head_len: self.uvm_free_size, tail_offset: 0, tail_len: 0, _pad: 0 }),
            // UVM_UNMAP_EXTERNAL_PARAMS: base, length, gpuUuid, rmStatus@32 (40 bytes).
            (uvm::UNMAP_EXTERNAL, UvmWindow { head_len: 40, tail_offset: 0, tail_len: 0, _pad: 0 }),
        ]
    }

    /// Size of the allocation params RM copies for a class, for the classes gputrace decodes.
    pub fn class_params_size(&self, class: u32) -> Option<u32> {
        match class {
            class::LOCAL_USER | class::SYSTEM | class::NV50_MEMORY_VIRTUAL | class::EXTENDED_USER => Some(self.memory_params_size),
            class::MEMORY_VIRTUAL => Some(24),
            class::OS_DESCRIPTOR => Some(40),
            class::MEMORY_FABRIC => Some(48),
            class::MULTICAST_FABRIC => Some(self.multicast_params.0),
            class::DEVICE => Some(4),
            _ => None,
        }
    }

    pub fn class_params_table(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        class::WITH_PARAMS.iter().filter_map(move |&c| Some((c, self.class_params_size(c)?)))
    }
}

/// RM classes (`hClass`).
pub mod class {
    pub const ROOT: u32 = 0x0;
    pub const ROOT_NON_PRIV: u32 = 0x1;
    pub const ROOT_CLIENT: u32 = 0x41;
    pub const DEVICE: u32 = 0x80;
    pub const SUBDEVICE: u32 = 0x2080;
    pub const SYSTEM: u32 = 0x3e;
    pub const LOCAL_PRIVILEGED: u32 = 0x3f;
    pub const LOCAL_USER: u32 = 0x40;
    pub const MEMORY_VIRTUAL: u32 = 0x70;
    pub const OS_DESCRIPTOR: u32 = 0x71;
    pub const LOCAL_PHYSICAL: u32 = 0xc2;
    /// NV_MEMORY_EXTENDED_USER: extended GPU memory (EGM), CPU-attached memory of a Grace system
    /// the GPU reaches over C2C, from the host's page allocator (egm_mem.c); 535 to 590.
    pub const EXTENDED_USER: u32 = 0x42;
    pub const MEMORY_FABRIC: u32 = 0xf8;
    pub const MULTICAST_FABRIC: u32 = 0xfd;
    pub const NV50_MEMORY_VIRTUAL: u32 = 0x50a0;
    pub const VASPACE: u32 = 0x90f1;
    pub const CHANNEL_GROUP: u32 = 0xa06c;
    pub const CONTEXT_SHARE: u32 = 0x9067;

    /// Classes whose params the kernel side copies.
    pub const WITH_PARAMS: [u32; 9] =
        [LOCAL_USER, SYSTEM, NV50_MEMORY_VIRTUAL, MEMORY_VIRTUAL, OS_DESCRIPTOR, MEMORY_FABRIC, MULTICAST_FABRIC, EXTENDED_USER, DEVICE];

    /// escape.c turns an RM_ALLOC of any of these into a new client.
    pub fn is_client(class: u32) -> bool {
        matches!(class, ROOT | ROOT_NON_PRIV | ROOT_CLIENT)
    }
}

/// NV_STATUS values gputrace names.
pub mod status {
    pub const OK: u32 = 0;
    pub const INSUFFICIENT_RESOURCES: u32 = 0x1a;
    pub const INVALID_HEAP: u32 = 0x2b;
    pub const NO_MEMORY: u32 = 0x51;
    pub const MEMORY_ERROR: u32 = 0x72;
    /// NV_ERR_GENERIC; gputrace also uses it for an ioctl() that failed before RM saw it.
    pub const GENERIC_FAILURE: u32 = 0xffff;

    /// The statuses that mean the driver ran out of memory: NO_MEMORY (PMA, the heap,
    /// osAllocPages) and INSUFFICIENT_RESOURCES (the PMA scrubber's OOM, the page-blacklist limit).
    /// Not MEMORY_ERROR (a BAR, NVLink or MMU fault) nor INVALID_HEAP ("heap corrupted", which no
    /// open RM code returns): docs/driver-truth.md.
    pub fn is_out_of_memory(status: u32) -> bool {
        matches!(status, NO_MEMORY | INSUFFICIENT_RESOURCES)
    }

    /// The driver's own name for a status, as its headers spell it (shown beside failures).
    pub fn name(status: u32) -> Option<&'static str> {
        Some(match status {
            OK => "NV_OK",
            NO_MEMORY => "NV_ERR_NO_MEMORY",
            INSUFFICIENT_RESOURCES => "NV_ERR_INSUFFICIENT_RESOURCES",
            MEMORY_ERROR => "NV_ERR_MEMORY_ERROR",
            INVALID_HEAP => "NV_ERR_INVALID_HEAP",
            0x1f => "NV_ERR_INVALID_ARGUMENT",
            0x33 => "NV_ERR_INVALID_OBJECT_HANDLE",
            0x36 => "NV_ERR_INVALID_OBJECT_PARENT",
            0x22 => "NV_ERR_INVALID_CLASS",
            0x23 => "NV_ERR_INVALID_CLIENT",
            0x2e => "NV_ERR_INVALID_LIMIT",
            0x1b => "NV_ERR_INSUFFICIENT_PERMISSIONS",
            0x56 => "NV_ERR_NOT_SUPPORTED",
            0x17 => "NV_ERR_IN_USE",
            0x16 => "NV_ERR_ILLEGAL_ACTION",
            0x68 => "NV_ERR_UVM_ADDRESS_IN_USE",
            0x1e => "NV_ERR_INVALID_ADDRESS",
            0xf => "NV_ERR_GPU_IS_LOST",
            GENERIC_FAILURE => "NV_ERR_GENERIC",
            _ => return None,
        })
    }
}

/// Offsets that are the same in every version compiled (515-595).
pub mod offsets {
    // NVOS21 / NVOS64 (RM_ALLOC) head
    pub const ALLOC_ROOT: usize = 0;
    pub const ALLOC_PARENT: usize = 4;
    pub const ALLOC_NEW: usize = 8;
    pub const ALLOC_CLASS: usize = 12;
    // NV0080_ALLOC_PARAMETERS (class params of NV01_DEVICE_0)
    pub const DEVICE_ID: usize = 0;
    // NVOS00 (RM_FREE)
    pub const FREE_ROOT: usize = 0;
    pub const FREE_PARENT: usize = 4;
    pub const FREE_OLD: usize = 8;
    pub const FREE_STATUS: usize = 12;
    // NVOS02 + fd (RM_ALLOC_MEMORY)
    pub const NVOS02_ROOT: usize = 0;
    pub const NVOS02_PARENT: usize = 4;
    pub const NVOS02_NEW: usize = 8;
    pub const NVOS02_CLASS: usize = 12;
    pub const NVOS02_FLAGS: usize = 16;
    pub const NVOS02_LIMIT: usize = 32;
    pub const NVOS02_STATUS: usize = 40;
    pub const NVOS02_FD: usize = 48;
    // NVOS55 (RM_DUP_OBJECT)
    pub const DUP_CLIENT: usize = 0;
    pub const DUP_PARENT: usize = 4;
    pub const DUP_OBJECT: usize = 8;
    pub const DUP_CLIENT_SRC: usize = 12;
    pub const DUP_OBJECT_SRC: usize = 16;
    pub const DUP_STATUS: usize = 24;
    // NVOS57 (RM_SHARE): sharePolicy {target, accessMask (one limb), type (u16), action (u8)}
    pub const SHARE_CLIENT: usize = 0;
    pub const SHARE_OBJECT: usize = 4;
    pub const SHARE_TARGET: usize = 8;
    pub const SHARE_TYPE: usize = 16;
    pub const SHARE_ACTION: usize = 18;
    pub const SHARE_STATUS: usize = 20;
    // NVOS32 (RM_VID_HEAP_CONTROL)
    pub const VID_ROOT: usize = 0;
    pub const VID_PARENT: usize = 4;
    pub const VID_FUNCTION: usize = 8;
    pub const VID_STATUS: usize = 20;
    pub const VID_HMEMORY: usize = 44;
    pub const VID_FLAGS: usize = 52;
    pub const VID_ATTR: usize = 56;
    pub const VID_SIZE: usize = 88;
    pub const VID_OFFSET: usize = 104;
    pub const VID_ATTR2: usize = 144;
    /// NVOS32_ATTR2_USE_EGM, bit 24: VID_HEAP_CONTROL allocates class 0x42 (550 to 590).
    pub const ATTR2_USE_EGM: u32 = 1 << 24;
    pub const VID_FUNCTION_ALLOC_SIZE: u32 = 2;
    pub const VID_FUNCTION_FREE: u32 = 3;
    pub const VID_ALLOC_FLAGS_VIRTUAL: u32 = 0x80000;
    // NV_MEMORY_ALLOCATION_PARAMS
    pub const MEM_ATTR: usize = 24;
    pub const MEM_SIZE: usize = 64;
    // NV_MEMORY_VIRTUAL_ALLOCATION_PARAMS (0x70): limit@8
    pub const VIRT_LIMIT: usize = 8;
    // NV_OS_DESC_MEMORY_ALLOCATION_PARAMS (0x71): limit@24
    pub const OS_DESC_LIMIT: usize = 24;
    // NV00F8 (fabric): allocSize@8
    pub const FABRIC_SIZE: usize = 8;
    /// NV00F8: allocFlags@24 (bit 0 FLEXIBLE_FLA), map.hVidMem@40: a non-flexible one made over
    /// existing memory dups that memory until it goes.
    pub const FABRIC_FLAGS: usize = 24;
    pub const FABRIC_FLEXIBLE: u32 = 1;
    pub const FABRIC_VIDMEM: usize = 40;
    // NVOS32_ATTR LOCATION, bits 26:25
    pub const ATTR_LOCATION_SHIFT: u32 = 25;
    pub const ATTR_LOCATION_VIDMEM: u32 = 0;
    // NVOS02_FLAGS LOCATION, bits 11:8
    pub const NVOS02_LOCATION_SHIFT: u32 = 8;
    pub const NVOS02_LOCATION_VIDMEM: u32 = 2;
    // UVM
    pub const UVM_BASE: usize = 0;
    pub const UVM_LENGTH: usize = 8;
    pub const UVM_OFFSET: usize = 16;
    pub const UVM_CREATE_RANGE_STATUS: usize = 16;
    /// REGISTER_FD: ctl_fd@0
    pub const REGISTER_FD_CTL: usize = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_place_a_version_appears() {
        assert_eq!(DriverVersion::parse("580.95.05\n"), Some(DriverVersion::new(580, 95, 5)));
        assert_eq!(
            DriverVersion::parse("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.104.05  Release Build"),
            Some(DriverVersion::new(535, 104, 5))
        );
        assert_eq!(DriverVersion::parse("590"), Some(DriverVersion::new(590, 0, 0)));
        assert_eq!(DriverVersion::parse("garbage"), None);
        assert_eq!(DriverVersion::parse(""), None);
    }

    /// The table in nvidia-ioctl-abi.md, one row per compiled branch.
    #[test]
    fn layouts_follow_the_compiled_table() {
        let l = |maj, min, pat| Layout::for_version(DriverVersion::new(maj, min, pat));
        let v515 = l(515, 65, 1);
        assert_eq!((v515.nvos21_status, v515.nvos64_size, v515.nvos64_status, v515.memory_params_size), (24, 40, 32, 120));
        let v525 = l(525, 60, 13);
        assert_eq!((v525.nvos21_status, v525.nvos64_size, v525.nvos64_status), (24, 40, 36));
        let v535 = l(535, 104, 5);
        assert_eq!((v535.nvos21_status, v535.nvos64_size, v535.nvos64_status, v535.memory_params_size), (28, 48, 40, 120));
        assert_eq!((v535.uvm_map_external_size, v535.uvm_semaphore_pool_size, v535.uvm_free_size), (1200, 1184, 24));
        assert_eq!(l(545, 23, 6).memory_params_size, 128);
        assert_eq!(l(550, 40, 7).uvm_map_external_size, 1200);
        assert_eq!(l(550, 40, 53).uvm_map_external_size, 9264, "the cutoff is 550.40.53");
        assert!(l(535, 43, 2).fabric_attach_holds && l(565, 77, 0).fabric_attach_holds, "RM dups attached memory up to 565");
        assert!(!l(570, 86, 15).fabric_attach_holds && !l(595, 45, 4).fabric_attach_holds, "an inter-mapping from 570");
        let v550 = l(550, 54, 14);
        assert_eq!((v550.uvm_map_external_size, v550.uvm_semaphore_pool_size), (9264, 9248));
        assert_eq!(l(580, 95, 5).uvm_free_size, 24);
        assert_eq!(l(590, 44, 1).uvm_free_size, 16);
        assert!(!l(595, 45, 4).assumed);
        assert!(l(610, 1, 0).assumed);
        assert!(l(470, 1, 0).assumed);
    }

    /// MAP_EXTERNAL_ALLOCATION: rmCtrlFd@9248 hClient@9252 hMemory@9256 rmStatus@9260 (550+),
    /// rmCtrlFd@1184 .. rmStatus@1196 (535): the 16-byte tail starts at rmCtrlFd in both.
    #[test]
    fn uvm_tail_windows_start_at_rm_ctrl_fd() {
        for (v, rm_ctrl_fd) in [(DriverVersion::new(535, 104, 5), 1184), (DriverVersion::new(580, 95, 5), 9248)] {
            let windows = Layout::for_version(v).uvm_windows();
            let map = windows.iter().find(|(c, _)| *c == uvm::MAP_EXTERNAL_ALLOCATION).unwrap().1;
            assert_eq!(map.tail_offset, rm_ctrl_fd);
            let pool = windows.iter().find(|(c, _)| *c == uvm::ALLOC_SEMAPHORE_POOL).unwrap().1;
            // gpuAttributesCount@9232 then rmStatus@9240 (550+).
            assert_eq!(pool.tail_offset + 8, if rm_ctrl_fd == 9248 { 9240 } else { 1176 });
        }
    }
}
