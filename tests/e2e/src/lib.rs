//! The end-to-end suite: the agent under test on namespace testbeds (`proxy-testbed`),
//! reached by real clients — ClusterIPs, NodePorts and the node's own connections, both
//! datapaths and XDP, DSR and fan-out on the two-node testbed, kube-proxy's rules and
//! their cleanup, the agent's lifecycle, privileges and debug endpoints. The suite is the
//! integration tests in `tests/` (root; `cargo xtask test` runs them, `docs/tests.md` says
//! what each checks); this library holds nothing.
