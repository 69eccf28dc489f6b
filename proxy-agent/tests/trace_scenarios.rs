//! `proxy-agent trace` on the scenario corpus (tests/scenarios/*.json, a copy of the
//! steering repository's examples among them) through the real classifier, and its exit
//! statuses. Root only.

mod support;

use std::{path::PathBuf, process::Command};

use proxy_agent::trace::{self, scenario};
use test_support::needs_root;

fn scenario_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/scenarios");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/scenarios")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}

#[needs_root]
#[test]
fn every_scenario_packet_behaves_as_kube_proxy_does() {
    let mut total = 0;
    let mut failures = Vec::new();
    for file in scenario_files() {
        let text = std::fs::read_to_string(&file).expect("read");
        let cases = scenario::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let packets: Vec<_> = cases.iter().flat_map(|c| &c.packets).collect();
        let opts = trace::TraceOptions {
            connect_probe: Some(PathBuf::from(env!("CARGO_BIN_EXE_proxy-agent"))),
            skip_tc: false,
        };
        let outcomes =
            trace::run(&cases, &opts).unwrap_or_else(|e| panic!("{}: {e:#}", file.display()));
        for (i, o) in &outcomes {
            let p = packets[*i];
            total += 1;
            if !o.ok() {
                failures.push(format!(
                    "{} {}\n{}",
                    file.display(),
                    o.case,
                    trace::describe(o, Some(p))
                ));
            }
        }
    }
    eprintln!("{total} scenario packets traced");
    assert!(
        total >= 90 + 50,
        "the corpus shrank: {total} outcomes over both paths"
    );
    assert!(
        failures.is_empty(),
        "{} packets differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_proxy-agent"))
}

#[needs_root]
#[test]
fn trace_exit_statuses_and_diff() {
    let dir = std::env::temp_dir().join(format!("trace-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    // A wrong expectation: exit 1, with a diff-like explanation.
    let examples =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/scenarios/shared-examples.json");
    let text = std::fs::read_to_string(examples).expect("examples");
    let wrong = text.replacen("\"verdict\": \"reject\"", "\"verdict\": \"drop\"", 1);
    assert_ne!(wrong, text);
    std::fs::write(dir.join("wrong.json"), wrong).expect("write");
    let out = agent()
        .args(["trace", "--scenario"])
        .arg(dir.join("wrong.json"))
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("FAIL")
            && stdout.contains("- expected: drop")
            && stdout.contains("+ got:      reject"),
        "{stdout}"
    );

    // A malformed file: refused before anything is loaded, naming case and field.
    std::fs::write(dir.join("bad.json"), r#"{"cases": [{"id": "broken", "packets": [{"name": "p", "proto": "TCP", "src_ip": "10.0.0.1", "dst_ip": "10.96.0.1", "dst_port": 99999}]}]}"#).expect("write");
    let out = agent()
        .args(["trace", "--scenario"])
        .arg(dir.join("bad.json"))
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("case \"broken\"") && stderr.contains("dst_port"),
        "{stderr}"
    );

    // Usage errors are 2 as well, never 1 (which means "a packet differs"): a missing
    // file, a device, a malformed packet, no arguments.
    for args in [
        vec!["trace", "--scenario", "/nonexistent/scenario.json"],
        vec!["trace", "--scenario", "/dev/zero"],
        vec!["trace", "--objects", "/tmp", "--packet", "tcp nonsense"],
        vec!["trace"],
    ] {
        let out = agent().args(&args).output().expect("run");
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // The single-packet form, JSON.
    let trace_json = |objects: &std::path::Path| -> serde_json::Value {
        let out = agent()
            .args([
                "trace",
                "--json",
                "--cluster-cidr",
                "10.0.0.0/8",
                "--objects",
            ])
            .arg(objects)
            .args(["--packet", "tcp 10.244.0.3:40000 -> 10.96.0.10:80"])
            .output()
            .expect("run");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("json")
    };
    let manifests = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let o = trace_json(&manifests);
    assert_eq!(o["verdict"], "dnat");
    assert_eq!(o["endpoints"].as_array().map(Vec::len), Some(3));
    assert_eq!(o["service"], "default/web:http");
    assert_eq!(o["scheduler"], "random", "the default scheduler is named");

    // A Service with a scheduler annotation: the trace names it, and Maglev sends the
    // same flow to the same endpoint every time (a fresh private dataplane each run).
    let web = std::fs::read_to_string(manifests.join("web.yaml")).expect("web.yaml");
    let annotated = web.replacen(
        "  name: web\n  namespace: default\n",
        "  name: web\n  namespace: default\n  annotations:\n    ebpf.proxy.k8s.io/scheduler: mh\n",
        1,
    );
    assert_ne!(
        annotated, web,
        "the example's metadata moved: update this test"
    );
    let objects = dir.join("objects");
    std::fs::create_dir_all(&objects).expect("tmp");
    std::fs::write(objects.join("web.yaml"), annotated).expect("write");
    let trace_mh = || trace_json(&objects);
    let (a, b) = (trace_mh(), trace_mh());
    assert_eq!(a["scheduler"], "mh");
    assert!(a["first"].is_string(), "{a}");
    assert_eq!(
        a["first"], b["first"],
        "Maglev: the same flow, the same endpoint"
    );
    let _ = std::fs::remove_dir_all(dir);
}
