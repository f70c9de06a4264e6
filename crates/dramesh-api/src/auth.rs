//! Who is calling, and whether they may: authentication and authorization of every API call.
//!
//! * **Identities** ([`Identity`]) follow Kubernetes: a user name and groups. A client
//!   certificate (verified against `--api-client-ca`) names the user by its subject CommonName
//!   (else its first URI SAN) and the groups by its Organizations; a bearer token
//!   (`Authorization: Bearer ...`, over HTTP or as gRPC metadata) is looked up in the static
//!   token file ([`TokenFile`], Kubernetes' `--token-auth-file` CSV format) or, failing that,
//!   reviewed by the API server ([`TokenReviewer`], cached per [`ReviewCache`]). A caller with
//!   neither is `system:anonymous` in group `system:unauthenticated`; every authenticated
//!   caller is also in `system:authenticated`. A token that is presented but not valid is
//!   refused (401), never downgraded to anonymous.
//! * **Verbs** ([`Verb`]): `read` (estimates, placement, preemption, status, Karmada estimator
//!   calls, reading reservations), `write` (creating and releasing reservations), `admin`
//!   (releasing anyone's reservation, retiring clusters). Admin implies write, write implies
//!   read. [`Policy`] names, per verb, the users and `group:`s granted it.
//! * **Refusals** (401, 403, 429) are counted in `dramesh_api_refusals_total{identity,reason}`
//!   and logged at most once per identity and reason per minute ([`Refusals`]).
//!
//! `/healthz`, `/readyz` and `/metrics` need no credentials ([`http_verb`]).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

use crate::backend::ApiError;
use crate::metrics::Metrics;

/// Kubernetes' user name of a caller without credentials.
pub const ANONYMOUS: &str = "system:anonymous";
/// Kubernetes' group of every caller without credentials.
pub const UNAUTHENTICATED: &str = "system:unauthenticated";
/// Kubernetes' group of every caller with valid credentials.
pub const AUTHENTICATED: &str = "system:authenticated";
/// Longest bearer token accepted (ServiceAccount tokens are about 1 KB).
pub const MAX_TOKEN_BYTES: usize = 8192;

/// A caller: a user name and its groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The user name (`system:serviceaccount:ns:name`, a certificate's CN, ...).
    pub user: String,
    /// Groups, `system:authenticated` or `system:unauthenticated` included.
    pub groups: Vec<String>,
}

impl Identity {
    /// The caller without credentials.
    pub fn anonymous() -> Identity {
        Identity {
            user: ANONYMOUS.into(),
            groups: vec![UNAUTHENTICATED.into()],
        }
    }

    /// An authenticated caller: `user` in `groups` and `system:authenticated`.
    pub fn authenticated(user: impl Into<String>, mut groups: Vec<String>) -> Identity {
        if !groups.iter().any(|g| g == AUTHENTICATED) {
            groups.push(AUTHENTICATED.into());
        }
        Identity {
            user: user.into(),
            groups,
        }
    }

    /// Whether this is the caller without credentials.
    pub fn is_anonymous(&self) -> bool {
        self.groups.iter().any(|g| g == UNAUTHENTICATED)
    }
}

/// An authorized caller as the backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Who calls.
    pub identity: Identity,
    /// Whether the policy grants it `admin` (it may then release anyone's reservation).
    pub admin: bool,
}

/// What a call does, for authorization.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verb {
    /// Reads: estimates, placement, preemption, status, Karmada estimator calls.
    Read,
    /// Writes: creating and releasing (own) reservations.
    Write,
    /// Administration: releasing anyone's reservation, retiring clusters.
    Admin,
}

impl Verb {
    /// The verb's name in messages and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Read => "read",
            Verb::Write => "write",
            Verb::Admin => "admin",
        }
    }
}

/// The verb an HTTP request needs; `None` for the unauthenticated health, readiness and
/// metrics endpoints. Every other GET reads; POSTs to the query endpoints read; creating or
/// deleting a reservation writes; any other DELETE is admin.
pub fn http_verb(method: &axum::http::Method, path: &str) -> Option<Verb> {
    use axum::http::Method as M;
    if matches!(path, "/healthz" | "/readyz" | "/metrics") {
        return None;
    }
    Some(match *method {
        M::GET | M::HEAD => Verb::Read,
        M::POST if matches!(path, "/v1/estimate" | "/v1/place" | "/v1/preempt") => Verb::Read,
        M::POST if path == "/v1/reservations" => Verb::Write,
        M::DELETE if path.starts_with("/v1/reservations/") => Verb::Write,
        // Retiring a cluster (`DELETE /v1/clusters/{name}`), and anything not listed.
        _ => Verb::Admin,
    })
}

