//! The replica's status page in a real browser: runs `dramesh demo --serve`, loads
//! `http://<replica r1>/` in headless Chromium (`--dump-dom`, so what is checked is the DOM the
//! browser built, not the bytes sent) and asserts that it shows every demo cluster, a device
//! chart with a bar per (cluster, device class) with devices the replica reports, the reservations section
//! and the peers section with the demo's other replicas and agents.
//!
//! Chromium is the Debian `chromium` package (`scripts/test` installs it when run as root).
//! Without it the test prints a loud skip message and passes, except when `CI` is set: then a
//! missing browser fails the test.

use crate::common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Demo, demo_clusters, http, wait_exit};
use serde_json::Value;

fn find_chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in ["chromium", "chromium-browser"] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// `chromium --headless --dump-dom url`, bounded to 90 s.
fn dump_dom(chromium: &PathBuf, url: &str) -> String {
    let profile = tempfile::tempdir().expect("chromium profile dir");
    let mut child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(["--dump-dom", url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", chromium.display()));
    if wait_exit(&mut child, Duration::from_secs(90)).is_none() {
        let _ = child.kill();
        let out = child.wait_with_output().expect("chromium output");
        panic!(
            "chromium did not finish within 90 s; stderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = child.wait_with_output().expect("chromium output");
    let dom = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && dom.contains("<html"),
        "chromium failed ({}); stderr:\n{}\nstdout:\n{dom}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    dom
}

/// The text of the first element opening with `open` up to `close` (the DOM dump is
/// serialized HTML, so sections can be cut out by their tags).
fn section<'a>(dom: &'a str, open: &str, close: &str) -> &'a str {
    let start = dom
        .find(open)
        .unwrap_or_else(|| panic!("no {open} in the page:\n{dom}"));
    let len = dom[start..]
        .find(close)
        .unwrap_or_else(|| panic!("{open} is not closed by {close}"));
    &dom[start..start + len]
}

#[test]
fn status_page_shows_the_demo_in_chromium() {
    let Some(chromium) = find_chromium() else {
        if std::env::var_os("CI").is_some() {
            panic!(
                "chromium is not installed but CI is set: the status page test must run in CI (scripts/test installs the Debian chromium package as root)"
            );
        }
        eprintln!(
            "\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n\
             !!! SKIPPED status_page_shows_the_demo_in_chromium: no chromium or  !!!\n\
             !!! chromium-browser on PATH (apt-get install chromium; CI installs) !!!\n\
             !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n"
        );
        return;
    };
    let mut demo = Demo::start(&[], &[]);
    let r1 = demo.replicas[0].clone();

    // What the page must show, from the same replica's JSON API.
    let (code, body) = http(r1.http, "GET", "/v1/status", None);
    assert_eq!(code, 200, "{body}");
    let status: Value = serde_json::from_str(&body).expect("status JSON");
    let mut bars = Vec::new();
    for c in status["clusters"].as_array().expect("clusters") {
        for d in c["devices"].as_array().into_iter().flatten() {
            if d["devices"].as_u64().unwrap_or(0) == 0 {
                continue;
            }
            bars.push((
                c["name"].as_str().unwrap_or("").to_string(),
                d["class"].as_str().unwrap_or("").to_string(),
            ));
        }
    }
    assert!(
        !bars.is_empty(),
        "the demo fleet publishes devices: {status}"
    );

    let dom = dump_dom(&chromium, &format!("http://{}/", r1.http));
    assert!(
        dom.contains(&format!("<span id=\"replica\">{}</span>", r1.id)),
        "replica id in the header:\n{dom}"
    );

    let clusters = section(&dom, "<section id=\"clusters\">", "</section>");
    for name in demo_clusters() {
        assert!(
            clusters.contains(&format!("<tr class=\"cluster\" data-cluster=\"{name}\">")),
            "cluster {name} has a row:\n{clusters}"
        );
        assert!(
            clusters.contains(&format!("<td class=\"name\">{name}</td>")),
            "cluster {name} is named:\n{clusters}"
        );
    }
    assert_eq!(
        clusters.matches("<tr class=\"cluster\"").count(),
        demo_clusters().len(),
        "one row per cluster"
    );
    assert!(
        !clusters.contains("<td class=\"data-age num\">unknown</td>"),
        "every cluster has a data age:\n{clusters}"
    );

    let devices = section(&dom, "<section id=\"devices\">", "</section>");
    assert!(
        devices.contains("<svg id=\"devices-chart\""),
        "chart:\n{devices}"
    );
    for (cluster, class) in &bars {
        let open = format!("<g class=\"bar\" data-cluster=\"{cluster}\" data-class=\"{class}\"");
        let bar = section(devices, &open, "</g>");
        assert!(
            bar.contains("<rect class=\"used\"") && bar.contains("<rect class=\"free\""),
            "bar {cluster}/{class} has used and free parts:\n{bar}"
        );
    }
    assert_eq!(
        devices.matches("<g class=\"bar\"").count(),
        bars.len(),
        "one bar per cluster and class"
    );

    let reservations = section(&dom, "<section id=\"reservations\">", "</section>");
    let listed = status["reservations"].as_array().map_or(0, Vec::len);
    if listed == 0 {
        assert!(
            reservations.contains("no reservations"),
            "empty reservations say so:\n{reservations}"
        );
    } else {
        assert_eq!(
            reservations.matches("<tr class=\"reservation\">").count(),
            listed.min(500)
        );
    }

    let peers = section(&dom, "<section id=\"peers\">", "</section>");
    for other in &demo.replicas[1..] {
        assert!(
            peers.contains(&format!("data-peer=\"replica/{}\"", other.id)),
            "replica {} is a peer of {}:\n{peers}",
            other.id,
            r1.id
        );
    }
    for name in demo_clusters() {
        assert!(
            peers.contains(&format!("data-peer=\"cluster/{name}/agent/_cluster\"")),
            "the agent of {name} is a peer:\n{peers}"
        );
        assert!(
            peers.contains(&format!("<span class=\"lag\" data-cluster=\"{name}\">")),
            "some peer delivered {name} (sync lag shown):\n{peers}"
        );
    }

    assert!(demo.stop(), "the demo exits cleanly on SIGTERM");
}
