//! The pod of a review, read keeping only what injection reads.

use serde::Deserialize;
use serde_json::Value;

/// The pod of a review, keeping only what the operator reads (see [`Keep`]):
/// a pod's bulk (env, volumes' sources, managed fields, big annotations) is
/// skipped while parsing, never held, so a review costs about its body size
/// whatever its shape. `null` is no object.
pub(super) fn pruned_pod<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Value>, D::Error> {
    use serde::de::DeserializeSeed;
    let v = Keep::Pod.deserialize(d)?;
    Ok((!v.is_null()).then_some(v))
}

/// Which part of a pod a JSON value is, and so what of it is kept: what
/// [`crate::patch::mutate`] and the selection read, and the shape (object,
/// array, null) of everything the patch paths go through. A value of an
/// unexpected type is kept as it is (scalars) or emptied (arrays where an
/// object belongs), so that `mutate` still sees that it is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    All,
    Pod,
    Meta,
    Annotations,
    Spec,
    Containers,
    Container,
    Lifecycle,
    Mounts,
    Mount,
    Volumes,
    Volume,
}

impl Keep {
    /// What is kept of the member `key` of an object of this kind.
    fn member(self, key: &str) -> Option<Keep> {
        use Keep::*;
        match (self, key) {
            (All, _) => Some(All),
            (Pod, "metadata") => Some(Meta),
            (Pod, "spec") => Some(Spec),
            (Pod, "apiVersion" | "kind") => Some(All),
            (Meta, "labels" | "namespace" | "name" | "generateName") => Some(All),
            (Meta, "annotations") => Some(Annotations),
            (Annotations, k) if k.starts_with(remora_contract::annotations::PREFIX) => Some(All),
            (Spec, "containers" | "initContainers") => Some(Containers),
            (Spec, "volumes") => Some(Volumes),
            (Spec, "hostNetwork" | "restartPolicy" | "terminationGracePeriodSeconds") => Some(All),
            (Container, "name" | "ports") => Some(All),
            (Container, "lifecycle") => Some(Lifecycle),
            (Lifecycle, "preStop") => Some(All),
            (Container, "volumeMounts") => Some(Mounts),
            (Mount, "mountPath") => Some(All),
            (Volume, "name") => Some(All),
            _ => None,
        }
    }

    /// What is kept of the elements of an array of this kind; `None`: an
    /// array where an object belongs, kept empty.
    fn element(self) -> Option<Keep> {
        match self {
            Keep::All => Some(Keep::All),
            Keep::Containers => Some(Keep::Container),
            Keep::Mounts => Some(Keep::Mount),
            Keep::Volumes => Some(Keep::Volume),
            _ => None,
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Keep {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        if self == Keep::All {
            return Value::deserialize(d);
        }
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Keep {
    type Value = Value;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        match self.element() {
            Some(keep) => {
                while let Some(v) = seq.next_element_seed(keep)? {
                    out.push(v);
                }
            }
            None => while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {},
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            match self.member(&key) {
                Some(keep) => {
                    let v = map.next_value_seed(keep)?;
                    out.insert(key, v);
                }
                None => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(Value::Object(out))
    }
}
