//! A record as a trace line: `{"ts":N,"pid":N[,"tid":N],"ev":"<event>",<its fields>[,"raw":...]}`,
//! the event's name under `ev` among the record's own fields.
//!
//! Written by hand rather than derived with serde's `tag` and `flatten`: serde reads an internally
//! tagged enum by buffering every field of the object first (it cannot know the variant before
//! it has seen the tag), and `flatten` buffers them again; that was most of the time of reading a
//! trace. Here the event is an externally tagged enum, and a line with `ev` before the event's
//! fields (as gputrace writes them) is read straight into its variant. A line in any other order
//! (a trace rewritten by another tool) still reads: its fields are kept until `ev` is met.

use std::borrow::Cow;
use std::fmt;

use serde::de::value::{MapAccessDeserializer, MapDeserializer};
use serde::de::{self, DeserializeSeed, EnumAccess, IgnoredAny, IntoDeserializer, MapAccess, VariantAccess, Visitor};
use serde::ser::{self, Impossible, SerializeMap, SerializeStruct, SerializeStructVariant};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{Event, Record};

const TAG: &str = "ev";

impl Serialize for Record {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("ts", &self.ts)?;
        map.serialize_entry("pid", &self.pid)?;
        if self.tid != 0 {
            map.serialize_entry("tid", &self.tid)?;
        }
        self.event.serialize(Flat(&mut map))?;
        if let Some(raw) = &self.raw {
            map.serialize_entry("raw", raw)?;
        }
        map.end()
    }
}

/// Serialises an event's variant into the record's map: its name under `ev`, then its fields
/// (those of a struct variant, or of the struct a newtype variant holds).
struct Flat<'a, M>(&'a mut M);

impl<M: SerializeMap> Flat<'_, M> {
    fn refuse<T>() -> Result<T, M::Error> {
        Err(ser::Error::custom("an event is a unit, struct, or newtype-of-struct variant"))
    }
}

/// The Serializer methods an event never calls.
macro_rules! refused {
    ($($method:ident($($arg:ty),*) -> $ret:ty;)*) => {
        $(fn $method(self, $(_: $arg),*) -> Result<$ret, M::Error> {
            Self::refuse()
        })*
    };
}

impl<'a, M: SerializeMap> Serializer for Flat<'a, M> {
    type Ok = ();
    type Error = M::Error;
    type SerializeSeq = Impossible<(), M::Error>;
    type SerializeTuple = Impossible<(), M::Error>;
    type SerializeTupleStruct = Impossible<(), M::Error>;
    type SerializeTupleVariant = Impossible<(), M::Error>;
    type SerializeMap = Impossible<(), M::Error>;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    fn serialize_unit_variant(self, _: &'static str, _: u32, variant: &'static str) -> Result<(), M::Error> {
        self.0.serialize_entry(TAG, variant)
    }

    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), M::Error> {
        self.0.serialize_entry(TAG, variant)?;
        value.serialize(self)
    }

    fn serialize_struct_variant(self, _: &'static str, _: u32, variant: &'static str, _: usize) -> Result<Self, M::Error> {
        self.0.serialize_entry(TAG, variant)?;
        Ok(self)
    }

    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, M::Error> {
        Ok(self)
    }

    fn serialize_some<T: ?Sized + Serialize>(self, _: &T) -> Result<(), M::Error> {
        Self::refuse()
    }

    fn serialize_newtype_struct<T: ?Sized + Serialize>(self, _: &'static str, _: &T) -> Result<(), M::Error> {
        Self::refuse()
    }

    refused! {
        serialize_bool(bool) -> ();
        serialize_i8(i8) -> ();
        serialize_i16(i16) -> ();
        serialize_i32(i32) -> ();
        serialize_i64(i64) -> ();
        serialize_u8(u8) -> ();
        serialize_u16(u16) -> ();
        serialize_u32(u32) -> ();
        serialize_u64(u64) -> ();
        serialize_f32(f32) -> ();
        serialize_f64(f64) -> ();
        serialize_char(char) -> ();
        serialize_str(&str) -> ();
        serialize_bytes(&[u8]) -> ();
        serialize_none() -> ();
        serialize_unit() -> ();
        serialize_unit_struct(&'static str) -> ();
        serialize_seq(Option<usize>) -> Self::SerializeSeq;
        serialize_tuple(usize) -> Self::SerializeTuple;
        serialize_tuple_struct(&'static str, usize) -> Self::SerializeTupleStruct;
        serialize_tuple_variant(&'static str, u32, &'static str, usize) -> Self::SerializeTupleVariant;
        serialize_map(Option<usize>) -> Self::SerializeMap;
    }
}

/// A struct's fields, or a struct variant's, become entries of the record's map.
macro_rules! fields_into_map {
    ($($kind:ident)*) => {
        $(impl<M: SerializeMap> $kind for Flat<'_, M> {
            type Ok = ();
            type Error = M::Error;
            fn serialize_field<T: ?Sized + Serialize>(&mut self, key: &'static str, value: &T) -> Result<(), M::Error> {
                self.0.serialize_entry(key, value)
            }
            fn end(self) -> Result<(), M::Error> {
                Ok(())
            }
        })*
    };
}