/// Who holds a verb: a user name, or `group:NAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// Exactly this user.
    User(String),
    /// Every member of this group.
    Group(String),
}

impl Subject {
    /// Parses `NAME` or `group:NAME`.
    pub fn parse(s: &str) -> Result<Subject, String> {
        let s = s.trim();
        let (sub, name) = match s.strip_prefix("group:") {
            Some(g) => (Subject::Group(g.to_owned()), g),
            None => (Subject::User(s.to_owned()), s),
        };
        if name.is_empty() {
            return Err(format!("{s:?}: expected a user name or group:NAME"));
        }
        Ok(sub)
    }

    fn matches(&self, id: &Identity) -> bool {
        match self {
            Subject::User(u) => *u == id.user,
            Subject::Group(g) => id.groups.iter().any(|x| x == g),
        }
    }
}

/// Who may do what. Admin implies write, write implies read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Granted `read`.
    pub readers: Vec<Subject>,
    /// Granted `write` (and `read`).
    pub writers: Vec<Subject>,
    /// Granted `admin` (and `write`, `read`).
    pub admins: Vec<Subject>,
}

impl Default for Policy {
    /// Every authenticated caller reads; nobody writes or administers.
    fn default() -> Self {
        Policy {
            readers: vec![Subject::Group(AUTHENTICATED.into())],
            writers: Vec::new(),
            admins: Vec::new(),
        }
    }
}

impl Policy {
    /// Whether `id` holds `verb`.
    pub fn allows(&self, id: &Identity, verb: Verb) -> bool {
        let any = |subs: &[Subject]| subs.iter().any(|s| s.matches(id));
        match verb {
            Verb::Read => any(&self.readers) || any(&self.writers) || any(&self.admins),
            Verb::Write => any(&self.writers) || any(&self.admins),
            Verb::Admin => any(&self.admins),
        }
    }
}

/// Per-identity bounds of reservations, enforced by the backend when one is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Live reservations at most. Default 50.
    pub max_reservations: usize,
    /// Replicas summed over live reservations at most. Default 10,000.
    pub max_reserved_replicas: i64,
    /// Bytes of workload manifests summed over live reservations at most. Default 4 MiB.
    pub max_manifest_bytes: usize,
    /// Longest time to live of one reservation. Default 3,600 s.
    pub max_ttl: Duration,
}

impl Default for Caps {
    fn default() -> Self {
        Caps {
            max_reservations: 50,
            max_reserved_replicas: 10_000,
            max_manifest_bytes: 4 * 1024 * 1024,
            max_ttl: Duration::from_secs(3600),
        }
    }
}

/// Why a call was refused, as counted and logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RefusalKind {
    /// No valid credentials where they are needed: HTTP 401, gRPC UNAUTHENTICATED.
    Unauthenticated,
    /// The identity lacks the verb, or the object is someone else's: HTTP 403, gRPC
    /// PERMISSION_DENIED.
    Forbidden,
    /// Over a per-identity cap: HTTP 429, gRPC RESOURCE_EXHAUSTED.
    OverCap,
}

/// A refused call: its kind, a short `reason` label (bounded vocabulary) and the message
/// (naming the identity and the cap or verb).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The kind (status code).
    pub kind: RefusalKind,
    /// The metric label: `bad_token`, `no_credentials`, `forbidden_read`, `not_creator`,
    /// `cap_reservations`, ...
    pub reason: &'static str,
    /// The identity refused.
    pub identity: String,
    /// What the caller is told.
    pub message: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Counts refusals and logs each (identity, reason) at most once per [`Refusals::LOG_EVERY`].
#[derive(Debug)]
pub struct Refusals {
    last_logged: Mutex<HashMap<(String, &'static str), Instant>>,
}

impl Default for Refusals {
    fn default() -> Self {
        Refusals {
            last_logged: Mutex::new(HashMap::new()),
        }
    }
}

impl Refusals {
    /// Minimum time between two log lines for the same identity and reason.
    pub const LOG_EVERY: Duration = Duration::from_secs(60);
    /// (identity, reason) pairs remembered at most; older ones are forgotten first.
    const MAX_REMEMBERED: usize = 4096;

