//! A stand-in for libnvidia-ml.so.1 with the NVML entry points gputrace uses, its figures read
//! from the state file the fake driver keeps (`$FAKEGPU_STATE`, default /dev/fakegpu-state.json).
//! In unified-memory mode device memory info is NVML_ERROR_NOT_SUPPORTED, as on DGX Spark, while
//! per-process figures still answer.
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
    name: String,
    total: u64,
    used: u64,
    unified: bool,
    processes: Vec<(u32, u64)>,
}

fn state() -> Option<State> {
    let path = std::env::var("FAKEGPU_STATE").unwrap_or_else(|_| "/dev/fakegpu-state.json".into());
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// The one device's handle: any non-null pointer will do, NVML handles are opaque.
static DEVICE: u8 = 0;

fn device_ok(device: *const u8) -> bool {
    std::ptr::eq(device, &DEVICE)
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
    // SAFETY: checked non-null; the caller owns it.
    unsafe { *count = 1 };
    SUCCESS
}

/// # Safety
/// Pointer arguments follow NVML's API: valid for what it writes, or null where NVML allows it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: u32, device: *mut *const u8) -> Return {
    if index != 0 || device.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; the caller owns it.
    unsafe { *device = &DEVICE };
    SUCCESS
}

/// # Safety
/// Pointer arguments follow NVML's API: valid for what it writes, or null where NVML allows it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(device: *const u8, name: *mut c_char, length: u32) -> Return {
    match state() {
        Some(s) if device_ok(device) => unsafe { copy_str(&s.name, name, length) },
        Some(_) => ERROR_INVALID_ARGUMENT,
        None => ERROR_UNINITIALIZED,
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
    let Some(s) = state() else { return ERROR_UNINITIALIZED };
    if !device_ok(device) || memory.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    if s.unified {
        return ERROR_NOT_SUPPORTED;
    }
    // SAFETY: checked non-null; the caller owns it.
    unsafe { *memory = Memory { total: s.total, free: s.total - s.used, used: s.used } };
    SUCCESS
}

/// # Safety
/// Pointer arguments follow NVML's API: valid for what it writes, or null where NVML allows it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(device: *const u8, memory: *mut MemoryV2) -> Return {
    let Some(s) = state() else { return ERROR_UNINITIALIZED };
    if !device_ok(device) || memory.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    if s.unified {
        return ERROR_NOT_SUPPORTED;
    }
    // SAFETY: checked non-null; the caller set `version` and owns the rest.
    unsafe {
        let version = (*memory).version;
        *memory = MemoryV2 { version, total: s.total, reserved: 0, free: s.total - s.used, used: s.used };
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
    let Some(s) = state() else { return ERROR_UNINITIALIZED };
    if !device_ok(device) || count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; `infos` has room for `*count` entries as NVML's contract says.
    unsafe {
        let room = *count as usize;
        *count = s.processes.len() as u32;
        if room < s.processes.len() || (infos.is_null() && !s.processes.is_empty()) {
            return ERROR_INSUFFICIENT_SIZE;
        }
        for (i, (pid, used)) in s.processes.iter().enumerate() {
            *infos.add(i) = ProcessInfo { pid: *pid, used_gpu_memory: *used, gpu_instance_id: u32::MAX, compute_instance_id: u32::MAX };
        }
    }
    SUCCESS
}
