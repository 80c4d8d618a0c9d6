//! Guarded state transitions: optimistic locking on a `status` + `version` row.

use sqlx::{Acquire, AssertSqlSafe, Encode, Postgres, Type};

/// What a transition attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transition {
    /// The row moved to the new status; `version` is its new version.
    Applied {
        /// The version after the update.
        version: i64,
    },
    /// The row is already in the requested status: a repeated request (a redelivered
    /// message, a retried HTTP call). Nothing changed; acknowledge it.
    AlreadyApplied {
        /// The row's current version.
        version: i64,
    },
    /// The row is elsewhere: the caller's version is stale, or the move is not allowed from
    /// the row's current status (backwards, a skip, or to a status no move leads to).
    Conflict {
        /// The row's current status.
        status: String,
        /// The row's current version.
        version: i64,
    },
    /// No row has this id.
    NotFound,
}

/// Why a state machine could not be declared or a transition could not be attempted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransitionError {
    /// A table or column name is not a plain SQL identifier (`[a-z_][a-z0-9_]{0,62}`).
    #[error("{0:?} is not a valid SQL identifier (lowercase letters, digits and _, at most 63)")]
    InvalidIdentifier(String),
    /// The declared transitions go backwards (a cycle).
    #[error("the transition {from} -> {to} closes a cycle: state machines here only move forward")]
    Backwards {
        /// Where the offending transition starts.
        from: String,
        /// Where it ends.
        to: String,
    },
    /// The status is not one of the machine's (no declared transition starts or ends
    /// there). A known status that no transition leads to is not this error but a
    /// [`Transition::Conflict`]: the move is forbidden, not malformed.
    #[error("{0:?} is not a status of this state machine")]
    UnknownTarget(String),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// A table's allowed status transitions, checked by the database in one statement.
///
/// `transition(id, to, expected_version)` runs
/// `UPDATE t SET status = to, version = version + 1 WHERE id = $id AND version = $expected
/// AND status IN (<statuses that may move to `to`>)`. Zero rows are told apart by reading the
/// row: [`Transition::AlreadyApplied`], [`Transition::Conflict`] or [`Transition::NotFound`].
/// Identifiers are validated once at construction and never come from requests.
///
/// ```
/// use idempotency_postgres::StateMachine;
///
/// let orders = StateMachine::builder("orders")
///     .unwrap()
///     .allow("pending", "processing")
///     .allow("processing", "shipped")
///     .allow("shipped", "completed")
///     .build()
///     .unwrap();
/// assert!(orders.can_move("pending", "processing"));
/// assert!(!orders.can_move("shipped", "pending"));
/// // "pending" is a status (moving there is forbidden); "cancelled" is not one.
/// assert!(orders.is_state("pending") && !orders.is_target("pending"));
/// assert!(!orders.is_state("cancelled"));
/// ```
#[derive(Debug, Clone)]
pub struct StateMachine {
    table: String,
    id: String,
    status: String,
    version: String,
    transitions: Vec<(String, String)>,
}

fn identifier(name: &str) -> Result<String, TransitionError> {
    let mut bytes = name.bytes();
    let valid = !name.is_empty()
        && name.len() <= 63
        && bytes
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    // Quoted, though a plain lowercase name means the same quoted: unquoted, `user`,
    // `current_user` or `current_date` are the SQL functions of that name, not the columns,
    // and a transition on `WHERE user = $1` moved every row when the id was the role's name.
    if valid {
        Ok(format!("\"{name}\""))
    } else {
        Err(TransitionError::InvalidIdentifier(name.to_owned()))
    }
}

/// Declares the transitions of a [`StateMachine`].
#[derive(Debug, Clone)]
pub struct StateMachineBuilder {
    machine: StateMachine,
}

impl StateMachine {
    /// Starts declaring the machine of `table`, with columns `id`, `status`, `version`.
    ///
    /// # Errors
    /// [`TransitionError::InvalidIdentifier`] when `table` is not a plain SQL identifier.
    pub fn builder(table: &str) -> Result<StateMachineBuilder, TransitionError> {
        Ok(StateMachineBuilder {
            machine: StateMachine {
                table: identifier(table)?,
                id: "id".into(),
                status: "status".into(),
                version: "version".into(),
                transitions: Vec::new(),
            },
        })
    }

    /// Whether `from -> to` is declared.
    pub fn can_move(&self, from: &str, to: &str) -> bool {
        self.transitions.iter().any(|(f, t)| f == from && t == to)
    }

    /// The former name of [`StateMachine::builder`].
    #[deprecated(since = "0.1.0", note = "use `StateMachine::builder`")]
    #[allow(clippy::new_ret_no_self)]
    pub fn new(table: &str) -> Result<StateMachineBuilder, TransitionError> {
        Self::builder(table)
    }

    /// Whether any declared transition leads to `to`.
    pub fn is_target(&self, to: &str) -> bool {
        self.transitions.iter().any(|(_, t)| t == to)
    }

    /// Whether `status` is one of the machine's statuses (a declared transition starts or
    /// ends there).
    pub fn is_state(&self, status: &str) -> bool {
        self.transitions
            .iter()
            .any(|(f, t)| f == status || t == status)
    }

