//! The replica's layers, checked from its sources (issue 23): main → server → gateway →
//! actors → leader → raft → state machine, each using only what is below it. A `use` or
//! path that reaches up (or sideways, where a layer must stay plain logic) fails here,
//! naming the file and line. Test code may reach across (a `tests.rs` file, and what
//! follows a file's `#[cfg(test)]`).

use std::path::Path;

/// Which `crate::` modules the files under each folder of `src/` may not name.
const FORBIDDEN: &[(&str, &[&str])] = &[
    // The state machine is pure: `wire`, std and its own files only.
    (
        "state_machine",
        &[
            "actors", "leader", "raft", "gateway", "server", "config", "errors", "backup",
        ],
    ),
    // Leader-local logic: `wire` and std, never Raft or the actors that drive it.
    ("leader", &["actors", "raft", "gateway", "server", "backup"]),
    // openraft glue: below the actors, the leader logic and the gateway.
    // Backups (`backup.rs`) sit above it: they write and read its snapshot files.
    ("raft", &["actors", "leader", "gateway", "server", "backup"]),
];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read_dir") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_layer_reaches_up() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    let mut checked = 0;
    for (layer, forbidden) in FORBIDDEN {
        let mut files = Vec::new();
        rust_files(&src.join(layer), &mut files);
        assert!(!files.is_empty(), "no sources under src/{layer}");
        for f in files {
            if f.file_name().is_some_and(|n| n == "tests.rs") {
                continue;
            }
            checked += 1;
            let text = std::fs::read_to_string(&f).expect("read");
            for (n, line) in text.lines().enumerate() {
                let code = line.trim_start();
                if code.starts_with("#[cfg(test)]") {
                    break;
                }
                if code.starts_with("//") {
                    continue;
                }
                for m in *forbidden {
                    if code.contains(&format!("crate::{m}::"))
                        || code.contains(&format!("crate::{m};"))
                        || code.contains(&format!("crate::{m}::{{"))
                    {
                        found.push(format!(
                            "src/{}:{}: src/{layer} names crate::{m}: {}",
                            f.strip_prefix(&src).unwrap().display(),
                            n + 1,
                            code
                        ));
                    }
                }
            }
        }
    }
    assert!(checked > 10, "only {checked} files checked");
    assert!(found.is_empty(), "layers reached up:\n{}", found.join("\n"));
}
