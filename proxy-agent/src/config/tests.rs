//! The config's tests: kube-proxy's file, the flags over it, what is refused at start.

use super::*;

#[test]
fn the_feed_section_names_servers_and_tls_files_together() {
    let (cfg, _) = Config::from_text(
            "ebpf: {feed: {servers: [\"10.0.0.1:10270\", \"10.0.0.2:10270\"], cert: /c, key: /k, ca: /a}}\n",
        )
        .expect("valid");
    assert_eq!(cfg.feed_servers, ["10.0.0.1:10270", "10.0.0.2:10270"]);
    assert_eq!(cfg.feed_tls, Some(["/c".into(), "/k".into(), "/a".into()]));
    let err =
        Config::from_text("ebpf: {feed: {servers: [\"a:1\"], cert: /c}}\n").expect_err("half");
    assert!(err.contains("ebpf.feed"), "{err}");
}

/// The file read as `Config::from_file` reads it: parsed, then validated.
fn read(text: &str) -> Result<Config, String> {
    let (cfg, _) = Config::from_text(text)?;
    cfg.validate()?;
    Ok(cfg)
}

/// A listen address that can never be bound is refused when the file is read, naming
/// the setting (`0.0.0.0:99999` was accepted, and the endpoint never came up).
#[test]
fn listen_addresses_that_cannot_be_bound_are_refused() {
    for (text, field) in [
        ("healthzBindAddress: 0.0.0.0:99999", "healthzBindAddress"),
        ("metricsBindAddress: 0.0.0.0:99999", "metricsBindAddress"),
        ("metricsBindAddress: 127.0.0.1:0", "metricsBindAddress"),
        ("healthzBindAddress: 10256", "healthzBindAddress"),
        ("healthzBindAddress: localhost:10256", "healthzBindAddress"),
        ("metricsBindAddress: \"::1:10249\"", "metricsBindAddress"),
        (
            "ebpf: {debugBindAddress: 127.0.0.1:70000}",
            "ebpf.debugBindAddress",
        ),
    ] {
        let text = format!("kind: KubeProxyConfiguration\n{text}\n");
        let err = read(&text).expect_err(&text);
        assert!(err.starts_with(field), "{err} does not name {field}");
    }
    let cfg = read(
        "healthzBindAddress: \"[::]:10256\"\nmetricsBindAddress: 0.0.0.0:10249\n\
             ebpf: {debugBindAddress: \"\"}\n",
    )
    .expect("valid addresses");
    assert_eq!(cfg.healthz_bind_address, "[::]:10256");
    // A flag's address is checked as well.
    let cfg = Config {
        debug_bind_address: "127.0.0.1:".into(),
        ..Config::default()
    };
    assert!(
        cfg.validate()
            .expect_err("no port")
            .contains("--debug-addr")
    );
}

/// Masquerade source ports that are NodePorts are refused, naming both settings.
#[test]
fn masquerade_ports_must_not_overlap_node_ports() {
    for text in [
        "ebpf: {masqueradePortRange: 30000-30100}",
        "ebpf: {masqueradePortRange: 20000-40000}",
        "ebpf: {masqueradePortRange: 32767-40000}",
        "ebpf: {nodePortRange: 1024-25000}",
        "ebpf: {nodePortRange: 29999-29999}",
    ] {
        let err = read(text).expect_err(text);
        assert!(
            err.contains("ebpf.masqueradePortRange") && err.contains("ebpf.nodePortRange"),
            "{err}"
        );
    }
    let cfg = read("ebpf: {masqueradePortRange: 40000-49999, nodePortRange: 30000-39999}")
        .expect("apart");
    assert_eq!(cfg.conntrack.masquerade_ports, (40000, 49999));
    read("{}").expect("the defaults are apart");
}

