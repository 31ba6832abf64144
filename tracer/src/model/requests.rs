//! Requests as the kernel saw them on a server's connections: from the read that brought a
//! request line to the connection's close or the next request on it (keep-alive).

use super::{add_saturating, Model, Request};

impl Model {
    pub(super) fn on_received(&mut self, pid: u32, ts: u64, conn: u64, bytes: u64, request: Option<&String>) {
        let current = self.connections.get(&conn).and_then(|(_, r)| *r);
        if let (None, Some(id)) = (request, current) {
            add_saturating(&mut self.requests[id].bytes_in, bytes);
            return;
        }
        self.end_request(conn, ts);
        let line = request.cloned().unwrap_or_default();
        let request = Request {
            pid,
            conn,
            line,
            arrived: ts,
            bytes_in: bytes,
            headers_at: None,
            status: None,
            first_data_at: None,
            bytes_out: 0,
            ended: None,
        };
        self.requests.push(request);
        self.connections.insert(conn, (pid, Some(self.requests.len() - 1)));
    }

    pub(super) fn on_sent(&mut self, ts: u64, conn: u64, bytes: u64, status: Option<u16>, data: bool) {
        let Some(id) = self.connections.get(&conn).and_then(|(_, r)| *r) else { return };
        let r = &mut self.requests[id];
        add_saturating(&mut r.bytes_out, bytes);
        if status.is_some() && r.headers_at.is_none() {
            r.headers_at = Some(ts);
            r.status = status;
        }
        if data && r.first_data_at.is_none() {
            r.first_data_at = Some(ts);
        }
    }

    pub(super) fn on_conn_close(&mut self, ts: u64, conn: u64) {
        self.end_request(conn, ts);
        self.connections.remove(&conn);
    }

    /// A process's exit closes its connections and ends their requests.
    pub(super) fn end_connections_of(&mut self, pid: u32, ts: u64) {
        let conns: Vec<u64> = self.connections.iter().filter(|(_, (p, _))| *p == pid).map(|(c, _)| *c).collect();
        for conn in conns {
            self.on_conn_close(ts, conn);
        }
    }

    fn end_request(&mut self, conn: u64, ts: u64) {
        if let Some((_, current)) = self.connections.get_mut(&conn) {
            if let Some(id) = current.take() {
                self.requests[id].ended.get_or_insert(ts);
            }
        }
    }

    /// Requests in flight at `ts`, in the processes given (a service's), or everywhere.
    pub fn in_flight(&self, ts: u64, pids: Option<&[u32]>) -> usize {
        self.requests.iter().filter(|r| r.in_flight_at(ts) && pids.is_none_or(|p| p.contains(&r.pid))).count()
    }
}
