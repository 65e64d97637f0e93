//! A token provider's tokens for librdkafka clients an application or tool
//! makes itself, outside dedup's runtimes.

use std::fmt;
use std::sync::Arc;

use crate::TokenProvider;
use crate::oauth::{Tokens, take_token};

/// OAUTHBEARER tokens from a [`TokenProvider`] for librdkafka clients made
/// outside dedup's runtimes (an operator's tool, a client of the
/// application's own): keep it while the clients live, let it
/// [`configure`](Self::configure) them, and make them with
/// [`TokenContext`](crate::TokenContext). The provider runs as a runtime's does (a thread of its
/// own, asked before each token expires; failures waited out).
///
/// ```no_run
/// # fn f(provider: impl dedup_kafka::TokenProvider) -> Result<(), Box<dyn std::error::Error>> {
/// use rdkafka::consumer::BaseConsumer;
/// let keeper = dedup_kafka::TokenKeeper::start(provider)?;
/// let mut config = rdkafka::ClientConfig::new();
/// config
///     .set("bootstrap.servers", "broker-1:9093")
///     .set("security.protocol", "SASL_SSL")
///     .set("sasl.mechanisms", "OAUTHBEARER");
/// keeper.configure(&mut config);
/// let consumer: BaseConsumer<dedup_kafka::TokenContext> =
///     config.create_with_context(dedup_kafka::TokenContext)?;
/// // A client only ever asked for metadata is given its first token here.
/// dedup_kafka::TokenKeeper::serve(&consumer);
/// # Ok(()) }
/// ```
pub struct TokenKeeper(Tokens);

impl fmt::Debug for TokenKeeper {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TokenKeeper(..)")
    }
}

impl TokenKeeper {
    /// Starts asking `provider` for tokens.
    pub fn start(provider: impl TokenProvider) -> Result<Self, crate::Error> {
        Tokens::start(Arc::new(provider))
            .map(TokenKeeper)
            .map_err(|e| crate::Error::Config(format!("cannot start the token provider: {e}")))
    }

    /// Points clients made from `config` (with [`TokenContext`](crate::TokenContext)) at these
    /// tokens: sets `sasl.oauthbearer.config`.
    pub fn configure(&self, config: &mut rdkafka::ClientConfig) {
        config.set("sasl.oauthbearer.config", self.0.setting());
    }

    /// Waits for the provider's first token (at most 10 s): an error saying
    /// why there is none (the identity provider refused the credentials,
    /// or could not be reached). A tool that runs once calls it, to fail at
    /// once with the reason; a service waits an outage out instead.
    pub fn first_token(&self) -> Result<(), crate::Error> {
        self.0.current().map(|_| ()).map_err(crate::Error::Config)
    }

    /// Gives a consumer that is not polled otherwise (one only asked for
    /// metadata, watermarks or committed offsets) its first token: blocks
    /// until the provider answers (at most 10 s), so call it off async
    /// workers. Clients that are polled (a producer, a consumer read with
    /// `poll`) need nothing more.
    pub fn serve<C: rdkafka::consumer::ConsumerContext>(
        client: &rdkafka::consumer::BaseConsumer<C>,
    ) {
        take_token(client);
    }
}
