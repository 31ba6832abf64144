//! The HTTP side of `gputrace watch` (`--listen`, loopback by default): `/healthz`, `/metrics`
//! (Prometheus's text format) and `/report` (the live state as the report's JSON). It runs as
//! root on a shared host, so every connection is bounded and none can keep the others out:
//! - at most [`MAX_CONNECTIONS`] at once. Past that, who holds the slots is asked of the kernel:
//!   a user (root aside) who holds [`MAX_PER_USER`] already is answered 503, and anyone else
//!   evicts a connection without a whole request head yet: one whose other end was closed, else
//!   the one that has waited longest, taken from the user (or, from another host, the host) who
//!   holds the most (a flood of connections, slow or fast, never holds a slot against a
//!   scraper); 503 only when every slot holds a complete request;
//! - connections are taken on a task of their own, which lets every connection taken read what
//!   it was sent before the next one can evict it;
//! - a request head of at most [`MAX_HEAD`] bytes, whole within [`HEAD_TIMEOUT`]; GET or HEAD;
//! - `/report` holds command lines and request lines: only root and the user who started the
//!   watch get it. The peer's uid is the kernel's answer for that one connection (sock_diag
//!   over netlink, by its addresses and ports), asked off the event loop.
//!
//! The port never stops a watch: taken by someone else, it is said once and asked for again
//! every [`RETRY_BIND`] while tracing and dumps go on ([`Endpoint`]).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

pub const MAX_CONNECTIONS: usize = 16;
/// The slots one user other than root may hold once they are all taken.
pub const MAX_PER_USER: usize = 4;
pub const MAX_HEAD: usize = 8 * 1024;
/// How long a connection has to send its whole request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the answer may take to write.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a port that could not be had is asked for again.
pub const RETRY_BIND: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Health,
    Metrics,
    Report,
}

/// A request the event loop answers (it owns the model).
pub struct Request {
    pub route: Route,
    /// Who is on the other end, when the kernel says (asked for /report only).
    pub peer_uid: Option<u32>,
    pub reply: oneshot::Sender<Response>,
}

pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response { status, content_type: "text/plain; charset=utf-8", body: body.into() }
    }

    /// As sent: its head, then its body unless only the head was asked for (HEAD).
    fn bytes(&self, head_only: bool) -> Vec<u8> {
        let mut bytes = head(self.status, self.content_type, self.body.len());
        if !head_only {
            bytes.extend_from_slice(self.body.as_bytes());
        }
        bytes
    }
}

/// A request line's method and route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Asked {
    pub route: Route,
    /// HEAD: the answer's head only.
    pub head_only: bool,
}

/// Who holds the other end of a connection, as the kernel says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    User(u32),
    /// Its socket was closed: nobody reads an answer (the kernel names uid 0, root, for such a
    /// socket, and it is nobody's).
    Gone,
    /// Not a socket of this host (of this network namespace), or the kernel did not say.
    Unknown,
}

impl Peer {
    pub fn uid(self) -> Option<u32> {
        match self {
            Peer::User(uid) => Some(uid),
            Peer::Gone | Peer::Unknown => None,
        }
    }
}

/// Whose a slot counts as, when the slots are all taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Occupant {
    User(u32),
    /// Not a socket of this host (or the kernel did not say): its host's, by address (an IPv6
    /// one by its /64, which one host is commonly given whole).
    Host(IpAddr),
    /// Its other end was closed.
    Gone,
}

impl Occupant {
    fn of(peer: Peer, addr: SocketAddr) -> Occupant {
        match peer {
            Peer::User(uid) => Occupant::User(uid),
            Peer::Gone => Occupant::Gone,
            Peer::Unknown => match plain_ip(addr.ip()) {
                IpAddr::V6(v6) => Occupant::Host(IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into())),
                v4 => Occupant::Host(v4),
            },
        }
    }
}

/// A slot as the choice of who makes way sees it.
#[derive(Clone, Copy)]
struct Claim {
    occupant: Occupant,
    /// Its request head came whole.
    headed: bool,
    since: Instant,
}