    /// Attempts `-> to` on row `id`, expecting it at `expected_version`.
    ///
    /// `conn` is a pool, a connection or **the caller's transaction** (`&mut *tx`): in a
    /// transaction, the move commits or rolls back with the caller's own writes (an outbox
    /// row, a ledger entry), so a crash between the move and those writes cannot leave the
    /// move done and the writes lost (a repeat would answer `AlreadyApplied`). Use `READ
    /// COMMITTED` there (Postgres's default): under `REPEATABLE READ` or `SERIALIZABLE` the
    /// row is read in the transaction's snapshot, so a move another transaction committed
    /// since answers `Conflict` with the snapshot's status, or fails with a serialization
    /// error; retry the whole transaction then.
    ///
    /// A status no transition leads to (the machine's start, say) is never applied: the
    /// answer is [`Transition::Conflict`] with the row's status, or
    /// [`Transition::NotFound`].
    ///
    /// # Errors
    /// [`TransitionError::UnknownTarget`] when `to` is not a status of the machine, and
    /// [`TransitionError::Database`] when a statement fails.
    pub async fn transition<'c, I>(
        &self,
        conn: impl Acquire<'c, Database = Postgres>,
        id: I,
        to: &str,
        expected_version: i64,
    ) -> Result<Transition, TransitionError>
    where
        I: for<'q> Encode<'q, Postgres> + Type<Postgres> + Send + Clone,
    {
        let from: Vec<&str> = self
            .transitions
            .iter()
            .filter(|(_, t)| t == to)
            .map(|(f, _)| f.as_str())
            .collect();
        if !self.is_state(to) {
            return Err(TransitionError::UnknownTarget(to.to_owned()));
        }
        let (t, idc, st, ver) = (&self.table, &self.id, &self.status, &self.version);
        // Both statements on one connection: in the caller's transaction when it is one.
        let mut conn = conn.acquire().await?;
        // `::bigint`: an `integer` version column decodes too (a decoding error after the
        // row moved would report a move that was applied as a failure).
        if !from.is_empty() {
            let update = format!(
                "UPDATE {t} SET {st} = $2, {ver} = {ver} + 1 \
                 WHERE {idc} = $1 AND {ver} = $3 AND {st} = ANY($4) RETURNING {ver}::bigint"
            );
            let applied: Option<(i64,)> = sqlx::query_as(AssertSqlSafe(update))
                .bind(id.clone())
                .bind(to)
                .bind(expected_version)
                .bind(&from)
                .fetch_optional(&mut *conn)
                .await?;
            if let Some((version,)) = applied {
                return Ok(Transition::Applied { version });
            }
        }
        // Zero rows (or no move leads to `to`): read the row (a new statement, so a new
        // snapshot under READ COMMITTED) to say why.
        let read = format!("SELECT {st}::text, {ver}::bigint FROM {t} WHERE {idc} = $1");
        let row: Option<(String, i64)> = sqlx::query_as(AssertSqlSafe(read))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(match row {
            None => Transition::NotFound,
            // Only a move can have put the row there: a repeat of it.
            Some((status, version)) if status == to && !from.is_empty() => {
                Transition::AlreadyApplied { version }
            }
            Some((status, version)) => Transition::Conflict { status, version },
        })
    }
}

impl StateMachineBuilder {
    /// Renames the id, status and version columns.
    pub fn columns(
        mut self,
        id: &str,
        status: &str,
        version: &str,
    ) -> Result<Self, TransitionError> {
        self.machine.id = identifier(id)?;
        self.machine.status = identifier(status)?;
        self.machine.version = identifier(version)?;
        Ok(self)
    }

    /// Allows `from -> to`.
    pub fn allow(mut self, from: &str, to: &str) -> Self {
        self.machine
            .transitions
            .push((from.to_owned(), to.to_owned()));
        self
    }

    /// Checks the declaration: no transition may lead back to a status it came from.
    pub fn build(self) -> Result<StateMachine, TransitionError> {
        let m = &self.machine;
        // A move is backwards if `from` is reachable from `to`.
        for (from, to) in &m.transitions {
            let mut seen = vec![to.as_str()];
            let mut i = 0;
            while i < seen.len() {
                let here = seen[i];
                if here == from {
                    return Err(TransitionError::Backwards {
                        from: from.clone(),
                        to: to.clone(),
                    });
                }
                for (f, t) in &m.transitions {
                    if f == here && !seen.contains(&t.as_str()) {
                        seen.push(t);
                    }
                }
                i += 1;
            }
        }
        Ok(self.machine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated() {
        assert!(StateMachine::builder("orders").is_ok());
        for bad in [
            "",
            "Orders",
            "orders; drop table x",
            "1orders",
            "a-b",
            &"x".repeat(64),
        ] {
            assert!(StateMachine::builder(bad).is_err(), "{bad}");
        }
        assert!(
            StateMachine::builder("t")
                .unwrap()
                .columns("id", "st\"atus", "version")
                .is_err()
        );
    }

    #[test]
    fn backwards_moves_cannot_be_declared() {
        let cyclic = StateMachine::builder("t")
            .unwrap()
            .allow("a", "b")
            .allow("b", "c")
            .allow("c", "a")
            .build();
        assert!(matches!(cyclic, Err(TransitionError::Backwards { .. })));
        let self_loop = StateMachine::builder("t").unwrap().allow("a", "a").build();
        assert!(self_loop.is_err());
    }
}
