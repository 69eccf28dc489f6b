//! The node view, kept up to date one Service at a time (kube-proxy's change trackers):
//! each Service's part of the view is rebuilt only when the Service or one of its slices
//! changed; VIP collisions between Services are settled for the frontends it touches.
//! A full rebuild is for a new node identity or settings, and for the periodic resync.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use super::{
    cluster::{ClusterModel, ObjectRef},
    frontend::{Frontend, FrontendState, NodeView},
    node::{NodeInfo, ViewConfig},
    view::{HealthCheck, Rejection, ServiceView, frontend_in, service_view},
};

/// What an update changed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ViewChanges {
    /// Frontends whose state changed, appeared or went away.
    pub frontends: BTreeSet<Frontend>,
    /// Rejections that are new (of Services whose rejections changed): to log and count.
    pub new_rejections: Vec<Rejection>,
    /// Some health-check port changed.
    pub health: bool,
}

/// A Service's part as the tracker keeps it: 24 bytes, where a `ServiceView` is 136
/// (at 100k Services the tracker's map held 32 MiB). The health check is kept in
/// `ViewTracker::health`.
#[derive(Debug)]
struct Part {
    /// Sorted by frontend.
    frontends: Box<[(Frontend, Arc<FrontendState>)]>,
    /// What was left out and the no-local keys: few Services have any.
    rest: Option<Box<Rest>>,
}

#[derive(Debug)]
struct Rest {
    rejections: Vec<Rejection>,
    no_local: Vec<(&'static str, &'static str)>,
}

impl Part {
    fn new(v: ServiceView) -> Self {
        let rest = (!v.rejections.is_empty() || !v.no_local.is_empty()).then(|| {
            Box::new(Rest {
                rejections: v.rejections,
                no_local: v.no_local,
            })
        });
        Self {
            frontends: v.frontends.into_boxed_slice(),
            rest,
        }
    }

    fn rejections(&self) -> &[Rejection] {
        self.rest.as_ref().map_or(&[], |r| &r.rejections)
    }

    fn no_local(&self) -> &[(&'static str, &'static str)] {
        self.rest.as_ref().map_or(&[], |r| &r.no_local)
    }

    /// The state this Service wants for `fe`, if it wants `fe`.
    fn frontend(&self, fe: &Frontend) -> Option<&Arc<FrontendState>> {
        frontend_in(&self.frontends, fe)
    }
}

/// The Services that want one frontend, in namespace/name order: nearly always one (a
/// vector of one took 56 bytes a frontend, this takes 32).
#[derive(Clone, Debug)]
enum Claims {
    One(ObjectRef),
    /// Two or more; none once the last went.
    Many(Vec<ObjectRef>),
}

impl Claims {
    fn as_slice(&self) -> &[ObjectRef] {
        match self {
            Claims::One(r) => std::slice::from_ref(r),
            Claims::Many(v) => v,
        }
    }

    fn add(&mut self, r: &ObjectRef) {
        let mut all = self.as_slice().to_vec();
        if let Err(at) = all.binary_search(r) {
            all.insert(at, r.clone());
            *self = match <[ObjectRef; 1]>::try_from(all) {
                Ok([one]) => Claims::One(one),
                Err(all) => Claims::Many(all),
            };
        }
    }

    fn remove(&mut self, r: &ObjectRef) {
        match self {
            Claims::One(one) if one == r => *self = Claims::Many(Vec::new()),
            Claims::One(_) => {}
            Claims::Many(v) => {
                v.retain(|x| x != r);
                if v.len() == 1 {
                    *self = Claims::One(v[0].clone());
                }
            }
        }
    }
}

/// This node's view and each Service's part in it.
#[derive(Debug)]
pub struct ViewTracker {
    node: NodeInfo,
    cfg: ViewConfig,
    /// Services with something in the view (frontends, rejections or a health check).
    services: BTreeMap<ObjectRef, Part>,
    /// The Services that want each frontend, in namespace/name order: the first has it.
    claims: BTreeMap<Frontend, Claims>,
    /// Frontends wanted by more than one Service: the refusals of the others.
    collisions: BTreeMap<Frontend, Vec<Rejection>>,
    view: NodeView,
    /// Services with a health-check port here (few: eTP Local ones).
    health: BTreeMap<ObjectRef, (u16, HealthCheck)>,
    no_local: BTreeMap<(&'static str, &'static str), u64>,
}

