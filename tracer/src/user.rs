//! The user behind `sudo`, and work done with that user's rights (`as_user`).
//!
//! gputrace runs as root on shared hosts. Whatever it writes (traces, exports) must be opened as
//! the person who asked for it, never as root: root follows a symbolic link planted in /tmp onto
//! any file, and truncates files the user could not have written. Under sudo the open happens on
//! a short-lived thread whose filesystem identity (fsuid, fsgid, supplementary groups) is that
//! user's: credentials are per thread in the kernel, so the rest of the recorder keeps its own.

use std::ffi::{CStr, CString};
use std::io;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};

/// The person who ran `sudo gputrace ...`: their ids, groups and home, from SUDO_* and the
/// password database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
    pub name: String,
    pub home: PathBuf,
    /// Supplementary groups (`video` among them on many GPU hosts), the primary one included.
    pub groups: Vec<u32>,
}

/// An entry of the password database: what `User::invoking` checks SUDO_* against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Passwd {
    pub uid: u32,
    /// The primary group: what sudo sets SUDO_GID to.
    pub gid: u32,
    pub home: PathBuf,
}

impl User {
    /// Under sudo: the invoking user. Root without sudo (or not root at all): None, gputrace acts
    /// as itself. SUDO_* set in part, or naming a user the system does not know as that uid, is an
    /// error: running the command as root instead would be the wrong thing done quietly.
    pub fn invoking() -> Result<Option<User>> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Ok(None);
        }
        User::from_env(|k| std::env::var(k).ok(), lookup_passwd, group_list)
    }

    /// The decision, with the environment and the databases given: testable without sudo.
    pub fn from_env(
        var: impl Fn(&str) -> Option<String>,
        passwd: impl Fn(&str) -> Option<Passwd>,
        groups: impl Fn(&str, u32) -> Vec<u32>,
    ) -> Result<Option<User>> {
        let (uid, gid, name) = (var("SUDO_UID"), var("SUDO_GID"), var("SUDO_USER"));
        let (uid, gid, name) = match (uid, gid, name) {
            (None, None, None) => return Ok(None),
            (Some(u), Some(g), Some(n)) => (u, g, n),
            (u, g, n) => {
                let missing: Vec<&str> = [("SUDO_UID", u.is_none()), ("SUDO_GID", g.is_none()), ("SUDO_USER", n.is_none())]
                    .iter()
                    .filter(|(_, m)| *m)
                    .map(|(k, _)| *k)
                    .collect();
                bail!(
                    "{} is missing while other SUDO_* variables are set: gputrace will not guess who invoked it; run it through sudo, or unset SUDO_UID, SUDO_GID and SUDO_USER to act as root",
                    missing.join(" and ")
                );
            }
        };
        let number = |key: &str, text: &str| {
            text.parse::<u32>()
                .map_err(|_| anyhow!("{key}={text:?} is not a number: run gputrace through sudo, or unset the SUDO_* variables"))
        };
        let (uid, gid) = (number("SUDO_UID", &uid)?, number("SUDO_GID", &gid)?);
        let entry = passwd(&name).ok_or_else(|| {
            anyhow!("SUDO_USER={name:?} is not a user on this system: run gputrace through sudo, or unset the SUDO_* variables")
        })?;
        if entry.uid != uid {
            bail!(
                "SUDO_USER={name:?} has uid {} but SUDO_UID is {uid}: the SUDO_* variables disagree, so gputrace will not act for either",
                entry.uid
            );
        }
        // A group the user does not have (root's, say) would run the command and own the trace
        // with it: the primary group, or one of the user's groups as sudo's -g gives, only.
        let member = groups(&name, entry.gid);
        if gid != entry.gid && !member.contains(&gid) {
            bail!(
                "SUDO_GID={gid} is not a group of {name:?} (primary group {}): the SUDO_* variables disagree, so gputrace will not act for them",
                entry.gid
            );
        }
        let mut groups = groups(&name, gid);
        if !groups.contains(&gid) {
            groups.push(gid);
        }
        Ok(Some(User { uid, gid, name, home: entry.home, groups }))
    }

    /// Becomes this user for filesystem access, on the calling thread only (raw syscalls: glibc's
    /// wrappers would change every thread of the process).
    fn become_on_this_thread(&self) -> io::Result<()> {
        // SAFETY: raw credential syscalls with a valid array; they affect only this thread.
        unsafe {
            if libc::syscall(libc::SYS_setgroups, self.groups.len(), self.groups.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            libc::syscall(libc::SYS_setfsgid, self.gid);
            libc::syscall(libc::SYS_setfsuid, self.uid);
            // setfsuid reports no error: asking again (with an invalid id) returns the current one.
            if libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32 != self.uid
                || libc::syscall(libc::SYS_setfsgid, u32::MAX) as u32 != self.gid
            {
                return Err(io::Error::new(io::ErrorKind::PermissionDenied, "the kernel refused to switch the filesystem identity"));
            }
        }
        Ok(())
    }
}