/// The slot that makes way for a newcomer, if any: never one whose request head came whole,
/// and none for a user (root aside) who holds [`MAX_PER_USER`] already. First a slot whose
/// other end was closed, then one of whoever holds the most, the one waiting longest.
fn make_way(claims: &[Claim], newcomer: Occupant) -> Option<usize> {
    let held_by = |h: Occupant| claims.iter().filter(|c| c.occupant == h).count();
    if matches!(newcomer, Occupant::User(uid) if uid != 0) && held_by(newcomer) >= MAX_PER_USER {
        return None;
    }
    let evictable = claims.iter().enumerate().filter(|(_, c)| !c.headed);
    evictable.max_by_key(|(_, c)| (c.occupant == Occupant::Gone, held_by(c.occupant), std::cmp::Reverse(c.since))).map(|(i, _)| i)
}

/// One slot among the [`MAX_CONNECTIONS`].
struct Slot {
    id: u64,
    since: Instant,
    /// Its addresses, and who holds it once asked (only when the slots are all taken).
    peer: SocketAddr,
    local: Option<SocketAddr>,
    occupant: Option<Occupant>,
    /// Its request head came whole: it waits for its answer, never evicted.
    headed: Arc<AtomicBool>,
    task: AbortHandle,
}

#[derive(Default)]
struct Slots {
    held: Vec<Slot>,
    next: u64,
}

/// Gives a slot back when its connection's task ends, however it ends.
struct Leave(Arc<Mutex<Slots>>, u64);

impl Drop for Leave {
    fn drop(&mut self) {
        let mut slots = self.0.lock().unwrap_or_else(|e| e.into_inner());
        slots.held.retain(|p| p.id != self.1);
    }
}

pub struct Server {
    listener: TcpListener,
    local: SocketAddr,
    slots: Arc<Mutex<Slots>>,
}

