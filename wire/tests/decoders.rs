//! Every decoder a remote party reaches, fed random and mutated frames (issue 22, item 4):
//! a server decodes `Hello` and `Request` (client ALPN), `Hello` and `PeerRequest`, with
//! the `Command`s inside its AppendEntries (peer ALPN); a client (the SDK, a proxy's
//! upstream, a replica dialing a peer) decodes `HelloReply`, `Response` and
//! `PeerResponse`. Each decode must return a value or a typed error, never panic, and
//! never allocate beyond what the input can pay for: this binary counts the heap each
//! thread holds (its global allocator), so a length field mutated to claim a billion
//! elements shows up as the allocation it would cost.
//!
//! The frame reader is held to the same: a header claiming the largest frame followed by
//! a few bytes allocates a few bytes, not the claimed length.
//!
//! Case counts are bounded (`DECODER_CASES`, 512 per decoder by default) so CI stays
//! fast; `PROPTEST_CASES` overrides as usual.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};

use openraft::{EntryPayload, Membership};
use proptest::prelude::*;
use wire::command::{Command, LeaseCheckpoint};
use wire::hello::{Hello, HelloOk, HelloReply};
use wire::raft::{Binding, LogId, Member, Vote};
use wire::raft::{PeerRequest, PeerResponse};
use wire::types::*;
use wire::{Error, CLIENT_FRAME_BYTES_MAX, PEER_FRAME_BYTES_MAX};

/// Counts the bytes each thread holds and the most it held since [`reset_peak`].
struct Counting;

thread_local! {
    static HELD: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = HELD.try_with(|h| {
        let now = h.get() + delta;
        h.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size() as isize);
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size() as isize);
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        note(-(l.size() as isize));
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new as isize - l.size() as isize);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result and the most heap this thread held above what it held
/// when `f` started.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = HELD.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    let peak = PEAK.with(Cell::get) - base;
    (r, peak.max(0) as usize)
}

/// What a decode of `n` input bytes may allocate: every sequence element takes at least a
/// byte of input and at most 512 bytes of memory (asserted below for the largest ones),
/// plus a little for the decoder itself. Without the bounded decoder a mutated length
/// makes serde preallocate up to 1 MiB per sequence whatever the input.
fn alloc_bound(n: usize) -> usize {
    64 * 1024 + 512 * n
}

