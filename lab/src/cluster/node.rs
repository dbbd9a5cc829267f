//! One kubelet node: a network namespace plugged into the control plane's bridge, a mount
//! namespace of its own (private /run and bpffs; its own /var/lib and /var/log), a cgroup
//! root of its own, and containerd, kubelet and kube-proxy started inside both namespaces.
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::super::{netns, LabError};
use super::control::{self, spawn, Credentials, TOOL_TIMEOUT};
use super::{
    node_name, ClusterState, Components, DownReport, NodeState, CLUSTER_CIDR, CONTROL_PLANE_IP,
};
use crate::pki::{self, Auth};

/// What kubelet's container manager wants of the host-wide kernel tunables.
const KUBELET_SYSCTLS: &[(&str, &str)] = &[
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 250, 0, 1 + i as u8)
}

fn pod_cidr(i: usize) -> String {
    format!("10.250.{i}.0/24")
}

fn mnt_dir(state: &ClusterState) -> PathBuf {
    state.dir.join("mnt")
}

fn node_dir(state: &ClusterState, node: &NodeState) -> PathBuf {
    state.dir.join(&node.name)
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn run(program: &str, package: &str, args: &[&str]) -> Result<String, LabError> {
    netns::tool(program, package, args, TOOL_TIMEOUT)
}

/// `dir/mnt`, bind-mounted onto itself and private: a mount namespace can be bound to a
/// file only on a mount that does not propagate into that namespace.
pub fn prepare_mounts(state: &mut ClusterState) -> Result<(), LabError> {
    let mnt = mnt_dir(state);
    std::fs::create_dir_all(&mnt)
        .map_err(|e| LabError::io(format!("creating {}", mnt.display()), e))?;
    run("mount", "mount", &["--bind", &s(&mnt), &s(&mnt)])?;
    state.mnt_bound = true;
    run("mount", "mount", &["--make-private", &s(&mnt)])?;
    Ok(())
}

/// Every cgroup v1 hierarchy (and the v2 one) of the host: where a node's cgroup root goes.
fn hierarchies() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").is_file())
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The node's cgroup root in every hierarchy.
pub fn cgroup_dirs(cgroup: &str) -> Vec<PathBuf> {
    hierarchies()
        .into_iter()
        .map(|h| h.join(cgroup.trim_start_matches('/')))
        .collect()
}

/// Builds node `i` of `total`: its network (address, routes to every node's pod range),
/// its cgroup root and its mount namespace. Nothing runs in it yet.
pub fn create(state: &ClusterState, i: usize, total: usize) -> Result<NodeState, LabError> {
    let name = node_name(&state.name, i);
    let cp = &state.control_plane.netns;
    let ip = node_ip(i);
    let node = NodeState {
        name: name.clone(),
        netns: name.clone(),
        ip,
        pod_cidr: pod_cidr(i),
        mount_ns: mnt_dir(state).join(&name),
        cgroup: format!("/{name}"),
        containerd: None,
        kubelet: None,
        kube_proxy: None,
    };
    netns::add(&name)?;
    let veth = format!("{}-v{i}", state.name);
    netns::ip(&[
        "-n", cp, "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &name,
    ])?;
    netns::ip(&[
        "-n",
        cp,
        "link",
        "set",
        &veth,
        "master",
        &control::bridge(state),
    ])?;
    netns::ip(&["-n", cp, "link", "set", &veth, "up"])?;
    netns::ip(&[
        "-n",
        &name,
        "addr",
        "add",
        &format!("{ip}/24"),
        "dev",
        "eth0",
    ])?;
    netns::ip(&["-n", &name, "link", "set", "eth0", "up"])?;
    netns::ip(&[
        "-n",
        &name,
        "route",
        "add",
        "default",
        "via",
        &CONTROL_PLANE_IP.to_string(),
    ])?;
    for j in (1..=total).filter(|&j| j != i) {
        netns::ip(&[
            "-n",
            &name,
            "route",
            "add",
            &pod_cidr(j),
            "via",
            &node_ip(j).to_string(),
        ])?;
    }
    netns::ip(&[
        "-n",
        cp,
        "route",
        "add",
        &pod_cidr(i),
        "via",
        &ip.to_string(),
    ])?;
    netns::sysctl(&name, "net.ipv4.ip_forward", "1")?;

    for dir in cgroup_dirs(&node.cgroup) {
        std::fs::create_dir_all(&dir)
            .map_err(|e| LabError::io(format!("creating cgroup {}", dir.display()), e))?;
        // A cpuset cgroup takes no task until it has CPUs and memory nodes.
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let parent = dir.parent().map(|p| p.join(file));
            if let Some(parent) = parent.filter(|p| p.is_file()) {
                let value = std::fs::read_to_string(&parent)
                    .map_err(|e| LabError::io(format!("reading {}", parent.display()), e))?;
                std::fs::write(dir.join(file), value.trim())
                    .map_err(|e| LabError::io(format!("writing {}/{file}", dir.display()), e))?;
            }
        }
    }

    let nd = state.dir.join(&name);
    for d in [
        "var-lib/kubelet",
        "var-lib/containerd",
        "var-lib/cni/net.d",
        "var-log/pods",
        "var-log/containers",
    ] {
        std::fs::create_dir_all(nd.join(d))
            .map_err(|e| LabError::io(format!("creating {}", nd.join(d).display()), e))?;
    }
    std::fs::write(&node.mount_ns, "")
        .map_err(|e| LabError::io(format!("creating {}", node.mount_ns.display()), e))?;
    run(
        "unshare",
        "util-linux",
        &[
            &format!("--mount={}", s(&node.mount_ns)),
            "--propagation",
            "private",
            "true",
        ],
    )?;
    // kubelet sets these host-wide sysctls to these values when they differ (and
    // protectKernelDefaults makes a difference fatal instead): the node sees files with
    // these values bound over them, so the host's stay as they are.
    let sysctl_dir = nd.join("sysctl");
    std::fs::create_dir_all(&sysctl_dir)
        .map_err(|e| LabError::io(format!("creating {}", sysctl_dir.display()), e))?;
    let mut binds = String::new();
    for (key, value) in KUBELET_SYSCTLS {
        let file = sysctl_dir.join(key.replace('/', "."));
        write(&file, &format!("{value}\n"))?;
        binds.push_str(&format!("mount --bind {} /proc/sys/{key}\n", s(&file)));
    }
    // Inside: drop the copies of the host's namespace pins (they would keep other
    // namespaces alive), then the node's own /run (shared, so pods started later show
    // up in a HostToContainer mount of /run/netns), bpffs (alone at /sys/fs/bpf: a copy
    // of the host's, private, under it would fail containerd's propagation check), /var/lib
    // and /var/log.
    let script = format!(
        "umount -l {mnt} 2>/dev/null; umount -l /run/netns 2>/dev/null; set -e
mount -t tmpfs -o mode=0755 weir-node-run /run
mount --make-shared /run
mkdir -p /run/netns
while umount -l /sys/fs/bpf 2>/dev/null; do :; done
mount -t bpf bpffs /sys/fs/bpf
mount --make-shared /sys/fs/bpf
mount --bind {nd}/var-lib /var/lib
mount --bind {nd}/var-log /var/log
{binds}",
        mnt = s(&mnt_dir(state)),
        nd = s(&nd)
    );
    in_node(&node, &["sh", "-c", &script], TOOL_TIMEOUT)?;
    Ok(node)
}

