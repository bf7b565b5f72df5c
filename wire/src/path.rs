//! Path validation, shared by the client (to fail early) and the state machine (to be sure).

use crate::error::Error;
use crate::limits::{
    KEEPALIVE_BATCH_MAX, PATH_BYTES_MAX, REWATCH_MAX, TXN_OPS_MAX, VALUE_BYTES_MAX,
};
use crate::types::{SessionId, TxnOp, WatchSpec};

/// Digits of the sequence suffix the cell appends to sequential nodes.
pub const SEQUENCE_DIGITS: usize = 10;

/// Checks that `path` is a valid node path: absolute, at most [`PATH_BYTES_MAX`] bytes, no
/// empty, `.` or `..` components, no trailing slash (except the root `/` itself), and no
/// control characters.
pub fn validate(path: &str) -> Result<(), Error> {
    let bad = |reason: &str| {
        Err(Error::InvalidPath {
            path: truncate(path),
            reason: reason.into(),
        })
    };
    if path.is_empty() {
        return bad("empty path");
    }
    if path.len() > PATH_BYTES_MAX {
        return bad(&format!("longer than {PATH_BYTES_MAX} bytes"));
    }
    if !path.starts_with('/') {
        return bad("not absolute (must start with '/')");
    }
    if path == "/" {
        return Ok(());
    }
    if path.ends_with('/') {
        return bad("trailing '/'");
    }
    for component in path[1..].split('/') {
        match component {
            "" => return bad("empty component ('//')"),
            "." | ".." => return bad("'.' and '..' components are not allowed"),
            _ => {}
        }
        if component.chars().any(|c| c.is_control()) {
            return bad("control character in path");
        }
    }
    Ok(())
}

/// Checks an `AckInvalidationsBatch` request: at most [`KEEPALIVE_BATCH_MAX`] sessions,
/// none of them 0 (`SessionRequired`) and each with at least one id.
pub fn validate_ack_batch(acks: &[(SessionId, Vec<u64>)]) -> Result<(), Error> {
    if acks.len() > KEEPALIVE_BATCH_MAX {
        return Err(Error::BadRequest {
            reason: format!(
                "{} sessions exceed the batch maximum of {KEEPALIVE_BATCH_MAX}",
                acks.len()
            ),
        });
    }
    if acks.iter().any(|(s, _)| *s == 0) {
        return Err(Error::SessionRequired);
    }
    if let Some((s, _)) = acks.iter().find(|(_, ids)| ids.is_empty()) {
        return Err(Error::BadRequest {
            reason: format!("session {s} acknowledges no invalidation"),
        });
    }
    Ok(())
}

/// Checks a `KeepAliveBatch` request: at most [`KEEPALIVE_BATCH_MAX`] sessions, none of
/// them 0.
pub fn validate_keepalive_batch(sessions: &[SessionId]) -> Result<(), Error> {
    if sessions.len() > KEEPALIVE_BATCH_MAX {
        return Err(Error::BadRequest {
            reason: format!(
                "{} sessions exceed the batch maximum of {KEEPALIVE_BATCH_MAX}",
                sessions.len()
            ),
        });
    }
    if sessions.contains(&0) {
        return Err(Error::SessionRequired);
    }
    Ok(())
}

/// Checks a `Rewatch` request: at most [`REWATCH_MAX`] watches, every path valid.
pub fn validate_rewatch(watches: &[WatchSpec]) -> Result<(), Error> {
    if watches.len() > REWATCH_MAX {
        return Err(Error::BadRequest {
            reason: format!(
                "{} watches exceed the maximum of {}",
                watches.len(),
                REWATCH_MAX
            ),
        });
    }
    watches.iter().try_for_each(|w| validate(&w.path))
}

