//! The cluster model: every Service and EndpointSlice the source reported, by name
//! (`ClusterModel`), and what differs between two versions of it.

use std::{collections::BTreeSet, fmt, sync::Arc};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde::Serialize;

use crate::objects::{self, ServiceInfo, SliceInfo};

/// `namespace/name` of a Kubernetes object. Shared strings: the model's keys, the
/// tracker's and the claims are clones of one another (at 100k Services, a dozen copies
/// of each name as `String`s took some 25 MiB), and namespaces are interned.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ObjectRef {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl ObjectRef {
    /// The reference of an object's metadata; objects without a name get "<unnamed>".
    pub fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        Self::new(
            meta.namespace.as_deref().unwrap_or("default"),
            meta.name.as_deref().unwrap_or("<unnamed>"),
        )
    }

    /// `namespace/name`, the namespace interned.
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            namespace: objects::intern(namespace),
            name: name.into(),
        }
    }
}

/// Where an EndpointSlice sits in the model: under the Service it belongs to, so a
/// Service's slices are one range of the map.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct SliceKey {
    pub namespace: Arc<str>,
    /// `kubernetes.io/service-name` ("" for a slice that names none).
    pub service: Arc<str>,
    pub name: Arc<str>,
}

impl SliceKey {
    /// The slice's own reference.
    pub fn object(&self) -> ObjectRef {
        ObjectRef {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

/// Every Service and EndpointSlice the source knows, in their compact form. Persistent
/// maps: a copy costs O(1) and shares everything with the original, and two versions of
/// one lineage diff in proportion to what changed between them (`changed_services`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterModel {
    services: imbl::OrdMap<ObjectRef, Arc<ServiceInfo>>,
    slices: imbl::OrdMap<SliceKey, Arc<SliceInfo>>,
    /// Each slice's owner, to find its entry when it is deleted or relabelled.
    slice_owners: imbl::OrdMap<ObjectRef, Arc<str>>,
}

impl ClusterModel {
    /// Adds or replaces a Service; `false` if the model already held it as it is.
    pub fn insert_service(&mut self, r: ObjectRef, svc: ServiceInfo) -> bool {
        if self.services.get(&r).is_some_and(|old| **old == svc) {
            return false;
        }
        self.services.insert(r, Arc::new(svc));
        true
    }

    pub fn remove_service(&mut self, r: &ObjectRef) -> bool {
        self.services.remove(r).is_some()
    }

    /// Adds or replaces an EndpointSlice; `false` if the model already held it as it is.
    pub fn insert_slice(&mut self, r: ObjectRef, slice: SliceInfo) -> bool {
        let key = SliceKey {
            namespace: r.namespace.clone(),
            service: slice.service.clone().unwrap_or_else(|| "".into()),
            name: r.name.clone(),
        };
        if self.slices.get(&key).is_some_and(|old| **old == slice) {
            return false;
        }
        // Relabelled to another Service: it leaves the old one.
        if let Some(old_owner) = self.slice_owners.get(&r).filter(|o| **o != key.service) {
            let old = SliceKey {
                service: old_owner.clone(),
                ..key.clone()
            };
            self.slices.remove(&old);
        }
        self.slice_owners.insert(r, key.service.clone());
        self.slices.insert(key, Arc::new(slice));
        true
    }

    pub fn remove_slice(&mut self, r: &ObjectRef) -> bool {
        let Some(owner) = self.slice_owners.remove(r) else {
            return false;
        };
        self.slices
            .remove(&SliceKey {
                namespace: r.namespace.clone(),
                service: owner,
                name: r.name.clone(),
            })
            .is_some()
    }

    /// Adds a Service from its API object.
    pub fn add_service(&mut self, svc: &Service) -> bool {
        self.insert_service(ObjectRef::of(&svc.metadata), ServiceInfo::from_k8s(svc))
    }

    /// Adds an EndpointSlice from its API object.
    pub fn add_slice(&mut self, slice: &EndpointSlice) -> bool {
        self.insert_slice(ObjectRef::of(&slice.metadata), SliceInfo::from_k8s(slice))
    }

    pub fn services(&self) -> impl Iterator<Item = (&ObjectRef, &ServiceInfo)> {
        self.services.iter().map(|(r, s)| (r, &**s))
    }

    pub fn service(&self, r: &ObjectRef) -> Option<&ServiceInfo> {
        self.services.get(r).map(|s| &**s)
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    pub fn slices(&self) -> impl Iterator<Item = (&SliceKey, &SliceInfo)> {
        self.slices.iter().map(|(k, s)| (k, &**s))
    }

    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    /// The slices of one Service: one range of the map.
    pub fn slices_of<'a>(
        &'a self,
        service: &'a ObjectRef,
    ) -> impl Iterator<Item = (&'a SliceKey, &'a SliceInfo)> {
        let from = SliceKey {
            namespace: service.namespace.clone(),
            service: service.name.clone(),
            name: "".into(),
        };
        self.slices
            .range(from..)
            .take_while(move |(k, _)| k.namespace == service.namespace && k.service == service.name)
            .map(|(k, s)| (k, &**s))
    }

    /// Makes this model equal to `fresh` (a relist, a reload) by changing only the
    /// entries that differ, so it keeps sharing the rest with its earlier versions (and
    /// diffs against them stay proportional). Returns how many objects changed.
    pub fn replace_with(&mut self, fresh: &ClusterModel) -> u64 {
        let mut changed = 0;
        let gone: Vec<ObjectRef> = self
            .services
            .keys()
            .filter(|r| !fresh.services.contains_key(*r))
            .cloned()
            .collect();
        for r in gone {
            changed += u64::from(self.remove_service(&r));
        }
        for (r, svc) in &fresh.services {
            if self.services.get(r) != Some(svc) {
                self.services.insert(r.clone(), Arc::clone(svc));
                changed += 1;
            }
        }
        let gone: Vec<ObjectRef> = self
            .slice_owners
            .keys()
            .filter(|r| !fresh.slice_owners.contains_key(*r))
            .cloned()
            .collect();
        for r in gone {
            changed += u64::from(self.remove_slice(&r));
        }
        for (key, slice) in &fresh.slices {
            let r = ObjectRef {
                namespace: key.namespace.clone(),
                name: key.name.clone(),
            };
            if self.slices.get(key) != Some(slice) {
                changed += u64::from(self.insert_slice(r, (**slice).clone()));
            }
        }
        changed
    }

    /// Adds every object of `other` (later files win).
    pub fn extend(&mut self, other: &ClusterModel) {
        for (r, svc) in &other.services {
            self.services.insert(r.clone(), Arc::clone(svc));
        }
        for (key, slice) in &other.slices {
            let r = ObjectRef {
                namespace: key.namespace.clone(),
                name: key.name.clone(),
            };
            self.insert_slice(r, (**slice).clone());
        }
    }

    /// The Services whose inputs differ between `self` and `newer` (the Service itself,
    /// or one of its slices), and the slices whose change-trigger time is new. In
    /// proportion to the changes when `newer` was derived from `self`.
    pub fn changes_to(&self, newer: &ClusterModel) -> ModelChanges {
        let mut out = ModelChanges::default();
        for d in self.services.diff(&newer.services) {
            let r = match d {
                imbl::ordmap::DiffItem::Add(r, _) | imbl::ordmap::DiffItem::Remove(r, _) => r,
                imbl::ordmap::DiffItem::Update { new: (r, _), .. } => r,
            };
            out.services.insert(r.clone());
            out.service_objects += 1;
        }
        let owner = |k: &SliceKey| ObjectRef {
            namespace: k.namespace.clone(),
            name: k.service.clone(),
        };
        for d in self.slices.diff(&newer.slices) {
            match d {
                imbl::ordmap::DiffItem::Add(k, s) => {
                    out.services.insert(owner(k));
                    out.slices += 1;
                    out.triggers.extend(s.trigger_time);
                }
                imbl::ordmap::DiffItem::Remove(k, _) => {
                    out.services.insert(owner(k));
                    out.slices += 1;
                }
                imbl::ordmap::DiffItem::Update { old, new } => {
                    out.services.insert(owner(new.0));
                    out.slices += 1;
                    if new.1.trigger_time != old.1.trigger_time {
                        out.triggers.extend(new.1.trigger_time);
                    }
                }
            }
        }
        out
    }
}

impl ClusterModel {
    /// Each object that differs between `self` and `newer`, as the ops that turn one into
    /// the other (the node-view feed's): removals first, and a slice moved to another
    /// Service only set (its removal under the old owner would remove the move). In
    /// proportion to the changes when `newer` was derived from `self`.
    pub fn object_changes(&self, newer: &ClusterModel) -> Vec<ObjectChange> {
        use imbl::ordmap::DiffItem;
        let mut removed = Vec::new();
        let mut set = Vec::new();
        for d in self.services.diff(&newer.services) {
            match d {
                DiffItem::Remove(r, _) => removed.push(ObjectChange::RemoveService(r.clone())),
                DiffItem::Add(r, s) | DiffItem::Update { new: (r, s), .. } => {
                    set.push(ObjectChange::SetService(r.clone(), Arc::clone(s)))
                }
            }
        }
        let mut moved = BTreeSet::new();
        for d in self.slices.diff(&newer.slices) {
            match d {
                DiffItem::Remove(k, _) => removed.push(ObjectChange::RemoveSlice(k.object())),
                DiffItem::Add(k, s) | DiffItem::Update { new: (k, s), .. } => {
                    moved.insert(k.object());
                    set.push(ObjectChange::SetSlice(k.object(), Arc::clone(s)));
                }
            }
        }
        removed.retain(|c| !matches!(c, ObjectChange::RemoveSlice(r) if moved.contains(r)));
        removed.extend(set);
        removed
    }
}

/// One object's change, as the node-view feed sends it.
#[derive(Clone, Debug, PartialEq)]
pub enum ObjectChange {
    SetService(ObjectRef, Arc<ServiceInfo>),
    RemoveService(ObjectRef),
    SetSlice(ObjectRef, Arc<SliceInfo>),
    RemoveSlice(ObjectRef),
}

/// What differs between two versions of the model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelChanges {
    /// Services to rebuild: changed themselves, or one of their slices did (a Service
    /// that no longer exists is in here too: its frontends go).
    pub services: BTreeSet<ObjectRef>,
    /// Service objects added, changed or removed.
    pub service_objects: u64,
    /// EndpointSlice entries added, changed or removed.
    pub slices: u64,
    /// Change-trigger times new in the newer version (each EndpointSlice change once).
    pub triggers: Vec<std::time::SystemTime>,
}
