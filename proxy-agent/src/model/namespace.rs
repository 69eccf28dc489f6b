//! Namespaces, interned: a cluster's few namespaces are named by every one of its
//! objects, so each object reference holds a clone of one shared string instead of a copy.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, OnceLock},
};

/// Past this many distinct namespaces, new ones are no longer kept (each reference gets
/// its own copy): the table never shrinks, and a namespace is cheap to create.
const MAX_INTERNED: usize = 65_536;

/// The shared string for namespace `ns`.
pub fn intern(ns: &str) -> Arc<str> {
    static TABLE: OnceLock<Mutex<HashSet<Arc<str>>>> = OnceLock::new();
    let mut table = TABLE
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(shared) = table.get(ns) {
        return Arc::clone(shared);
    }
    let fresh: Arc<str> = ns.into();
    if table.len() < MAX_INTERNED {
        table.insert(Arc::clone(&fresh));
    }
    fresh
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_namespace_is_one_string() {
        let a = intern("kube-system");
        let b = intern(&String::from("kube-system"));
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(&*a, "kube-system");
        assert!(!Arc::ptr_eq(&a, &intern("default")));
    }
}