/// A feed server's address that no connection can use is refused where it is given
/// (`server=::::` was retried for ever as an invalid URI).
#[test]
fn feed_server_addresses_are_checked_when_read() {
    for good in [
        "10.0.0.1:10270",
        "[fd00::1]:10270",
        "feed.example:10270",
        "node-1:1",
    ] {
        check_feed_server(good).expect(good);
    }
    for (bad, why) in [
        ("::::", "brackets"),
        ("fd00::1:10270", "brackets"),
        ("[fd00::zz]:10270", "IPv6"),
        ("[fd00::1:10270", "IPv6"),
        ("10.0.0.1", "no port"),
        ("10.0.0.1:", "port"),
        ("10.0.0.1:99999", "port"),
        ("10.0.0.1:0", "port"),
        (":10270", "no host"),
        ("feed/x:10270", "DNS name"),
        ("user@feed:10270", "DNS name"),
        ("feed example:10270", "DNS name"),
        ("feed%:10270", "DNS name"),
    ] {
        let err = check_feed_server(bad).expect_err(bad);
        assert!(
            err.contains(&format!("{bad:?}")) && err.contains(why),
            "{bad}: {err}"
        );
    }
    let err = Config::from_text("ebpf: {feed: {servers: [\"10.0.0.1:10270\", \"::::\"]}}\n")
        .expect_err("a bad server");
    assert!(
        err.contains("ebpf.feed.servers") && err.contains("\"::::\""),
        "{err}"
    );
}

#[test]
fn ipvs_mode_chooses_the_nodes_scheduler() {
    let parse = |text: &str| Config::from_text(text).expect("valid");
    let (cfg, _) = parse("mode: ipvs\nipvs: {scheduler: \"\"}\n");
    assert_eq!(
        cfg.scheduler,
        Scheduler::Rr,
        "kube-proxy's default in ipvs mode"
    );
    let (cfg, _) = parse("mode: ipvs\nipvs: {scheduler: mh}\n");
    assert_eq!(cfg.scheduler, Scheduler::Mh);
    let (cfg, warnings) = parse("mode: ipvs\nipvs: {scheduler: lblcr}\n");
    assert_eq!(cfg.scheduler, Scheduler::Wlc);
    assert!(warnings.iter().any(|w| w.contains("wlc")), "{warnings:?}");
    let (cfg, warnings) = parse("mode: nftables\nipvs: {scheduler: sh}\n");
    assert_eq!(cfg.scheduler, Scheduler::Random, "only ipvs mode reads it");
    assert!(
        warnings.iter().any(|w| w.contains("ipvs.scheduler")),
        "{warnings:?}"
    );
    assert_eq!(parse("{}").0.scheduler, Scheduler::Random);
    assert!(Config::from_text("mode: ipvs\nipvs: {scheduler: fastest}\n").is_err());
    let (cfg, _) = parse("ebpf: {maglevTableSize: 16381}\n");
    assert_eq!(cfg.maglev_table_len, 16381);
    let err = Config::from_text("ebpf: {maglevTableSize: 1000}\n").expect_err("not prime");
    assert!(err.contains("maglevTableSize"), "{err}");
}

