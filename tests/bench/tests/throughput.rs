//! The throughput benchmark's harness (`bench --throughput-only`, `cargo xtask bench`)
//! checked as a test: what it counts is translated traffic. Root only.

use test_support::needs_root;

/// The throughput benchmark's harness measures translated traffic: live frames
/// (`BPF_F_TEST_XDP_LIVE_FRAMES`) for one established flow reach the backend namespace
/// through each contender — our XDP program, our classifier, iptables and nftables DNAT —
/// and none through the control that translates nothing (the harness stops if any do).
#[needs_root]
#[test]
fn live_frames_reach_the_backend_through_every_contender() {
    let t = match proxy_bench::throughput::throughput(10, 20_000, 1, &[]) {
        Err(e) if proxy_bench::throughput::live_frames_refused(&e) => {
            return test_support::cannot_run(
                "live_frames_reach_the_backend_through_every_contender",
                &format!("the kernel refuses BPF_F_TEST_XDP_LIVE_FRAMES: {e:#}"),
            );
        }
        r => r.expect("throughput run"),
    };
    for c in proxy_bench::throughput::CONTENDERS {
        let r = t
            .rates
            .iter()
            .find(|r| r.contender == c)
            .unwrap_or_else(|| panic!("no figure for {c}"));
        assert!(
            r.delivered_share >= 0.99 && r.mpps > 0.0,
            "{c}: {:.1}% of the frames delivered, {:.3} Mpps",
            r.delivered_share * 100.0,
            r.mpps
        );
    }
}
