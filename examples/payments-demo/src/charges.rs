//! The charges: in Postgres when `DATABASE_URL` is set, else in memory.

use std::{collections::HashMap, sync::Mutex};

use chrono::{DateTime, SecondsFormat, Utc};
use idempotency::RecordId;
use serde::Serialize;
use sqlx::PgPool;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Charge {
    pub(crate) id: String,
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) customer: String,
    pub(crate) status: String,
    #[serde(serialize_with = "rfc3339")]
    pub(crate) created_at: DateTime<Utc>,
}

fn rfc3339<S: serde::Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&t.to_rfc3339_opts(SecondsFormat::Millis, true))
}

#[derive(Debug, Clone)]
pub(crate) struct NewCharge {
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) customer: String,
}

/// What [`Charges::create`] did for a record id.
#[derive(Debug)]
pub(crate) enum Created {
    /// Charged now.
    New(Charge),
    /// The record id had charged already, for this amount, currency and customer: the same
    /// operation (a retry after its idempotency record expired, or after a crash between the
    /// charge and the stored outcome).
    Existing(Charge),
    /// The record id had charged already, for another request: the key was reused after its
    /// record expired. Nothing was charged.
    Conflict(Charge),
}

impl Created {
    fn of_existing(charge: Charge, new: &NewCharge) -> Self {
        if charge.amount == new.amount
            && charge.currency == new.currency
            && charge.customer == new.customer
        {
            Created::Existing(charge)
        } else {
            Created::Conflict(charge)
        }
    }
}

pub(crate) enum Charges {
    Memory(Mutex<Memory>),
    Postgres(PgPool),
}

#[derive(Default)]
pub(crate) struct Memory {
    by_id: HashMap<String, Charge>,
    by_record: HashMap<RecordId, String>,
    order: Vec<String>,
}

type Row = (String, i64, String, String, String, DateTime<Utc>);

fn from_row((id, amount, currency, customer, status, created_at): Row) -> Charge {
    Charge {
        id,
        amount,
        currency,
        customer,
        status,
        created_at,
    }
}

impl Charges {
    /// Charges once per record id (the unique constraint on `record_id` decides, in
    /// Postgres). A second call for the same record charges nothing, and says whether it
    /// asked for what the first one charged: once the idempotency record's retention has
    /// ended, the layer no longer sees the key, and only the charge remembers the request.
    pub(crate) async fn create(
        &self,
        record: &RecordId,
        new: &NewCharge,
    ) -> Result<Created, sqlx::Error> {
        let id = format!("ch_{}", &uuid::Uuid::new_v4().simple().to_string()[..24]);
        match self {
            Charges::Memory(memory) => {
                let mut m = memory
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(existing) = m.by_record.get(record) {
                    return Ok(Created::of_existing(m.by_id[existing].clone(), new));
                }
                let charge = Charge {
                    id: id.clone(),
                    amount: new.amount,
                    currency: new.currency.clone(),
                    customer: new.customer.clone(),
                    status: "succeeded".into(),
                    created_at: Utc::now(),
                };
                m.by_record.insert(*record, id.clone());
                m.by_id.insert(id.clone(), charge.clone());
                m.order.push(id);
                Ok(Created::New(charge))
            }
            Charges::Postgres(pool) => {
                // A second run for one record id, what the idempotency layer exists to stop,
                // is counted (see the migration `charge_runs`) in the same statement: a run
                // stopped between an insert and a separate count went uncounted. `xmax = 0`:
                // the row was inserted, not updated.
                let (id, amount, currency, customer, status, created_at, inserted) =
                    sqlx::query_as::<_, (String, i64, String, String, String, DateTime<Utc>, bool)>(
                        "INSERT INTO charges (id, record_id, amount, currency, customer, status)
                         VALUES ($1, $2, $3, $4, $5, 'succeeded')
                         ON CONFLICT (record_id) DO UPDATE SET runs = charges.runs + 1
                         RETURNING id, amount, currency, customer, status, created_at, xmax = 0",
                    )
                .bind(&id)
                .bind(&record.as_bytes()[..])
                .bind(new.amount)
                .bind(&new.currency)
                .bind(&new.customer)
                .fetch_one(pool)
                .await?;
                let row = from_row((id, amount, currency, customer, status, created_at));
                if inserted {
                    return Ok(Created::New(row));
                }
                Ok(Created::of_existing(row, new))
            }
        }
    }

    /// The charge a record id made, if any: what an attempt that crashed after charging
    /// and before its outcome was stored left behind (the layer's reconcile hook asks).
    pub(crate) async fn by_record(&self, record: &RecordId) -> Result<Option<Charge>, sqlx::Error> {
        match self {
            Charges::Memory(memory) => {
                let m = memory
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                Ok(m.by_record.get(record).map(|id| m.by_id[id].clone()))
            }
            Charges::Postgres(pool) => Ok(sqlx::query_as::<_, Row>(
                "SELECT id, amount, currency, customer, status, created_at FROM charges WHERE record_id = $1",
            )
            .bind(&record.as_bytes()[..])
            .fetch_optional(pool)
            .await?
            .map(from_row)),
        }
    }

    /// Counts that the reconcile hook answered with charge `id` (see the migration
    /// `charge_reconciled`): the fault campaign reports such a charge that no fault explains,
    /// an outcome the layer lost that the hook rebuilt. Instrumentation, not the hook's
    /// answer: the hook runs it in a task of its own and does not wait for it.
    pub(crate) async fn count_reconciled(&self, id: &str) -> Result<(), sqlx::Error> {
        if let Charges::Postgres(pool) = self {
            sqlx::query("UPDATE charges SET reconciled = reconciled + 1 WHERE id = $1")
                .bind(id)
                .execute(pool)
                .await?;
        }
        Ok(())
    }

    pub(crate) async fn get(&self, id: &str) -> Result<Option<Charge>, sqlx::Error> {
        match self {
            Charges::Memory(memory) => {
                let m = memory.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                Ok(m.by_id.get(id).cloned())
            }
            Charges::Postgres(pool) => Ok(sqlx::query_as::<_, Row>(
                "SELECT id, amount, currency, customer, status, created_at FROM charges WHERE id = $1",
            )
            .bind(id)
            .fetch_optional(pool)
            .await?
            .map(from_row)),
        }
    }

    pub(crate) async fn list(&self, customer: Option<&str>) -> Result<Vec<Charge>, sqlx::Error> {
        match self {
            Charges::Memory(memory) => {
                let m = memory
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                Ok(m.order
                    .iter()
                    .map(|id| &m.by_id[id])
                    .filter(|c| customer.is_none_or(|want| c.customer == want))
                    .cloned()
                    .collect())
            }
            Charges::Postgres(pool) => Ok(sqlx::query_as::<_, Row>(
                "SELECT id, amount, currency, customer, status, created_at FROM charges
                 WHERE $1::text IS NULL OR customer = $1 ORDER BY created_at, id LIMIT 10000",
            )
            .bind(customer)
            .fetch_all(pool)
            .await?
            .into_iter()
            .map(from_row)
            .collect()),
        }
    }
}
