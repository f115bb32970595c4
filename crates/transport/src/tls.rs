//! Who gets in: certificates, keys and the rustls configurations built from
//! them. Mutual TLS always: a server requires a client certificate signed by
//! the job's CA, and a client accepts only a server certificate signed by the
//! same CA.

use crate::{Error, Result};
use rustls::{
    client::WebPkiServerVerifier,
    crypto::{ring, CryptoProvider},
    server::WebPkiClientVerifier,
    RootCertStore,
};
use rustls_pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
use std::{fmt, path::Path, sync::Arc};

/// The server name every oar certificate carries as a DNS subject
/// alternative name, and that clients verify. A fixed name (rather than the
/// host's) lets processes call each other by IP address: the identity that
/// matters is "signed by this job's CA".
pub const DEFAULT_SERVER_NAME: &str = "oar";

/// The ALPN protocol oar speaks; a QUIC client of another protocol is refused
/// during the handshake.
pub const ALPN: &[u8] = b"oar/1";

/// The AEAD cipher preferred for traffic (TLS 1.3; the QUIC initial packets
/// always use AES-128-GCM).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Cipher {
    /// AES-128-GCM: the fastest with AES-NI (see BENCHMARKS.md).
    #[default]
    Aes128Gcm,
    /// AES-256-GCM.
    Aes256Gcm,
    /// ChaCha20-Poly1305: the fastest without AES hardware.
    ChaCha20Poly1305,
}

/// A process's TLS identity: the job's CA certificate(s), its own certificate
/// chain and private key.
#[derive(Clone)]
pub struct TlsConfig {
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
    server_name: String,
    cipher: Cipher,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("roots", &self.roots.len())
            .field("chain", &self.chain.len())
            .field("server_name", &self.server_name)
            .field("cipher", &self.cipher)
            .finish_non_exhaustive()
    }
}

fn pem_error(what: &str, e: impl fmt::Display) -> Error {
    Error::Tls(format!("cannot read {what}: {e}"))
}

