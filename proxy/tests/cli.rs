//! The `proxy` binary as an operator meets it: `--help`, and a configuration it cannot use
//! refused at once (exit 2) with a message naming the file and the problem, before any
//! socket is opened. (Also makes `cargo test` build `target/debug/proxy`, which
//! `ops/tests/deploy.rs` asks for its flags.)

use std::process::{Command, Output};

fn proxy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_proxy"))
        .args(args)
        .output()
        .expect("the proxy binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn help_names_the_configuration_and_its_environment_overrides() {
    let o = proxy(&["--help"]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("--config"), "{out}");
    assert!(out.contains("LOCKSVC_PROXY__"), "{out}");
}

#[test]
fn a_configuration_it_cannot_use_is_refused_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let o = proxy(&["--config", missing.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("missing.toml") && stderr(&o).contains("not found"),
        "{}",
        stderr(&o)
    );

    let garbage = dir.path().join("garbage.toml");
    std::fs::write(&garbage, "replicas = [\n").unwrap();
    let o = proxy(&["--config", garbage.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("TOML parse error"), "{}", stderr(&o));

    let wrong_type = dir.path().join("wrong.toml");
    std::fs::write(&wrong_type, "max_clients = \"many\"\n").unwrap();
    let o = proxy(&["--config", wrong_type.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("max_clients"), "{}", stderr(&o));

    // No configuration at all: clap's usage error, not a panic.
    let o = proxy(&[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--config"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}
