//! `dedup claims`: one claim, all of them, purging the expired, on any
//! store (its admin functions do the SQL).

use dedup_core::DedupKey;
use dedup_core::admin::{ClaimRecord, ScopeSummary, TableSize};
use serde_json::json;

use crate::store::Claims as Table;
use crate::time::{human_seconds, rfc3339};
use crate::{Database, Failure, Report};

/// The claims table of one database.
pub(crate) struct Claims {
    table: Table,
    raw_table: String,
}

impl Claims {
    pub(crate) async fn connect(db: &Database) -> Result<Self, Failure> {
        Ok(Claims {
            table: Table::open(&db.database_url, &db.table).await?,
            raw_table: db.table.clone(),
        })
    }

    /// The key as the store keeps it (long ids digested).
    pub(crate) fn key(scope: &str, id: &str) -> Result<DedupKey, Failure> {
        DedupKey::new(scope, id).map_err(|e| Failure::new(format!("--scope/--key: {e}")))
    }

    /// Whether `key` holds a live claim now.
    pub(crate) async fn is_live(&self, key: &DedupKey) -> Result<bool, Failure> {
        let row = self.record(key).await?;
        Ok(row.is_some_and(|r| r.live()))
    }

    /// The claim of `key`, live or expired, if one is stored.
    pub(crate) async fn record(&self, key: &DedupKey) -> Result<Option<ClaimRecord>, Failure> {
        self.table
            .claim(key)
            .await
            .map_err(|e| Failure::new(format!("reading the claim: {e}")))
    }

    pub(crate) async fn get(&self, scope: &str, id: &str) -> Result<ClaimReport, Failure> {
        let key = Self::key(scope, id)?;
        let row = self.record(&key).await?;
        Ok(ClaimReport {
            key,
            given: id.to_owned(),
            row,
            released: false,
        })
    }

    pub(crate) async fn release(&self, scope: &str, id: &str) -> Result<ClaimReport, Failure> {
        let key = Self::key(scope, id)?;
        let row = self.table.release(&key).await.map_err(|e| {
            Failure::new(format!(
                "deleting the claim: {e} (a transaction still holding it? try again)"
            ))
        })?;
        let Some(row) = row else {
            return Err(Failure::new(format!(
                "no claim for scope {scope:?} and key {id:?} in {:?}: nothing released (check \
                 the scope, which defaults to the handler's module::path::function)",
                self.raw_table
            )));
        };
        Ok(ClaimReport {
            key,
            given: id.to_owned(),
            row: Some(row),
            released: true,
        })
    }

    pub(crate) async fn stats(&self) -> Result<StatsReport, Failure> {
        let scopes = self
            .table
            .scopes()
            .await
            .map_err(|e| Failure::new(format!("counting claims: {e}")))?;
        let size = self
            .table
            .size()
            .await
            .map_err(|e| Failure::new(format!("reading the table's size: {e}")))?;
        Ok(StatsReport {
            table: self.raw_table.clone(),
            scopes,
            size,
        })
    }

