//! Bytes to typed events. Two steps: a ring buffer record becomes a [`Raw`] (length-checked, no
//! unsafe reads past the end), then an ioctl's params become an [`Event`] for the driver's
//! [`Layout`]. Bad input is an error value, never a panic.

use std::mem::size_of;

use thiserror::Error;
use tracer_common::{
    control, control_params_size, device, escape, ioc_nr, ioc_size, ioctl_flag, kind, uvm, ExecRecord, FdRecord, IoctlRecord, OpenRecord,
    RecordHeader, SockRecord,
};

use crate::abi::{class, offsets as o, DriverVersion, Layout};
use crate::event::{Alloc, Device, Event, Memory, Via};

#[derive(Debug, Error, PartialEq)]
pub enum DecodeError {
    #[error("record of {0} bytes is shorter than its header")]
    Short(usize),
    #[error("record kind {kind} needs {need} bytes, got {got}")]
    Truncated { kind: u32, need: usize, got: usize },
    #[error("unknown record kind {0}")]
    UnknownKind(u32),
}

/// An ioctl as the kernel side captured it.
#[derive(Clone, Debug, PartialEq)]
pub struct RawIoctl {
    pub fd: i32,
    pub cmd: u32,
    pub escape_cmd: u32,
    pub ret: i64,
    /// Known device, or None while the kernel's question about this fd is unanswered.
    pub device: Option<Device>,
    pub flags: u8,
    /// The kernel's `struct file *` for a question (0 when unknown).
    pub file: u64,
    /// The kernel's `struct file *` behind the fd an export or import names (0 otherwise).
    pub named_file: u64,
    pub params: Vec<u8>,
    pub class_params: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RawKind {
    Ioctl(RawIoctl),
    /// `file` is the kernel's `struct file *` (0 when unknown).
    Open {
        fd: i32,
        flags: i32,
        device: Option<Device>,
        file: u64,
    },
    Close {
        fd: i32,
        /// The kernel had no entry for it: a close by a child still inheriting its parent's fds
        /// (any other close the kernel sends, it has forgotten already).
        inheriting: bool,
    },
    Dup {
        old_fd: i32,
        new_fd: i32,
        cloexec: bool,
    },
    CloseRange {
        first: u32,
        last: u32,
        flags: u32,
    },
    SetCloexec {
        fd: i32,
        cloexec: bool,
    },
    Fork {
        child: u32,
    },
    Exec {
        filename: String,
        /// The argv it was given, as far as the kernel side could read it (empty: unknown), and
        /// whether that is all of it.
        argv: Vec<String>,
        argv_whole: bool,
    },
    /// The whole process is gone; `status` as wait(2) would give it, where the kernel's BTF let
    /// the kernel side read it.
    Exit {
        status: Option<i32>,
    },
    Bind {
        fd: i32,
        port: u16,
    },
    Listen {
        fd: i32,
    },
    Accept {
        fd: i32,
    },
    ConnClose {
        fd: i32,
    },
    /// A read (`inbound`) or write on an accepted connection: its length and first bytes.
    SockIo {
        fd: i32,
        inbound: bool,
        len: i64,
        head: Vec<u8>,
    },
    OomVictim {
        victim: u32,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Raw {
    pub ts: u64,
    pub pid: u32,
    pub tid: u32,
    pub kind: RawKind,
}

pub fn device_from_kernel(state: u8) -> Option<Device> {
    match state {
        device::CTL => Some(Device::Ctl),
        device::GPU => Some(Device::Gpu),
        device::UVM => Some(Device::Uvm),
        _ => None,
    }
}

fn read<T: Copy>(bytes: &[u8], kind: u32) -> Result<T, DecodeError> {
    if bytes.len() < size_of::<T>() {
        return Err(DecodeError::Truncated { kind, need: size_of::<T>(), got: bytes.len() });
    }
    // SAFETY: the length is checked and T is a plain #[repr(C)] record of integers and arrays.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr() as *const T) })
}

fn c_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Parses one ring buffer record.
pub fn parse_record(bytes: &[u8]) -> Result<Raw, DecodeError> {
    if bytes.len() < size_of::<RecordHeader>() {
        return Err(DecodeError::Short(bytes.len()));
    }
    let header: RecordHeader = read(bytes, 0)?;
    let k = header.kind;
    let fd_record = || read::<FdRecord>(bytes, k);
    let raw_kind = match k {
        kind::IOCTL => {
            let r: IoctlRecord = read(bytes, k)?;
            let params_len = (r.params_len as usize).min(r.params.len());
            let class_len = (r.class_len as usize).min(r.class_params.len());
            RawKind::Ioctl(RawIoctl {
                fd: r.fd,
                cmd: r.cmd,
                escape_cmd: r.escape_cmd,
                ret: r.ret,
                device: device_from_kernel(r.device),
                flags: r.flags,
                file: r.file,
                named_file: r.named_file,
                params: r.params[..params_len].to_vec(),
                class_params: r.class_params[..class_len].to_vec(),
            })
        }
        kind::OPEN => {
            let r: OpenRecord = read(bytes, k)?;
            RawKind::Open { fd: r.fd, flags: r.flags, device: device_from_kernel(r.device), file: r.file }
        }
        kind::CLOSE => {
            let r = fd_record()?;
            RawKind::Close { fd: r.a as i32, inheriting: r.b != 0 }
        }
        kind::DUP => {
            let r = fd_record()?;
            RawKind::Dup { old_fd: r.a as i32, new_fd: r.b as i32, cloexec: r.c != 0 }
        }
        kind::CLOSE_RANGE => {
            let r = fd_record()?;
            RawKind::CloseRange { first: r.a as u32, last: r.b as u32, flags: r.c as u32 }
        }
        kind::SET_CLOEXEC => {
            let r = fd_record()?;
            RawKind::SetCloexec { fd: r.a as i32, cloexec: r.b != 0 }
        }
        kind::FORK => RawKind::Fork { child: fd_record()?.a as u32 },
        kind::EXEC => {
            let r: ExecRecord = read(bytes, k)?;
            let args = &r.args[..(r.args_len as usize).min(r.args.len())];
            let whole = r.args_whole == 1;
            // A part ends inside an argument (`--max-num-seqs 25` of 2560): only those it holds
            // whole are kept.
            let args = if whole { args } else { args.iter().rposition(|&b| b == 0).map_or(&args[..0], |end| &args[..end]) };
            let argv = crate::procfs::command::argv(args);
            // An empty argv (execve with none, or only "") names nothing: /proc or the file do.
            RawKind::Exec { filename: c_string(&r.filename), argv_whole: whole && !argv.is_empty(), argv }
        }
        kind::EXIT => {
            let r = fd_record()?;
            RawKind::Exit { status: (r.b != 0).then_some(r.a as i32) }
        }
        kind::BIND => {
            let r = fd_record()?;
            RawKind::Bind { fd: r.a as i32, port: r.b as u16 }
        }
        kind::LISTEN => RawKind::Listen { fd: fd_record()?.a as i32 },
        kind::ACCEPT => RawKind::Accept { fd: fd_record()?.a as i32 },
        kind::CONN_CLOSE => RawKind::ConnClose { fd: fd_record()?.a as i32 },
        kind::OOM_VICTIM => RawKind::OomVictim { victim: fd_record()?.a as u32 },
        kind::SOCK_IO => {
            let r: SockRecord = read(bytes, k)?;
            let head_len = (r.head_len as usize).min(r.head.len());
            RawKind::SockIo { fd: r.fd, inbound: r.inbound != 0, len: r.len, head: r.head[..head_len].to_vec() }
        }
        other => return Err(DecodeError::UnknownKind(other)),
    };
    Ok(Raw { ts: header.ts_ns, pid: header.tgid, tid: header.tid, kind: raw_kind })
}

/// Little-endian field reader over a params struct that may be shorter than expected.
struct Params<'a>(&'a [u8]);

impl Params<'_> {
    fn u32(&self, at: usize) -> Option<u32> {
        self.0.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }
    fn u64(&self, at: usize) -> Option<u64> {
        self.0.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
    fn u16(&self, at: usize) -> Option<u16> {
        self.0.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }
    fn u8(&self, at: usize) -> Option<u8> {
        self.0.get(at).copied()
    }
}

fn undecodable(raw: &RawIoctl, reason: impl Into<String>) -> Event {
    Event::Undecodable { fd: raw.fd, cmd: raw.escape_cmd, reason: reason.into() }
}

/// The errno when ioctl() itself failed: the driver never ran, the struct holds what the caller wrote.
fn errno(raw: &RawIoctl) -> Option<i32> {
    // A kernel returns -4095..-1; anything below is not an errno, and must not overflow either.
    (raw.ret < 0).then(|| i32::try_from(raw.ret.unsigned_abs()).unwrap_or(i32::MAX))
}

/// Decodes one ioctl on a known NVIDIA device. Returns None for escapes that carry nothing for the
/// model (a failed REGISTER_FD, say).
pub fn decode_ioctl(layout: &Layout, raw: &RawIoctl) -> Option<Event> {
    if raw.flags & ioctl_flag::PARAMS_FAULT != 0 {
        return Some(undecodable(raw, "reading the params from the process's memory failed"));
    }
    let p = Params(&raw.params);
    let nr = ioc_nr(raw.escape_cmd);
    let size = ioc_size(raw.escape_cmd);
    let needed = match (raw.device, raw.cmd) {
        (Some(Device::Uvm), uvm::CREATE_EXTERNAL_RANGE) => 24,
        (Some(Device::Uvm), uvm::MAP_EXTERNAL_ALLOCATION) => 40,
        (Some(Device::Uvm), uvm::ALLOC_SEMAPHORE_POOL) => 28,
        (Some(Device::Uvm), uvm::FREE) => layout.uvm_free_size as usize,
        (Some(Device::Uvm), _) => 0,
        _ if nr == escape::RM_ALLOC => size.max(32) as usize,
        _ => tracer_common::rm_params_size(nr).unwrap_or(0) as usize,
    };
    if raw.params.len() < needed {
        return Some(undecodable(raw, format!("params are {} bytes, the layout needs {needed}", raw.params.len())));
    }
    if raw.device == Some(Device::Uvm) {
        return decode_uvm(layout, raw, &p);
    }
    match nr {
        escape::RM_ALLOC => decode_rm_alloc(layout, raw, &p, size),
        escape::RM_FREE => Some(Event::Free {
            fd: raw.fd,
            via: Via::RmFree,
            client: p.u32(o::FREE_ROOT)?,
            parent: p.u32(o::FREE_PARENT)?,
            object: p.u32(o::FREE_OLD)?,
            status: status_or_errno(raw, p.u32(o::FREE_STATUS)?),
        }),
        escape::RM_VID_HEAP_CONTROL => decode_vid_heap(layout, raw, &p),
        escape::RM_ALLOC_MEMORY => decode_alloc_memory(raw, &p),
        escape::RM_DUP_OBJECT => Some(Event::DupObject {
            fd: raw.fd,
            client: p.u32(o::DUP_CLIENT)?,
            parent: p.u32(o::DUP_PARENT)?,
            object: p.u32(o::DUP_OBJECT)?,
            src_client: p.u32(o::DUP_CLIENT_SRC)?,
            src_object: p.u32(o::DUP_OBJECT_SRC)?,
            status: status_or_errno(raw, p.u32(o::DUP_STATUS)?),
        }),
        escape::RM_SHARE => Some(Event::Share {
            fd: raw.fd,
            client: p.u32(o::SHARE_CLIENT)?,
            object: p.u32(o::SHARE_OBJECT)?,
            share_type: p.u16(o::SHARE_TYPE)?,
            target: p.u32(o::SHARE_TARGET)?,
            action: p.u8(o::SHARE_ACTION)?,
            status: status_or_errno(raw, p.u32(o::SHARE_STATUS)?),
        }),
        escape::RM_CONTROL => decode_control(layout, raw, &p),
        escape::REGISTER_FD => {
            if raw.ret != 0 {
                return None;
            }
            Some(Event::RegisterFd { fd: raw.fd, ctl_fd: p.u32(o::REGISTER_FD_CTL)? as i32 })
        }
        _ => Some(undecodable(raw, "not an escape gputrace follows")),
    }
}

/// The controls the kernel side lets through (`tracer_common::control`), their params copied
/// from behind NVOS54's pointer.
fn decode_control(layout: &Layout, raw: &RawIoctl, p: &Params) -> Option<Event> {
    let (client, cmd) = (p.u32(0)?, p.u32(control::CMD)?);
    let fabric_control = matches!(
        cmd,
        control::FABRIC_ATTACH_MEM | control::FABRIC_DETACH_MEM | control::MULTICAST_ATTACH_MEM | control::MULTICAST_DETACH_MEM
    );
    // From 570 an attachment holds nothing (freeing the memory detaches it): nothing to record.
    if fabric_control && !layout.fabric_attach_holds {
        return None;
    }
    let status = status_or_errno(raw, p.u32(control::STATUS)?);
    let c = Params(&raw.class_params);
    let need = control_params_size(cmd).unwrap_or(0) as usize;
    if raw.class_params.len() < need {
        let why = if raw.flags & ioctl_flag::CLASS_FAULT != 0 { "reading" } else { "capturing" };
        return Some(undecodable(raw, format!("RM_CONTROL {cmd:#x}: {why} its params behind NVOS54's pointer failed")));
    }
    match cmd {
        control::EXPORT_OBJECT_TO_FD => {
            let (object, to_fd) = (c.u32(control::EXPORT_OBJECT_AT)?, c.u32(control::EXPORT_FD_AT)? as i32);
            Some(Event::ExportObject { fd: raw.fd, client, object, to_fd, status })
        }
        control::IMPORT_OBJECT_FROM_FD => {
            let (parent, object) = (c.u32(control::IMPORT_PARENT_AT)?, c.u32(control::IMPORT_OBJECT_AT)?);
            Some(Event::ImportObject { fd: raw.fd, client, parent, object, from_fd: c.u32(control::IMPORT_FD_AT)? as i32, status })
        }
        control::EXPORT_OBJECTS_TO_FD | control::IMPORT_OBJECTS_FROM_FD => {
            let count = c.u16(control::PACKED_COUNT)?;
            let index = c.u16(control::PACKED_COUNT + 2)?;
            let followed = usize::from(count).min(control::OBJECTS_FOLLOWED);
            let more = count - followed as u16;
            let mut objects: Vec<u32> = (0..followed).map(|i| c.u32(control::PACKED_OBJECTS + 4 * i)).collect::<Option<_>>()?;
            let (file_fd, second) = (c.u32(control::PACKED_HEAD)? as i32, c.u32(control::PACKED_HEAD + 4)?);
            if cmd == control::EXPORT_OBJECTS_TO_FD {
                return Some(Event::ExportObjects { fd: raw.fd, client, objects, index, more, to_fd: file_fd, status });
            }
            // RM writes a type per handle: none where that slot held nothing to import.
            for (i, object) in objects.iter_mut().enumerate() {
                if c.u8(control::PACKED_TYPES + i)? == 0 {
                    *object = 0;
                }
            }
            Some(Event::ImportObjects { fd: raw.fd, client, parent: second, objects, index, more, from_fd: file_fd, status })
        }
        control::FABRIC_ATTACH_MEM | control::FABRIC_DETACH_MEM => {
            let fabric = p.u32(control::OBJECT)?;
            let at = if cmd == control::FABRIC_ATTACH_MEM { control::PACKED_ATTACH_COUNTS } else { control::PACKED_DETACH_COUNTS };
            // numMemInfos@0 flags@4 numAttached@8 (numOffsets, flags, numDetached alike).
            let (count, done) = (c.u16(at)?, c.u16(at + 8)?);
            let followed = usize::from(count).min(control::FABRIC_FOLLOWED);
            let more = count - followed as u16;
            if cmd == control::FABRIC_ATTACH_MEM {
                let attachments = (0..followed).map(|i| Some((c.u32(16 * i)?, c.u64(16 * i + 8)?))).collect::<Option<_>>()?;
                return Some(Event::FabricAttach { fd: raw.fd, client, fabric, subdevice: 0, attachments, attached: done, more, status });
            }
            let offsets = (0..followed).map(|i| c.u64(8 * i)).collect::<Option<_>>()?;
            Some(Event::FabricDetach { fd: raw.fd, client, fabric, subdevice: 0, offsets, detached: done, more, status })
        }
        // One each, on one GPU's subdevice: done when RM says so.
        control::MULTICAST_ATTACH_MEM => {
            let attachments = vec![(c.u32(4)?, c.u64(8)?)];
            let attached = u16::from(status == 0);
            Some(Event::FabricAttach {
                fd: raw.fd,
                client,
                fabric: p.u32(control::OBJECT)?,
                subdevice: c.u32(0)?,
                attachments,
                attached,
                more: 0,
                status,
            })
        }
        control::MULTICAST_DETACH_MEM => {
            let (offsets, detached) = (vec![c.u64(8)?], u16::from(status == 0));
            Some(Event::FabricDetach {
                fd: raw.fd,
                client,
                fabric: p.u32(control::OBJECT)?,
                subdevice: c.u32(0)?,
                offsets,
                detached,
                more: 0,
                status,
            })
        }
        _ => Some(undecodable(raw, format!("RM_CONTROL {cmd:#x} is not a control gputrace follows"))),
    }
}

/// A failed ioctl() never reached RM, so its status field is whatever the caller left; report the
/// errno instead as a generic failure.
fn status_or_errno(raw: &RawIoctl, status: u32) -> u32 {
    if raw.ret < 0 {
        crate::abi::status::GENERIC_FAILURE
    } else {
        status
    }
}

fn decode_rm_alloc(layout: &Layout, raw: &RawIoctl, p: &Params, size: u32) -> Option<Event> {
    // The struct's size says its generation: a 48-byte NVOS64 is 535's even when the trace was
    // decoded with an older version's layout (a --driver-version given wrong).
    let status_at = if size == 32 {
        layout.nvos21_status
    } else if size == layout.nvos64_size {
        layout.nvos64_status
    } else if size == 48 {
        Layout::for_version(DriverVersion::new(535, 0, 0)).nvos64_status
    } else {
        layout.nvos64_status
    };
    let via = if size == 32 { Via::RmAllocNvos21 } else { Via::RmAllocNvos64 };
    let client = p.u32(o::ALLOC_ROOT)?;
    let parent = p.u32(o::ALLOC_PARENT)?;
    let object = p.u32(o::ALLOC_NEW)?;
    let hclass = p.u32(o::ALLOC_CLASS)?;
    let status = status_or_errno(raw, p.u32(status_at)?);
    let memory = match hclass {
        // LOCAL_PHYSICAL "does not allocate ANY framebuffer memory": a linear mapping of all of
        // it (phys_mem.c). An object, not memory.
        class::LOCAL_USER => Memory::Video,
        // EGM is host memory on a Grace system's NUMA node, not the GPU's.
        class::SYSTEM | class::OS_DESCRIPTOR | class::EXTENDED_USER => Memory::System,
        // Fabric objects are address space (FLA) over memory allocated as LOCAL_USER.
        class::NV50_MEMORY_VIRTUAL | class::MEMORY_VIRTUAL | class::MEMORY_FABRIC | class::MULTICAST_FABRIC => Memory::Virtual,
        _ => {
            // A new client's handle is hObjectNew; it is its own root.
            let client = if class::is_client(hclass) { object } else { client };
            let gpu = if hclass == class::DEVICE { Params(&raw.class_params).u32(o::DEVICE_ID) } else { None };
            return Some(Event::Object { fd: raw.fd, client, parent, object, class: hclass, status, gpu });
        }
    };
    let c = Params(&raw.class_params);
    let bytes = match hclass {
        class::LOCAL_USER | class::SYSTEM | class::NV50_MEMORY_VIRTUAL | class::EXTENDED_USER => c.u64(o::MEM_SIZE),
        class::MULTICAST_FABRIC => c.u64(layout.multicast_params.1),
        class::MEMORY_VIRTUAL => c.u64(o::VIRT_LIMIT).map(|l| l.wrapping_add(1)),
        class::OS_DESCRIPTOR => c.u64(o::OS_DESC_LIMIT).map(|l| l.wrapping_add(1)),
        class::MEMORY_FABRIC => c.u64(o::FABRIC_SIZE),
        _ => None,
    };
    // A sticky fabric object keeps the memory it maps alive (its dup, in every version).
    let holds = (hclass == class::MEMORY_FABRIC && c.u32(o::FABRIC_FLAGS).is_some_and(|f| f & o::FABRIC_FLEXIBLE == 0))
        .then(|| c.u32(o::FABRIC_VIDMEM))
        .flatten()
        .filter(|&h| h != 0);
    let Some(bytes) = bytes else {
        let why = if raw.flags & ioctl_flag::CLASS_FAULT != 0 {
            "reading the class params behind pAllocParms failed"
        } else {
            "the class params behind pAllocParms were not captured"
        };
        return Some(undecodable(raw, format!("RM_ALLOC of class {hclass:#x}: {why}")));
    };
    Some(Event::Alloc(Alloc {
        fd: raw.fd,
        via,
        memory,
        bytes,
        status,
        client,
        parent,
        object,
        class: hclass,
        base: None,
        errno: errno(raw),
        holds,
    }))
}

/// VID_HEAP_CONTROL: RM turns ALLOC_SIZE into an RM_ALLOC of NV50_MEMORY_VIRTUAL (flags VIRTUAL),
/// EXTENDED_USER (attr2 USE_EGM, 550 to 590), LOCAL_USER (attr LOCATION VIDMEM) or SYSTEM
/// (anything else).
fn decode_vid_heap(layout: &Layout, raw: &RawIoctl, p: &Params) -> Option<Event> {
    let function = p.u32(o::VID_FUNCTION)?;
    let client = p.u32(o::VID_ROOT)?;
    let parent = p.u32(o::VID_PARENT)?;
    let object = p.u32(o::VID_HMEMORY)?;
    let status = status_or_errno(raw, p.u32(o::VID_STATUS)?);
    match function {
        o::VID_FUNCTION_ALLOC_SIZE => {
            let flags = p.u32(o::VID_FLAGS)?;
            let attr = p.u32(o::VID_ATTR)?;
            let egm = layout.vid_heap_egm && p.u32(o::VID_ATTR2).is_some_and(|a| a & o::ATTR2_USE_EGM != 0);
            let (memory, class) = if flags & o::VID_ALLOC_FLAGS_VIRTUAL != 0 {
                (Memory::Virtual, class::NV50_MEMORY_VIRTUAL)
            } else if egm {
                (Memory::System, class::EXTENDED_USER)
            } else if (attr >> o::ATTR_LOCATION_SHIFT) & 3 == o::ATTR_LOCATION_VIDMEM {
                (Memory::Video, class::LOCAL_USER)
            } else {
                (Memory::System, class::SYSTEM)
            };
            Some(Event::Alloc(Alloc {
                fd: raw.fd,
                via: Via::VidHeapControl,
                memory,
                bytes: p.u64(o::VID_SIZE)?,
                status,
                client,
                parent,
                object,
                class,
                base: None,
                errno: errno(raw),
                holds: None,
            }))
        }
        o::VID_FUNCTION_FREE => Some(Event::Free { fd: raw.fd, via: Via::VidHeapControl, client, parent, object, status }),
        // INFO and the rest change nothing.
        _ => None,
    }
}

/// RM_ALLOC_MEMORY (the deprecated path, rmapi_deprecated_allocmemory.c): system memory (0x3e,
/// or pinned pages described by 0x71), or address space (0x70). Of LOCAL_USER it allocates no
/// memory but a mapping of the whole framebuffer (the X driver asks for it), of
/// LOCAL_PRIVILEGED a 4 GiB window with none: objects, like any class not known to be memory,
/// never counted as the size of the card.
fn decode_alloc_memory(raw: &RawIoctl, p: &Params) -> Option<Event> {
    let hclass = p.u32(o::NVOS02_CLASS)?;
    let flags = p.u32(o::NVOS02_FLAGS)?;
    let vidmem = (flags >> o::NVOS02_LOCATION_SHIFT) & 0xf == o::NVOS02_LOCATION_VIDMEM;
    let memory = match hclass {
        class::SYSTEM | class::OS_DESCRIPTOR if vidmem => Memory::Video,
        class::SYSTEM | class::OS_DESCRIPTOR => Memory::System,
        class::MEMORY_VIRTUAL => Memory::Virtual,
        _ => {
            let (client, parent, object) = (p.u32(o::NVOS02_ROOT)?, p.u32(o::NVOS02_PARENT)?, p.u32(o::NVOS02_NEW)?);
            let status = status_or_errno(raw, p.u32(o::NVOS02_STATUS)?);
            return Some(Event::Object { fd: raw.fd, client, parent, object, class: hclass, status, gpu: None });
        }
    };
    Some(Event::Alloc(Alloc {
        fd: raw.fd,
        via: Via::RmAllocMemory,
        memory,
        bytes: p.u64(o::NVOS02_LIMIT)?.wrapping_add(1),
        status: status_or_errno(raw, p.u32(o::NVOS02_STATUS)?),
        client: p.u32(o::NVOS02_ROOT)?,
        parent: p.u32(o::NVOS02_PARENT)?,
        object: p.u32(o::NVOS02_NEW)?,
        class: hclass,
        base: None,
        errno: errno(raw),
        holds: None,
    }))
}

/// UVM params arrive as the head window followed by the 16-byte tail window (see
/// `Layout::uvm_windows`).
fn decode_uvm(layout: &Layout, raw: &RawIoctl, p: &Params) -> Option<Event> {
    let uvm_alloc = |via, memory, base: u64, length: u64, status: u32| {
        Event::Alloc(Alloc {
            fd: raw.fd,
            via,
            memory,
            bytes: length,
            status: status_or_errno(raw, status),
            client: 0,
            parent: 0,
            object: 0,
            class: 0,
            base: Some(base),
            errno: errno(raw),
            holds: None,
        })
    };
    let base = p.u64(o::UVM_BASE)?;
    match raw.cmd {
        uvm::CREATE_EXTERNAL_RANGE => {
            Some(uvm_alloc(Via::UvmCreateExternalRange, Memory::Virtual, base, p.u64(o::UVM_LENGTH)?, p.u32(o::UVM_CREATE_RANGE_STATUS)?))
        }
        uvm::ALLOC_SEMAPHORE_POOL => {
            // head 16 bytes (base, length), then gpuAttributesCount(8) rmStatus(4) pad(4)
            Some(uvm_alloc(Via::UvmAllocSemaphorePool, Memory::System, base, p.u64(o::UVM_LENGTH)?, p.u32(16 + 8)?))
        }
        uvm::MAP_EXTERNAL_ALLOCATION => {
            // head 24 bytes (base, length, offset), then rmCtrlFd hClient hMemory rmStatus
            Some(Event::UvmMap {
                fd: raw.fd,
                base,
                length: p.u64(o::UVM_LENGTH)?,
                offset: p.u64(o::UVM_OFFSET)?,
                client: p.u32(24 + 4)?,
                memory: p.u32(24 + 8)?,
                status: status_or_errno(raw, p.u32(24 + 12)?),
            })
        }
        uvm::FREE => {
            let status_at = layout.uvm_free_size as usize - 8;
            Some(Event::UvmFree { fd: raw.fd, base, status: status_or_errno(raw, p.u32(status_at)?) })
        }
        uvm::UNMAP_EXTERNAL => {
            Some(Event::UvmUnmap { fd: raw.fd, base, length: p.u64(o::UVM_LENGTH)?, status: status_or_errno(raw, p.u32(32)?) })
        }
        _ => Some(undecodable(raw, "not a UVM command gputrace follows")),
    }
}

const METHODS: [&str; 7] = ["GET ", "POST ", "PUT ", "DELETE ", "HEAD ", "OPTIONS ", "PATCH "];

/// Method and path when inbound bytes start an HTTP request ("POST /v1/completions").
pub fn request_line(head: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(head);
    if !METHODS.iter().any(|m| text.starts_with(m)) {
        return None;
    }
    let line = text.split("\r\n").next().unwrap_or(&text);
    Some(line.split(' ').take(2).collect::<Vec<_>>().join(" "))
}

/// What outbound bytes carry: the status of a response's headers, and whether body data (an SSE
/// `data:` event, a chunk, a body) is in them. Prefill ends at the first data, not at headers.
pub fn response_part(head: &[u8], len: i64) -> (Option<u16>, bool) {
    if !head.starts_with(b"HTTP/1.") {
        return (None, len > 0);
    }
    let status = head.get(9..12).and_then(|d| std::str::from_utf8(d).ok()?.parse().ok());
    // Headers and data in one write show as bytes after the blank line, if it falls in the head.
    let data = head.windows(4).position(|w| w == b"\r\n\r\n").is_some_and(|end| (len as usize) > end + 4);
    (status, data)
}

#[cfg(test)]
mod tests;
