//! Where a process runs: its cgroup, the container and Kubernetes pod the cgroup names, its pid
//! in its own namespace, the uid that owns it.

use super::read_bounded;

/// Its control group path, where a container shows: the first that names a container (on a
/// hybrid host Docker's may be in the v1 hierarchies only), else cgroup v2's, else the first.
pub fn cgroup(pid: u32) -> Option<String> {
    pick_cgroup(&read_bounded(&format!("/proc/{pid}/cgroup"), 16 * 1024)?)
}

fn pick_cgroup(text: &str) -> Option<String> {
    let paths: Vec<(&str, &str)> = text.lines().filter_map(|l| l.split_once(':').and_then(|(_, rest)| rest.split_once(':'))).collect();
    let named = paths.iter().find(|(_, p)| container_of(p).is_some() || pod_of(p).is_some());
    let v2 = paths.iter().find(|(controllers, p)| controllers.is_empty() && *p != "/");
    named.or(v2).or(paths.first()).map(|(_, p)| p.to_string())
}

/// The container a cgroup path names: the 64-hex id Docker, containerd, CRI-O and Podman put in
/// it, shortened as `docker ps` shows it.
pub fn container_of(cgroup: &str) -> Option<String> {
    cgroup
        .split(['/', '-', '.', ':'])
        .find(|part| part.len() == 64 && part.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(|id| id[..12].to_string())
}

/// The Kubernetes pod UID a cgroup path names: `pod<uid>` (cgroupfs driver) or
/// `kubepods-...-pod<uid with _>.slice` (systemd driver).
/// Only below a top-level `kubepods` cgroup, which only root (the kubelet) can make: a user with
/// a delegated subtree cannot name a pod of their choosing.
pub fn pod_of(cgroup: &str) -> Option<String> {
    let mut parts = cgroup.strip_prefix('/')?.split('/');
    if !parts.next()?.starts_with("kubepods") {
        return None;
    }
    parts.find_map(|part| {
        let (_, after) = part.rsplit_once("pod")?;
        let uid = after.trim_end_matches(".slice").replace('_', "-");
        (uid.len() == 36 && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')).then_some(uid)
    })
}

/// The last NSpid of /proc/PID/status: the pid inside the innermost pid namespace, where that
/// differs from the host's.
fn ns_pid(status: &str) -> Option<u32> {
    let pids: Vec<u32> = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_whitespace().filter_map(|p| p.parse().ok()).collect();
    (pids.len() > 1).then(|| *pids.last().expect("more than one"))
}

/// Where the kubelet keeps each pod's container logs, one directory per pod named
/// `NAMESPACE_NAME_UID` (neither name may hold `_`): the pod's names without the API server.
const POD_LOGS: &str = "/var/log/pods";

/// The namespace and name of pod `uid`, from the kubelet's log directories under `dir`. Reads
/// at most a few thousand entries (a node runs at most a few hundred pods).
pub fn pod_names_in(dir: &std::path::Path, uid: &str) -> Option<(String, String)> {
    let suffix = format!("_{uid}");
    std::fs::read_dir(dir).ok()?.take(4096).filter_map(Result::ok).find_map(|entry| {
        let name = entry.file_name().into_string().ok()?;
        let (namespace, pod) = name.strip_suffix(&suffix)?.split_once('_')?;
        (!namespace.is_empty() && !pod.is_empty() && !pod.contains('_')).then(|| (namespace.to_string(), pod.to_string()))
    })
}

/// Where a process runs (cgroup, container, pod, pid in its namespace); None when it is gone.
pub fn place(pid: u32) -> Option<crate::event::Place> {
    let cgroup = cgroup(pid)?;
    let status = read_bounded(&format!("/proc/{pid}/status"), 64 * 1024).unwrap_or_default();
    let pod = pod_of(&cgroup);
    let (namespace, pod_name) = pod.as_deref().and_then(|uid| pod_names_in(std::path::Path::new(POD_LOGS), uid)).unzip();
    let uid = uid_in(&status);
    Some(crate::event::Place { container: container_of(&cgroup), pod, namespace, pod_name, ns_pid: ns_pid(&status), cgroup, uid })
}

/// The real uid that owns a process, from /proc/PID/status.
pub fn owner(pid: u32) -> Option<u32> {
    uid_in(&read_bounded(&format!("/proc/{pid}/status"), 64 * 1024)?)
}

/// The real uid of a /proc/PID/status text.
fn uid_in(status: &str) -> Option<u32> {
    status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup_that_names_the_container() {
        let hex = "b".repeat(64);
        let hybrid = format!("4:memory:/docker/{hex}\n1:name=systemd:/docker/{hex}\n0::/\n");
        assert_eq!(pick_cgroup(&hybrid), Some(format!("/docker/{hex}")), "v1's, where v2's is the root");
        assert_eq!(pick_cgroup("0::/user.slice/session-1.scope\n"), Some("/user.slice/session-1.scope".into()));
        assert_eq!(pick_cgroup("4:memory:/\n0::/\n"), Some("/".into()));
    }

    #[test]
    fn containers_pods_and_namespaced_pids() {
        let hex = "a".repeat(64);
        let cgroupfs = format!("/kubepods/burstable/pod0b3c2d1e-aaaa-bbbb-cccc-0123456789ab/{hex}");
        assert_eq!(pod_of(&cgroupfs).as_deref(), Some("0b3c2d1e-aaaa-bbbb-cccc-0123456789ab"));
        assert_eq!(container_of(&cgroupfs).as_deref(), Some("aaaaaaaaaaaa"));
        let systemd = format!("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0b3c2d1e_aaaa_bbbb_cccc_0123456789ab.slice/cri-containerd-{hex}.scope");
        assert_eq!(pod_of(&systemd).as_deref(), Some("0b3c2d1e-aaaa-bbbb-cccc-0123456789ab"));
        assert_eq!(pod_of("/system.slice/docker-x.scope"), None);
        let delegated = "/user.slice/user-1000.slice/user@1000.service/kubepods/pod0b3c2d1e-aaaa-bbbb-cccc-0123456789ab";
        assert_eq!(pod_of(delegated), None, "a pod is named only below the kubelet's top-level cgroup");
        let logs = std::env::temp_dir().join(format!("gputrace-pod-logs-{}", std::process::id()));
        for dir in
            ["kube-system_coredns-5d78c9869d-abcde_11111111-2222-3333-4444-555555555555", "llm_vllm-0_0b3c2d1e-aaaa-bbbb-cccc-0123456789ab"]
        {
            std::fs::create_dir_all(logs.join(dir)).unwrap();
        }
        assert_eq!(pod_names_in(&logs, "0b3c2d1e-aaaa-bbbb-cccc-0123456789ab"), Some(("llm".into(), "vllm-0".into())));
        assert_eq!(pod_names_in(&logs, "99999999-aaaa-bbbb-cccc-0123456789ab"), None);
        assert_eq!(pod_names_in(&logs.join("absent"), "0b3c2d1e-aaaa-bbbb-cccc-0123456789ab"), None);
        std::fs::remove_dir_all(&logs).ok();
        assert_eq!(ns_pid("Name:\tsleep\nNSpid:\t4242\t1\n"), Some(1));
        assert_eq!(ns_pid("NSpid:\t4242\n"), None, "the host's own namespace");
    }

    #[test]
    fn a_docker_cgroup_names_its_container() {
        let docker = "/system.slice/docker-4f2a9c1e0b7d3a5f6e8c9b0a1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e.scope";
        assert_eq!(container_of(docker).as_deref(), Some("4f2a9c1e0b7d"));
        assert_eq!(container_of("/user.slice/user-1000.slice/session-3.scope"), None);
    }
}