fields_into_map!(SerializeStruct SerializeStructVariant);

impl<'de> Deserialize<'de> for Record {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Record, D::Error> {
        deserializer.deserialize_map(RecordVisitor)
    }
}

/// A key as read: borrowed from the line where it has no escape.
#[derive(Deserialize)]
#[serde(transparent)]
struct Key<'a>(#[serde(borrow)] Cow<'a, str>);

/// The record's own fields, wherever they are in the line.
#[derive(Default)]
struct Own {
    ts: Option<u64>,
    pid: Option<u32>,
    tid: Option<u32>,
    raw: Option<Option<String>>,
}

impl Own {
    /// Takes `key`'s value when it is one of the record's own fields; false for any other key.
    fn take<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<bool, A::Error> {
        fn once<T, E: de::Error>(slot: &mut Option<T>, value: T, key: &'static str) -> Result<bool, E> {
            match slot.replace(value) {
                Some(_) => Err(E::duplicate_field(key)),
                None => Ok(true),
            }
        }
        match key {
            "ts" => once(&mut self.ts, map.next_value()?, "ts"),
            "pid" => once(&mut self.pid, map.next_value()?, "pid"),
            "tid" => once(&mut self.tid, map.next_value()?, "tid"),
            "raw" => once(&mut self.raw, map.next_value()?, "raw"),
            _ => Ok(false),
        }
    }

    fn record<E: de::Error>(self, event: Event) -> Result<Record, E> {
        Ok(Record {
            ts: self.ts.ok_or_else(|| E::missing_field("ts"))?,
            pid: self.pid.ok_or_else(|| E::missing_field("pid"))?,
            tid: self.tid.unwrap_or(0),
            event,
            raw: self.raw.flatten(),
        })
    }
}

struct RecordVisitor;

impl<'de> Visitor<'de> for RecordVisitor {
    type Value = Record;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a trace record: an object with ts, pid and ev")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Record, A::Error> {
        let mut own = Own::default();
        // An event's fields met before its `ev`, kept in the order read until it is (the
        // variant's own reading finds a field there twice).
        let mut early = Vec::new();
        let mut tag = None;
        while let Some(Key(key)) = map.next_key()? {
            if own.take(&key, &mut map)? {
                continue;
            }
            if key != TAG {
                early.push((key.into_owned(), map.next_value::<serde_json::Value>()?));
                continue;
            }
            if tag.is_some() {
                return Err(de::Error::duplicate_field(TAG));
            }
            let Key(name) = map.next_value()?;
            if !early.is_empty() {
                tag = Some(name);
                continue;
            }
            let mut fields = RecordFields { map: &mut map, own: &mut own };
            let event = Event::deserialize(Tagged { name, fields: &mut fields })?;
            // Only a unit variant leaves fields unread: the record's own, or ones passed over.
            while fields.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            return own.record(event);
        }
        let name = tag.ok_or_else(|| de::Error::missing_field(TAG))?;
        let fields = MapDeserializer::<_, serde_json::Error>::new(early.into_iter());
        let event = Event::deserialize(Tagged { name, fields }).map_err(de::Error::custom)?;
        own.record(event)
    }
}

/// The rest of the record's map as the fields of its event: the record's own fields met among
/// them are taken aside.
struct RecordFields<'a, A> {
    map: &'a mut A,
    own: &'a mut Own,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for RecordFields<'_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        while let Some(Key(key)) = self.map.next_key()? {
            if key == TAG {
                return Err(de::Error::duplicate_field(TAG));
            }
            if !self.own.take(&key, self.map)? {
                return seed.deserialize(key.as_ref().into_deserializer()).map(Some);
            }
        }
        Ok(None)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        self.map.next_value_seed(seed)
    }
}

/// An event as its variant's name and the map of its fields: what serde's externally tagged
/// enums read.
struct Tagged<'de, M> {
    name: Cow<'de, str>,
    fields: M,
}

impl<'de, M: MapAccess<'de>> Deserializer<'de> for Tagged<'de, M> {
    type Error = M::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, M::Error> {
        visitor.visit_enum(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option
        unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier ignored_any
    }
}

impl<'de, M: MapAccess<'de>> EnumAccess<'de> for Tagged<'de, M> {
    type Error = M::Error;
    type Variant = Variant<M>;