fn cases() -> u32 {
    std::env::var("DECODER_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512)
}

fn log_id(term: u64, index: u64) -> LogId {
    LogId::new(wire::raft::LeaderId { term, node_id: 1 }, index)
}

fn write(session: u64) -> Command {
    Command::Write {
        session,
        request_id: 4,
        ack_below: 2,
        ops: vec![
            TxnOp::Create {
                path: "/locks/a/lock-".into(),
                data: b"holder".to_vec(),
                mode: CreateMode {
                    ephemeral: true,
                    sequential: true,
                },
            },
            TxnOp::Check {
                path: "/cfg".into(),
                version: Some(3),
            },
            TxnOp::SetData {
                path: "/cfg".into(),
                data: vec![7; 40],
                version: None,
            },
            TxnOp::Delete {
                path: "/old".into(),
                version: Some(1),
            },
        ],
        single: false,
    }
}

/// Valid encodings of every message kind, the seeds the mutations start from.
fn commands() -> Vec<Command> {
    vec![
        Command::Noop,
        Command::CreateSession {
            owner: "lock://client/test".into(),
        },
        Command::CloseSession { session: 1 << 40 },
        Command::ExpireSessions {
            sessions: vec![1, 2, 3 << 30],
        },
        write(9),
        Command::LeaseCheckpoint(LeaseCheckpoint {
            mark_all: true,
            renewed: vec![5, 6],
            silent_add_ms: 1_000,
        }),
        Command::MarkCacher { session: 12 },
        Command::Held {
            term: 4,
            command: Box::new(write(10)),
        },
        Command::Batch(vec![
            Command::CreateSession {
                owner: "lock://client/test".into(),
            },
            Command::Held {
                term: 4,
                command: Box::new(write(11)),
            },
            write(12),
        ]),
    ]
}

fn requests() -> Vec<Request> {
    let ops = vec![
        Op::CreateSession,
        Op::KeepAlive,
        Op::KeepAliveBatch {
            sessions: vec![1, 1 << 33],
        },
        Op::Create {
            path: "/a".into(),
            data: b"xy".to_vec(),
            mode: CreateMode::default(),
        },
        Op::SetData {
            path: "/a".into(),
            data: vec![1; 30],
            version: Some(2),
        },
        Op::Get {
            path: "/a".into(),
            watch: true,
        },
        Op::Txn {
            ops: match write(1) {
                Command::Write { ops, .. } => ops,
                _ => unreachable!(),
            },
        },
        Op::Rewatch {
            watches: vec![WatchSpec {
                path: "/w".into(),
                kind: WatchKind::Exists,
                since_index: 40,
            }],
        },
        Op::CheckSequencer {
            path: "/l/x".into(),
            token: 99,
            session: 3,
        },
        Op::AckInvalidationsBatch {
            acks: vec![(1, vec![2, 3]), (4, vec![])],
        },
        Op::AddLearner {
            id: 4,
            addr: "127.0.0.1:7104".into(),
        },
    ];
    ops.into_iter()
        .enumerate()
        .map(|(i, op)| Request {
            session: 1 << 20,
            request_id: i as u64,
            ack_below: 0,
            op,
        })
        .collect()
}

fn stat() -> NodeStat {
    NodeStat {
        version: 1,
        children_version: 2,
        create_index: 3,
        mod_index: 4,
        ephemeral_owner: Some(5),
        data_len: 6,
        children_count: 7,
        token: 1,
    }
}

fn responses() -> Vec<Response> {
    vec![
        Ok(Reply::Created {
            path: "/l/lock-0000000001".into(),
            stat: stat(),
            predecessor: Some(Predecessor {
                name: "lock-0000000000".into(),
                create_index: 8,
            }),
        }),
        Ok(Reply::Children {
            stat: stat(),
            children: vec![("a".into(), stat()), ("b".into(), stat())],
            index: 40,
        }),
        Ok(Reply::KeepAliveBatch {
            session_lease_ms: 12_000,
            renewed: vec![1, 2],
            expired: vec![3],
            unknown: vec![],
            unacknowledged: vec![(1, 7, vec!["/c".into()])],
        }),
        Ok(Reply::Event(WatchEvent {
            path: "/w".into(),
            kind: WatchKind::Data,
            event: EventType::Deleted,
            index: 77,
        })),
        Err(Error::TxnFailed {
            index: 1,
            error: Box::new(Error::BadVersion {
                path: "/cfg".into(),
                expected: 1,
                actual: 2,
            }),
        }),
        Err(Error::NotLeader {
            leader_id: Some(2),
            leader_addr: Some("127.0.0.1:7102".into()),
        }),
    ]
}

fn membership() -> Membership<u64, Member> {
    let voters: BTreeSet<u64> = [1, 2, 3].into();
    let stores = [
        Binding::Unbound,
        Binding::Pending,
        Binding::Bound(wire::store::StoreId([9; 16])),
    ];
    let nodes: BTreeMap<u64, Member> = [1u64, 2, 3]
        .into_iter()
        .zip(stores)
        .map(|(i, store)| {
            (
                i,
                Member {
                    addr: format!("127.0.0.1:71{i:02}"),
                    store,
                },
            )
        })
        .collect();
    Membership::new(vec![voters], nodes).expect("membership")
}

fn peer_requests() -> Vec<PeerRequest> {
    let mut entries: Vec<wire::raft::Entry> = commands()
        .into_iter()
        .enumerate()
        .map(|(i, c)| openraft::Entry {
            log_id: log_id(2, 10 + i as u64),
            payload: EntryPayload::Normal(c),
        })
        .collect();
    entries.push(openraft::Entry {
        log_id: log_id(2, 30),
        payload: EntryPayload::Membership(membership()),
    });
    entries.push(openraft::Entry {
        log_id: log_id(2, 31),
        payload: EntryPayload::Blank,
    });
    vec![
        PeerRequest::AppendEntries(openraft::raft::AppendEntriesRequest {
            vote: Vote::new_committed(2, 1),
            prev_log_id: Some(log_id(2, 9)),
            entries,
            leader_commit: Some(log_id(2, 9)),
        }),
        PeerRequest::Vote(openraft::raft::VoteRequest::new(
            Vote::new(3, 2),
            Some(log_id(2, 31)),
        )),
        PeerRequest::InstallSnapshot,
        PeerRequest::Probe,
        PeerRequest::Snapshot(wire::raft::SnapshotOffer {
            vote: Vote::new_committed(2, 1),
            meta: openraft::SnapshotMeta {
                last_log_id: Some(log_id(2, 31)),
                last_membership: openraft::StoredMembership::new(Some(log_id(2, 30)), membership()),
            },
            id: "2-31-7".into(),
            bytes: 64,
        }),
        PeerRequest::TransferLeader(openraft::raft::TransferLeaderRequest::new(
            Vote::new_committed(2, 1),
            3,
            Some(log_id(2, 31)),
        )),
    ]
}

fn peer_responses() -> Vec<PeerResponse> {
    vec![
        PeerResponse::AppendEntries(Ok(openraft::raft::AppendEntriesResponse::Success)),
        PeerResponse::AppendEntries(Ok(openraft::raft::AppendEntriesResponse::HigherVote(
            Vote::new(5, 3),
        ))),
        PeerResponse::Vote(Ok(openraft::raft::VoteResponse::new(
            Vote::new(3, 2),
            Some(log_id(2, 31)),
            true,
        ))),
        PeerResponse::InstallSnapshot,
        PeerResponse::Snapshot(Ok(openraft::raft::SnapshotResponse::new(
            Vote::new_committed(2, 1),
        ))),
        PeerResponse::TransferLeader(Ok(Ok(()))),
        PeerResponse::Refused(Error::Malformed { reason: "x".into() }),
        PeerResponse::Probe(wire::raft::PeerState {
            initialized: true,
            term: 4,
            last_log_index: Some(31),
        }),
    ]
}

fn hello_replies() -> Vec<HelloReply> {
    vec![
        Ok(HelloOk {
            protocol_version: wire::PROTOCOL_VERSION,
            replica_id: 3,
            proxy: false,
            store: Some(wire::store::StoreId([7; 16])),
        }),
        Err(Error::ProtocolVersion {
            client: 1,
            server: wire::PROTOCOL_VERSION,
        }),
    ]
}

fn encodings<T: serde::Serialize>(msgs: &[T]) -> Vec<Vec<u8>> {
    msgs.iter()
        .map(|m| postcard::to_allocvec(m).expect("encode"))
        .collect()
}

/// The decoders a remote party reaches, by name: each decodes a frame body as a server or
/// client does (`frame::decode` with that protocol's frame cap).
type Decoder = fn(&[u8]) -> Result<(), Error>;

fn decoders() -> Vec<(&'static str, Decoder, Vec<Vec<u8>>)> {
    macro_rules! dec {
        ($t:ty, $max:expr) => {
            |b: &[u8]| wire::frame::decode::<$t>(b, $max).map(|_| ())
        };
    }
    vec![
        (
            "Hello",
            dec!(Hello, wire::frame::HELLO_BYTES_MAX) as Decoder,
            encodings(&[Hello::new("client-sdk 0.1.0"), Hello::new("")]),
        ),
        (
            "Request",
            dec!(Request, CLIENT_FRAME_BYTES_MAX),
            encodings(&requests()),
        ),
        (
            "PeerRequest",
            dec!(PeerRequest, PEER_FRAME_BYTES_MAX),
            encodings(&peer_requests()),
        ),
        (
            "Command",
            dec!(Command, PEER_FRAME_BYTES_MAX),
            encodings(&commands()),
        ),
        (
            "HelloReply",
            dec!(HelloReply, wire::frame::HELLO_BYTES_MAX),
            encodings(&hello_replies()),
        ),
        (
            "Response",
            dec!(Response, CLIENT_FRAME_BYTES_MAX),
            encodings(&responses()),
        ),
        (
            "PeerResponse",
            dec!(PeerResponse, PEER_FRAME_BYTES_MAX),
            encodings(&peer_responses()),
        ),
    ]
}

/// One mutation of a valid encoding.
#[derive(Debug, Clone)]
enum Mutation {
    /// Overwrite the byte at (index mod len).
    Set(usize, u8),
    /// Insert bytes at (index mod len): a varint claiming a huge length, say.
    Insert(usize, Vec<u8>),
    /// Remove (count) bytes at (index mod len).
    Remove(usize, usize),
    /// Keep only the first (index mod len) bytes.
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let huge = prop_oneof![
        Just(vec![0xff, 0xff, 0xff, 0xff, 0x0f]),
        Just(vec![0x80, 0x94, 0xeb, 0xdc, 0x03]),
        proptest::collection::vec(any::<u8>(), 1..8),
    ];
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        2 => (any::<usize>(), huge).prop_map(|(i, v)| Mutation::Insert(i, v)),
        1 => (any::<usize>(), 1..16usize).prop_map(|(i, n)| Mutation::Remove(i, n)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(mut bytes: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        let len = bytes.len().max(1);
        match m {
            Mutation::Set(i, b) => {
                if !bytes.is_empty() {
                    bytes[i % len] = *b;
                }
            }
            Mutation::Insert(i, v) => {
                let at = i % (bytes.len() + 1);
                bytes.splice(at..at, v.iter().copied());
            }
            Mutation::Remove(i, n) => {
                if !bytes.is_empty() {
                    let at = i % len;
                    let end = (at + n).min(bytes.len());
                    bytes.drain(at..end);
                }
            }
            Mutation::Truncate(i) => bytes.truncate(i % len),
        }
    }
    bytes
}

/// The outcome every decoder must have on any input: a value, or one of the typed errors
/// that mean "not a valid message" or "past a bound", within [`alloc_bound`].
fn check(name: &str, dec: Decoder, input: &[u8]) -> Result<(), TestCaseError> {
    let (r, peak) = peak_of(|| dec(input));
    match r {
        Ok(()) | Err(Error::Malformed { .. }) | Err(Error::LimitExceeded { .. }) => {}
        Err(e) => {
            return Err(TestCaseError::fail(format!(
                "{name}: untyped outcome {e:?}"
            )))
        }
    }
    prop_assert!(
        peak <= alloc_bound(input.len()),
        "{name}: decoding {} bytes allocated {peak} bytes (bound {})",
        input.len(),
        alloc_bound(input.len())
    );
    Ok(())
}

#[test]
fn every_seed_decodes() {
    for (name, dec, seeds) in decoders() {
        for s in seeds {
            assert_eq!(dec(&s), Ok(()), "{name}: a valid encoding must decode");
        }
    }
    // The element sizes alloc_bound counts on.
    assert!(std::mem::size_of::<wire::raft::Entry>() <= 512);
    assert!(std::mem::size_of::<Command>() <= 512);
    assert!(std::mem::size_of::<TxnOp>() <= 512);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Valid encodings with a few mutations each, for every decoder.
    #[test]
    fn mutated_frames_get_a_value_or_a_typed_error(
        which in any::<usize>(),
        seed in any::<usize>(),
        muts in proptest::collection::vec(mutation(), 1..6),
    ) {
        let decs = decoders();
        let (name, dec, seeds) = &decs[which % decs.len()];
        let input = apply(seeds[seed % seeds.len()].clone(), &muts);
        check(name, *dec, &input)?;
    }

    /// Random bytes, for every decoder.
    #[test]
    fn random_frames_get_a_value_or_a_typed_error(
        bytes in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        for (name, dec, _) in decoders() {
            check(name, dec, &bytes)?;
        }
    }
}

/// A length varint claiming a billion elements, with a few bytes behind it, in every
/// sequence position a peer reaches: the decode allocates about what the input holds, not
/// serde's 1 MiB preallocation (nor the billion).
#[test]
fn a_claimed_length_preallocates_nothing_near_it() {
    // ExpireSessions { sessions: [billion claimed, 3 given] }.
    let mut b = vec![3u8, 0x80, 0x94, 0xeb, 0xdc, 0x03, 1, 2, 3];
    let (r, peak) = peak_of(|| wire::frame::decode::<Command>(&b, PEER_FRAME_BYTES_MAX));
    assert!(matches!(r, Err(Error::Malformed { .. })), "{r:?}");
    assert!(peak <= alloc_bound(b.len()), "allocated {peak}");
    b.truncate(1);
    assert!(wire::frame::decode::<Command>(&b, PEER_FRAME_BYTES_MAX).is_err());
}

/// The frame reader given a header claiming the largest frame and then a few bytes:
/// it allocates about what arrived, not the claimed length (before: `vec![0; len]`, the
/// whole 4 MiB or 64 MiB at once).
#[test]
fn a_claimed_frame_length_is_not_allocated_up_front() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for max in [CLIENT_FRAME_BYTES_MAX, PEER_FRAME_BYTES_MAX] {
        let mut input = (max as u32).to_be_bytes().to_vec();
        input.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let (r, peak) = peak_of(|| {
            rt.block_on(async {
                let mut reader = &input[..];
                wire::frame::read_body(&mut reader, max).await
            })
        });
        assert!(matches!(r, Err(Error::Malformed { .. })), "{r:?}");
        assert!(
            peak <= 2 * wire::frame::READ_CHUNK_BYTES,
            "a frame claiming {max} bytes with 8 given allocated {peak} bytes"
        );
        println!("FIGURE bounds: a header claiming {max} bytes, 8 given: the reader allocated {peak} bytes");
    }
}

/// An error nested 100 000 deep in a `Response` (`TxnFailed` in `TxnFailed` ...), which a
/// client decodes from whatever answers at a server's address: refused at the nesting
/// bound on a thread with a 256 KiB stack. Before the bounded decoder it recursed once per
/// level and overflowed any stack.
#[test]
fn a_deeply_nested_error_is_refused_on_a_small_stack() {
    // Err (1), then TxnFailed (variant 18) { index: 0, error: ... } ..., then SessionRequired (13).
    let mut b = vec![1u8];
    b.extend([18u8, 0].repeat(100_000));
    b.push(13);
    let r = std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(move || wire::frame::decode::<Response>(&b, CLIENT_FRAME_BYTES_MAX))
        .unwrap()
        .join()
        .expect("the decoding thread survived");
    assert_eq!(
        r.unwrap_err(),
        Error::LimitExceeded {
            bound: wire::Bound::NestingDepth,
            limit: wire::decode::DEPTH_MAX as u64
        }
    );
    // A shallow one decodes.
    let ok = postcard::to_allocvec(&responses()[4]).unwrap();
    assert!(wire::frame::decode::<Response>(&ok, CLIENT_FRAME_BYTES_MAX).is_ok());
}