impl Server {
    pub fn bind(addr: SocketAddr) -> std::io::Result<Server> {
        let std_listener = std::net::TcpListener::bind(addr)?;
        std_listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(std_listener)?;
        let local = listener.local_addr()?;
        Ok(Server { listener, local, slots: Arc::default() })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Takes connections until dropped, each served on its own task. After each one taken this
    /// task yields, so the connections taken before have read what they were sent (and so
    /// are known to hold a whole request) before the next connection may evict one of them.
    async fn serve_all(self, to_loop: mpsc::Sender<Request>) {
        let mut failing = false;
        loop {
            match self.accept(&to_loop).await {
                Ok(()) => failing = false,
                Err(e) => {
                    // Out of file descriptors, say: said once, tried again shortly, never in
                    // a busy loop.
                    if !failing {
                        eprintln!("gputrace: warning: cannot take a connection on {}: {e}; trying again", self.local);
                    }
                    failing = true;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            tokio::task::yield_now().await;
        }
    }

    /// Takes the next connection and serves it on its own task. At the bound, a connection
    /// without a whole request head makes way (see the module's comment); with none such, the
    /// newcomer is answered 503 at once.
    async fn accept(&self, to_loop: &mpsc::Sender<Request>) -> std::io::Result<()> {
        let (stream, peer) = self.listener.accept().await?;
        let local = stream.local_addr().ok();
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mut occupant = None;
        if slots.held.len() >= MAX_CONNECTIONS {
            // One netlink question per connection, and only while every slot is taken.
            let owner =
                |peer: SocketAddr, local: Option<SocketAddr>| Occupant::of(local.map_or(Peer::Unknown, |l| tcp_owner(peer, l)), peer);
            let newcomer = owner(peer, local);
            if newcomer == Occupant::Gone {
                // Closed before it was taken: nobody to answer, and no slot given.
                return Ok(());
            }
            occupant = Some(newcomer);
            let claims: Vec<Claim> = slots
                .held
                .iter_mut()
                .map(|p| {
                    let occupant = *p.occupant.get_or_insert_with(|| owner(p.peer, p.local));
                    Claim { occupant, headed: p.headed.load(Ordering::Acquire), since: p.since }
                })
                .collect();
            match make_way(&claims, newcomer) {
                Some(i) => slots.held.swap_remove(i).task.abort(),
                None => {
                    let busy = Response::text(
                        503,
                        "gputrace: every place is taken by a request being answered, or by your user's share of them; try again\n",
                    );
                    if let Ok(stream) = stream.into_std() {
                        crate::serving::refuse(stream, &busy.bytes(false));
                    }
                    return Ok(());
                }
            }
        }
        let id = slots.next;
        slots.next += 1;
        let headed = Arc::new(AtomicBool::new(false));
        let leave = Leave(self.slots.clone(), id);
        let task = tokio::spawn(serve(stream, peer, to_loop.clone(), headed.clone(), leave));
        slots.held.push(Slot { id, since: Instant::now(), peer, local, occupant, headed, task: task.abort_handle() });
        Ok(())
    }
}

/// The `--listen` endpoint of a watch, bound when it can be: tracing and dumps never wait on it.
/// Once bound, its connections are taken on a task of their own, stopped when it is dropped.
pub struct Endpoint {
    addr: Option<SocketAddr>,
    serving: Option<AbortHandle>,
    tried: Option<Instant>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(task) = &self.serving {
            task.abort();
        }
    }
}

impl Endpoint {
    pub fn new(addr: Option<SocketAddr>) -> Endpoint {
        Endpoint { addr, serving: None, tried: None }
    }

    /// The port asked for, bound or not.
    pub fn port(&self) -> Option<u16> {
        self.addr.map(|a| a.port())
    }

    /// Binds now if not bound and a try is due (at once, then every [`RETRY_BIND`]), and starts
    /// taking connections, their requests sent to `to_loop`; a failure is said the first time,
    /// a success always. Called on the event loop's runtime.
    pub fn bind_when_due(&mut self, to_loop: &mpsc::Sender<Request>) {
        // Taking connections never ends but by a fault in it: its port is then bound again.
        if self.serving.as_ref().is_some_and(AbortHandle::is_finished) {
            self.serving = None;
        }
        let Some(addr) = self.addr.filter(|_| self.serving.is_none()) else { return };
        if self.tried.is_some_and(|t| t.elapsed() < RETRY_BIND) {
            return;
        }
        let first = self.tried.is_none();
        self.tried = Some(Instant::now());
        match Server::bind(addr) {
            Ok(server) => {
                eprintln!("gputrace: serving /metrics, /report and /healthz on http://{}", server.local_addr());
                self.serving = Some(tokio::spawn(server.serve_all(to_loop.clone())).abort_handle());
            }
            Err(e) if first => eprintln!(
                "gputrace: warning: cannot listen on {addr} (--listen): {e}; tracing and dumps go on, and the port is asked for again every {} s",
                RETRY_BIND.as_secs()
            ),
            Err(_) => {}
        }
    }
}

async fn serve(mut stream: TcpStream, peer: SocketAddr, to_loop: mpsc::Sender<Request>, headed: Arc<AtomicBool>, _leave: Leave) {
    let (response, head_only) = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)).await {
        Err(_) => (Response::text(408, "the request head took too long\n"), false),
        Ok(Err(response)) => (response, false),
        Ok(Ok(asked)) => {
            headed.store(true, Ordering::Release);
            // The connection's own local address: a listener on 0.0.0.0 or [::] has no other.
            let peer_uid = match (asked.route, stream.local_addr()) {
                (Route::Report, Ok(local)) => {
                    let lookup = tokio::task::spawn_blocking(move || tcp_owner(peer, local).uid());
                    tokio::time::timeout(Duration::from_secs(2), lookup).await.ok().and_then(Result::ok).flatten()
                }
                _ => None,
            };
            let (reply, answer) = oneshot::channel();
            if to_loop.send(Request { route: asked.route, peer_uid, reply }).await.is_err() {
                return;
            }
            match tokio::time::timeout(Duration::from_secs(30), answer).await {
                Ok(Ok(response)) => (response, asked.head_only),
                _ => (Response::text(503, "gputrace is stopping\n"), false),
            }
        }
    };
    let _ = tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(&response.bytes(head_only))).await;
    let _ = stream.shutdown().await;
}

/// Reads up to the blank line ending the head (at most MAX_HEAD bytes) and routes its request line.
async fn read_head(stream: &mut TcpStream) -> Result<Asked, Response> {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut filled = 0;
    loop {
        let n = stream.read(&mut buf[filled..]).await.map_err(|_| Response::text(400, "unreadable request\n"))?;
        if n == 0 {
            return Err(Response::text(400, "the connection closed before the request ended\n"));
        }
        filled += n;
        if buf[..filled].windows(4).any(|w| w == b"\r\n\r\n") || buf[..filled].windows(2).any(|w| w == b"\n\n") {
            break;
        }
        if filled == buf.len() {
            return Err(Response::text(431, "request head too large\n"));
        }
    }
    route(&buf[..filled])
}