/// The login name of `uid`, from the passwd database.
pub fn name_of(uid: u32) -> Option<String> {
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: getpwuid_r fills `entry` with pointers into `buf`, which outlives their use here.
    unsafe {
        let mut entry: libc::passwd = std::mem::zeroed();
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        if libc::getpwuid_r(uid, &mut entry, buf.as_mut_ptr(), buf.len(), &mut found) != 0 || found.is_null() {
            return None;
        }
        Some(CStr::from_ptr(entry.pw_name).to_string_lossy().into_owned())
    }
}

fn lookup_passwd(name: &str) -> Option<Passwd> {
    let name = CString::new(name).ok()?;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: getpwnam_r fills `entry` with pointers into `buf`, which outlives their use here.
    unsafe {
        let mut entry: libc::passwd = std::mem::zeroed();
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        if libc::getpwnam_r(name.as_ptr(), &mut entry, buf.as_mut_ptr(), buf.len(), &mut found) != 0 || found.is_null() {
            return None;
        }
        let home = CStr::from_ptr(entry.pw_dir).to_string_lossy().into_owned();
        Some(Passwd { uid: entry.pw_uid, gid: entry.pw_gid, home: PathBuf::from(home) })
    }
}

fn group_list(name: &str, gid: u32) -> Vec<u32> {
    let Ok(cname) = CString::new(name) else { return vec![gid] };
    let mut count: libc::c_int = 64;
    loop {
        let mut groups = vec![0 as libc::gid_t; count as usize];
        let asked = count;
        // SAFETY: getgrouplist writes at most `count` gids and sets `count` to the number it has.
        let rc = unsafe { libc::getgrouplist(cname.as_ptr(), gid, groups.as_mut_ptr(), &mut count) };
        if rc >= 0 {
            groups.truncate(count as usize);
            return groups;
        }
        // Too small: `count` now says how many there are; bounded, since NGROUPS_MAX is 65536.
        if count <= asked || count > 65536 {
            return vec![gid];
        }
    }
}

/// `work` with `user`'s rights: on a thread of its own that becomes the user for filesystem
/// access; as gputrace itself with no user.
pub(crate) fn as_user<T: Send>(user: Option<&User>, work: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
    match user {
        None => work(),
        Some(user) => std::thread::scope(|s| {
            s.spawn(|| {
                user.become_on_this_thread()?;
                work()
            })
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the thread opening the file panicked")))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }
    fn alice(name: &str) -> Option<Passwd> {
        (name == "alice").then(|| Passwd { uid: 1000, gid: 1000, home: "/home/alice".into() })
    }
    fn video(_: &str, gid: u32) -> Vec<u32> {
        vec![gid, 44]
    }

    #[test]
    fn plain_root_acts_as_itself() {
        assert_eq!(User::from_env(env(&[]), alice, video).unwrap(), None);
    }

    #[test]
    fn sudo_gives_the_users_ids_groups_and_home() {
        let user =
            User::from_env(env(&[("SUDO_UID", "1000"), ("SUDO_GID", "1000"), ("SUDO_USER", "alice")]), alice, video).unwrap().unwrap();
        assert_eq!((user.uid, user.gid, user.name.as_str()), (1000, 1000, "alice"));
        assert_eq!(user.home, PathBuf::from("/home/alice"));
        assert_eq!(user.groups, vec![1000, 44]);
    }

    #[test]
    fn partial_or_inconsistent_sudo_is_an_error_not_root() {
        let e = User::from_env(env(&[("SUDO_UID", "1000")]), alice, video).unwrap_err().to_string();
        assert!(e.contains("SUDO_GID and SUDO_USER is missing"), "{e}");
        let e = User::from_env(env(&[("SUDO_UID", "0"), ("SUDO_GID", "0"), ("SUDO_USER", "alice")]), alice, video).unwrap_err().to_string();
        assert!(e.contains("has uid 1000 but SUDO_UID is 0"), "{e}");
        let e = User::from_env(env(&[("SUDO_UID", "x"), ("SUDO_GID", "1"), ("SUDO_USER", "alice")]), alice, video).unwrap_err().to_string();
        assert!(e.contains("not a number"), "{e}");
        let e =
            User::from_env(env(&[("SUDO_UID", "5"), ("SUDO_GID", "5"), ("SUDO_USER", "mallory")]), alice, video).unwrap_err().to_string();
        assert!(e.contains("not a user on this system"), "{e}");
        let e =
            User::from_env(env(&[("SUDO_UID", "1000"), ("SUDO_GID", "0"), ("SUDO_USER", "alice")]), alice, video).unwrap_err().to_string();
        assert!(e.contains("SUDO_GID=0 is not a group of \"alice\""), "{e}");
        let video_group = User::from_env(env(&[("SUDO_UID", "1000"), ("SUDO_GID", "44"), ("SUDO_USER", "alice")]), alice, video);
        assert_eq!(video_group.unwrap().unwrap().gid, 44, "one of the user's own groups (sudo -g video)");
    }
}
