//! Named bounds, each with the reason for its number.

/// Largest node value in bytes. Chubby-style cells hold small config and lock data only;
/// 64 KiB keeps the whole namespace (~100k nodes) around 100 MB in memory.
pub const VALUE_BYTES_MAX: usize = 65_536;

/// Longest path in bytes. Long enough for deep hierarchies, short enough that a list of
/// 2 000 lock waiters stays a few hundred kilobytes.
pub const PATH_BYTES_MAX: usize = 1_024;

/// Largest frame a client may send or receive. A transaction may carry several values,
/// and a children listing of a busy lock several thousand names: 4 MiB covers both.
pub const CLIENT_FRAME_BYTES_MAX: usize = 4 * 1024 * 1024;

/// Largest frame between replicas. AppendEntries batches and snapshot chunks (openraft's
/// `snapshot_max_chunk_size`, which the replica sets to 4 MiB) must fit.
pub const PEER_FRAME_BYTES_MAX: usize = 64 * 1024 * 1024;

/// Bytes the requests of one client (or proxy) connection may hold at once at a server,
/// by default, while they are read, decoded and answered (`wire::frame::Budget`): room for
/// the largest request (a 4 MiB frame and the 16 MiB its sequences may decode to) and
/// more. A proxy forwarding a cell's whole write load on one connection holds far less:
/// 2 000 writes a second of 64 KiB values, each in flight a few milliseconds, is about
/// 1 MiB. A connection that reaches it waits (QUIC's flow control holds its sender back).
pub const CLIENT_CONNECTION_BYTES_MAX: usize = 32 * 1024 * 1024;

/// Bytes the RPCs of one peer connection may hold at once at a replica, by default: one
/// peer frame and what it may decode to (a peer's client makes one RPC at a time).
pub const PEER_CONNECTION_BYTES_MAX: usize = 2 * PEER_FRAME_BYTES_MAX;

/// Connections a server accepts at once, by default, handshakes included (more are
/// refused before their handshake): a cell's ~25 proxies and the clients that connect
/// directly, with room. With [`CLIENT_CONNECTION_BYTES_MAX`] and QUIC's 8 MiB receive
/// window per connection this bounds what connections can make a replica hold.
pub const CONNECTIONS_MAX: usize = 4_096;

/// Connections a server accepts from one source IP address at once, by default: a host
/// running many client processes, or a proxy host, with room; one misbehaving host cannot
/// take every place.
pub const CONNECTIONS_PER_SOURCE_MAX: usize = 256;

/// Largest number of operations in one transaction: keeps one log entry bounded.
pub const TXN_OPS_MAX: usize = 128;

/// Largest number of unacknowledged write results the cell remembers per session for
/// deduplication. A result is forgotten only once the client acknowledged it (`ack_below`);
/// a request that would exceed the window is refused unapplied. The SDK keeps its
/// request ids within half of it.
pub const DEDUP_RESULTS_MAX: usize = 64;

/// Largest number of ended sessions the state machine remembers, so that a late request
/// from an expired session gets `SessionExpired` rather than `UnknownSession`.
pub const ENDED_SESSIONS_MAX: usize = 100_000;

/// Largest number of watches re-armed by one `Rewatch` request.
pub const REWATCH_MAX: usize = 10_000;

/// Path bytes a re-arming client puts in one `Rewatch` request, at most (a quarter of a
/// frame; see [`crate::types::rewatch_chunks`]).
pub const REWATCH_PATH_BYTES_MAX: usize = CLIENT_FRAME_BYTES_MAX / 4;

/// Largest number of sessions renewed by one `KeepAliveBatch`: a proxy of ~2 000 clients
/// sends one batch a second; 10 000 ids are 80 KB, well inside a frame.
pub const KEEPALIVE_BATCH_MAX: usize = 10_000;

/// An invalidation unacknowledged for this long (ms) is repeated in the session's
/// KeepAlive replies. Longer than an event-stream round trip, so a healthy stream's
/// acknowledgement normally arrives first and nothing is sent twice.
pub const INVALIDATION_RESEND_MS: u64 = 1_000;

/// Unacknowledged invalidations carried by one KeepAlive reply for one session, at most
/// (the oldest first; the rest come with later KeepAlives).
pub const KEEPALIVE_UNACKED_MAX: usize = 64;

/// Bytes of paths (with a few bytes of overhead each) the unacknowledged invalidations of
/// one KeepAlive reply (or batch reply) carry, at most: a prefix-wide hold names every
/// node cached under it, which could otherwise outgrow [`CLIENT_FRAME_BYTES_MAX`]. An
/// invalidation left out is sent again on the event stream, or waited out with the lease.
pub const KEEPALIVE_UNACKED_BYTES_MAX: usize = 256 * 1024;

/// How much faster, at most, a replica's clock may run than a client's, in parts per
/// thousand. A client (or proxy) counts its local lease as the cell's lease shortened by
/// this share ([`local_lease`]), so it stops trusting its lease and its cache before the
/// leader can expire the session even when the leader's clock runs that much fast
/// (Chubby's conservative client lease). 25 ‰ is 300 ms of a 12 s lease.
pub const CLOCK_DRIFT_PERMILLE_MAX: u32 = 25;

/// The lease a client may count on locally for a lease of `lease` at the cell: shortened
/// by [`CLOCK_DRIFT_PERMILLE_MAX`].
pub fn local_lease(lease: std::time::Duration) -> std::time::Duration {
    lease * (1_000 - CLOCK_DRIFT_PERMILLE_MAX) / 1_000
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn local_lease_ends_before_the_cells_even_on_a_fast_cell_clock() {
        let lease = Duration::from_secs(12);
        assert_eq!(local_lease(lease), Duration::from_millis(11_700));
        // A cell clock 2.5 % fast ends the lease after 12 s / 1.025 of real time.
        let cell_real = lease.as_secs_f64() / 1.025;
        assert!(local_lease(lease).as_secs_f64() <= cell_real + 1e-9);
    }
}
