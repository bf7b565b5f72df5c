//! Decoding with bounds: postcard under a serde deserializer that limits how deep a
//! message nests and how many bytes of sequence elements it builds.
//!
//! postcard decodes recursive types (`Command::Held` holds a `Box<Command>`,
//! `Error::TxnFailed` a `Box<Error>`, openraft's errors a chain of sources) by recursing
//! once per level, before any type of ours could look at the depth: a crafted frame of a
//! few hundred kilobytes nested 100 000 deep overflowed a replica's stack and killed the
//! process (`replica/tests/bounds.rs`). And a sequence costs far more in memory than on
//! the wire: a `Noop` command is one byte and a `Command` value about a hundred, so a
//! 64 MiB peer frame of them would have built gigabytes. [`from_bytes`] wraps postcard's
//! deserializer in one that counts both as it goes and stops with a typed error
//! ([`Error::LimitExceeded`]) the moment either passes its limit, so neither the stack
//! nor the heap follows the input.
//!
//! Depth counts every compound value entered (a struct, an enum's variant, a sequence, a
//! map, an `Option`'s `Some`, a newtype): the deepest message we send is an
//! AppendEntries carrying a batch of held writes, about 12 levels; [`DEPTH_MAX`] is 48.
//! Element bytes count `size_of` of every sequence element and map entry decoded (the
//! memory a `Vec` of them takes), and a sequence's announced length is never trusted for
//! a preallocation beyond what the input could hold (serde caps it at 1 MiB besides).
//! Strings and byte strings are not counted: they are copies of input bytes.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess};
use serde::de::{VariantAccess, Visitor};
use serde::Deserialize;

use crate::error::{Bound, Error};

/// Deepest nesting [`from_bytes`] accepts by default: four times the deepest message the
/// service sends (about 12 levels: an AppendEntries carrying a batch of held writes), and
/// shallow enough that decoding at this depth uses a few tens of kilobytes of stack.
pub const DEPTH_MAX: usize = 48;

/// Bytes of sequence elements decoding a frame may build, at most, as a multiple of the
/// frame's cap ([`Limits::for_frame`]).
pub const ELEMENT_BYTES_PER_FRAME_BYTE: usize = 4;

/// [`Limits::for_frame`] lets a frame build more than its own cap only up to this: a client
/// frame (4 MiB) 16 MiB, a peer frame (64 MiB) its own 64 MiB. The largest messages the
/// service sends build far less: an `AckInvalidationsBatch` of 10 000 sessions with 64 ids
/// each about 5 MiB, a 4 MiB snapshot chunk 4 MiB (a byte per byte), an AppendEntries of
/// 300 entries a few hundred kilobytes (a batch of 512 `CreateSession`s, each naming its
/// owner in a few dozen bytes, builds under 64 KiB: a sequence can cost many times its
/// encoding, so the bound is absolute, not a ratio to the bytes received).
pub const ELEMENT_BYTES_OVER_FRAME_MAX: usize = 16 * 1024 * 1024;

/// What one decode may build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Deepest nesting of compound values.
    pub depth_max: usize,
    /// Most bytes of sequence elements and map entries (`size_of` each).
    pub element_bytes_max: usize,
}

impl Limits {
    /// The limits for a frame whose cap is `frame_bytes_max`: [`DEPTH_MAX`], and
    /// [`ELEMENT_BYTES_PER_FRAME_BYTE`] times the cap in element bytes but never more than
    /// the larger of the cap and [`ELEMENT_BYTES_OVER_FRAME_MAX`].
    pub fn for_frame(frame_bytes_max: usize) -> Limits {
        Limits {
            depth_max: DEPTH_MAX,
            element_bytes_max: frame_bytes_max
                .saturating_mul(ELEMENT_BYTES_PER_FRAME_BYTE)
                .min(frame_bytes_max.max(ELEMENT_BYTES_OVER_FRAME_MAX)),
        }
    }
}

