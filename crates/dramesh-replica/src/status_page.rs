//! The replica's status web page (`GET /` and `GET /status`): one server-rendered HTML document
//! with inline CSS and an inline SVG chart, no scripts and no external assets (it must work
//! where the control plane has no internet access), reloading itself every
//! [`REFRESH_SECONDS`].
//!
//! It is rendered from the same JSON as `GET /v1/status` (so the page and the API can never
//! disagree) plus the mesh peer rows. Sections and the classes inside them are stable, for
//! tests and scrapers:
//!
//! | element | content |
//! |---|---|
//! | `section#clusters`, `tr.cluster[data-cluster]` | name, Kubernetes version, data age, stale, nodes, pods, devices (free / total) |
//! | `section#devices`, `svg#devices-chart`, `g.bar[data-cluster][data-class]` | per cluster and device class with at least one device, a bar of `rect.used` and `rect.free` devices |
//! | `section#reservations`, `tr.reservation` or `p.empty` | the status report's `reservations` array, one row each, columns from the objects' fields |
//! | `section#peers`, `tr.peer[data-peer]` | live mesh connections: kind, address, last heard, RTT, documents behind, bytes, sync lag per cluster |
//!
//! Every text taken from the report or the mesh is HTML-escaped; table sizes are bounded.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::Value;

use dramesh_mesh::observe::PeerRow;

/// Seconds between automatic reloads of the page.
pub(crate) const REFRESH_SECONDS: u32 = 5;
/// Longest reservation table rendered; the rest are counted.
const MAX_RESERVATION_ROWS: usize = 500;
/// Most columns a reservation table gets from its objects' fields.
const MAX_RESERVATION_COLUMNS: usize = 12;
/// Longest text of one rendered JSON value.
const MAX_CELL_CHARS: usize = 200;

/// Escapes text for HTML element content and quoted attribute values.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `0.4 s`, `12 s`, `3 min 5 s`, `2 h 7 min`.
pub(crate) fn fmt_age(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 10.0 {
        format!("{s:.1} s")
    } else if s < 60.0 {
        format!("{s:.0} s")
    } else if s < 3600.0 {
        let s = d.as_secs();
        format!("{} min {} s", s / 60, s % 60)
    } else {
        let s = d.as_secs();
        format!("{} h {} min", s / 3600, (s % 3600) / 60)
    }
}

fn text_of(v: &Value) -> String {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        // An object reference (`{kind, namespace, name}`) reads as `Kind ns/name`.
        Value::Object(o)
            if o.get("kind").is_some_and(Value::is_string)
                && o.get("name").is_some_and(Value::is_string) =>
        {
            let ns = o.get("namespace").and_then(Value::as_str).unwrap_or("");
            let kind = o.get("kind").and_then(Value::as_str).unwrap_or("");
            let name = o.get("name").and_then(Value::as_str).unwrap_or("");
            if ns.is_empty() {
                format!("{kind} {name}")
            } else {
                format!("{kind} {ns}/{name}")
            }
        }
        other => other.to_string(),
    };
    if s.chars().count() > MAX_CELL_CHARS {
        let mut t: String = s.chars().take(MAX_CELL_CHARS).collect();
        t.push('…');
        t
    } else {
        s
    }
}

