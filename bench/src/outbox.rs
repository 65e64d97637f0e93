//! The outbox modes: the relay against a direct idempotent producer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::producer::FutureRecord;

use crate::workload::Workload;
use crate::{Args, BoxError, Report, env_or, new_topic, records_in};

/// One outbox mode: `outbox-direct` sends the records straight to Kafka;
/// `outbox-N-relay(s)` enqueues them in transactions and has N relays
/// publish them.
pub(crate) async fn run_outbox(mode: &str, args: &Args) -> Result<Report, BoxError> {
    let brokers = env_or("KAFKA_BROKERS", "127.0.0.1:9092");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?)
        .await?;
    let outbox = dedup_postgres::OutboxWriter::new(
        dedup_postgres::OutboxConfig::default().with_retention(if args.delete_sent {
            dedup_core::outbox::Retention::Delete
        } else {
            dedup_core::outbox::Retention::default()
        }),
    )?;
    outbox.migrate(&pool).await?;
    sqlx::query("TRUNCATE dedup_outbox").execute(&pool).await?;
    let topic = new_topic(&brokers, mode, args.partitions).await?;
    let work = Arc::new(Workload::new(args.events, 0.0, 0));
    let events = work.len();
    let event_id = |i: usize| format!("bench-{i}");

    if mode == "outbox-direct" {
        let producer = crate::outbox_logical::producer(&brokers)?;
        let started = Instant::now();
        let mut latencies = Vec::with_capacity(events);
        let mut inflight = std::collections::VecDeque::new();
        for i in 0..events {
            let (key, payload) = work.message(i);
            let id = event_id(i);
            let headers = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                key: dedup_core::outbox::EVENT_ID_HEADER,
                value: Some(&id),
            });
            let record = FutureRecord::to(&topic)
                .key(&key)
                .payload(&payload)
                .headers(headers);
            let delivery = producer.send_result(record).map_err(|(e, _)| e)?;
            inflight.push_back((Instant::now(), delivery));
            if inflight.len() >= 10_000
                && let Some((sent, delivery)) = inflight.pop_front()
            {
                delivery.await?.map_err(|(e, _)| e)?;
                latencies.push(sent.elapsed().as_secs_f64() * 1000.0);
            }
        }
        for (sent, delivery) in inflight {
            delivery.await?.map_err(|(e, _)| e)?;
            latencies.push(sent.elapsed().as_secs_f64() * 1000.0);
        }
        let seconds = started.elapsed().as_secs_f64();
        let records = records_in(&brokers, &topic, args.partitions)?;
        return Ok(Report::new(
            mode,
            events,
            seconds,
            latencies,
            (records, events as i64),
            0,
        ));
    }

    let relays: usize = if mode.starts_with("outbox-2-relays") {
        2
    } else {
        1
    };
    // `-drain`: the whole backlog is enqueued first, then the relays start
    // (what they can publish); otherwise the writers and the relays run
    // together (end to end).
    let drain = mode.ends_with("-drain");
    let start_relays = || {
        (0..relays)
            .map(|_| {
                let relay = dedup_kafka::Relay::builder(outbox.reader(pool.clone()))
                    .brokers(&brokers)
                    .batch_size(args.relay_batch)
                    .build()?;
                let stats = relay.stats();
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let task = tokio::spawn(relay.run_until(async {
                    let _ = stopped.await;
                }));
                Ok::<_, BoxError>((stats, stop, task))
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let logical = mode.starts_with("outbox-logical-");
    // The events as logical decoding messages, no rows.
    let messages = mode == "outbox-logical-message-drain";
    let slot = if logical {
        Some(crate::outbox_logical::Slot::create(&pool).await?)
    } else {
        None
    };
    // Whatever happens, a slot made here is dropped: it would hold WAL on
    // the server for good.
    let outcome: Result<Report, BoxError> = async {
        let mut running = Vec::new();
        if !drain {
            running = start_relays()?;
            // Let the relays start listening before the clock starts.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let mut started = Instant::now();
        let writers: Vec<_> = (0..4)
            .map(|w| {
                let (pool, outbox, work, topic) =
                    (pool.clone(), outbox.clone(), work.clone(), topic.clone());
                let per_tx = args.per_tx;
                tokio::spawn(async move {
                    let chunks: Vec<usize> = (0..work.len()).step_by(per_tx).collect();
                    for start in chunks.into_iter().skip(w).step_by(4) {
                        let mut tx = pool.begin().await?;
                        for i in start..(start + per_tx).min(work.len()) {
                            let (key, payload) = work.message(i);
                            if messages {
                                let content = crate::outbox_logical::message_content(
                                    &topic,
                                    &key,
                                    &event_id(i),
                                    payload.as_bytes(),
                                );
                                sqlx::query("SELECT pg_logical_emit_message(true, $1, $2)")
                                    .bind(crate::outbox_logical::MESSAGE_PREFIX)
                                    .bind(content)
                                    .execute(&mut *tx)
                                    .await?;
                                continue;
                            }
                            let message = dedup_core::OutboxMessage::bytes(&topic, payload)
                                .with_key(key)
                                .with_event_id(event_id(i));
                            outbox.enqueue(&mut tx, message).await?;
                        }
                        tx.commit().await?;
                    }
                    Ok::<_, BoxError>(())
                })
            })
            .collect();
        for writer in writers {
            writer.await??;
        }
        let enqueued_in = started.elapsed().as_secs_f64();
        if let Some(slot) = &slot {
            started = Instant::now();
            let drained = if mode != "outbox-logical-sql-drain" {
                crate::outbox_logical::drain_stream(
                    &std::env::var("DATABASE_URL")?,
                    &pool,
                    slot,
                    &brokers,
                    events as u64,
                    messages,
                )
                .await?
            } else {
                crate::outbox_logical::drain(&pool, slot, &brokers, args.logical_batch, events as u64)
                    .await?
            };
            let seconds = started.elapsed().as_secs_f64();
            let left: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_outbox")
                .fetch_one(&pool)
                .await?;
            if left != 0 {
                return Err(format!("{left} events left in the table after the relay").into());
            }
            let ms = |d: Duration| d.as_secs_f64() * 1000.0 / drained.batches.max(1) as f64;
            let enqueued = format!(
                "enqueued in {enqueued_in:.2} s ({:.0} events/s), published {}",
                events as f64 / enqueued_in,
                drained.published
            );
            if mode == "outbox-logical-sql-drain" {
                eprintln!(
                    "  {mode}: {enqueued} in {} batches; per batch: peek {:.1} ms, send and \
                     acknowledgements {:.1} ms, delete {:.1} ms, slot advance {:.1} ms",
                    drained.batches,
                    ms(drained.peek),
                    ms(drained.send),
                    ms(drained.delete),
                    ms(drained.advance),
                );
            } else {
                eprintln!(
                    "  {mode}: {enqueued}, acknowledged in {} groups; deleting their rows took {:.1} ms \
                     a group",
                    drained.batches,
                    ms(drained.delete),
                );
            }
            let records = records_in(&brokers, &topic, args.partitions)?;
            return Ok(Report::new(
                mode,
                events,
                seconds,
                Vec::new(),
                (records, events as i64),
                drained.batches,
            ));
        }
        if drain {
            started = Instant::now();
            running = start_relays()?;
        }
        // Watch the relays' own counters: a count of the pending rows every
        // few milliseconds is a sequential scan that took a core from
        // PostgreSQL (54 ms each at 200,000 rows), so the benchmark measured
        // itself. The table is checked once the counters say everything went.
        loop {
            let published: u64 = running
                .iter()
                .map(|(stats, _, _)| stats.snapshot().published)
                .sum();
            if published >= events as u64 {
                break;
            }
            if started.elapsed() > Duration::from_secs(3600) {
                return Err("gave up after an hour".into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let seconds = started.elapsed().as_secs_f64();
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM dedup_outbox WHERE sent_at IS NULL")
                .fetch_one(&pool)
                .await?;
        if pending != 0 {
            return Err(
                format!("{pending} events still pending after the relays published {events}").into(),
            );
        }
        let mut published = 0;
        let mut batches = 0;
        for (stats, stop, task) in running {
            let _ = stop.send(());
            task.await??;
            let s = stats.snapshot();
            published += s.published;
            batches += s.batches;
        }
        eprintln!(
            "  {mode}: enqueued in {enqueued_in:.2} s ({:.0} events/s), published {published}",
            events as f64 / enqueued_in
        );
        let latencies: Vec<f64> = sqlx::query_scalar(
            "SELECT extract(epoch FROM sent_at - enqueued_at)::float8 * 1000 FROM dedup_outbox",
        )
        .fetch_all(&pool)
        .await?;
        let table_bytes: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('dedup_outbox')")
            .fetch_one(&pool)
            .await?;
        let records = records_in(&brokers, &topic, args.partitions)?;
        let mut report = Report::new(
            mode,
            events,
            seconds,
            latencies,
            (records, events as i64),
            batches,
        );
        report.table_mib = Some(table_bytes as f64 / (1024.0 * 1024.0));
        Ok(report)
    }
    .await;
    if let Some(slot) = &slot {
        let dropped = slot.drop_all(&pool).await;
        match (&outcome, dropped) {
            (Ok(_), Err(e)) => return Err(e),
            (Err(_), Err(e)) => eprintln!("  the replication slot could not be dropped: {e}"),
            (_, Ok(())) => {}
        }
    }
    outcome
}
