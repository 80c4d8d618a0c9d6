//! A certificate authority made at test time, for TLS-enabled Postgres and Redis
//! ([`services::start_postgres_tls`](crate::services::start_postgres_tls),
//! [`services::start_redis_tls`](crate::services::start_redis_tls)).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

/// A fresh CA and a server certificate it signed for `127.0.0.1` and `localhost`. The CA's
/// certificate is also written to a file of its own, for clients that take a path
/// (`sslrootcert=` in a Postgres URL).
#[derive(Debug)]
pub struct TestCa {
    ca_pem: String,
    server_cert_pem: String,
    server_key_pem: String,
    ca_path: PathBuf,
}

impl TestCa {
    /// Generates the CA and the server certificate.
    pub fn generate() -> Self {
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "idempotency test CA");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("CA key"))
            .expect("CA certificate");

        let mut server =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .expect("server parameters");
        server
            .distinguished_name
            .push(DnType::CommonName, "127.0.0.1");
        let server_key = KeyPair::generate().expect("server key");
        let server_cert = server
            .signed_by(&server_key, &ca)
            .expect("server certificate");

        let dir = std::env::temp_dir().join(crate::unique("idempotency-tls"));
        std::fs::create_dir_all(&dir).expect("TLS directory");
        let ca_path = dir.join("ca.pem");
        std::fs::write(&ca_path, ca.pem()).expect("writing ca.pem");
        Self {
            ca_pem: ca.pem(),
            server_cert_pem: server_cert.pem(),
            server_key_pem: server_key.serialize_pem(),
            ca_path,
        }
    }

    /// The CA's certificate (PEM): what clients trust.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The file holding [`TestCa::ca_pem`].
    pub fn ca_path(&self) -> &Path {
        &self.ca_path
    }

    /// The server's certificate (PEM), for the server.
    pub fn server_cert_pem(&self) -> &str {
        &self.server_cert_pem
    }

    /// The server's private key (PEM), for the server.
    pub fn server_key_pem(&self) -> &str {
        &self.server_key_pem
    }
}
