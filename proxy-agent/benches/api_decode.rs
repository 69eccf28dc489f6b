//! The API-server source's decoding cost: a list page of Services and one of
//! EndpointSlices decoded as kube-rs would (typed, the whole list failing on one bad item)
//! and as the agent does (`Decoded<K>`: each item on its own, so one bad item costs only
//! itself). Interleaved rounds, alternating which goes first; medians with their spread,
//! and the ratio per round. Not a test: figures only.
//!
//! `cargo xtask bench` runs it; `cargo bench -p proxy-agent --bench api_decode -- 5000`
//! picks another size (objects per list).

use std::time::{Duration, Instant};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::core::ObjectList;
use proxy_agent::source::decoded::Decoded;
use serde::de::DeserializeOwned;
use serde_json::json;

/// Rounds per measurement: each a typed and a `Decoded` decode of the same body.
const ROUNDS: usize = 9;

fn services(n: usize) -> Vec<u8> {
    let items: Vec<_> = (0..n)
        .map(|i| {
            json!({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": format!("svc-{i}"), "namespace": "bench",
                                "resourceVersion": (1000 + i).to_string(),
                                "uid": format!("00000000-0000-0000-0000-{i:012}"),
                                "labels": {"app": format!("svc-{i}")},
                                "annotations": {"example.com/owner": "team-a"}},
                   "spec": {"clusterIP": std::net::Ipv4Addr::from(0x0a60_0001 + i as u32).to_string(),
                            "clusterIPs": [std::net::Ipv4Addr::from(0x0a60_0001 + i as u32).to_string()],
                            "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                            "type": "ClusterIP", "sessionAffinity": "None",
                            "selector": {"app": format!("svc-{i}")},
                            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
                                      {"name": "https", "port": 443, "targetPort": 8443, "protocol": "TCP"}]},
                   "status": {"loadBalancer": {}}})
        })
        .collect();
    json!({"kind": "ServiceList", "apiVersion": "v1", "metadata": {"resourceVersion": "99"},
           "items": items})
    .to_string()
    .into_bytes()
}

fn slices(n: usize, endpoints: usize) -> Vec<u8> {
    let items: Vec<_> = (0..n)
        .map(|i| {
            let eps: Vec<_> = (0..endpoints)
                .map(|e| {
                    json!({"addresses": [std::net::Ipv4Addr::from(0x0a80_0000 + ((e as u32) << 20) + i as u32).to_string()],
                           "conditions": {"ready": true, "serving": true, "terminating": false},
                           "nodeName": format!("node-{e}"), "zone": "zone-a",
                           "targetRef": {"kind": "Pod", "namespace": "bench", "name": format!("svc-{i}-{e}")}})
                })
                .collect();
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"name": format!("svc-{i}-1"), "namespace": "bench",
                                "resourceVersion": (1000 + i).to_string(),
                                "labels": {"kubernetes.io/service-name": format!("svc-{i}"),
                                           "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
                   "addressType": "IPv4",
                   "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                   "endpoints": eps})
        })
        .collect();
    json!({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
           "metadata": {"resourceVersion": "99"}, "items": items})
    .to_string()
    .into_bytes()
}

fn time<T: DeserializeOwned + Clone>(body: &[u8]) -> Duration {
    let t = Instant::now();
    let list: ObjectList<T> = serde_json::from_slice(body).expect("a list");
    let took = t.elapsed();
    std::hint::black_box(&list);
    drop(list);
    took
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Decodes `body` both ways, `ROUNDS` times interleaved; prints medians, spread, ratio;
/// returns the median ratio (`Decoded` / typed).
fn measure<K>(what: &str, body: &[u8]) -> f64
where
    K: DeserializeOwned + Clone + kube::Resource,
{
    // One of each first, not counted: allocator and caches warm.
    time::<K>(body);
    time::<Decoded<K>>(body);
    let (mut typed, mut decoded, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let (t, d) = if round % 2 == 0 {
            let t = time::<K>(body);
            (t, time::<Decoded<K>>(body))
        } else {
            let d = time::<Decoded<K>>(body);
            (time::<K>(body), d)
        };
        typed.push(t.as_secs_f64() * 1e3);
        decoded.push(d.as_secs_f64() * 1e3);
        ratios.push(d.as_secs_f64() / t.as_secs_f64());
    }
    let spread = |v: &[f64]| {
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        format!("{lo:.1}–{hi:.1}")
    };
    let (st, sd, sr) = (spread(&typed), spread(&decoded), spread(&ratios));
    let (mt, md, mr) = (
        median(&mut typed),
        median(&mut decoded),
        median(&mut ratios),
    );
    println!(
        "{what:<40} typed {mt:>8.1} ms ({st})   item by item {md:>8.1} ms ({sd})   ratio {mr:.2}× ({sr}), {ROUNDS} rounds, {:.1} MB",
        body.len() as f64 / 1e6
    );
    mr
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(10_000);
    println!(
        "API list decoding, {n} objects per list (load average {} before)",
        load()
    );
    let s = measure::<Service>(&format!("{n} Services"), &services(n));
    let e = measure::<EndpointSlice>(
        &format!("{n} EndpointSlices × 10 endpoints"),
        &slices(n, 10),
    );
    println!("(load average {} after)", load());
    for (what, r) in [("Services", s), ("EndpointSlices", e)] {
        if r > 1.5 {
            println!(
                "WARNING: {what}: decoding item by item costs {r:.2}× the typed decode (goal ≤ 1.5×)"
            );
        }
    }
}
