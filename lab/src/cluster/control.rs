//! The cluster's control plane in the namespace `NAME-cp`: the bridge the nodes plug into,
//! the lab's etcd, and kube-apiserver, kube-controller-manager and kube-scheduler
//! configured for real nodes (client certificates, the Node authorizer, service account
//! tokens issued by the controller-manager and kubelets).
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::super::control_plane::{ControlPlane, SERVICE_CIDR};
use super::super::{netns, LabError};
use super::{ClusterState, Components, DownReport, API_PORT, CONTROL_PLANE_IP};
use crate::pki::{self, Auth, Pki};

/// Shell-outs that are not waits (ip, mount, kubectl get) end within this.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(30);

pub fn bridge(state: &ClusterState) -> String {
    format!("{}-br", state.name)
}

/// The control plane's namespace and the bridge in it.
pub fn network(state: &ClusterState) -> Result<(), LabError> {
    let ns = &state.control_plane.netns;
    netns::add(ns)?;
    let br = bridge(state);
    netns::ip(&["-n", ns, "link", "add", &br, "type", "bridge"])?;
    netns::ip(&[
        "-n",
        ns,
        "addr",
        "add",
        &format!("{CONTROL_PLANE_IP}/24"),
        "dev",
        &br,
    ])?;
    netns::ip(&["-n", ns, "link", "set", &br, "up"])?;
    netns::sysctl(ns, "net.ipv4.ip_forward", "1")
}

/// What the nodes need of the control plane: its PKI and the tokens of the components.
pub struct Credentials {
    pub pki: Pki,
    pub proxy_token: String,
}

fn cp_dir(state: &ClusterState) -> PathBuf {
    state.dir.join("control-plane")
}

pub fn server() -> String {
    format!("https://{CONTROL_PLANE_IP}:{API_PORT}")
}

/// The certificate the API server serves (self-signed, with its CA in the same file, made
/// by kube-apiserver in --cert-dir): what clients and pods verify it with.
pub fn server_ca(state: &ClusterState) -> PathBuf {
    cp_dir(state).join("certs/apiserver.crt")
}

fn write(path: &Path, text: &str) -> Result<(), LabError> {
    std::fs::write(path, text).map_err(|e| LabError::io(format!("writing {}", path.display()), e))
}

/// Starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler; returns once
/// the server is ready and the ClusterNetworkPolicy CRD (deploy/crds/) is served.
pub fn start(
    state: &mut ClusterState,
    c: &Components,
    nodes: usize,
) -> Result<Credentials, LabError> {
    let dir = cp_dir(state);
    std::fs::create_dir_all(dir.join("certs"))
        .map_err(|e| LabError::io(format!("creating {}", dir.display()), e))?;
    let pki = Pki {
        dir: state.dir.join("pki"),
    };
    pki.init()?;
    pki.client(
        "apiserver-kubelet-client",
        "kube-apiserver-kubelet-client",
        &["system:masters"],
    )?;
    for i in 1..=nodes {
        let node = super::node_name(&state.name, i);
        pki.client(&node, &format!("system:node:{node}"), &["system:nodes"])?;
    }
    // Static tokens for the users the bootstrap RBAC binds: the admin, and each component.
    let mut tokens = String::new();
    let mut token_of = |who: &str, user: &str, group: &str| -> Result<String, LabError> {
        let t = pki::token()?;
        tokens.push_str(&format!("{t},{user},{user}{group}\n"));
        let auth = Auth::Token(t.clone());
        write(
            &dir.join(format!("kubeconfig-{who}")),
            &pki::kubeconfig(&server(), &server_ca(state), who, &auth),
        )?;
        Ok(t)
    };
    token_of("admin", "admin", ",\"system:masters\"")?;
    token_of("controller-manager", "system:kube-controller-manager", "")?;
    token_of("scheduler", "system:kube-scheduler", "")?;
    let proxy_token = token_of("proxy", "system:kube-proxy", "")?;
    write(&dir.join("tokens.csv"), &tokens)?;

    let ns = state.control_plane.netns.clone();
    let etcd_plane = ControlPlane::new(&dir);
    state.control_plane.etcd = Some(etcd_plane.start_etcd(&ns)?);

    let p = |f: &Path| f.display().to_string();
    let d = |f: &str| dir.join(f).display().to_string();
    let apiserver = c.kubernetes.join("kube-apiserver");
    let args = vec![
        "--etcd-servers=http://127.0.0.1:2379".to_string(),
        "--bind-address=0.0.0.0".into(),
        format!("--advertise-address={CONTROL_PLANE_IP}"),
        format!("--secure-port={API_PORT}"),
        format!("--cert-dir={}", d("certs")),
        format!("--client-ca-file={}", p(&pki.ca_cert())),
        format!("--token-auth-file={}", d("tokens.csv")),
        format!(
            "--service-account-key-file={}",
            p(&pki.service_account_key())
        ),
        format!(
            "--service-account-signing-key-file={}",
            p(&pki.service_account_key())
        ),
        "--service-account-issuer=https://kubernetes.default.svc".into(),
        "--api-audiences=https://kubernetes.default.svc".into(),
        "--authorization-mode=Node,RBAC".into(),
        "--enable-admission-plugins=NodeRestriction".into(),
        format!("--service-cluster-ip-range={SERVICE_CIDR}"),
        "--allow-privileged=true".into(),
        format!(
            "--kubelet-client-certificate={}",
            p(&pki.cert("apiserver-kubelet-client"))
        ),
        format!(
            "--kubelet-client-key={}",
            p(&pki.key("apiserver-kubelet-client"))
        ),
        // The nodes' names resolve nowhere: exec and logs reach kubelets by address.
        "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
        "--profiling=false".into(),
        "--v=1".into(),
    ];
    state.control_plane.apiserver = Some(spawn(
        &ns,
        None,
        &apiserver,
        &args,
        &[],
        &dir.join("kube-apiserver.log"),
    )?);
    wait_ready(state, c, Duration::from_secs(120))?;
    kubectl_stdin(
        state,
        c,
        &["apply", "--server-side", "-f", "-"],
        CLUSTER_POLICY_CRD,
        Duration::from_secs(60),
    )?;

    let kcm = c.node.join("kube-controller-manager");
    let args = vec![
        format!("--kubeconfig={}", d("kubeconfig-controller-manager")),
        format!(
            "--authentication-kubeconfig={}",
            d("kubeconfig-controller-manager")
        ),
        format!(
            "--authorization-kubeconfig={}",
            d("kubeconfig-controller-manager")
        ),
        "--bind-address=127.0.0.1".into(),
        "--leader-elect=false".into(),
        // Pod ranges are the nodes' own (host-local in the CNI config), not allocated.
        "--controllers=*,-nodeipam".into(),
        format!("--root-ca-file={}", p(&server_ca(state))),
        format!(
            "--service-account-private-key-file={}",
            p(&pki.service_account_key())
        ),
        // Each controller with its own ServiceAccount, as the bootstrap RBAC expects.
        "--use-service-account-credentials=true".into(),
        format!("--service-cluster-ip-range={SERVICE_CIDR}"),
        "--profiling=false".into(),
        "--v=1".into(),
    ];
    state.control_plane.controller_manager = Some(spawn(
        &ns,
        None,
        &kcm,
        &args,
        &[],
        &dir.join("kube-controller-manager.log"),
    )?);
    let scheduler = c.node.join("kube-scheduler");
    let args = vec![
        format!("--kubeconfig={}", d("kubeconfig-scheduler")),
        format!("--authentication-kubeconfig={}", d("kubeconfig-scheduler")),
        format!("--authorization-kubeconfig={}", d("kubeconfig-scheduler")),
        "--bind-address=127.0.0.1".into(),
        "--leader-elect=false".into(),
        "--profiling=false".into(),
        "--v=1".into(),
    ];
    state.control_plane.scheduler = Some(spawn(
        &ns,
        None,
        &scheduler,
        &args,
        &[],
        &dir.join("kube-scheduler.log"),
    )?);
    Ok(Credentials { pki, proxy_token })
}

/// The ClusterNetworkPolicy CRD, as deploy/crds/ ships it (the agent watches the kind).
const CLUSTER_POLICY_CRD: &str =
    include_str!("../../../deploy/crds/policy.networking.k8s.io_clusternetworkpolicies.yaml");

/// Starts `program` detached (its own session), in the network namespace `netns` and,
/// when given, the mount namespace bound at `mount_ns`, through nsenter (which execs it:
/// the pid is the program's). Its output goes to `log`.
pub fn spawn(
    netns_name: &str,
    mount_ns: Option<&Path>,
    program: &Path,
    args: &[String],
    env: &[(&str, &str)],
    log: &Path,
) -> Result<u32, LabError> {
    let log_file = std::fs::File::create(log)
        .map_err(|e| LabError::io(format!("creating {}", log.display()), e))?;
    let out = log_file
        .try_clone()
        .map_err(|e| LabError::io(format!("opening {}", log.display()), e))?;
    let mut command = Command::new("nsenter");
    command.arg(format!("--net={}", netns::path(netns_name).display()));
    if let Some(m) = mount_ns {
        command.arg(format!("--mount={}", m.display()));
    }
    command
        .arg("--")
        .arg(program)
        .args(args)
        .envs(env.iter().copied())
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(log_file);
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec the child only calls setsid, async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = command.spawn().map_err(|e| {
        LabError::io(
            format!("starting {} in {netns_name} (nsenter)", program.display()),
            e,
        )
    })?;
    Ok(child.id())
}

