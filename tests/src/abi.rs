//! The driver ABI as the fake GPU and the workloads speak it, per presented driver version.
//! Written from the driver's headers independently of gputrace's own tables (tracer/src/abi.rs), so a
//! wrong offset on either side shows up as a disagreement in the end-to-end tests.

/// The driver versions the fake GPU can present.
pub const VERSIONS: [&str; 5] = ["525.147.05", "535.104.05", "550.54.15", "580.95.05", "590.44.01"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Abi {
    pub major: u32,
    pub nvos21_status: usize,
    pub nvos64_size: usize,
    pub nvos64_status: usize,
    pub memory_params_size: usize,
    pub uvm_map_external_size: usize,
    pub uvm_semaphore_pool_size: usize,
    pub uvm_free_size: usize,
    /// NV00FD_ALLOCATION_PARAMETERS: (size, offset of allocSize); it grew at 545.
    pub multicast_params: (usize, usize),
    /// VID_HEAP_CONTROL's attr2 USE_EGM allocates EGM (class 0x42): 550 to 590.
    pub vid_heap_egm: bool,
}

impl Abi {
    pub fn for_version(version: &str) -> Abi {
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let version = (parts.next().unwrap_or(0), parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        let major = version.0;
        let old = major < 535;
        // UVM_MAX_GPUS went from 32 to 256 in 550.40.53 (uvm_ioctl.h).
        let big_uvm = version >= (550, 40, 53);
        Abi {
            major,
            nvos21_status: if old { 24 } else { 28 },
            nvos64_size: if old { 40 } else { 48 },
            nvos64_status: if old { 36 } else { 40 },
            memory_params_size: if major >= 545 { 128 } else { 120 },
            uvm_map_external_size: if big_uvm { 9264 } else { 1200 },
            uvm_semaphore_pool_size: if big_uvm { 9248 } else { 1184 },
            uvm_free_size: if major >= 590 { 16 } else { 24 },
            multicast_params: if major >= 545 { (80, 48) } else { (40, 8) },
            vid_heap_egm: (550..595).contains(&major),
        }
    }
}

pub const fn rm_cmd(nr: u32, size: usize) -> u32 {
    (3 << 30) | ((size as u32) << 16) | ((b'F' as u32) << 8) | nr
}

pub mod esc {
    pub const RM_ALLOC_MEMORY: u32 = 0x27;
    pub const RM_FREE: u32 = 0x29;
    pub const RM_CONTROL: u32 = 0x2a;
    pub const RM_ALLOC: u32 = 0x2b;
    pub const RM_DUP_OBJECT: u32 = 0x34;
    pub const RM_VID_HEAP_CONTROL: u32 = 0x4a;
    pub const REGISTER_FD: u32 = 0xc9;
    pub const CHECK_VERSION_STR: u32 = 0xd2;
    pub const XFER: u32 = 0xd3;
}

pub mod uvm {
    pub const INITIALIZE: u32 = 0x30000001;
    pub const MAP_EXTERNAL_ALLOCATION: u32 = 33;
    pub const FREE: u32 = 34;
    pub const UNMAP_EXTERNAL: u32 = 66;
    pub const ALLOC_SEMAPHORE_POOL: u32 = 68;
    pub const CREATE_EXTERNAL_RANGE: u32 = 73;
    pub const MM_INITIALIZE: u32 = 75;
}

pub mod status {
    pub const OK: u32 = 0;
    pub const ILLEGAL_ACTION: u32 = 0x16;
    pub const INVALID_ARGUMENT: u32 = 0x1f;
    pub const INVALID_CLIENT: u32 = 0x23;
    pub const INVALID_OBJECT_HANDLE: u32 = 0x33;
    pub const INVALID_OBJECT_PARENT: u32 = 0x36;
    pub const NO_MEMORY: u32 = 0x51;
    pub const UVM_ADDRESS_IN_USE: u32 = 0x68;
}

pub mod class {
    pub const ROOT_CLIENT: u32 = 0x41;
    pub const DEVICE: u32 = 0x80;
    pub const SUBDEVICE: u32 = 0x2080;
    pub const SYSTEM: u32 = 0x3e;
    pub const LOCAL_USER: u32 = 0x40;
    pub const MEMORY_VIRTUAL: u32 = 0x70;
    /// LOCAL_PRIVILEGED: of RM_ALLOC_MEMORY, a 4 GiB window with no memory.
    pub const LOCAL_PRIVILEGED: u32 = 0x3f;
    /// EXTENDED_USER: EGM, host memory of a Grace system's NUMA node (NV_MEMORY_ALLOCATION_PARAMS).
    pub const EXTENDED_USER: u32 = 0x42;
    /// LOCAL_PHYSICAL: a mapping of the whole framebuffer, no memory (phys_mem.c).
    pub const LOCAL_PHYSICAL: u32 = 0xc2;
    /// NV_MEMORY_MULTICAST_FABRIC: fabric address space; allocSize where `Abi::multicast_params` says.
    pub const MULTICAST_FABRIC: u32 = 0xfd;
    pub const OS_DESCRIPTOR: u32 = 0x71;
    pub const NV50_MEMORY_VIRTUAL: u32 = 0x50a0;
    /// NV_MEMORY_FABRIC: 48-byte params, allocSize@8, allocFlags@24 (bit 0 FLEXIBLE), map.hVidMem@40.
    pub const MEMORY_FABRIC: u32 = 0xf8;
    pub const VASPACE: u32 = 0x90f1;
    pub const CHANNEL_GROUP: u32 = 0xa06c;
}

pub fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
pub fn get32(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4).map(|s| u32::from_le_bytes(s.try_into().unwrap())).unwrap_or(0)
}
pub fn get16(b: &[u8], at: usize) -> u16 {
    b.get(at..at + 2).map(|s| u16::from_le_bytes([s[0], s[1]])).unwrap_or(0)
}
pub fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
pub fn get64(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).map(|s| u64::from_le_bytes(s.try_into().unwrap())).unwrap_or(0)
}
