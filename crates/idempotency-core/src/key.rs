//! What identifies a record: the client's key, the scope it belongs to, and the record id.

use std::fmt;

use sha2::{Digest, Sha256};

/// The longest key accepted, as the IETF draft and most providers do.
pub const MAX_KEY_LEN: usize = 255;

/// A client-supplied `Idempotency-Key`: 1 to 255 printable ASCII characters
/// (`0x20..=0x7e`, what an RFC 8941 sf-string holds, as the IETF draft's key is), neither
/// the first nor the last a space (transports trim them).
///
/// Validated on construction, so every key a store sees is well formed.
///
/// ```
/// use idempotency_core::IdempotencyKey;
///
/// let key = IdempotencyKey::new("8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap();
/// assert_eq!(key.as_str().len(), 36);
/// assert!(IdempotencyKey::new("").is_err());
/// assert!(IdempotencyKey::new("order 42").is_ok());
/// assert!(IdempotencyKey::new(" padded").is_err());
/// assert!(IdempotencyKey::new("tab\there").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a string is not a valid [`IdempotencyKey`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error("the idempotency key is {len} characters long; at most {MAX_KEY_LEN} are allowed")]
    TooLong {
        /// The length of the rejected key.
        len: usize,
    },
    /// The key holds a byte outside printable ASCII, or starts or ends with a space.
    #[error(
        "the idempotency key holds a character outside printable ASCII, or a space at its \
         start or end, at position {position}"
    )]
    InvalidCharacter {
        /// Zero-based byte position of the first offending character.
        position: usize,
    },
}

impl IdempotencyKey {
    /// Validates and wraps a key.
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        Self::validate(key.as_bytes())?;
        Ok(Self(key))
    }

    /// Validates raw bytes (for example a header value) and wraps them as a key.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        Self::validate(bytes)?;
        // Printable ASCII is valid UTF-8.
        Ok(Self(String::from_utf8_lossy(bytes).into_owned()))
    }

    fn validate(bytes: &[u8]) -> Result<(), KeyError> {
        if bytes.is_empty() {
            return Err(KeyError::Empty);
        }
        if bytes.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: bytes.len() });
        }
        if let Some(position) = bytes.iter().position(|b| !(0x20..=0x7e).contains(b)) {
            return Err(KeyError::InvalidCharacter { position });
        }
        if bytes[0] == b' ' {
            return Err(KeyError::InvalidCharacter { position: 0 });
        }
        if bytes[bytes.len() - 1] == b' ' {
            return Err(KeyError::InvalidCharacter {
                position: bytes.len() - 1,
            });
        }
        Ok(())
    }

    /// The key as sent by the client.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

// Keys are secrets of a sort (guessable keys let one client replay another's outcome inside a
// scope), so Debug shows a short hash, never the key.
impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let digest = Sha256::digest(self.0.as_bytes());
        write!(f, "IdempotencyKey(sha256:{})", hex::encode(&digest[..6]))
    }
}

/// Who a key belongs to: a tenant, account or authenticated principal.
///
/// Two scopes never see each other's records: the same key sent by two accounts names two
/// records. Use [`Scope::global`] only for single-tenant APIs.
///
/// ```
/// use idempotency_core::Scope;
///
/// let scope = Scope::new("acct_123");
/// assert_eq!(scope.as_str(), "acct_123");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope(String);

impl Scope {
    /// A scope named by any string (the string is hashed, never stored).
    pub fn new(scope: impl Into<String>) -> Self {
        Self(scope.into())
    }

    /// The single shared scope: every client shares one key space. Only for single-tenant APIs.
    pub fn global() -> Self {
        Self(String::new())
    }

