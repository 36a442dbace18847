//! Logging: `RUST_LOG` (e.g. `daplkrdma=debug,krdma_dapl=debug`) sends the provider's
//! tracing to stderr, as in the stack's other C libraries.

use std::sync::Once;

pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .try_init();
        }
    });
}
