//! `#[idempotent]` handlers applied through `HandlerExt::apply` on the memory store.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::{
    DedupStore, Describe, DescribeExt, Error, HandlerError, HandlerExt, KeyError, MemoryStore,
    MemoryTx, Outcome, idempotent,
};

#[derive(serde::Deserialize)]
struct Payment {
    event_id: uuid::Uuid,
    /// Each test pays into accounts of its own: tests run in parallel threads
    /// of one process, so no two of them may share a balance.
    account: String,
    amount_cents: i64,
}

/// Balances by account, the handlers' effect.
static BALANCES: Mutex<Option<HashMap<String, i64>>> = Mutex::new(None);

fn add_to(account: String, cents: i64) {
    let mut balances = BALANCES.lock().unwrap();
    *balances
        .get_or_insert_with(HashMap::new)
        .entry(account)
        .or_default() += cents;
}

fn balance(account: &str) -> i64 {
    BALANCES
        .lock()
        .unwrap()
        .as_ref()
        .and_then(|b| b.get(account).copied())
        .unwrap_or(0)
}

/// A non-idempotent effect (add to a balance), staged to happen on commit.
#[idempotent(key = "event_id", ttl = "1h")]
async fn add_payment(tx: &mut MemoryTx, ev: Payment) -> Result<(), HandlerError> {
    if ev.amount_cents < 0 {
        return Err(HandlerError::permanent("negative amount"));
    }
    tx.on_commit(move || add_to(ev.account, ev.amount_cents));
    Ok(())
}

fn payment(account: &str, id: &str, amount: i64) -> Vec<u8> {
    format!(r#"{{"event_id":"{id}","account":"{account}","amount_cents":{amount}}}"#).into_bytes()
}

const ID: &str = "7f0c2b0e-6a43-4a8e-9d8b-0a3c2f1e5b6d";

#[tokio::test]
async fn the_three_ttl_cases() {
    let store = MemoryStore::new();
    let msg = payment("ttl-cases", ID, 250);

    // (A) first delivery applies.
    let out = add_payment.apply(&store, &msg, &()).await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: false }),
        "{out:?}"
    );
    assert_eq!(balance("ttl-cases"), 250);

    // (B) a redelivery within the TTL is skipped; the balance stays.
    let out = add_payment.apply(&store, &msg, &()).await;
    assert!(matches!(out, Outcome::Skipped { .. }), "{out:?}");
    assert_eq!(balance("ttl-cases"), 250);

    // (C) after the TTL the same event is new again and applies.
    store.advance(Duration::from_secs(3600));
    let out = add_payment.apply(&store, &msg, &()).await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: true }),
        "{out:?}"
    );
    assert_eq!(balance("ttl-cases"), 500);
}

