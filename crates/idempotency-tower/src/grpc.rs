//! gRPC answers `200 OK` at the HTTP level whatever happened, and carries its own status in
//! `grpc-status`: in the headers of a response that is only trailers (a call that failed
//! before any message), or in the trailers after the messages. What the store keeps is
//! decided by that status, read as the HTTP status it stands for, so that the cache rule
//! treats an `UNAVAILABLE` as the 503 it is (given back, the retry runs) rather than as the
//! 200 it travels in (stored, and replayed to every retry for the whole retention).

use http::HeaderMap;

/// The HTTP status a gRPC response stands for, for the cache rule: the `grpc-status` of
/// `headers` (a trailers-only response), else of `trailers`, mapped as `google.rpc.Code`
/// documents it. `None` for a response that is not gRPC, or whose status is not known yet
/// (its trailers have not come); `OK` stands for 200. A status that does not parse stands
/// for 500, as `UNKNOWN` does. `CANCELLED` stands for 408 rather than 499: the call was
/// given up, and what it did is not known, so it is not stored by the default rule.
///
/// ```text
/// OK 200, CANCELLED 408, UNKNOWN 500, INVALID_ARGUMENT 400, DEADLINE_EXCEEDED 504,
/// NOT_FOUND 404, ALREADY_EXISTS 409, PERMISSION_DENIED 403, RESOURCE_EXHAUSTED 429,
/// FAILED_PRECONDITION 400, ABORTED 409, OUT_OF_RANGE 400, UNIMPLEMENTED 501, INTERNAL 500,
/// UNAVAILABLE 503, DATA_LOSS 500, UNAUTHENTICATED 401
/// ```
pub(crate) fn status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<u16> {
    if !is_grpc(headers) {
        return None;
    }
    status_in(headers).or_else(|| status_in(trailers?))
}

/// The HTTP status the `grpc-status` of `fields` (a gRPC response's headers or trailers)
/// stands for (see [`status`]); `None` without one.
pub(crate) fn status_in(fields: &HeaderMap) -> Option<u16> {
    let code = fields.get("grpc-status")?;
    let code = code.to_str().ok().and_then(|c| c.trim().parse::<u8>().ok());
    Some(match code {
        Some(0) => 200,
        Some(1) => 408,
        Some(3 | 9 | 11) => 400,
        Some(4) => 504,
        Some(5) => 404,
        Some(6 | 10) => 409,
        Some(7) => 403,
        Some(8) => 429,
        Some(12) => 501,
        Some(14) => 503,
        Some(16) => 401,
        // UNKNOWN, INTERNAL, DATA_LOSS, and codes outside the list.
        _ => 500,
    })
}

/// Whether a gRPC failure, by the HTTP status it stands for ([`status`]), may have taken
/// effect: `CANCELLED` (408), `DEADLINE_EXCEEDED` (504), `UNKNOWN`, `INTERNAL` and
/// `DATA_LOSS` (500) come from a call that may have done its work (a downstream charge whose
/// answer came late). Settled as a response marked `MaybeApplied` is: kept for the
/// outcome-unknown policy, not given back. `UNAVAILABLE`, `RESOURCE_EXHAUSTED`,
/// `UNAUTHENTICATED`, `PERMISSION_DENIED`, `UNIMPLEMENTED` and `ABORTED` say the call did
/// not run (or rolled back): given back, the retry runs.
pub(crate) fn may_have_applied(http: u16) -> bool {
    matches!(http, 408 | 500 | 504)
}

/// Marks a stored gRPC outcome kept without its messages (over the stored-body limit, or
/// broken off: `why`) as a trailers-only `INTERNAL`, so that its replay fails clearly: with
/// no `grpc-status` at all, some clients (older tonic, gRPC-Web) took a replay without
/// messages for a success. Any other outcome is left as it is.
pub(crate) fn mark_not_replayable(outcome: &mut idempotency_core::Outcome, why: &str) {
    let grpc = outcome
        .headers
        .iter()
        .any(|(name, value)| name == "content-type" && grpc_content_type(value));
    if !grpc {
        return;
    }
    outcome
        .headers
        .retain(|(name, _)| name != "grpc-status" && name != "grpc-message");
    let message = format!("the idempotent replay has no messages: the response was {why}");
    outcome.headers.push(("grpc-status".into(), "13".into()));
    outcome
        .headers
        .push(("grpc-message".into(), message.into()));
    outcome.trailers.clear();
}

/// Whether a response is gRPC's (`application/grpc`, `application/grpc+proto`, gRPC-Web's
/// `application/grpc-web…`, whose trailers travel in its body: only a trailers-only
/// response's status is read there).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| grpc_content_type(v.as_bytes()))
}