    /// Counts `r` and logs it unless the same identity and reason was logged within a minute.
    /// Returns whether it was logged.
    pub fn record(&self, metrics: &Metrics, r: &Refusal) -> bool {
        metrics
            .api_refusals_total
            .with([r.identity.as_str(), r.reason])
            .inc();
        let now = Instant::now();
        let mut seen = self.last_logged.lock().unwrap_or_else(|p| p.into_inner());
        let key = (r.identity.clone(), r.reason);
        if let Some(t) = seen.get(&key)
            && now.duration_since(*t) < Self::LOG_EVERY
        {
            return false;
        }
        if seen.len() >= Self::MAX_REMEMBERED {
            seen.retain(|_, t| now.duration_since(*t) < Self::LOG_EVERY);
            if seen.len() >= Self::MAX_REMEMBERED {
                // Every entry is recent: a flood of distinct identities. Stop remembering the
                // oldest rather than growing.
                if let Some(oldest) = seen.iter().min_by_key(|(_, t)| **t).map(|(k, _)| k.clone()) {
                    seen.remove(&oldest);
                }
            }
        }
        seen.insert(key, now);
        tracing::warn!(
            identity = %r.identity,
            reason = r.reason,
            kind = ?r.kind,
            message = %r.message,
            "API request refused (logged once per identity and reason per minute)"
        );
        true
    }
}

/// A static token file in Kubernetes' `--token-auth-file` format: one
/// `token,user,uid[,"group1,group2"]` per line; blank lines and `#` comments are skipped.
#[derive(Clone, Default)]
pub struct TokenFile {
    by_hash: HashMap<[u8; 32], Identity>,
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenFile")
            .field("tokens", &self.by_hash.len())
            .finish()
    }
}

fn token_hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// A token file that cannot be used; names the file and line.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    /// The file cannot be read.
    #[error("cannot read token file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A line is malformed.
    #[error("token file {path}, line {line}: {message}")]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
}

/// Splits one CSV line (fields optionally in double quotes, `""` an escaped quote).
fn csv_fields(line: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    let mut was_quoted = false;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                cur.push('"');
            }
            (true, '"') => quoted = false,
            (true, c) => cur.push(c),
            (false, '"') if cur.is_empty() && !was_quoted => {
                quoted = true;
                was_quoted = true;
            }
            (false, '"') => return Err("a quote inside an unquoted field".into()),
            (false, ',') => {
                out.push(std::mem::take(&mut cur));
                was_quoted = false;
            }
            (false, c) if was_quoted => {
                return Err(format!("{c:?} after a closing quote"));
            }
            (false, c) => cur.push(c),
        }
    }
    if quoted {
        return Err("an unterminated quote".into());
    }
    out.push(cur);
    Ok(out)
}

