//! The LiteLLM deployments that send their requests to a service: a proxy's config names a host
//! and port, the service listens on that port. A host that is an address of another machine (as
//! the proxy saw its own when it was read) ties nothing; a name is not resolved (a name in a
//! cluster's DNS cannot be from a trace), so its port alone ties it: a port two services listen
//! on ties no deployment to either.

use serde::Serialize;

use super::services::Service;
use crate::model::Model;

/// A LiteLLM deployment in front of a service.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Front {
    /// The proxy's pid and user, and its config as its command line names it.
    pub pid: u32,
    pub uid: u32,
    pub config: String,
    /// The deployment's `model_name`, and the port of its `api_base`.
    pub model: String,
    pub port: u16,
    /// The requests it lets through at once (see [`crate::event::Deployment`]); None: no limit.
    pub max_parallel_requests: Option<u64>,
    pub limit_from: String,
    /// The proxy's workers (those counted when it was read, else its `--num_workers`, else 1):
    /// each keeps its own count of a deployment's requests.
    pub workers: u64,
}

impl Front {
    /// What it lets through at once: its limit in each of its proxy's workers.
    pub fn lets_through(&self) -> Option<u64> {
        self.max_parallel_requests.map(|n| n.saturating_mul(self.workers))
    }
}

/// What the deployments in front of a service let through to it at once, all together; None
/// where there are none, or one of them sets no limit.
pub fn let_through(fronts: &[Front]) -> Option<u64> {
    fronts.iter().try_fold(None, |sum: Option<u64>, f| Some(Some(sum.unwrap_or(0).saturating_add(f.lets_through()?))))?
}

/// The `max_parallel_requests` that keeps them within `cap` all together: each deployment in
/// each worker an equal share, at least one.
pub fn share(fronts: &[Front], cap: u64) -> u64 {
    (cap / counts(fronts).max(1)).max(1)
}

/// The counts kept of what is let through: each deployment's in each of its proxy's workers.
pub fn counts(fronts: &[Front]) -> u64 {
    fronts.iter().map(|f| f.workers).sum()
}

/// Most workers a proxy is taken to run: a larger `--num_workers` is read as this many.
const MAX_WORKERS: u64 = 4096;

/// `--num_workers N` (or `=N`) on a proxy's command line; 1 where absent or not a count.
fn workers(command: &[String]) -> u64 {
    let mut args = command.iter();
    while let Some(a) = args.next() {
        let value = match a.strip_prefix("--num_workers") {
            Some("") => args.next().map(String::as_str),
            Some(rest) => rest.strip_prefix('='),
            None => continue,
        };
        return value.and_then(|v| v.parse::<u64>().ok()).filter(|&n| n > 0).map_or(1, |n| n.min(MAX_WORKERS));
    }
    1
}

/// The TCP ports a service's processes listened on, bound while traced or met listening.
fn ports(model: &Model, service: &Service) -> Vec<u16> {
    let mut ports: Vec<u16> = service
        .pids
        .iter()
        .filter_map(|pid| model.processes.get(pid))
        .flat_map(|p| p.bound.iter().map(|(_, port)| *port).chain(p.attached.iter().flat_map(|a| a.listening.iter().copied())))
        .collect();
    ports.sort();
    ports.dedup();
    ports
}

/// The deployments of every proxy met that send to `service`, by the port it alone listens on:
/// a proxy of the service's own user, or root's (another user's proxy says nothing of it).
pub fn fronting(model: &Model, services: &[Service], service: &Service) -> Vec<Front> {
    let user = model.processes.get(&service.root).and_then(|p| p.place.as_ref()).and_then(|p| p.uid);
    let own = ports(model, service);
    let others: Vec<u16> = services.iter().filter(|s| s.root != service.root).flat_map(|s| ports(model, s)).collect();
    model
        .proxies
        .iter()
        .flat_map(|(&pid, proxy)| proxy.deployments.iter().map(move |d| (pid, proxy, d)))
        .filter(|(_, proxy, d)| {
            own.contains(&d.port)
                && !others.contains(&d.port)
                && d.local != Some(false)
                && (proxy.uid == 0 || user.is_none_or(|u| u == proxy.uid))
        })
        .map(|(pid, proxy, d)| Front {
            pid,
            uid: proxy.uid,
            config: proxy.config.clone(),
            model: d.model.clone(),
            port: d.port,
            max_parallel_requests: d.max_parallel_requests,
            limit_from: d.limit_from.clone(),
            workers: proxy.workers.filter(|&n| n > 0).map_or_else(|| workers(&proxy.command), |n| n.min(MAX_WORKERS)),
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn front(limit: Option<u64>, workers: u64) -> Front {
        let (config, model, limit_from) = ("c".into(), "m".into(), "rpm".into());
        Front { pid: 1, uid: 0, config, model, port: 8000, max_parallel_requests: limit, limit_from, workers }
    }

    #[test]
    fn workers_are_read_from_the_command_line() {
        let argv = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        assert_eq!(workers(&argv("litellm --config c.yaml --num_workers 4")), 4);
        assert_eq!(workers(&argv("litellm --num_workers=8 --config c.yaml")), 8);
        for odd in [
            "litellm --config c.yaml",
            "litellm --num_workers",
            "litellm --num_workers 0",
            "litellm --num_workers x",
            "litellm --num_workersx 3",
        ] {
            assert_eq!(workers(&argv(odd)), 1, "{odd}");
        }
        assert_eq!(workers(&argv("litellm --num_workers 99999999999999999999")), 1, "no count a u64 holds");
        assert_eq!(workers(&argv("litellm --num_workers 1000000")), MAX_WORKERS);
    }

    /// Each deployment's limit counts in each worker; one without a limit lets anything through.
    #[test]
    fn what_deployments_let_through_together() {
        assert_eq!(let_through(&[]), None);
        assert_eq!(let_through(&[front(Some(10), 1)]), Some(10));
        assert_eq!(let_through(&[front(Some(10), 1), front(Some(12), 4)]), Some(58));
        assert_eq!(let_through(&[front(Some(10), 1), front(None, 1)]), None);
        assert_eq!(let_through(&[front(Some(u64::MAX), 2), front(Some(1), 1)]), Some(u64::MAX));
        assert_eq!(share(&[front(Some(10), 1), front(Some(12), 4)], 17), 3, "17 over 5 counts");
        assert_eq!(share(&[front(Some(10), 8)], 3), 1, "never 0");
        assert_eq!(share(&[], 3), 3);
    }
}
