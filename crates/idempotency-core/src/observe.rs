//! What every store call reports, through the `tracing` and `metrics` facades, so an
//! application sees its stores with the subscriber and the recorder it already installed
//! (`tracing-opentelemetry`, `metrics-exporter-prometheus`, …).

use std::{future::Future, time::Instant};

use tracing::Instrument;

use crate::{Begin, Error, ForceReleased, Inspection, Result};

/// The answer of a store call, as a span field and a metric label.
pub trait Answer {
    /// A short, fixed label: `execute`, `takeover`, `replay`, `in_flight`, `mismatch`, `ok`,
    /// `lease_lost`, `unavailable`, `error`; for the operator's calls also `absent`,
    /// `completed`, `released`, `deleted`.
    fn label(&self) -> &'static str;
}

impl Answer for Result<Begin> {
    fn label(&self) -> &'static str {
        match self {
            Ok(Begin::Execute(_)) => "execute",
            Ok(Begin::TakeOver(_)) => "takeover",
            Ok(Begin::Replay(_)) => "replay",
            Ok(Begin::InFlight { .. }) => "in_flight",
            Ok(Begin::Mismatch) => "mismatch",
            Err(error) => error_label(error),
        }
    }
}

impl Answer for Result<()> {
    fn label(&self) -> &'static str {
        match self {
            Ok(()) => "ok",
            Err(error) => error_label(error),
        }
    }
}

impl Answer for Result<Option<Inspection>> {
    fn label(&self) -> &'static str {
        match self {
            Ok(None) => "absent",
            Ok(Some(record)) if record.is_completed() => "completed",
            Ok(Some(_)) => "in_flight",
            Err(error) => error_label(error),
        }
    }
}

impl Answer for Result<ForceReleased> {
    fn label(&self) -> &'static str {
        match self {
            Ok(ForceReleased::Released) => "released",
            Ok(ForceReleased::Live) => "live",
            Ok(ForceReleased::Deleted) => "deleted",
            Ok(ForceReleased::Completed) => "completed",
            Ok(ForceReleased::Absent) => "absent",
            Err(error) => error_label(error),
        }
    }
}

fn error_label(error: &Error) -> &'static str {
    match error {
        Error::LeaseLost => "lease_lost",
        Error::Unavailable(_) => "unavailable",
        _ => "error",
    }
}

/// Runs one store call inside a span `idempotency.store` (fields `store`, `operation`,
/// `answer`) and records its latency in the histogram `idempotency_store_call_seconds`
/// (labels `store`, `operation`, `answer`). The stores of this workspace call it for
/// `begin`, `complete`, `release` and `renew`; a store of your own can too.
///
/// A call dropped before it answers records no latency: its span just ends.
///
/// ```
/// use idempotency_core::{Result, observe};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let answer: Result<()> = observe("mine", "release", async { Ok(()) }).await;
/// assert!(answer.is_ok());
/// # }
/// ```
pub async fn observe<T>(
    store: &'static str,
    operation: &'static str,
    call: impl Future<Output = T>,
) -> T
where
    T: Answer,
{
    let span = tracing::debug_span!(
        "idempotency.store",
        store,
        operation,
        answer = tracing::field::Empty
    );
    let started = Instant::now();
    let result = call.instrument(span.clone()).await;
    let answer = result.label();
    span.record("answer", answer);
    metrics::histogram!(
        "idempotency_store_call_seconds",
        "store" => store,
        "operation" => operation,
        "answer" => answer
    )
    .record(started.elapsed());
    result
}
