//! A minimal FUSE server spoken directly over /dev/fuse: enough for three regular files that
//! answer ioctls (LOOKUP, GETATTR, OPEN, IOCTL, RELEASE, FLUSH and the housekeeping around them).
//! The `fuser` crate drops an ioctl's raw `arg` pointer, which the fake driver needs to reach
//! nested params (pAllocParms) and UVM params, hence this.

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;

use anyhow::{bail, Context, Result};

const FUSE_LOOKUP: u32 = 1;
const FUSE_FORGET: u32 = 2;
const FUSE_GETATTR: u32 = 3;
const FUSE_SETATTR: u32 = 4;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_WRITE: u32 = 16;
const FUSE_STATFS: u32 = 17;
const FUSE_RELEASE: u32 = 18;
const FUSE_FLUSH: u32 = 25;
const FUSE_INIT: u32 = 26;
const FUSE_OPENDIR: u32 = 27;
const FUSE_RELEASEDIR: u32 = 29;
const FUSE_ACCESS: u32 = 34;
const FUSE_INTERRUPT: u32 = 36;
const FUSE_DESTROY: u32 = 38;
const FUSE_IOCTL: u32 = 39;
const FUSE_BATCH_FORGET: u32 = 42;

const ROOT: u64 = 1;
const IN_HEADER: usize = 40;

/// Who is calling: FUSE puts the calling thread's id in every request.
#[derive(Clone, Copy, Debug)]
pub struct Caller {
    pub tid: u32,
    pub uid: u32,
}

/// How a filesystem answers READ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reads {
    AtOnce,
    After(std::time::Duration),
    Never,
}

/// What an ioctl handler answers: the return value and the bytes the kernel copies back out.
pub struct IoctlReply {
    pub result: i32,
    pub out: Vec<u8>,
}

