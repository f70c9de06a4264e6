//! The API listeners' security flags of `dramesh replica` (TLS, credentials, who may do what,
//! per-identity caps) and their wiring into `dramesh_api`'s types (README, "Securing the
//! APIs").

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use dramesh_api::auth::{AUTHENTICATED, Auth, Caps, Policy, ReviewCache, Subject, TokenFile};
use dramesh_api::tls::{ApiTls, TlsFiles};

/// TLS of the API listeners (shared by `replica` and `demo`).
#[derive(clap::Args, Clone, Debug, Default)]
pub(crate) struct TlsArgs {
    /// Server certificate (PEM) of the --api and --grpc listeners.
    #[arg(long, requires = "api_key")]
    pub(crate) api_cert: Option<PathBuf>,
    /// Private key (PEM) of --api-cert.
    #[arg(long, requires = "api_cert")]
    pub(crate) api_key: Option<PathBuf>,
    /// CA bundle (PEM) client certificates must chain to; a verified certificate names the
    /// caller (CommonName = user, Organizations = groups). Client certificates stay optional.
    #[arg(long, requires = "api_cert")]
    pub(crate) api_client_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The loaded TLS configuration, `None` without --api-cert.
    pub(crate) fn load(&self) -> anyhow::Result<Option<ApiTls>> {
        let (Some(cert), Some(key)) = (&self.api_cert, &self.api_key) else {
            return Ok(None);
        };
        let tls = ApiTls::load(&TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: self.api_client_ca.clone(),
        })?;
        Ok(Some(tls))
    }
}

/// Security of a replica's API listeners.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct ApiAuthArgs {
    #[command(flatten)]
    pub(crate) tls: TlsArgs,
    /// Serve both API listeners in plaintext. Required when --api-cert is not given, so
    /// plaintext is never an accident.
    #[arg(long, conflicts_with = "api_cert")]
    pub(crate) api_insecure: bool,
    /// Static bearer tokens, Kubernetes --token-auth-file format:
    /// token,user,uid[,"group1,group2"] per line.
    #[arg(long)]
    pub(crate) api_token_file: Option<PathBuf>,
    /// Kubeconfig of the Kubernetes API server that reviews other bearer tokens
    /// (ServiceAccount tokens, TokenReview); "in-cluster" uses the pod's ServiceAccount.
    #[arg(long)]
    pub(crate) api_token_review_kubeconfig: Option<String>,
    /// Seconds a reviewed token's answer is reused (refused tokens: 10 s).
    #[arg(long, default_value_t = 60)]
    pub(crate) api_token_review_ttl: u64,
    /// Who may read (estimates, placement, preemption, status, Karmada estimator calls):
    /// user names or group:NAME, comma-separated or repeated. Writers and admins also read.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "group:system:authenticated"
    )]
    pub(crate) api_readers: Vec<String>,
    /// Who may create and release their own reservations (user names or group:NAME).
    #[arg(long, value_delimiter = ',')]
    pub(crate) api_writers: Vec<String>,
    /// Who may release anyone's reservation and retire clusters (user names or group:NAME).
    #[arg(long, value_delimiter = ',')]
    pub(crate) api_admins: Vec<String>,
    /// Live reservations one identity may hold at most.
    #[arg(long, default_value_t = Caps::default().max_reservations)]
    pub(crate) api_max_reservations: usize,
    /// Replicas one identity may hold reserved at most, summed over its live reservations.
    #[arg(long, default_value_t = Caps::default().max_reserved_replicas)]
    pub(crate) api_max_reserved_replicas: i64,
    /// Bytes of workload manifests one identity may hold reserved at most.
    #[arg(long, default_value_t = Caps::default().max_manifest_bytes)]
    pub(crate) api_max_manifest_bytes: usize,
    /// Longest time to live of a reservation, in seconds.
    #[arg(long, default_value_t = Caps::default().max_ttl.as_secs())]
    pub(crate) api_max_ttl: u64,
}

fn subjects(flag: &str, values: &[String]) -> anyhow::Result<Vec<Subject>> {
    values
        .iter()
        .filter(|v| !v.trim().is_empty())
        .map(|v| Subject::parse(v).map_err(|e| anyhow::anyhow!("{flag}: {e}")))
        .collect()
}

/// What the flags configure.
pub(crate) struct Security {
    pub(crate) tls: Option<ApiTls>,
    pub(crate) auth: Arc<Auth>,
    pub(crate) caps: Caps,
}

impl ApiAuthArgs {
    /// Checks and loads everything the flags name; errors name the flag or file.
    pub(crate) async fn build(&self) -> anyhow::Result<Security> {
        let tls = self.tls.load()?;
        if tls.is_none() && !self.api_insecure {
            anyhow::bail!(
                "the API listeners need TLS: pass --api-cert and --api-key (and --api-client-ca to \
                 accept client certificates), or --api-insecure to serve plaintext"
            );
        }
        let policy = Policy {
            readers: subjects("--api-readers", &self.api_readers)?,
            writers: subjects("--api-writers", &self.api_writers)?,
            admins: subjects("--api-admins", &self.api_admins)?,
        };
        let mut auth = Auth::new(policy);
        if let Some(path) = &self.api_token_file {
            auth = auth.with_tokens(TokenFile::load(path)?);
        }
        if let Some(kubeconfig) = &self.api_token_review_kubeconfig {
            let reviewer = dramesh_api::tokenreview::KubeTokenReviewer::connect(kubeconfig)
                .await
                .with_context(|| format!("--api-token-review-kubeconfig {kubeconfig}"))?;
            auth = auth.with_reviewer(
                Arc::new(reviewer),
                ReviewCache {
                    ttl: Duration::from_secs(self.api_token_review_ttl),
                    ..ReviewCache::default()
                },
            );
        }
        if tls.is_none() {
            tracing::warn!(
                "--api-insecure: the API listeners serve plaintext; bearer tokens cross the network in clear"
            );
        }
        if auth
            .policy
            .readers
            .contains(&Subject::Group(AUTHENTICATED.into()))
            && self.api_token_file.is_none()
            && self.api_token_review_kubeconfig.is_none()
            && tls.as_ref().is_none_or(|t| !t.client_auth())
        {
            tracing::warn!(
                "no way to authenticate is configured (--api-client-ca, --api-token-file, \
                 --api-token-review-kubeconfig): only callers the policy lets in anonymously are answered"
            );
        }
        Ok(Security {
            tls,
            auth: Arc::new(auth),
            caps: Caps {
                max_reservations: self.api_max_reservations,
                max_reserved_replicas: self.api_max_reserved_replicas,
                max_manifest_bytes: self.api_max_manifest_bytes,
                max_ttl: Duration::from_secs(self.api_max_ttl.max(1)),
            },
        })
    }
}
