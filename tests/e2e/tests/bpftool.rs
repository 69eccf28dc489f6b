//! bpftool on a running agent's pins, as docs/operations.md promises it: `map dump` names
//! every key and value field (the maps carry BTF), `prog show` names our programs and the
//! maps they use, and the classifier's tcx links are ours. Root only.

use std::collections::BTreeSet;

use proxy_testbed::{Path_, TCP_PORT, Testbed, VIP4, sh, target, web_manifests};
use serde_json::Value;
use test_support::needs_root;

/// Frontends the web manifests program: web (2 families × 2 ports) + empty.
const FRONTENDS: usize = 5;

fn bpftool_json(args: &[&str]) -> Value {
    let mut argv = vec!["bpftool", "-j"];
    argv.extend(args);
    let out = sh(&argv).unwrap_or_else(|e| panic!("bpftool {args:?}: {e}"));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("bpftool {args:?}: {e}: {out}"))
}

/// The named fields of the first entry's key and value in a `map dump`.
fn fields(dump: &Value, part: &str) -> BTreeSet<String> {
    dump[0]["formatted"][part]
        .as_object()
        .unwrap_or_else(|| panic!("no named {part} fields (no BTF?): {dump}"))
        .keys()
        .cloned()
        .collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

#[needs_root]
#[test]
fn bpftool_names_our_map_fields_programs_and_links() {
    let mut tb = Testbed::new(3).expect("testbed");
    tb.write_manifests(&web_manifests(&[0, 1, 2], None))
        .expect("manifests");
    tb.start_agent(Path_::PerPacket, FRONTENDS).expect("agent");
    // One flow through the classifier, so the flow table holds an entry.
    let attempts = tb
        .client(&["--target", &target(VIP4, TCP_PORT), "--count", "1"])
        .expect("client");
    assert!(attempts.iter().all(|a| a.ok), "{attempts:?}");
    let maps = tb.pin_dir().join("maps");
    let pin = |name: &str| maps.join(name).to_str().expect("utf-8").to_string();

    let services = bpftool_json(&["map", "dump", "pinned", &pin("SERVICES")]);
    assert_eq!(
        services.as_array().map(Vec::len),
        Some(FRONTENDS),
        "{services}"
    );
    assert_eq!(
        fields(&services, "key"),
        set(&["addr", "port", "proto", "family", "scope", "_pad"])
    );
    for f in [
        "id",
        "rev",
        "count",
        "flags",
        "affinity_timeout_s",
        "scheduler",
    ] {
        assert!(fields(&services, "value").contains(f), "{f}: {services}");
    }
    // The ClusterIP's port as the packet carries it (network order): 80.
    let ports: BTreeSet<u16> = services
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["formatted"]["key"]["port"].as_u64())
        .map(|p| u16::from_be(p as u16))
        .collect();
    assert!(ports.contains(&TCP_PORT), "{ports:?}");

    let backends = bpftool_json(&["map", "dump", "pinned", &pin("BACKENDS")]);
    for f in ["addr", "port", "proto", "family", "state"] {
        assert!(fields(&backends, "value").contains(f), "{f}: {backends}");
    }
    let flows = bpftool_json(&["map", "dump", "pinned", &pin("CONNTRACK")]);
    for f in ["saddr", "daddr", "sport", "dport", "proto", "family"] {
        assert!(fields(&flows, "key").contains(f), "{f}: {flows}");
    }

    // Our programs by name: those that use our pinned maps (other agents' are not ours).
    let ours_ids: BTreeSet<u64> = std::fs::read_dir(&maps)
        .expect("maps folder")
        .flatten()
        .filter_map(|e| {
            let path = e.path();
            bpftool_json(&["map", "show", "pinned", path.to_str()?])["id"].as_u64()
        })
        .collect();
    let progs = bpftool_json(&["prog", "show"]);
    let ours: Vec<&Value> = progs
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| {
            p["map_ids"].as_array().is_some_and(|ids| {
                ids.iter()
                    .any(|i| i.as_u64().is_some_and(|i| ours_ids.contains(&i)))
            })
        })
        .collect();
    let names: BTreeSet<&str> = ours.iter().filter_map(|p| p["name"].as_str()).collect();
    for want in ["tc_ingress", "tc_egress"] {
        assert!(names.contains(want), "{want} missing from {names:?}");
    }
    assert!(
        ours.iter().all(|p| p["btf_id"].as_u64().is_some()),
        "programs without BTF"
    );

    // The classifier's links (tcx, bpftool's link type 11 on 7.1) run those programs;
    // on kernels without tcx they are clsact filters, which `tc filter show` lists.
    let ingress_id = ours
        .iter()
        .find(|p| p["name"] == "tc_ingress")
        .and_then(|p| p["id"].as_u64())
        .expect("tc_ingress id");
    let links = bpftool_json(&["link", "show"]);
    let tcx = links
        .as_array()
        .into_iter()
        .flatten()
        .any(|l| l["prog_id"].as_u64() == Some(ingress_id));
    let interface = &tb.node_interfaces()[0];
    let filters = tb.tc_filters(interface, "ingress").unwrap_or_default();
    assert!(
        tcx || filters.contains("tc_ingress"),
        "tc_ingress (id {ingress_id}) is neither a tcx link nor a filter on {interface}:\n\
         links: {links}\nfilters: {filters}"
    );
}
