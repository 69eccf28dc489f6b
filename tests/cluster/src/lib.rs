//! The cluster in a box: etcd, kube-apiserver and kube-controller-manager on loopback with
//! TLS (`cluster`), what its tests do through the API (`box_api`), real nodes — kubelets,
//! containerd and the scheduler, in namespaces of their own (`node`, with its DNS, `dns`,
//! and its images, `images`) — and the agent on them as `deploy/` ships it (`daemonset`).
//! Its binaries: `cluster` (`cargo xtask cluster`), `conformance` (Kubernetes' own
//! specs) and `cluster-scale`; its tests are `tests/cluster*.rs`
//! (`docs/cluster-in-a-box.md`).

pub mod box_api;
pub mod cluster;
pub mod daemonset;
pub mod dns;
pub mod images;
pub mod node;