/// The route of a request head: GET (or HEAD) of a known path; query strings are ignored.
pub fn route(head: &[u8]) -> Result<Asked, Response> {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    if method != "GET" && method != "HEAD" {
        return Err(Response::text(405, "only GET is served\n"));
    }
    let route = match target.split('?').next().unwrap_or("") {
        "/healthz" => Route::Health,
        "/metrics" => Route::Metrics,
        "/report" => Route::Report,
        _ => return Err(Response::text(404, "served: /healthz, /metrics, /report\n")),
    };
    Ok(Asked { route, head_only: method == "HEAD" })
}

fn head(status: u16, content_type: &str, length: usize) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        _ => "Service Unavailable",
    };
    format!("HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n")
        .into_bytes()
}

/// An address as the kernel keys a socket: an IPv4-mapped IPv6 address is the IPv4 socket's.
fn plain_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The sock_diag request for the one TCP socket bound at `src` and connected to `dst`
/// (struct nlmsghdr, then struct inet_diag_req_v2): not a dump, so the kernel looks that socket
/// up and answers it alone, whatever else the host holds.
pub fn sock_diag_request(src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    let (src_ip, dst_ip) = (plain_ip(src.ip()), plain_ip(dst.ip()));
    let family = if src_ip.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 } as u8;
    let octets = |ip: IpAddr| -> [u8; 16] {
        let mut out = [0u8; 16];
        match ip {
            IpAddr::V4(v4) => out[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => out = v6.octets(),
        }
        out
    };
    let mut msg = Vec::with_capacity(72);
    msg.extend_from_slice(&72u32.to_ne_bytes());
    msg.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    msg.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    msg.extend_from_slice(&u32::MAX.to_ne_bytes());
    msg.extend_from_slice(&src.port().to_be_bytes());
    msg.extend_from_slice(&dst.port().to_be_bytes());
    msg.extend_from_slice(&octets(src_ip));
    msg.extend_from_slice(&octets(dst_ip));
    msg.extend_from_slice(&0u32.to_ne_bytes());
    // INET_DIAG_NOCOOKIE: any socket with these addresses.
    msg.extend_from_slice(&[0xff; 8]);
    msg
}

/// Who holds the socket a sock_diag answer is about (struct nlmsghdr, then struct
/// inet_diag_msg), when it is the one asked about: the socket bound at `src` and connected to
/// `dst`. Unknown for an error, anything shorter, or another socket: with no such connection the
/// kernel answers for a listener on `src`'s port, whoever connected from that port (a client on
/// another host connecting from port 22 would be named as sshd's root). A socket with no inode has
/// no file: closed (orphaned, or the kernel's TIME_WAIT record, which says uid 0).
pub fn sock_diag_peer(answer: &[u8], src: SocketAddr, dst: SocketAddr) -> Peer {
    const NLMSG_ERROR: u16 = 2;
    const TCP_LISTEN: u8 = 10;
    // inet_diag_msg: family, state, timer, retrans; the socket id (ports, then addresses of 16
    // bytes each, interface, cookie); expires, rqueue, wqueue; uid and inode.
    let Some(msg) = answer.get(16..88) else { return Peer::Unknown };
    if answer.get(4..6) == Some(&NLMSG_ERROR.to_ne_bytes()[..]) || msg[1] == TCP_LISTEN {
        return Peer::Unknown;
    }
    let port = |at: usize| u16::from_be_bytes([msg[at], msg[at + 1]]);
    let address = |at: usize| -> Option<IpAddr> {
        let v6: [u8; 16] = msg[at..at + 16].try_into().ok()?;
        let ip = match i32::from(msg[0]) {
            libc::AF_INET => IpAddr::from([v6[0], v6[1], v6[2], v6[3]]),
            libc::AF_INET6 => IpAddr::from(v6),
            _ => return None,
        };
        Some(plain_ip(ip))
    };
    let asked = (src.port(), dst.port(), Some(plain_ip(src.ip())), Some(plain_ip(dst.ip())));
    if (port(4), port(6), address(8), address(24)) != asked {
        return Peer::Unknown;
    }
    let word = |at: usize| u32::from_ne_bytes([msg[at], msg[at + 1], msg[at + 2], msg[at + 3]]);
    match (word(64), word(68)) {
        (_, 0) => Peer::Gone,
        (uid, _) => Peer::User(uid),
    }
}

