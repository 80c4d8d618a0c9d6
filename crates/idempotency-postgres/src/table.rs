//! The key table's name, and the statements written for it.

use std::{collections::HashMap, sync::Arc};

use idempotency_core::{Error, Result};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

/// The table every statement and the migration are written for.
const DEFAULT: &str = "idempotency_keys";

/// A validated table name, optionally schema-qualified (`schema.table`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Table {
    schema: Option<String>,
    name: String,
}

impl Table {
    /// Lowercase ASCII letters, digits and `_`, not starting with a digit: what the
    /// statements write quoted (`"schema"."table"`), so reserved words are fine and nothing
    /// else needs escaping. Short enough for the index and migrations-table names derived
    /// from them (63 bytes at most), and never a name those derived tables could take.
    pub(crate) fn parse(qualified: &str) -> Result<Self> {
        let valid = |part: &str, max: usize| {
            !part.is_empty()
                && part.len() <= max
                && part.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        };
        let (schema, name) = match qualified.split_once('.') {
            Some((schema, name)) => (Some(schema), name),
            None => (None, qualified),
        };
        let invalid = |why: &str| {
            Err(Error::Config(format!(
                "invalid idempotency table name {qualified:?}: {why}"
            )))
        };
        // `{name}_migrations` and `{name}_expires_at` must fit in 63 bytes too.
        if !valid(name, 52) || schema.is_some_and(|s| !valid(s, 63)) {
            return invalid(
                "use `table` or `schema.table`, each of lowercase letters, digits and `_`, \
                 the table 52 characters at most",
            );
        }
        // Their migrations would share a table with another's (`x` and `x_migrations`,
        // `_idempotency` and the default table's `_idempotency_migrations`).
        if name.ends_with("_migrations") || name == "_idempotency" {
            return invalid("the name of a migrations table");
        }
        // Nor an index's: `x_expires_at` is table `x`'s, and whichever came first, the other
        // table went without (its purge scanning the whole table) or could not be created.
        if name.ends_with("_expires_at") {
            return invalid("the name of another table's index (`<table>_expires_at`)");
        }
        if schema.is_some_and(|s| s.starts_with("pg_")) {
            return invalid("`pg_` schemas are reserved");
        }
        Ok(Self {
            schema: schema.map(str::to_owned),
            name: name.to_owned(),
        })
    }

    pub(crate) fn is_default(&self) -> bool {
        self.schema.is_none() && self.name == DEFAULT
    }

    pub(crate) fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// `"schema"."name"` or `"name"`, as the statements write it.
    pub(crate) fn qualified(&self) -> String {
        self.qualify(&self.name)
    }

    fn qualify(&self, name: &str) -> String {
        match &self.schema {
            Some(schema) => format!("{}.{}", quoted(schema), quoted(name)),
            None => quoted(name),
        }
    }

    /// The table where the migrations applied to this one are recorded, beside it.
    pub(crate) fn migrations_table(&self) -> String {
        self.qualify(&format!("{}_migrations", self.name))
    }

    /// `sql` (written for `idempotency_keys`) for this table, in one pass over the name:
    /// `idempotency_keys_<suffix>` is an index (named after the table, unqualified: an index
    /// lives in its table's schema), any other `idempotency_keys` the table.
    pub(crate) fn rewrite(&self, sql: &str) -> String {
        let mut out = String::with_capacity(sql.len() + 32);
        let mut rest = sql;
        while let Some(at) = rest.find(DEFAULT) {
            out.push_str(&rest[..at]);
            rest = &rest[at + DEFAULT.len()..];
            if let Some(after) = rest.strip_prefix('_') {
                let end = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len());
                out.push_str(&quoted(&format!("{}_{}", self.name, &after[..end])));
                rest = &after[end..];
            } else {
                out.push_str(&self.qualified());
            }
        }
        out.push_str(rest);
        out
    }
}

/// An identifier in double quotes (callers pass validated names: no quote inside).
pub(crate) fn quoted(name: &str) -> String {
    format!("\"{name}\"")
}

impl Default for Table {
    fn default() -> Self {
        Self {
            schema: None,
            name: DEFAULT.to_owned(),
        }
    }
}

