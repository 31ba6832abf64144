//! Stop signals (SIGINT, SIGTERM, SIGHUP) with who sent them, so the recorder can do what `sudo`
//! and `timeout` do: pass a signal meant for it on to the traced command, then wait for the
//! command and exit with its status. A terminal's Ctrl-C (sent by the kernel to the whole
//! foreground process group) already reached the command, and is not sent twice.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::{anyhow, Result};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

pub const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The write end of the pipe the handler reports through (-1 before `StopSignals::install`).
static REPORT_FD: AtomicI32 = AtomicI32::new(-1);

/// One signal as delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivered {
    pub signal: libc::c_int,
    /// si_code: SI_KERNEL for a terminal's keys, SI_USER for kill(2).
    pub code: libc::c_int,
    /// The sending process, for kill(2).
    pub sender: libc::pid_t,
}

impl Delivered {
    /// Whether the traced command (pid `command`, in the recorder's process group) needs it
    /// passed on: not when the terminal sent it to the whole group, nor when it sent it itself.
    pub fn to_forward(&self, command: u32) -> bool {
        self.code != libc::SI_KERNEL && self.sender != command as libc::pid_t
    }

    /// The exit status a shell reports for a process ended by this signal.
    pub fn exit_code(&self) -> i32 {
        128 + self.signal
    }
}

extern "C" fn on_signal(signal: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t with SA_SIGINFO; write(2) is async-signal-safe.
    unsafe {
        let record = [signal, (*info).si_code, (*info).si_pid()];
        let fd = REPORT_FD.load(Ordering::Relaxed);
        libc::write(fd, record.as_ptr().cast(), std::mem::size_of_val(&record));
    }
}

pub struct StopSignals {
    read: AsyncFd<OwnedFd>,
    _write: OwnedFd,
}

impl StopSignals {
    /// Replaces the default action of the stop signals with a report through a pipe.
    pub fn install() -> Result<StopSignals> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two descriptors, which are owned below.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(anyhow!("cannot create the signal pipe: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: both descriptors were just created and are owned by nothing else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        REPORT_FD.store(write.as_raw_fd(), Ordering::Relaxed);
        for signal in STOP_SIGNALS {
            // SAFETY: a handler that only calls write(2); the struct is fully initialised.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as *const () as usize;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                    return Err(anyhow!("cannot handle signal {signal}: {}", std::io::Error::last_os_error()));
                }
            }
        }
        // SAFETY: the pipe's read end is owned by the AsyncFd for as long as it watches it.
        let read = unsafe { AsyncFd::register_with_interest(read, Interest::READABLE) }
            .map_err(|e| anyhow!("watching the signal pipe: {}", e.into_parts().1))?;
        Ok(StopSignals { read, _write: write })
    }

    /// The next stop signal.
    pub async fn next(&self) -> Result<Delivered> {
        loop {
            let mut guard = self.read.readable().await?;
            let mut record = [0 as libc::c_int; 3];
            // SAFETY: reads at most the record's size into it.
            let n = unsafe { libc::read(self.read.as_raw_fd(), record.as_mut_ptr().cast(), std::mem::size_of_val(&record)) };
            if n == std::mem::size_of_val(&record) as isize {
                return Ok(Delivered { signal: record[0], code: record[1], sender: record[2] });
            }
            guard.clear_ready();
        }
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        REPORT_FD.store(-1, Ordering::Relaxed);
        for signal in STOP_SIGNALS {
            // SAFETY: restoring the default action.
            unsafe { libc::signal(signal, libc::SIG_DFL) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminals_signal_is_not_sent_twice() {
        let ctrl_c = Delivered { signal: libc::SIGINT, code: libc::SI_KERNEL, sender: 0 };
        assert!(!ctrl_c.to_forward(42));
        let kill = Delivered { signal: libc::SIGTERM, code: libc::SI_USER, sender: 7 };
        assert!(kill.to_forward(42));
        assert_eq!(kill.exit_code(), 143);
        let from_the_command = Delivered { signal: libc::SIGTERM, code: libc::SI_USER, sender: 42 };
        assert!(!from_the_command.to_forward(42));
    }
}
