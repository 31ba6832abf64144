//! Directories held open. gputrace runs as root: once a directory is chosen, whatever it writes,
//! renames or removes there is named relative to the directory's fd, never by a path walked
//! again, so a component renamed away or swapped for a symbolic link afterwards changes nothing.
//!
//! The dump directory of a watch is opened component by component from `/`, following no link
//! (`O_NOFOLLOW|O_DIRECTORY` at each step), and each directory on the way must be one that no
//! one but root (and, under sudo, the invoking user) can change: sshd's StrictModes rule, with
//! root's sticky directories (/tmp) allowed, since nobody else may rename what root made there.

use std::ffi::{CString, OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use crate::user::{as_user, User};

/// An open directory and the path it was opened by (for messages only).
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

/// What [`Dir::entries`] reports of each regular file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: OsString,
    pub len: u64,
    pub mtime: i64,
}

fn cstr(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a name with a NUL byte"))
}

/// One name inside a directory: no `/`, not `.` or `..`.
fn plain(name: &OsStr) -> io::Result<CString> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.contains(&b'/') || bytes == b"." || bytes == b".." {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a file name")));
    }
    cstr(name)
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: fstat fills the zeroed struct for an open fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Who may change the entries of a directory with this owner and mode: nobody but `trusted`
/// owners when it is writable by its owner only, or when it is root's and sticky (others may add
/// names, never rename or remove root's). Owned by anyone else, it is not safe.
fn safe_to_walk(st: &libc::stat, trusted: &[u32]) -> bool {
    let mode = st.st_mode;
    let others_write = mode & 0o022 != 0;
    trusted.contains(&st.st_uid) && (!others_write || (st.st_uid == 0 && mode & libc::S_ISVTX != 0))
}

impl Dir {
    /// `path` as the process would open it (links followed): for outputs a person names, opened
    /// on a thread that has their rights.
    pub fn open(path: &Path) -> io::Result<Dir> {
        let c = cstr(path.as_os_str())?;
        // SAFETY: open(2) with a NUL-terminated path; the fd is owned from here on.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Dir { fd: unsafe { OwnedFd::from_raw_fd(fd) }, path: path.to_path_buf() })
    }

