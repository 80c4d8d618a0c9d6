//! What makes two requests "the same".

use std::fmt;

use sha2::{Digest, Sha256};

/// SHA-256 over the parts of a request that make two requests "the same".
///
/// A retry with the same key and the same fingerprint gets the stored outcome; the same key
/// with a different fingerprint is a client bug and gets `Mismatch` (422 over HTTP), because
/// replaying the first outcome to a different request would lie to the client.
///
/// Build one with [`Fingerprint::builder`]. Every part is written with its tag and length, so
/// moving bytes from one part to the next changes the fingerprint.
///
/// ```
/// use idempotency_core::Fingerprint;
///
/// let a = Fingerprint::builder().method("POST").path_and_query("/charges").body(b"{}").finish();
/// let b = Fingerprint::builder().method("POST").path_and_query("/charges").body(b"{}").finish();
/// let c = Fingerprint::builder().method("POST").path_and_query("/charges").body(b"{ }").finish();
/// assert_eq!(a, b);
/// assert_ne!(a, c);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Starts a fingerprint.
    pub fn builder() -> FingerprintBuilder {
        FingerprintBuilder {
            hasher: Sha256::new(),
        }
    }

    /// A fingerprint of opaque bytes, for callers that hash their own canonical form
    /// (a message payload, a command's serialised arguments).
    pub fn of(bytes: &[u8]) -> Self {
        Self::builder().body(bytes).finish()
    }

    /// Wraps 32 bytes read back from a store.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes of the fingerprint.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, as the admin view shows it.
    pub fn to_hex(&self) -> String {
        hex::encode(self.as_bytes())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..8]))
    }
}

/// Incrementally hashes the parts of a request. See [`Fingerprint`].
#[derive(Clone)]
pub struct FingerprintBuilder {
    hasher: Sha256,
}

impl fmt::Debug for FingerprintBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FingerprintBuilder").finish_non_exhaustive()
    }
}

impl FingerprintBuilder {
    fn part(mut self, tag: u8, bytes: &[u8]) -> Self {
        self.hasher.update([tag]);
        self.hasher.update((bytes.len() as u64).to_be_bytes());
        self.hasher.update(bytes);
        self
    }

    /// Adds the request method.
    pub fn method(self, method: &str) -> Self {
        self.part(b'M', method.as_bytes())
    }

    /// Adds the path and query as sent.
    pub fn path_and_query(self, path_and_query: &str) -> Self {
        self.part(b'P', path_and_query.as_bytes())
    }

    /// Adds one header. Names are compared case-insensitively; add headers in a fixed order.
    pub fn header(self, name: &str, value: &[u8]) -> Self {
        self.part(b'H', name.to_ascii_lowercase().as_bytes())
            .part(b'V', value)
    }

    /// Adds the body (or a canonical form of it).
    pub fn body(self, body: &[u8]) -> Self {
        self.part(b'B', body)
    }

    /// Adds any other part the application considers significant.
    pub fn extra(self, bytes: &[u8]) -> Self {
        self.part(b'X', bytes)
    }

    /// Finishes the hash.
    pub fn finish(self) -> Fingerprint {
        Fingerprint(self.hasher.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_length_delimited() {
        let a = Fingerprint::builder()
            .path_and_query("/a")
            .body(b"bc")
            .finish();
        let b = Fingerprint::builder()
            .path_and_query("/ab")
            .body(b"c")
            .finish();
        assert_ne!(a, b);
    }

    #[test]
    fn header_names_ignore_case() {
        let a = Fingerprint::builder().header("X-Tenant", b"1").finish();
        let b = Fingerprint::builder().header("x-tenant", b"1").finish();
        assert_eq!(a, b);
    }
}
