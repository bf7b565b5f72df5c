//! The `directory` binary as an operator meets it: `--help` lists every flag with its
//! environment variable, and arguments it cannot use are refused with a message naming
//! the problem and a non-zero exit, never a panic. (Also makes `cargo test` build
//! `target/debug/directory`, which `ops/tests/deploy.rs` asks for its flags.)

use std::process::{Command, Output};

fn directory(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_directory"))
        .args(args)
        .env_remove("DIRECTORY_LISTEN")
        .env_remove("DIRECTORY_ROOT")
        .output()
        .expect("the directory binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn help_lists_every_flag_and_its_environment_variable() {
    let o = directory(&["--help"]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    for (flag, env) in [
        ("--listen", "DIRECTORY_LISTEN"),
        ("--root", "DIRECTORY_ROOT"),
        ("--ca", "DIRECTORY_CA"),
        ("--cert", "DIRECTORY_CERT"),
        ("--key", "DIRECTORY_KEY"),
        ("--metrics-listen", "DIRECTORY_METRICS_LISTEN"),
    ] {
        assert!(
            out.contains(flag) && out.contains(env),
            "{flag} {env}: {out}"
        );
    }
}

#[test]
fn arguments_it_cannot_use_are_refused_with_their_reason() {
    // Not a socket address: clap's usage error (exit 2) naming the flag.
    let o = directory(&[
        "--listen",
        "here",
        "--root",
        "127.0.0.1:1",
        "--ca",
        "a",
        "--cert",
        "b",
        "--key",
        "c",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--listen"), "{}", stderr(&o));

    // TLS files that are not there: exit 1, the file named, before serving anything.
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    let o = directory(&[
        "--listen",
        "127.0.0.1:0",
        "--root",
        "127.0.0.1:1",
        "--ca",
        ca.to_str().unwrap(),
        "--cert",
        "b.pem",
        "--key",
        "c.key",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("ca.pem") && stderr(&o).contains("No such file"),
        "{}",
        stderr(&o)
    );
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}
