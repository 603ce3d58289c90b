//! The config keys that come from the request-key rows: each limit's node default and
//! ceiling in `[mps]` (the rows' `default_key` and `ceiling_key`) and its name in a
//! `[cdi.profiles.<name>]` table. They are read by row rather than as serde fields, so a
//! new limit row gets its keys with no edit to the config module.
//!
//! Invariants: the refusals are the ones serde's derive gives a struct that denies unknown
//! fields, at the same place in the file: an unknown key is one line naming it and listing
//! every key the table takes (its own fields and the rows'), a value of the wrong type
//! names what the row wants. toml attaches the span of the key or value being read to an
//! error raised while reading it, so each error is raised inside toml's own
//! `next_key_seed`/`next_value_seed`. A value's range and form are left to the config's
//! checks, which name the key, the value and what is allowed.

use std::fmt;

use serde::de::{
    self, Deserialize, DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, Visitor,
};

use super::raw::{MpsFields, RawMps};
use super::types::{CdiProfile, Written};
use crate::request::{limits, numeric, KeySpec, Number};

/// The `[mps]` keys of the rows, defaults then ceilings (the order the checks read them):
/// the config key (`mps.<name>`), its name in the table, and the row's grammar.
fn mps_keys() -> impl Iterator<Item = (&'static str, &'static str, Number)> {
    let defaults = numeric().filter_map(|(k, n)| Some((k.default_key?, n)));
    let ceilings = numeric().filter_map(|(k, n)| Some((k.ceiling_key?, n)));
    defaults
        .chain(ceilings)
        .filter_map(|(key, n)| Some((key, key.strip_prefix("mps.")?, n)))
}

/// serde's line for an unknown field, word for word (`Error::unknown_field` wants a
/// `'static` list; this one is built from the rows).
fn unknown_key<E: de::Error>(key: &str, known: &[&str]) -> E {
    let list = match known {
        [] => return E::custom(format_args!("unknown field `{key}`, there are no fields")),
        [one] => format!("`{one}`"),
        [a, b] => format!("`{a}` or `{b}`"),
        _ => format!(
            "one of {}",
            known
                .iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    E::custom(format_args!("unknown field `{key}`, expected {list}"))
}

/// Reads a row's value by its grammar.
struct ValueSeed(Number);

impl<'de> DeserializeSeed<'de> for ValueSeed {
    type Value = Written;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Written, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed {
    type Value = Written;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Number::Integer { allowed, .. } => f.write_str(allowed),
            Number::Size => f.write_str("a string with a size and a unit, like \"512M\" or \"4G\""),
        }
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Written, E> {
        match self.0 {
            Number::Integer { .. } => Ok(Written::Integer(v)),
            Number::Size => Err(E::invalid_type(de::Unexpected::Unsigned(v), &self)),
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Written, E> {
        match (self.0, u64::try_from(v)) {
            (Number::Integer { .. }, Ok(v)) => Ok(Written::Integer(v)),
            (Number::Integer { .. }, Err(_)) => {
                Err(E::invalid_value(de::Unexpected::Signed(v), &self))
            }
            (Number::Size, _) => Err(E::invalid_type(de::Unexpected::Signed(v), &self)),
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Written, E> {
        match self.0 {
            Number::Size => Ok(Written::Text(v.to_owned())),
            Number::Integer { .. } => Err(E::invalid_type(de::Unexpected::Str(v), &self)),
        }
    }
}

/// `[mps]`: the rows' keys read here, every other key passed to the derived
/// [`MpsFields`] through [`Rest`].
impl<'de> Deserialize<'de> for RawMps {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(MpsVisitor)
    }
}

struct MpsVisitor;

impl<'de> Visitor<'de> for MpsVisitor {
    type Value = RawMps;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the [mps] table")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawMps, A::Error> {
        let mut rows = Vec::new();
        let fields = MpsFields::deserialize(Rest {
            map: &mut map,
            rows: &mut rows,
        })?;
        Ok(RawMps { fields, rows })
    }
}

/// The `[mps]` table as the derived [`MpsFields`] sees it: a map of its own keys. The rows'
/// keys it never sees are read into `rows` on the way.
struct Rest<'a, A> {
    map: &'a mut A,
    rows: &'a mut Vec<(&'static str, Written)>,
}

impl<'de, A: MapAccess<'de>> Deserializer<'de> for Rest<'_, A> {
    type Error = A::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, A::Error> {
        self.deserialize_struct("", &[], visitor)
    }

    /// `fields` is the derived struct's list of keys, for the unknown-key line.
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        visitor.visit_map(RestMap {
            map: self.map,
            rows: self.rows,
            fields,
        })
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

struct RestMap<'a, A> {
    map: &'a mut A,
    rows: &'a mut Vec<(&'static str, Written)>,
    fields: &'static [&'static str],
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for RestMap<'_, A> {
    type Error = A::Error;

    /// The next key that is one of `fields`; the rows' keys before it are read, value and
    /// all, into `rows`.
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        let mut seed = Some(seed);
        loop {
            let key = self.map.next_key_seed(MpsKey {
                seed: &mut seed,
                fields: self.fields,
            })?;
            match key {
                None => return Ok(None),
                Some(Key::Field(value)) => return Ok(Some(value)),
                Some(Key::Row(config_key, number)) => {
                    let value = self.map.next_value_seed(ValueSeed(number))?;
                    self.rows.push((config_key, value));
                }
            }
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        self.map.next_value_seed(seed)
    }
}

