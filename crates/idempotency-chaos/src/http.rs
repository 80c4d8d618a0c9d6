//! One HTTP/1.1 request per connection, so that giving up on a request really hangs up:
//! dropping the future closes the socket, as a client timeout does (the hyper client of
//! `idempotency-test`).

pub(crate) use idempotency_test::http::{NoReply, Reply, send};