/// The filesystem behind the mount: named files, each open gets a handle.
pub trait Files {
    /// The files in the root directory: (name, inode), inodes from 2.
    fn names(&self) -> &[(&'static str, u64)];
    fn open(&mut self, caller: Caller, inode: u64) -> u64;
    fn ioctl(&mut self, caller: Caller, fh: u64, cmd: u32, arg: u64, input: &[u8], out_size: u32) -> IoctlReply;
    fn release(&mut self, caller: Caller, fh: u64);
    /// How READ is answered (with no bytes): at once, after a while, or never. A hostile user's
    /// filesystem answers late or not at all, so whoever faults on a mapping of it waits.
    fn reads(&self) -> Reads {
        Reads::AtOnce
    }
}

pub struct Session {
    dev: File,
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

impl Session {
    /// Opens /dev/fuse and mounts it at `mountpoint` (allow_other, so any user's workload can use it).
    pub fn mount(mountpoint: &Path) -> Result<Session> {
        let dev = std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse").context("opening /dev/fuse")?;
        let opts = format!("fd={},rootmode=40000,user_id=0,group_id=0,allow_other", dev.as_raw_fd());
        let c = |s: &str| CString::new(s).unwrap();
        let target = c(mountpoint.to_str().unwrap());
        // SAFETY: mount(2) with valid C strings.
        let rc =
            unsafe { libc::mount(c("fakegpu").as_ptr(), target.as_ptr(), c("fuse").as_ptr(), libc::MS_NOSUID, c(&opts).as_ptr().cast()) };
        if rc != 0 {
            bail!("mounting FUSE at {}: {}", mountpoint.display(), std::io::Error::last_os_error());
        }
        Ok(Session { dev })
    }

    /// A second handle on the same connection, for a thread of its own. Close-on-exec: a process
    /// the launcher starts must never hold the connection, or its own release would wait on it.
    pub fn try_clone(&self) -> Result<Session> {
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) of an open fd.
        let fd = unsafe { libc::fcntl(self.dev.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            bail!("dup /dev/fuse: {}", std::io::Error::last_os_error());
        }
        Ok(Session { dev: unsafe { File::from_raw_fd(fd) } })
    }

    fn reply(&mut self, unique: u64, error: i32, body: &[u8]) {
        let mut msg = Vec::with_capacity(16 + body.len());
        msg.extend_from_slice(&((16 + body.len()) as u32).to_le_bytes());
        msg.extend_from_slice(&(-error).to_le_bytes());
        msg.extend_from_slice(&unique.to_le_bytes());
        msg.extend_from_slice(body);
        // A request the kernel gave up on (interrupted caller) makes write fail with ENOENT: harmless.
        let _ = self.dev.write_all(&msg);
    }

    /// Serves requests until the filesystem is unmounted.
    pub fn serve(&mut self, files: &mut dyn Files) -> Result<()> {
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = match self.dev.read(&mut buf) {
                Ok(n) => n,
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) => return Err(e).context("reading /dev/fuse"),
            };
            if n < IN_HEADER {
                continue;
            }
            let req = &buf[..n];
            let opcode = le32(req, 4);
            let unique = le64(req, 8);
            let nodeid = le64(req, 16);
            let caller = Caller { uid: le32(req, 24), tid: le32(req, 32) };
            let body = &req[IN_HEADER..];
            match opcode {
                FUSE_INIT => {
                    let mut out = vec![0u8; 64];
                    out[0..4].copy_from_slice(&7u32.to_le_bytes());
                    out[4..8].copy_from_slice(&31u32.to_le_bytes());
                    out[8..12].copy_from_slice(&le32(body, 8).to_le_bytes());
                    out[20..24].copy_from_slice(&(128u32 << 10).to_le_bytes()); // max_write
                    out[24..28].copy_from_slice(&1u32.to_le_bytes()); // time_gran
                    out[28..30].copy_from_slice(&32u16.to_le_bytes()); // max_pages
                    self.reply(unique, 0, &out);
                }
                FUSE_LOOKUP => {
                    let name = body.split(|&b| b == 0).next().unwrap_or_default();
                    let found = files.names().iter().find(|(n, _)| n.as_bytes() == name).map(|(_, ino)| *ino);
                    match (nodeid, found) {
                        (ROOT, Some(ino)) => {
                            let mut out = vec![0u8; 40];
                            out[0..8].copy_from_slice(&ino.to_le_bytes());
                            out[16..24].copy_from_slice(&3600u64.to_le_bytes());
                            out[24..32].copy_from_slice(&3600u64.to_le_bytes());
                            out.extend_from_slice(&attr(ino));
                            self.reply(unique, 0, &out);
                        }
                        _ => self.reply(unique, libc::ENOENT, &[]),
                    }
                }
                FUSE_GETATTR | FUSE_SETATTR => {
                    let mut out = vec![0u8; 16];
                    out[0..8].copy_from_slice(&3600u64.to_le_bytes());
                    out.extend_from_slice(&attr(nodeid));
                    self.reply(unique, 0, &out);
                }
                FUSE_OPEN => {
                    let fh = files.open(caller, nodeid);
                    let mut out = vec![0u8; 16];
                    out[0..8].copy_from_slice(&fh.to_le_bytes());
                    self.reply(unique, 0, &out);
                }
                FUSE_OPENDIR => self.reply(unique, 0, &[0u8; 16]),
                FUSE_IOCTL => {
                    let (fh, cmd, arg, in_size, out_size) =
                        (le64(body, 0), le32(body, 12), le64(body, 16), le32(body, 24) as usize, le32(body, 28));
                    let input = body.get(32..32 + in_size).unwrap_or_default();
                    let reply = files.ioctl(caller, fh, cmd, arg, input, out_size);
                    let mut out = vec![0u8; 16];
                    out[0..4].copy_from_slice(&reply.result.to_le_bytes());
                    let mut data = reply.out;
                    data.truncate(out_size as usize);
                    out.extend_from_slice(&data);
                    self.reply(unique, 0, &out);
                }
                FUSE_RELEASE => {
                    files.release(caller, le64(body, 0));
                    self.reply(unique, 0, &[]);
                }
                FUSE_FLUSH | FUSE_RELEASEDIR | FUSE_ACCESS => self.reply(unique, 0, &[]),
                FUSE_READ => match files.reads() {
                    Reads::AtOnce => self.reply(unique, 0, &[]),
                    // Whole pages of zeros: a short read would shrink the file (FUSE takes it for
                    // the end), and the next fault past it would fail at once instead of waiting.
                    Reads::After(delay) => {
                        std::thread::sleep(delay);
                        let size = (le32(body, 16) as usize).min(128 << 10);
                        self.reply(unique, 0, &vec![0u8; size]);
                    }
                    Reads::Never => {}
                },
                FUSE_WRITE => {
                    let size = le32(body, 16);
                    let mut out = vec![0u8; 8];
                    out[0..4].copy_from_slice(&size.to_le_bytes());
                    self.reply(unique, 0, &out);
                }
                FUSE_STATFS => self.reply(unique, 0, &[0u8; 80]),
                FUSE_FORGET | FUSE_BATCH_FORGET | FUSE_INTERRUPT => {}
                FUSE_DESTROY => {
                    self.reply(unique, 0, &[]);
                    return Ok(());
                }
                _ => self.reply(unique, libc::ENOSYS, &[]),
            }
        }
    }
}

/// fuse_attr: the root is a directory; the files are large regular files (mmap needs a size).
fn attr(ino: u64) -> Vec<u8> {
    let mut a = vec![0u8; 88];
    a[0..8].copy_from_slice(&ino.to_le_bytes());
    let (size, mode, nlink): (u64, u32, u32) =
        if ino == ROOT { (0, libc::S_IFDIR | 0o755, 2) } else { (1 << 40, libc::S_IFREG | 0o666, 1) };
    a[8..16].copy_from_slice(&size.to_le_bytes());
    a[60..64].copy_from_slice(&mode.to_le_bytes());
    a[64..68].copy_from_slice(&nlink.to_le_bytes());
    a[80..84].copy_from_slice(&4096u32.to_le_bytes());
    a
}