    fn variant_seed<V: DeserializeSeed<'de>>(self, seed: V) -> Result<(V::Value, Variant<M>), M::Error> {
        let variant = seed.deserialize(self.name.as_ref().into_deserializer())?;
        Ok((variant, Variant(self.fields)))
    }
}

struct Variant<M>(M);

impl<'de, M: MapAccess<'de>> VariantAccess<'de> for Variant<M> {
    type Error = M::Error;

    fn unit_variant(self) -> Result<(), M::Error> {
        Ok(())
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, M::Error> {
        seed.deserialize(MapAccessDeserializer::new(self.0))
    }

    fn tuple_variant<V: Visitor<'de>>(self, _: usize, _: V) -> Result<V::Value, M::Error> {
        Err(de::Error::invalid_type(de::Unexpected::TupleVariant, &"an event's fields"))
    }

    fn struct_variant<V: Visitor<'de>>(self, _: &'static [&'static str], visitor: V) -> Result<V::Value, M::Error> {
        visitor.visit_map(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Alloc, Memory, Place, Seen, Via};

    fn read(line: &str) -> serde_json::Result<Record> {
        serde_json::from_str(line)
    }

    fn alloc() -> Event {
        Event::Alloc(Alloc {
            fd: 3,
            via: Via::RmAllocNvos64,
            memory: Memory::Video,
            bytes: 1 << 21,
            status: 0,
            client: 1,
            parent: 2,
            object: 3,
            class: 0x40,
            base: Some(7),
            errno: None,
            holds: None,
        })
    }

    /// The trace's line layout is a contract (docs/trace-format.md): the record's numbers, the
    /// event's name under `ev` and its fields, `raw` last.
    #[test]
    fn a_record_is_written_as_its_numbers_then_its_event_by_name() {
        let line = |r: &Record| serde_json::to_string(r).unwrap();
        assert_eq!(line(&Record::new(5, 7, 9, Event::Close { fd: 3 })), r#"{"ts":5,"pid":7,"tid":9,"ev":"close","fd":3}"#);
        assert_eq!(
            line(&Record { ts: 1, pid: 2, tid: 0, event: Event::OomKill, raw: Some("00ff".into()) }),
            r#"{"ts":1,"pid":2,"ev":"oom_kill","raw":"00ff"}"#
        );
        assert_eq!(
            line(&Record::new(1, 2, 2, alloc())),
            r#"{"ts":1,"pid":2,"tid":2,"ev":"alloc","fd":3,"via":"rm_alloc_nvos64","memory":"video","bytes":2097152,"status":0,"client":1,"parent":2,"object":3,"class":64,"base":7}"#
        );
        let place = Event::Place(Place { cgroup: "/a".into(), uid: Some(5), ..Place::default() });
        assert_eq!(line(&Record::new(1, 2, 0, place)), r#"{"ts":1,"pid":2,"ev":"place","cgroup":"/a","uid":5}"#);
    }

    #[test]
    fn every_shape_of_event_reads_back_as_written() {
        let records = [
            Record::new(5, 7, 9, Event::Close { fd: 3 }),
            Record::new(u64::MAX, u32::MAX, 0, Event::Exit { code: Some(-1) }),
            Record::new(1, 2, 2, Event::Mark { phase: "\"raw\" prefill".into() }),
            Record { ts: 1, pid: 2, tid: 3, event: Event::OomKill, raw: Some("00ff".into()) },
            Record { ts: 1, pid: 2, tid: 3, event: alloc(), raw: Some("00".into()) },
            Record::new(1, 2, 0, Event::Place(Place { cgroup: "/x".into(), ..Place::default() })),
            Record::new(0, 0, 0, Event::Process { ppid: 1, seen: Seen::Running, command: vec!["a,\"ev\":".into()] }),
        ];
        for r in &records {
            let line = serde_json::to_string(r).unwrap();
            assert_eq!(read(&line).unwrap(), *r, "{line}");
            assert_eq!(read(&reversed(&line)).unwrap(), *r, "{line}");
        }
    }

    /// A line another tool rewrote (keys sorted, the record's fields last, escapes) reads as the
    /// line gputrace wrote; a field this version does not know is passed over.
    #[test]
    fn a_line_in_another_order_reads_the_same() {
        let close = Record::new(1, 2, 0, Event::Close { fd: 3 });
        for line in [
            r#"{"pid":2,"ts":1,"ev":"close","fd":3}"#,
            r#"{"fd":3,"ev":"close","pid":2,"ts":1}"#,
            r#"{"ev":"close","fd":3,"pid":2,"ts":1}"#,
            r#"{"ts":1,"pid":2,"ev":"close","fd":3,"later":[1,{"a":2}]}"#,
            r#"{"later":null,"ts":1,"pid":2,"fd":3,"ev":"close"}"#,
            r#"{"x":1,"fd":3,"x":2,"ts":1,"pid":2,"ev":"close","x":3}"#,
            r#"{"ts":1,"pid":2,"ev":"close","fd":3,"x":1,"x":2}"#,
            r#"{"t\u0073":1,"pid":2,"\u0065v":"cl\u006fse","f\u0064":3}"#,
            r#"{"ts":1,"pid":2,"tid":0,"ev":"close","fd":3,"raw":null}"#,
        ] {
            assert_eq!(read(line).unwrap(), close, "{line}");
        }
        let with_raw = Record { ts: 1, pid: 2, tid: 7, event: Event::Close { fd: 3 }, raw: Some("00".into()) };
        for line in
            [r#"{"ts":1,"ev":"close","fd":3,"pid":2,"tid":7,"raw":"00"}"#, r#"{"raw":"00","fd":3,"tid":7,"pid":2,"ts":1,"ev":"close"}"#]
        {
            assert_eq!(read(line).unwrap(), with_raw, "{line}");
        }
        let oom = Record { ts: 1, pid: 2, tid: 0, event: Event::OomKill, raw: Some("00".into()) };
        assert_eq!(read(r#"{"ev":"oom_kill","ts":1,"extra":5,"pid":2,"raw":"00"}"#).unwrap(), oom);
        let r = Record::new(1, 2, 0, alloc());
        let sorted = r#"{"base":7,"bytes":2097152,"class":64,"client":1,"ev":"alloc","fd":3,"memory":"video","object":3,"parent":2,"pid":2,"status":0,"ts":1,"via":"rm_alloc_nvos64"}"#;
        assert_eq!(read(sorted).unwrap(), r);
    }

    /// `line`'s keys in the reverse order: the record's own fields last, `ev` after its event's.
    fn reversed(line: &str) -> String {
        let serde_json::Value::Object(map) = serde_json::from_str(line).unwrap() else { panic!("{line}") };
        let mut entries: Vec<(String, serde_json::Value)> = map.into_iter().collect();
        entries.sort_by(|a, b| b.0.cmp(&a.0));
        let text: Vec<String> = entries.iter().map(|(k, v)| format!("{}:{v}", serde_json::to_string(k).unwrap())).collect();
        format!("{{{}}}", text.join(","))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        /// Whatever the model's generator makes, and a snapshot of it, reads back as itself, as
        /// written and with its keys in another order.
        #[test]
        fn generated_records_read_back_in_any_order(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600)) {
            let records = crate::model::generate::records(&data);
            let snapshot = crate::model::Model::from_records(&records).snapshot();
            for r in records.iter().chain(&snapshot) {
                let line = serde_json::to_string(r).unwrap();
                proptest::prop_assert_eq!(&read(&line).unwrap(), r, "{}", line);
                let other = reversed(&line);
                proptest::prop_assert_eq!(&read(&other).unwrap(), r, "{}", other);
            }
        }
    }

    #[test]
    fn a_line_that_is_not_a_record_is_an_error_not_a_guess() {
        for line in [
            r#"{"ts":1,"pid":2,"ev":"close"}"#,
            r#"{"ts":1,"pid":2,"fd":3}"#,
            r#"{"pid":2,"ev":"close","fd":3}"#,
            r#"{"ts":1,"ev":"close","fd":3}"#,
            r#"{"ts":1,"pid":2,"ev":"no_such_event","fd":3}"#,
            r#"{"ts":1,"pid":2,"ev":"close","fd":3,"pid":9}"#,
            r#"{"ts":1,"pid":2,"ev":"close","ev":"close","fd":3}"#,
            r#"{"ts":1,"pid":2,"ev":"close","fd":3,"ev":"close"}"#,
            r#"{"fd":3,"fd":4,"ts":1,"pid":2,"ev":"close"}"#,
            r#"{"fd":3,"ts":1,"pid":2,"ev":"close","fd":4}"#,
            r#"{"fd":3,"ts":1,"pid":2,"ev":"close","ev":"exit"}"#,
            r#"{"ts":1,"pid":2,"ev":"oom_kill","ev":"oom_kill"}"#,
            r#"{"ts":1,"pid":99999999999,"ev":"close","fd":3}"#,
            r#"{"ts":184467440737095516150,"pid":2,"ev":"close","fd":3}"#,
            r#"{"ts":007,"pid":2,"ev":"close","fd":3}"#,
            r#"{"ts":1,"pid":2,"ev":3,"fd":3}"#,
            r#"{"ts":1,"pid":2,"ev":"close","fd":"3"}"#,
            r#"[1,2]"#,
            r#"{"ts":1,"pid":2,"ev":"close","fd":3"#,
        ] {
            assert!(read(line).is_err(), "{line} read as {:?}", read(line));
        }
    }
}
