package dev.dedup.bench;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Properties;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.StreamsBuilder;
import org.apache.kafka.streams.StreamsConfig;
import org.apache.kafka.streams.kstream.Consumed;
import org.apache.kafka.streams.kstream.Produced;
import org.apache.kafka.streams.processor.api.Processor;
import org.apache.kafka.streams.processor.api.ProcessorContext;
import org.apache.kafka.streams.processor.api.Record;
import org.apache.kafka.streams.state.KeyValueStore;
import org.apache.kafka.streams.state.Stores;

/**
 * The benchmark's job in Kafka Streams: each distinct payment (by its
 * event_id) written once to the output, enriched, keyed by its account;
 * the ids seen kept in a persistent store (RocksDB, with its changelog),
 * exactly once (exactly_once_v2), 2 stream threads.
 *
 * <p>Arguments: brokers, input topic, output topic, application id (the
 * consumer group whose offsets the benchmark watches), state directory. It
 * runs until its stdin closes, then closes the application and prints the
 * benchmark's report line: {"batches":0,"peak_rss_mib":...}.
 */
public final class Enrich {
  private static final ObjectMapper JSON = new ObjectMapper();
  private static final String SEEN = "seen";

  /** Forwards a payment the first time its event_id is seen. */
  static final class Dedup implements Processor<byte[], byte[], String, byte[]> {
    private ProcessorContext<String, byte[]> context;
    private KeyValueStore<String, Long> seen;

    @Override
    public void init(ProcessorContext<String, byte[]> context) {
      this.context = context;
      this.seen = context.getStateStore(SEEN);
    }

    @Override
    public void process(Record<byte[], byte[]> record) {
      try {
        JsonNode payment = JSON.readTree(record.value());
        String id = payment.get("event_id").asText();
        if (seen.get(id) != null) {
          return;
        }
        seen.put(id, record.timestamp());
        ObjectNode enriched = JSON.createObjectNode();
        enriched.set("payment", payment);
        enriched.put("enriched", true);
        context.forward(
            record
                .withKey(payment.get("account_id").asText())
                .withValue(JSON.writeValueAsBytes(enriched)));
      } catch (IOException e) {
        throw new UncheckedIOException(e);
      }
    }
  }

  public static void main(String[] args) throws Exception {
    if (args.length != 5) {
      System.err.println("usage: Enrich BROKERS INPUT OUTPUT APPLICATION_ID STATE_DIR");
      System.exit(2);
    }
    Properties props = new Properties();
    props.put(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
    props.put(StreamsConfig.APPLICATION_ID_CONFIG, args[3]);
    props.put(StreamsConfig.STATE_DIR_CONFIG, args[4]);
    props.put(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, StreamsConfig.EXACTLY_ONCE_V2);
    props.put(StreamsConfig.NUM_STREAM_THREADS_CONFIG, 2);
    props.put(StreamsConfig.consumerPrefix(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG), "earliest");

    StreamsBuilder builder = new StreamsBuilder();
    builder.addStateStore(
        Stores.keyValueStoreBuilder(
            Stores.persistentKeyValueStore(SEEN), Serdes.String(), Serdes.Long()));
    builder.stream(args[1], Consumed.with(Serdes.ByteArray(), Serdes.ByteArray()))
        .process(Dedup::new, SEEN)
        .to(args[2], Produced.with(Serdes.String(), Serdes.ByteArray()));

    KafkaStreams streams = new KafkaStreams(builder.build(), props);
    streams.setUncaughtExceptionHandler(
        e -> {
          e.printStackTrace();
          System.exit(1);
          return null;
        });
    streams.start();
    // The benchmark stops us by closing stdin.
    while (System.in.read() != -1) {
      // nothing to read
    }
    streams.close(Duration.ofSeconds(60));
    System.out.println("{\"batches\":0,\"peak_rss_mib\":" + peakRssMib() + "}");
    System.out.flush();
    System.exit(0);
  }

  /** This process's peak resident set (VmHWM), MiB. */
  private static double peakRssMib() throws IOException {
    for (String line : Files.readAllLines(Path.of("/proc/self/status"))) {
      if (line.startsWith("VmHWM:")) {
        String kb = line.substring(6).trim().split("\\s+")[0];
        return Long.parseLong(kb) / 1024.0;
      }
    }
    return 0.0;
  }
}
