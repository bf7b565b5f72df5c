//! The operations crate's library part: what the fault-injection suite shares between its
//! tiers (histories and checkers). The `lockctl` binary lives in `main.rs`.

pub mod checkers;