/// Checks what can be checked of a write without the namespace: the number of ops, every
/// path (with the full sequence suffix for sequential creates) and every value size. The
/// gateway runs it before proposing, so bad input never reaches the log; apply runs it
/// again, so the log's outcome never depends on the gateway. A failure inside a
/// transaction is reported as `TxnFailed` at that op.
pub fn validate_write(ops: &[TxnOp], single: bool) -> Result<(), Error> {
    if ops.is_empty() {
        return Err(Error::BadRequest {
            reason: "empty transaction".into(),
        });
    }
    if ops.len() > TXN_OPS_MAX {
        return Err(Error::BadRequest {
            reason: format!("{} ops exceed the maximum of {}", ops.len(), TXN_OPS_MAX),
        });
    }
    for (i, op) in ops.iter().enumerate() {
        let checked = match op {
            TxnOp::Check { path: p, .. } | TxnOp::Delete { path: p, .. } => validate(p),
            TxnOp::SetData { path: p, data, .. } => validate(p).and_then(|_| check_value(data)),
            TxnOp::Create {
                path: p,
                data,
                mode,
            } => validate_create(p, data, *mode),
        };
        if let Err(e) = checked {
            return Err(if single {
                e
            } else {
                Error::TxnFailed {
                    index: i,
                    error: Box::new(e),
                }
            });
        }
    }
    Ok(())
}

/// Checks a create: the path (with a full-width sequence suffix when sequential, so the
/// final name is valid too) and the value's size.
pub fn validate_create(p: &str, data: &[u8], mode: crate::types::CreateMode) -> Result<(), Error> {
    if mode.sequential {
        validate(&format!("{p}{}", "0".repeat(SEQUENCE_DIGITS)))?;
    } else {
        validate(p)?;
    }
    check_value(data)
}

/// Checks a value's size against [`VALUE_BYTES_MAX`].
pub fn check_value(data: &[u8]) -> Result<(), Error> {
    if data.len() > VALUE_BYTES_MAX {
        return Err(Error::ValueTooLarge {
            len: data.len(),
            max: VALUE_BYTES_MAX,
        });
    }
    Ok(())
}

/// The parent of a valid, non-root path.
pub fn parent(path: &str) -> &str {
    match path.rfind('/') {
        Some(0) | None => "/",
        Some(i) => &path[..i],
    }
}

/// The last component of a valid, non-root path.
pub fn name(path: &str) -> &str {
    match path.rfind('/') {
        Some(i) => &path[i + 1..],
        None => path,
    }
}

/// Joins a parent path and a child name.
pub fn join(parent: &str, name: &str) -> String {
    if parent == "/" {
        format!("/{name}")
    } else {
        format!("{parent}/{name}")
    }
}

fn truncate(path: &str) -> String {
    if path.len() <= 128 {
        return path.to_string();
    }
    let mut end = 128;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &path[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_batches_are_bounded_and_name_real_sessions() {
        assert!(validate_ack_batch(&[]).is_ok());
        assert!(validate_ack_batch(&[(3, vec![1, 2]), (4, vec![9])]).is_ok());
        assert!(matches!(
            validate_ack_batch(&[(3, vec![1]), (0, vec![1])]),
            Err(Error::SessionRequired)
        ));
        let err = validate_ack_batch(&[(3, vec![1]), (5, vec![])]).unwrap_err();
        assert!(err.to_string().contains("session 5"), "{err}");
        let too_many: Vec<(SessionId, Vec<u64>)> = (1..=KEEPALIVE_BATCH_MAX as u64 + 1)
            .map(|s| (s, vec![1]))
            .collect();
        let err = validate_ack_batch(&too_many).unwrap_err().to_string();
        assert!(err.contains("batch maximum"), "{err}");
    }

    #[test]
    fn accepts_and_rejects() {
        for ok in ["/", "/a", "/a/b", "/locks/db-1", "/ünï"] {
            assert!(validate(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a", "/a/", "//", "/a//b", "/./a", "/a/..", "/a\n"] {
            assert!(
                matches!(validate(bad), Err(Error::InvalidPath { .. })),
                "{bad:?}"
            );
        }
        let long = format!("/{}", "x".repeat(PATH_BYTES_MAX));
        assert!(validate(&long).is_err());
    }

    #[test]
    fn parent_name_join() {
        assert_eq!(parent("/a"), "/");
        assert_eq!(parent("/a/b"), "/a");
        assert_eq!(name("/a/b"), "b");
        assert_eq!(join("/", "a"), "/a");
        assert_eq!(join("/a", "b"), "/a/b");
    }
}