/// Runs kubectl as the admin in the control plane's namespace.
pub fn kubectl(
    state: &ClusterState,
    c: &Components,
    args: &[&str],
    timeout: Duration,
) -> Result<String, LabError> {
    let kubectl = c.node.join("kubectl").display().to_string();
    let kubeconfig = format!("--kubeconfig={}", state.admin_kubeconfig().display());
    let ns = format!(
        "--net={}",
        netns::path(&state.control_plane.netns).display()
    );
    let mut all = vec![ns.as_str(), "--", kubectl.as_str(), kubeconfig.as_str()];
    all.extend_from_slice(args);
    netns::tool("nsenter", "util-linux", &all, timeout)
}

/// [`kubectl`] with `input` on its standard input.
pub fn kubectl_stdin(
    state: &ClusterState,
    c: &Components,
    args: &[&str],
    input: &str,
    timeout: Duration,
) -> Result<String, LabError> {
    let kubectl = c.node.join("kubectl").display().to_string();
    let kubeconfig = format!("--kubeconfig={}", state.admin_kubeconfig().display());
    let ns = format!(
        "--net={}",
        netns::path(&state.control_plane.netns).display()
    );
    let mut all = vec![ns.as_str(), "--", kubectl.as_str(), kubeconfig.as_str()];
    all.extend_from_slice(args);
    let command = format!("kubectl {}", args.join(" "));
    let out = weir::exec::run_with_timeout("nsenter", &all, Some(input), timeout).map_err(|e| {
        LabError::Command {
            command: command.clone(),
            stderr: e.to_string(),
        }
    })?;
    if !out.success {
        return Err(LabError::Command {
            command,
            stderr: out.stderr.trim().to_string(),
        });
    }
    Ok(out.stdout)
}

pub fn kubectl_json(
    state: &ClusterState,
    c: &Components,
    args: &[&str],
) -> Result<serde_json::Value, LabError> {
    let out = kubectl(state, c, args, TOOL_TIMEOUT)?;
    serde_json::from_str(&out)
        .map_err(|e| LabError::invalid(format!("kubectl {}", args.join(" ")), e.to_string()))
}

fn wait_ready(state: &ClusterState, c: &Components, timeout: Duration) -> Result<(), LabError> {
    let deadline = Instant::now() + timeout;
    let log = cp_dir(state).join("kube-apiserver.log");
    loop {
        if !state.control_plane.apiserver.is_some_and(netns::alive) {
            return Err(netns::not_ready("kube-apiserver", "exited", &log));
        }
        let last = match kubectl(state, c, &["get", "--raw=/readyz"], TOOL_TIMEOUT) {
            Ok(text) if text.trim() == "ok" => return Ok(()),
            Ok(text) => text,
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            return Err(netns::not_ready(
                "kube-apiserver",
                &format!("not ready after {timeout:?}: {last}"),
                &log,
            ));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Waits until every node reports Ready.
pub fn wait_nodes_ready(state: &ClusterState, timeout: Duration) -> Result<(), LabError> {
    let deadline = Instant::now() + timeout;
    loop {
        let summary = super::status(state)?;
        let not_ready: Vec<String> = summary
            .nodes
            .iter()
            .filter(|n| !n.ready)
            .map(|n| n.name.clone())
            .collect();
        if not_ready.is_empty() {
            return Ok(());
        }
        for n in &summary.nodes {
            if !n.dead.is_empty() {
                let log = state.dir.join(&n.name).join(format!("{}.log", n.dead[0]));
                return Err(netns::not_ready(
                    format!("node {}", n.name),
                    &format!("{} exited", n.dead.join(", ")),
                    &log,
                ));
            }
        }
        if Instant::now() > deadline {
            let log = state.dir.join(&not_ready[0]).join("kubelet.log");
            return Err(netns::not_ready(
                format!("nodes {}", not_ready.join(", ")),
                &format!("not Ready after {timeout:?}"),
                &log,
            ));
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Stops the control plane (scheduler, controller-manager, API server, etcd, each by its
/// pid, then anything else in its namespace) and deletes its namespace.
pub fn stop(state: &ClusterState, report: &mut DownReport) {
    let cp = &state.control_plane;
    for pid in [cp.scheduler, cp.controller_manager, cp.apiserver, cp.etcd]
        .into_iter()
        .flatten()
    {
        if netns::alive(pid) {
            netns::stop_pid(pid, Duration::from_secs(10));
            report.stopped_processes += 1;
        }
    }
    if netns::exists(&cp.netns) {
        let _ = netns::stop_processes(&cp.netns);
        match netns::delete(&cp.netns) {
            Ok(()) => report.removed_netns.push(cp.netns.clone()),
            Err(e) => report.left.push(format!("{}: {e}", cp.netns)),
        }
    }
}
