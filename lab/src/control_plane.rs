//! The lab's control plane: the real etcd and kube-apiserver of the pinned Kubernetes
//! release (`deploy/kubernetes-version`, built by `cargo xtask setup`), run inside the lab's
//! node namespace. Its loopback is the lab's own, so labs never collide on ports, and the
//! agent reaches the server at 127.0.0.1 as a node's agent reaches its API server.
//!
//! The server authorizes with Node and RBAC and authenticates static tokens: an admin (the
//! lab's writes) and the DaemonSet's ServiceAccount identity (the agent, bound by deploy/'s
//! RBAC and nothing else). An audit log records every request of the agent,
//! so tests can show that its ClusterRole is enough and not more than enough.
//!
//! There is no controller-manager, scheduler or kubelet: the lab sets `spec.nodeName`,
//! writes Pod status through the status subresource, deletes pods with grace period 0 and
//! finalizes namespaces itself. The ClusterNetworkPolicy CRD that deploy/crds/ ships is
//! installed once the server is ready, so manifests may hold that kind.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};

/// The ClusterNetworkPolicy CRD, as deploy/crds/ ships it.
const CLUSTER_POLICY_CRD: &str =
    include_str!("../../deploy/crds/policy.networking.k8s.io_clusternetworkpolicies.yaml");

use super::{netns, LabError};

/// The release the components are built from (a `vX.Y.Z` line).
pub fn kubernetes_version() -> &'static str {
    include_str!("../../deploy/kubernetes-version").trim()
}

/// Where xtask caches the Go-built binaries, one directory per component and version:
/// `$WEIR_COMPONENTS_DIR`, default `~/.cache/weir/components`.
pub fn components_root() -> PathBuf {
    std::env::var_os("WEIR_COMPONENTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                .join(".cache/weir/components")
        })
}

/// Where `cargo xtask setup` puts kube-apiserver, kube-proxy and etcd.
pub fn components_dir() -> PathBuf {
    components_root().join(format!("kubernetes-{}", kubernetes_version()))
}

pub const ETCD_CLIENT: &str = "127.0.0.1:2379";
const ETCD_PEER: &str = "127.0.0.1:2380";
/// The relay's own etcd (`weir-lab up --relay`), beside the API server's.
pub const RELAY_STORE: &str = "127.0.0.1:2381";
const RELAY_STORE_PEER: &str = "127.0.0.1:2382";
pub const APISERVER_PORT: u16 = 6443;
/// The ClusterIP range kube-apiserver allocates Service addresses from.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";

/// Who talks to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Identity {
    /// system:masters: the lab's own writes.
    Admin,
    /// The DaemonSet's ServiceAccount, kube-system/weir: what `weir agent` runs as.
    Agent,
    /// kube-proxy: the user the bootstrap RBAC binds to `system:node-proxier`.
    Proxy,
}

impl Identity {
    fn name(self) -> &'static str {
        match self {
            Identity::Admin => "admin",
            Identity::Agent => "agent",
            Identity::Proxy => "proxy",
        }
    }
}

/// The user name the agent's token authenticates as (the ServiceAccount's), and its groups.
pub const AGENT_USER: &str = "system:serviceaccount:kube-system:weir";
/// The user the API server's bootstrap ClusterRoleBinding `system:node-proxier` binds to
/// the ClusterRole of that name: kube-proxy's least privilege, built in.
pub const PROXY_USER: &str = "system:kube-proxy";
pub const AGENT_GROUPS: &[&str] = &[
    "system:serviceaccounts",
    "system:serviceaccounts:kube-system",
];

/// How long kube-apiserver gets to become ready (it bootstraps RBAC roles, priority
/// classes and the Service CIDR first: seconds on the host, a minute or more emulated).
pub const API_READY_WITHIN: Duration = Duration::from_secs(90);

/// The files of one control plane, under `dir`.
#[derive(Clone, Debug)]
pub struct ControlPlane {
    pub dir: PathBuf,
    /// The ClusterNetworkPolicy CRD to install instead of deploy/crds/'s (YAML).
    pub cluster_policy_crd: Option<String>,
}

