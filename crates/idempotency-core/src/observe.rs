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
        let elapsed = started.elapsed();
        let histogram = match call_key(this.store, this.operation, answer) {
            Some(key) => metrics::with_recorder(|r| r.register_histogram(key, &METADATA)),
            None => metrics::histogram!(
                CALL_SECONDS,
                "store" => *this.store,
                "operation" => *this.operation,
                "answer" => answer
            ),
        };
        histogram.record(elapsed);
        Poll::Ready(result)
    }
}

const CALL_SECONDS: &str = "idempotency_store_call_seconds";

/// What `metrics::histogram!` would give the recorder here.
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// Distinct (store, operation, answer) keys kept; beyond them (a store of one's own with
/// many names) a key is built per call, as the macro does.
const MAX_KEYS: usize = 256;

/// The histogram's key for one (store, operation, answer), made once and kept. Built per
/// call, as `metrics::histogram!` with labels does, it is a `Vec` allocated, hashed and
/// freed on every store call, recorder or not. Each thread keeps the keys it used (no lock
/// to find one); the keys themselves are made once per process.
fn call_key(
    store: &'static str,
    operation: &'static str,
    answer: &'static str,
) -> Option<&'static metrics::Key> {
    type Keys = Vec<(
        &'static str,
        &'static str,
        &'static str,
        &'static metrics::Key,
    )>;
    fn find(keys: &Keys, s: &str, o: &str, a: &str) -> Option<&'static metrics::Key> {
        keys.iter()
            .find(|k| k.0 == s && k.1 == o && k.2 == a)
            .map(|k| k.3)
    }
    static MADE: std::sync::Mutex<Keys> = std::sync::Mutex::new(Vec::new());
    thread_local! {
        static USED: std::cell::RefCell<Keys> = const { std::cell::RefCell::new(Vec::new()) };
    }
    // `try_with`: a call answered while the thread is being torn down (its locals gone) must
    // not panic here, after the store committed its answer; it builds its key instead.
    USED.try_with(|used| {
        if let Some(key) = find(&used.borrow(), store, operation, answer) {
            return Some(key);
        }
        let mut made = MADE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = match find(&made, store, operation, answer) {
            Some(key) => key,
            None if made.len() >= MAX_KEYS => return None,
            None => {
                let labels: &'static [metrics::Label] = Box::leak(Box::new([
                    metrics::Label::from_static_parts("store", store),
                    metrics::Label::from_static_parts("operation", operation),
                    metrics::Label::from_static_parts("answer", answer),
                ]));
                let key: &'static metrics::Key = Box::leak(Box::new(
                    metrics::Key::from_static_parts(CALL_SECONDS, labels),
                ));
                made.push((store, operation, answer, key));
                key
            }
        };
        used.borrow_mut().push((store, operation, answer, key));
        Some(key)
    })
    .ok()
    .flatten()
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

    /// The latency goes to the recorder the application installed, under the histogram's
    /// name and the call's three labels — the same key whether made once or per call.
    #[test]
    fn a_call_is_recorded_under_its_store_operation_and_answer() {
        use std::sync::{Arc, Mutex};

        use metrics::{
            Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString,
            Unit,
        };

        /// Name, labels, value.
        type Seen = (String, Vec<(String, String)>, f64);
        #[derive(Default)]
        struct Keys(Mutex<Vec<Seen>>);
        struct Record(Arc<Keys>, Key);
        impl HistogramFn for Record {
            fn record(&self, value: f64) {
                let labels = self.1.labels();
                let labels = labels.map(|l| (l.key().to_owned(), l.value().to_owned()));
                let name = self.1.name().to_owned();
                let mut seen = self.0.0.lock().unwrap();
                seen.push((name, labels.collect(), value));
            }
        }
        struct Recording(Arc<Keys>);
        impl Recorder for Recording {
            fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
                Counter::noop()
            }
            fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
                Gauge::noop()
            }
            fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
                Histogram::from_arc(Arc::new(Record(self.0.clone(), key.clone())))
            }
        }

        let seen = Arc::new(Keys::default());
        let recorder = Recording(seen.clone());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        metrics::with_local_recorder(&recorder, || {
            runtime.block_on(async {
                for _ in 0..2 {
                    let _: Result<()> = observe("mine", "release", async { Ok(()) }).await;
                }
                let _: Result<()> = observe("mine", "renew", async { Err(Error::LeaseLost) }).await;
            });
        });
        let seen = seen.0.lock().unwrap();
        let labels = |op: &str, answer: &str| {
            vec![
                ("store".to_owned(), "mine".to_owned()),
                ("operation".to_owned(), op.to_owned()),
                ("answer".to_owned(), answer.to_owned()),
            ]
        };
        let got: Vec<_> = seen
            .iter()
            .map(|(n, l, _)| (n.as_str(), l.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (CALL_SECONDS, labels("release", "ok")),
                (CALL_SECONDS, labels("release", "ok")),
                (CALL_SECONDS, labels("renew", "lease_lost")),
            ]
        );
        assert!(seen.iter().all(|(_, _, seconds)| *seconds >= 0.0));
    }

    #[tokio::test]
    async fn an_observed_call_answers_what_the_call_answered() {
        let answer: Result<()> = observe("mine", "release", async { Err(Error::LeaseLost) }).await;
        assert!(matches!(answer, Err(Error::LeaseLost)));
    }
}
