//! Proto3-JSON helpers: bytes as base64, integers as numbers or strings, enums
//! as names or numbers, and `null` meaning the default.

use std::fmt;

use base64::Engine;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use bytes::Bytes;
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Standard alphabet, padded on output, padding optional on input.
const STANDARD: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// A proto `bytes` value: standard base64 in JSON. Input may also use the
/// URL-safe alphabet, as proto3-JSON parsers must accept.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct B64(pub Bytes);

impl fmt::Debug for B64 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "B64({:?})", String::from_utf8_lossy(&self.0))
    }
}

impl B64 {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<Vec<u8>> for B64 {
    fn from(v: Vec<u8>) -> Self {
        B64(v.into())
    }
}

impl From<&[u8]> for B64 {
    fn from(v: &[u8]) -> Self {
        B64(Bytes::copy_from_slice(v))
    }
}

impl From<Bytes> for B64 {
    fn from(v: Bytes) -> Self {
        B64(v)
    }
}

pub fn b64_encode(data: &[u8]) -> String {
    STANDARD.encode(data)
}

pub fn b64_decode(text: &str) -> Result<Vec<u8>, base64::DecodeError> {
    if text.contains(['-', '_']) {
        STANDARD.decode(text.replace('-', "+").replace('_', "/"))
    } else {
        STANDARD.decode(text)
    }
}

impl Serialize for B64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&b64_encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for B64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = Option::<String>::deserialize(d)?.unwrap_or_default();
        b64_decode(&text)
            .map(B64::from)
            .map_err(|e| de::Error::custom(format!("invalid base64: {e}")))
    }
}

/// `#[serde(deserialize_with = "null_default")]`: JSON `null` is the default.
pub fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Integers arrive as JSON numbers or decimal strings (proto3 JSON allows both).
struct IntVisitor;

