//! Logging for the binaries: `tracing` to stderr, filtered by `SOFTNIC_LOG` (EnvFilter syntax).

/// Installs the subscriber; `default` is the filter when `SOFTNIC_LOG` is unset or invalid.
pub fn init(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SOFTNIC_LOG")
                .unwrap_or_else(|_| default.into()),
        )
        .with_writer(std::io::stderr)
        .init();
}