impl ViewTracker {
    pub fn new(node: NodeInfo, cfg: ViewConfig) -> Self {
        Self {
            node,
            cfg,
            services: BTreeMap::new(),
            claims: BTreeMap::new(),
            collisions: BTreeMap::new(),
            view: NodeView::new(),
            health: BTreeMap::new(),
            no_local: BTreeMap::new(),
        }
    }

    pub fn node(&self) -> &NodeInfo {
        &self.node
    }

    /// A new node identity or settings: `true` if it differs (the caller rebuilds).
    pub fn set_node(&mut self, node: &NodeInfo, cfg: &ViewConfig) -> bool {
        if self.node == *node && self.cfg == *cfg {
            return false;
        }
        self.node = node.clone();
        self.cfg = cfg.clone();
        true
    }

    pub fn view(&self) -> &NodeView {
        &self.view
    }

    /// Rebuilds every Service's part; frontends are changed only where they differ.
    pub fn rebuild(&mut self, model: &ClusterModel) -> ViewChanges {
        let all: BTreeSet<ObjectRef> = self
            .services
            .keys()
            .cloned()
            .chain(model.services().map(|(r, _)| r.clone()))
            .collect();
        self.update(model, &all)
    }

    /// The maps a first build filled in key order, with fuller nodes (`model::compact`):
    /// std's B-trees build full nodes from sorted input. For the runner, once its first
    /// programming is applied.
    pub fn compact(&mut self) {
        self.services = std::mem::take(&mut self.services).into_iter().collect();
        self.claims = std::mem::take(&mut self.claims).into_iter().collect();
        self.view.compact();
    }