impl Visitor<'_> for IntVisitor {
    type Value = i128;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an integer or a decimal string")
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<i128, E> {
        Ok(v.into())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<i128, E> {
        Ok(v.into())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<i128, E> {
        if v.fract() == 0.0 && v.abs() < 1e19 {
            Ok(v as i128)
        } else {
            Err(E::custom(format!("{v} is not an integer")))
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<i128, E> {
        v.trim()
            .parse()
            .map_err(|_| E::custom(format!("{v:?} is not an integer")))
    }

    fn visit_unit<E: de::Error>(self) -> Result<i128, E> {
        Ok(0)
    }
}

fn int_in_range<'de, D: Deserializer<'de>, T: TryFrom<i128>>(d: D) -> Result<T, D::Error> {
    let v = d.deserialize_any(IntVisitor)?;
    T::try_from(v).map_err(|_| de::Error::custom(format!("{v} is out of range")))
}

/// Serde `with` module for u32 fields: emitted as numbers, read from either.
pub mod u32_flex {
    use super::*;

    pub fn serialize<S: Serializer>(v: &u32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(*v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        int_in_range(d)
    }
}

/// Serde `with` module for i32/sint32 fields.
pub mod i32_flex {
    use super::*;

    pub fn serialize<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i32(*v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
        int_in_range(d)
    }
}

/// Serde `with` module for int64 fields: emitted as strings, as proto3 JSON does.
pub mod i64_string {
    use super::*;

    pub fn serialize<S: Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        int_in_range(d)
    }
}

/// Serde `with` module for uint64 fields: emitted as strings.
pub mod u64_string {
    use super::*;

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        int_in_range(d)
    }
}

/// Reads a proto enum given by name or by number.
pub fn deserialize_enum<'de, D, T>(
    d: D,
    what: &'static str,
    from_name: fn(&str) -> Option<T>,
    from_number: fn(i32) -> Option<T>,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NameOrNumber {
        Name(String),
        Number(i64),
    }
    match Option::<NameOrNumber>::deserialize(d)? {
        Some(NameOrNumber::Name(n)) => {
            from_name(&n).ok_or_else(|| de::Error::custom(format!("unknown {what} {n:?}")))
        }
        Some(NameOrNumber::Number(n)) => i32::try_from(n)
            .ok()
            .and_then(from_number)
            .ok_or_else(|| de::Error::custom(format!("unknown {what} {n}"))),
        None => from_number(0).ok_or_else(|| de::Error::custom(format!("{what} is null"))),
    }
}

/// Declares a proto enum: emitted as its name, read from its name or number,
/// defaulting to the first (zero) variant.
///
/// ```
/// envd_proto::proto_enum! {
///     /// Doc.
///     pub enum Color "color" {
///         Unspecified = 0 => "COLOR_UNSPECIFIED",
///         Red = 1 => "COLOR_RED",
///     }
/// }
/// assert_eq!(Color::from_number(1), Some(Color::Red));
/// ```
#[macro_export]
macro_rules! proto_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident $what:literal {
            $first:ident = $first_num:literal => $first_str:literal
            $(, $variant:ident = $num:literal => $str:literal)* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
        $vis enum $name {
            #[default]
            $first,
            $($variant,)*
        }

        impl $name {
            pub fn as_str(self) -> &'static str {
                match self {
                    $name::$first => $first_str,
                    $($name::$variant => $str,)*
                }
            }

            pub fn number(self) -> i32 {
                match self {
                    $name::$first => $first_num,
                    $($name::$variant => $num,)*
                }
            }

            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $first_str => Some($name::$first),
                    $($str => Some($name::$variant),)*
                    _ => None,
                }
            }

            pub fn from_number(n: i32) -> Option<Self> {
                match n {
                    $first_num => Some($name::$first),
                    $($num => Some($name::$variant),)*
                    _ => None,
                }
            }

            pub fn is_default(&self) -> bool {
                *self == $name::$first
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                $crate::json::deserialize_enum(d, $what, $name::from_name, $name::from_number)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Serialize, Deserialize, PartialEq, Default)]
    struct Nums {
        #[serde(default, with = "u32_flex")]
        a: u32,
        #[serde(default, with = "i32_flex")]
        b: i32,
        #[serde(default, with = "i64_string")]
        c: i64,
        #[serde(default, deserialize_with = "null_default")]
        d: Vec<String>,
        #[serde(default)]
        e: B64,
    }

    crate::proto_enum! {
        enum Fruit "fruit" {
            Unspecified = 0 => "FRUIT_UNSPECIFIED",
            Apple = 7 => "FRUIT_APPLE",
        }
    }

    #[test]
    fn integers_from_numbers_or_strings() {
        let n: Nums =
            serde_json::from_str(r#"{"a":"42","b":-3,"c":"-9000000000","d":null,"e":"aGk="}"#)
                .unwrap();
        assert_eq!(
            n,
            Nums {
                a: 42,
                b: -3,
                c: -9_000_000_000,
                d: vec![],
                e: B64::from(&b"hi"[..]),
            }
        );
        assert_eq!(
            serde_json::to_string(&n).unwrap(),
            r#"{"a":42,"b":-3,"c":"-9000000000","d":[],"e":"aGk="}"#
        );
        assert!(serde_json::from_str::<Nums>(r#"{"a":-1}"#).is_err());
        assert!(serde_json::from_str::<Nums>(r#"{"a":4294967296}"#).is_err());
        assert!(serde_json::from_str::<Nums>(r#"{"a":1.5}"#).is_err());
        assert_eq!(serde_json::from_str::<Nums>(r#"{"a":3.0}"#).unwrap().a, 3);
    }

    #[test]
    fn base64_accepts_unpadded_and_url_safe() {
        for text in ["+/8=", "+/8", "-_8=", "-_8"] {
            let b: B64 = serde_json::from_str(&format!("\"{text}\"")).unwrap();
            assert_eq!(&b.0[..], &[0xfb, 0xff], "{text}");
        }
        assert!(serde_json::from_str::<B64>("\"***\"").is_err());
        assert!(serde_json::from_str::<B64>("null").unwrap().is_empty());
    }

    #[test]
    fn enums_by_name_or_number() {
        assert_eq!(
            serde_json::from_str::<Fruit>("\"FRUIT_APPLE\"").unwrap(),
            Fruit::Apple
        );
        assert_eq!(serde_json::from_str::<Fruit>("7").unwrap(), Fruit::Apple);
        assert_eq!(
            serde_json::from_str::<Fruit>("null").unwrap(),
            Fruit::Unspecified
        );
        assert!(serde_json::from_str::<Fruit>("\"FRUIT_PEAR\"").is_err());
        assert!(serde_json::from_str::<Fruit>("8").is_err());
        assert_eq!(
            serde_json::to_string(&Fruit::Apple).unwrap(),
            "\"FRUIT_APPLE\""
        );
        assert_eq!(Fruit::Apple.number(), 7);
        assert!(Fruit::default().is_default());
    }
}
