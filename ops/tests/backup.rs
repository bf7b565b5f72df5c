//! Backups to object storage (issue 28), against a real S3-compatible server (moto's,
//! from PyPI: `python3 -m pip install 'moto[server]'`, which `.ci/run` does): a cell
//! backs itself up on a schedule with retention and on demand (`lockctl snapshot save`);
//! `snapshot ls` lists the backups; a damaged or partial object is refused by `snapshot
//! restore` with the reason and nothing written; a new cell seeded from a good one (the
//! disaster-recovery drill) holds the same state (same digest at the same index) and
//! goes on granting fencing tokens above the old cell's.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use client_sdk::{Client, ClientConfig};
use common::*;

const BUCKET: &str = "lockbackups";

/// moto's S3 server on a free loopback port, stopped on drop.
struct Moto {
    child: Child,
    port: u16,
}

impl Moto {
    fn start() -> Moto {
        let ok = Command::new("python3")
            .args(["-c", "import moto.server"])
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "moto's S3 server is needed: python3 -m pip install 'moto[server]' (.ci/run does)"
        );
        let port = free_tcp_base(&[0]);
        let child = Command::new("python3")
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 -m moto.server");
        let moto = Moto { child, port };
        // Up when it answers; then the bucket (moto takes unsigned requests).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(answer) = moto.http("PUT", &format!("/{BUCKET}")) {
                assert!(
                    answer.starts_with("HTTP/1.1 200"),
                    "creating the bucket: {answer}"
                );
                return moto;
            }
            assert!(Instant::now() < deadline, "moto did not start in 60 s");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn http(&self, method: &str, path: &str) -> std::io::Result<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    }
}

impl StoreServer for Moto {
    fn url(&self) -> String {
        format!("s3://{BUCKET}/drill")
    }

