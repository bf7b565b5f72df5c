//! Fencing: what a protected resource does with the tokens of lock holders.
//!
//! A lock service cannot stop a paused process: a holder that stalls past its lease may
//! wake up and write after another client was granted the lock. The resource is the only
//! place that can refuse it. The rule:
//!
//! 1. Keep, next to the data, the highest token accepted for each lock.
//! 2. On **every** write, in the **same atomic transaction** as the write: refuse a token
//!    lower than the highest; otherwise write and raise the highest to this token.
//!
//! A new holder should make its first act a write (even an empty one) that raises the
//! high-water mark, so nothing from the old holder can land after it started.
//!
//! [`admit`] is the check; `examples/fenced_resource.rs` shows it inside a fjall write
//! transaction. A resource that cannot store tokens can ask the cell instead
//! ([`crate::Session::check_sequencer`]), at the cost of a round trip and a race window
//! between the check and the write.

/// A write carried a token lower than one the resource already accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stale fencing token {token}: the resource already accepted {highest}")]
pub struct StaleToken {
    /// The refused token.
    pub token: u64,
    /// The highest token accepted so far.
    pub highest: u64,
}

/// Decides a write: `highest` is the highest token accepted for the lock (`None` if none
/// yet). Returns the new highest to store with the write, or [`StaleToken`].
pub fn admit(highest: Option<u64>, token: u64) -> Result<u64, StaleToken> {
    match highest {
        Some(h) if token < h => Err(StaleToken { token, highest: h }),
        _ => Ok(token),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_tokens_are_refused() {
        assert_eq!(admit(None, 5), Ok(5));
        assert_eq!(admit(Some(5), 5), Ok(5), "the holder writes again");
        assert_eq!(admit(Some(5), 9), Ok(9));
        assert_eq!(
            admit(Some(9), 5),
            Err(StaleToken {
                token: 5,
                highest: 9
            })
        );
    }
}