/// The store's statements for its table: the constants themselves for the default table,
/// rewritten copies (made once, at connect) for another.
#[derive(Debug, Clone, Default)]
pub(crate) struct Statements {
    rewritten: Option<Arc<HashMap<&'static str, SqlStr>>>,
}

impl Statements {
    pub(crate) fn for_table(table: &Table, all: &[&'static str]) -> Self {
        if table.is_default() {
            return Self::default();
        }
        let rewritten = all
            .iter()
            .map(|sql| (*sql, AssertSqlSafe(table.rewrite(sql)).into_sql_str()))
            .collect();
        Self {
            rewritten: Some(Arc::new(rewritten)),
        }
    }

    /// The statement `sql` (one of the store's constants) for this store's table.
    pub(crate) fn get(&self, sql: &'static str) -> SqlStr {
        match &self.rewritten {
            None => sql.into_sql_str(),
            Some(rewritten) => match rewritten.get(sql) {
                Some(rewritten) => rewritten.clone(),
                // A statement missing from `ALL_SQL` would run on the default table: caught
                // by the tests (every statement is listed), never silently in a release.
                None => {
                    debug_assert!(false, "a statement missing from ALL_SQL: {sql}");
                    sql.into_sql_str()
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(
            Table::parse("idempotency_keys")
                .expect("valid")
                .is_default()
        );
        let t = Table::parse("payments.charge_keys").expect("valid");
        assert_eq!(t.qualified(), r#""payments"."charge_keys""#);
        assert_eq!(
            t.migrations_table(),
            r#""payments"."charge_keys_migrations""#
        );
        // Reserved words are fine: the statements quote them.
        assert_eq!(
            Table::parse("user.order").expect("valid").qualified(),
            r#""user"."order""#
        );
        for bad in [
            "",
            "Keys",
            "1keys",
            "a.b.c",
            "keys; DROP TABLE x",
            "\"keys\"",
            ".keys",
            "s.",
            "keys_migrations",
            "keys_expires_at",
            "idempotency_keys_expires_at",
            "_idempotency",
            "pg_catalog.keys",
        ] {
            assert!(
                matches!(Table::parse(bad), Err(Error::Config(_))),
                "{bad:?}"
            );
        }
        assert!(Table::parse(&"k".repeat(53)).is_err());
    }

    #[test]
    fn statements_are_rewritten_for_the_table() {
        let index = "CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at)";
        for (table, expected) in [
            (
                "payments.charge_keys",
                r#"CREATE INDEX IF NOT EXISTS "charge_keys_expires_at" ON "payments"."charge_keys" (expires_at)"#,
            ),
            // The default name in another schema, or inside a longer name: one pass, so the
            // table's own name is never rewritten again.
            (
                "payments.idempotency_keys",
                r#"CREATE INDEX IF NOT EXISTS "idempotency_keys_expires_at" ON "payments"."idempotency_keys" (expires_at)"#,
            ),
            (
                "app.idempotency_keys_v2",
                r#"CREATE INDEX IF NOT EXISTS "idempotency_keys_v2_expires_at" ON "app"."idempotency_keys_v2" (expires_at)"#,
            ),
        ] {
            assert_eq!(Table::parse(table).expect("valid").rewrite(index), expected);
        }
        const SQL: &str = "DELETE FROM idempotency_keys WHERE record_id = $1";
        let t = Table::parse("payments.charge_keys").expect("valid");
        let statements = Statements::for_table(&t, &[SQL]);
        assert_eq!(
            statements.get(SQL).as_str(),
            r#"DELETE FROM "payments"."charge_keys" WHERE record_id = $1"#
        );
        assert_eq!(Statements::default().get(SQL).as_str(), SQL);
    }

    /// Every statement of the store names the table it is given, and no other.
    #[test]
    fn no_statement_keeps_the_default_table() {
        let t = Table::parse("elsewhere.keys").expect("valid");
        for sql in crate::store::ALL_SQL {
            let rewritten = t.rewrite(sql);
            assert!(!rewritten.contains(DEFAULT), "{rewritten}");
            assert!(rewritten.contains(r#""elsewhere"."keys""#), "{rewritten}");
        }
    }
}
