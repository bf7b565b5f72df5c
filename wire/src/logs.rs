//! How the servers log (feature `server`): `tracing` to stderr, the level from `RUST_LOG`
//! (or the server's default), as text or, with `LOCKSERVICE_LOG_FORMAT=json`, one JSON
//! object per line (`docs/operations.md`, "Logs").

/// The environment variable that picks the format: `text` (the default) or `json`.
pub const FORMAT_ENV: &str = "LOCKSERVICE_LOG_FORMAT";

/// The log formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Human-readable lines (colored on a terminal).
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields` (the message and
    /// its fields) and the spans.
    Json,
}

impl Format {
    /// The format `value` names (case-insensitive), or an error that lists the choices.
    pub fn parse(value: &str) -> Result<Format, String> {
        match value.to_ascii_lowercase().as_str() {
            "" | "text" => Ok(Format::Text),
            "json" => Ok(Format::Json),
            other => Err(format!(
                "{FORMAT_ENV}={other:?}: expected \"text\" or \"json\""
            )),
        }
    }
}

/// Starts logging to stderr for a server whose default filter is `default_filter` (used
/// when `RUST_LOG` is unset). Fails on a `LOCKSERVICE_LOG_FORMAT` it does not know.
pub fn init(default_filter: &str) -> Result<(), String> {
    let format = Format::parse(&std::env::var(FORMAT_ENV).unwrap_or_default())?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        Format::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        Format::Json => builder.json().with_ansi(false).init(),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_named_and_a_wrong_one_is_refused() {
        assert_eq!(Format::parse(""), Ok(Format::Text));
        assert_eq!(Format::parse("JSON"), Ok(Format::Json));
        let e = Format::parse("yaml").unwrap_err();
        assert!(
            e.contains("LOCKSERVICE_LOG_FORMAT") && e.contains("json"),
            "{e}"
        );
    }
}
