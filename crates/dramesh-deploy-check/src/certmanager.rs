//! A strict schema for the cert-manager (`cert-manager.io/v1`) fields the manifests use.
//!
//! `k8s-openapi` has no cert-manager types, so these are written by hand from the
//! cert-manager v1 API: only the fields used in `deploy/` are accepted and any other field is
//! rejected as unknown, exactly like the typed Kubernetes objects. Enumerated values (key
//! usages, key algorithms, rotation policy, issuer kinds) and durations are checked too,
//! because a typo there is accepted by YAML but refused by cert-manager's webhook.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use dramesh_model::load::FieldError;

/// The `apiVersion` of every cert-manager object here.
pub const API_VERSION: &str = "cert-manager.io/v1";

/// A namespaced cert-manager `Issuer`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Issuer {
    /// Must be [`API_VERSION`].
    pub api_version: String,
    /// Must be `Issuer`.
    pub kind: String,
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The issuer type.
    pub spec: IssuerSpec,
}

/// Exactly one issuer type must be set.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct IssuerSpec {
    /// Issues self-signed certificates.
    #[serde(default)]
    pub self_signed: Option<SelfSignedIssuer>,
    /// Issues certificates signed by the CA in a Secret.
    #[serde(default)]
    pub ca: Option<CaIssuer>,
}

/// `spec.selfSigned`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SelfSignedIssuer {
    /// CRL distribution points written into issued certificates.
    #[serde(default)]
    pub crl_distribution_points: Option<Vec<String>>,
}

/// `spec.ca`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CaIssuer {
    /// The Secret holding the CA key pair.
    pub secret_name: String,
}

/// A cert-manager `Certificate`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Certificate {
    /// Must be [`API_VERSION`].
    pub api_version: String,
    /// Must be `Certificate`.
    pub kind: String,
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// What to issue and where to store it.
    pub spec: CertificateSpec,
}

/// `Certificate.spec`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CertificateSpec {
    /// The Secret the issued key pair is stored in.
    pub secret_name: String,
    /// The issuer that signs it.
    pub issuer_ref: IssuerRef,
    /// Subject common name.
    #[serde(default)]
    pub common_name: Option<String>,
    /// Whether the certificate is a CA.
    #[serde(default, rename = "isCA")]
    pub is_ca: Option<bool>,
    /// DNS subject alternative names.
    #[serde(default)]
    pub dns_names: Option<Vec<String>>,
    /// URI subject alternative names (the dramesh identities).
    #[serde(default)]
    pub uris: Option<Vec<String>>,
    /// Validity, a Go duration (see [`valid_duration`]).
    #[serde(default)]
    pub duration: Option<String>,
    /// How long before expiry to renew, a Go duration.
    #[serde(default)]
    pub renew_before: Option<String>,
    /// Key usages, each one of [`KEY_USAGES`].
    #[serde(default)]
    pub usages: Option<Vec<String>>,
    /// Private key parameters.
    #[serde(default)]
    pub private_key: Option<PrivateKey>,
}

/// `spec.privateKey`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PrivateKey {
    /// `RSA`, `ECDSA` or `Ed25519`.
    #[serde(default)]
    pub algorithm: Option<String>,
    /// Key size in bits.
    #[serde(default)]
    pub size: Option<u32>,
    /// `Never` or `Always`.
    #[serde(default)]
    pub rotation_policy: Option<String>,
    /// `PKCS1` or `PKCS8`.
    #[serde(default)]
    pub encoding: Option<String>,
}

/// `spec.issuerRef`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct IssuerRef {
    /// Issuer name.
    pub name: String,
    /// `Issuer` or `ClusterIssuer`.
    #[serde(default)]
    pub kind: Option<String>,
    /// `cert-manager.io` when set.
    #[serde(default)]
    pub group: Option<String>,
}

/// cert-manager's `KeyUsage` values.
pub const KEY_USAGES: [&str; 22] = [
    "signing",
    "digital signature",
    "content commitment",
    "key encipherment",
    "key agreement",
    "data encipherment",
    "cert sign",
    "crl sign",
    "encipher only",
    "decipher only",
    "any",
    "server auth",
    "client auth",
    "code signing",
    "email protection",
    "s/mime",
    "ipsec end system",
    "ipsec tunnel",
    "ipsec user",
    "timestamping",
    "ocsp signing",
    "microsoft sgc",
];