/// Who holds the TCP socket at `peer` connected to `local`: who is talking on a connection from
/// this host, from the kernel, one socket asked about (bounded whatever the host's table holds).
pub fn tcp_owner(peer: SocketAddr, local: SocketAddr) -> Peer {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: socket(2); the fd is owned from here on.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return Peer::Unknown;
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval { tv_sec: 1, tv_usec: 0 };
    let request = sock_diag_request(peer, local);
    let mut answer = [0u8; 512];
    // SAFETY: setsockopt, send and recv on the fd owned here, with buffers of the sizes given.
    let got = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        );
        if libc::send(fd.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) < 0 {
            return Peer::Unknown;
        }
        libc::recv(fd.as_raw_fd(), answer.as_mut_ptr().cast(), answer.len(), 0)
    };
    usize::try_from(got).map_or(Peer::Unknown, |got| sock_diag_peer(&answer[..got.min(answer.len())], peer, local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_and_head_of_known_paths() {
        let asked = |h: &[u8]| route(h).ok();
        assert_eq!(asked(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Some(Asked { route: Route::Metrics, head_only: false }));
        assert_eq!(asked(b"GET /report?x=1 HTTP/1.0\r\n\r\n"), Some(Asked { route: Route::Report, head_only: false }));
        assert_eq!(asked(b"HEAD /healthz HTTP/1.1\r\n\r\n"), Some(Asked { route: Route::Health, head_only: true }));
        assert_eq!(route(b"POST /metrics HTTP/1.1\r\n\r\n").err().map(|r| r.status), Some(405));
        assert_eq!(route(b"GET /../../etc/passwd HTTP/1.1\r\n\r\n").err().map(|r| r.status), Some(404));
        assert_eq!(route(b"\xff\xfe garbage").err().map(|r| r.status), Some(405));
    }

    #[test]
    fn the_kernel_names_who_holds_the_other_end_of_a_loopback_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        // SAFETY: getuid has no preconditions.
        let me = unsafe { libc::getuid() };
        let (peer, local) = (server.peer_addr().unwrap(), server.local_addr().unwrap());
        assert_eq!(tcp_owner(peer, local), Peer::User(me));
        assert_eq!(client.local_addr().unwrap(), peer);
        assert_eq!(tcp_owner("127.0.0.1:1".parse().unwrap(), local), Peer::Unknown, "no such socket");
        // A dual-stack listener sees IPv4 peers as mapped addresses: asked as the IPv4 socket.
        let mapped: SocketAddr = format!("[::ffff:127.0.0.1]:{}", peer.port()).parse().unwrap();
        let local6: SocketAddr = format!("[::ffff:127.0.0.1]:{}", local.port()).parse().unwrap();
        assert_eq!(tcp_owner(mapped, local6), Peer::User(me));
        // Closed by its holder (the kernel's record of it says uid 0, root, whoever held it).
        drop(client);
        assert_eq!(tcp_owner(peer, local), Peer::Gone);
        // A client elsewhere connecting from the port of a listener here on every address: the
        // kernel answers for that listener (this process's), which is not who connected.
        let everywhere = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let from_its_port = SocketAddr::from(([192, 0, 2, 1], everywhere.local_addr().unwrap().port()));
        assert_eq!(tcp_owner(from_its_port, local), Peer::Unknown);
    }

    #[test]
    fn the_place_that_makes_way_is_a_closed_one_then_the_oldest_of_whoever_holds_most() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let (root, nobody) = (Occupant::User(0), Occupant::User(65534));
        let remote = Occupant::Host("192.0.2.7".parse().unwrap());
        // A scraper waiting longest, among a flood's connections: the flood's oldest goes.
        let mut claims: Vec<Claim> = (1..16).map(|ms| Claim { occupant: nobody, headed: false, since: at(ms) }).collect();
        claims.insert(0, Claim { occupant: root, headed: false, since: at(0) });
        assert_eq!(make_way(&claims, root), Some(1));
        // A closed one goes first, even the youngest of a lone occupant.
        claims.push(Claim { occupant: Occupant::Gone, headed: false, since: at(99) });
        assert_eq!(make_way(&claims, root), Some(16));
        // The flood's user is capped; root never is.
        assert_eq!(make_way(&claims, nobody), None);
        // Whole requests are never evicted: with every slot headed, nobody makes way.
        let headed: Vec<Claim> = claims.iter().map(|c| Claim { headed: true, ..*c }).collect();
        assert_eq!(make_way(&headed, root), None);
        // Another host's flood is counted as its host's, against a lone local scraper.
        let mut claims: Vec<Claim> = (1..16).map(|ms| Claim { occupant: remote, headed: false, since: at(ms) }).collect();
        claims.insert(0, Claim { occupant: root, headed: false, since: at(0) });
        assert_eq!(make_way(&claims, remote), Some(1));
        // One host's IPv6 addresses are one occupant (its /64), an IPv4-mapped one its IPv4's.
        let (a, b) = ("[2001:db8::1]:1".parse().unwrap(), "[2001:db8::ffff:2]:2".parse().unwrap());
        assert_eq!(Occupant::of(Peer::Unknown, a), Occupant::of(Peer::Unknown, b));
        assert_ne!(Occupant::of(Peer::Unknown, a), Occupant::of(Peer::Unknown, "[2001:db8:0:1::1]:1".parse().unwrap()));
        let mapped = Occupant::of(Peer::Unknown, "[::ffff:192.0.2.7]:1".parse().unwrap());
        assert_eq!(mapped, remote);
    }

    #[test]
    fn a_sock_diag_answer_names_a_holder_only_for_the_socket_asked_about() {
        let (src, dst): (SocketAddr, SocketAddr) = ("127.0.0.1:40000".parse().unwrap(), "127.0.0.1:9431".parse().unwrap());
        // The answer for the socket asked about: family and socket id as asked, state
        // ESTABLISHED, uid 1234, inode 77.
        let request = sock_diag_request(src, dst);
        let mut answer = vec![0u8; 16 + 72];
        answer[4..6].copy_from_slice(&20u16.to_ne_bytes());
        answer[16] = request[16];
        answer[17] = 1;
        answer[20..68].copy_from_slice(&request[24..72]);
        answer[80..84].copy_from_slice(&1234u32.to_ne_bytes());
        answer[84..88].copy_from_slice(&77u32.to_ne_bytes());
        assert_eq!(sock_diag_peer(&answer, src, dst), Peer::User(1234));
        assert_eq!(sock_diag_peer(&answer[..87], src, dst), Peer::Unknown);
        assert_eq!(sock_diag_peer(&[], src, dst), Peer::Unknown);
        let mut error = answer.clone();
        error[4..6].copy_from_slice(&2u16.to_ne_bytes());
        assert_eq!(sock_diag_peer(&error, src, dst), Peer::Unknown);
        // Another socket: a listener on that port (no peer port), or the state says so.
        let mut listener = answer.clone();
        listener[22..24].copy_from_slice(&[0, 0]);
        assert_eq!(sock_diag_peer(&listener, src, dst), Peer::Unknown);
        let mut listening = answer.clone();
        listening[17] = 10;
        assert_eq!(sock_diag_peer(&listening, src, dst), Peer::Unknown);
        assert_eq!(sock_diag_peer(&answer, "127.0.0.2:40000".parse().unwrap(), dst), Peer::Unknown);
        // The same socket as an IPv6 one at IPv4-mapped addresses (a dual-stack client).
        let mut mapped = answer.clone();
        mapped[16] = libc::AF_INET6 as u8;
        let v6 = |ip: [u8; 4]| std::net::Ipv4Addr::from(ip).to_ipv6_mapped().octets();
        mapped[24..40].copy_from_slice(&v6([127, 0, 0, 1]));
        mapped[40..56].copy_from_slice(&v6([127, 0, 0, 1]));
        assert_eq!(sock_diag_peer(&mapped, src, dst), Peer::User(1234));
        // No inode: a socket closed by its holder.
        answer[84..88].copy_from_slice(&0u32.to_ne_bytes());
        assert_eq!(sock_diag_peer(&answer, src, dst), Peer::Gone);
    }
}
