//! The deployment files under `ops/deploy/` (issue 28), checked offline: the Kubernetes
//! manifests render with `kubectl kustomize` into what `docs/operations.md` promises;
//! every configuration key they hold is one the binaries read; every flag and
//! environment variable the manifests, the systemd units and the Dockerfile pass is one
//! the binaries take.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/");

/// A server binary built beside `lockctl`: `cargo test --workspace` builds a package's
/// binaries for its integration tests (`replica/tests`, `proxy/tests/cli.rs`,
/// `directory/tests/cli.rs`); without those, CI's clean clone had no `proxy` binary.
fn binary(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_lockctl"))
        .parent()
        .unwrap()
        .join(name);
    assert!(
        p.exists(),
        "{} is not built (cargo build --workspace --bins builds every server)",
        p.display()
    );
    p
}

fn help(name: &str) -> String {
    let o = Command::new(binary(name)).arg("--help").output().unwrap();
    assert!(o.status.success(), "{name} --help failed");
    String::from_utf8(o.stdout).unwrap()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(format!("{DEPLOY}{rel}")).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every key path of a TOML value (`a.b`, arrays of tables as `a[].b`).
fn key_paths(v: &toml::Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.insert(p.clone());
                key_paths(v, &p, out);
            }
        }
        toml::Value::Array(a) => {
            for v in a.iter().filter(|v| v.is_table()) {
                key_paths(v, &format!("{prefix}[]"), out);
            }
        }
        _ => {}
    }
}

/// Checks that `file` (TOML) holds only keys `T` reads: deserialized into `T` and
/// serialized back, no key of the file may be missing (serde ignores unknown keys, so a
/// misspelt one would otherwise pass unnoticed).
fn only_known_keys<T: serde::de::DeserializeOwned + serde::Serialize>(file: &str, text: &str) -> T {
    let raw: toml::Value = toml::from_str(text).unwrap_or_else(|e| panic!("{file}: {e}"));
    let cfg: T = toml::from_str(text).unwrap_or_else(|e| panic!("{file}: {e}"));
    let back = toml::Value::try_from(&cfg).unwrap();
    let (mut used, mut known) = (BTreeSet::new(), BTreeSet::new());
    key_paths(&raw, "", &mut used);
    key_paths(&back, "", &mut known);
    let unknown: Vec<_> = used.difference(&known).collect();
    assert!(
        unknown.is_empty(),
        "{file}: keys no binary reads: {unknown:?}"
    );
    cfg
}

/// The config key an environment override names (`LOCKSVC_REPLICA__SESSION__LEASE_MS`
/// → `session.lease_ms`).
fn env_key(var: &str, prefix: &str) -> String {
    var.strip_prefix(prefix)
        .unwrap()
        .split("__")
        .map(str::to_ascii_lowercase)
        .collect::<Vec<_>>()
        .join(".")
}

/// The flags (`--x`) given to `bin` on any line of `text` that runs it.
fn flags_of(text: &str, bin: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let words: Vec<&str> = line
            .split(|c: char| c.is_whitespace() || matches!(c, '[' | ']' | ',' | '"' | '='))
            .filter(|w| !w.is_empty())
            .collect();
        let Some(at) = words
            .iter()
            .position(|w| *w == bin || w.ends_with(&format!("/{bin}")))
        else {
            continue;
        };
        for w in &words[at + 1..] {
            if let Some(f) = w.strip_prefix("--") {
                out.insert(format!("--{f}"));
            }
        }
    }
    out
}

fn assert_flags_exist(file: &str, text: &str, bin: &str, help: &str) -> usize {
    let flags = flags_of(text, bin);
    for f in &flags {
        assert!(
            help.contains(&format!("{f} ")) || help.contains(&format!("{f}\n")),
            "{file} passes {bin} {f}, which `{bin} --help` does not list"
        );
    }
    flags.len()
}

