//! The LiteLLM deployments that send their requests to a service: a proxy's config names a host
//! and port, the service listens on that port. The host is not checked (a name in a cluster's
//! DNS cannot be resolved from a trace): a port two services listen on ties no deployment to
//! either.

use serde::Serialize;

use super::Service;
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
}

impl Front {
    /// "LiteLLM (pid 77, /srv/litellm.yaml) deployment `local-llama`".
    pub fn name(&self) -> String {
        let (config, model) = (crate::units::one_line(&self.config), crate::units::one_line(&self.model));
        format!("LiteLLM (pid {} of uid {}, {config}) deployment `{model}`", self.pid, self.uid)
    }
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
            own.contains(&d.port) && !others.contains(&d.port) && (proxy.uid == 0 || user.is_none_or(|u| u == proxy.uid))
        })
        .map(|(pid, proxy, d)| Front {
            pid,
            uid: proxy.uid,
            config: proxy.config.clone(),
            model: d.model.clone(),
            port: d.port,
            max_parallel_requests: d.max_parallel_requests,
            limit_from: d.limit_from.clone(),
        })
        .collect()
}
