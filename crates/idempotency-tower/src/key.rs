//! Reading the `Idempotency-Key` header.

use http::{HeaderMap, HeaderName};
use idempotency_core::{IdempotencyKey, KeyError};

/// The header's name (lowercase, as `http` stores it).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header saying until when a stored outcome replays, as an HTTP-date (RFC
/// 9110 §5.6.7, like `Expires`), on first responses and replays when the layer is told to
/// ([`IdempotencyLayer::advertise_expiry`](crate::IdempotencyLayer::advertise_expiry)).
///
/// Not (yet) in the IETF draft: the working group discusses advertising the retention
/// (ietf-wg-httpapi/idempotency issues #35 and #49). An absolute date rather than a
/// duration, so a response that spent time in transit or in a client's queue still says the
/// truth, and so a replay needs no arithmetic.
pub const IDEMPOTENCY_EXPIRES: &str = "idempotency-expires";

/// Why a request's key was refused (400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyProblem {
    Multiple,
    Invalid(String),
}

/// Reads the key: one header line holding an RFC 8941 sf-string (`"abc-1"`), or a bare
/// value as most clients send it (`abc-1`), both naming the same key. Lists, parameters,
/// other item types and repeated header lines are refused.
pub(crate) fn parse(
    headers: &HeaderMap,
    name: &HeaderName,
) -> Result<Option<IdempotencyKey>, KeyProblem> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyProblem::Multiple);
    }
    parse_value(value.as_bytes()).map(Some)
}

/// Reads an `Idempotency-Key` header value as the layer reads it: an RFC 8941 sf-string
/// (`"order-42"`, the IETF draft's form) or a bare value (`order-42`) name the same key,
/// surrounding whitespace trimmed; a list, parameters, another item type, or a bare value
/// holding a space are refused. For tools that take a key an operator copied from a request
/// log (the admin routes read the key in their path so): the record the layer wrote for a
/// request is the record of `RecordId::new(&scope, &parse_key(value)?)`.
///
/// ```
/// use idempotency_tower::parse_key;
///
/// assert_eq!(parse_key(b"\"order-42\"").unwrap(), parse_key(b"order-42").unwrap());
/// assert_eq!(parse_key(b"order-42").unwrap().as_str(), "order-42");
/// assert!(parse_key(b"a, b").is_err());
/// ```
///
/// # Errors
/// [`InvalidKey`], saying why, when the layer would answer such a header 400.
pub fn parse_key(value: &[u8]) -> Result<IdempotencyKey, InvalidKey> {
    parse_value(value).map_err(|problem| match problem {
        KeyProblem::Invalid(why) => InvalidKey(why),
        KeyProblem::Multiple => InvalidKey("more than one key".to_owned()),
    })
}

/// Why a value is not an idempotency key ([`parse_key`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidKey(String);

impl std::fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidKey {}

pub(crate) fn parse_value(raw: &[u8]) -> Result<IdempotencyKey, KeyProblem> {
    let invalid = |why: &str| KeyProblem::Invalid(why.to_owned());
    let trimmed = raw.trim_ascii();
    if trimmed.first() == Some(&b'"') {
        let item = sfv::Parser::new(trimmed)
            .parse_item::<sfv::Item>()
            .map_err(|e| KeyProblem::Invalid(format!("not a structured-field string: {e}")))?;
        if !item.params.is_empty() {
            return Err(invalid("parameters are not allowed on the key"));
        }
        return match item.bare_item {
            sfv::BareItem::String(s) => IdempotencyKey::new(s.as_str()).map_err(key_error),
            _ => Err(invalid("the key must be a string")),
        };
    }
    // A bare key. A comma means a list (two keys): refuse it rather than pick one.
    if trimmed.contains(&b',') {
        return Err(invalid(
            "a list of keys is not allowed; send exactly one key",
        ));
    }
    // Nor is a bare value with a space a key (`a b` is no structured field): a key holding
    // spaces is sent as an sf-string, quoted.
    if trimmed.contains(&b' ') {
        return Err(invalid(
            "a key holding spaces must be sent quoted, as a structured-field string",
        ));
    }
    IdempotencyKey::from_bytes(trimmed).map_err(key_error)
}

#[allow(clippy::needless_pass_by_value)] // used as `map_err(key_error)`
fn key_error(error: KeyError) -> KeyProblem {
    KeyProblem::Invalid(error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_and_bare_name_one_key() {
        let quoted = parse_value(br#""abc-1""#).unwrap();
        let bare = parse_value(b"abc-1").unwrap();
        assert_eq!(quoted, bare);
        assert_eq!(
            parse_value(b"8e03978e-40d5-43e8").unwrap().as_str(),
            "8e03978e-40d5-43e8"
        );
    }

    #[test]
    fn refuses_what_is_not_one_key() {
        for bad in [
            &b""[..],
            b"\"\"",
            b"a b",
            b"a, b",
            b"\"a\", \"b\"",
            b"\"a\";p=1",
            b"\"a\" b",
            b"\"unterminated",
            b"\xff",
        ] {
            assert!(
                parse_value(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(parse_value("x".repeat(256).as_bytes()).is_err());
        assert!(parse_value("x".repeat(255).as_bytes()).is_ok());
    }

    #[test]
    fn a_bare_value_is_a_key_even_if_it_looks_like_another_item() {
        // `?1` is an sf-boolean, but clients send keys bare: a bare value is the key.
        assert_eq!(parse_value(b"?1").unwrap().as_str(), "?1");
    }

    #[test]
    fn a_quoted_key_may_hold_spaces() {
        // An sf-string holds 0x20..=0x7e: "order 42" is a key the draft allows.
        assert_eq!(parse_value(br#""order 42""#).unwrap().as_str(), "order 42");
        assert!(parse_value(b"order 42").is_err(), "bare, it must be quoted");
        assert!(parse_value(br#"" padded""#).is_err());
    }

    #[test]
    fn escapes_in_strings_are_decoded() {
        assert_eq!(parse_value(br#""a\"b""#).unwrap().as_str(), "a\"b");
    }
}