    fn open_at(&self, name: &CString, display: PathBuf) -> io::Result<Dir> {
        // SAFETY: openat(2) relative to an fd this Dir owns; the new fd is owned from here on.
        let fd = unsafe {
            libc::openat(self.fd.as_raw_fd(), name.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Dir { fd: unsafe { OwnedFd::from_raw_fd(fd) }, path: display })
    }

    fn mkdir_at(&self, name: &CString, mode: libc::mode_t) -> io::Result<()> {
        // SAFETY: mkdirat(2) relative to an fd this Dir owns.
        if unsafe { libc::mkdirat(self.fd.as_raw_fd(), name.as_ptr(), mode) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The directory where a watch writes its dumps: opened from `/` with no link followed,
    /// every directory on the way safe (see [`safe_to_walk`]), created where missing (the last
    /// one private, 0700, and the invoking user's under sudo), and the last one owned by root or
    /// that user and writable by nobody else. Errors are sentences naming the directory at fault.
    pub fn for_dumps(path: &Path, user: Option<&User>) -> Result<Dir, String> {
        let absolute = if path.is_absolute() {
            path.to_path_buf()
        } else {
            std::env::current_dir().map_err(|e| format!("cannot tell the current directory: {e}"))?.join(path)
        };
        let mut names = Vec::new();
        for part in absolute.components() {
            match part {
                Component::RootDir | Component::CurDir => {}
                Component::Normal(name) => names.push(name.to_os_string()),
                Component::ParentDir | Component::Prefix(_) => {
                    return Err(format!("{} has a `..` in it: give --dump-dir as a plain path", path.display()))
                }
            }
        }
        let trusted: Vec<u32> = std::iter::once(0).chain(user.map(|u| u.uid)).collect();
        let mut dir = Dir::open(Path::new("/")).map_err(|e| format!("cannot open /: {e}"))?;
        let mut here = PathBuf::from("/");
        let last = names.len().saturating_sub(1);
        for (i, name) in names.iter().enumerate() {
            let st = fstat(dir.fd.as_raw_fd()).map_err(|e| format!("cannot read {}: {e}", here.display()))?;
            if !safe_to_walk(&st, &trusted) {
                return Err(format!(
                    "{} (owner uid {}, mode {:o}) can be changed by someone other than root{}: anyone who may write there could swap the dump directory; give --dump-dir a path whose every directory only root writes",
                    here.display(),
                    st.st_uid,
                    st.st_mode & 0o7777,
                    if user.is_some() { " and you" } else { "" }
                ));
            }
            let c = plain(name).map_err(|e| format!("{}: {e}", path.display()))?;
            here.push(name);
            let created = match dir.mkdir_at_as(&c, i == last, &st, user) {
                Ok(()) => true,
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => false,
                Err(e) => return Err(format!("cannot create {}: {e}", here.display())),
            };
            dir = dir.open_at(&c, here.clone()).map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) | Some(libc::ENOTDIR) => format!(
                    "{} is a symbolic link or not a directory: gputrace follows no link to its dump directory; give the real path",
                    here.display()
                ),
                _ => format!("cannot open {}: {e}", here.display()),
            })?;
            // Made by root in a directory only root may change: nobody could have swapped it
            // between the mkdir and the open, so giving it away is safe. (In the user's own
            // directory it was made as the user.)
            if created && i == last && st.st_uid == 0 {
                if let Some(u) = user {
                    // SAFETY: fchown(2) on the fd this Dir owns.
                    if unsafe { libc::fchown(dir.fd.as_raw_fd(), u.uid, u.gid) } != 0 {
                        return Err(format!("cannot give {} to uid {}: {}", here.display(), u.uid, io::Error::last_os_error()));
                    }
                }
            }
        }
        let st = fstat(dir.fd.as_raw_fd()).map_err(|e| format!("cannot read {}: {e}", here.display()))?;
        // Dumps are written as whoever asked for the watch: under sudo the directory must be
        // theirs (root keeps no right to write elsewhere once tracing runs), else root's.
        let owner = user.map_or(0, |u| u.uid);
        if st.st_uid != owner || st.st_mode & 0o022 != 0 {
            return Err(format!(
                "{} is not a directory that only you (uid {owner}) may write (owner uid {}, mode {:o}): give --dump-dir a private directory of yours",
                path.display(),
                st.st_uid,
                st.st_mode & 0o7777
            ));
        }
        Ok(dir)
    }

