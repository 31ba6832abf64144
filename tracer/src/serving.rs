//! What the sockets gputrace serves (the mark socket, `watch --listen`) share.

use std::io::{Read, Write};

/// Answers a connection given no place and closes it, never waiting on it. The stream is a
/// plain one taken out of tokio (non-blocking still): tokio's own `try_write` of a stream just
/// taken sends nothing, its readiness not yet polled. What the client sent is read away first,
/// so that closing sends a FIN after the answer, not a reset that could make the client drop it;
/// the answer goes only if the socket takes it at once (it is new: its buffer is empty).
pub fn refuse<S: Read + Write>(mut stream: S, answer: &[u8]) {
    let mut sent = [0u8; 8192];
    let _ = stream.read(&mut sent);
    let _ = stream.write(answer);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_refusal_reaches_a_connection_just_taken_whole() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let got = runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            client.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
            let (stream, _) = listener.accept().await.unwrap();
            refuse(stream.into_std().unwrap(), b"HTTP/1.1 503 Service Unavailable\r\n\r\n");
            client.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut got = String::new();
            client.read_to_string(&mut got).map(|_| got)
        });
        assert_eq!(got.unwrap(), "HTTP/1.1 503 Service Unavailable\r\n\r\n");
    }
}
