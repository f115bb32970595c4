//! A development certificate authority (feature `dev-ca`, which pulls in
//! `rcgen`): certificates made in memory for tests, the one-process example
//! and small clusters. Production jobs bring their own CA and PEM files
//! ([`TlsConfig::from_pem_files`]).

use crate::{Error, Result, TlsConfig, DEFAULT_SERVER_NAME};
use std::fmt;
use std::path::{Path, PathBuf};

/// A certificate and its private key, PEM-encoded.
#[derive(Clone)]
pub struct Issued {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// The private key (PKCS#8), PEM.
    pub key_pem: String,
}

impl fmt::Debug for Issued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Issued").field("cert_pem", &self.cert_pem).finish_non_exhaustive()
    }
}

/// A development certificate authority made in memory: for tests, the local
/// example and small clusters. It signs certificates valid for
/// [`DEFAULT_SERVER_NAME`] (plus the given name), usable as server and as
/// client certificates, valid until the year 4096.
pub struct DevCa {
    cert_pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl fmt::Debug for DevCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevCa").finish_non_exhaustive()
    }
}

fn rcgen_error(what: &str, e: rcgen::Error) -> Error {
    Error::Tls(format!("{what}: {e}"))
}

/// Whether `name` can stand in a DNS subject alternative name.
fn dns_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

impl DevCa {
    /// A fresh CA with a new ECDSA P-256 key.
    pub fn new() -> Result<DevCa> {
        let key = rcgen::KeyPair::generate().map_err(|e| rcgen_error("generate the CA key", e))?;
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name.push(rcgen::DnType::CommonName, "oar development CA");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).map_err(|e| rcgen_error("sign the CA certificate", e))?;
        Ok(DevCa { cert_pem: cert.pem(), issuer: rcgen::Issuer::new(params, key) })
    }

    /// The CA certificate, PEM: what every process of the job trusts.
    pub fn ca_pem(&self) -> String {
        self.cert_pem.clone()
    }

    /// A certificate and key for the process called `name` (any text; it is
    /// the certificate's common name, and also a subject alternative name
    /// when it is a valid DNS name or an IP address).
    pub fn issue(&self, name: &str) -> Result<Issued> {
        let key = rcgen::KeyPair::generate().map_err(|e| rcgen_error("generate a key", e))?;
        let mut names = vec![DEFAULT_SERVER_NAME.to_string()];
        if name != DEFAULT_SERVER_NAME && (dns_name_ok(name) || name.parse::<std::net::IpAddr>().is_ok()) {
            names.push(name.to_string());
        }
        let mut params = rcgen::CertificateParams::new(names)
            .map_err(|e| rcgen_error(&format!("names of {name:?}"), e))?;
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert =
            params.signed_by(&key, &self.issuer).map_err(|e| rcgen_error(&format!("sign {name:?}"), e))?;
        Ok(Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }

    /// A ready identity for the process called `name`.
    pub fn tls_config(&self, name: &str) -> Result<TlsConfig> {
        let issued = self.issue(name)?;
        TlsConfig::from_pem(self.cert_pem.as_bytes(), issued.cert_pem.as_bytes(), issued.key_pem.as_bytes())
    }

    /// Write `ca.pem`, and `NAME.pem` and `NAME.key` for each name, into
    /// `dir` (created if missing; keys readable by the owner only). Returns
    /// the paths written, the CA's first.
    pub fn write_files(&self, dir: impl AsRef<Path>, names: &[&str]) -> Result<Vec<PathBuf>> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir)
            .map_err(|source| Error::Io { what: format!("create {}", dir.display()), source })?;
        let mut written = vec![write_file(&dir.join("ca.pem"), &self.cert_pem, false)?];
        for name in names {
            if name.is_empty() || name.contains(['/', '\\']) || *name == "ca" || name.starts_with('.') {
                return Err(Error::Tls(format!("{name:?} cannot name certificate files")));
            }
            let issued = self.issue(name)?;
            written.push(write_file(&dir.join(format!("{name}.pem")), &issued.cert_pem, false)?);
            written.push(write_file(&dir.join(format!("{name}.key")), &issued.key_pem, true)?);
        }
        Ok(written)
    }
}

fn write_file(path: &Path, text: &str, secret: bool) -> Result<PathBuf> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    let io = |source| Error::Io { what: format!("write {}", path.display()), source };
    let mut file = options.open(path).map_err(io)?;
    file.write_all(text.as_bytes()).map_err(io)?;
    Ok(path.to_path_buf())
}