    /// Creates `name` here: the last component 0700, those before it 0755. In a directory of the
    /// invoking user's it is made as that user (theirs from the start, nothing to give away).
    fn mkdir_at_as(&self, name: &CString, last: bool, parent: &libc::stat, user: Option<&User>) -> io::Result<()> {
        let mode = if last { 0o700 } else { 0o755 };
        match user.filter(|u| parent.st_uid == u.uid && u.uid != 0) {
            Some(u) => as_user(Some(u), || self.mkdir_at(name, mode)),
            None => self.mkdir_at(name, mode),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `path/name`, for messages.
    pub fn display(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Creates (or replaces) `name` as [`create_private`] says, with the rights of
    /// whoever calls (the invoking user's thread, under sudo).
    pub fn create_private(&self, name: &OsStr) -> io::Result<File> {
        use std::os::unix::fs::FileTypeExt;
        let c = plain(name)?;
        let shown = self.path.join(name);
        let refuse = |why: String| io::Error::new(io::ErrorKind::PermissionDenied, why);
        match self.create_new(&c) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            done => return done,
        }
        let st = self.stat_at(&c)?;
        let kind = st.st_mode & libc::S_IFMT;
        if kind == libc::S_IFLNK {
            return Err(refuse(format!(
                "{} is a symbolic link: gputrace does not write through links; give the real path",
                shown.display()
            )));
        }
        if kind == libc::S_IFCHR {
            // O_NONBLOCK: a FIFO swapped in after the check must not hang the recorder; it is refused.
            let file = self.open_file(&c, libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK, 0)?;
            if !file.metadata()?.file_type().is_char_device() {
                return Err(refuse(format!("{} changed while it was opened: choose another name", shown.display())));
            }
            clear_nonblock(&file)?;
            return Ok(file);
        }
        if kind != libc::S_IFREG {
            return Err(refuse(format!("{} exists and is not a regular file: choose another name", shown.display())));
        }
        // SAFETY: setfsuid with an invalid id changes nothing and returns the current fsuid.
        let me = unsafe { libc::syscall(libc::SYS_setfsuid, u32::MAX) } as u32;
        if st.st_uid != me {
            return Err(refuse(format!(
                "{} exists and belongs to uid {}, not to you (uid {me}): gputrace will not replace it; choose another name",
                shown.display(),
                st.st_uid
            )));
        }
        // A new file beside it, renamed over the name: whatever the name points at by then (a
        // hard link planted in a shared directory), only the name changes, never that file.
        let mut fresh = OsString::from(".");
        fresh.push(name);
        fresh.push(format!(".gputrace-{}", std::process::id()));
        let fresh_c = plain(&fresh)?;
        let file = self
            .create_new(&fresh_c)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot create {}: {e}", self.path.join(&fresh).display())))?;
        if let Err(e) = self.rename(&fresh, name) {
            let _ = self.remove(&fresh);
            return Err(io::Error::new(e.kind(), format!("cannot replace {}: {e}", shown.display())));
        }
        Ok(file)
    }

    fn create_new(&self, name: &CString) -> io::Result<File> {
        self.open_file(name, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC, 0o600)
    }

    fn open_file(&self, name: &CString, flags: libc::c_int, mode: libc::c_uint) -> io::Result<File> {
        // SAFETY: openat(2) relative to an fd this Dir owns; the new fd is owned by the File.
        let fd = unsafe { libc::openat(self.fd.as_raw_fd(), name.as_ptr(), flags, mode) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    fn stat_at(&self, name: &CString) -> io::Result<libc::stat> {
        // SAFETY: fstatat(2) relative to an fd this Dir owns, into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatat(self.fd.as_raw_fd(), name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st)
    }

    /// Renames `from` to `to`, both in this directory.
    pub fn rename(&self, from: &OsStr, to: &OsStr) -> io::Result<()> {
        let (from, to) = (plain(from)?, plain(to)?);
        let fd = self.fd.as_raw_fd();
        // SAFETY: renameat(2) with both names relative to the fd this Dir owns.
        if unsafe { libc::renameat(fd, from.as_ptr(), fd, to.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Removes the file `name` (never a directory).
    pub fn remove(&self, name: &OsStr) -> io::Result<()> {
        let c = plain(name)?;
        // SAFETY: unlinkat(2) relative to the fd this Dir owns.
        if unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The regular files here (at most `limit` names looked at), from the directory itself: its
    /// fd's own /proc link leads to it whatever its path has become.
    pub fn entries(&self, limit: usize) -> Vec<Entry> {
        let listing = std::fs::read_dir(format!("/proc/self/fd/{}", self.fd.as_raw_fd()));
        let names = listing.into_iter().flatten().filter_map(Result::ok).take(limit).map(|e| e.file_name());
        names
            .filter_map(|name| {
                let st = self.stat_at(&plain(&name).ok()?).ok()?;
                (st.st_mode & libc::S_IFMT == libc::S_IFREG).then_some(Entry { name, len: st.st_size as u64, mtime: st.st_mtime })
            })
            .collect()
    }
}

pub(crate) fn clear_nonblock(file: &File) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor this File owns.
    unsafe {
        let flags = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Creates (or replaces) an output file the way a careful shell redirection would, as `user`:
/// - a new file is created exclusively, mode 0600, never through a symbolic link;
/// - an existing regular file of the writer's is replaced by a new one renamed over its name:
///   the old file is never opened, so a name swapped for a hard link to another file between a
///   check and a write (fs.protected_hardlinks may be 0) can never get that file truncated;
/// - a character device the writer may open (/dev/null) is written as is;
/// - anything else (a symbolic link, a FIFO, a directory, someone else's file) is refused.
///
/// The directory is opened once, as the user would open it, and the rest is relative to it.
pub fn create_private(path: &Path, user: Option<&User>) -> io::Result<File> {
    let name = path.file_name().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{} names no file", path.display())))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    as_user(user, || Dir::open(parent)?.create_private(name))
}

/// Opens a file to read (a trace) as `user` would: with that user's rights, not root's, and only a
/// regular file. The name is pinned first (O_PATH opens nothing) and only a regular file is then
/// opened: a device at the name (a link to /dev/watchdog, which an open arms and a close without
/// its magic word leaves armed) is never opened for its side effects, a FIFO never hangs the
/// reader nor frees a writer waiting on it.
pub fn open_for_reading(path: &Path, user: Option<&User>) -> io::Result<File> {
    as_user(user, || {
        let pinned = OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC | libc::O_PATH).open(path)?;
        let meta = pinned.metadata()?;
        if !meta.file_type().is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
        }
        reopen_to_read(&pinned, &meta)
    })
}

/// The regular file `pinned` (O_PATH, found regular as `meta`) opened to read, with the rights of
/// whoever asks now; refused if what is there is no longer that file.
pub(crate) fn reopen_to_read(pinned: &File, meta: &std::fs::Metadata) -> io::Result<File> {
    use std::os::unix::fs::MetadataExt;
    // O_NONBLOCK: a regular file never blocks, but should a bind mount swap it, nothing hangs.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(format!("/proc/self/fd/{}", pinned.as_raw_fd()))?;
    let again = file.metadata()?;
    if !again.file_type().is_file() || (again.dev(), again.ino()) != (meta.dev(), meta.ino()) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "it changed while it was opened"));
    }
    clear_nonblock(&file)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn st(uid: u32, mode: u32) -> libc::stat {
        // SAFETY: a plain C struct, zeroed.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        st.st_uid = uid;
        st.st_mode = libc::S_IFDIR | mode;
        st
    }

    #[test]
    fn who_may_change_a_directory_on_the_way() {
        assert!(safe_to_walk(&st(0, 0o755), &[0]));
        assert!(safe_to_walk(&st(0, 0o1777), &[0]), "/tmp: root's and sticky");
        assert!(!safe_to_walk(&st(0, 0o777), &[0]), "writable by all, not sticky");
        assert!(!safe_to_walk(&st(0, 0o775), &[0]), "writable by its group");
        assert!(!safe_to_walk(&st(1000, 0o755), &[0]), "another user's");
        assert!(safe_to_walk(&st(1000, 0o700), &[0, 1000]), "the invoking user's own, under sudo");
        assert!(!safe_to_walk(&st(1000, 0o1777), &[0, 1000]), "sticky counts for root's directories only");
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gputrace-dir-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Only a regular file is opened to read: a FIFO at the name is refused without being
    /// opened (its opening frees a writer waiting on it, as a device's opening would arm it).
    #[test]
    fn a_trace_that_is_no_regular_file_is_never_opened() {
        let dir = scratch("fifo");
        let fifo = dir.join("x.trace");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || OpenOptions::new().write(true).open(fifo).is_ok())
        };
        let link = dir.join("link.trace");
        std::os::unix::fs::symlink(&fifo, &link).unwrap();
        for path in [&fifo, &link] {
            let e = open_for_reading(path, None).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{e}");
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(!writer.is_finished(), "the FIFO was opened: its writer went on");
        // Let the writer go.
        drop(OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap());
        assert!(writer.join().unwrap());
        let plain = dir.join("plain.trace");
        std::fs::write(&plain, "a trace").unwrap();
        let mut text = String::new();
        std::io::Read::read_to_string(&mut open_for_reading(&plain, None).unwrap(), &mut text).unwrap();
        assert_eq!(text, "a trace");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_new_file_is_private_and_a_link_is_refused() {
        let dir = scratch("own");
        let path = dir.join("new.trace");
        create_private(&path, None).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        // Replacing one's own file is allowed, and leaves it private.
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        std::fs::write(&path, "old").unwrap();
        create_private(&path, None).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        let target = dir.join("target");
        std::fs::write(&target, "keep").unwrap();
        let link = dir.join("link.trace");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = create_private(&link, None).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        // A planted hard link to the user's own file: the name is replaced, the file untouched.
        let linked = dir.join("linked.trace");
        std::fs::hard_link(&target, &linked).unwrap();
        let mut out = create_private(&linked, None).unwrap();
        std::io::Write::write_all(&mut out, b"trace").unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep", "a planted hard link never truncates its file");
        assert_eq!(std::fs::read_to_string(&linked).unwrap(), "trace");
        assert_eq!(std::fs::metadata(&linked).unwrap().mode() & 0o777, 0o600);
        let fifo = dir.join("fifo");
        let c = CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a valid path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
        assert!(create_private(&fifo, None).is_err(), "a FIFO is refused, without hanging");
        create_private(Path::new("/dev/null"), None).expect("a character device is written as is");
        std::fs::remove_dir_all(&dir).ok();
    }
}
