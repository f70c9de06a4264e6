//! A strict parser for the Prometheus text format 0.0.4, used to check rendered output
//! independently of the renderer.

#![allow(dead_code)]

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sample {
    pub(crate) name: String,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) value: f64,
}

#[derive(Debug, Default)]
pub(crate) struct Exposition {
    /// family name -> TYPE keyword
    pub(crate) types: BTreeMap<String, String>,
    /// family name -> HELP text (unescaped)
    pub(crate) help: BTreeMap<String, String>,
    pub(crate) samples: Vec<Sample>,
}

impl Exposition {
    pub(crate) fn family_samples(&self, family: &str) -> Vec<&Sample> {
        let suffixes: &[&str] = match self.types.get(family).map(String::as_str) {
            Some("histogram") => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        self.samples
            .iter()
            .filter(|s| {
                suffixes
                    .iter()
                    .any(|suf| s.name.strip_suffix(suf) == Some(family))
            })
            .collect()
    }

    pub(crate) fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.samples
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
    }
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s
            .parse::<f64>()
            .map_err(|e| format!("bad value {s:?}: {e}")),
    }
}

fn is_name(s: &str, first_colon: bool) -> bool {
    let mut cs = s.chars();
    matches!(cs.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || (first_colon && c == ':'))
        && cs.all(|c| c.is_ascii_alphanumeric() || c == '_' || (first_colon && c == ':'))
}

fn unescape_help(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\\' {
            match it.next() {
                Some('\\') => out.push('\\'),
                Some('n') => out.push('\n'),
                other => return Err(format!("bad escape in HELP: {other:?}")),
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// Parses `k="v",...}` starting right after `{`; returns labels and the rest after `}`.
fn parse_labels(mut s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    loop {
        if let Some(rest) = s.strip_prefix('}') {
            return Ok((labels, rest));
        }
        let eq = s.find('=').ok_or("label without =")?;
        let key = &s[..eq];
        if !is_name(key, false) {
            return Err(format!("bad label name {key:?}"));
        }
        s = s[eq + 1..]
            .strip_prefix('"')
            .ok_or("label value not quoted")?;
        let mut val = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value".into()),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => val.push('\\'),
                    Some((_, '"')) => val.push('"'),
                    Some((_, 'n')) => val.push('\n'),
                    other => return Err(format!("bad escape in label value: {other:?}")),
                },
                Some((_, '\n')) => return Err("raw newline in label value".into()),
                Some((_, c)) => val.push(c),
            }
        };
        if labels.insert(key.to_owned(), val).is_some() {
            return Err(format!("label {key} repeated"));
        }
        s = &s[end + 1..];
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err(format!("expected , or }} after label, got {s:?}"));
        }
    }
}

/// Parses a whole exposition, checking that every sample follows its family's TYPE line and that
/// a family's samples are contiguous.
pub(crate) fn parse(text: &str) -> Result<Exposition, String> {
    let mut exp = Exposition::default();
    let mut current: Option<String> = None;
    let mut closed: Vec<String> = Vec::new();
    if !text.ends_with('\n') {
        return Err("exposition must end with a line feed".into());
    }
    for (n, line) in text.lines().enumerate() {
        let ctx = |e: String| format!("line {}: {e}: {line:?}", n + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let kw = parts.next().unwrap_or("");
            let name = parts.next().ok_or_else(|| ctx("missing name".into()))?;
            let arg = parts.next().unwrap_or("");
            match kw {
                "HELP" => {
                    if exp.help.contains_key(name) {
                        return Err(ctx("HELP twice".into()));
                    }
                    exp.help
                        .insert(name.to_owned(), unescape_help(arg).map_err(ctx)?);
                }
                "TYPE" => {
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&arg) {
                        return Err(ctx(format!("bad type {arg}")));
                    }
                    if exp.types.insert(name.to_owned(), arg.to_owned()).is_some() {
                        return Err(ctx("TYPE twice".into()));
                    }
                    if let Some(prev) = current.replace(name.to_owned()) {
                        closed.push(prev);
                    }
                }
                _ => {}
            }
            continue;
        }
        let name_end = line
            .find(['{', ' '])
            .ok_or_else(|| ctx("no value".into()))?;
        let name = &line[..name_end];
        if !is_name(name, true) {
            return Err(ctx(format!("bad metric name {name:?}")));
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end + 1..]).map_err(ctx)?
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let value_str = rest
            .strip_prefix(' ')
            .ok_or_else(|| ctx("no space before value".into()))?;
        if value_str.contains(' ') {
            return Err(ctx("timestamps are not expected".into()));
        }
        let value = parse_value(value_str).map_err(ctx)?;
        let family = current
            .clone()
            .ok_or_else(|| ctx("sample before any TYPE".into()))?;
        let ty = exp.types[&family].as_str();
        let ok = match ty {
            "histogram" => ["_bucket", "_sum", "_count"]
                .iter()
                .any(|s| name.strip_suffix(s) == Some(family.as_str())),
            _ => name == family,
        };
        if !ok || closed.contains(&family) {
            return Err(ctx(format!(
                "sample does not belong to the current family {family}"
            )));
        }
        if ty == "histogram" && name.ends_with("_bucket") != labels.contains_key("le") {
            return Err(ctx("le label only and always on _bucket".into()));
        }
        exp.samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    Ok(exp)
}

type SeriesKey = Vec<(String, String)>;

/// Checks every histogram: per series, `le` strictly increasing and ending in +Inf, counts
/// cumulative, `_count` equal to the +Inf bucket, and a `_sum` present.
pub(crate) fn check_histograms(exp: &Exposition) -> Result<(), String> {
    for (family, ty) in &exp.types {
        if ty != "histogram" {
            continue;
        }
        // series key: labels without le
        let mut series: BTreeMap<SeriesKey, Vec<(f64, f64)>> = BTreeMap::new();
        let mut sums = BTreeMap::new();
        let mut counts = BTreeMap::new();
        for s in exp.family_samples(family) {
            let key: SeriesKey = s
                .labels
                .iter()
                .filter(|(k, _)| *k != "le")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if s.name.ends_with("_bucket") {
                let le = parse_value(&s.labels["le"])?;
                series.entry(key).or_default().push((le, s.value));
            } else if s.name.ends_with("_sum") {
                sums.insert(key, s.value);
            } else {
                counts.insert(key, s.value);
            }
        }
        for (key, buckets) in &series {
            for w in buckets.windows(2) {
                if w[0].0 >= w[1].0 {
                    return Err(format!("{family}{key:?}: le not increasing: {buckets:?}"));
                }
                if w[0].1 > w[1].1 {
                    return Err(format!(
                        "{family}{key:?}: buckets not cumulative: {buckets:?}"
                    ));
                }
            }
            let last = buckets.last().ok_or("no buckets")?;
            if last.0 != f64::INFINITY {
                return Err(format!("{family}{key:?}: last bucket is not +Inf"));
            }
            let count = counts
                .get(key)
                .ok_or_else(|| format!("{family}{key:?}: no _count"))?;
            if *count != last.1 {
                return Err(format!(
                    "{family}{key:?}: _count {count} != +Inf bucket {}",
                    last.1
                ));
            }
            if !sums.contains_key(key) {
                return Err(format!("{family}{key:?}: no _sum"));
            }
        }
        if series.len() != counts.len() || series.len() != sums.len() {
            return Err(format!("{family}: _sum/_count without buckets"));
        }
    }
    Ok(())
}
