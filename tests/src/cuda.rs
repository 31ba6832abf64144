//! What libcuda does at the ioctl level, as far as memory goes, for the fake workloads: open the
//! device files, build a context (client, device, subdevice, VA space, UVM registration) and
//! allocate through each of the driver's paths.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use crate::abi::{class, esc, get16, get32, put16, put32, put64, rm_cmd, uvm, Abi};

/// An NV status, or 0xffff when ioctl() itself failed.
pub type Status = u32;
const IOCTL_FAILED: Status = 0xffff;

#[derive(Clone, Copy, Debug)]
pub enum Path {
    /// RM_ALLOC NVOS64 of class 0x40, then a UVM external range and map: cudaMalloc.
    RmAlloc,
    /// RM_ALLOC NVOS21 (libcuda uses it for some objects; tinygrad for memory).
    RmAllocNvos21,
    /// RM_VID_HEAP_CONTROL ALLOC_SIZE.
    VidHeap,
    /// mmap'ed host memory pinned through RM_ALLOC_MEMORY of class 0x71 on /dev/nvidiaN.
    HostPinned,
    /// Address space only: RM_ALLOC NVOS64 of NV50_MEMORY_VIRTUAL (cuMemAddressReserve).
    VirtualReserve,
}

#[derive(Clone, Debug)]
pub struct Buffer {
    pub handle: u32,
    pub va: Option<u64>,
    pub bytes: u64,
}

pub struct Gpu {
    abi: Abi,
    pub ctl: File,
    /// /dev/nvidiaN of the GPU this context is on.
    pub gpu_file: File,
    pub uvm: File,
    pub client: u32,
    pub device: u32,
    pub subdevice: u32,
    pub vaspace: u32,
    next_va: u64,
}

fn open(path: &str) -> std::io::Result<File> {
    OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(path)
}

fn ioctl(file: &File, cmd: u32, arg: *mut u8) -> Result<(), Status> {
    // SAFETY: arg points at a buffer of the size the command encodes (or the UVM struct size).
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), cmd as _, arg) };
    if rc < 0 {
        Err(IOCTL_FAILED)
    } else {
        Ok(())
    }
}

fn check(status: u32) -> Result<(), Status> {
    if status == 0 {
        Ok(())
    } else {
        Err(status)
    }
}

impl Gpu {
    /// Opens the device files, asks the driver its version (NV_ESC_CHECK_VERSION_STR, as libcuda
    /// does) and sets up a context on GPU `instance` (its /dev/nvidiaN and its RM device).
    pub fn open(instance: u32) -> Result<Gpu, String> {
        let node = format!("/dev/nvidia{instance}");
        let files = (open("/dev/nvidiactl"), open(&node), open("/dev/nvidia-uvm"));
        let (Ok(ctl), Ok(gpu_file), Ok(uvm)) = files else {
            return Err(format!("cannot open /dev/nvidiactl, {node} and /dev/nvidia-uvm: run inside `fakegpu run`"));
        };
        let mut query = [0u8; 72];
        put32(&mut query, 0, b'2' as u32);
        ioctl(&ctl, rm_cmd(esc::CHECK_VERSION_STR, 72), query.as_mut_ptr()).map_err(|_| "CHECK_VERSION_STR failed".to_string())?;
        let version: String = query[8..].iter().take_while(|&&b| b != 0).map(|&b| b as char).collect();
        let mut gpu = Gpu {
            abi: Abi::for_version(&version),
            ctl,
            gpu_file,
            uvm,
            client: 0,
            device: 0,
            subdevice: 0,
            vaspace: 0,
            next_va: 0x7f00_0000_0000,
        };
        let setup = |gpu: &mut Gpu| -> Result<(), Status> {
            gpu.client = gpu.rm_alloc(false, 0, 0, class::ROOT_CLIENT, &mut [])?;
            let mut device = [0u8; 56];
            put32(&mut device, 0, instance);
            gpu.device = gpu.rm_alloc(true, gpu.client, gpu.client, class::DEVICE, &mut device)?;
            gpu.subdevice = gpu.rm_alloc(true, gpu.client, gpu.device, class::SUBDEVICE, &mut [0u8; 4])?;
            let vaspace_size = if gpu.abi.major >= 580 { 56 } else { 48 };
            gpu.vaspace = gpu.rm_alloc(true, gpu.client, gpu.device, class::VASPACE, &mut vec![0u8; vaspace_size])?;
            gpu.uvm_call(uvm::INITIALIZE, &mut [0u8; 16], 8)?;
            let mut register = (gpu.ctl.as_raw_fd() as u32).to_le_bytes();
            ioctl(&gpu.gpu_file, rm_cmd(esc::REGISTER_FD, 4), register.as_mut_ptr())
        };
        setup(&mut gpu).map_err(|s| format!("setting up the context failed with status {s:#x}"))?;
        Ok(gpu)
    }