/// Runs a command inside the node's network and mount namespaces.
fn in_node(node: &NodeState, args: &[&str], timeout: Duration) -> Result<String, LabError> {
    let net = format!("--net={}", netns::path(&node.netns).display());
    let mnt = format!("--mount={}", node.mount_ns.display());
    let mut all = vec![net.as_str(), mnt.as_str(), "--"];
    all.extend_from_slice(args);
    netns::tool("nsenter", "util-linux", &all, timeout)
}

fn write(path: &Path, text: &str) -> Result<(), LabError> {
    std::fs::write(path, text).map_err(|e| LabError::io(format!("writing {}", path.display()), e))
}

/// Writes the node's configuration, starts containerd, imports the images, then starts
/// the kubelet and kube-proxy.
pub fn start(
    state: &mut ClusterState,
    index: usize,
    c: &Components,
    cred: &Credentials,
    images: &[PathBuf],
) -> Result<(), LabError> {
    let node = state.nodes[index].clone();
    let nd = node_dir(state, &node);
    let containerd_toml = nd.join("containerd.toml");
    // restrict_oom_score_adj: without CAP_SYS_RESOURCE every sandbox fails ("can't get
    // final child's PID from pipe: EOF"). CDI off: no devices.
    write(
        &containerd_toml,
        &format!(
            r#"version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  enable_cdi = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "/var/lib/cni/net.d"
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = "{runc}"
      SystemdCgroup = false
[plugins.'io.containerd.cri.v1.images']
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{pause}"
"#,
            pause = c.pause_image,
            runc = s(&state.dir.join("runc")),
        ),
    )?;
    // ptp: a veth per pod with a host route to it; the pod's default route is the node.
    write(
        &nd.join("var-lib/cni/net.d/10-weir-ptp.conflist"),
        &format!(
            r#"{{
  "cniVersion": "1.0.0",
  "name": "weir-ptp",
  "plugins": [
    {{
      "type": "ptp",
      "ipMasq": false,
      "mtu": 1500,
      "ipam": {{
        "type": "host-local",
        "ranges": [[{{ "subnet": "{cidr}" }}]],
        "routes": [{{ "dst": "0.0.0.0/0" }}]
      }}
    }}
  ]
}}
"#,
            cidr = node.pod_cidr
        ),
    )?;
    let path = format!(
        "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        s(&c.containerd)
    );
    let containerd = spawn(
        &node.netns,
        Some(&node.mount_ns),
        &c.containerd.join("containerd"),
        &["--config".into(), s(&containerd_toml)],
        &[("PATH", path.as_str())],
        &nd.join("containerd.log"),
    )?;
    state.nodes[index].containerd = Some(containerd);
    wait_containerd(&node, c, containerd, &nd.join("containerd.log"))?;
    for image in [c.images.join("pause.tar"), c.images.join("agnhost.tar")]
        .iter()
        .chain(images)
    {
        import(&node, c, image)?;
    }

    let kubeconfig = nd.join("kubeconfig");
    write(
        &kubeconfig,
        &pki::kubeconfig(
            &control::server(),
            &control::server_ca(state),
            &node.name,
            &Auth::Cert {
                cert: cred.pki.cert(&node.name),
                key: cred.pki.key(&node.name),
            },
        ),
    )?;
    let resolv = nd.join("resolv.conf");
    write(&resolv, "nameserver 127.0.0.1\n")?;
    let kubelet_yaml = nd.join("kubelet.yaml");
    // What kind also sets: no swap or cgroup v1 refusal, image GC and eviction off.
    write(
        &kubelet_yaml,
        &format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {ip}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: {cgroup}
failCgroupV1: false
failSwapOn: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "0%"
  nodefs.available: "0%"
  nodefs.inodesFree: "0%"
  imagefs.available: "0%"
podLogsDir: /var/log/pods
resolvConf: {resolv}
clusterDomain: cluster.local
serializeImagePulls: false
"#,
            ip = node.ip,
            ca = s(&cred.pki.ca_cert()),
            cgroup = node.cgroup,
            resolv = s(&resolv),
        ),
    )?;
    let kubelet = spawn(
        &node.netns,
        Some(&node.mount_ns),
        &c.node.join("kubelet"),
        &[
            format!("--config={}", s(&kubelet_yaml)),
            format!("--kubeconfig={}", s(&kubeconfig)),
            format!("--hostname-override={}", node.name),
            format!("--node-ip={}", node.ip),
            "--v=1".into(),
        ],
        &[("PATH", path.as_str())],
        &nd.join("kubelet.log"),
    )?;
    state.nodes[index].kubelet = Some(kubelet);

    let proxy_kubeconfig = nd.join("kubeconfig-proxy");
    write(
        &proxy_kubeconfig,
        &pki::kubeconfig(
            &control::server(),
            &control::server_ca(state),
            "kube-proxy",
            &Auth::Token(cred.proxy_token.clone()),
        ),
    )?;
    let proxy = spawn(
        &node.netns,
        Some(&node.mount_ns),
        &c.kubernetes.join("kube-proxy"),
        &[
            format!("--kubeconfig={}", s(&proxy_kubeconfig)),
            format!("--hostname-override={}", node.name),
            format!("--cluster-cidr={CLUSTER_CIDR}"),
            "--proxy-mode=iptables".into(),
            // Leave nf_conntrack_max (host-global) and the conntrack timeouts alone.
            "--conntrack-max-per-core=0".into(),
            "--conntrack-tcp-timeout-established=0s".into(),
            "--conntrack-tcp-timeout-close-wait=0s".into(),
            "--healthz-bind-address=127.0.0.1:10256".into(),
            "--metrics-bind-address=127.0.0.1:10249".into(),
            "--v=1".into(),
        ],
        &[("PATH", path.as_str())],
        &nd.join("kube-proxy.log"),
    )?;
    state.nodes[index].kube_proxy = Some(proxy);
    Ok(())
}