/// The layer's own refusal (`response`, a problem+json it made, marked [`Refused`]: no key,
/// in flight, key reused, store unavailable, …) as the gRPC client of a request whose
/// `Content-Type` was
/// `content_type` can read it: a trailers-only response (HTTP 200) whose `grpc-status`
/// stands for it, the problem's detail in `grpc-message`, and a `Retry-After` as
/// `grpc-retry-pushback-ms`. Sent as HTTP, a gRPC client read a 409 or a 422 as `UNKNOWN`
/// ("grpc-status header missing") and a 400 as `INTERNAL`: "in flight, retry later" looked
/// like a failure of unknown effect, which its retry policy does not retry, and a client
/// that started over with a new key ran the operation twice. So is the replay of the
/// layer's marker for a call that ran but whose response could not be stored (`INTERNAL`,
/// its detail saying so). Any other response — a handler's, a replay of a stored outcome,
/// even one in problem+json — is left as it is.
///
/// ```text
/// in flight 409, store unavailable 503, a request body that
/// broke off 400                                                 UNAVAILABLE 14 (retried)
/// outcome unknown 409                                           FAILED_PRECONDITION 9
/// key reused for another request 422, no key, a malformed key
/// or request 400                                                INVALID_ARGUMENT 3
/// body too large 413                                            RESOURCE_EXHAUSTED 8
/// unauthenticated 401                                           UNAUTHENTICATED 16
/// anything else                                                 INTERNAL 13
/// ```
///
/// A key reused is not `ALREADY_EXISTS`, which create-if-absent clients take for "done":
/// the second operation would be dropped unseen.
///
/// [`Refused`]: crate::problem::Refused
pub(crate) async fn refusal_as_status(
    response: http::Response<crate::Body>,
    content_type: http::HeaderValue,
) -> http::Response<crate::Body> {
    use http_body_util::BodyExt;

    use crate::{Problem, problem::Refused};

    let Some(&Refused { problem, transient }) = response.extensions().get::<Refused>() else {
        return response;
    };
    let (parts, body) = response.into_parts();
    // A problem the layer made: a few hundred bytes, in memory.
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let code: u8 = match problem {
        _ if transient => 14,
        Problem::InFlight | Problem::StoreUnavailable => 14,
        Problem::OutcomeUnknown => 9,
        Problem::Mismatch | Problem::MissingKey | Problem::InvalidKey | Problem::InvalidRequest => {
            3
        }
        Problem::PayloadTooLarge => 8,
        Problem::Unauthenticated => 16,
        _ => 13,
    };
    let detail = json["detail"]
        .as_str()
        .unwrap_or("refused by the idempotency layer");
    let mut answer = http::Response::new(crate::full(bytes::Bytes::new()));
    let headers = answer.headers_mut();
    headers.insert(http::header::CONTENT_TYPE, content_type);
    headers.insert("grpc-status", http::HeaderValue::from(u16::from(code)));
    if let Ok(message) = http::HeaderValue::from_str(&percent_encoded(detail)) {
        headers.insert("grpc-message", message);
    }
    let seconds = parts
        .headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(seconds) = seconds {
        headers.insert(
            "grpc-retry-pushback-ms",
            http::HeaderValue::from(seconds.saturating_mul(1000)),
        );
    }
    answer
}

/// `grpc-message`'s encoding: bytes outside printable ASCII, and `%`, percent-encoded.
fn percent_encoded(message: &str) -> String {
    use std::fmt::Write as _;
    let mut encoded = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            encoded.push(char::from(byte));
        } else {
            let _ = write!(encoded, "%{byte:02X}");
        }
    }
    encoded
}

/// Whether a `Content-Type` value is gRPC's (see [`is_grpc`]).
pub(crate) fn grpc_content_type(value: &[u8]) -> bool {
    value
        .trim_ascii_start()
        .get(..16)
        .is_some_and(|start| start.eq_ignore_ascii_case(b"application/grpc"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    http::HeaderName::from_static(k),
                    http::HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn a_grpc_status_stands_for_its_http_status() {
        let grpc = headers(&[("content-type", "application/grpc")]);
        let only = |code| {
            let mut h = grpc.clone();
            h.insert("grpc-status", http::HeaderValue::from_static(code));
            status(&h, None)
        };
        assert_eq!(only("0"), Some(200));
        assert_eq!(only("14"), Some(503));
        assert_eq!(only("16"), Some(401));
        assert_eq!(only("7"), Some(403));
        assert_eq!(only("1"), Some(408));
        assert_eq!(only("5"), Some(404));
        assert_eq!(only("99"), Some(500));
        assert_eq!(only("nope"), Some(500));
        // In the trailers, when the headers have none; not known before they come.
        let trailers = headers(&[("grpc-status", "14")]);
        assert_eq!(status(&grpc, Some(&trailers)), Some(503));
        assert_eq!(status(&grpc, None), None);
        // Not gRPC: its own HTTP status decides.
        let json = headers(&[("content-type", "application/json"), ("grpc-status", "14")]);
        assert_eq!(status(&json, None), None);
        let proto = headers(&[
            ("content-type", "application/grpc+proto"),
            ("grpc-status", "4"),
        ]);
        assert_eq!(status(&proto, None), Some(504));
        assert!(is_grpc(&headers(&[(
            "content-type",
            "application/grpc-web+proto"
        )])));
        assert!(!is_grpc(&headers(&[("content-type", "application/json")])));
    }
}