    /// Rebuilds the parts of `services` (those that changed, or went away).
    pub fn update<'a>(
        &mut self,
        model: &ClusterModel,
        services: impl IntoIterator<Item = &'a ObjectRef>,
    ) -> ViewChanges {
        let mut changes = ViewChanges::default();
        let mut touched = BTreeSet::new();
        for sref in services {
            let fresh = model
                .service(sref)
                .map(|svc| service_view(sref, svc, model, &self.node, &self.cfg))
                .filter(|v| !v.is_empty());
            self.replace(sref, fresh, &mut touched, &mut changes);
        }
        self.settle(&touched, &mut changes);
        changes
    }

    /// Swaps one Service's part, noting the frontends it touched.
    fn replace(
        &mut self,
        sref: &ObjectRef,
        fresh: Option<ServiceView>,
        touched: &mut BTreeSet<Frontend>,
        changes: &mut ViewChanges,
    ) {
        let old = self.services.remove(sref);
        let old_rejections = old.as_ref().map_or(&[][..], Part::rejections);
        let new_rejections = fresh.as_ref().map_or(&[][..], |f| &f.rejections);
        if old_rejections != new_rejections {
            changes
                .new_rejections
                .extend(new_rejections.iter().cloned());
        }
        let health = fresh.as_ref().and_then(|f| f.health.clone());
        if self.health.get(sref) != health.as_ref() {
            changes.health = true;
            match health {
                Some(h) => self.health.insert(sref.clone(), h),
                None => self.health.remove(sref),
            };
        }
        if let Some(old) = &old {
            for (fe, _) in &old.frontends {
                if let Some(c) = self.claims.get_mut(fe) {
                    c.remove(sref);
                }
                touched.insert(*fe);
            }
            for key in old.no_local() {
                if let Some(n) = self.no_local.get_mut(key) {
                    *n = n.saturating_sub(1);
                }
            }
        }
        if let Some(fresh) = fresh {
            for (fe, _) in &fresh.frontends {
                match self.claims.entry(*fe) {
                    std::collections::btree_map::Entry::Vacant(v) => {
                        v.insert(Claims::One(sref.clone()));
                    }
                    std::collections::btree_map::Entry::Occupied(mut o) => o.get_mut().add(sref),
                }
                touched.insert(*fe);
            }
            for key in &fresh.no_local {
                *self.no_local.entry(*key).or_insert(0) += 1;
            }
            self.services.insert(sref.clone(), Part::new(fresh));
        }
    }

    /// Gives each touched frontend to the first Service (namespace/name order) that
    /// wants it — the API server allocates ClusterIPs and NodePorts once, but files and
    /// external IPs can collide — and refuses it to the others, by name.
    fn settle(&mut self, touched: &BTreeSet<Frontend>, changes: &mut ViewChanges) {
        for fe in touched {
            let claimants: Vec<ObjectRef> = self
                .claims
                .get(fe)
                .map(|c| c.as_slice().to_vec())
                .unwrap_or_default();
            let state = |r: &ObjectRef| -> Option<&Arc<FrontendState>> {
                self.services.get(r).and_then(|s| s.frontend(fe))
            };
            let winner = claimants.first().and_then(|r| state(r).cloned());
            let refusals: Vec<Rejection> = match &winner {
                None => Vec::new(),
                Some(w) => claimants[1..]
                    .iter()
                    .filter_map(|r| {
                        let loser = state(r)?;
                        Some(Rejection {
                            kind: crate::error::ObjectKind::Service,
                            object: r.clone(),
                            reason: format!(
                                "{fe} already belongs to {}; not programmed for {}",
                                w.service, loser.service
                            ),
                        })
                    })
                    .collect(),
            };
            if claimants.is_empty() {
                self.claims.remove(fe);
            }
            let old_refusals = self.collisions.get(fe).map_or(&[][..], Vec::as_slice);
            if old_refusals != refusals.as_slice() {
                changes.new_rejections.extend(refusals.iter().cloned());
            }
            if refusals.is_empty() {
                self.collisions.remove(fe);
            } else {
                self.collisions.insert(*fe, refusals);
            }
            match winner {
                None => {
                    if self.view.remove(fe).is_some() {
                        changes.frontends.insert(*fe);
                    }
                }
                Some(st) => {
                    if self.view.shared(fe) != Some(&st) {
                        self.view.set(*fe, st);
                        changes.frontends.insert(*fe);
                    }
                }
            }
        }
    }

    /// Everything left out, in namespace/name order.
    pub fn rejections(&self) -> Vec<Rejection> {
        let mut refused: BTreeMap<&ObjectRef, Vec<&Rejection>> = BTreeMap::new();
        for r in self.collisions.values().flatten() {
            refused.entry(&r.object).or_default().push(r);
        }
        let mut out = Vec::new();
        for (sref, part) in &self.services {
            out.extend(part.rejections().iter().cloned());
            out.extend(refused.remove(sref).into_iter().flatten().cloned());
        }
        out
    }

    /// Health-check ports of this node, by port: kube-proxy answers 200 with the number
    /// of local endpoints, 503 without.
    pub fn health_checks(&self) -> BTreeMap<u16, HealthCheck> {
        self.health.values().cloned().collect()
    }

    /// kube-proxy's `sync_proxy_rules_no_local_endpoints_total`, per policy and family.
    pub fn no_local_endpoints(&self) -> BTreeMap<(&'static str, &'static str), u64> {
        let mut counts = BTreeMap::new();
        for policy in ["internal", "external"] {
            for family in ["IPv4", "IPv6"] {
                counts.insert((policy, family), 0);
            }
        }
        for (k, n) in &self.no_local {
            counts.insert(*k, *n);
        }
        counts
    }
}

