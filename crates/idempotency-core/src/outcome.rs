//! What a replay returns, and the one binary encoding every store shares.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The stored result of an operation: a status, headers in order (repeated names kept), the
/// body bytes, and trailers (fields sent after the body, as gRPC sends its status).
///
/// Non-HTTP users put their own status convention and serialised result in it (the
/// executor in this crate stores a serde value in the body).
///
/// ```
/// use idempotency_core::Outcome;
///
/// let outcome = Outcome::new(201)
///     .with_header("content-type", "application/json")
///     .with_header("set-cookie", "a=1")
///     .with_header("set-cookie", "b=2")
///     .with_body(r#"{"id":"ch_1"}"#);
/// let bytes = outcome.encode();
/// assert_eq!(Outcome::decode(&bytes).unwrap(), outcome);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Outcome {
    /// The status (an HTTP status code for the HTTP layer).
    pub status: u16,
    /// Header names and values in their original order; a name may repeat.
    pub headers: Vec<(String, Bytes)>,
    /// The body.
    pub body: Bytes,
    /// Trailer names and values in their original order (usually none).
    pub trailers: Vec<(String, Bytes)>,
}

/// The encoded outcome could not be read back: a store returned bytes this version does not
/// understand, or that were cut short.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("corrupt stored outcome: {0}")]
pub struct DecodeError(&'static str);

/// First byte of every encoding. A new layout takes a new number, and `decode` keeps reading
/// the old ones, so records written by the previous release replay after an upgrade.
const VERSION_1: u8 = 1;
/// Version 1 followed by trailers; written only for an outcome that has some, so that a
/// release that reads version 1 only still reads every other outcome (during a rolling
/// upgrade, it answers one with trailers as corrupt: an error, never a second run).
const VERSION_2: u8 = 2;

/// The header that marks [`Outcome::not_stored`].
pub const OUTCOME_NOT_STORED: &str = "idempotency-outcome-not-stored";

impl Outcome {
    /// What is stored in place of an outcome the store refused for good (too large for it, a
    /// constraint) while it took other writes: the operation ran, so its key must not run it
    /// again, and this marker says so to every retry. Over HTTP it replays as a `500`
    /// problem; [`Executor`](crate::Executor) answers it with [`Error::Corrupt`](crate::Error::Corrupt).
    ///
    /// ```
    /// let marker = idempotency_core::Outcome::not_stored();
    /// assert_eq!(marker.status, 500);
    /// assert!(marker.is_not_stored());
    /// assert!(!idempotency_core::Outcome::new(500).is_not_stored());
    /// ```
    pub fn not_stored() -> Self {
        Self::new(500)
            .with_header("content-type", "application/problem+json")
            .with_header(OUTCOME_NOT_STORED, "1")
            .with_body(
                r#"{"type":"urn:idempotency:problem:outcome-not-stored","title":"Outcome not stored","status":500,"detail":"The request was carried out, but its response could not be stored: this key will not carry it out again. Ask the operator what became of it."}"#,
            )
    }

    /// Whether this is [`Outcome::not_stored`]'s marker.
    pub fn is_not_stored(&self) -> bool {
        self.headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case(OUTCOME_NOT_STORED))
    }

    /// An outcome with a status and no headers or body.
    pub fn new(status: u16) -> Self {
        Self {
            status,
            ..Self::default()
        }
    }

    /// Appends a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the body.
    pub fn with_body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    /// Appends a trailer.
    ///
    /// ```
    /// use idempotency_core::Outcome;
    ///
    /// let outcome = Outcome::new(200).with_body("...").with_trailer("grpc-status", "0");
    /// assert_eq!(Outcome::decode(&outcome.encode()).unwrap(), outcome);
    /// ```
    pub fn with_trailer(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.trailers.push((name.into(), value.into()));
        self
    }

    /// Encodes as `version u8 | status u16 | fields(headers) | body_len u32 | body`, then for
    /// version 2 (an outcome with trailers) `fields(trailers)`, all big-endian, where
    /// `fields` is `n u32 | n × (name_len u16, name, value_len u32, value)`.
    pub fn encode(&self) -> Bytes {
        let fields_len = |fields: &[(String, Bytes)]| -> usize {
            4 + fields
                .iter()
                .map(|(n, v)| 6 + n.len() + v.len())
                .sum::<usize>()
        };
        let trailers = !self.trailers.is_empty();
        let len = 1
            + 2
            + fields_len(&self.headers)
            + 4
            + self.body.len()
            + if trailers {
                fields_len(&self.trailers)
            } else {
                0
            };
        let mut buf = BytesMut::with_capacity(len);
        buf.put_u8(if trailers { VERSION_2 } else { VERSION_1 });
        buf.put_u16(self.status);
        put_fields(&mut buf, &self.headers);
        buf.put_u32(self.body.len() as u32);
        buf.put_slice(&self.body);
        if trailers {
            put_fields(&mut buf, &self.trailers);
        }
        buf.freeze()
    }

    /// Decodes what [`Outcome::encode`] wrote.
    pub fn decode(mut bytes: &[u8]) -> Result<Self, DecodeError> {
        fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Result<&'a [u8], DecodeError> {
            if bytes.len() < n {
                return Err(DecodeError("truncated"));
            }
            let (head, tail) = bytes.split_at(n);
            *bytes = tail;
            Ok(head)
        }
        fn need(bytes: &[u8], n: usize) -> Result<(), DecodeError> {
            if bytes.len() < n {
                Err(DecodeError("truncated"))
            } else {
                Ok(())
            }
        }
        fn fields(bytes: &mut &[u8]) -> Result<Vec<(String, Bytes)>, DecodeError> {
            need(bytes, 4)?;
            let count = bytes.get_u32() as usize;
            // Each field takes at least 6 bytes: refuse counts the input cannot hold before
            // allocating for them.
            if count > bytes.len() / 6 {
                return Err(DecodeError("field count exceeds input"));
            }
            let mut fields = Vec::with_capacity(count);
            for _ in 0..count {
                need(bytes, 2)?;
                let name_len = bytes.get_u16() as usize;
                let name = std::str::from_utf8(take(bytes, name_len)?)
                    .map_err(|_| DecodeError("field name is not UTF-8"))?
                    .to_owned();
                need(bytes, 4)?;
                let value_len = bytes.get_u32() as usize;
                let value = Bytes::copy_from_slice(take(bytes, value_len)?);
                fields.push((name, value));
            }
            Ok(fields)
        }
        need(bytes, 1)?;
        let version = bytes.get_u8();
        if version != VERSION_1 && version != VERSION_2 {
            return Err(DecodeError("unknown encoding version"));
        }
        need(bytes, 2)?;
        let status = bytes.get_u16();
        let headers = fields(&mut bytes)?;
        need(bytes, 4)?;
        let body_len = bytes.get_u32() as usize;
        let body = Bytes::copy_from_slice(take(&mut bytes, body_len)?);
        let trailers = match version {
            VERSION_2 => fields(&mut bytes)?,
            _ => Vec::new(),
        };
        if !bytes.is_empty() {
            return Err(DecodeError("trailing bytes"));
        }
        Ok(Self {
            status,
            headers,
            body,
            trailers,
        })
    }
}

