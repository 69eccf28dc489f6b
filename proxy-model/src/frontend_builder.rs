//! `FrontendState::builder`: a frontend's state field by field, from the defaults of a
//! plain ClusterIP-like frontend, for tests, benchmarks and tools that make one by hand.

use std::net::SocketAddr;

use super::{
    frontend::{BackendSet, FrontendKind, FrontendState, WhenEmpty},
    schedule::Schedule,
};

impl FrontendState {
    /// A state for `service` (`namespace/name:port`) of `kind`: no backends (refused, as
    /// without endpoints), no separate internal set, no affinity, no traffic policy,
    /// everyone allowed, the default scheduler. Each setter changes one of these.
    pub fn builder(service: impl Into<String>, kind: FrontendKind) -> FrontendStateBuilder {
        FrontendStateBuilder(FrontendState {
            service: service.into(),
            kind,
            backends: BackendSet {
                endpoints: Default::default(),
                when_empty: WhenEmpty::Reject,
            },
            internal: None,
            affinity_timeout_s: None,
            external_local: false,
            internal_local: false,
            source_ranges: Box::default(),
            schedule: Schedule::default(),
            dsr: false,
        })
    }
}

/// Made by [`FrontendState::builder`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build`"]
pub struct FrontendStateBuilder(FrontendState);

impl FrontendStateBuilder {
    /// The endpoints of the (external, or only) backend set.
    pub fn backends(mut self, endpoints: impl IntoIterator<Item = SocketAddr>) -> Self {
        self.0.backends.endpoints = endpoints.into_iter().collect();
        self
    }

    /// What the (external, or only) backend set does when empty.
    pub fn when_empty(mut self, when_empty: WhenEmpty) -> Self {
        self.0.backends.when_empty = when_empty;
        self
    }

    /// The whole (external, or only) backend set.
    pub fn backend_set(mut self, set: BackendSet) -> Self {
        self.0.backends = set;
        self
    }

    /// The backends of traffic from pods and the node, when they differ (`None`: the same).
    pub fn internal(mut self, set: impl Into<Option<BackendSet>>) -> Self {
        self.0.internal = set.into().map(Box::new);
        self
    }

    /// `sessionAffinity: ClientIP` with this timeout in seconds (`None`: no affinity).
    pub fn affinity(mut self, timeout_s: impl Into<Option<u32>>) -> Self {
        self.0.affinity_timeout_s = timeout_s.into();
        self
    }

    /// `externalTrafficPolicy: Local`.
    pub fn external_local(mut self, local: bool) -> Self {
        self.0.external_local = local;
        self
    }

    /// `internalTrafficPolicy: Local`.
    pub fn internal_local(mut self, local: bool) -> Self {
        self.0.internal_local = local;
        self
    }

    /// `loadBalancerSourceRanges` (empty: everyone).
    pub fn source_ranges(mut self, ranges: impl IntoIterator<Item = ipnet::IpNet>) -> Self {
        self.0.source_ranges = ranges.into_iter().collect();
        self
    }

    /// How new flows pick among the backends.
    pub fn dsr(mut self, dsr: bool) -> Self {
        self.0.dsr = dsr;
        self
    }

    pub fn schedule(mut self, schedule: Schedule) -> Self {
        self.0.schedule = schedule;
        self
    }

    pub fn build(self) -> FrontendState {
        self.0
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::schedule::Scheduler;

    #[test]
    fn the_defaults_and_each_setter_set_their_field() {
        let a: SocketAddr = "10.244.1.5:8080".parse().expect("addr");
        let b: SocketAddr = "10.244.2.6:8080".parse().expect("addr");
        let set = |e: &[SocketAddr], when_empty| BackendSet {
            endpoints: e.iter().copied().collect(),
            when_empty,
        };
        assert_eq!(
            FrontendState::builder("default/web:http", FrontendKind::ClusterIp).build(),
            FrontendState {
                service: "default/web:http".into(),
                kind: FrontendKind::ClusterIp,
                backends: set(&[], WhenEmpty::Reject),
                internal: None,
                affinity_timeout_s: None,
                external_local: false,
                internal_local: false,
                source_ranges: Box::default(),
                schedule: Schedule::default(),
                dsr: false,
            }
        );
        let schedule = Schedule::new(Scheduler::ALL[1], Default::default(), 251);
        let range: ipnet::IpNet = "198.51.100.0/24".parse().expect("cidr");
        assert_eq!(
            FrontendState::builder("default/web:http", FrontendKind::NodePort)
                .backends([a])
                .when_empty(WhenEmpty::Drop)
                .internal(set(&[a, b], WhenEmpty::Reject))
                .affinity(10_800)
                .external_local(true)
                .internal_local(true)
                .source_ranges([range])
                .schedule(schedule.clone())
                .dsr(true)
                .build(),
            FrontendState {
                service: "default/web:http".into(),
                kind: FrontendKind::NodePort,
                backends: set(&[a], WhenEmpty::Drop),
                internal: Some(Box::new(set(&[a, b], WhenEmpty::Reject))),
                affinity_timeout_s: Some(10_800),
                external_local: true,
                internal_local: true,
                source_ranges: vec![range].into(),
                schedule,
                dsr: true,
            }
        );
        assert_eq!(
            FrontendState::builder("s", FrontendKind::ClusterIp)
                .backend_set(set(&[b], WhenEmpty::Drop))
                .affinity(None)
                .build()
                .backends,
            set(&[b], WhenEmpty::Drop)
        );
    }
}
