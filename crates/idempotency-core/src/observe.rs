//! What every store call reports, through the `tracing` and `metrics` facades, so an
//! application sees its stores with the subscriber and the recorder it already installed
//! (`tracing-opentelemetry`, `metrics-exporter-prometheus`, …).

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Instant,
};

use tracing::{Instrument, instrument::Instrumented};

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
pub fn observe<F>(store: &'static str, operation: &'static str, call: F) -> Observed<F>
where
    F: Future,
    F::Output: Answer,
{
    let span = tracing::debug_span!(
        "idempotency.store",
        store,
        operation,
        answer = tracing::field::Empty
    );
    Observed {
        call: call.instrument(span),
        store,
        operation,
        started: None,
    }
}

pin_project_lite::pin_project! {
    /// The future [`observe`] returns: the call, held once (an `async fn` would keep its
    /// future argument beside the future it awaits, twice the bytes, copied on every move).
    #[must_use = "futures do nothing unless polled"]
    pub struct Observed<F> {
        #[pin]
        call: Instrumented<F>,
        store: &'static str,
        operation: &'static str,
        // Read when the call is first polled: the latency of the call, not of the queue
        // before it.
        started: Option<Instant>,
    }
}

impl<F> std::fmt::Debug for Observed<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observed")
            .field("store", &self.store)
            .field("operation", &self.operation)
            .finish_non_exhaustive()
    }
}

impl<F> Future for Observed<F>
where
    F: Future,
    F::Output: Answer,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let mut this = self.project();
        let started = *this.started.get_or_insert_with(Instant::now);
        let result = ready!(this.call.as_mut().poll(cx));
        let answer = result.label();
        this.call.span().record("answer", answer);
        metrics::histogram!(
            "idempotency_store_call_seconds",
            "store" => *this.store,
            "operation" => *this.operation,
            "answer" => answer
        )
        .record(started.elapsed());
        Poll::Ready(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store call's future holds its whole state machine; `observe` must hold it once.
    /// (An `async fn` keeps its future argument beside the future it awaits: twice the
    /// bytes, copied on every move — rust-lang/rust#62958.)
    #[test]
    fn observing_a_call_adds_little_to_its_future() {
        let call = async {
            let state = [7u8; 4096];
            tokio::task::yield_now().await;
            std::hint::black_box(&state);
            Ok::<(), Error>(())
        };
        let bare = std::mem::size_of_val(&call);
        let observed = observe("mine", "release", call);
        let size = std::mem::size_of_val(&observed);
        assert!(
            size < bare + 256,
            "observe made a {bare}-byte future {size} bytes"
        );
    }

    #[tokio::test]
    async fn an_observed_call_answers_what_the_call_answered() {
        let answer: Result<()> = observe("mine", "release", async { Err(Error::LeaseLost) }).await;
        assert!(matches!(answer, Err(Error::LeaseLost)));
    }
}
