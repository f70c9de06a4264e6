//! Semantic versions (semver 2.0.0) as used by DRA `version` attributes and CEL's `semver()`.
//!
//! Parsing is strict, as for ResourceSlice validation: `MAJOR.MINOR.PATCH`, optional
//! `-prerelease` and `+build`, no leading zeros in numeric parts. [`Semver::parse_lenient`]
//! implements the normalization CEL's `semver(s, true)` performs (optional `v` prefix,
//! missing minor/patch, leading zeros). Ordering follows semver precedence and ignores build
//! metadata.

use std::cmp::Ordering;
use std::fmt;

/// A semantic version.
#[derive(Debug, Clone)]
pub struct Semver {
    /// Major version.
    pub major: u64,
    /// Minor version.
    pub minor: u64,
    /// Patch version.
    pub patch: u64,
    /// Prerelease identifiers (empty for a release).
    pub pre: Vec<PreId>,
    /// Build metadata (ignored when comparing).
    pub build: String,
}

/// One dot-separated prerelease identifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreId {
    /// A numeric identifier.
    Num(u64),
    /// An alphanumeric identifier.
    Alpha(String),
}

/// A string that is not a semantic version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not a semantic version: {why}")]
pub struct SemverError {
    /// The input.
    pub input: String,
    /// What is wrong.
    pub why: &'static str,
}

fn err(input: &str, why: &'static str) -> SemverError {
    SemverError {
        input: input.to_string(),
        why,
    }
}

fn numeric(s: &str, input: &str, strict: bool) -> Result<u64, SemverError> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(err(input, "version parts must be numbers"));
    }
    if strict && s.len() > 1 && s.starts_with('0') {
        return Err(err(input, "numbers must not have leading zeros"));
    }
    s.parse().map_err(|_| err(input, "number too large"))
}

fn ident_ok(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

impl Semver {
    /// The release `major.minor.patch`.
    pub fn new(major: u64, minor: u64, patch: u64) -> Semver {
        Semver {
            major,
            minor,
            patch,
            pre: Vec::new(),
            build: String::new(),
        }
    }

    /// Strict semver 2.0.0.
    pub fn parse(input: &str) -> Result<Semver, SemverError> {
        Self::parse_inner(input, input, true)
    }

    /// CEL `semver(s, true)`: strips a leading `v`, fills a missing minor/patch with 0 and
    /// drops leading zeros before parsing strictly.
    pub fn parse_lenient(input: &str) -> Result<Semver, SemverError> {
        let s = input.strip_prefix('v').unwrap_or(input);
        let (core, rest) = match s.find(['-', '+']) {
            Some(i) => (&s[..i], &s[i..]),
            None => (s, ""),
        };
        let mut parts: Vec<String> = core
            .split('.')
            .map(|p| {
                let t = p.trim_start_matches('0');
                if t.is_empty() && !p.is_empty() {
                    "0".to_string()
                } else {
                    t.to_string()
                }
            })
            .collect();
        while parts.len() < 3 {
            parts.push("0".to_string());
        }
        let normalized = format!("{}{rest}", parts.join("."));
        Self::parse_inner(&normalized, input, true)
    }

    fn parse_inner(s: &str, input: &str, strict: bool) -> Result<Semver, SemverError> {
        let (rest, build) = match s.split_once('+') {
            Some((r, b)) => {
                if !b.split('.').all(ident_ok) {
                    return Err(err(input, "invalid build metadata"));
                }
                (r, b.to_string())
            }
            None => (s, String::new()),
        };
        let (core, pre) = match rest.split_once('-') {
            Some((c, p)) => (c, Some(p)),
            None => (rest, None),
        };
        let mut it = core.split('.');
        let (Some(ma), Some(mi), Some(pa), None) = (it.next(), it.next(), it.next(), it.next())
        else {
            return Err(err(input, "expected MAJOR.MINOR.PATCH"));
        };
        let mut v = Semver::new(
            numeric(ma, input, strict)?,
            numeric(mi, input, strict)?,
            numeric(pa, input, strict)?,
        );
        v.build = build;
        if let Some(pre) = pre {
            for id in pre.split('.') {
                if !ident_ok(id) {
                    return Err(err(input, "invalid prerelease identifier"));
                }
                if id.bytes().all(|b| b.is_ascii_digit()) {
                    v.pre.push(PreId::Num(numeric(id, input, strict)?));
                } else {
                    v.pre.push(PreId::Alpha(id.to_string()));
                }
            }
        }
        Ok(v)
    }
}

impl PartialEq for Semver {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Semver {}
impl PartialOrd for Semver {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Semver {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.major, self.minor, self.patch)
            .cmp(&(other.major, other.minor, other.patch))
            .then_with(|| match (self.pre.is_empty(), other.pre.is_empty()) {
                (true, true) => Ordering::Equal,
                // A prerelease has lower precedence than the release.
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => {
                    for (a, b) in self.pre.iter().zip(&other.pre) {
                        let o = match (a, b) {
                            (PreId::Num(x), PreId::Num(y)) => x.cmp(y),
                            (PreId::Num(_), PreId::Alpha(_)) => Ordering::Less,
                            (PreId::Alpha(_), PreId::Num(_)) => Ordering::Greater,
                            (PreId::Alpha(x), PreId::Alpha(y)) => x.cmp(y),
                        };
                        if o != Ordering::Equal {
                            return o;
                        }
                    }
                    self.pre.len().cmp(&other.pre.len())
                }
            })
    }
}

impl fmt::Display for Semver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)?;
        for (i, p) in self.pre.iter().enumerate() {
            f.write_str(if i == 0 { "-" } else { "." })?;
            match p {
                PreId::Num(n) => write!(f, "{n}")?,
                PreId::Alpha(s) => f.write_str(s)?,
            }
        }
        if !self.build.is_empty() {
            write!(f, "+{}", self.build)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_parse() {
        let v = Semver::parse("1.2.3-rc.1+build.5").unwrap();
        assert_eq!((v.major, v.minor, v.patch), (1, 2, 3));
        assert_eq!(v.to_string(), "1.2.3-rc.1+build.5");
        for bad in [
            "1.2", "01.2.3", "1.2.3.4", "v1.2.3", "1.2.x", "", "1.2.3-", "1.2.3+",
        ] {
            assert!(Semver::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn lenient_parse() {
        assert_eq!(Semver::parse_lenient("v1.2").unwrap(), Semver::new(1, 2, 0));
        assert_eq!(
            Semver::parse_lenient("01.02.003").unwrap(),
            Semver::new(1, 2, 3)
        );
        assert_eq!(Semver::parse_lenient("3").unwrap(), Semver::new(3, 0, 0));
    }

    #[test]
    fn precedence() {
        let order = [
            "1.0.0-alpha",
            "1.0.0-alpha.1",
            "1.0.0-alpha.beta",
            "1.0.0-beta",
            "1.0.0-beta.2",
            "1.0.0-beta.11",
            "1.0.0-rc.1",
            "1.0.0",
            "1.0.1",
            "1.10.0",
            "2.0.0",
        ];
        for w in order.windows(2) {
            assert!(
                Semver::parse(w[0]).unwrap() < Semver::parse(w[1]).unwrap(),
                "{w:?}"
            );
        }
        assert_eq!(
            Semver::parse("1.0.0+a").unwrap(),
            Semver::parse("1.0.0+b").unwrap()
        );
    }
}