    /// A context built elsewhere, over device files received from another process.
    pub fn adopt(version: &str, ctl: File, gpu_file: File, uvm: File, client: u32, device: u32) -> Gpu {
        Gpu { abi: Abi::for_version(version), ctl, gpu_file, uvm, client, device, subdevice: 0, vaspace: 0, next_va: 0x7e00_0000_0000 }
    }

    /// The driver version, as CHECK_VERSION_STR reported it.
    pub fn version_major(&self) -> u32 {
        self.abi.major
    }

    /// RM_ALLOC, NVOS21 or NVOS64 (48 bytes; 40 before 535); returns the new handle.
    fn rm_alloc(&self, nvos64: bool, root: u32, parent: u32, hclass: u32, params: &mut [u8]) -> Result<u32, Status> {
        let (size, status_at) = if nvos64 { (self.abi.nvos64_size, self.abi.nvos64_status) } else { (32, self.abi.nvos21_status) };
        let mut p = vec![0u8; size];
        put32(&mut p, 0, root);
        put32(&mut p, 4, parent);
        put32(&mut p, 12, hclass);
        put64(&mut p, 16, if params.is_empty() { 0 } else { params.as_mut_ptr() as u64 });
        // paramsSize is left 0: RM sizes the params by class and ignores it.
        ioctl(&self.ctl, rm_cmd(esc::RM_ALLOC, size), p.as_mut_ptr())?;
        check(get32(&p, status_at))?;
        Ok(get32(&p, 8))
    }

    /// A UVM ioctl on a params struct whose rmStatus is at `status_at`.
    fn uvm_call(&self, cmd: u32, p: &mut [u8], status_at: usize) -> Result<(), Status> {
        ioctl(&self.uvm, cmd, p.as_mut_ptr())?;
        check(get32(p, status_at))
    }

    fn take_va(&mut self, bytes: u64) -> u64 {
        let va = self.next_va;
        self.next_va += bytes.div_ceil(2 << 20).max(1) * (2 << 20);
        va
    }