fn u64_of(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

const STYLE: &str = "
body{font-family:system-ui,sans-serif;margin:1.5em;color:#1d2733;background:#fafbfc}
h1{font-size:1.4em;margin:0 0 .2em} h2{font-size:1.1em;margin:1.6em 0 .5em}
table{border-collapse:collapse;font-size:.9em} th,td{padding:.25em .7em;border-bottom:1px solid #dde3ea;text-align:left}
th{background:#eef2f6} td.num{text-align:right;font-variant-numeric:tabular-nums}
.stale{color:#b3261e;font-weight:600} .fresh{color:#1b7f3b} .empty{color:#66707a;font-style:italic}
.meta{color:#4a5560;font-size:.9em} svg text{font-size:12px;fill:#1d2733}
rect.used{fill:#d9822b} rect.free{fill:#2f7fc1} .legend span{display:inline-block;width:.9em;height:.9em;margin:0 .3em 0 1em;vertical-align:middle}
";

/// The whole page. `status` is the `/v1/status` JSON; `peers` the live mesh connections.
pub(crate) fn render(status: &Value, peers: &[PeerRow]) -> String {
    let replica = status["replica"].as_str().unwrap_or("");
    let mut h = String::with_capacity(16 * 1024);
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"{REFRESH_SECONDS}\">\
         <title>dramesh replica {r}</title><style>{STYLE}</style></head><body>\n\
         <header><h1>dramesh replica <span id=\"replica\">{r}</span></h1>\
         <p class=\"meta\">ready: <span id=\"ready\">{ready}</span> · mesh digest <code id=\"digest\">{digest}</code> · \
         reloads every {REFRESH_SECONDS} s · <a href=\"/v1/status\">JSON</a> · <a href=\"/metrics\">metrics</a></p></header>\n",
        r = escape(replica),
        ready = if status["ready"].as_bool() == Some(true) {
            "yes"
        } else {
            "no"
        },
        digest = escape(status["digest"].as_str().unwrap_or("")),
    );
    let empty = Vec::new();
    let clusters = status["clusters"].as_array().unwrap_or(&empty);
    clusters_section(&mut h, clusters);
    devices_section(&mut h, clusters);
    reservations_section(&mut h, &status["reservations"]);
    peers_section(&mut h, peers);
    h.push_str("</body></html>\n");
    h
}

fn clusters_section(h: &mut String, clusters: &[Value]) {
    h.push_str("<section id=\"clusters\"><h2>Clusters</h2>\n");
    if clusters.is_empty() {
        h.push_str("<p class=\"empty\">no clusters yet</p></section>\n");
        return;
    }
    h.push_str(
        "<table class=\"clusters\"><thead><tr><th>cluster</th><th>Kubernetes</th><th>data age</th>\
         <th>state</th><th>nodes</th><th>pods</th><th>devices free / total</th><th>generation</th></tr></thead><tbody>\n",
    );
    for c in clusters {
        let name = escape(c["name"].as_str().unwrap_or(""));
        let age = c["dataAgeSeconds"]
            .as_f64()
            .filter(|a| a.is_finite() && *a >= 0.0)
            .map(|a| fmt_age(Duration::from_secs_f64(a)))
            .unwrap_or_else(|| "unknown".into());
        let stale = c["stale"].as_bool() == Some(true);
        let (mut total, mut free) = (0u64, 0u64);
        for d in c["devices"].as_array().into_iter().flatten() {
            total += u64_of(&d["devices"]);
            free += u64_of(&d["free"]);
        }
        let _ = writeln!(
            h,
            "<tr class=\"cluster\" data-cluster=\"{name}\"><td class=\"name\">{name}</td>\
             <td class=\"k8s\">{k8s}</td><td class=\"data-age num\">{age}</td>\
             <td class=\"{cls}\">{state}</td><td class=\"nodes num\">{nodes}</td><td class=\"pods num\">{pods}</td>\
             <td class=\"devices num\">{free} / {total}</td><td class=\"generation num\">{gen}</td></tr>",
            k8s = escape(c["kubernetesVersion"].as_str().unwrap_or("")),
            cls = if stale { "stale" } else { "fresh" },
            state = if stale { "stale" } else { "fresh" },
            nodes = u64_of(&c["nodes"]),
            pods = u64_of(&c["pods"]),
            gen = u64_of(&c["generation"]),
        );
    }
    h.push_str("</tbody></table></section>\n");
}

/// Horizontal stacked bars, one row per (cluster, device class), scaled to the largest class.
fn devices_section(h: &mut String, clusters: &[Value]) {
    const LABEL_W: u32 = 340;
    const BAR_W: u32 = 420;
    const ROW_H: u32 = 24;
    h.push_str("<section id=\"devices\"><h2>Devices by class: used and free</h2>\n");
    let mut rows = Vec::new();
    for c in clusters {
        let cluster = c["name"].as_str().unwrap_or("");
        for d in c["devices"].as_array().into_iter().flatten() {
            let total = u64_of(&d["devices"]);
            let free = u64_of(&d["free"]).min(total);
            // A class the cluster defines but has no device of would be an empty bar.
            if total > 0 {
                rows.push((cluster, d["class"].as_str().unwrap_or(""), total, free));
            }
        }
    }
    if rows.is_empty() {
        h.push_str("<p class=\"empty\">no devices published</p></section>\n");
        return;
    }
    let max = rows.iter().map(|r| r.2).max().unwrap_or(1).max(1);
    let height = ROW_H * u32::try_from(rows.len()).unwrap_or(u32::MAX / ROW_H) + 8;
    let width = LABEL_W + BAR_W + 90;
    h.push_str(
        "<p class=\"legend\"><span style=\"background:#d9822b\"></span>used\
         <span style=\"background:#2f7fc1\"></span>free</p>\n",
    );
    let _ = writeln!(
        h,
        "<svg id=\"devices-chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         role=\"img\" aria-label=\"devices by class, used and free\">"
    );
    for (i, (cluster, class, total, free)) in rows.iter().enumerate() {
        let y = 4 + ROW_H * u32::try_from(i).unwrap_or(0);
        let used = total - free;
        let scale = |n: u64| -> f64 { f64::from(BAR_W) * n as f64 / max as f64 };
        let (uw, fw) = (scale(used), scale(*free));
        let (c, k) = (escape(cluster), escape(class));
        let _ = writeln!(
            h,
            "<g class=\"bar\" data-cluster=\"{c}\" data-class=\"{k}\" data-used=\"{used}\" data-free=\"{free}\">\
             <title>{c} {k}: {used} used, {free} free of {total}</title>\
             <text x=\"0\" y=\"{ty}\">{c} · {k}</text>\
             <rect class=\"used\" x=\"{LABEL_W}\" y=\"{y}\" width=\"{uw:.1}\" height=\"{bh}\"/>\
             <rect class=\"free\" x=\"{fx:.1}\" y=\"{y}\" width=\"{fw:.1}\" height=\"{bh}\"/>\
             <text x=\"{tx:.1}\" y=\"{ty}\">{used} / {total}</text></g>",
            ty = y + 14,
            bh = ROW_H - 6,
            fx = f64::from(LABEL_W) + uw,
            tx = f64::from(LABEL_W) + uw + fw + 6.0,
        );
    }
    h.push_str("</svg></section>\n");
}

fn reservations_section(h: &mut String, reservations: &Value) {
    h.push_str("<section id=\"reservations\"><h2>In-flight reservations</h2>\n");
    let items = reservations.as_array().map(Vec::as_slice).unwrap_or(&[]);
    if items.is_empty() {
        h.push_str("<p class=\"empty\">no reservations</p></section>\n");
        return;
    }
    // Columns: the usual reservation fields first, then other fields in order of appearance.
    let mut cols: Vec<&str> = Vec::new();
    const FIRST: [&str; 6] = [
        "id",
        "status",
        "cluster",
        "workload",
        "replicas",
        "remaining",
    ];
    for f in FIRST {
        if items.iter().any(|it| it.get(f).is_some()) {
            cols.push(f);
        }
    }
    for it in items.iter().take(MAX_RESERVATION_ROWS) {
        if let Some(o) = it.as_object() {
            for k in o.keys() {
                if !cols.contains(&k.as_str()) && cols.len() < MAX_RESERVATION_COLUMNS {
                    cols.push(k);
                }
            }
        }
    }
    h.push_str("<table class=\"reservations\"><thead><tr>");
    if cols.is_empty() {
        h.push_str("<th>reservation</th>");
    }
    for c in &cols {
        let _ = write!(h, "<th>{}</th>", escape(c));
    }
    h.push_str("</tr></thead><tbody>\n");
    for it in items.iter().take(MAX_RESERVATION_ROWS) {
        h.push_str("<tr class=\"reservation\">");
        if cols.is_empty() {
            let _ = write!(h, "<td>{}</td>", escape(&text_of(it)));
        }
        for c in &cols {
            let _ = write!(
                h,
                "<td data-field=\"{}\">{}</td>",
                escape(c),
                escape(&text_of(&it[*c]))
            );
        }
        h.push_str("</tr>\n");
    }
    h.push_str("</tbody></table>\n");
    if items.len() > MAX_RESERVATION_ROWS {
        let _ = writeln!(
            h,
            "<p class=\"meta\">and {} more</p>",
            items.len() - MAX_RESERVATION_ROWS
        );
    }
    h.push_str("</section>\n");
}

fn peers_section(h: &mut String, peers: &[PeerRow]) {
    h.push_str("<section id=\"peers\"><h2>Mesh peers and sync lag</h2>\n");
    if peers.is_empty() {
        h.push_str("<p class=\"empty\">no connected peers</p></section>\n");
        return;
    }
    h.push_str(
        "<table class=\"peers\"><thead><tr><th>peer</th><th>kind</th><th>address</th><th>last heard</th>\
         <th>RTT</th><th>documents behind</th><th>bytes sent / received</th>\
         <th>newest change per cluster (sync lag)</th></tr></thead><tbody>\n",
    );
    for p in peers {
        let name = escape(&p.peer);
        let mut lag = String::new();
        for (c, d) in &p.sync_lag {
            let _ = write!(
                lag,
                "<span class=\"lag\" data-cluster=\"{c}\">{c}: {age} ago</span><br>",
                c = escape(c),
                age = fmt_age(*d)
            );
        }
        if lag.is_empty() {
            lag.push_str("<span class=\"empty\">none since start</span>");
        }
        let _ = writeln!(
            h,
            "<tr class=\"peer\" data-peer=\"{name}\"><td class=\"name\">{name}</td><td class=\"kind\">{kind}</td>\
             <td class=\"addr\">{addr}{dir}</td><td class=\"last-heard num\">{heard} ago</td>\
             <td class=\"rtt num\">{rtt:.1} ms</td><td class=\"docs-behind num\">{behind}</td>\
             <td class=\"bytes num\">{sent} / {recv}</td><td class=\"sync-lag\">{lag}</td></tr>",
            kind = p.kind,
            addr = escape(&p.addr.to_string()),
            dir = if p.dialed { " (dialed)" } else { "" },
            heard = fmt_age(p.last_heard),
            rtt = p.rtt.as_secs_f64() * 1000.0,
            behind = p.docs_behind,
            sent = p.bytes_sent,
            recv = p.bytes_received,
        );
    }
    h.push_str("</tbody></table></section>\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::BTreeMap;

    fn report() -> Value {
        json!({
            "replica": "r<1>",
            "ready": true,
            "digest": "00ff",
            "clusters": [
                {"name": "east", "kubernetesVersion": "1.36", "generation": 3, "dataAgeSeconds": 0.25,
                 "stale": false, "nodes": 4, "pods": 9,
                 "devices": [{"class": "gpu.nvidia.com", "devices": 32, "allocated": 8, "free": 24},
                             {"class": "efa", "devices": 16, "allocated": 0, "free": 16},
                             {"class": "mig", "devices": 0, "allocated": 0, "free": 0}]},
                {"name": "<script>alert(1)</script>", "generation": 1, "stale": true, "nodes": 0, "pods": 0, "devices": []}
            ]
        })
    }

    #[test]
    fn sections_bars_and_escaping() {
        let peers = vec![PeerRow {
            peer: "cluster/east/agent/folder".into(),
            kind: "agent",
            addr: "127.0.0.1:7000".parse().unwrap(),
            dialed: false,
            hello_received: true,
            last_heard: Duration::from_millis(300),
            rtt: Duration::from_micros(1500),
            docs_behind: 2,
            bytes_sent: 10,
            bytes_received: 20,
            sync_lag: BTreeMap::from([("east".to_string(), Duration::from_secs(75))]),
        }];
        let html = render(&report(), &peers);
        for id in ["clusters", "devices", "reservations", "peers"] {
            assert!(html.contains(&format!("<section id=\"{id}\">")), "{id}");
        }
        assert!(html.contains("<tr class=\"cluster\" data-cluster=\"east\">"));
        assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(!html.contains("<script>"), "no raw markup from the report");
        assert!(html.contains("<span id=\"replica\">r&lt;1&gt;</span>"));
        assert_eq!(html.matches("<g class=\"bar\"").count(), 2);
        assert!(html.contains("data-class=\"gpu.nvidia.com\" data-used=\"8\" data-free=\"24\""));
        // The largest class fills the bar: 8 used + 24 free of 32 = 420 px.
        assert!(html.contains("class=\"used\" x=\"340\" y=\"4\" width=\"105.0\""));
        assert!(html.contains("class=\"free\" x=\"445.0\" y=\"4\" width=\"315.0\""));
        assert!(html.contains("<td class=\"devices num\">40 / 48</td>"));
        assert!(html.contains("<p class=\"empty\">no reservations</p>"));
        assert!(html.contains("data-cluster=\"east\">east: 1 min 15 s ago</span>"));
        assert!(html.contains("<td class=\"stale\">stale</td>"));
    }

    #[test]
    fn reservations_become_rows_with_their_fields() {
        let mut r = report();
        r["reservations"] = json!([
            {"cluster": "east", "id": "a", "replicas": 2,
             "workload": {"kind": "Deployment", "namespace": "demo", "name": "w"}},
            {"cluster": "east", "expiresInSeconds": 30.5, "id": "b<"}
        ]);
        let html = render(&r, &[]);
        assert_eq!(html.matches("<tr class=\"reservation\">").count(), 2);
        assert!(html.contains(
            "<th>id</th><th>cluster</th><th>workload</th><th>replicas</th><th>expiresInSeconds</th>"
        ));
        assert!(html.contains("<td data-field=\"workload\">Deployment demo/w</td>"));
        assert!(html.contains("<td data-field=\"id\">b&lt;</td>"));
        assert!(html.contains("<p class=\"empty\">no connected peers</p>"));
    }

    #[test]
    fn ages_read_naturally() {
        assert_eq!(fmt_age(Duration::from_millis(420)), "0.4 s");
        assert_eq!(fmt_age(Duration::from_secs(42)), "42 s");
        assert_eq!(fmt_age(Duration::from_secs(185)), "3 min 5 s");
        assert_eq!(fmt_age(Duration::from_secs(7620)), "2 h 7 min");
    }
}