fn ctr(
    node: &NodeState,
    c: &Components,
    args: &[&str],
    timeout: Duration,
) -> Result<String, LabError> {
    let ctr = s(&c.containerd.join("ctr"));
    let mut all = vec![ctr.as_str(), "--address", "/run/containerd/containerd.sock"];
    all.extend_from_slice(args);
    in_node(node, &all, timeout)
}

fn wait_containerd(node: &NodeState, c: &Components, pid: u32, log: &Path) -> Result<(), LabError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if !netns::alive(pid) {
            return Err(netns::not_ready(
                format!("containerd on {}", node.name),
                "exited",
                log,
            ));
        }
        let last = match ctr(node, c, &["version"], Duration::from_secs(10)) {
            Ok(_) => return Ok(()),
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            return Err(netns::not_ready(
                format!("containerd on {}", node.name),
                &format!("no answer after 60 s: {last}"),
                log,
            ));
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// `ctr images import` of a docker-archive or oci-archive into the node's `k8s.io`
/// namespace, where the kubelet finds it (no registry: pods name it with
/// `imagePullPolicy: IfNotPresent` or by digest).
pub fn import(node: &NodeState, c: &Components, archive: &Path) -> Result<(), LabError> {
    ctr(
        node,
        c,
        &["-n", "k8s.io", "images", "import", &s(archive)],
        Duration::from_secs(300),
    )?;
    // An oci-archive's images keep their short names (`weir:0.1.0`), which the kubelet's
    // normalized references (`docker.io/library/weir...`) do not find; and a reference by
    // digest is found only under a name of that form. Both are added.
    let list = ctr(node, c, &["-n", "k8s.io", "images", "ls"], TOOL_TIMEOUT)?;
    for (name, digest) in list.lines().skip(1).filter_map(|l| {
        let mut f = l.split_whitespace();
        Some((f.next()?, f.nth(1)?))
    }) {
        if name.starts_with("sha256:") || name.contains('@') || !digest.starts_with("sha256:") {
            continue;
        }
        let (full, repository) = normalize(name);
        let mut names = vec![format!("{repository}@{digest}")];
        if full != name {
            names.push(full);
        }
        for new in names {
            ctr(
                node,
                c,
                &["-n", "k8s.io", "images", "tag", "--force", name, &new],
                TOOL_TIMEOUT,
            )?;
        }
    }
    Ok(())
}

/// `weir:0.1.0` → (`docker.io/library/weir:0.1.0`, `docker.io/library/weir`), as the
/// kubelet and containerd's CRI normalize image references.
fn normalize(name: &str) -> (String, String) {
    let (repository, tag) = match name.rsplit_once(':') {
        Some((r, t)) if !t.contains('/') => (r, Some(t)),
        _ => (name, None),
    };
    let repository = match repository.split_once('/') {
        Some((domain, _))
            if domain.contains('.') || domain.contains(':') || domain == "localhost" =>
        {
            repository.to_string()
        }
        Some(_) => format!("docker.io/{repository}"),
        None => format!("docker.io/library/{repository}"),
    };
    let full = format!("{repository}:{}", tag.unwrap_or("latest"));
    (full, repository)
}

fn kill_cgroup_tasks(cgroup: &str) -> usize {
    let mut killed = 0;
    for dir in cgroup_dirs(cgroup) {
        let mut stack = vec![dir];
        while let Some(d) = stack.pop() {
            if let Ok(procs) = std::fs::read_to_string(d.join("cgroup.procs")) {
                for pid in procs
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                {
                    // SAFETY: kill only sends a signal to the given process id.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    killed += 1;
                }
            }
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.path().is_dir() {
                    stack.push(e.path());
                }
            }
        }
    }
    killed
}