fn err(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        message: message.into(),
    }
}

fn one_of(field: &str, value: &str, allowed: &[&str]) -> Result<(), FieldError> {
    if allowed.contains(&value) {
        Ok(())
    } else {
        Err(err(
            field,
            format!("{value:?} is not one of {}", allowed.join(", ")),
        ))
    }
}

/// A subset of Go `time.ParseDuration` syntax: integer amounts of `h`, `m` and `s`, e.g.
/// `2160h` or `1h30m` (stricter than Go, which also takes fractions and smaller units).
pub fn valid_duration(s: &str) -> bool {
    let mut rest = s;
    if rest.is_empty() {
        return false;
    }
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return false;
        }
        rest = &rest[digits..];
        match rest.as_bytes().first() {
            Some(b'h' | b'm' | b's') => rest = &rest[1..],
            _ => return false,
        }
    }
    true
}

fn check_header(api_version: &str, kind: &str, want_kind: &str) -> Result<(), FieldError> {
    if api_version != API_VERSION {
        return Err(err(
            "apiVersion",
            format!("{want_kind} must be {API_VERSION}, got {api_version:?}"),
        ));
    }
    if kind != want_kind {
        return Err(err("kind", format!("expected {want_kind}, got {kind:?}")));
    }
    Ok(())
}

impl Issuer {
    /// Checks the constraints the schema types cannot express.
    pub fn validate(&self) -> Result<(), FieldError> {
        check_header(&self.api_version, &self.kind, "Issuer")?;
        match (&self.spec.self_signed, &self.spec.ca) {
            (Some(_), None) | (None, Some(_)) => Ok(()),
            _ => Err(err("spec", "set exactly one of selfSigned and ca")),
        }
    }
}

impl Certificate {
    /// Checks the constraints the schema types cannot express.
    pub fn validate(&self) -> Result<(), FieldError> {
        check_header(&self.api_version, &self.kind, "Certificate")?;
        let s = &self.spec;
        if let Some(kind) = &s.issuer_ref.kind {
            one_of("spec.issuerRef.kind", kind, &["Issuer", "ClusterIssuer"])?;
        }
        if let Some(group) = &s.issuer_ref.group {
            one_of("spec.issuerRef.group", group, &["cert-manager.io"])?;
        }
        for (field, d) in [
            ("spec.duration", &s.duration),
            ("spec.renewBefore", &s.renew_before),
        ] {
            if let Some(d) = d
                && !valid_duration(d)
            {
                return Err(err(field, format!("{d:?} is not a duration such as 2160h")));
            }
        }
        for (i, u) in s.usages.iter().flatten().enumerate() {
            one_of(&format!("spec.usages[{i}]"), u, &KEY_USAGES)?;
        }
        if let Some(k) = &s.private_key {
            if let Some(a) = &k.algorithm {
                one_of("spec.privateKey.algorithm", a, &["RSA", "ECDSA", "Ed25519"])?;
            }
            if let Some(p) = &k.rotation_policy {
                one_of("spec.privateKey.rotationPolicy", p, &["Never", "Always"])?;
            }
            if let Some(e) = &k.encoding {
                one_of("spec.privateKey.encoding", e, &["PKCS1", "PKCS8"])?;
            }
        }
        let has_subject = s.common_name.is_some()
            || s.dns_names.as_ref().is_some_and(|v| !v.is_empty())
            || s.uris.as_ref().is_some_and(|v| !v.is_empty());
        if !has_subject {
            return Err(err(
                "spec",
                "set at least one of commonName, dnsNames and uris",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_follow_go_syntax() {
        for ok in ["2160h", "1h30m", "90s", "0s"] {
            assert!(valid_duration(ok), "{ok}");
        }
        for bad in ["", "90d", "h", "1.5h", "10", "-1h", "1h 2m"] {
            assert!(!valid_duration(bad), "{bad}");
        }
    }
}