#[tokio::test]
async fn permanent_failures_are_classified() {
    let store = MemoryStore::new();
    let out = add_payment.apply(&store, b"{not json", &()).await;
    let Outcome::Failed(e @ Error::Decode(_)) = out else {
        panic!("{out:?}")
    };
    assert!(!e.is_retryable());

    let out = add_payment
        .apply(&store, br#"{"amount_cents":1}"#, &())
        .await;
    assert!(
        matches!(out, Outcome::Failed(Error::Decode(_))),
        "missing required key field: {out:?}"
    );

    let out = add_payment
        .apply(&store, &payment("permanent", ID, -1), &())
        .await;
    let Outcome::Failed(e) = out else {
        panic!("{out:?}")
    };
    assert_eq!(e.kind(), "handler");
    assert!(!e.is_retryable());
    // The failed attempt rolled back its claim: nothing is left behind.
    assert!(store.is_empty());
}

#[derive(serde::Deserialize)]
struct Envelope {
    meta: Meta,
}
#[derive(serde::Deserialize)]
struct Meta {
    event_id: Option<String>,
}

#[idempotent(key = "meta.event_id", ttl = "5m", scope = "envelopes")]
async fn nested(_tx: &mut MemoryTx, _ev: Envelope) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "header:event-id", ttl = "5m")]
async fn by_header(_tx: &mut MemoryTx, _ev: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

#[tokio::test]
async fn keys_from_nested_fields_options_and_headers() {
    let store = MemoryStore::new();
    assert_eq!(nested.scope(), "envelopes");
    assert_eq!(nested.ttl().to_string(), "5m");
    let out = nested
        .apply(&store, br#"{"meta":{"event_id":"e-1"}}"#, &())
        .await;
    assert!(matches!(out, Outcome::Applied { .. }), "{out:?}");
    let out = nested
        .apply(&store, br#"{"meta":{"event_id":null}}"#, &())
        .await;
    assert!(
        matches!(
            out,
            Outcome::Failed(Error::Key(KeyError::MissingField {
                field: "meta.event_id"
            }))
        ),
        "{out:?}"
    );
    let out = nested
        .apply(&store, br#"{"meta":{"event_id":""}}"#, &())
        .await;
    assert!(
        matches!(out, Outcome::Failed(Error::Key(KeyError::Empty))),
        "{out:?}"
    );

    assert_eq!(by_header.scope(), concat!(module_path!(), "::by_header"));
    let headers = vec![("event-id", b"h-1".to_vec())];
    assert!(matches!(
        by_header.apply(&store, b"{}", &headers).await,
        Outcome::Applied { .. }
    ));
    assert!(matches!(
        by_header.apply(&store, b"{}", &headers).await,
        Outcome::Skipped { .. }
    ));
    let out = by_header.apply(&store, b"{}", &()).await;
    assert!(
        matches!(
            out,
            Outcome::Failed(Error::Key(KeyError::MissingHeader { .. }))
        ),
        "{out:?}"
    );
}

#[derive(serde::Deserialize)]
struct TenantEvent {
    tenant: Option<String>,
    event_id: String,
}

#[idempotent(key = "tenant, header:event-id, event_id", ttl = "5m")]
async fn per_tenant(_tx: &mut MemoryTx, _ev: TenantEvent) -> Result<(), HandlerError> {
    Ok(())
}

#[tokio::test]
async fn composite_keys_keep_tenants_apart_and_name_a_missing_part() {
    let store = MemoryStore::new();
    let headers = vec![("event-id", b"h".to_vec())];
    let apply = |body: &'static str| per_tenant.apply(&store, body.as_bytes(), &headers);
    let applied = |out: &Outcome| matches!(out, Outcome::Applied { .. });
    let skipped = |out: &Outcome| matches!(out, Outcome::Skipped { .. });

    let out = apply(r#"{"tenant":"a","event_id":"1"}"#).await;
    assert!(applied(&out), "{out:?}");
    let out = apply(r#"{"tenant":"b","event_id":"1"}"#).await;
    assert!(
        applied(&out),
        "another tenant's event 1 is its own: {out:?}"
    );
    let out = apply(r#"{"tenant":"a","event_id":"1"}"#).await;
    assert!(skipped(&out), "{out:?}");
    // Separators inside the parts cannot make two keys meet.
    let out = apply(r#"{"tenant":"a,h","event_id":"1"}"#).await;
    assert!(applied(&out), "{out:?}");
    let out = apply(r#"{"tenant":"a","event_id":"h,1"}"#).await;
    assert!(applied(&out), "{out:?}");
    let out = apply(r#"{"tenant":"a:h","event_id":"1"}"#).await;
    assert!(applied(&out), "{out:?}");

    let out = apply(r#"{"tenant":null,"event_id":"1"}"#).await;
    assert!(
        matches!(
            &out,
            Outcome::Failed(Error::Key(KeyError::MissingField { field: "tenant" }))
        ),
        "{out:?}"
    );
    let out = apply(r#"{"tenant":"a","event_id":""}"#).await;
    assert!(
        matches!(
            &out,
            Outcome::Failed(Error::Key(KeyError::EmptyPart { part: "event_id" }))
        ),
        "{out:?}"
    );
    let out = per_tenant
        .apply(&store, br#"{"tenant":"a","event_id":"1"}"#, &())
        .await;
    assert!(
        matches!(
            &out,
            Outcome::Failed(Error::Key(KeyError::MissingHeader { header })) if header == "event-id"
        ),
        "{out:?}"
    );
}

/// Fails the first attempt at each account with a transient error.
#[idempotent(key = "event_id", ttl = "1h")]
async fn flaky(tx: &mut MemoryTx, ev: Payment) -> Result<(), HandlerError> {
    static FAILED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    {
        let mut failed = FAILED.lock().unwrap();
        if !failed.contains(&ev.account) {
            failed.push(ev.account);
            return Err(HandlerError::transient(std::io::Error::other(
                "downstream timed out",
            )));
        }
    }
    tx.on_commit(move || add_to(ev.account, ev.amount_cents));
    Ok(())
}

#[tokio::test]
async fn a_failed_attempt_rolls_back_so_the_retry_applies_once() {
    let store = MemoryStore::new();
    let msg = payment("flaky", ID, 40);
    let out = flaky.apply(&store, &msg, &()).await;
    let Outcome::Failed(e) = out else {
        panic!("{out:?}")
    };
    assert!(e.is_retryable());
    assert_eq!(balance("flaky"), 0);
    assert!(matches!(
        flaky.apply(&store, &msg, &()).await,
        Outcome::Applied { .. }
    ));
    assert!(matches!(
        flaky.apply(&store, &msg, &()).await,
        Outcome::Skipped { .. }
    ));
    assert_eq!(balance("flaky"), 40);
}

#[tokio::test]
async fn the_body_stays_callable_for_unit_tests() {
    let store = MemoryStore::new();
    let mut tx = dedup_core::DedupStore::begin(&store).await.unwrap();
    let seen = Arc::new(AtomicI64::new(0));
    add_payment::call(
        &mut tx,
        Payment {
            event_id: uuid::Uuid::nil(),
            account: "callable".into(),
            amount_cents: 1,
        },
    )
    .await
    .unwrap();
    tx.on_commit({
        let seen = seen.clone();
        move || seen.store(1, Ordering::SeqCst)
    });
    dedup_core::DedupStore::commit(&store, tx).await.unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    assert_eq!(balance("callable"), 1);
}

#[idempotent(key = "event_id", ttl = "1h")]
async fn add_in_batch(tx: &mut MemoryTx, ev: Payment) -> Result<(), HandlerError> {
    if ev.amount_cents < 0 {
        return Err(HandlerError::permanent("negative amount"));
    }
    tx.on_commit(move || add_to(ev.account, ev.amount_cents));
    Ok(())
}

fn prepared(
    ids: &[(&str, i64)],
) -> Vec<(
    dedup_core::DedupKey,
    Option<dedup_core::Fingerprint>,
    Payment,
)> {
    ids.iter()
        .map(|(id, cents)| {
            let ev = add_in_batch.decode(&payment("batch", id, *cents)).unwrap();
            (add_in_batch.dedup_key(&ev, &()).unwrap(), None, ev)
        })
        .collect()
}

#[tokio::test]
async fn a_batch_claims_once_applies_in_order_and_rolls_back_whole() {
    let store = MemoryStore::new();
    let a = "00000000-0000-0000-0000-00000000000a";
    let b = "00000000-0000-0000-0000-00000000000b";
    let c = "00000000-0000-0000-0000-00000000000c";
    let d = "00000000-0000-0000-0000-00000000000d";

    // The same key twice in a batch: applied once.
    let out = add_in_batch
        .apply_batch(&store, prepared(&[(a, 1), (b, 10), (a, 1)]))
        .await
        .unwrap();
    let names: Vec<_> = out.iter().map(Outcome::name).collect();
    assert_eq!(names, ["applied", "applied", "skipped"]);
    assert_eq!(balance("batch"), 11);

    // A failure in the middle rolls back the whole batch: c is not applied.
    let err = add_in_batch
        .apply_batch(&store, prepared(&[(c, 100), (d, -1)]))
        .await
        .unwrap_err();
    assert!(!err.is_retryable());
    assert_eq!(balance("batch"), 11);
    let out = add_in_batch
        .apply_batch(&store, prepared(&[(c, 100), (b, 10)]))
        .await
        .unwrap();
    let names: Vec<_> = out.iter().map(Outcome::name).collect();
    assert_eq!(
        names,
        ["applied", "skipped"],
        "c was rolled back, b is a live duplicate"
    );
    assert_eq!(balance("batch"), 111);
}

/// Keyed like `add_payment`, with a fingerprint of the fields that make the
/// payment: a re-send with other whitespace or field order still matches.
#[idempotent(key = "event_id", ttl = "1h", fingerprint = "account, amount_cents")]
async fn add_payment_checked(tx: &mut MemoryTx, ev: Payment) -> Result<(), HandlerError> {
    tx.on_commit(move || add_to(ev.account, ev.amount_cents));
    Ok(())
}

/// The whole payload, byte for byte.
#[idempotent(key = "event_id", ttl = "1h", fingerprint, batch)]
async fn add_payments_checked(tx: &mut MemoryTx, evs: Vec<Payment>) -> Result<(), HandlerError> {
    for ev in evs {
        tx.on_commit(move || add_to(ev.account, ev.amount_cents));
    }
    Ok(())
}

fn is_mismatch(out: &Outcome) -> bool {
    matches!(
        out,
        Outcome::Failed(e @ Error::FingerprintMismatch { .. })
            if e.kind() == "fingerprint_mismatch" && !e.is_retryable()
    )
}

#[tokio::test]
async fn a_reused_id_with_other_content_is_a_mismatch_not_a_skip() {
    let store = MemoryStore::new();
    let id = "5d1c2b0e-0000-4a8e-9d8b-0a3c2f1e5b6d";
    let out = add_payment_checked
        .apply(&store, &payment("fp-fields", id, 250), &())
        .await;
    assert!(matches!(out, Outcome::Applied { .. }), "{out:?}");
    // The same fields, written otherwise: a redelivery.
    let resent = format!(
        r#"{{ "amount_cents": 250, "account": "fp-fields", "event_id": "{id}", "sent_at": 9 }}"#
    );
    let out = add_payment_checked
        .apply(&store, resent.as_bytes(), &())
        .await;
    assert!(matches!(out, Outcome::Skipped { .. }), "{out:?}");
    let out = add_payment_checked
        .apply(&store, &payment("fp-fields", id, 2500), &())
        .await;
    assert!(is_mismatch(&out), "{out:?}");
    if let Outcome::Failed(e) = &out {
        let message = e.to_string();
        assert!(
            message.contains(id) && message.contains("reused"),
            "{message}"
        );
    }
    assert_eq!(
        balance("fp-fields"),
        250,
        "applied once, never the other content"
    );

    // A claim taken before the handler kept fingerprints matches any event.
    let old = "5d1c2b0e-0000-4a8e-9d8b-0a3c2f1e5b6e";
    let key = dedup_core::DedupKey::new(Describe::scope(&add_payment_checked), old).unwrap();
    let mut tx = store.begin().await.unwrap();
    let ttl = Describe::ttl(&add_payment_checked);
    assert!(
        store
            .claim(&mut tx, &key, None, ttl)
            .await
            .unwrap()
            .is_claimed()
    );
    store.commit(tx).await.unwrap();
    let out = add_payment_checked
        .apply(&store, &payment("fp-fields", old, 1), &())
        .await;
    assert!(matches!(out, Outcome::Skipped { .. }), "{out:?}");
}

#[tokio::test]
async fn a_batch_commits_around_a_mismatch_and_reports_it() {
    let store = MemoryStore::new();
    let [a, b] = [
        "00000000-0000-0000-0000-0000000000fa",
        "00000000-0000-0000-0000-0000000000fb",
    ];
    let batch = |items: &[(&str, i64)]| {
        items
            .iter()
            .map(|(id, cents)| {
                let payload = payment("fp-batch", id, *cents);
                let ev = add_payments_checked.decode(&payload).unwrap();
                let key = add_payments_checked.dedup_key(&ev, &()).unwrap();
                let fingerprint = add_payments_checked.fingerprint(&ev, &payload);
                assert!(fingerprint.is_some());
                (key, fingerprint, ev)
            })
            .collect::<Vec<_>>()
    };
    // In one batch: a, then a with other content (its repeat), then b.
    let outcomes = add_payments_checked
        .apply_batch(&store, batch(&[(a, 1), (a, 2), (b, 10)]))
        .await
        .unwrap();
    assert!(
        matches!(outcomes[0], Outcome::Applied { .. }),
        "{outcomes:?}"
    );
    assert!(is_mismatch(&outcomes[1]), "{outcomes:?}");
    assert!(
        matches!(outcomes[2], Outcome::Applied { .. }),
        "{outcomes:?}"
    );
    assert_eq!(balance("fp-batch"), 11);

    // Against committed claims: the same content is skipped, other content
    // is a mismatch.
    let outcomes = add_payments_checked
        .apply_batch(&store, batch(&[(b, 10), (a, 3)]))
        .await
        .unwrap();
    assert!(
        matches!(outcomes[0], Outcome::Skipped { .. }),
        "{outcomes:?}"
    );
    assert!(is_mismatch(&outcomes[1]), "{outcomes:?}");
    assert_eq!(balance("fp-batch"), 11);
}