    pub fn alloc(&mut self, path: Path, bytes: u64) -> Result<Buffer, Status> {
        match path {
            Path::RmAlloc | Path::RmAllocNvos21 => {
                let mut params = vec![0u8; self.abi.memory_params_size];
                put64(&mut params, 64, bytes);
                put64(&mut params, 88, bytes - 1);
                let handle = self.rm_alloc(matches!(path, Path::RmAlloc), self.client, self.device, class::LOCAL_USER, &mut params)?;
                let va = self.take_va(bytes);
                let mut range = [0u8; 24];
                put64(&mut range, 0, va);
                put64(&mut range, 8, bytes);
                self.uvm_call(uvm::CREATE_EXTERNAL_RANGE, &mut range, 16)?;
                let size = self.abi.uvm_map_external_size;
                let mut map = vec![0u8; size];
                put64(&mut map, 0, va);
                put64(&mut map, 8, bytes);
                put32(&mut map, size - 16, self.ctl.as_raw_fd() as u32);
                put32(&mut map, size - 12, self.client);
                put32(&mut map, size - 8, handle);
                self.uvm_call(uvm::MAP_EXTERNAL_ALLOCATION, &mut map, size - 4)?;
                Ok(Buffer { handle, va: Some(va), bytes })
            }
            Path::VirtualReserve => {
                let mut params = vec![0u8; self.abi.memory_params_size];
                put64(&mut params, 64, bytes);
                let handle = self.rm_alloc(true, self.client, self.device, class::NV50_MEMORY_VIRTUAL, &mut params)?;
                Ok(Buffer { handle, va: None, bytes })
            }
            Path::VidHeap => {
                let mut p = [0u8; 184];
                put32(&mut p, 0, self.client);
                put32(&mut p, 4, self.device);
                put32(&mut p, 8, 2);
                put64(&mut p, 88, bytes);
                ioctl(&self.ctl, rm_cmd(esc::RM_VID_HEAP_CONTROL, 184), p.as_mut_ptr())?;
                check(get32(&p, 20))?;
                Ok(Buffer { handle: get32(&p, 44), va: None, bytes })
            }
            Path::HostPinned => {
                // SAFETY: an anonymous private mapping, released with the process.
                let host = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        bytes as usize,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                        -1,
                        0,
                    )
                };
                let mut p = [0u8; 56];
                put32(&mut p, 0, self.client);
                put32(&mut p, 4, self.device);
                put32(&mut p, 12, class::OS_DESCRIPTOR);
                put64(&mut p, 24, host as u64);
                put64(&mut p, 32, bytes - 1);
                put32(&mut p, 48, self.ctl.as_raw_fd() as u32);
                ioctl(&self.gpu_file, rm_cmd(esc::RM_ALLOC_MEMORY, 56), p.as_mut_ptr())?;
                check(get32(&p, 40))?;
                Ok(Buffer { handle: get32(&p, 8), va: None, bytes })
            }
        }
    }

    /// RM_ALLOC (NVOS64) of `hclass` under the device, its size where the class keeps it: EGM
    /// (0x42) and LOCAL_PHYSICAL (0xc2) in NV_MEMORY_ALLOCATION_PARAMS, a multicast fabric
    /// object (0xfd) where the version's NV00FD params do.
    pub fn alloc_class(&self, hclass: u32, bytes: u64) -> Result<u32, Status> {
        let (size, at) = match hclass {
            class::MULTICAST_FABRIC => self.abi.multicast_params,
            _ => (self.abi.memory_params_size, 64),
        };
        let mut params = vec![0u8; size];
        put64(&mut params, at, bytes);
        self.rm_alloc(true, self.client, self.device, hclass, &mut params)
    }

    /// RM_ALLOC_MEMORY (the deprecated path) of `hclass` with the limit `bytes - 1`, on the
    /// GPU's file naming nvidiactl, as the pinned host path does.
    pub fn alloc_memory(&self, hclass: u32, bytes: u64) -> Result<u32, Status> {
        let mut p = [0u8; 56];
        put32(&mut p, 0, self.client);
        put32(&mut p, 4, self.device);
        put32(&mut p, 12, hclass);
        put64(&mut p, 32, bytes - 1);
        put32(&mut p, 48, self.ctl.as_raw_fd() as u32);
        ioctl(&self.gpu_file, rm_cmd(esc::RM_ALLOC_MEMORY, 56), p.as_mut_ptr())?;
        check(get32(&p, 40))?;
        Ok(get32(&p, 8))
    }

    /// VID_HEAP_CONTROL ALLOC_SIZE asking for EGM (attr2 USE_EGM): EGM from 550 to 590, video
    /// memory before and after (the flag is not there).
    pub fn vid_heap_egm(&self, bytes: u64) -> Result<u32, Status> {
        let mut p = [0u8; 184];
        put32(&mut p, 0, self.client);
        put32(&mut p, 4, self.device);
        put32(&mut p, 8, 2);
        put64(&mut p, 88, bytes);
        put32(&mut p, 144, 1 << 24);
        ioctl(&self.ctl, rm_cmd(esc::RM_VID_HEAP_CONTROL, 184), p.as_mut_ptr())?;
        check(get32(&p, 20))?;
        Ok(get32(&p, 44))
    }

    /// NV00FD_CTRL_CMD_ATTACH_MEM (0xfd0102): `buffer` at `offset` of a multicast object, for
    /// this context's GPU (its subdevice).
    pub fn attach_multicast(&self, multicast: u32, buffer: &Buffer, offset: u64) -> Result<(), Status> {
        let mut p = [0u8; 40];
        put32(&mut p, 0, self.subdevice);
        put32(&mut p, 4, buffer.handle);
        put64(&mut p, 8, offset);
        put64(&mut p, 24, buffer.bytes);
        self.control_on(multicast, 0xfd0102, &mut p)
    }

    /// NV00FD_CTRL_CMD_DETACH_MEM (0xfd0105): what this GPU has at `offset` of a multicast object.
    pub fn detach_multicast(&self, multicast: u32, offset: u64) -> Result<(), Status> {
        let mut p = [0u8; 24];
        put32(&mut p, 0, self.subdevice);
        put64(&mut p, 8, offset);
        self.control_on(multicast, 0xfd0105, &mut p)
    }

    /// UVM_ALLOC_SEMAPHORE_POOL: new system memory at a new UVM range.
    pub fn semaphore_pool(&mut self, bytes: u64) -> Result<u64, Status> {
        let va = self.take_va(bytes);
        let size = self.abi.uvm_semaphore_pool_size;
        let mut p = vec![0u8; size];
        put64(&mut p, 0, va);
        put64(&mut p, 8, bytes);
        self.uvm_call(uvm::ALLOC_SEMAPHORE_POOL, &mut p, size - 8)?;
        Ok(va)
    }

    /// RM_DUP_OBJECT: a second handle to the same memory.
    pub fn dup(&self, buffer: &Buffer) -> Result<u32, Status> {
        let mut p = [0u8; 28];
        put32(&mut p, 0, self.client);
        put32(&mut p, 4, self.device);
        put32(&mut p, 12, self.client);
        put32(&mut p, 16, buffer.handle);
        ioctl(&self.ctl, rm_cmd(esc::RM_DUP_OBJECT, 28), p.as_mut_ptr())?;
        check(get32(&p, 24))?;
        Ok(get32(&p, 8))
    }

    /// RM_CONTROL on the client (NVOS54), its params behind the pointer.
    fn control(&self, cmd: u32, params: &mut [u8]) -> Result<(), Status> {
        self.control_on(self.client, cmd, params)
    }

    /// RM_CONTROL on one of the client's objects.
    fn control_on(&self, object: u32, cmd: u32, params: &mut [u8]) -> Result<(), Status> {
        let mut p = [0u8; 32];
        put32(&mut p, 0, self.client);
        put32(&mut p, 4, object);
        put32(&mut p, 8, cmd);
        put64(&mut p, 16, params.as_mut_ptr() as u64);
        put32(&mut p, 24, params.len() as u32);
        ioctl(&self.ctl, rm_cmd(esc::RM_CONTROL, 32), p.as_mut_ptr())?;
        check(get32(&p, 28))
    }

    /// A flexible fabric object (class 0xf8, FLEXIBLE_FLA) of `bytes` of fabric address space,
    /// which memory is attached to (multi-node NVLink, IMEX).
    pub fn flexible_fabric(&self, bytes: u64) -> Result<u32, Status> {
        let mut params = [0u8; 48];
        put64(&mut params, 8, bytes);
        put32(&mut params, 24, 1);
        self.rm_alloc(true, self.client, self.device, class::MEMORY_FABRIC, &mut params)
    }

    /// NV00F8_CTRL_CMD_ATTACH_MEM: `buffer` at `offset` of the fabric object.
    pub fn attach(&self, fabric: u32, buffer: &Buffer, offset: u64) -> Result<(), Status> {
        let mut p = vec![0u8; 2064];
        put32(&mut p, 0, buffer.handle);
        put64(&mut p, 8, offset);
        put64(&mut p, 24, buffer.bytes);
        put16(&mut p, 2048, 1);
        self.control_on(fabric, 0xf80103, &mut p)?;
        if get16(&p, 2056) != 1 {
            return Err(IOCTL_FAILED);
        }
        Ok(())
    }

    /// NV00F8_CTRL_CMD_DETACH_MEM at `offset`.
    pub fn detach(&self, fabric: u32, offset: u64) -> Result<(), Status> {
        let mut p = vec![0u8; 528];
        put64(&mut p, 0, offset);
        put16(&mut p, 512, 1);
        self.control_on(fabric, 0xf80104, &mut p)
    }

    /// cuMemExportToShareableHandle (POSIX fd): a fresh nvidiactl file that the driver makes hold
    /// the memory (EXPORT_OBJECT_TO_FD); it lives until that file's last close.
    pub fn export(&self, buffer: &Buffer) -> Result<File, Status> {
        let share = open("/dev/nvidiactl").map_err(|_| IOCTL_FAILED)?;
        let mut p = [0u8; 24];
        put32(&mut p, 0, 1);
        put32(&mut p, 4, self.device);
        put32(&mut p, 8, self.device);
        put32(&mut p, 12, buffer.handle);
        put32(&mut p, 16, share.as_raw_fd() as u32);
        self.control(0x3d05, &mut p)?;
        Ok(share)
    }

    /// cuMemImportFromShareableHandle: a handle in this context to what `share` holds.
    pub fn import(&self, share: &File) -> Result<u32, Status> {
        let mut p = [0u8; 20];
        put32(&mut p, 0, share.as_raw_fd() as u32);
        put32(&mut p, 4, 1);
        put32(&mut p, 8, self.device);
        put32(&mut p, 12, self.device);
        self.control(0x3d06, &mut p)?;
        Ok(get32(&p, 16))
    }

    /// The same, the way current libcuda does it: EXPORT_OBJECTS_TO_FD, the batched form (2128
    /// bytes), with the one object in slot 0 of a file made for one.
    pub fn export_batched(&self, buffer: &Buffer) -> Result<File, Status> {
        let share = open("/dev/nvidiactl").map_err(|_| IOCTL_FAILED)?;
        let mut p = vec![0u8; 2128];
        put32(&mut p, 0, share.as_raw_fd() as u32);
        put32(&mut p, 4, self.device);
        put16(&mut p, 8, 1);
        put32(&mut p, 76, buffer.handle);
        put16(&mut p, 2124, 1);
        self.control(0x3d0b, &mut p)?;
        Ok(share)
    }

    /// IMPORT_OBJECTS_FROM_FD: slot 0 of `share` under a handle this process chooses, as libcuda
    /// does; RM says by the type it writes back whether anything was imported.
    pub fn import_batched(&self, share: &File) -> Result<u32, Status> {
        const HANDLE: u32 = 0xbeef_0001;
        let mut p = vec![0u8; 652];
        put32(&mut p, 0, share.as_raw_fd() as u32);
        put32(&mut p, 4, self.device);
        put32(&mut p, 8, HANDLE);
        put16(&mut p, 648, 1);
        self.control(0x3d0c, &mut p)?;
        if p[520] == 0 {
            return Err(IOCTL_FAILED);
        }
        Ok(HANDLE)
    }

    /// RM_FREE of one handle, directly or wrapped in NV_ESC_IOCTL_XFER_CMD.
    pub fn free_handle(&self, handle: u32, wrapped: bool) -> Result<(), Status> {
        let mut p = [0u8; 16];
        put32(&mut p, 0, self.client);
        put32(&mut p, 4, self.device);
        put32(&mut p, 8, handle);
        if wrapped {
            let mut xfer = [0u8; 16];
            put32(&mut xfer, 0, esc::RM_FREE);
            put32(&mut xfer, 4, 16);
            put64(&mut xfer, 8, p.as_mut_ptr() as u64);
            ioctl(&self.ctl, rm_cmd(esc::XFER, 16), xfer.as_mut_ptr())?;
        } else {
            ioctl(&self.ctl, rm_cmd(esc::RM_FREE, 16), p.as_mut_ptr())?;
        }
        check(get32(&p, 12))
    }

    /// UVM_UNMAP_EXTERNAL (cuMemUnmap): the mappings in [va, va + length) go, the range stays.
    pub fn unmap(&self, va: u64, length: u64) -> Result<(), Status> {
        let mut p = [0u8; 40];
        put64(&mut p, 0, va);
        put64(&mut p, 8, length);
        self.uvm_call(uvm::UNMAP_EXTERNAL, &mut p, 32)
    }

    /// UVM_FREE of the range at `va`.
    pub fn free_range(&self, va: u64) -> Result<(), Status> {
        let size = self.abi.uvm_free_size;
        let mut p = vec![0u8; size];
        put64(&mut p, 0, va);
        self.uvm_call(uvm::FREE, &mut p, size - 8)
    }

    /// cudaFree: the memory handle, then its UVM range.
    pub fn free(&self, buffer: &Buffer) -> Result<(), Status> {
        self.free_handle(buffer.handle, false)?;
        match buffer.va {
            Some(va) => self.free_range(va),
            None => Ok(()),
        }
    }
}
