use super::*;

fn argv(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

#[test]
fn a_proxy_is_known_by_its_program_or_module() {
    assert!(is_proxy(&argv("/usr/bin/python3 /usr/local/bin/litellm --config /app/config.yaml")));
    assert!(is_proxy(&argv("litellm --port 4000 -c cfg.yaml")));
    assert!(is_proxy(&argv("python -m litellm.proxy.proxy_cli --config x.yaml")));
    assert!(!is_proxy(&argv("python3 serve.py --name litellm")), "an argument named litellm is not the program");
    assert!(!is_proxy(&argv("vllm serve m --port 8000")));
    assert_eq!(config_arg(&argv("litellm --port 4000 --config /app/c.yaml")), Some("/app/c.yaml"));
    assert_eq!(config_arg(&argv("litellm --config=/app/c.yaml")), Some("/app/c.yaml"));
    assert_eq!(config_arg(&argv("litellm -c c.yaml")), Some("c.yaml"));
    assert_eq!(config_arg(&argv("litellm --config")), None);
    assert_eq!(config_arg(&argv("litellm --model x")), None);
}

#[test]
fn each_deployment_gets_the_limit_litellm_computes() {
    let config = r#"
model_list:
  - model_name: local-llama
    litellm_params:
      model: hosted_vllm/meta-llama/Llama-3.1-8B
      api_base: http://localhost:8000/v1
      max_parallel_requests: 50
      rpm: 600
  - model_name: by-rpm
    litellm_params: {model: openai/x, api_base: "http://10.0.0.7:8001", rpm: 12}
  - model_name: by-tpm
    litellm_params:
      api_base: http://[::1]:8002/v1
      tpm: 100000
  - model_name: by-default
    litellm_params:
      api_base: https://gpu-box/v1
  - model_name: no-base
    litellm_params:
      model: openai/gpt-4o
  - model_name: from-env
    litellm_params:
      api_base: http://localhost:8003
      max_parallel_requests: os.environ/LIMIT
router_settings:
  routing_strategy: least-busy
  default_max_parallel_requests: 7
general_settings:
  max_parallel_requests: 1000
"#;
    let d = |model: &str, host: &str, port, n, from: &str| Deployment {
        model: model.into(),
        host: host.into(),
        port,
        max_parallel_requests: n,
        limit_from: from.into(),
        local: None,
    };
    assert_eq!(
        deployments(config),
        [
            d("local-llama", "localhost", 8000, Some(50), "max_parallel_requests"),
            d("by-rpm", "10.0.0.7", 8001, Some(12), "rpm"),
            d("by-tpm", "::1", 8002, Some(600), "tpm"),
            d("by-default", "gpu-box", 443, Some(7), "default_max_parallel_requests"),
            // A value LiteLLM reads from the environment is not known here: no limit is checked.
            d("from-env", "localhost", 8003, None, ""),
        ]
    );
    let none = deployments("model_list:\n- model_name: m\n  litellm_params:\n    api_base: http://h:9000\n");
    assert_eq!(none, [d("m", "h", 9000, None, "")]);
    // 0 makes no semaphore in LiteLLM; tpm as LiteLLM rounds it (1999 × 6 / 1000 = 11).
    let zero = deployments("model_list:\n- model_name: m\n  litellm_params: {api_base: 'http://h:1', max_parallel_requests: 0, rpm: 5}\n");
    assert_eq!(zero, [d("m", "h", 1, None, "")]);
    let tpm = deployments("model_list:\n- model_name: m\n  litellm_params: {api_base: 'http://h:1', tpm: 1999}\n");
    assert_eq!(tpm, [d("m", "h", 1, Some(11), "tpm")]);
}

#[test]
fn hostile_configs_are_read_no_further_and_never_expanded() {
    // Aliases stay aliases: a billion laughs costs what its text does.
    let mut laughs = String::from("a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n");
    for i in 1..12 {
        laughs += &format!(
            "{}: &{} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n",
            (b'a' + i) as char,
            (b'a' + i) as char,
            p = (b'a' + i - 1) as char
        );
    }
    laughs += "model_list:\n- model_name: m\n  litellm_params: {api_base: 'http://h:1', max_parallel_requests: 3}\n";
    assert_eq!(deployments(&laughs).len(), 1);
    // No YAML at all, a cut file, deep nesting, a mapping as a key: what came before, no panic.
    for text in ["\u{0}\u{1}{{{", "model_list:\n- model_name: [", &"[".repeat(100_000), "? {a: 1}\n: 2\n", "model_list: *nothing"] {
        let _ = deployments(text);
    }
    let many: String =
        (0..MAX_DEPLOYMENTS + 10).map(|i| format!("- {{model_name: m{i}, litellm_params: {{api_base: 'http://h:1'}}}}\n")).collect();
    assert_eq!(deployments(&format!("model_list:\n{many}")).len(), MAX_DEPLOYMENTS);
    assert_eq!(host_and_port("localhost:8000"), None, "no scheme: no URL");
    assert_eq!(host_and_port("http://:8000"), None);
    assert_eq!(host_and_port("http://h:99999"), None);
    assert_eq!(host_and_port("http://user:pw@h:8000/v1"), Some(("h".into(), 8000)));
}

#[test]
fn a_config_is_read_only_as_its_user_could() {
    let status = "Name:\tlitellm\nUid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\nGroups:\t27 44 1000\n";
    let who = Credentials::parse(status).unwrap();
    assert_eq!(who, Credentials { uid: 1000, gid: 1000, groups: vec![27, 44, 1000] });
    assert!(who.may(4, 1000, 1000, 0o600));
    assert!(!who.may(4, 1000, 1000, 0o044), "the owner's bits count for the owner, not the others'");
    assert!(!who.may(4, 0, 0, 0o600), "root's own file");
    assert!(who.may(4, 0, 44, 0o640), "a group the user is in");
    assert!(who.may(4, 0, 0, 0o644));
    assert!(!who.may(1, 0, 0, 0o700) && who.may(1, 0, 0, 0o711), "a directory searched by its x bits");
    let root = Credentials::parse("Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n").unwrap();
    assert!(root.may(4, 1000, 1000, 0));
    assert!(Credentials::parse("Uid:\t1000\n").is_err(), "a cut status is no credentials");
    // su waiting at its prompt: real uid the user's, the others root's.
    let setuid = Credentials::parse("Uid:\t1000\t0\t0\t0\nGid:\t1000\t1000\t1000\t1000\n").unwrap_err();
    assert!(setuid.contains("setuid"), "{setuid}");
}

/// Through the walk: links followed inside the root (a ConfigMap's), directories' search bits,
/// no read of what is no regular file.
#[test]
fn a_config_path_is_walked_as_the_proxy_would() {
    let me = std::process::id();
    let dir = std::env::temp_dir().join(format!("gputrace-litellm-walk-{me}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("..data")).unwrap();
    std::fs::write(dir.join("..data/config.yaml"), "model_list: []\n").unwrap();
    std::os::unix::fs::symlink("..data/config.yaml", dir.join("config.yaml")).unwrap();
    std::os::unix::fs::symlink(dir.join("config.yaml"), dir.join("absolute.yaml")).unwrap();
    std::os::unix::fs::symlink("loop.yaml", dir.join("loop.yaml")).unwrap();
    let path = |name: &str| dir.join(name).display().to_string();
    assert_eq!(read_config(me, &path("config.yaml")).unwrap(), "model_list: []\n");
    assert_eq!(read_config(me, &path("absolute.yaml")).unwrap(), "model_list: []\n");
    assert_eq!(read_config(me, &format!("{}/../config.yaml", path("..data"))).unwrap(), "model_list: []\n");
    assert!(read_config(me, &path("loop.yaml")).unwrap_err().contains("too many symbolic links"));
    assert!(read_config(me, &path("missing.yaml")).unwrap_err().contains("cannot open it"));
    assert!(read_config(me, &path("..data")).unwrap_err().contains("not a regular file"));
    assert!(read_config(me, "/dev/null").unwrap_err().contains("not a regular file"), "a device is never opened to read");
    // Above the root is the root, as for the process.
    assert!(read_config(me, "/../../../dev/zero").unwrap_err().contains("not a regular file"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_config_that_is_no_regular_file_is_refused_without_blocking() {
    // This process's own FIFO: opening it to read would block without O_NONBLOCK.
    let dir = std::env::temp_dir().join(format!("gputrace-litellm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("config.yaml");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a valid path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let why = read_config(std::process::id(), fifo.to_str().unwrap()).unwrap_err();
    assert!(why.contains("not a regular file"), "{why}");
    std::fs::remove_file(&fifo).unwrap();
    std::fs::write(&fifo, "model_list: []\n").unwrap();
    assert_eq!(read_config(std::process::id(), fifo.to_str().unwrap()).unwrap(), "model_list: []\n");
    std::fs::write(&fifo, vec![b' '; MAX_CONFIG as usize + 1]).unwrap();
    assert!(read_config(std::process::id(), fifo.to_str().unwrap()).unwrap_err().contains("larger than"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A deployment's host against the proxy's own addresses: loopback and `localhost` are its own,
/// an address of its namespace is, another address is another machine's, a name is unknown.
#[test]
fn a_host_is_the_proxys_own_or_another_machines() {
    let own: Vec<std::net::IpAddr> = ["192.0.2.2", "fd00::2"].iter().map(|a| a.parse().unwrap()).collect();
    for host in [
        "localhost",
        "LOCALHOST.",
        "api.localhost",
        "127.0.0.1",
        "127.8.9.1",
        "::1",
        "0.0.0.0",
        "::",
        "192.0.2.2",
        "fd00::2",
        "fe80::1%eth0",
    ] {
        let want = if host.starts_with("fe80") { Some(false) } else { Some(true) };
        assert_eq!(locality(host, &own), want, "{host}");
    }
    assert_eq!(locality("::ffff:127.0.0.1", &[]), Some(true), "IPv4-mapped loopback");
    assert_eq!(locality("::ffff:192.0.2.2", &own), Some(true));
    for host in ["10.0.0.12", "192.0.2.3", "2001:db8::1"] {
        assert_eq!(locality(host, &own), Some(false), "{host}");
    }
    for host in ["gpu-node-2", "vllm.default.svc.cluster.local", "", "%", "1.2.3.4.5"] {
        assert_eq!(locality(host, &own), None, "{host}");
    }
    // The URL's bracketed IPv6 reaches here without its brackets.
    assert_eq!(host_and_port("http://[::1]:8000/v1").map(|(h, _)| locality(&h, &[])), Some(Some(true)));
}

/// gunicorn's workers are forks that show their master's command line: one proxy, its workers
/// counted; uvicorn's are spawned Pythons under it. A proxy of another config under it is its own.
#[test]
fn workers_fold_into_the_proxy_they_work_for() {
    let proxy = |pid: u32, config: &str| Proxy {
        pid,
        uid: 0,
        command: vec!["litellm".into(), "--config".into(), config.into()],
        config: config.into(),
        deployments: vec![],
        workers: None,
    };
    let parents = [(11, 10), (12, 10), (20, 10), (30, 20), (31, 20), (32, 99), (10, 1)];
    let parent = |pid: u32| parents.iter().find(|(p, _)| *p == pid).map(|(_, up)| *up);
    let found = vec![proxy(10, "a.yaml"), proxy(11, "a.yaml"), proxy(12, "a.yaml"), proxy(20, "b.yaml")];
    let folded = fold_workers(found, &[30, 31, 32], parent);
    let seen: Vec<(u32, Option<u64>)> = folded.iter().map(|p| (p.pid, p.workers)).collect();
    assert_eq!(seen, [(10, Some(2)), (20, Some(2))]);
    let alone = fold_workers(vec![proxy(10, "a.yaml")], &[], parent);
    assert_eq!(alone[0].workers, None);
    assert!(is_spawned_worker(&argv("python3 -c from multiprocessing.spawn import spawn_main --multiprocessing-fork")));
    assert!(!is_spawned_worker(&argv("python3 -c from multiprocessing.resource_tracker import main;main(5)")));
}

/// One user's 40 proxies take their share of a scan and no more: root's proxy, and another
/// user's first, are still read.
#[test]
fn one_users_crowd_of_proxies_leaves_root_s_and_others_read() {
    let mut shares = Shares::default();
    let crowd = (0..40).filter(|_| shares.admit(60001)).count();
    assert_eq!(crowd, PER_USER);
    assert!(shares.admit(0), "root's proxy is read");
    assert!(shares.admit(1000), "another user's first is read");
    // Root's own crowd is bounded too, and every user's together.
    let mut shares = Shares::default();
    assert_eq!((0..100).filter(|_| shares.admit(0)).count(), MAX_PROXIES);
    let users = (1..=100u32).filter(|&uid| shares.admit(uid)).count();
    assert_eq!(users, MAX_PROXIES, "other users' proxies together");
}