/// Removes a cgroup tree, deepest first.
fn remove_cgroup_tree(dir: &Path) -> usize {
    let mut removed = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().is_dir() {
            removed += remove_cgroup_tree(&e.path());
        }
    }
    if std::fs::remove_dir(dir).is_ok() {
        removed += 1;
    }
    removed
}

/// Stops the node: kubelet and kube-proxy by pid, every task in its cgroups (the pods),
/// containerd by pid, whatever is left in its network namespace (the shims); then drops its
/// mount namespace, cgroups and network namespace.
pub fn stop(node: &NodeState, report: &mut DownReport) {
    for pid in [node.kubelet, node.kube_proxy].into_iter().flatten() {
        if netns::alive(pid) {
            netns::stop_pid(pid, Duration::from_secs(10));
            report.stopped_processes += 1;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let killed = kill_cgroup_tasks(&node.cgroup);
        report.stopped_processes += killed;
        if killed == 0 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if let Some(pid) = node.containerd.filter(|&p| netns::alive(p)) {
        netns::stop_pid(pid, Duration::from_secs(10));
        report.stopped_processes += 1;
    }
    if netns::exists(&node.netns) {
        if let Ok(pids) = netns::pids(&node.netns) {
            report.stopped_processes += pids.len();
        }
        let _ = netns::stop_processes(&node.netns);
    }
    if node.mount_ns.exists() {
        let _ = run("umount", "mount", &[&s(&node.mount_ns)]);
    }
    for dir in cgroup_dirs(&node.cgroup) {
        if dir.exists() {
            report.removed_cgroups += remove_cgroup_tree(&dir);
        }
    }
    if netns::exists(&node.netns) {
        match netns::delete(&node.netns) {
            Ok(()) => report.removed_netns.push(node.netns.clone()),
            Err(e) => report.left.push(format!("{}: {e}", node.netns)),
        }
    }
}

/// Unmounts `dir/mnt` once every node's namespace file is unmounted.
pub fn release_mounts(state: &ClusterState, report: &mut DownReport) {
    if !state.mnt_bound {
        return;
    }
    if let Err(e) = run("umount", "mount", &[&s(&mnt_dir(state))]) {
        report
            .left
            .push(format!("{}: {e}", mnt_dir(state).display()));
    }
}

#[cfg(test)]
mod tests {
    use super::normalize;

    #[test]
    fn image_names_are_normalized_as_the_kubelet_does() {
        assert_eq!(
            normalize("weir:0.1.0"),
            (
                "docker.io/library/weir:0.1.0".into(),
                "docker.io/library/weir".into()
            )
        );
        assert_eq!(
            normalize("registry.k8s.io/pause:3.10.1").0,
            "registry.k8s.io/pause:3.10.1"
        );
        assert_eq!(normalize("me/weir").0, "docker.io/me/weir:latest");
        assert_eq!(normalize("localhost:5000/weir:1").1, "localhost:5000/weir");
    }
}