/// Decodes `bytes` as postcard within `limits`. Returns the value and the element bytes
/// it built. A bound passed gives [`Error::LimitExceeded`], anything else that does not
/// decode [`Error::Malformed`]. Trailing bytes are ignored, as `postcard::from_bytes`
/// ignores them.
pub fn from_bytes<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
    limits: Limits,
) -> Result<(T, usize), Error> {
    let state = State {
        limits,
        input_len: bytes.len(),
        depth: Cell::new(0),
        elements: Cell::new(0),
        exceeded: Cell::new(None),
    };
    #[cfg(feature = "raft")]
    crate::command::nesting_reset();
    let mut de = postcard::Deserializer::from_bytes(bytes);
    let r = T::deserialize(Limited {
        de: &mut de,
        st: &state,
    });
    match r {
        Ok(v) => Ok((v, state.elements.get())),
        Err(e) => {
            if let Some((bound, limit)) = state.exceeded.get() {
                return Err(Error::LimitExceeded { bound, limit });
            }
            #[cfg(feature = "raft")]
            if let Some(limit) = crate::command::nesting_exceeded() {
                return Err(Error::LimitExceeded {
                    bound: Bound::CommandNesting,
                    limit,
                });
            }
            Err(Error::Malformed {
                reason: e.to_string(),
            })
        }
    }
}

struct State {
    limits: Limits,
    input_len: usize,
    depth: Cell<usize>,
    elements: Cell<usize>,
    exceeded: Cell<Option<(Bound, u64)>>,
}

impl State {
    fn enter<E: de::Error>(&self) -> Result<DepthGuard<'_>, E> {
        let d = self.depth.get() + 1;
        if d > self.limits.depth_max {
            self.exceeded
                .set(Some((Bound::NestingDepth, self.limits.depth_max as u64)));
            return Err(E::custom("nesting too deep"));
        }
        self.depth.set(d);
        Ok(DepthGuard(self))
    }

    fn charge<E: de::Error>(&self, bytes: usize) -> Result<(), E> {
        // A zero-sized element costs nothing on the wire either: charge one byte so a
        // sequence of them is bounded too.
        let total = self.elements.get().saturating_add(bytes.max(1));
        if total > self.limits.element_bytes_max {
            self.exceeded.set(Some((
                Bound::DecodedBytes,
                self.limits.element_bytes_max as u64,
            )));
            return Err(E::custom("message builds too many bytes"));
        }
        self.elements.set(total);
        Ok(())
    }

    /// A sequence's announced length, as far as a preallocation may trust it: every
    /// element takes at least a byte of input (serde then caps it at 1 MiB as well).
    fn hint(&self, n: Option<usize>) -> Option<usize> {
        n.map(|n| n.min(self.input_len))
    }
}

struct DepthGuard<'s>(&'s State);

impl Drop for DepthGuard<'_> {
    fn drop(&mut self) {
        self.0.depth.set(self.0.depth.get() - 1);
    }
}

/// The deserializer wrapper: every value it hands out is visited by [`LimitedVisitor`].
struct Limited<'s, D> {
    de: D,
    st: &'s State,
}

/// `visitor`, wrapped to charge what it builds to the limits of the decode `st` tracks.
fn limited<V>(st: &State, visitor: V, counted: bool) -> LimitedVisitor<'_, V> {
    LimitedVisitor {
        v: visitor,
        st,
        counted,
    }
}

/// `counted`: the value is a sequence or map whose elements are charged (not a struct or
/// tuple, which postcard also visits as a sequence, of fields inside their parent's size).
struct LimitedVisitor<'s, V> {
    v: V,
    st: &'s State,
    counted: bool,
}

struct LimitedSeed<'s, S> {
    seed: S,
    st: &'s State,
}

struct LimitedSeq<'s, A> {
    a: A,
    st: &'s State,
    counted: bool,
}

struct LimitedMap<'s, A> {
    a: A,
    st: &'s State,
}

struct LimitedEnum<'s, A> {
    a: A,
    st: &'s State,
}

struct LimitedVariant<'s, A> {
    a: A,
    st: &'s State,
}

macro_rules! forward {
    ($($name:ident),* $(,)?) => {
        $(
            fn $name<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
                self.de.$name(LimitedVisitor { v: visitor, st: self.st, counted: true })
            }
        )*
    };
}