#[test]
fn a_kube_proxy_config_file() {
    let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clusterCIDR: 10.244.0.0/16,fd00:244::/48
nodePortAddresses: [192.0.2.0/24]
iptables:
  masqueradeAll: true
  masqueradeBit: 14
  minSyncPeriod: 2s
  syncPeriod: 1m
conntrack:
  tcpEstablishedTimeout: 24h0m0s
  udpTimeout: 45s
  maxPerCore: 32768
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
hostnameOverride: node-a
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 5
someFutureField: true
ebpf:
  interfaces: [eth0]
  tcAttach: clsact
  xdp: best-effort
  serviceProxyName: ebpf-proxy
  mapSizes: {backendSlots: 8388608}
  loadBalancer: {mode: hybrid}
";
    let (cfg, warnings) = Config::from_text(text).expect("valid");
    assert_eq!(
        cfg.local_detector,
        LocalDetector::ClusterCidr(vec![
            "10.244.0.0/16".parse().expect("cidr"),
            "fd00:244::/48".parse().expect("cidr")
        ])
    );
    assert!(cfg.masquerade_all);
    assert_eq!(
        cfg.node_port_addresses,
        vec!["192.0.2.0/24".parse::<ipnet::IpNet>().expect("cidr")]
    );
    assert_eq!(
        (cfg.min_sync_period, cfg.sync_period),
        (Duration::from_secs(2), Duration::from_secs(60))
    );
    assert_eq!(cfg.conntrack.udp, Duration::from_secs(45));
    assert_eq!(cfg.hostname_override.as_deref(), Some("node-a"));
    assert_eq!(
        cfg.kubeconfig.as_deref(),
        Some("/var/lib/kube-proxy/kubeconfig.conf")
    );
    assert_eq!(cfg.interfaces, vec!["eth0"]);
    assert_eq!(cfg.tc_attach, TcAttachMode::Clsact);
    assert_eq!(
        (cfg.map_sizes.backend_slots, cfg.map_sizes.services),
        (8_388_608, MapSizes::default().services),
        "a size given, the others kept"
    );
    assert_eq!(Config::default().tc_attach, TcAttachMode::Auto);
    assert_eq!(cfg.xdp, XdpMode::BestEffort);
    assert_eq!(Config::default().xdp, XdpMode::Off, "off unless asked");
    assert_eq!(cfg.lb_mode, LbMode::Hybrid);
    assert_eq!(
        Config::default().lb_mode,
        LbMode::Snat,
        "kube-proxy's, unless asked"
    );
    assert!(
        Config::from_text("ebpf: {loadBalancer: {mode: direct}}\n")
            .expect_err("an unknown mode")
            .contains("ebpf.loadBalancer.mode")
    );
    assert_eq!(cfg.service_proxy_name.as_deref(), Some("ebpf-proxy"));
    for needle in [
        "mode \"nftables\": not applicable",
        "iptables.masqueradeBit",
        "clientConnection.qps",
        "someFutureField: unknown field",
    ] {
        assert!(
            warnings.iter().any(|w| w.contains(needle)),
            "{needle} not reported in {warnings:?}"
        );
    }
    assert_eq!(warnings.len(), 4, "{warnings:?}");
    assert_eq!(cfg.conntrack.table_entries(8), 8 * 32_768);
    assert_eq!(cfg.conntrack.table_entries(2), 131_072);
}

/// The `config.conf` of kubeadm's `kube-proxy` ConfigMap, verbatim: what it leaves
/// unset it writes as `""`, `0s` or `null`, and each keeps kube-proxy's default —
/// never "off" and never zero.
#[test]
fn kubeadms_configmap_as_kube_proxy_reads_it() {
    let text = include_str!("../../tests/data/kubeadm-kube-proxy-config.conf");
    let (cfg, warnings) = Config::from_text(text).expect("kubeadm's file is valid");
    let defaults = Config::default();
    assert_eq!(cfg.healthz_bind_address, "0.0.0.0:10256");
    assert_eq!(cfg.metrics_bind_address, "127.0.0.1:10249");
    assert_eq!(cfg.sync_period, Duration::from_secs(30));
    assert_eq!(cfg.min_sync_period, defaults.min_sync_period);
    assert_eq!(
        cfg.conntrack,
        ConntrackOptions::default(),
        "udpTimeout: 0s is the default"
    );
    assert_eq!(
        cfg.local_detector,
        LocalDetector::ClusterCidr(vec!["10.244.0.0/16".parse().expect("cidr")]),
        "detectLocalMode \"\" is ClusterCIDR"
    );
    assert_eq!(cfg.hostname_override, None);
    assert_eq!(
        cfg.kubeconfig.as_deref(),
        Some("/var/lib/kube-proxy/kubeconfig.conf")
    );
    assert!(!cfg.masquerade_all && cfg.localhost_node_ports);
    assert!(cfg.node_port_addresses.is_empty());
    // Fields that mean nothing here are reported, none refused.
    assert!(warnings.iter().any(|w| w.contains("ipvs")), "{warnings:?}");
}