/// Builds this node's view. Invalid objects (or invalid parts: one bad port, one bad
/// address) are left out and reported; everything else still applies.
pub fn node_view(
    model: &ClusterModel,
    node: &NodeInfo,
    cfg: &ViewConfig,
) -> (NodeView, Vec<Rejection>) {
    let mut tracker = ViewTracker::new(node.clone(), cfg.clone());
    tracker.rebuild(model);
    (tracker.view().clone(), tracker.rejections())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
    use serde_json::json;

    use super::*;
    use crate::node_view;

    #[test]
    fn a_lone_claimant_is_held_without_a_vector() {
        let a = ObjectRef::new("ns", "a");
        let b = ObjectRef::new("ns", "b");
        let mut c = Claims::One(a.clone());
        c.remove(&a);
        assert!(c.as_slice().is_empty());
        c.add(&a);
        assert!(matches!(c, Claims::One(_)), "back to one: {c:?}");
        c.add(&b);
        c.add(&b);
        assert_eq!(c.as_slice(), &[a.clone(), b.clone()], "sorted, once each");
        c.remove(&a);
        assert!(matches!(&c, Claims::One(r) if *r == b));
    }

    /// A random Service from small pools, so VIPs, NodePorts and slices collide.
    fn service(rng: &mut StdRng, name: &str) -> Service {
        let ip = format!("10.96.0.{}", rng.random_range(1..6));
        let node_port = 30_000 + rng.random_range(0..4);
        let mut spec = json!({
            "clusterIP": ip,
            "ports": [{"name": "http", "port": 80 + rng.random_range(0..2), "targetPort": 8080}],
        });
        if rng.random_bool(0.3) {
            spec["type"] = json!("NodePort");
            spec["ports"][0]["nodePort"] = json!(node_port);
            if rng.random_bool(0.5) {
                spec["externalTrafficPolicy"] = json!("Local");
                spec["healthCheckNodePort"] = json!(32_000 + rng.random_range(0..3));
            }
        }
        if rng.random_bool(0.2) {
            spec["externalIPs"] = json!([format!("203.0.113.{}", rng.random_range(1..4))]);
        }
        if rng.random_bool(0.2) {
            spec["internalTrafficPolicy"] = json!("Local");
        }
        if rng.random_bool(0.05) {
            spec["clusterIP"] = json!("not-an-ip");
        }
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": "ns"}, "spec": spec}))
            .expect("service")
    }

    fn slice(rng: &mut StdRng, name: &str, owner: &str) -> EndpointSlice {
        let eps: Vec<_> = (0..rng.random_range(0..4))
            .map(|_| {
                json!({"addresses": [format!("10.244.0.{}", rng.random_range(1..8))],
                       "conditions": {"ready": rng.random_bool(0.7), "serving": true,
                                      "terminating": rng.random_bool(0.2)},
                       "nodeName": if rng.random_bool(0.5) { "node-a" } else { "node-b" }})
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns",
                         "labels": {"kubernetes.io/service-name": owner}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": eps,
        }))
        .expect("slice")
    }

    fn node() -> NodeInfo {
        NodeInfo {
            name: "node-a".into(),
            addresses: vec!["192.0.2.10".parse().expect("ip")],
            ..Default::default()
        }
    }

    #[test]
    fn updating_the_changed_services_gives_the_full_rebuild() {
        let cfg = ViewConfig::default();
        for seed in 0..20 {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut model = ClusterModel::default();
            let mut tracker = ViewTracker::new(node(), cfg.clone());
            tracker.rebuild(&model);
            let mut shown = NodeView::new();
            for step in 0..150 {
                let before = model.clone();
                let svc = format!("svc-{}", rng.random_range(0..8));
                let slice_name = format!("slice-{}", rng.random_range(0..12));
                match rng.random_range(0..10) {
                    0..=2 => {
                        model.add_service(&service(&mut rng, &svc));
                    }
                    3 => {
                        model.remove_service(&ObjectRef {
                            namespace: "ns".into(),
                            name: svc.into(),
                        });
                    }
                    4..=7 => {
                        // Sometimes relabelled to another Service.
                        model.add_slice(&slice(&mut rng, &slice_name, &svc));
                    }
                    _ => {
                        model.remove_slice(&ObjectRef {
                            namespace: "ns".into(),
                            name: slice_name.into(),
                        });
                    }
                }
                let changes = tracker.update(&model, &before.changes_to(&model).services);
                let (want, want_rejections) = node_view(&model, &node(), &cfg);
                assert_eq!(tracker.view(), &want, "seed {seed} step {step}");
                let mut got_rejections = tracker.rejections();
                let mut want_rejections = want_rejections;
                let key = |r: &Rejection| (r.object.clone(), r.reason.clone());
                got_rejections.sort_by_key(key);
                want_rejections.sort_by_key(key);
                assert_eq!(got_rejections, want_rejections, "seed {seed} step {step}");
                let mut full = ViewTracker::new(node(), cfg.clone());
                full.rebuild(&model);
                assert_eq!(tracker.health_checks(), full.health_checks());
                assert_eq!(tracker.no_local_endpoints(), full.no_local_endpoints());
                // The changes name exactly the frontends that differ.
                assert_eq!(
                    changes.frontends,
                    shown.changed_frontends(tracker.view()),
                    "seed {seed} step {step}"
                );
                shown = tracker.view().clone();
            }
        }
    }
}