impl<'de, 's, D: Deserializer<'de>> Deserializer<'de> for Limited<'s, D> {
    type Error = D::Error;

    forward!(
        deserialize_any,
        deserialize_bool,
        deserialize_i8,
        deserialize_i16,
        deserialize_i32,
        deserialize_i64,
        deserialize_i128,
        deserialize_u8,
        deserialize_u16,
        deserialize_u32,
        deserialize_u64,
        deserialize_u128,
        deserialize_f32,
        deserialize_f64,
        deserialize_char,
        deserialize_str,
        deserialize_string,
        deserialize_bytes,
        deserialize_byte_buf,
        deserialize_option,
        deserialize_unit,
        deserialize_seq,
        deserialize_map,
        deserialize_identifier,
        deserialize_ignored_any,
    );

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        let v = limited(self.st, visitor, false);
        self.de.deserialize_unit_struct(name, v)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        let v = limited(self.st, visitor, false);
        self.de.deserialize_newtype_struct(name, v)
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        let v = limited(self.st, visitor, false);
        self.de.deserialize_tuple(len, v)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        let v = limited(self.st, visitor, false);
        self.de.deserialize_tuple_struct(name, len, v)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        let v = limited(self.st, visitor, false);
        self.de.deserialize_struct(name, fields, v)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        let v = limited(self.st, visitor, false);
        self.de.deserialize_enum(name, variants, v)
    }

    fn is_human_readable(&self) -> bool {
        self.de.is_human_readable()
    }
}

macro_rules! visit_scalar {
    ($($name:ident: $ty:ty),* $(,)?) => {
        $(
            fn $name<E: de::Error>(self, x: $ty) -> Result<Self::Value, E> {
                self.v.$name(x)
            }
        )*
    };
}

impl<'de, 's, V: Visitor<'de>> Visitor<'de> for LimitedVisitor<'s, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.v.expecting(f)
    }

    visit_scalar!(
        visit_bool: bool,
        visit_i8: i8,
        visit_i16: i16,
        visit_i32: i32,
        visit_i64: i64,
        visit_i128: i128,
        visit_u8: u8,
        visit_u16: u16,
        visit_u32: u32,
        visit_u64: u64,
        visit_u128: u128,
        visit_f32: f32,
        visit_f64: f64,
        visit_char: char,
        visit_str: &str,
        visit_string: String,
        visit_bytes: &[u8],
        visit_byte_buf: Vec<u8>,
    );

    fn visit_borrowed_str<E: de::Error>(self, x: &'de str) -> Result<Self::Value, E> {
        self.v.visit_borrowed_str(x)
    }

    fn visit_borrowed_bytes<E: de::Error>(self, x: &'de [u8]) -> Result<Self::Value, E> {
        self.v.visit_borrowed_bytes(x)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.v.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.v.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let _g = self.st.enter()?;
        self.v.visit_some(Limited { de: d, st: self.st })
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let _g = self.st.enter()?;
        self.v.visit_newtype_struct(Limited { de: d, st: self.st })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, a: A) -> Result<Self::Value, A::Error> {
        let _g = self.st.enter()?;
        self.v.visit_seq(LimitedSeq {
            a,
            st: self.st,
            counted: self.counted,
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, a: A) -> Result<Self::Value, A::Error> {
        let _g = self.st.enter()?;
        self.v.visit_map(LimitedMap { a, st: self.st })
    }

    fn visit_enum<A: EnumAccess<'de>>(self, a: A) -> Result<Self::Value, A::Error> {
        let _g = self.st.enter()?;
        self.v.visit_enum(LimitedEnum { a, st: self.st })
    }
}

impl<'de, 's, S: DeserializeSeed<'de>> DeserializeSeed<'de> for LimitedSeed<'s, S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.seed.deserialize(Limited { de: d, st: self.st })
    }
}

impl<'de, 's, A: SeqAccess<'de>> SeqAccess<'de> for LimitedSeq<'s, A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Self::Error> {
        let next = self
            .a
            .next_element_seed(LimitedSeed { seed, st: self.st })?;
        if self.counted && next.is_some() {
            self.st.charge(std::mem::size_of::<T::Value>())?;
        }
        Ok(next)
    }

    fn size_hint(&self) -> Option<usize> {
        self.st.hint(self.a.size_hint())
    }
}

