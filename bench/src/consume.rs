//! A mode's consumer in a process of its own: the peak RSS a mode reports
//! is then the consumer's alone, at any run length, and not the
//! benchmark's bookkeeping (the workload's numbering, each event's
//! acknowledgement time, the latencies), which grows with the run.
//!
//! The parent starts this program as `--consume MODE --topic T --group G`
//! (and `--output O` for the Kafka-only modes); the child runs the mode's
//! consumer until its stdin closes, then prints a [`Consumed`] line.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};

use dedup_postgres::PgStore;

use crate::{Args, BoxError, ConsumerRun, NoDedup, configure, env_or};

/// What a consumer child reports when it stops.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct Consumed {
    /// Transactions that committed a batch.
    pub(crate) batches: u64,
    /// The child's peak resident set, MiB.
    pub(crate) peak_rss_mib: f64,
}

/// The parent's handle on a consumer child.
pub(crate) struct ConsumerChild {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Drop for ConsumerChild {
    /// A run that fails midway does not leave its consumer running.
    fn drop(&mut self) {
        crate::produce::end_if_running(&mut self.child);
    }
}

impl ConsumerChild {
    /// Starts the consumer of `mode` on `topic` as `group` (writing to
    /// `output`, for the Kafka-only modes), with `args`' consumer settings.
    pub(crate) fn spawn(
        mode: &str,
        topic: &str,
        group: &str,
        output: Option<&str>,
        args: &Args,
    ) -> Result<Self, BoxError> {
        let mut command = Command::new(std::env::current_exe()?);
        command.args(["--consume", mode, "--topic", topic, "--group", group]);
        if let Some(output) = output {
            command.args(["--output", output]);
        }
        crate::forward_consumer_settings(&mut command, args);
        Self::start(command)
    }

    /// Starts `command` as a consumer child: it runs until its stdin
    /// closes, then prints a [`Consumed`] line.
    pub(crate) fn start(mut command: Command) -> Result<Self, BoxError> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdin = child.stdin.take();
        Ok(ConsumerChild { child, stdin })
    }

    /// CPU time the child's process has used so far (user and system, all
    /// its threads), in clock ticks (USER_HZ, 100 a second), where
    /// /proc is readable.
    pub(crate) fn cpu_ticks(&self) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).ok()?;
        // Fields after the command's closing parenthesis: state is the
        // first (field 3), utime and stime fields 14 and 15.
        let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
        let utime: u64 = fields.next()?.parse().ok()?;
        let stime: u64 = fields.next()?.parse().ok()?;
        Some(utime + stime)
    }

    /// Whether the child is still running; an error once it has failed.
    pub(crate) fn check(&mut self) -> Result<(), BoxError> {
        match self.child.try_wait()? {
            None => Ok(()),
            Some(status) => Err(format!("the consumer stopped early: {status}").into()),
        }
    }

    /// Stops the consumer (closing its stdin) and returns its report.
    pub(crate) fn stop(mut self) -> Result<Consumed, BoxError> {
        drop(self.stdin.take());
        let mut out = String::new();
        if let Some(mut stdout) = self.child.stdout.take() {
            stdout.read_to_string(&mut out)?;
        }
        let status = self.child.wait()?;
        if !status.success() {
            return Err(format!("the consumer failed: {status}").into());
        }
        let line = out.trim().lines().last().unwrap_or_default();
        Ok(serde_json::from_str(line)
            .map_err(|e| format!("the consumer's report {line:?}: {e}"))?)
    }
}

/// The child's side: runs `mode`'s consumer until stdin closes.
pub(crate) async fn serve(
    mode: &str,
    topic: &str,
    group: &str,
    output: Option<&str>,
    args: &Args,
) -> Result<(), BoxError> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    // The parent closes stdin to stop us (and so does its exit).
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = BufReader::new(std::io::stdin().lock()).read_until(0, &mut sink);
        let _ = stop.send(());
    });
    let brokers = env_or("KAFKA_BROKERS", "127.0.0.1:9092");
    let batches = match mode {
        "kafka-plain" => {
            let output = output.ok_or("kafka-plain needs --output")?;
            crate::kafka_only::plain(brokers, topic.into(), group.into(), output.into(), stopped)
                .await?;
            0
        }
        m if m.starts_with("kafka-") => {
            let output = output.ok_or("the transactional consumer needs --output")?;
            let run = crate::kafka_only::Transactional::spawn(&brokers, topic, group, output, args);
            let _ = stopped.await;
            run.stop().await?.batches
        }
        _ => {
            if mode == "batched-metrics" {
                crate::install_prometheus()?;
            }
            let store = PgStore::connect_with(
                &std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?,
                crate::growth::config(mode),
            )
            .await?;
            let batch_size = if mode == "per-message" { 1 } else { 200 };
            let run = match mode {
                "no-dedup" => ConsumerRun::spawn(
                    configure(NoDedup(store), args, &brokers, group, batch_size)
                        .handle(topic, crate::record_payments),
                ),
                "per-event-body" => ConsumerRun::spawn(
                    configure(store, args, &brokers, group, batch_size)
                        .handle(topic, crate::record_payment),
                ),
                _ => ConsumerRun::spawn(
                    configure(store, args, &brokers, group, batch_size)
                        .handle(topic, crate::record_payments),
                ),
            };
            let _ = stopped.await;
            let batches = run.stats.snapshot().batches;
            run.stop().await;
            batches
        }
    };
    let report = Consumed {
        batches,
        peak_rss_mib: crate::peak_rss_mib(),
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&report)?)?;
    out.flush()?;
    Ok(())
}
