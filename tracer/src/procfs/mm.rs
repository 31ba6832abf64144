//! Reads of /proc files that take the target's memory-map lock (cmdline, environ, maps). Any
//! user can make such a read block in the kernel for as long as they like: a process whose own
//! lock is held in a page fault that a FUSE server of theirs never answers, with a writer queued
//! behind it. So each read runs on a worker thread and is waited for [`DEADLINE`] at most; past
//! it the caller goes on without it. A worker stuck in such a read stays stuck until the kernel
//! lets it go; while one is stuck on some uid's process, reads of that uid's processes are not
//! tried (one frozen process costs one deadline, not one per fork of it), and at most
//! [`WORKERS`] exist at once (past that, every read is late until one comes back). Reads that
//! are slow without ever being late (a lock held in stretches just under the deadline, a
//! process forking at every stretch) are bounded too: each uid's processes may cost the caller
//! [`BUDGET`] of waiting in any [`BUDGET_WINDOW`], past which they are late at once.

use std::collections::HashMap;
use std::io::Read as _;
use std::os::unix::fs::MetadataExt;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const DEADLINE: Duration = Duration::from_millis(250);
pub const WORKERS: usize = 8;
pub const BUDGET: Duration = Duration::from_millis(100);
pub const BUDGET_WINDOW: Duration = Duration::from_secs(1);

pub enum Read {
    /// The bytes (at most the limit), or None: the process or the file is gone.
    Done(Option<Vec<u8>>),
    /// Not read within the deadline, or not tried (its owner's reads are stuck).
    Late,
}

struct Job {
    path: String,
    limit: u64,
    uid: u32,
    state: Arc<Mutex<State>>,
    reply: SyncSender<Option<Vec<u8>>>,
}

#[derive(Default)]
struct State {
    finished: bool,
    abandoned: bool,
}

#[derive(Default)]
struct Pool {
    /// Each idle worker's channel: a job, or None to end (see [`retire`]).
    idle: Vec<SyncSender<Option<Job>>>,
    workers: usize,
    /// Raised by [`retire`]: a worker of an earlier generation ends after its read.
    generation: u64,
    /// Reads abandoned and still blocked, by the uid owning the process read.
    stuck: HashMap<u32, usize>,
    /// The waiting each uid's processes cost in the current window: (its start, the total).
    spent: HashMap<u32, (Instant, Duration)>,
}

impl Pool {
    /// Whether `uid`'s processes have had their share of waiting in this window.
    fn spent_up(&mut self, uid: u32, now: Instant) -> bool {
        self.spent.get(&uid).is_some_and(|(start, spent)| now.duration_since(*start) < BUDGET_WINDOW && *spent >= BUDGET)
    }

    fn charge(&mut self, uid: u32, now: Instant, waited: Duration) {
        if self.spent.len() > 4096 {
            self.spent.retain(|_, (start, _)| now.duration_since(*start) < BUDGET_WINDOW);
        }
        let (start, spent) = self.spent.entry(uid).or_insert((now, Duration::ZERO));
        if now.duration_since(*start) >= BUDGET_WINDOW {
            (*start, *spent) = (now, Duration::ZERO);
        }
        *spent += waited;
    }
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

fn pool<T>(f: impl FnOnce(&mut Pool) -> T) -> T {
    let mut guard = POOL.lock().unwrap_or_else(|e| e.into_inner());
    f(guard.get_or_insert_with(Pool::default))
}

fn work(jobs: Receiver<Option<Job>>, me: SyncSender<Option<Job>>, generation: u64) {
    while let Ok(Some(job)) = jobs.recv() {
        let read = (|| {
            let mut raw = Vec::new();
            std::fs::File::open(&job.path).ok()?.take(job.limit).read_to_end(&mut raw).ok()?;
            Some(raw)
        })();
        let _ = job.reply.try_send(read);
        let kept = pool(|p| {
            let mut state = job.state.lock().unwrap_or_else(|e| e.into_inner());
            state.finished = true;
            if state.abandoned {
                if let Some(n) = p.stuck.get_mut(&job.uid) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        p.stuck.remove(&job.uid);
                    }
                }
            }
            if p.generation != generation {
                p.workers -= 1;
                return false;
            }
            p.idle.push(me.clone());
            true
        });
        if !kept {
            return;
        }
    }
}

/// Ends every worker: the idle ones now, a busy one when its read ends (one stuck ends when
/// the kernel lets it go). Capabilities are each thread's own: a worker started before
/// gputrace dropped its capabilities would keep them all, while one started after inherits
/// what the dropping thread kept.
pub fn retire() {
    pool(|p| {
        p.generation += 1;
        for worker in p.idle.drain(..) {
            if worker.try_send(None).is_ok() {
                p.workers -= 1;
            }
        }
    })
}

/// /proc/PID/FILE, at most `limit` bytes, within [`DEADLINE`].
pub fn read(pid: u32, file: &str, limit: u64) -> Read {
    // The owner from the directory's inode: no lock of the target's taken.
    let Ok(uid) = std::fs::metadata(format!("/proc/{pid}")).map(|m| m.uid()) else { return Read::Done(None) };
    let began = Instant::now();
    let worker = pool(|p| {
        if p.stuck.contains_key(&uid) || p.spent_up(uid, began) {
            return None;
        }
        if let Some(w) = p.idle.pop() {
            return Some(w);
        }
        if p.workers >= WORKERS {
            return None;
        }
        let (tx, rx) = sync_channel::<Option<Job>>(1);
        let (me, generation) = (tx.clone(), p.generation);
        std::thread::Builder::new().name("gputrace-proc".into()).spawn(move || work(rx, me, generation)).ok()?;
        p.workers += 1;
        Some(tx)
    });
    let Some(worker) = worker else { return Read::Late };
    let (reply, answer) = sync_channel(1);
    let state = Arc::new(Mutex::new(State::default()));
    let job = Job { path: format!("/proc/{pid}/{file}"), limit, uid, state: state.clone(), reply };
    if worker.send(Some(job)).is_err() {
        return Read::Late;
    }
    let answered = answer.recv_timeout(DEADLINE);
    pool(|p| p.charge(uid, began, began.elapsed()));
    if let Ok(read) = answered {
        return Read::Done(read);
    }
    // Decided under the pool's lock, as the worker's end is: a read that ended just now is
    // taken, one still blocked counts against its owner until it ends.
    pool(|p| {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        if s.finished {
            return Read::Done(answer.try_recv().ok().flatten());
        }
        s.abandoned = true;
        *p.stuck.entry(uid).or_default() += 1;
        Read::Late
    })
}