/// An `[mps]` key: a row's, or one of the derived struct's (read by its own seed).
enum Key<T> {
    Row(&'static str, Number),
    Field(T),
}

struct MpsKey<'s, K> {
    /// The derived struct's seed, taken by the key that is one of its fields.
    seed: &'s mut Option<K>,
    fields: &'static [&'static str],
}

impl<'de, K: DeserializeSeed<'de>> DeserializeSeed<'de> for MpsKey<'_, K> {
    type Value = Key<K::Value>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de, K: DeserializeSeed<'de>> Visitor<'de> for MpsKey<'_, K> {
    type Value = Key<K::Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key of [mps]")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        if !self.fields.contains(&v) {
            if let Some((config_key, _, number)) = mps_keys().find(|(_, name, _)| *name == v) {
                return Ok(Key::Row(config_key, number));
            }
            let known: Vec<&str> = (self.fields.iter().copied())
                .chain(mps_keys().map(|(_, name, _)| name))
                .collect();
            return Err(unknown_key(v, &known));
        }
        let seed = self
            .seed
            .take()
            .ok_or_else(|| E::custom("a key read twice"))?;
        seed.deserialize(v.into_deserializer()).map(Key::Field)
    }
}

/// `[cdi.profiles.<name>]`: a limit row's name and its value, for each key.
impl<'de> Deserialize<'de> for CdiProfile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(ProfileVisitor)
    }
}

struct ProfileVisitor;

impl<'de> Visitor<'de> for ProfileVisitor {
    type Value = CdiProfile;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a table of limits")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<CdiProfile, A::Error> {
        let mut limits = Vec::new();
        while let Some((key, number)) = map.next_key_seed(ProfileKey)? {
            limits.push((key, map.next_value_seed(ValueSeed(number))?));
        }
        Ok(CdiProfile { limits })
    }
}

/// A profile's key: the name of a limit row.
struct ProfileKey;

impl<'de> DeserializeSeed<'de> for ProfileKey {
    type Value = (&'static KeySpec, Number);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for ProfileKey {
    type Value = (&'static KeySpec, Number);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a limit's name")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        limits()
            .map(|(k, _, n)| (k, n))
            .find(|(k, _)| k.name == v)
            .ok_or_else(|| {
                let known: Vec<&str> = limits().map(|(k, _, _)| k.name).collect();
                unknown_key(v, &known)
            })
    }
}