impl TokenFile {
    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<TokenFile, TokenFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenFileError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses token file text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<TokenFile, TokenFileError> {
        let mut by_hash = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let err = |message: String| TokenFileError::Line {
                path: path.to_owned(),
                line: i + 1,
                message,
            };
            let f = csv_fields(line).map_err(err)?;
            if f.len() < 3 {
                return Err(err(format!(
                    "expected token,user,uid[,\"group1,group2\"], found {} field(s)",
                    f.len()
                )));
            }
            let (token, user) = (f[0].trim(), f[1].trim());
            if token.is_empty() || user.is_empty() {
                return Err(err("the token and the user must not be empty".into()));
            }
            if token.len() > MAX_TOKEN_BYTES {
                return Err(err(format!(
                    "the token is longer than {MAX_TOKEN_BYTES} bytes"
                )));
            }
            let groups = f
                .get(3)
                .map(|g| {
                    g.split(',')
                        .map(str::trim)
                        .filter(|g| !g.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default();
            if by_hash
                .insert(token_hash(token), Identity::authenticated(user, groups))
                .is_some()
            {
                return Err(err("the same token appears on an earlier line".into()));
            }
        }
        Ok(TokenFile { by_hash })
    }

    /// The identity of `token`, if listed.
    pub fn lookup(&self, token: &str) -> Option<&Identity> {
        self.by_hash.get(&token_hash(token))
    }

    /// Whether the file lists no token.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

/// A boxed future of a token review.
pub type ReviewFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Option<Identity>, String>> + Send + 'a>>;

/// Checks a bearer token with an authority (Kubernetes TokenReview): `Ok(Some)` for a valid
/// token, `Ok(None)` for one the authority says is not valid, `Err` when it cannot be asked.
pub trait TokenReviewer: Send + Sync + 'static {
    /// Reviews `token`.
    fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a>;
}

/// Bounds of the token review cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReviewCache {
    /// How long a valid token's identity is reused. Default 60 s.
    pub ttl: Duration,
    /// How long a refused token stays refused without asking again. Default 10 s.
    pub negative_ttl: Duration,
    /// Tokens remembered at most (by SHA-256, never in clear). Default 4096.
    pub max_entries: usize,
    /// Time limit of one review. Default 5 s.
    pub timeout: Duration,
}

impl Default for ReviewCache {
    fn default() -> Self {
        ReviewCache {
            ttl: Duration::from_secs(60),
            negative_ttl: Duration::from_secs(10),
            max_entries: 4096,
            timeout: Duration::from_secs(5),
        }
    }
}

/// Reviewed tokens by SHA-256: until when the answer holds, and the answer.
type Reviews = BTreeMap<[u8; 32], (Instant, Option<Identity>)>;

struct Reviewed {
    reviewer: Arc<dyn TokenReviewer>,
    bounds: ReviewCache,
    cache: Mutex<Reviews>,
}

/// Authentication and authorization of API calls. Cheap to share (`Arc`).
pub struct Auth {
    /// Who may do what.
    pub policy: Policy,
    tokens: TokenFile,
    reviewer: Option<Reviewed>,
    refusals: Refusals,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("policy", &self.policy)
            .field("tokens", &self.tokens)
            .field("token_review", &self.reviewer.is_some())
            .finish_non_exhaustive()
    }
}

impl Default for Auth {
    fn default() -> Self {
        Auth::new(Policy::default())
    }
}

/// Credentials a request presents.
#[derive(Debug, Clone, Default)]
pub struct Credentials<'a> {
    /// The identity of a verified client certificate.
    pub certificate: Option<&'a Identity>,
    /// The value of the `Authorization` header or metadata, if any.
    pub authorization: Option<&'a str>,
}

impl Auth {
    /// `policy` with no token file and no token review.
    pub fn new(policy: Policy) -> Auth {
        Auth {
            policy,
            tokens: TokenFile::default(),
            reviewer: None,
            refusals: Refusals::default(),
        }
    }

    /// Accepts the bearer tokens of `tokens`.
    pub fn with_tokens(mut self, tokens: TokenFile) -> Auth {
        self.tokens = tokens;
        self
    }

    /// Accepts bearer tokens `reviewer` vouches for (after the token file).
    pub fn with_reviewer(mut self, reviewer: Arc<dyn TokenReviewer>, bounds: ReviewCache) -> Auth {
        self.reviewer = Some(Reviewed {
            reviewer,
            bounds,
            cache: Mutex::new(BTreeMap::new()),
        });
        self
    }

    fn unauthenticated(reason: &'static str, message: String) -> Refusal {
        Refusal {
            kind: RefusalKind::Unauthenticated,
            reason,
            identity: ANONYMOUS.into(),
            message,
        }
    }