    /// The scope's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The id a store indexes a record by: `SHA-256(scope, 0x00, key)`.
///
/// The `0x00` separator cannot occur in a key, so `("ab", "c")` and `("a", "bc")` differ.
/// Stores keep only this id, never the raw key.
///
/// ```
/// use idempotency_core::{IdempotencyKey, RecordId, Scope};
///
/// let key = IdempotencyKey::new("k1").unwrap();
/// let a = RecordId::new(&Scope::new("tenant-a"), &key);
/// let b = RecordId::new(&Scope::new("tenant-b"), &key);
/// assert_ne!(a, b);
/// assert_eq!(a.to_hex().len(), 64);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordId([u8; 32]);

impl RecordId {
    /// Derives the record id of `key` within `scope`.
    pub fn new(scope: &Scope, key: &IdempotencyKey) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(scope.0.as_bytes());
        hasher.update([0u8]);
        hasher.update(key.0.as_bytes());
        Self(hasher.finalize().into())
    }

    /// Wraps 32 bytes read back from a store.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes of the id.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, as used in Redis keys and logs.
    pub fn to_hex(&self) -> String {
        let mut out = String::with_capacity(64);
        self.write_hex(&mut out);
        out
    }

    /// Appends [`to_hex`](Self::to_hex) to `out`, without an allocation of its own (the
    /// Redis store builds a key per call with it).
    ///
    /// ```
    /// use idempotency_core::{IdempotencyKey, RecordId, Scope};
    ///
    /// let id = RecordId::new(&Scope::global(), &IdempotencyKey::new("k-1").unwrap());
    /// let mut key = String::from("idem:");
    /// id.write_hex(&mut key);
    /// assert_eq!(key, format!("idem:{}", id.to_hex()));
    /// ```
    pub fn write_hex(&self, out: &mut String) {
        let mut buf = [0u8; 64];
        // Neither can fail; if one ever did, an empty id would make every key the same key,
        // so it must not pass silently.
        hex::encode_to_slice(self.0, &mut buf).expect("64 bytes hold 32 bytes in hex");
        out.push_str(std::str::from_utf8(&buf).expect("hex digits are ASCII"));
    }
}

impl fmt::Debug for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordId({})", self.to_hex())
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_ids_print_as_lowercase_hex_of_their_bytes() {
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37) ^ 0xa5;
        }
        let id = RecordId::from_bytes(bytes);
        let expected: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(id.to_hex(), expected);
        assert_eq!(id.to_string(), expected);
        let mut appended = String::from("p:");
        id.write_hex(&mut appended);
        assert_eq!(appended, format!("p:{expected}"));
    }

    #[test]
    fn keys_are_bounded_printable_ascii() {
        assert!(IdempotencyKey::new("a").is_ok());
        assert!(IdempotencyKey::new("order 42").is_ok());
        assert_eq!(
            IdempotencyKey::new(" a"),
            Err(KeyError::InvalidCharacter { position: 0 })
        );
        assert_eq!(
            IdempotencyKey::new("a "),
            Err(KeyError::InvalidCharacter { position: 1 })
        );
        assert!(IdempotencyKey::new("~!\"#").is_ok());
        assert!(IdempotencyKey::new("x".repeat(255)).is_ok());
        assert_eq!(
            IdempotencyKey::new("x".repeat(256)),
            Err(KeyError::TooLong { len: 256 })
        );
        assert_eq!(IdempotencyKey::new(""), Err(KeyError::Empty));
        assert_eq!(
            IdempotencyKey::new("ab\tc"),
            Err(KeyError::InvalidCharacter { position: 2 })
        );
        assert_eq!(
            IdempotencyKey::from_bytes(&[b'a', 0xff]),
            Err(KeyError::InvalidCharacter { position: 1 })
        );
    }

    #[test]
    fn record_id_separates_scope_and_key() {
        let id1 = RecordId::new(&Scope::new("ab"), &IdempotencyKey::new("c").unwrap());
        let id2 = RecordId::new(&Scope::new("a"), &IdempotencyKey::new("bc").unwrap());
        assert_ne!(id1, id2);
    }

    #[test]
    fn debug_never_shows_the_raw_key() {
        let key = IdempotencyKey::new("secret-key-123").unwrap();
        assert!(!format!("{key:?}").contains("secret"));
    }
}
