//! Orders: a guarded state machine (status + version), in Postgres or in memory.

use std::{collections::HashMap, sync::Mutex};

use idempotency::{
    RecordId,
    postgres::{StateMachine, Transition, TransitionError},
};
use serde::Serialize;
use sqlx::PgPool;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Order {
    pub(crate) id: String,
    pub(crate) customer: String,
    pub(crate) amount: i64,
    pub(crate) status: String,
    pub(crate) version: i64,
}

/// The only forward path, declared once.
pub(crate) fn machine() -> StateMachine {
    StateMachine::builder("orders")
        .and_then(|m| {
            m.allow("pending", "processing")
                .allow("processing", "shipped")
                .allow("shipped", "completed")
                .build()
        })
        .unwrap_or_else(|e| unreachable!("the order machine is declared statically: {e}"))
}

/// What [`Orders::create`] did for a record id.
#[derive(Debug)]
pub(crate) enum Placed {
    /// Created now.
    New(Order),
    /// The record id had created an order already, for this customer and amount: the same
    /// operation (a retry after its idempotency record expired, or after a crash between the
    /// insert and the stored outcome). The order as it is now, transitions included.
    Existing(Order),
    /// The record id had created an order already, for another request: the key was reused
    /// after its record expired. Nothing was created.
    Conflict(Order),
}

impl Placed {
    fn of_existing(order: Order, customer: &str, amount: i64) -> Self {
        if order.customer == customer && order.amount == amount {
            Placed::Existing(order)
        } else {
            Placed::Conflict(order)
        }
    }
}

pub(crate) enum Orders {
    Memory(Mutex<Memory>),
    Postgres(PgPool, StateMachine),
}

#[derive(Default)]
pub(crate) struct Memory {
    by_id: HashMap<String, Order>,
    by_record: HashMap<RecordId, String>,
}

type Row = (String, String, i64, String, i64);

fn from_row((id, customer, amount, status, version): Row) -> Order {
    Order {
        id,
        customer,
        amount,
        status,
        version,
    }
}

impl Orders {
    /// Creates the order once per record id (the unique constraint on `record_id` decides, in
    /// Postgres). A second call for the same record creates nothing, and says whether it
    /// asked for what the first one created: once the idempotency record's retention has
    /// ended, the layer no longer sees the key, and only the order remembers the request.
    pub(crate) async fn create(
        &self,
        record: &RecordId,
        customer: &str,
        amount: i64,
    ) -> Result<Placed, sqlx::Error> {
        let id = format!("ord_{}", &uuid::Uuid::new_v4().simple().to_string()[..24]);
        match self {
            Orders::Memory(m) => {
                let mut m = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(existing) = m.by_record.get(record) {
                    return Ok(Placed::of_existing(
                        m.by_id[existing].clone(),
                        customer,
                        amount,
                    ));
                }
                let order = Order {
                    id: id.clone(),
                    customer: customer.into(),
                    amount,
                    status: "pending".into(),
                    version: 1,
                };
                m.by_record.insert(*record, id.clone());
                m.by_id.insert(id, order.clone());
                Ok(Placed::New(order))
            }
            Orders::Postgres(pool, _) => {
                let inserted: Option<Row> = sqlx::query_as(
                    "INSERT INTO orders (id, record_id, customer, amount, status, version)
                     VALUES ($1, $2, $3, $4, 'pending', 1) ON CONFLICT (record_id) DO NOTHING
                     RETURNING id, customer, amount, status, version",
                )
                .bind(&id)
                .bind(&record.as_bytes()[..])
                .bind(customer)
                .bind(amount)
                .fetch_optional(pool)
                .await?;
                if let Some(row) = inserted {
                    return Ok(Placed::New(from_row(row)));
                }
                let existing: Row = sqlx::query_as(
                    "SELECT id, customer, amount, status, version FROM orders WHERE record_id = $1",
                )
                .bind(&record.as_bytes()[..])
                .fetch_one(pool)
                .await?;
                Ok(Placed::of_existing(from_row(existing), customer, amount))
            }
        }
    }

    pub(crate) async fn get(&self, id: &str) -> Result<Option<Order>, sqlx::Error> {
        match self {
            Orders::Memory(m) => Ok(m
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .by_id
                .get(id)
                .cloned()),
            Orders::Postgres(pool, _) => Ok(sqlx::query_as::<_, Row>(
                "SELECT id, customer, amount, status, version FROM orders WHERE id = $1",
            )
            .bind(id)
            .fetch_optional(pool)
            .await?
            .map(from_row)),
        }
    }

    /// Moves the order to `to` if it is at `expected` and the move is allowed.
    pub(crate) async fn transition(
        &self,
        id: &str,
        to: &str,
        expected: i64,
    ) -> Result<Transition, TransitionError> {
        match self {
            Orders::Memory(m) => {
                let mut m = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let machine = machine();
                let Some(order) = m.by_id.get_mut(id) else {
                    return Ok(Transition::NotFound);
                };
                // As the Postgres machine answers: a status no move leads to is never
                // "already applied", only forbidden.
                Ok(if order.status == to && machine.is_target(to) {
                    Transition::AlreadyApplied {
                        version: order.version,
                    }
                } else if order.version == expected && machine.can_move(&order.status, to) {
                    order.status = to.into();
                    order.version += 1;
                    Transition::Applied {
                        version: order.version,
                    }
                } else {
                    Transition::Conflict {
                        status: order.status.clone(),
                        version: order.version,
                    }
                })
            }
            Orders::Postgres(pool, machine) => machine.transition(pool, id, to, expected).await,
        }
    }
}