impl TlsConfig {
    /// An identity from PEM text: `ca_pem` holds one or more CA certificates,
    /// `cert_pem` this process's certificate (then any intermediates),
    /// `key_pem` its private key (PKCS#8, SEC1 or PKCS#1).
    pub fn from_pem(ca_pem: &[u8], cert_pem: &[u8], key_pem: &[u8]) -> Result<TlsConfig> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem) {
            let cert = cert.map_err(|e| pem_error("the CA certificate", e))?;
            roots.add(cert).map_err(|e| pem_error("the CA certificate", e))?;
        }
        if roots.is_empty() {
            return Err(Error::Tls("the CA PEM holds no certificate".into()));
        }
        let chain = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| pem_error("the certificate", e))?;
        if chain.is_empty() {
            return Err(Error::Tls("the certificate PEM holds no certificate".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| pem_error("the private key", e))?;
        let config = TlsConfig {
            roots: Arc::new(roots),
            chain,
            key: Arc::new(key),
            server_name: DEFAULT_SERVER_NAME.to_string(),
            cipher: Cipher::default(),
        };
        // Fail now, not on the first call, if the pieces do not fit together.
        config.rustls_server_config()?;
        config.rustls_client_config()?;
        Ok(config)
    }

    /// An identity from PEM files (see [`TlsConfig::from_pem`]).
    pub fn from_pem_files(
        ca: impl AsRef<Path>,
        cert: impl AsRef<Path>,
        key: impl AsRef<Path>,
    ) -> Result<TlsConfig> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| Error::Io { what: format!("read {}", p.display()), source })
        };
        let (ca, cert, key) = (ca.as_ref(), cert.as_ref(), key.as_ref());
        TlsConfig::from_pem(&read(ca)?, &read(cert)?, &read(key)?).map_err(|e| match e {
            Error::Tls(reason) => Error::Tls(format!(
                "{reason} (files {}, {}, {})",
                ca.display(),
                cert.display(),
                key.display()
            )),
            other => other,
        })
    }

    /// Verify servers against `name` instead of [`DEFAULT_SERVER_NAME`]
    /// (for certificates made without the `oar` name).
    pub fn with_server_name(mut self, name: impl Into<String>) -> TlsConfig {
        self.server_name = name.into();
        self
    }

    /// Prefer `cipher` for traffic.
    pub fn with_cipher(mut self, cipher: Cipher) -> TlsConfig {
        self.cipher = cipher;
        self
    }

    /// The name servers are verified against.
    pub fn server_name(&self) -> &str {
        &self.server_name
    }

    /// The preferred cipher.
    pub fn cipher(&self) -> Cipher {
        self.cipher
    }

    /// ring's provider with the preferred cipher first (the others stay, so
    /// peers preferring another still connect).
    fn provider(&self) -> Arc<CryptoProvider> {
        let mut provider = ring::default_provider();
        let first = match self.cipher {
            Cipher::Aes128Gcm => ring::cipher_suite::TLS13_AES_128_GCM_SHA256,
            Cipher::Aes256Gcm => ring::cipher_suite::TLS13_AES_256_GCM_SHA384,
            Cipher::ChaCha20Poly1305 => ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        };
        provider
            .cipher_suites
            .retain(|s| s.version() == &rustls::version::TLS13 && s.suite() != first.suite());
        provider.cipher_suites.insert(0, first);
        Arc::new(provider)
    }

    /// The client side: TLS 1.3, the job's CA as the only root, this
    /// identity as the client certificate, ALPN `oar/1`.
    pub fn rustls_client_config(&self) -> Result<rustls::ClientConfig> {
        let provider = self.provider();
        let verifier = WebPkiServerVerifier::builder_with_provider(self.roots.clone(), provider.clone())
            .build()
            .map_err(|e| Error::Tls(format!("server verifier: {e}")))?;
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Tls(e.to_string()))?
            .with_webpki_verifier(verifier)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| Error::Tls(format!("client certificate and key: {e}")))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    /// The server side: TLS 1.3, a client certificate signed by the job's CA
    /// required, this identity as the server certificate, ALPN `oar/1`.
    pub fn rustls_server_config(&self) -> Result<rustls::ServerConfig> {
        let provider = self.provider();
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider.clone())
            .build()
            .map_err(|e| Error::Tls(format!("client verifier: {e}")))?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Tls(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| Error::Tls(format!("server certificate and key: {e}")))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    /// A secret stable across restarts of this identity at `local_addr`:
    /// it keys QUIC stateless resets and connection-ID validation, so that a
    /// server restarted at the same address with the same key recognises its
    /// predecessor's connection IDs and tells old clients at once that their
    /// connection is gone (they reconnect instead of waiting for the idle
    /// timeout).
    pub(crate) fn restart_secret(&self, local_addr: &str) -> [u8; 32] {
        let root = ::ring::hmac::Key::new(::ring::hmac::HMAC_SHA256, self.key.secret_der());
        let tag = ::ring::hmac::sign(&root, format!("oar stateless reset {local_addr}").as_bytes());
        let mut secret = [0u8; 32];
        secret.copy_from_slice(&tag.as_ref()[..32]);
        secret
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DevCa;

    #[test]
    fn dev_ca_identities_build_both_sides() {
        let ca = DevCa::new().unwrap();
        let tls = ca.tls_config("pserver-0").unwrap();
        assert_eq!(tls.server_name(), "oar");
        assert_eq!(tls.rustls_client_config().unwrap().alpn_protocols, vec![b"oar/1".to_vec()]);
        assert!(tls.rustls_server_config().is_ok());
    }

    #[test]
    fn names_that_are_not_dns_names_still_get_a_certificate() {
        let ca = DevCa::new().unwrap();
        for name in ["trainer 1", "10.0.0.7", "oar", "a..b"] {
            ca.tls_config(name).unwrap();
        }
    }

    #[test]
    fn garbage_pem_is_an_error_naming_the_part() {
        let ca = DevCa::new().unwrap();
        let issued = ca.issue("x").unwrap();
        let err = TlsConfig::from_pem(b"nothing", issued.cert_pem.as_bytes(), issued.key_pem.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(err.contains("CA"), "{err}");
        let err = TlsConfig::from_pem(ca.ca_pem().as_bytes(), issued.cert_pem.as_bytes(), b"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("private key"), "{err}");
        // A key that does not match the certificate.
        let other = ca.issue("y").unwrap();
        let err =
            TlsConfig::from_pem(ca.ca_pem().as_bytes(), issued.cert_pem.as_bytes(), other.key_pem.as_bytes())
                .unwrap_err()
                .to_string();
        assert!(err.contains("key"), "{err}");
    }

    #[test]
    fn files_round_trip_and_keys_are_private() {
        let dir = tempfile::tempdir().unwrap();
        let ca = DevCa::new().unwrap();
        let written = ca.write_files(dir.path(), &["master", "ps-0"]).unwrap();
        assert_eq!(written.len(), 5);
        let tls = TlsConfig::from_pem_files(
            dir.path().join("ca.pem"),
            dir.path().join("ps-0.pem"),
            dir.path().join("ps-0.key"),
        )
        .unwrap();
        assert_eq!(tls.server_name(), "oar");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("ps-0.key")).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "key file mode {mode:o}");
        }
        assert!(ca.write_files(dir.path(), &["../evil"]).is_err());
        let err = TlsConfig::from_pem_files(dir.path().join("nope.pem"), "a", "b").unwrap_err();
        assert!(err.to_string().contains("nope.pem"), "{err}");
    }

    #[test]
    fn preferred_cipher_goes_first() {
        let tls = DevCa::new().unwrap().tls_config("a").unwrap().with_cipher(Cipher::ChaCha20Poly1305);
        let p = tls.provider();
        assert_eq!(p.cipher_suites[0].suite(), rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256);
        assert_eq!(p.cipher_suites.len(), 3);
    }
}