impl ControlPlane {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        ControlPlane {
            dir: dir.into(),
            cluster_policy_crd: None,
        }
    }

    pub fn kubeconfig(&self, who: Identity) -> PathBuf {
        self.dir.join(format!("kubeconfig-{}", who.name()))
    }
    /// The identity's bearer token alone (for a client that reads only a ServiceAccount's
    /// in-cluster files).
    pub fn token_file(&self, who: Identity) -> PathBuf {
        self.dir.join(format!("token-{}", who.name()))
    }
    /// The certificate clients verify the server with.
    pub fn server_certificate(&self) -> PathBuf {
        self.dir.join("certs/apiserver.crt")
    }
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("audit.log")
    }
    pub fn apiserver_log(&self) -> PathBuf {
        self.dir.join("kube-apiserver.log")
    }
    fn etcd_log(&self) -> PathBuf {
        self.dir.join("etcd.log")
    }

    /// Writes keys, tokens, kubeconfigs and the audit policy (once), then starts etcd and
    /// kube-apiserver in `node` and waits up to [`API_READY_WITHIN`] for the server to be
    /// ready, or `ready_within` when that is longer (a slow machine). Returns their pids.
    pub fn start(&self, node: &str, ready_within: Duration) -> Result<(u32, u32), LabError> {
        let bin = components_dir();
        for b in ["etcd", "kube-apiserver"] {
            if !bin.join(b).is_file() {
                return Err(LabError::invalid(
                    "weir-lab --api server",
                    format!(
                        "{} not found: `cargo xtask setup` builds kube-apiserver, kube-proxy and etcd of Kubernetes {} into {} (or set WEIR_COMPONENTS_DIR)",
                        bin.join(b).display(),
                        kubernetes_version(),
                        bin.display()
                    ),
                ));
            }
        }
        self.prepare()?;
        let etcd = self.start_etcd(node)?;
        let mut started = vec![etcd];
        let apiserver = self.start_apiserver(node).and_then(|apiserver| {
            started.push(apiserver);
            self.wait_ready(node, ready_within.max(API_READY_WITHIN))?;
            self.install_crds(node, ready_within.max(API_READY_WITHIN))?;
            Ok(apiserver)
        });
        match apiserver {
            Ok(apiserver) => Ok((etcd, apiserver)),
            // Half a control plane is no use to the caller, who has no pids to stop it by.
            Err(e) => {
                for pid in started.into_iter().rev() {
                    netns::stop_pid(pid, Duration::from_secs(10));
                }
                Err(e)
            }
        }
    }

    /// Creates the ClusterNetworkPolicy CRD (deploy/crds/) and waits until the server
    /// serves the kind.
    pub fn install_crds(&self, node: &str, timeout: Duration) -> Result<(), LabError> {
        let (text, what) = match &self.cluster_policy_crd {
            Some(text) => (text.as_str(), "--cluster-policy-crd"),
            None => (CLUSTER_POLICY_CRD, "deploy/crds/ (built in)"),
        };
        let crd: CustomResourceDefinition =
            serde_yaml::from_str(text).map_err(|e| LabError::invalid(what, e.to_string()))?;
        let name = crd.metadata.name.clone().unwrap_or_default();
        let answer = self.block_on(node, Identity::Admin, |client| async move {
            let api: Api<CustomResourceDefinition> = Api::all(client);
            let params = PatchParams::apply("weir-lab").force();
            api.patch(&name, &params, &Patch::Apply(&crd)).await?;
            let established = |c: &CustomResourceDefinition| {
                c.status
                    .iter()
                    .flat_map(|s| s.conditions.iter().flatten())
                    .any(|c| c.type_ == "Established" && c.status == "True")
            };
            let deadline = Instant::now() + timeout;
            loop {
                if established(&api.get(&name).await?) {
                    return Ok(());
                }
                if Instant::now() > deadline {
                    return Err(kube::Error::Service(
                        format!("CRD {name} not established after {timeout:?}").into(),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        match answer {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(LabError::invalid(
                "the ClusterNetworkPolicy CRD",
                e.to_string(),
            )),
            Err(e) => Err(LabError::invalid("the ClusterNetworkPolicy CRD", e)),
        }
    }

    fn prepare(&self) -> Result<(), LabError> {
        let io = |what: &str, e| LabError::io(format!("{what} in {}", self.dir.display()), e);
        std::fs::create_dir_all(self.dir.join("certs")).map_err(|e| io("creating certs", e))?;
        let key = self.dir.join("service-account.key");
        if !key.exists() {
            let path = key.display().to_string();
            weir::exec::run_ok("openssl", &["genrsa", "-out", &path, "2048"], None).map_err(
                |e| {
                    LabError::invalid(
                        "the service account key",
                        format!("{e} (openssl is installed by `cargo xtask setup`)"),
                    )
                },
            )?;
        }
        let agent_groups = format!("\"{}\"", AGENT_GROUPS.join(","));
        let tokens: [(Identity, &str, &str); 3] = [
            (Identity::Admin, "admin", "\"system:masters\""),
            (Identity::Agent, AGENT_USER, &agent_groups),
            (Identity::Proxy, PROXY_USER, ""),
        ];
        let mut csv = String::new();
        for (who, user, groups) in tokens {
            let token = format!("{}-{:016x}", who.name(), random_u64());
            match groups.is_empty() {
                true => csv.push_str(&format!("{token},{user},{user}\n")),
                false => csv.push_str(&format!("{token},{user},{user},{groups}\n")),
            }
            let kubeconfig = format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: https://127.0.0.1:{APISERVER_PORT}\n    certificate-authority: {ca}\nusers:\n- name: {name}\n  user:\n    token: {token}\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    user: {name}\ncurrent-context: lab\n",
                ca = self.dir.join("certs/apiserver.crt").display(),
                name = who.name(),
            );
            std::fs::write(self.kubeconfig(who), kubeconfig).map_err(|e| io("writing", e))?;
            std::fs::write(self.token_file(who), &token).map_err(|e| io("writing", e))?;
        }
        std::fs::write(self.dir.join("tokens.csv"), csv).map_err(|e| io("writing", e))?;
        // Every request of the agent's identity, at Metadata level: who, verb, resource,
        // and the response code (a 403 is a missing permission).
        let policy = format!(
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n  users: [\"{AGENT_USER}\"]\n- level: None\n"
        );
        std::fs::write(self.dir.join("audit-policy.yaml"), policy).map_err(|e| io("writing", e))
    }

    pub fn start_etcd(&self, node: &str) -> Result<u32, LabError> {
        self.spawn_etcd(node, "etcd", ETCD_CLIENT, ETCD_PEER, &self.etcd_log())
    }

    /// The relay's etcd (`weir relay --store`), with its data in `relay-etcd`: over TLS,
    /// taking only clients with a certificate of its CA, as deploy/relay/ runs it.
    pub fn start_relay_store(&self, node: &str) -> Result<u32, LabError> {
        let tls = self.relay_tls()?;
        let log = self.dir.join("relay-etcd.log");
        let mut etcd = etcd_command("relay-etcd", &self.dir, RELAY_STORE_PEER);
        etcd.arg(format!("--listen-client-urls=https://{RELAY_STORE}"))
            .arg(format!("--advertise-client-urls=https://{RELAY_STORE}"))
            .arg("--client-cert-auth")
            .arg(format!(
                "--trusted-ca-file={}",
                tls.join("ca.crt").display()
            ))
            .arg(format!("--cert-file={}", tls.join("server.crt").display()))
            .arg(format!("--key-file={}", tls.join("server.key").display()));
        let child = netns::spawn_detached(node, &mut etcd, &log, netns::Stdout::Log)?;
        Ok(child.id())
    }

    /// The relay's etcd's URL, as the flag `url_flag` (`--relay`, `--store`), and the client
    /// identity (the relay's and the agent's) that reaches it, as `weir agent` and `weir
    /// relay` flags.
    pub fn relay_client_args(&self, url_flag: &str) -> Vec<String> {
        let tls = self.dir.join("relay-tls");
        vec![
            format!("{url_flag}=https://{RELAY_STORE}"),
            format!("--relay-ca={}", tls.join("ca.crt").display()),
            format!("--relay-cert={}", tls.join("client.crt").display()),
            format!("--relay-key={}", tls.join("client.key").display()),
        ]
    }

    /// The client identity of [`Self::relay_client_args`]; `with_cert` false: the CA
    /// alone, as a client without a certificate would come.
    pub fn relay_client_tls(&self, with_cert: bool) -> weir::source::relay::store::StoreTls {
        let tls = self.dir.join("relay-tls");
        weir::source::relay::store::StoreTls {
            ca: Some(tls.join("ca.crt")),
            cert: with_cert.then(|| tls.join("client.crt")),
            key: with_cert.then(|| tls.join("client.key")),
        }
    }

    /// The CA, the relay's etcd's server certificate (for 127.0.0.1) and one client
    /// certificate, made once (`relay-tls/`).
    fn relay_tls(&self) -> Result<PathBuf, LabError> {
        let pki = crate::pki::Pki {
            dir: self.dir.join("relay-tls"),
        };
        if !pki.cert("client").exists() {
            pki.init_ca()?;
            pki.server("server", "weir-lab relay etcd", "IP:127.0.0.1")?;
            pki.client_v3("client", "weir-lab relay client")?;
        }
        Ok(pki.dir)
    }

    /// `weir relay` on the relay's etcd, as the agent's identity (the relay needs the
    /// agent's reads and nothing more), its log in `relay.log`.
    pub fn start_relay(&self, node: &str, weir: &Path) -> Result<u32, LabError> {
        let mut relay = Command::new(weir);
        let args = self.relay_client_args("--store");
        relay
            .arg("relay")
            .args(args)
            .env("KUBECONFIG", self.kubeconfig(Identity::Agent));
        let child = netns::spawn_detached(node, &mut relay, &self.relay_log(), netns::Stdout::Log)?;
        Ok(child.id())
    }

    /// Waits until the relay has written a complete list of every kind (its six
    /// `/weir/v1/listed/` marks), or `within` has passed.
    pub fn wait_relay_listed(&self, node: &str, within: Duration) -> Result<(), LabError> {
        let deadline = std::time::Instant::now() + within;
        let kinds = weir::source::kube::KINDS.len() as i64;
        loop {
            let marks = self.relay_store_count(node, "/weir/v1/listed/", true);
            if marks.as_ref() == Ok(&kinds) {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(LabError::invalid(
                    "the relay",
                    format!(
                        "not every kind listed after {within:?} ({marks:?} of {kinds}); its log: {}",
                        self.relay_log().display()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// How many keys under `prefix` the relay's etcd holds, asked as the lab's client
    /// identity (or, `with_cert` false, with no client certificate: refused).
    pub fn relay_store_count(
        &self,
        node: &str,
        prefix: &str,
        with_cert: bool,
    ) -> Result<i64, String> {
        let tls = self.relay_client_tls(with_cert);
        let prefix = prefix.to_string();
        self.relay_store(node, tls, move |mut client| async move {
            let options = etcd_client::GetOptions::new()
                .with_prefix()
                .with_count_only();
            let r = client
                .get(prefix, Some(options))
                .await
                .map_err(|e| e.to_string())?;
            Ok(r.count())
        })
    }

    /// Runs `f` with a client of the relay's etcd, in the node's namespace.
    fn relay_store<T, F, Fut>(
        &self,
        node: &str,
        tls: weir::source::relay::store::StoreTls,
        f: F,
    ) -> Result<T, String>
    where
        T: Send,
        F: FnOnce(etcd_client::Client) -> Fut + Send,
        Fut: std::future::Future<Output = Result<T, String>>,
    {
        in_netns_runtime(node, move || async move {
            let endpoints = [format!("https://{RELAY_STORE}")];
            let client = weir::source::relay::store::connect(&endpoints, &tls)
                .await
                .map_err(|e| format!("{e:#}"))?;
            f(client).await
        })
    }

    pub fn relay_log(&self) -> PathBuf {
        self.dir.join("relay.log")
    }

    fn spawn_etcd(
        &self,
        node: &str,
        name: &str,
        client: &str,
        peer: &str,
        log: &Path,
    ) -> Result<u32, LabError> {
        let mut etcd = etcd_command(name, &self.dir, peer);
        etcd.arg(format!("--listen-client-urls=http://{client}"))
            .arg(format!("--advertise-client-urls=http://{client}"));
        let child = netns::spawn_detached(node, &mut etcd, log, netns::Stdout::Log)?;
        Ok(child.id())
    }

    pub fn start_apiserver(&self, node: &str) -> Result<u32, LabError> {
        let d = |f: &str| self.dir.join(f).display().to_string();
        let mut api = Command::new(components_dir().join("kube-apiserver"));
        api.arg(format!("--etcd-servers=http://{ETCD_CLIENT}"))
            .args(["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"])
            .arg(format!("--secure-port={APISERVER_PORT}"))
            .arg(format!("--cert-dir={}", d("certs")))
            .arg(format!(
                "--service-account-key-file={}",
                d("service-account.key")
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                d("service-account.key")
            ))
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg("--api-audiences=https://kubernetes.default.svc")
            .arg("--authorization-mode=Node,RBAC")
            .arg(format!("--token-auth-file={}", d("tokens.csv")))
            .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}"))
            .arg("--allow-privileged=true")
            // No controller-manager: nothing would create the default ServiceAccounts or
            // reconcile the kubernetes Service's endpoints.
            .arg("--endpoint-reconciler-type=none")
            .arg("--disable-admission-plugins=ServiceAccount")
            .arg(format!("--audit-policy-file={}", d("audit-policy.yaml")))
            .arg(format!("--audit-log-path={}", d("audit.log")))
            .arg("--audit-log-format=json")
            .arg("--audit-log-mode=blocking")
            .arg("--profiling=false")
            .arg("--v=1");
        let child =
            netns::spawn_detached(node, &mut api, &self.apiserver_log(), netns::Stdout::Log)?;
        Ok(child.id())
    }

    /// Waits until `/readyz` answers 200 to the admin.
    pub fn wait_ready(&self, node: &str, timeout: Duration) -> Result<(), LabError> {
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no answer yet");
        while Instant::now() < deadline {
            let answer = self.block_on(node, Identity::Admin, |client| async move {
                let req = http::Request::get("/readyz")
                    .body(Vec::new())
                    .expect("request");
                client.request_text(req).await.map_err(|e| e.to_string())
            });
            match answer {
                Ok(Ok(text)) if text.trim() == "ok" => return Ok(()),
                Ok(Ok(text)) => last = text,
                Ok(Err(e)) | Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(LabError::invalid(
            "kube-apiserver",
            format!(
                "not ready after {timeout:?} ({last}); last lines of {}:\n{}\nlast lines of {}:\n{}",
                self.apiserver_log().display(),
                tail(&self.apiserver_log()),
                self.etcd_log().display(),
                tail(&self.etcd_log())
            ),
        ))
    }

    /// Runs `f` with a client of `who` on a thread inside `node` (whose loopback serves the
    /// API). Errors of the setup (client, runtime) are strings naming what failed.
    pub fn block_on<T, F, Fut>(&self, node: &str, who: Identity, f: F) -> Result<T, String>
    where
        T: Send,
        F: FnOnce(Client) -> Fut + Send,
        Fut: std::future::Future<Output = T>,
    {
        let path = self.kubeconfig(who);
        in_netns_runtime(node, move || async move {
            let client = client_from(&path).await?;
            Ok(f(client).await)
        })
    }

    /// Compacts etcd's history up to its current revision (through etcd's own HTTP
    /// gateway), so that a watch resuming from an older resourceVersion gets 410 Gone.
    pub fn compact_etcd(&self, node: &str) -> Result<u64, LabError> {
        netns::in_netns(node, || {
            let header = etcd_post("/v3/kv/range", r#"{"key":"AA=="}"#)?;
            let revision: u64 = header["header"]["revision"]
                .as_str()
                .and_then(|r| r.parse().ok())
                .ok_or_else(|| format!("etcd range answered no revision: {header}"))?;
            etcd_post(
                "/v3/kv/compaction",
                &format!(r#"{{"revision":"{revision}","physical":true}}"#),
            )?;
            Ok::<u64, String>(revision)
        })?
        .map_err(|e| LabError::invalid("etcd compaction", e))
    }

    /// Compacts the relay's etcd's history up to its current revision, so that an agent's
    /// watch resuming from an older revision must list again.
    pub fn compact_relay_store(&self, node: &str) -> Result<u64, LabError> {
        let tls = self.relay_client_tls(true);
        self.relay_store(node, tls, |mut client| async move {
            let now = client.get("/", None).await.map_err(|e| e.to_string())?;
            let revision = now.header().map(|h| h.revision()).unwrap_or(0);
            let options = etcd_client::CompactionOptions::new().with_physical();
            client
                .compact(revision, Some(options))
                .await
                .map_err(|e| e.to_string())?;
            Ok(revision as u64)
        })
        .map_err(|e| LabError::invalid("the relay's etcd's compaction", e))
    }

    /// Writes a key outside the API server's prefix (`/weir-lab/advance`) to etcd
    /// directly: etcd's revision moves on with no object changed, and it works while the
    /// API server is stopped. A kube-apiserver started after it lists at that revision, so
    /// every watch resuming from an older resourceVersion gets 410 Gone: none can have
    /// heard of the write (no bookmark carries it). Returns the new revision.
    pub fn advance_etcd(&self, node: &str) -> Result<u64, LabError> {
        netns::in_netns(node, || {
            // Key "/weir-lab/advance", value "1", base64 as the gateway takes them: every
            // put is a new revision, the same value or not.
            let put = etcd_post(
                "/v3/kv/put",
                r#"{"key":"L3dlaXItbGFiL2FkdmFuY2U=","value":"MQ=="}"#,
            )?;
            put["header"]["revision"]
                .as_str()
                .and_then(|r| r.parse().ok())
                .ok_or_else(|| format!("etcd put answered no revision: {put}"))
        })?
        .map_err(|e| LabError::invalid("etcd revision advance", e))
    }
}

/// A kube client from a kubeconfig file.
pub async fn client_from(path: &Path) -> Result<Client, String> {
    let kubeconfig = Kubeconfig::read_from(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Client::try_from(config).map_err(|e| format!("kube client: {e}"))
}

/// One JSON POST to etcd's gRPC gateway over plain HTTP/1.1 (the lab's etcd listens on
/// loopback without TLS).
/// Runs `work` to its end on a runtime of its own, in the node's namespace.
fn in_netns_runtime<T: Send, Fut: std::future::Future<Output = Result<T, String>>>(
    node: &str,
    work: impl FnOnce() -> Fut + Send,
) -> Result<T, String> {
    netns::in_netns(node, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?;
        rt.block_on(work())
    })
    .map_err(|e| e.to_string())?
}

/// etcd named `name`, its data in DIR/NAME, its one peer at `peer`; the client URLs are the
/// caller's.
fn etcd_command(name: &str, dir: &Path, peer: &str) -> Command {
    let mut etcd = Command::new(components_dir().join("etcd"));
    etcd.arg(format!("--data-dir={}", dir.join(name).display()))
        .arg(format!("--name={name}"))
        .arg(format!("--listen-peer-urls=http://{peer}"))
        .arg(format!("--initial-advertise-peer-urls=http://{peer}"))
        .arg(format!("--initial-cluster={name}=http://{peer}"))
        // A lab is thrown away; fsync only slows it down.
        .arg("--unsafe-no-fsync")
        .arg("--log-level=warn");
    etcd
}

fn etcd_post(path: &str, body: &str) -> Result<serde_json::Value, String> {
    let mut stream = std::net::TcpStream::connect(ETCD_CLIENT).map_err(|e| format!("etcd: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {ETCD_CLIENT}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| format!("etcd: {e}"))?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|e| format!("etcd: {e}"))?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("etcd {path}: no HTTP body in {response:?}"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("etcd {path}: {head} {body}"));
    }
    serde_json::from_str(body).map_err(|e| format!("etcd {path}: {e}: {body}"))
}

fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .is_err()
    {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        return t.as_nanos() as u64 ^ u64::from(std::process::id());
    }
    u64::from_le_bytes(bytes)
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
