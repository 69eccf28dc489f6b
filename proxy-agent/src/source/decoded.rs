//! Objects of a list or a watch decoded one at a time. kube-rs decodes a list as a whole:
//! one item the agent cannot read (a field of another type than k8s-openapi's) failed the
//! list, which was retried forever — a fresh node programmed nothing — and kube-client
//! logged the whole body at WARN on every retry. Watched as `Decoded<K>`, such an item
//! arrives as what could be read of it (its name, for the log and the model), and the
//! list's other items apply.
//!
//! An item is decoded into `K` straight from its text (serde_json's raw value), as kube's
//! typed decode would; only an item that fails goes through a `serde_json::Value`, for its
//! name and the failing field's path. Through a `Value` every time, a list took 3.2×
//! (Services) to 3.9× (EndpointSlices) kube's typed decode (`cargo xtask bench`,
//! `api_decode`).

use std::{borrow::Cow, fmt, marker::PhantomData};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::{
    Deserialize, Deserializer,
    de::{DeserializeOwned, MapAccess, Visitor},
};

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

/// The name serde_json gives its raw value (`serde_json::value::RawValue`, feature
/// `raw_value`): asked for a newtype struct of this name, it hands over the value's text.
/// Any other deserializer (or a serde_json that no longer knows the name) hands over the
/// value itself, decoded through a `Value`: slower, the same result.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

impl<'de, K: DeserializeOwned> Deserialize<'de> for Decoded<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Any JSON is an item; only what is not JSON at all fails the list (or event).
        d.deserialize_newtype_struct(RAW_VALUE_TOKEN, ItemVisitor(PhantomData))
    }
}

impl<K: DeserializeOwned> Decoded<K> {
    /// An item from its text: straight into `K`, else as a `Value` would have it.
    fn from_text(text: &str) -> Self {
        match serde_json::from_str::<K>(text) {
            Ok(k) => Self::Ok(k),
            // The text is JSON (serde_json checked it while taking it).
            Err(_) => match serde_json::from_str::<serde_json::Value>(text) {
                Ok(value) => Self::from_value(value),
                Err(e) => Self::Unreadable {
                    meta: Box::default(),
                    reason: cap(&e.to_string(), MAX_REASON),
                },
            },
        }
    }

    /// An item from its value; an unreadable one named by what can be read of it.
    fn from_value(value: serde_json::Value) -> Self {
        // Read first (three short strings): decoding moves the value's strings into K.
        let meta = readable_meta(&value);
        match serde_path_to_error::deserialize::<_, K>(value) {
            Ok(k) => Self::Ok(k),
            Err(e) => Self::Unreadable {
                meta: Box::new(meta),
                reason: cap(&e.to_string(), MAX_REASON),
            },
        }
    }
}

/// Takes an item as serde_json's raw text (`visit_map`) or as whatever else the
/// deserializer gives (`visit_newtype_struct`).
struct ItemVisitor<K>(PhantomData<K>);

impl<'de, K: DeserializeOwned> Visitor<'de> for ItemVisitor<K> {
    type Value = Decoded<K>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Decoded<K>, D::Error> {
        Ok(Decoded::from_value(serde_json::Value::deserialize(d)?))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Decoded<K>, A::Error> {
        let Some(key) = map.next_key::<Cow<'de, str>>()? else {
            return Ok(Decoded::from_value(serde_json::Value::Object(
                Default::default(),
            )));
        };
        if key == RAW_VALUE_TOKEN {
            let text = map.next_value::<Text<'de>>()?;
            return Ok(Decoded::from_text(&text.0));
        }
        // A deserializer that gave the object's own fields: take them as a value.
        let mut object = serde_json::Map::new();
        object.insert(key.into_owned(), map.next_value()?);
        while let Some((k, v)) = map.next_entry::<String, serde_json::Value>()? {
            object.insert(k, v);
        }
        Ok(Decoded::from_value(serde_json::Value::Object(object)))
    }
}

/// A string, borrowed from the input where the deserializer can.
struct Text<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object's text")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s.to_string())))
            }
            fn visit_string<E>(self, s: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s)))
            }
        }
        d.deserialize_str(V)
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

/// The longest watch error logged (the rest is cut).
pub const MAX_LOGGED_ERROR: usize = 1024;

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
    fn an_item_decodes_the_same_from_its_text_or_through_serdes_buffer() {
        use kube::core::WatchEvent;
        let object = r#"{"metadata": {"name": "web", "namespace": "ns"}, "spec": {"clusterIP": "10.96.0.1"}}"#;
        let bad = r#"{"metadata": {"name": "bad", "namespace": "ns"}, "spec": {"ports": 7}}"#;
        for (text, ok) in [(object, true), (bad, false)] {
            // "type" first: the item's own text; "object" first: serde buffers it.
            for line in [
                format!(r#"{{"type": "ADDED", "object": {text}}}"#),
                format!(r#"{{"object": {text}, "type": "ADDED"}}"#),
            ] {
                let event: WatchEvent<Decoded<Service>> =
                    serde_json::from_str(&line).expect("an event");
                let WatchEvent::Added(item) = event else {
                    panic!("{line}");
                };
                match (item, ok) {
                    (Decoded::Ok(s), true) => assert_eq!(s.meta().name.as_deref(), Some("web")),
                    (Decoded::Unreadable { meta, reason }, false) => {
                        assert_eq!(meta.name.as_deref(), Some("bad"));
                        assert!(reason.starts_with("spec.ports: invalid type"), "{reason}");
                    }
                    (item, _) => panic!("{line}: {item:?}"),
                }
            }
        }
        // Straight from the text, as kube's typed decode.
        let Decoded::<Service>::Ok(s) = Decoded::from_text(object) else {
            panic!("typed");
        };
        assert_eq!(
            s.spec.and_then(|s| s.cluster_ip).as_deref(),
            Some("10.96.0.1")
        );
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
