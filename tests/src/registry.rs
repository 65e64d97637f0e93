//! The schema registry the tests talk to: the shared one that
//! `scripts/registry.sh` runs (Apicurio Registry behind nginx: TLS, basic
//! auth), or one of a test's own for the tests that stop it.

use dedup_registry::Registry;

use crate::common::Script;

/// An environment variable `scripts/registry.sh env` sets.
fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the tests with `scripts/test.sh`, or export `scripts/registry.sh env`")
    })
}

/// The shared registry's URL (`DEDUP_REGISTRY_URL`).
pub fn url() -> String {
    env("DEDUP_REGISTRY_URL")
}

/// The test CA's certificate, which signed the registry's.
pub fn ca_file() -> String {
    env("DEDUP_REGISTRY_CA")
}

/// The user and password the registry accepts.
pub fn credentials() -> (String, String) {
    (
        env("DEDUP_REGISTRY_USERNAME"),
        env("DEDUP_REGISTRY_PASSWORD"),
    )
}

/// A client of the registry at `url`, trusting the test CA, signed in.
pub fn client_of(url: &str) -> Registry {
    let (user, password) = credentials();
    Registry::builder(url)
        .ca_file(ca_file())
        .basic_auth(user, password)
        .timeout(std::time::Duration::from_secs(3))
        .build()
        .expect("registry client")
}

/// A client of the shared registry.
pub fn client() -> Registry {
    client_of(&url())
}

/// A registry of a test's own (its own schemas and ports), stopped on
/// drop: for the tests that stop it, so the tests beside them never notice.
pub struct OwnRegistry {
    script: Script,
    /// Its API's base URL.
    pub url: String,
}

impl OwnRegistry {
    /// Starts a registry in `.registry/<name>` with nginx on `port` (the
    /// registry itself on `port + 1`), with no schemas.
    pub async fn start(name: &str, port: u16) -> Self {
        let home = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../.registry")
            .join(name);
        let registry = OwnRegistry {
            script: Script {
                name: "registry",
                env: vec![
                    ("DEDUP_REGISTRY_HOME", home.display().to_string()),
                    ("DEDUP_REGISTRY_PORT", port.to_string()),
                ],
            },
            url: format!("https://localhost:{port}/apis/ccompat/v6"),
        };
        registry.run("stop").await;
        let _ = std::fs::remove_dir_all(&home);
        registry.run("start").await;
        registry
    }

    /// Runs `registry.sh <action>` (`start`, `stop`, `kill`) for it.
    pub async fn run(&self, action: &str) {
        self.script.run(action).await;
    }
}

impl Drop for OwnRegistry {
    fn drop(&mut self) {
        let _ = self.script.command("stop").status();
    }
}
