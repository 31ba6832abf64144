//! The HTTP side of `gputrace watch` (`--listen`, loopback by default): `/healthz`, `/metrics`
//! (Prometheus's text format) and `/report` (the live state as the report's JSON). It runs as
//! root on a shared host, so every connection is bounded: at most [`MAX_CONNECTIONS`] at once, a
//! request head of [`MAX_HEAD`] bytes read within [`READ_TIMEOUT`], GET only. `/report` holds
//! command lines and request lines: only root and the user who started the watch get it (the
//! peer's uid from the kernel's socket table).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

pub const MAX_CONNECTIONS: usize = 16;
pub const MAX_HEAD: usize = 8 * 1024;
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Health,
    Metrics,
    Report,
}

/// A request the event loop answers (it owns the model).
pub struct Request {
    pub route: Route,
    /// Who is on the other end, when the kernel's socket table says.
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
}

pub struct Server {
    listener: TcpListener,
    local: SocketAddr,
    permits: Arc<Semaphore>,
}

impl Server {
    pub async fn bind(addr: SocketAddr) -> Result<Server> {
        let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} (--listen)"))?;
        let local = listener.local_addr()?;
        Ok(Server { listener, local, permits: Arc::new(Semaphore::new(MAX_CONNECTIONS)) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Takes the next connection and serves it on its own task; past the connection bound it is
    /// answered 503 at once.
    pub async fn accept(&self, to_loop: &mpsc::Sender<Request>) {
        let Ok((stream, peer)) = self.listener.accept().await else { return };
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            let _ = stream.try_write(&head(503, "text/plain", 0));
            return;
        };
        let (local, to_loop) = (self.local, to_loop.clone());
        tokio::spawn(serve(stream, local, peer, to_loop, permit));
    }
}

async fn serve(mut stream: TcpStream, local: SocketAddr, peer: SocketAddr, to_loop: mpsc::Sender<Request>, _permit: OwnedSemaphorePermit) {
    let response = match tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream)).await {
        Err(_) => Response::text(408, "the request head took too long\n"),
        Ok(Err(response)) => response,
        Ok(Ok(route)) => {
            let (reply, answer) = oneshot::channel();
            let peer_uid = crate::procfs::tcp_peer_uid(local, peer);
            if to_loop.send(Request { route, peer_uid, reply }).await.is_err() {
                return;
            }
            match tokio::time::timeout(Duration::from_secs(30), answer).await {
                Ok(Ok(response)) => response,
                _ => Response::text(503, "gputrace is stopping\n"),
            }
        }
    };
    let mut bytes = head(response.status, response.content_type, response.body.len());
    bytes.extend_from_slice(response.body.as_bytes());
    let _ = tokio::time::timeout(READ_TIMEOUT, stream.write_all(&bytes)).await;
    let _ = stream.shutdown().await;
}

/// Reads up to the blank line ending the head (at most MAX_HEAD bytes) and routes its request line.
async fn read_head(stream: &mut TcpStream) -> Result<Route, Response> {
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
pub fn route(head: &[u8]) -> Result<Route, Response> {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    if method != "GET" && method != "HEAD" {
        return Err(Response::text(405, "only GET is served\n"));
    }
    match target.split('?').next().unwrap_or("") {
        "/healthz" => Ok(Route::Health),
        "/metrics" => Ok(Route::Metrics),
        "/report" => Ok(Route::Report),
        _ => Err(Response::text(404, "served: /healthz, /metrics, /report\n")),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_of_known_paths() {
        assert_eq!(route(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").ok(), Some(Route::Metrics));
        assert_eq!(route(b"GET /report?x=1 HTTP/1.0\r\n\r\n").ok(), Some(Route::Report));
        assert_eq!(route(b"POST /metrics HTTP/1.1\r\n\r\n").err().map(|r| r.status), Some(405));
        assert_eq!(route(b"GET /../../etc/passwd HTTP/1.1\r\n\r\n").err().map(|r| r.status), Some(404));
        assert_eq!(route(b"\xff\xfe garbage").err().map(|r| r.status), Some(405));
    }
}
