//! Bearer tokens checked by a Kubernetes API server (`authentication.k8s.io/v1` TokenReview),
//! as the kube-apiserver's webhook token authenticator does: ServiceAccount tokens of the
//! karmada-scheduler or of any workload identity the cluster issues.
//!
//! Guarantees: one POST per token not in the [`crate::auth::ReviewCache`]; a review that does
//! not say `authenticated: true` with a user name is a refusal; a review that fails (network,
//! 403 for a replica not allowed to create TokenReviews) is an error the caller sees as 401
//! "could not be reviewed", never an acceptance.

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::{Api, PostParams};

use crate::auth::{Identity, ReviewFuture, TokenReviewer};

/// The kube client could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TokenReviewError {
    /// The kubeconfig cannot be read or used.
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig {
        /// The file (or "in-cluster").
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// Reviews tokens with the API server of a kube client.
#[derive(Clone)]
pub struct KubeTokenReviewer {
    client: kube::Client,
}

impl KubeTokenReviewer {
    /// Reviews with `client`.
    pub fn new(client: kube::Client) -> KubeTokenReviewer {
        KubeTokenReviewer { client }
    }

    /// Reviews with the API server of the kubeconfig at `path` (its current context), or of
    /// the pod's ServiceAccount for `"in-cluster"`.
    pub async fn connect(path: &str) -> Result<KubeTokenReviewer, TokenReviewError> {
        let err = |message: String| TokenReviewError::Kubeconfig {
            path: path.to_owned(),
            message,
        };
        let config = if path == "in-cluster" {
            kube::Config::incluster().map_err(|e| err(e.to_string()))?
        } else {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| err(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| err(e.to_string()))?
        };
        let client = kube::Client::try_from(config).map_err(|e| err(e.to_string()))?;
        Ok(KubeTokenReviewer { client })
    }
}

impl TokenReviewer for KubeTokenReviewer {
    fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a> {
        Box::pin(async move {
            let api: Api<TokenReview> = Api::all(self.client.clone());
            let review = TokenReview {
                spec: TokenReviewSpec {
                    token: token.to_owned(),
                    audiences: None,
                },
                ..TokenReview::default()
            };
            let answer = api
                .create(&PostParams::default(), &review)
                .await
                .map_err(|e| format!("TokenReview: {e}"))?;
            let Some(status) = answer.status else {
                return Ok(None);
            };
            if let Some(e) = status.error.filter(|e| !e.is_empty()) {
                tracing::debug!(error = %e, "TokenReview refused a token");
            }
            if status.authenticated != Some(true) {
                return Ok(None);
            }
            let Some(user) = status.user else {
                return Ok(None);
            };
            let Some(name) = user.username.filter(|u| !u.is_empty()) else {
                return Ok(None);
            };
            Ok(Some(Identity::authenticated(
                name,
                user.groups.unwrap_or_default(),
            )))
        })
    }
}