/// `n u32 | n × (name_len u16, name, value_len u32, value)`.
fn put_fields(buf: &mut BytesMut, fields: &[(String, Bytes)]) {
    buf.put_u32(fields.len() as u32);
    for (name, value) in fields {
        buf.put_u16(name.len() as u16);
        buf.put_slice(name.as_bytes());
        buf.put_u32(value.len() as u32);
        buf.put_slice(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_binary_and_repeated_headers() {
        let body: Vec<u8> = (0..=255u8).cycle().take(1 << 20).collect();
        let outcome = Outcome::new(200)
            .with_header("x-a", &b"\x00\xff"[..])
            .with_header("x-a", "second")
            .with_body(body);
        assert_eq!(Outcome::decode(&outcome.encode()).unwrap(), outcome);
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        let good = Outcome::new(201)
            .with_header("a", "b")
            .with_body("c")
            .encode();
        for cut in 0..good.len() {
            assert!(Outcome::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        assert!(Outcome::decode(&[2, 0, 200]).is_err());
        assert!(Outcome::decode(&[3, 0, 200, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(Outcome::decode(&[1, 0, 200, 0xff, 0xff, 0xff, 0xff]).is_err());
        let trailed = Outcome::new(200).with_trailer("t", "1").encode();
        for cut in 0..trailed.len() {
            assert!(Outcome::decode(&trailed[..cut]).is_err(), "cut at {cut}");
        }
    }

    /// Without trailers the encoding is version 1, byte for byte what the releases before
    /// trailers wrote and read; with them, version 2.
    #[test]
    fn trailers_take_version_2_and_nothing_else_does() {
        let plain = Outcome::new(201).with_header("a", "b").with_body("c");
        assert_eq!(
            &plain.encode()[..],
            &[
                1, 0, 201, 0, 0, 0, 1, 0, 1, b'a', 0, 0, 0, 1, b'b', 0, 0, 0, 1, b'c'
            ][..]
        );
        let trailed = plain.with_trailer("grpc-status", "0");
        let bytes = trailed.encode();
        assert_eq!(bytes[0], 2);
        assert_eq!(Outcome::decode(&bytes).unwrap(), trailed);
    }
}
