//! The conformance suite against the in-process memory store.

use std::sync::Arc;

use idempotency_core::{MemoryStore, Store};

idempotency_test::conformance_tests!(async {
    // Cases use fresh keys, so one store serves them all, as a container does for the others.
    static STORE: std::sync::OnceLock<Arc<dyn Store>> = std::sync::OnceLock::new();
    Some(STORE.get_or_init(|| Arc::new(MemoryStore::new())).clone())
});

/// A lease counts from the ask. A grant read with half its lease or less left (here all of
/// it gone: a retry could have taken the key over and be running the operation) is given
/// back, not acted on; a grant read a quarter of the lease late still runs.
#[test]
fn the_executor_gives_back_a_grant_read_late() {
    use std::{
        sync::atomic::{AtomicUsize, Ordering},
        time::Duration,
    };

    use idempotency_core::{
        Begin, Error, Executor, Fingerprint, IdempotencyKey, Policy, RecordId, RunError, Scope,
    };
    use idempotency_test::late::LateBegin;

    idempotency_test::block_on(async {
        let lease = Duration::from_millis(400);
        let (scope, fp) = (Scope::new("late"), Fingerprint::of(b"p"));
        let key = IdempotencyKey::new("k").expect("key");
        let runs = AtomicUsize::new(0);
        let op = || async { Ok::<_, &str>(runs.fetch_add(1, Ordering::SeqCst)) };
        let store = Arc::new(LateBegin::new(MemoryStore::new(), lease));
        let executor =
            Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease));

        let answer = executor.run(&scope, &key, &fp, op).await;
        assert!(
            matches!(answer, Err(RunError::Store(Error::Unavailable(_)))),
            "{answer:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the operation never ran");
        // Given back (in a task): the next claim is a fresh `Execute`, not a `TakeOver` of an
        // attempt that never ran.
        let id = RecordId::new(&scope, &key);
        for _ in 0..500 {
            if store.inner().inspect(&id).await.expect("inspect").is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(matches!(
            store.inner().begin(&id, &fp, lease).await,
            Ok(Begin::Execute(_))
        ));

        // Read a quarter of the lease late: more than half is left, so it runs.
        let other = IdempotencyKey::new("k2").expect("key");
        store.set_delay(lease / 4);
        let answer = executor.run(&scope, &other, &fp, op).await;
        assert!(answer.is_ok(), "{answer:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    });
}