#[test]
fn deployment_files_render_and_name_only_real_flags_and_keys() {
    let (replica, proxy, directory) = (help("replica"), help("proxy"), help("directory"));

    // Kubernetes: renders, and holds what the docs promise.
    let o = Command::new("kubectl")
        .args(["kustomize", &format!("{DEPLOY}kubernetes")])
        .output()
        .expect("kubectl (apt-get install -y kubernetes-client) renders the manifests");
    assert!(
        o.status.success(),
        "kubectl kustomize: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let rendered = String::from_utf8(o.stdout).unwrap();
    let docs: Vec<&str> = rendered.split("\n---\n").collect();
    let doc = |kind: &str, name: &str| -> &str {
        docs.iter()
            .find(|d| {
                d.lines().any(|l| l == format!("kind: {kind}"))
                    && d.contains(&format!("\n  name: {name}\n"))
            })
            .unwrap_or_else(|| panic!("no {kind} {name} in:\n{rendered}"))
    };
    let sts = doc("StatefulSet", "lockservice-replica");
    for want in [
        "replicas: 5",
        "podManagementPolicy: Parallel",
        "serviceName: lockservice-replica-peers",
        "volumeClaimTemplates:",
        "secretName: lockservice-replica-tls",
        "namespace: lockservice",
    ] {
        assert!(sts.contains(want), "the StatefulSet lacks {want:?}:\n{sts}");
    }
    assert!(doc("Service", "lockservice-replica-peers").contains("publishNotReadyAddresses: true"));
    assert!(doc("PodDisruptionBudget", "lockservice-replica").contains("maxUnavailable: 1"));
    assert!(doc("Service", "lockservice").contains("protocol: UDP"));
    assert!(doc("Deployment", "lockservice-directory")
        .contains("secretName: lockservice-directory-tls"));
    for (kind, name) in [
        ("StatefulSet", "lockservice-replica"),
        ("Deployment", "lockservice-proxy"),
        ("Deployment", "lockservice-directory"),
    ] {
        let d = doc(kind, name);
        for want in [
            "prometheus.io/scrape: \"true\"",
            "prometheus.io/port: \"9464\"",
            "path: /ready",
            "path: /health",
            "containerPort: 9464",
        ] {
            assert!(d.contains(want), "{kind} {name} lacks {want:?}");
        }
    }

    // The configurations in the ConfigMaps: only keys the binaries read, valid with what
    // each pod sets from its name.
    let sts_src = read("kubernetes/replica.yaml");
    let env_keys: BTreeSet<String> = common::words_starting(&sts_src, "LOCKSVC_REPLICA__")
        .iter()
        .map(|var| env_key(var, "LOCKSVC_REPLICA__"))
        .collect();
    assert_eq!(
        env_keys,
        ["advertise", "bootstrap", "id"].map(String::from).into(),
        "the pods set their id, address and bootstrap"
    );
    let text = read("kubernetes/replica.toml");
    let with_pod = format!(
        "id = 1\nadvertise = \"lockservice-replica-0.lockservice-replica-peers.lockservice.svc.cluster.local:7001\"\nbootstrap = true\n{text}"
    );
    let cfg: replica::config::ReplicaConfig = only_known_keys("kubernetes/replica.toml", &with_pod);
    cfg.validate()
        .expect("the replicas' configuration validates");
    assert_eq!(cfg.members.len(), 5);
    assert_eq!(cfg.metrics.listen.map(|a| a.port()), Some(9464));
    let p: proxy::ProxyConfig =
        only_known_keys("kubernetes/proxy.toml", &read("kubernetes/proxy.toml"));
    p.validate().expect("the proxies' configuration validates");
    assert_eq!(p.metrics.listen.map(|a| a.port()), Some(9464));
    for toml in ["../replica.example.toml", "../proxy.example.toml"] {
        let t = read(toml);
        if toml.contains("replica") {
            only_known_keys::<replica::config::ReplicaConfig>(toml, &t);
        } else {
            only_known_keys::<proxy::ProxyConfig>(toml, &t);
        }
    }

    // Flags and environment the manifests and units pass.
    let mut checked = 0;
    for file in [
        "kubernetes/replica.yaml",
        "kubernetes/proxy.yaml",
        "kubernetes/directory.yaml",
        "systemd/lockservice-replica.service",
        "systemd/lockservice-proxy.service",
        "systemd/lockservice-directory.service",
    ] {
        let text = read(file);
        checked += assert_flags_exist(file, &text, "replica", &replica);
        checked += assert_flags_exist(file, &text, "proxy", &proxy);
        checked += assert_flags_exist(file, &text, "directory", &directory);
        for var in common::words_starting(&text, "DIRECTORY_") {
            assert!(
                directory.contains(&format!("[env: {var}")),
                "{file} sets {var}, which the directory does not read"
            );
            checked += 1;
        }
    }
    assert!(checked >= 10, "the check found the flags ({checked})");
    // Every unit starts a binary the Dockerfile installs, with a configuration path the
    // image's layout has.
    let dockerfile = read("Dockerfile");
    for bin in ["replica", "proxy", "directory", "lockctl"] {
        assert!(
            dockerfile.contains(&format!("--bin {bin}")),
            "the image builds {bin}"
        );
        binary(bin);
    }
    let rust_version =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("rust-version = "))
            .map(|v| v.trim_matches('"').to_string())
            .unwrap();
    assert!(
        dockerfile.contains(&format!("FROM rust:{rust_version}-")),
        "the image builds with the workspace's rust-version {rust_version}"
    );
}