    pub(crate) async fn purge(&self, batch_size: u32) -> Result<PurgeReport, Failure> {
        let expired = self
            .table
            .expired()
            .await
            .map_err(|e| Failure::new(format!("counting expired claims: {e}")))?;
        let bar = indicatif::ProgressBar::new(expired);
        let started = std::time::Instant::now();
        let (mut deleted, mut batches) = (0u64, 0u64);
        loop {
            let n =
                self.table.purge(batch_size).await.map_err(|e| {
                    Failure::new(format!("purging: {e} ({deleted} deleted so far)"))
                })?;
            deleted += n;
            batches += 1;
            bar.inc(n);
            if n < u64::from(batch_size) {
                break;
            }
        }
        bar.finish_and_clear();
        Ok(PurgeReport {
            deleted,
            batches,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// What a claim means for a redelivery of its event, as read.
pub(crate) fn state(row: &ClaimRecord) -> String {
    if row.in_progress && row.live() {
        format!(
            "lease in progress, ends in {}",
            human_seconds(row.expires_in_seconds())
        )
    } else if row.live() {
        format!(
            "live, expires in {}: a redelivery is skipped",
            human_seconds(row.expires_in_seconds())
        )
    } else {
        format!(
            "expired {} ago: a redelivery would apply the event again",
            human_seconds(-row.expires_in_seconds())
        )
    }
}

/// `claims get` and `claims release`.
pub(crate) struct ClaimReport {
    key: DedupKey,
    given: String,
    row: Option<ClaimRecord>,
    released: bool,
}

impl Report for ClaimReport {
    fn text(&self) -> String {
        let mut out = String::new();
        let Some(row) = &self.row else {
            return format!("no claim for {}\n", self.key);
        };
        let verb = if self.released { "released " } else { "" };
        out.push_str(&format!("{verb}claim {}\n", self.key));
        if self.key.id() != self.given {
            out.push_str("  (the id is stored as its digest: it is long or looks like one)\n");
        }
        out.push_str(&format!(
            "  claimed at  {} (database clock)\n",
            rfc3339(row.claimed_at)
        ));
        out.push_str(&format!("  expires at  {}\n", rfc3339(row.expires_at)));
        out.push_str(&format!("  state       {}\n", state(row)));
        out
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "scope": self.key.scope(),
            "key": self.key.id(),
            "found": self.row.is_some(),
            "released": self.released,
            "claimed_at": self.row.as_ref().map(|r| rfc3339(r.claimed_at)),
            "expires_at": self.row.as_ref().map(|r| rfc3339(r.expires_at)),
            "live": self.row.as_ref().map(ClaimRecord::live),
            "expires_in_seconds": self.row.as_ref().map(ClaimRecord::expires_in_seconds),
            "fingerprint": self.row.as_ref().and_then(|r| r.fingerprint).map(|f| f.to_string()),
            "lease_in_progress": self.row.as_ref().map(|r| r.in_progress),
        })
    }
}

/// `claims stats`.
pub(crate) struct StatsReport {
    table: String,
    pub(crate) scopes: Vec<ScopeSummary>,
    /// Where the store can tell.
    size: Option<TableSize>,
}

impl StatsReport {
    fn totals(&self) -> (u64, u64) {
        self.scopes
            .iter()
            .fold((0, 0), |(rows, live), s| (rows + s.rows, live + s.live))
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

impl Report for StatsReport {
    fn text(&self) -> String {
        let (rows, live) = self.totals();
        let mut out = format!(
            "{}: {rows} claims, {live} live, {} expired (waiting for purge)",
            self.table,
            rows - live,
        );
        if let Some(size) = self.size {
            out.push_str(&format!(
                "; table {}, indexes {}, total {}",
                mib(size.table_bytes),
                mib(size.index_bytes),
                mib(size.total_bytes)
            ));
        }
        out.push('\n');
        for s in &self.scopes {
            out.push_str(&format!(
                "  {}: {} claims, {} live, {} expired; expiries {} .. {}\n",
                s.scope,
                s.rows,
                s.live,
                s.rows - s.live,
                rfc3339(s.oldest_expiry),
                rfc3339(s.newest_expiry)
            ));
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        let (rows, live) = self.totals();
        json!({
            "table": self.table,
            "rows": rows,
            "live": live,
            "expired": rows - live,
            "oldest_expiry": self.scopes.iter().map(|s| s.oldest_expiry).min().map(rfc3339),
            "newest_expiry": self.scopes.iter().map(|s| s.newest_expiry).max().map(rfc3339),
            "table_bytes": self.size.map(|s| s.table_bytes),
            "index_bytes": self.size.map(|s| s.index_bytes),
            "total_bytes": self.size.map(|s| s.total_bytes),
            "scopes": self.scopes.iter().map(|s| json!({
                "scope": s.scope,
                "rows": s.rows,
                "live": s.live,
                "expired": s.rows - s.live,
                "oldest_expiry": rfc3339(s.oldest_expiry),
                "newest_expiry": rfc3339(s.newest_expiry),
            })).collect::<Vec<_>>(),
        })
    }
}

/// `claims purge`.
pub(crate) struct PurgeReport {
    deleted: u64,
    batches: u64,
    seconds: f64,
}

impl Report for PurgeReport {
    fn text(&self) -> String {
        format!(
            "purged {} expired claims in {} batches ({:.1} s)\n",
            self.deleted, self.batches, self.seconds
        )
    }

    fn json(&self) -> serde_json::Value {
        json!({ "deleted": self.deleted, "batches": self.batches, "seconds": self.seconds })
    }
}