impl<'de, 's, A: MapAccess<'de>> MapAccess<'de> for LimitedMap<'s, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        let next = self.a.next_key_seed(LimitedSeed { seed, st: self.st })?;
        if next.is_some() {
            self.st.charge(std::mem::size_of::<K::Value>())?;
        }
        Ok(next)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let v = self.a.next_value_seed(LimitedSeed { seed, st: self.st })?;
        self.st.charge(std::mem::size_of::<V::Value>())?;
        Ok(v)
    }

    fn size_hint(&self) -> Option<usize> {
        self.st.hint(self.a.size_hint())
    }
}

impl<'de, 's, A: EnumAccess<'de>> EnumAccess<'de> for LimitedEnum<'s, A> {
    type Error = A::Error;
    type Variant = LimitedVariant<'s, A::Variant>;

    fn variant_seed<V: DeserializeSeed<'de>>(
        self,
        seed: V,
    ) -> Result<(V::Value, Self::Variant), Self::Error> {
        let st = self.st;
        let (v, a) = self.a.variant_seed(LimitedSeed { seed, st })?;
        Ok((v, LimitedVariant { a, st }))
    }
}

impl<'de, 's, A: VariantAccess<'de>> VariantAccess<'de> for LimitedVariant<'s, A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), Self::Error> {
        self.a.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(
        self,
        seed: T,
    ) -> Result<T::Value, Self::Error> {
        self.a
            .newtype_variant_seed(LimitedSeed { seed, st: self.st })
    }

    fn tuple_variant<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        let v = limited(self.st, visitor, false);
        self.a.tuple_variant(len, v)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        let v = limited(self.st, visitor, false);
        self.a.struct_variant(fields, v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Op, Request, WatchKind, WatchSpec};

    #[test]
    fn decodes_what_postcard_decodes() {
        let req = Request {
            session: 9,
            request_id: 3,
            ack_below: 1,
            op: Op::Rewatch {
                watches: vec![WatchSpec {
                    path: "/a/b".into(),
                    kind: WatchKind::Children,
                    since_index: 77,
                }],
            },
        };
        let bytes = postcard::to_allocvec(&req).unwrap();
        let (back, elements): (Request, usize) =
            from_bytes(&bytes, Limits::for_frame(1024)).unwrap();
        assert_eq!(back, req);
        assert_eq!(elements, std::mem::size_of::<WatchSpec>());
    }

    /// `Option<Option<...>>` nests one level per `Some` byte: 100 000 of them overflowed
    /// no stack here because the depth stops them at [`DEPTH_MAX`].
    #[test]
    fn deep_nesting_is_a_typed_error() {
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Deep(Option<Box<Deep>>);
        let bytes = vec![1u8; 100_000];
        let r = from_bytes::<Deep>(&bytes, Limits::for_frame(bytes.len()));
        assert_eq!(
            r.unwrap_err(),
            Error::LimitExceeded {
                bound: Bound::NestingDepth,
                limit: DEPTH_MAX as u64
            }
        );
    }

    /// A sequence of one-byte elements that are large in memory stops at the element
    /// bound, and its announced length (a billion) preallocates nothing near it.
    #[cfg(feature = "raft")]
    #[test]
    fn element_bytes_are_bounded() {
        let mut bytes = vec![0x80, 0x94, 0xeb, 0xdc, 0x03]; // varint 1_000_000_000
        bytes.extend(std::iter::repeat_n(0u8, 10_000)); // Noop, Noop, ...
        let limits = Limits {
            depth_max: DEPTH_MAX,
            element_bytes_max: 64 * 1024,
        };
        let r = from_bytes::<Vec<crate::command::Command>>(&bytes, limits);
        assert_eq!(
            r.unwrap_err(),
            Error::LimitExceeded {
                bound: Bound::DecodedBytes,
                limit: 64 * 1024
            }
        );
        // Within the bound it decodes.
        let mut ok = vec![100u8];
        ok.extend(std::iter::repeat_n(0u8, 100));
        let (v, built) = from_bytes::<Vec<crate::command::Command>>(&ok, limits).unwrap();
        assert_eq!(v.len(), 100);
        assert_eq!(built, 100 * std::mem::size_of::<crate::command::Command>());
    }

    #[test]
    fn garbage_is_malformed() {
        let r = from_bytes::<Request>(&[0xff, 0xff, 0xff], Limits::for_frame(3));
        assert!(matches!(r, Err(Error::Malformed { .. })), "{r:?}");
    }
}
