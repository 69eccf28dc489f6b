//! Objects of a list or a watch decoded one at a time. kube-rs decodes a list as a whole:
//! one item the agent cannot read (a field of another type than k8s-openapi's) failed the
//! list, which was retried forever — a fresh node programmed nothing — and kube-client
//! logged the whole body at WARN on every retry. Watched as `Decoded<K>`, such an item
//! arrives as what could be read of it (its name, for the log and the model), and the
//! list's other items apply.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::{Deserialize, Deserializer, de::DeserializeOwned};

/// The longest decoding error kept (the rest is cut): an error quotes the value it met.
pub const MAX_REASON: usize = 300;

/// One object as the API server sent it: decoded into `K`, or why not.
#[derive(Clone, Debug)]
pub enum Decoded<K> {
    Ok(K),
    Unreadable {
        /// What could be read of its metadata (name, namespace and resourceVersion, when
        /// they are strings): to name it, and for the watcher's resourceVersion. Boxed:
        /// rare, and an `ObjectMeta` is large.
        meta: Box<ObjectMeta>,
        /// The decoding error, with the field's path, cut to `MAX_REASON`.
        reason: String,
    },
}

impl<'de, K: DeserializeOwned> Deserialize<'de> for Decoded<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Any JSON is an item; only what is not JSON at all fails the list (or event).
        let value = serde_json::Value::deserialize(d)?;
        // Read first (three short strings): decoding moves the value's strings into K.
        let meta = readable_meta(&value);
        match serde_path_to_error::deserialize::<_, K>(value) {
            Ok(k) => Ok(Self::Ok(k)),
            Err(e) => Ok(Self::Unreadable {
                meta: Box::new(meta),
                reason: cap(&e.to_string(), MAX_REASON),
            }),
        }
    }
}

/// What names an object whatever else in it is broken: its name, namespace and
/// resourceVersion, those that are strings.
fn readable_meta(value: &serde_json::Value) -> ObjectMeta {
    let meta = &value["metadata"];
    let text = |field: &str| meta[field].as_str().map(str::to_string);
    ObjectMeta {
        name: text("name"),
        namespace: text("namespace"),
        resource_version: text("resourceVersion"),
        ..ObjectMeta::default()
    }
}

/// `text` cut to at most `max` bytes (at a character boundary), saying how much was cut.
pub fn cap(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} more bytes)", &text[..end], text.len() - end)
}

impl<K: Resource> Resource for Decoded<K> {
    type DynamicType = K::DynamicType;
    type Scope = K::Scope;

    fn kind(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::version(dt)
    }

    fn api_version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::api_version(dt)
    }

    fn plural(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn url_path(dt: &Self::DynamicType, namespace: Option<&str>) -> String {
        K::url_path(dt, namespace)
    }

    fn meta(&self) -> &ObjectMeta {
        match self {
            Self::Ok(k) => k.meta(),
            Self::Unreadable { meta, .. } => meta,
        }
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Self::Ok(k) => k.meta_mut(),
            Self::Unreadable { meta, .. } => meta,
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;
    use kube::core::ObjectList;

    use super::*;

    #[test]
    fn a_list_with_an_unreadable_item_keeps_the_others_and_names_it() {
        let body = serde_json::json!({
            "apiVersion": "v1", "kind": "ServiceList", "metadata": {"resourceVersion": "7"},
            "items": [
                {"metadata": {"name": "good", "namespace": "ns", "resourceVersion": "5"},
                 "spec": {"clusterIP": "10.96.0.1"}},
                {"metadata": {"name": "bad", "namespace": "ns", "resourceVersion": "6"},
                 "spec": {"ports": 7}},
                {"metadata": {"name": 3}, "spec": {}},
            ]
        })
        .to_string();
        // As kube-client decodes a list: the typed one fails whole.
        assert!(serde_json::from_str::<ObjectList<Service>>(&body).is_err());
        let list: ObjectList<Decoded<Service>> = serde_json::from_str(&body).expect("list");
        assert_eq!(list.metadata.resource_version.as_deref(), Some("7"));
        assert!(
            matches!(&list.items[0], Decoded::Ok(s) if s.meta().name.as_deref() == Some("good"))
        );
        let Decoded::Unreadable { meta, reason } = &list.items[1] else {
            panic!("{:?}", list.items[1]);
        };
        assert_eq!(meta.name.as_deref(), Some("bad"));
        assert_eq!(meta.resource_version.as_deref(), Some("6"));
        assert!(reason.starts_with("spec.ports: invalid type"), "{reason}");
        let Decoded::Unreadable { meta, .. } = &list.items[2] else {
            panic!("{:?}", list.items[2]);
        };
        assert_eq!(meta.name, None, "a name that is not a string is not read");
    }

    #[test]
    fn reasons_are_capped_at_a_character_boundary() {
        assert_eq!(cap("short", 10), "short");
        let long = "é".repeat(400);
        let capped = cap(&long, MAX_REASON);
        assert!(capped.len() < MAX_REASON + 30, "{}", capped.len());
        assert!(capped.ends_with("(500 more bytes)"), "{capped}");
    }
}