/// kube-proxy's `nodePortAddresses` keywords and `detectLocalMode: NodeCIDR`.
#[test]
fn node_port_keywords_and_node_cidr() {
    let text = "kind: KubeProxyConfiguration
detectLocalMode: NodeCIDR
nodePortAddresses: [primary, localhost, 010.001.0.0/16]
";
    let (cfg, warnings) = Config::from_text(text).expect("valid");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(cfg.local_detector, LocalDetector::NodeCidr);
    assert!(cfg.node_port_primary);
    let nets: Vec<String> = cfg
        .node_port_addresses
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(nets, ["127.0.0.0/8", "::1/128", "10.1.0.0/16"]);
    let (all, _) = Config::from_text("kind: KubeProxyConfiguration\nnodePortAddresses: [all]\n")
        .expect("valid");
    assert!(!all.node_port_primary);
    assert_eq!(all.node_port_addresses.len(), 2, "0.0.0.0/0 and ::/0");
}

/// Huge durations are errors naming the field, never a panic (hostile input).
#[test]
fn durations_out_of_range_are_refused() {
    for (text, needle) in [
        ("syncPeriod: 4000000000000000h", "syncPeriod"),
        ("syncPeriod: 2562047788015215h", "syncPeriod"),
        ("syncPeriod: 99999999999999999999999h", "syncPeriod"),
        ("conntrack: {udpTimeout: 2562048h}", "conntrack.udpTimeout"),
        ("syncPeriod: 2562047h2562047h", "syncPeriod"),
    ] {
        let text = format!("kind: KubeProxyConfiguration\n{text}\n");
        let err = Config::from_text(&text).expect_err(&text);
        assert!(err.contains(needle) && err.contains("range"), "{err}");
    }
    // Within Go's range but beyond a sane period: refused by validate, with the field.
    let (cfg, _) = Config::from_text("kind: KubeProxyConfiguration\nsyncPeriod: 9000h\n")
        .expect("a Go duration");
    assert!(cfg.validate().expect_err("a year").contains("syncPeriod"));
    let cfg = Config {
        sync_period: Duration::from_secs(u64::MAX),
        ..Config::default()
    };
    assert!(cfg.validate().is_err());
}

#[test]
fn invalid_files_are_refused_with_the_field() {
    for (text, needle) in [
        (
            "kind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/33\n",
            "clusterCIDR",
        ),
        (
            "kind: KubeProxyConfiguration\nsyncPeriod: soon\n",
            "syncPeriod",
        ),
        (
            "kind: KubeProxyConfiguration\ndetectLocalMode: ClusterCIDR\n",
            "needs clusterCIDR",
        ),
        ("kind: Deployment\n", "expected KubeProxyConfiguration"),
        (
            "kind: KubeProxyConfiguration\nebpf: {mapSizes: {services: 10}}\n",
            "ebpf.mapSizes.services",
        ),
        (
            "kind: KubeProxyConfiguration\nebpf: {mapSizes: {slots: 4096}}\n",
            "slots",
        ),
        ("kind: KubeProxyConfiguration\nebpf: {bogus: 1}\n", "bogus"),
        (
            "kind: KubeProxyConfiguration\nebpf: {masqueradePortRange: 30000-2000}\n",
            "masqueradePortRange",
        ),
        (
            "kind: KubeProxyConfiguration\nebpf: {tcAttach: netlink}\n",
            "ebpf.tcAttach",
        ),
        (
            "kind: KubeProxyConfiguration\nconntrack: {maxPerCore: -1}\n",
            "conntrack.maxPerCore",
        ),
        // Refused by name, never accepted and ignored.
        (
            "kind: KubeProxyConfiguration\ndetectLocalMode: BridgeInterface\n\
                 detectLocal: {bridgeInterface: cbr0}\n",
            "detectLocalMode BridgeInterface (\"cbr0\") is not supported",
        ),
        (
            "kind: KubeProxyConfiguration\ndetectLocalMode: InterfaceNamePrefix\n",
            "detectLocalMode InterfaceNamePrefix",
        ),
        (
            "kind: KubeProxyConfiguration\nnodePortAddresses: [primary, primary]\n",
            "duplicate keyword \"primary\"",
        ),
        (
            "kind: KubeProxyConfiguration\nnodePortAddresses: [everything]\n",
            "one of the keywords primary, localhost, all",
        ),
    ] {
        let err = Config::from_text(text).expect_err(text);
        assert!(err.contains(needle), "{err} lacks {needle}");
    }
}
