//! How an agent or the relay reaches the relay's etcd: its endpoints and, with https ones,
//! the CA that signed the server's certificate and the client's own certificate and key.
//! Whoever can write to that etcd decides every node's policy, so in a cluster it is
//! served over TLS with client certificates (deploy/relay/).

use std::path::PathBuf;
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

#[derive(Clone, Debug, Default, clap::Args)]
pub struct StoreTls {
    /// The CA certificate (PEM) the relay's etcd's server certificate is checked against.
    #[arg(long = "relay-ca", env = "WEIR_RELAY_CA", value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// This client's certificate (PEM), for an etcd that asks for one (`--client-cert-auth`).
    #[arg(
        long = "relay-cert",
        env = "WEIR_RELAY_CERT",
        value_name = "FILE",
        requires = "key"
    )]
    pub cert: Option<PathBuf>,
    /// The key (PEM) of --relay-cert.
    #[arg(
        long = "relay-key",
        env = "WEIR_RELAY_KEY",
        value_name = "FILE",
        requires = "cert"
    )]
    pub key: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("connecting to the relay's etcd at {endpoints}: {source}")]
    Connect {
        endpoints: String,
        #[source]
        source: etcd_client::Error,
    },
    #[error("no endpoint given for the relay's etcd")]
    NoEndpoint,
}

fn read(path: &PathBuf) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::Read {
        path: path.clone(),
        source,
    })
}

/// A client of the etcd at `endpoints` (`http://host:port` or `https://...`).
pub async fn connect(endpoints: &[String], tls: &StoreTls) -> Result<Client, ConnectError> {
    if endpoints.is_empty() {
        return Err(ConnectError::NoEndpoint);
    }
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        // A dead peer is noticed by the watches too, not only by the next request.
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        .with_keep_alive_while_idle(true);
    if tls.ca.is_some() || tls.cert.is_some() {
        let mut config = TlsOptions::new();
        if let Some(ca) = &tls.ca {
            config = config.ca_certificate(Certificate::from_pem(read(ca)?));
        }
        if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
            config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        options = options.with_tls(config);
    }
    Client::connect(endpoints, Some(options))
        .await
        .map_err(|source| ConnectError::Connect {
            endpoints: endpoints.join(","),
            source,
        })
}
