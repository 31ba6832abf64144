//! A stand-in for libnvidia-ml.so.1 with the NVML entry points gputrace uses, its figures read
//! from the state file the fake driver keeps (`$FAKEGPU_STATE`, default /dev/fakegpu-state.json),
//! one device per GPU of the fake driver, indexed as its device instances. In unified-memory mode
//! device memory info is NVML_ERROR_NOT_SUPPORTED, as on DGX Spark, while per-process figures
//! still answer.
#![allow(non_snake_case)]

use std::ffi::c_char;

use serde::Deserialize;

type Return = u32;
const SUCCESS: Return = 0;
const ERROR_UNINITIALIZED: Return = 1;
const ERROR_INVALID_ARGUMENT: Return = 2;
const ERROR_NOT_SUPPORTED: Return = 3;
const ERROR_INSUFFICIENT_SIZE: Return = 7;
const ERROR_DRIVER_NOT_LOADED: Return = 9;

#[derive(Deserialize)]
struct State {
    version: String,
    unified: bool,
    devices: Vec<Device>,
}

#[derive(Deserialize)]
struct Device {
    name: String,
    total: u64,
    used: u64,
    processes: Vec<(u32, u64)>,
}

fn state() -> Option<State> {
    let path = std::env::var("FAKEGPU_STATE").unwrap_or_else(|_| "/dev/fakegpu-state.json".into());
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// Device handles: NVML's are opaque pointers; here the address of one byte per device.
const MAX_DEVICES: usize = 64;
static DEVICES: [u8; MAX_DEVICES] = [0; MAX_DEVICES];

/// The state and the device a handle names, when both exist.
fn device(handle: *const u8) -> Result<(State, usize), Return> {
    let s = state().ok_or(ERROR_UNINITIALIZED)?;
    let index = (handle as usize).wrapping_sub(DEVICES.as_ptr() as usize);
    if index < s.devices.len() && std::ptr::eq(handle, &DEVICES[index]) {
        Ok((s, index))
    } else {
        Err(ERROR_INVALID_ARGUMENT)
    }
}

/// SAFETY: `out` is null or has `length` writable bytes (NVML's contract for string outputs).
unsafe fn copy_str(text: &str, out: *mut c_char, length: u32) -> Return {
    if out.is_null() || (length as usize) < text.len() + 1 {
        return ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: the caller gave `length` writable bytes, checked above.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), out as *mut u8, text.len());
        *out.add(text.len()) = 0;
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> Return {
    if state().is_some() {
        SUCCESS
    } else {
        ERROR_DRIVER_NOT_LOADED
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: u32) -> Return {
    nvmlInit_v2()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> Return {
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(_result: Return) -> *const c_char {
    c"fake NVML error".as_ptr()
}

/// # Safety
/// Pointer arguments follow NVML's API: valid for what it writes, or null where NVML allows it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: u32) -> Return {
    match state() {
        Some(s) => unsafe { copy_str(&s.version, version, length) },
        None => ERROR_UNINITIALIZED,
    }
}

/// # Safety
/// Pointer arguments follow NVML's API: valid for what it writes, or null where NVML allows it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut u32) -> Return {
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let Some(s) = state() else { return ERROR_UNINITIALIZED };
    // SAFETY: checked non-null; the caller owns it.
    unsafe { *count = s.devices.len().min(MAX_DEVICES) as u32 };
    SUCCESS
}

/// # Safety
/// Pointer arguments follow NVML's API: valid for what it writes, or null where NVML allows it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: u32, device: *mut *const u8) -> Return {
    let Some(s) = state() else { return ERROR_UNINITIALIZED };
    if index as usize >= s.devices.len().min(MAX_DEVICES) || device.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; the caller owns it.
    unsafe { *device = &DEVICES[index as usize] };
    SUCCESS
}

/// # Safety
/// Pointer arguments follow NVML's API: valid for what it writes, or null where NVML allows it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(device: *const u8, name: *mut c_char, length: u32) -> Return {
    match self::device(device) {
        Ok((s, i)) => unsafe { copy_str(&s.devices[i].name, name, length) },
        Err(e) => e,
    }
}

#[repr(C)]
pub struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct MemoryV2 {
    version: u32,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

/// # Safety
/// Pointer arguments follow NVML's API: valid for what it writes, or null where NVML allows it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: *const u8, memory: *mut Memory) -> Return {
    let (s, i) = match self::device(device) {
        Ok(found) => found,
        Err(e) => return e,
    };
    if memory.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    if s.unified {
        return ERROR_NOT_SUPPORTED;
    }
    let d = &s.devices[i];
    // SAFETY: checked non-null; the caller owns it.
    unsafe { *memory = Memory { total: d.total, free: d.total - d.used, used: d.used } };
    SUCCESS
}

/// # Safety
/// Pointer arguments follow NVML's API: valid for what it writes, or null where NVML allows it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(device: *const u8, memory: *mut MemoryV2) -> Return {
    let (s, i) = match self::device(device) {
        Ok(found) => found,
        Err(e) => return e,
    };
    if memory.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    if s.unified {
        return ERROR_NOT_SUPPORTED;
    }
    let d = &s.devices[i];
    // SAFETY: checked non-null; the caller set `version` and owns the rest.
    unsafe {
        let version = (*memory).version;
        *memory = MemoryV2 { version, total: d.total, reserved: 0, free: d.total - d.used, used: d.used };
    }
    SUCCESS
}

#[repr(C)]
pub struct ProcessInfo {
    pid: u32,
    used_gpu_memory: u64,
    gpu_instance_id: u32,
    compute_instance_id: u32,
}

/// NVML's two-call protocol: a short buffer gets INSUFFICIENT_SIZE with the count needed.
/// # Safety
/// Pointer arguments follow NVML's API: valid for what it writes, or null where NVML allows it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(device: *const u8, count: *mut u32, infos: *mut ProcessInfo) -> Return {
    let (s, i) = match self::device(device) {
        Ok(found) => found,
        Err(e) => return e,
    };
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let processes = &s.devices[i].processes;
    // SAFETY: checked non-null; `infos` has room for `*count` entries as NVML's contract says.
    unsafe {
        let room = *count as usize;
        *count = processes.len() as u32;
        if room < processes.len() || (infos.is_null() && !processes.is_empty()) {
            return ERROR_INSUFFICIENT_SIZE;
        }
        for (i, (pid, used)) in processes.iter().enumerate() {
            *infos.add(i) = ProcessInfo { pid: *pid, used_gpu_memory: *used, gpu_instance_id: u32::MAX, compute_instance_id: u32::MAX };
        }
    }
    SUCCESS
}