    /// Who presents `creds`. A bearer token wins over a certificate (a proxy holding a client
    /// certificate may pass its caller's token); an invalid token is refused.
    pub async fn authenticate(&self, creds: &Credentials<'_>) -> Result<Identity, Refusal> {
        let Some(header) = creds.authorization else {
            return Ok(creds
                .certificate
                .cloned()
                .unwrap_or_else(Identity::anonymous));
        };
        let token = header
            .strip_prefix("Bearer ")
            .or_else(|| header.strip_prefix("bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                Self::unauthenticated(
                    "bad_authorization",
                    "the authorization header is not \"Bearer <token>\"".into(),
                )
            })?;
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Self::unauthenticated(
                "bad_token",
                format!("the bearer token is longer than {MAX_TOKEN_BYTES} bytes"),
            ));
        }
        if let Some(id) = self.tokens.lookup(token) {
            return Ok(id.clone());
        }
        let Some(r) = &self.reviewer else {
            return Err(Self::unauthenticated(
                "bad_token",
                "the bearer token is not valid".into(),
            ));
        };
        let key = token_hash(token);
        let now = Instant::now();
        {
            let cache = r.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((until, id)) = cache.get(&key)
                && now < *until
            {
                return id.clone().ok_or_else(|| {
                    Self::unauthenticated("bad_token", "the bearer token is not valid".into())
                });
            }
        }
        let reviewed = match tokio::time::timeout(r.bounds.timeout, r.reviewer.review(token)).await
        {
            Ok(Ok(id)) => id,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "token review failed");
                return Err(Self::unauthenticated(
                    "review_failed",
                    format!("the bearer token could not be reviewed: {e}"),
                ));
            }
            Err(_) => {
                return Err(Self::unauthenticated(
                    "review_failed",
                    format!(
                        "the bearer token could not be reviewed within {:?}",
                        r.bounds.timeout
                    ),
                ));
            }
        };
        {
            let mut cache = r.cache.lock().unwrap_or_else(|p| p.into_inner());
            if cache.len() >= r.bounds.max_entries {
                cache.retain(|_, (until, _)| now < *until);
                while cache.len() >= r.bounds.max_entries.max(1) {
                    let Some(k) = cache
                        .iter()
                        .min_by_key(|(_, (until, _))| *until)
                        .map(|(k, _)| *k)
                    else {
                        break;
                    };
                    cache.remove(&k);
                }
            }
            let ttl = if reviewed.is_some() {
                r.bounds.ttl
            } else {
                r.bounds.negative_ttl
            };
            cache.insert(key, (now + ttl, reviewed.clone()));
        }
        reviewed.ok_or_else(|| {
            Self::unauthenticated("bad_token", "the bearer token is not valid".into())
        })
    }

    /// Checks that `id` holds `verb`; on success the caller as the backend sees it.
    pub fn authorize(&self, id: Identity, verb: Verb, what: &str) -> Result<Caller, Refusal> {
        if !self.policy.allows(&id, verb) {
            if id.is_anonymous() {
                return Err(Self::unauthenticated(
                    "no_credentials",
                    format!(
                        "{what} needs the {} permission: present a client certificate or a bearer token",
                        verb.as_str()
                    ),
                ));
            }
            return Err(Refusal {
                kind: RefusalKind::Forbidden,
                reason: match verb {
                    Verb::Read => "forbidden_read",
                    Verb::Write => "forbidden_write",
                    Verb::Admin => "forbidden_admin",
                },
                message: format!(
                    "{} may not {what}: it lacks the {} permission",
                    id.user,
                    verb.as_str()
                ),
                identity: id.user,
            });
        }
        let admin = self.policy.allows(&id, Verb::Admin);
        Ok(Caller {
            identity: id,
            admin,
        })
    }

    /// Authenticates and authorizes in one step, counting and logging a refusal.
    pub async fn check(
        &self,
        metrics: &Metrics,
        creds: &Credentials<'_>,
        verb: Verb,
        what: &str,
    ) -> Result<Caller, ApiError> {
        let r = match self.authenticate(creds).await {
            Ok(id) => self.authorize(id, verb, what),
            Err(r) => Err(r),
        };
        r.map_err(|r| self.refused(metrics, r))
    }

    /// Counts and logs a refusal (also one the backend made) and turns it into the error.
    pub fn refused(&self, metrics: &Metrics, r: Refusal) -> ApiError {
        self.refusals.record(metrics, &r);
        ApiError::Refused(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    #[test]
    fn token_file_parses_kubernetes_format_and_names_bad_lines() {
        let f = TokenFile::parse(
            "# comment\n\nt1,alice,uid1,\"ops,dev\"\nt2,bob,uid2\n",
            &p("tokens.csv"),
        )
        .unwrap();
        let a = f.lookup("t1").unwrap();
        assert_eq!(a.user, "alice");
        assert_eq!(a.groups, ["ops", "dev", AUTHENTICATED]);
        assert_eq!(f.lookup("t2").unwrap().groups, [AUTHENTICATED]);
        assert!(f.lookup("t3").is_none());
        let e = TokenFile::parse("t1,alice,u\nt2,bob\n", &p("tokens.csv"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("tokens.csv, line 2"), "{e}");
        let e = TokenFile::parse("t1,alice,u\nt1,bob,u\n", &p("x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains("earlier line"), "{e}");
        let e = TokenFile::parse("t1,alice,u,\"ops\n", &p("x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unterminated"), "{e}");
    }

    #[test]
    fn policy_verbs_nest_and_groups_match() {
        let policy = Policy {
            readers: vec![Subject::parse("group:system:authenticated").unwrap()],
            writers: vec![Subject::parse("alice").unwrap()],
            admins: vec![Subject::parse("group:ops").unwrap()],
        };
        let alice = Identity::authenticated("alice", vec![]);
        let carol = Identity::authenticated("carol", vec!["ops".into()]);
        let bob = Identity::authenticated("bob", vec![]);
        assert!(policy.allows(&alice, Verb::Write) && !policy.allows(&alice, Verb::Admin));
        assert!(policy.allows(&carol, Verb::Admin) && policy.allows(&carol, Verb::Write));
        assert!(policy.allows(&bob, Verb::Read) && !policy.allows(&bob, Verb::Write));
        assert!(!policy.allows(&Identity::anonymous(), Verb::Read));
        assert!(Subject::parse("group:").is_err());
    }

    #[test]
    fn http_verbs() {
        use axum::http::Method as M;
        assert_eq!(http_verb(&M::GET, "/metrics"), None);
        assert_eq!(http_verb(&M::GET, "/healthz"), None);
        assert_eq!(http_verb(&M::GET, "/v1/status"), Some(Verb::Read));
        assert_eq!(http_verb(&M::POST, "/v1/estimate"), Some(Verb::Read));
        assert_eq!(http_verb(&M::POST, "/v1/reservations"), Some(Verb::Write));
        assert_eq!(
            http_verb(&M::DELETE, "/v1/reservations/r1-1"),
            Some(Verb::Write)
        );
        assert_eq!(
            http_verb(&M::DELETE, "/v1/clusters/east"),
            Some(Verb::Admin)
        );
    }

    struct Counting(std::sync::atomic::AtomicUsize);
    impl TokenReviewer for Counting {
        fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(
                async move { Ok((token == "good").then(|| Identity::authenticated("sa", vec![]))) },
            )
        }
    }

    #[tokio::test]
    async fn tokens_are_checked_and_reviews_cached_and_bounded() {
        let reviewer = Arc::new(Counting(Default::default()));
        let auth = Auth::new(Policy::default())
            .with_tokens(TokenFile::parse("t1,alice,u\n", &p("x")).unwrap())
            .with_reviewer(
                reviewer.clone(),
                ReviewCache {
                    max_entries: 2,
                    ..ReviewCache::default()
                },
            );
        let creds = |h: &'static str| Credentials {
            certificate: None,
            authorization: Some(h),
        };
        assert_eq!(
            auth.authenticate(&creds("Bearer t1")).await.unwrap().user,
            "alice"
        );
        assert_eq!(reviewer.0.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(
            auth.authenticate(&creds("Bearer good")).await.unwrap().user,
            "sa"
        );
        auth.authenticate(&creds("Bearer good")).await.unwrap();
        assert_eq!(reviewer.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        let e = auth.authenticate(&creds("Bearer bad")).await.unwrap_err();
        assert_eq!(e.kind, RefusalKind::Unauthenticated);
        auth.authenticate(&creds("Bearer other")).await.unwrap_err();
        let cached = auth.reviewer.as_ref().unwrap().cache.lock().unwrap().len();
        assert!(cached <= 2, "{cached}");
        let e = auth.authenticate(&creds("Basic x")).await.unwrap_err();
        assert_eq!(e.reason, "bad_authorization");
        let anon = auth.authenticate(&Credentials::default()).await.unwrap();
        assert!(anon.is_anonymous());
    }

    #[test]
    fn refusals_are_counted_always_and_logged_once_a_minute() {
        let m = Metrics::new();
        let r = Refusals::default();
        let refusal = Refusal {
            kind: RefusalKind::Forbidden,
            reason: "forbidden_write",
            identity: "bob".into(),
            message: "no".into(),
        };
        assert!(r.record(&m, &refusal));
        assert!(!r.record(&m, &refusal));
        let text = m.render();
        assert!(
            text.contains(
                r#"dramesh_api_refusals_total{identity="bob",reason="forbidden_write"} 2"#
            ),
            "{text}"
        );
    }
}