    /// The store's options, as `[backup] options` and `--store-option` take them.
    fn options(&self) -> Vec<(String, String)> {
        [
            ("endpoint", format!("http://127.0.0.1:{}", self.port)),
            ("allow_http", "true".into()),
            ("region", "us-east-1".into()),
            // Any key does for moto; given, so the client asks no metadata service.
            ("access_key_id", "drill".into()),
            ("secret_access_key", "drill".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Azurite's development account (published in its documentation; every Azurite has it).
const AZURITE_ACCOUNT: &str = "devstoreaccount1";
const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Azurite's Blob service (Microsoft's Azure Storage emulator, from npm: `npm install -g
/// azurite`, which `.ci/run` does) on a free loopback port, in memory, stopped on drop.
struct Azurite {
    child: Child,
    port: u16,
}

impl Azurite {
    fn start() -> Azurite {
        let ok = Command::new("azurite-blob")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            ok,
            "Azurite is needed: npm install -g azurite (.ci/run does)"
        );
        let port = free_tcp_base(&[0]);
        let child = Command::new("azurite-blob")
            .args([
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                &port.to_string(),
                "--inMemoryPersistence",
                "--disableTelemetry",
                "--silent",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("azurite-blob");
        let azurite = Azurite { child, port };
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "Azurite did not start in 60 s");
            std::thread::sleep(Duration::from_millis(200));
        }
        azurite
    }

    /// Creates the container (object_store writes blobs, it does not make containers),
    /// signed with the account's key by object_store's own Azure signer.
    async fn create_container(&self) {
        use object_store::azure::{AzureAccessKey, AzureAuthorizer, AzureCredential};
        use object_store::client::{HttpConnector, ReqwestConnector};
        let credential = AzureCredential::AccessKey(AzureAccessKey::try_new(AZURITE_KEY).unwrap());
        let mut req = http::Request::builder()
            .method("PUT")
            .uri(format!(
                "http://127.0.0.1:{}/{AZURITE_ACCOUNT}/{BUCKET}?restype=container",
                self.port
            ))
            .header("content-length", "0")
            .body(object_store::client::HttpRequestBody::empty())
            .unwrap();
        AzureAuthorizer::new(&credential, AZURITE_ACCOUNT).authorize(&mut req);
        let client = ReqwestConnector::default()
            .connect(&object_store::ClientOptions::new().with_allow_http(true))
            .unwrap();
        let resp = client.execute(req).await.expect("create the container");
        assert_eq!(
            resp.status().as_u16(),
            201,
            "creating the container: {resp:?}"
        );
    }
}

impl StoreServer for Azurite {
    fn url(&self) -> String {
        format!("azure://{BUCKET}/drill")
    }

    fn options(&self) -> Vec<(String, String)> {
        [
            ("account_name", AZURITE_ACCOUNT.to_string()),
            ("access_key", AZURITE_KEY.to_string()),
            (
                "endpoint",
                format!("http://127.0.0.1:{}/{AZURITE_ACCOUNT}", self.port),
            ),
            ("allow_http", "true".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An object store server the tests run: its URL and options, as `--store` and
/// `--store-option` (and `[backup]`) take them.
trait StoreServer {
    fn url(&self) -> String;
    fn options(&self) -> Vec<(String, String)>;

    fn args(&self, flag: &str) -> Vec<String> {
        self.options()
            .into_iter()
            .flat_map(|(k, v)| [flag.to_string(), format!("{k}={v}")])
            .collect()
    }

    fn store(&self) -> replica::backup::Store {
        let o: BTreeMap<String, String> = self.options().into_iter().collect();
        replica::backup::Store::open(&self.url(), &o).unwrap()
    }
}

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", text(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(o)))
}

/// `lockctl snapshot ls|restore` against the store (no cell).
fn offline(moto: &dyn StoreServer, args: &[&str]) -> std::process::Output {
    Command::new(LOCKCTL)
        .args(["snapshot"])
        .args(args)
        .args(["--store", &moto.url()])
        .args(moto.args("--store-option"))
        .output()
        .unwrap()
}

/// `lockctl dev` backing up to `server` every 2 s, keeping `keep`.
fn dev_cell_backing_up_to(server: &dyn StoreServer, keep: u32) -> DevCell {
    let mut extra: Vec<String> = vec![
        "--backup".into(),
        server.url(),
        "--backup-interval-secs".into(),
        "2".into(),
        "--backup-keep".into(),
        keep.to_string(),
    ];
    extra.extend(server.args("--backup-option"));
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    DevCell::start(&extra)
}

fn listed(moto: &dyn StoreServer) -> Vec<serde_json::Value> {
    json(&offline(moto, &["ls", "--cell", "dev", "--json"]))["backups"]
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn backups_to_s3_and_a_cell_restored_from_one() {
    let _serial = serial();
    let moto = Moto::start();
    let mut cell = dev_cell_backing_up_to(&moto, 3);
    let ctl = |args: &[&str]| lockctl(&cell.eps(), &cell.ca, args);

    // On a schedule, with retention: backups every 2 s, the store keeping 3. Bounded:
    // 60 s for at least 4 to have been taken (the newest's time moves past the first
    // three's).
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        if let Some(b) = listed(&moto).first() {
            break b["unix_ms"].as_u64().unwrap();
        }
        assert!(Instant::now() < deadline, "no scheduled backup in 60 s");
        std::thread::sleep(Duration::from_millis(250));
    };
    loop {
        let l = listed(&moto);
        // A backup is uploaded before the oldest is deleted: a listing between the two
        // sees one more than kept, never two more.
        assert!(l.len() <= 4, "retention keeps 3 (+1 while pruning): {l:?}");
        if l.len() == 3 && l[0]["unix_ms"].as_u64().unwrap() > first {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "retention never deleted the first: {l:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // Some state, then a backup on demand.
    for (p, v) in [("/app", "x"), ("/app/config", "v1"), ("/app/flags", "on")] {
        assert!(ctl(&["create", p, v]).status.success());
    }
    assert!(ctl(&["set", "/app/config", "v2", "--version", "0"])
        .status
        .success());
    let before_token: u64 = json(&ctl(&["get", "/app/flags", "--json"]))["stat"]["token"]
        .as_u64()
        .unwrap();
    let old_tree = text(&ctl(&["ls", "-R", "/"]));
    assert!(old_tree.contains("/app/flags"), "{old_tree}");
    let saved = json(&ctl(&["snapshot", "save", "--json"]));
    let object = saved["object"].as_str().unwrap().to_string();
    let index = saved["index"].as_u64().unwrap();
    let digest = saved["digest"].as_str().unwrap().to_string();
    assert!(object.starts_with("dev/snapshot-"), "{saved}");
    // Stopped at once: its scheduled backups would prune this one (the third after it,
    // about 6 s on) while the test still reads it. One may finish during the shutdown.
    cell.stop();
    // Listed: backups are found by name, and `ls` shows this one.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !listed(&moto).iter().any(|b| b["name"] == object.as_str()) {
        assert!(Instant::now() < deadline, "{object} not listed");
        std::thread::sleep(Duration::from_millis(100));
    }
    let ls = offline(&moto, &["ls"]);
    assert!(text(&ls).contains(&object), "{}", text(&ls));
    // Read back, it holds what the leader copied.
    let check = json(&offline(
        &moto,
        &["restore", "--object", &object, "--check", "--json"],
    ));
    assert_eq!(check["digest"].as_str().unwrap(), digest, "{check}");

    // Damaged copies of it, under names newer than every good one: cut short, one byte
    // changed, not a backup at all. Each refused with the reason, nothing written.
    let store = moto.store();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let good = rt
        .block_on(store.get(&object, replica::backup::BACKUP_BYTES_MAX))
        .unwrap();
    // A minute ahead of now: newer than every good one (the cell is stopped), not so far
    // ahead that a restore takes it for a clock that ran ahead.
    let far = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 60_000;
    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x40;
    let damaged = [
        (good[..good.len() / 2].to_vec(), "truncated"),
        (flipped, "checksum mismatch"),
        (
            b"<Error>not a snapshot</Error>".to_vec(),
            "not a snapshot file",
        ),
    ];
    let seeded = cell.dir.path().join("restored");
    let data = seeded.join("replica-1");
    for (i, (bytes, says)) in damaged.into_iter().enumerate() {
        let b = rt
            .block_on(store.put("dev", index + 100, far + i as u64, bytes))
            .unwrap();
        // The newest is the damaged one: a restore of "the latest" refuses it.
        let o = offline(
            &moto,
            &[
                "restore",
                "--cell",
                "dev",
                "--data-dir",
                data.to_str().unwrap(),
                "--id",
                "1",
                "--members",
                "1=127.0.0.1:1",
            ],
        );
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(
            text(&o).contains(&b.name)
                && text(&o).contains(says)
                && text(&o).contains("nothing was written"),
            "{says}: {}",
            text(&o)
        );
        assert!(!data.exists(), "a refused restore wrote {}", data.display());
    }
    // A large object goes up in parts (S3's multipart upload) and reads back whole: here
    // 11 MiB that is not a backup, which a restore refuses like the others.
    let large: Vec<u8> = (0..11u32 << 20).map(|i| (i % 253) as u8).collect();
    let multipart = rt
        .block_on(store.put_in_parts(
            "dev",
            index + 100,
            far + 10,
            large.clone(),
            1 << 20,
            5 << 20,
        ))
        .unwrap();
    assert!(
        rt.block_on(store.get(&multipart.name, replica::backup::BACKUP_BYTES_MAX))
            .unwrap()
            == large
    );
    let o = offline(&moto, &["restore", "--object", &multipart.name, "--check"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("not a snapshot file"), "{}", text(&o));

    // The drill: a new cell of three, every member's data directory seeded from the good
    // backup alike (a member not in --members is refused).
    let base = free_base(3);
    let members: Vec<String> = (0..3)
        .map(|i| format!("{}=127.0.0.1:{}", i + 1, base + i))
        .collect();
    let restore = |id: u64| {
        let dir = seeded.join(format!("replica-{id}"));
        offline(
            &moto,
            &[
                "restore",
                "--object",
                &object,
                "--data-dir",
                dir.to_str().unwrap(),
                "--id",
                &id.to_string(),
                "--members",
                &members.join(","),
                "--bump-index",
                "1000",
                "--json",
            ],
        )
    };
    let o = restore(4);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("not one of the members"), "{}", text(&o));
    // Without --bump-index a seed is refused and nothing written: the new cell would grant
    // fencing tokens the old one granted after the backup. The refusal suggests a value.
    let first = seeded.join("replica-1");
    let o = offline(
        &moto,
        &[
            "restore",
            "--object",
            &object,
            "--data-dir",
            first.to_str().unwrap(),
            "--id",
            "1",
            "--members",
            &members.join(","),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("--bump-index is needed") && text(&o).contains("nothing was written"),
        "{}",
        text(&o)
    );
    let suggested: u64 = text(&o)
        .split("plus an hour's margin: --bump-index ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no suggested value: {}", text(&o)));
    assert!(
        suggested >= 360_000_000 && suggested.is_multiple_of(360_000_000),
        "{suggested}"
    );
    assert!(
        !first.exists(),
        "a refused restore wrote {}",
        first.display()
    );
    let mut digests = Vec::new();
    for id in 1..=3 {
        let r = json(&restore(id));
        assert_eq!(r["index"].as_u64().unwrap(), index, "{r}");
        assert_eq!(r["log_index"].as_u64().unwrap(), index + 1_000, "{r}");
        assert_eq!(r["sessions"].as_u64().unwrap(), 0, "{r}");
        digests.push(r["digest"].as_str().unwrap().to_string());
    }
    let digest = digests[0].clone();
    assert!(digests.iter().all(|d| *d == digest), "{digests:?}");
    let (dev, _) = start_dev_of(&seeded, base, 3, &["--no-demo"]);
    let _dev = DevGuard(Some(dev));
    let eps: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", base + i)).collect();
    let ca = seeded.join("tls/ca.pem");
    let ctl = |args: &[&str]| lockctl(&eps.join(","), &ca, args);

    // Each replica started from exactly the backup's state (its digest, logged once),
    // and the replicas of the new cell go on holding one state (a new cell commits its
    // own entries as its first leader starts: the index moves on from the backup's).
    for id in 1..=3 {
        let log = std::fs::read_to_string(seeded.join(format!("replica-{id}.log"))).unwrap();
        let line = log
            .lines()
            .find(|l| l.contains("seeded from a backup"))
            .unwrap_or_else(|| panic!("replica {id} did not start from the seed:\n{log}"));
        assert!(
            line.contains(&format!("digest={digest}"))
                && line.contains(&format!("index={}", index + 1_000)),
            "{line}"
        );
    }
    rt.block_on(async {
        let client = Client::connect(ClientConfig::new(eps.clone(), ca.clone()))
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut seen = Vec::new();
            for addr in &eps {
                seen.push(client.state_digest_of(addr.parse().unwrap()).await.ok());
            }
            if seen[0].is_some() && seen.iter().all(|d| *d == seen[0]) {
                break;
            }
            assert!(Instant::now() < deadline, "the replicas disagree: {seen:?}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    // The namespace is the old cell's, node for node (versions, tokens, sizes).
    let tree = ctl(&["ls", "-R", "/"]);
    assert!(tree.status.success(), "{}", text(&tree));
    assert_eq!(text(&tree), old_tree);
    let got = ctl(&["get", "/app/config"]);
    assert_eq!(text(&got).lines().next(), Some("v2"), "{}", text(&got));
    // Fencing tokens go on above the old cell's.
    assert!(ctl(&["create", "/app/after", "y"]).status.success());
    let after_token = json(&ctl(&["get", "/app/after", "--json"]))["stat"]["token"]
        .as_u64()
        .unwrap();
    assert!(
        after_token > before_token,
        "{after_token} <= {before_token}"
    );
    // Above every token the old cell could have granted in the 1 000 entries after it.
    assert!(
        after_token > (index + 1_000) * 1024,
        "{after_token}: the index was not bumped past {}",
        index + 1_000
    );
    // This cell has no store: asked for a backup, it says what to set (exit 9).
    let o = ctl(&["snapshot", "save"]);
    assert_eq!(o.status.code(), Some(9), "{}", text(&o));
    assert!(text(&o).contains("[backup] url"), "{}", text(&o));
}

/// The same flow against Azure Blob Storage (Azurite): scheduled backups with retention
/// (deletes), one on demand listed and read back with the leader's digest, a damaged
/// object refused, and a large object uploaded in blocks (Azure's multipart: blocks, then
/// the block list) reading back whole.
#[test]
fn backups_to_azure_blob_storage() {
    let _serial = serial();
    let azurite = Azurite::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(azurite.create_container());
    let mut cell = dev_cell_backing_up_to(&azurite, 2);
    let ctl = |args: &[&str]| lockctl(&cell.eps(), &cell.ca, args);

    // Scheduled, with retention keeping 2: the first one is deleted once newer ones come.
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        if let Some(b) = listed(&azurite).first() {
            break b["name"].as_str().unwrap().to_string();
        }
        assert!(Instant::now() < deadline, "no scheduled backup in 60 s");
        std::thread::sleep(Duration::from_millis(250));
    };
    loop {
        let l = listed(&azurite);
        // A backup is uploaded before the oldest is deleted: a listing between the two
        // sees one more than kept, never two more.
        assert!(l.len() <= 3, "retention keeps 2 (+1 while pruning): {l:?}");
        if l.len() == 2 && l.iter().all(|b| b["name"] != first.as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "retention never deleted the first: {l:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // On demand, read back with the digest the leader reported.
    assert!(ctl(&["create", "/app", "azure"]).status.success());
    let saved = json(&ctl(&["snapshot", "save", "--json"]));
    let object = saved["object"].as_str().unwrap().to_string();
    let digest = saved["digest"].as_str().unwrap().to_string();
    // Stopped at once: its scheduled backups would prune this one (the second after it,
    // about 4 s on) while the test still reads it. One may finish during the shutdown.
    cell.stop();
    let check = json(&offline(
        &azurite,
        &["restore", "--object", &object, "--check", "--json"],
    ));
    assert_eq!(check["digest"].as_str().unwrap(), digest, "{check}");

    // Damaged: cut short, refused with the reason.
    let store = azurite.store();
    let good = rt
        .block_on(store.get(&object, replica::backup::BACKUP_BYTES_MAX))
        .unwrap();
    let index = saved["index"].as_u64().unwrap();
    let now = replica::backup::unix_ms_now();
    let cut = rt
        .block_on(store.put("dev", index + 1, now, good[..good.len() / 2].to_vec()))
        .unwrap();
    let o = offline(&azurite, &["restore", "--object", &cut.name, "--check"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("truncated"), "{}", text(&o));

    // In blocks: 11 MiB in 5 MiB blocks, whole when read back (not a backup: refused).
    let large: Vec<u8> = (0..11u32 << 20).map(|i| (i % 251) as u8).collect();
    let blocks = rt
        .block_on(store.put_in_parts("dev", index + 2, now + 1, large.clone(), 1 << 20, 5 << 20))
        .unwrap();
    assert!(
        rt.block_on(store.get(&blocks.name, replica::backup::BACKUP_BYTES_MAX))
            .unwrap()
            == large
    );
    let o = offline(&azurite, &["restore", "--object", &blocks.name, "--check"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("not a snapshot file"), "{}", text(&o));
}
