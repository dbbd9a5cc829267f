//! Credentials made with openssl: a CA that signs client and server certificates. The
//! cluster's (`weir-lab cluster`: a kubelet's `system:node:NAME` in `system:nodes`, so the
//! Node authorizer and NodeRestriction judge it; the API server's own client to the
//! kubelets; static tokens for the components the bootstrap RBAC already names) and the
//! relay's etcd's (its server certificate, one client certificate).
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{netns, LabError};

const OPENSSL_TIMEOUT: Duration = Duration::from_secs(60);

fn openssl(args: &[&str]) -> Result<(), LabError> {
    netns::tool("openssl", "openssl", args, OPENSSL_TIMEOUT).map(drop)
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// The cluster's PKI directory.
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
    fn ca_key(&self) -> PathBuf {
        self.dir.join("ca.key")
    }
    pub fn cert(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.crt"))
    }
    pub fn key(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.key"))
    }
    pub fn service_account_key(&self) -> PathBuf {
        self.dir.join("service-account.key")
    }

    /// The CA and the service account signing key.
    pub fn init(&self) -> Result<(), LabError> {
        self.init_ca()?;
        openssl(&["genrsa", "-out", &s(&self.service_account_key()), "2048"])
    }

    /// The CA.
    pub fn init_ca(&self) -> Result<(), LabError> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| LabError::io(format!("creating {}", self.dir.display()), e))?;
        openssl(&["genrsa", "-out", &s(&self.ca_key()), "2048"])?;
        openssl(&[
            "req",
            "-x509",
            "-new",
            "-key",
            &s(&self.ca_key()),
            "-subj",
            "/CN=weir-cluster-ca",
            "-days",
            "30",
            "-out",
            &s(&self.ca_cert()),
        ])
    }

    /// A client certificate for `cn` in the groups `orgs`, signed by the CA, as `name`.crt/.key.
    pub fn client(&self, name: &str, cn: &str, orgs: &[&str]) -> Result<(), LabError> {
        let subject: String =
            orgs.iter().map(|o| format!("/O={o}")).collect::<String>() + &format!("/CN={cn}");
        self.sign(name, &subject, None)
    }

    /// A client certificate for `cn` as X.509v3, its extended key usage clientAuth (what a
    /// rustls client, which takes only v3 certificates, can present).
    pub fn client_v3(&self, name: &str, cn: &str) -> Result<(), LabError> {
        self.sign(
            name,
            &format!("/CN={cn}"),
            Some("extendedKeyUsage=clientAuth\n"),
        )
    }

    /// A server certificate for `cn` with the subject alternative names `san`
    /// (`IP:127.0.0.1`), signed by the CA, as `name`.crt/.key.
    pub fn server(&self, name: &str, cn: &str, san: &str) -> Result<(), LabError> {
        let ext = format!("subjectAltName={san}\nextendedKeyUsage=serverAuth\n");
        self.sign(name, &format!("/CN={cn}"), Some(&ext))
    }

    /// A key and a certificate for `subject` signed by the CA, with the X.509v3 extensions
    /// `ext` (openssl's extfile syntax) if any.
    fn sign(&self, name: &str, subject: &str, ext: Option<&str>) -> Result<(), LabError> {
        let key = s(&self.key(name));
        let csr = s(&self.dir.join(format!("{name}.csr")));
        let extfile = s(&self.dir.join(format!("{name}.ext")));
        openssl(&["genrsa", "-out", &key, "2048"])?;
        openssl(&["req", "-new", "-key", &key, "-subj", subject, "-out", &csr])?;
        let (ca, ca_key, cert) = (s(&self.ca_cert()), s(&self.ca_key()), s(&self.cert(name)));
        let mut args = vec![
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "30",
            "-out",
            &cert,
        ];
        if let Some(ext) = ext {
            std::fs::write(&extfile, ext)
                .map_err(|e| LabError::io(format!("writing {extfile}"), e))?;
            args.extend(["-extfile", &extfile]);
        }
        openssl(&args)?;
        let mut made = vec![csr.as_str()];
        if ext.is_some() {
            made.push(&extfile);
        }
        for f in made {
            std::fs::remove_file(f).map_err(|e| LabError::io(format!("removing {f}"), e))?;
        }
        Ok(())
    }
}

/// A kubeconfig for `server` that trusts `ca` and authenticates with either a client
/// certificate (cert, key) or a bearer token.
pub fn kubeconfig(server: &str, ca: &Path, user: &str, auth: &Auth) -> String {
    let credentials = match auth {
        Auth::Cert { cert, key } => format!(
            "    client-certificate: {}\n    client-key: {}\n",
            cert.display(),
            key.display()
        ),
        Auth::Token(token) => format!("    token: {token}\n"),
    };
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: weir-cluster\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n{credentials}contexts:\n- name: weir-cluster\n  context:\n    cluster: weir-cluster\n    user: {user}\ncurrent-context: weir-cluster\n",
        ca = ca.display()
    )
}

pub enum Auth {
    Cert { cert: PathBuf, key: PathBuf },
    Token(String),
}

/// A random token.
pub fn token() -> Result<String, LabError> {
    let mut bytes = [0u8; 16];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| LabError::io("reading /dev/urandom", e))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
