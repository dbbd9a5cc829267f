//! The real kube-proxy of the pinned Kubernetes release in the lab's node namespace
//! (`weir-lab up --proxy iptables|nftables|ipvs`, server mode only): it reads Services and
//! the lab's EndpointSlices from the lab's API server and programs the node's Service
//! rules in the same hooks, relative to weir's programs and chains, as on a real node.
//!
//! It authenticates as `system:kube-proxy`, the user the API server's bootstrap RBAC binds
//! to the built-in `system:node-proxier` ClusterRole, and nothing else. It touches no
//! host-global sysctl (`--conntrack-max-per-core=0`, the timeouts left as they are) and
//! listens on the node namespace's loopback only.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::control_plane::{components_dir, kubernetes_version, ControlPlane, Identity};
use super::objects::ObjectSet;
use super::state::{LabDir, LabState};
pub use super::state::{ProxyMode, ProxyState};
use super::world::NODE_IP;
use super::{netns, services, LabError};
use weir::exec;

impl ProxyMode {
    fn flag(self) -> &'static str {
        match self {
            ProxyMode::None => "none",
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Nftables => "nftables",
        }
    }
}

const HEALTHZ: &str = "127.0.0.1:10256";
const METRICS: &str = "127.0.0.1:10249";

/// Refuses a mode this host cannot run, before anything is built: the binary, `nft` for
/// nftables mode, and the kernel's IPVS and dummy devices for ipvs mode (probed).
pub fn check_host(mode: ProxyMode) -> Result<(), LabError> {
    let what = format!("--proxy {}", mode.flag());
    let bin = components_dir().join("kube-proxy");
    if !bin.is_file() {
        return Err(LabError::invalid(
            &what,
            format!(
                "{} not found: `cargo xtask setup` builds kube-apiserver, kube-proxy and etcd of Kubernetes {} into {} (or set WEIR_COMPONENTS_DIR)",
                bin.display(),
                kubernetes_version(),
                components_dir().display()
            ),
        ));
    }
    match mode {
        ProxyMode::Nftables if !kernel_runs_nftables_mode() => Err(LabError::invalid(
            &what,
            format!(
                "kube-proxy's nftables mode needs Linux {}.{} or later (kube-proxy checks the kernel's version and exits); this kernel is {}: use --proxy iptables or ipvs here",
                NFTABLES_MODE_KERNEL.0,
                NFTABLES_MODE_KERNEL.1,
                weir::kernel::release()
            ),
        )),
        ProxyMode::Nftables => match exec::run("nft", &["--version"], None) {
            Ok(out) if out.success => Ok(()),
            Ok(out) => Err(LabError::invalid(&what, format!("`nft --version` failed: {}", out.stderr.trim()))),
            Err(e) => Err(LabError::invalid(
                &what,
                format!("kube-proxy's nftables mode runs the `nft` binary: {e} (Debian package nftables; `cargo xtask setup` installs it)"),
            )),
        },
        ProxyMode::Ipvs => ipvs_support().map_err(|missing| {
            LabError::invalid(
                &what,
                format!("this kernel lacks what kube-proxy's ipvs mode needs: {missing}; run it on a kernel that has them (e.g. Debian's, in a VM)"),
            )
        }),
        ProxyMode::None | ProxyMode::Iptables => Ok(()),
    }
}

/// The oldest kernel kube-proxy's nftables mode starts on (its
/// `NFTablesKubeProxyKernelVersion`).
pub const NFTABLES_MODE_KERNEL: (u32, u32) = (5, 13);

/// Whether kube-proxy's nftables mode starts on this kernel (by its version, as kube-proxy
/// itself decides).
pub fn kernel_runs_nftables_mode() -> bool {
    weir::kernel::major_minor(&weir::kernel::release()).is_none_or(|v| v >= NFTABLES_MODE_KERNEL)
}

/// The kernel support ipvs mode needs: IPVS itself (`/proc/net/ip_vs` once `ip_vs` is
/// loaded) and dummy devices (kube-proxy puts every ClusterIP on a dummy `kube-ipvs0`).
fn ipvs_support() -> Result<(), String> {
    let mut missing = Vec::new();
    const PRESENT: &str = "/proc/net/ip_vs";
    if !Path::new(PRESENT).exists() {
        let why = modprobe("ip_vs");
        if !Path::new(PRESENT).exists() {
            missing.push(format!(
                "CONFIG_IP_VS ({PRESENT} does not exist; modprobe ip_vs: {why})"
            ));
        }
    }
    if let Err(e) = dummy_device() {
        let why = modprobe("dummy");
        if let Err(again) = dummy_device() {
            missing.push(format!(
                "CONFIG_DUMMY (a dummy device cannot be made: {e}; modprobe dummy: {why}; then: {again})"
            ));
        }
    }
    match missing.is_empty() {
        true => Ok(()),
        false => Err(missing.join("; ")),
    }
}

/// Loads a module; says how that went.
fn modprobe(module: &str) -> String {
    match exec::run_with_timeout("modprobe", &[module], None, Duration::from_secs(10)) {
        Ok(out) if out.success => "loaded".into(),
        Ok(out) => out.stderr.trim().to_string(),
        Err(e) => e.to_string(),
    }
}

/// Makes (and removes) a dummy device in a namespace of its own.
fn dummy_device() -> Result<(), LabError> {
    let ns = format!("weir-ipvs-probe-{}", std::process::id());
    netns::add(&ns)?;
    let made = netns::ip(&["-n", &ns, "link", "add", "probe0", "type", "dummy"]);
    netns::delete(&ns)?;
    made.map(drop)
}

/// Starts kube-proxy in the node namespace; returns its pid.
pub fn start(dir: &LabDir, state: &LabState, mode: ProxyMode) -> Result<u32, LabError> {
    let api = state.api.as_ref().ok_or_else(|| {
        LabError::invalid("kube-proxy", "needs the lab's API server (--api server)")
    })?;
    let cp = ControlPlane::new(dir.api_dir());
    let node = api.node_name.clone();
    cp.block_on(&state.node_netns, Identity::Admin, |client| async move {
        super::api::set_node_address(&client, &node, NODE_IP).await
    })
    .and_then(|r| r)
    .map_err(|e| LabError::invalid("the lab's Node", e))?;
    let kubeconfig = cp.kubeconfig(Identity::Proxy);
    let mut command = Command::new(components_dir().join("kube-proxy"));
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--hostname-override={}", api.node_name))
        .arg(format!(
            "--cluster-cidr={},{}",
            state.ipv4_pool, state.ipv6_pool
        ))
        .arg(format!("--proxy-mode={}", mode.flag()))
        // Leave nf_conntrack_max (host-global) and the conntrack timeouts alone.
        .arg("--conntrack-max-per-core=0")
        .arg("--conntrack-tcp-timeout-established=0s")
        .arg("--conntrack-tcp-timeout-close-wait=0s")
        .arg(format!("--healthz-bind-address={HEALTHZ}"))
        .arg(format!("--metrics-bind-address={METRICS}"))
        .arg("--v=2");
    let child = netns::spawn_detached(
        &state.node_netns,
        &mut command,
        &dir.proxy_log(),
        netns::Stdout::Log,
    )?;
    Ok(child.id())
}

/// Waits until kube-proxy answers /healthz with 200 (it has synced its rules once).
pub fn wait_healthy(dir: &LabDir, state: &LabState, timeout: Duration) -> Result<(), LabError> {
    let deadline = Instant::now() + timeout;
    let mut last = String::from("no answer yet");
    while Instant::now() < deadline {
        check_alive(dir, state)?;
        match netns::in_netns(&state.node_netns, healthz)? {
            Ok((200, _)) => return Ok(()),
            Ok((code, body)) => last = format!("HTTP {code}: {}", body.trim()),
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(not_ready(
        dir,
        &format!("/healthz not OK after {timeout:?}: {last}"),
    ))
}

/// kube-proxy's /healthz: (status, body).
fn healthz() -> Result<(u16, String), String> {
    let mut stream = TcpStream::connect_timeout(
        &HEALTHZ.parse().expect("HEALTHZ is an address"),
        Duration::from_secs(2),
    )
    .map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET /healthz HTTP/1.1\r\nHost: {HEALTHZ}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no HTTP status in {response:?}"))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or("");
    Ok((code, body.to_string()))
}

/// Waits until kube-proxy's rules (iptables-save or nft's listing in the node namespace)
/// hold every ClusterIP with backends and every backend of `set`, and no ClusterIP or
/// backend that `before` had and `set` has not.
pub fn wait_programmed(
    dir: &LabDir,
    state: &LabState,
    mode: ProxyMode,
    before: &ObjectSet,
    set: &ObjectSet,
    timeout: Duration,
) -> Result<(), LabError> {
    let (ips, endpoints) = services::programmed(set);
    let gone_endpoints: Vec<(Ipv4Addr, u16)> = services::programmed(before)
        .1
        .into_iter()
        .filter(|e| !endpoints.contains(e))
        .collect();
    let now = services::cluster_ips(set);
    let gone: Vec<Ipv4Addr> = services::cluster_ips(before)
        .into_iter()
        .filter(|ip| !now.contains(ip))
        .collect();
    let deadline = Instant::now() + timeout;
    let mut missing;
    loop {
        check_alive(dir, state)?;
        let rules = rules(&state.node_netns, mode)?;
        // How each mode's listing spells a frontend and a DNAT to a backend.
        let frontend = |ip: &Ipv4Addr| match mode {
            ProxyMode::Nftables => rules.contains(&format!("{ip} . ")),
            ProxyMode::Ipvs => ipvs_frontend(&rules, *ip),
            _ => rules.contains(&format!("-d {ip}/32 ")),
        };
        let backend = |ip: &Ipv4Addr, port: &u16| match mode {
            ProxyMode::Nftables => rules.contains(&format!("to {ip}:{port}")),
            ProxyMode::Ipvs => ipvs_serves(&rules, *ip, *port),
            _ => rules.contains(&format!("--to-destination {ip}:{port}")),
        };
        missing = ips
            .iter()
            .filter(|ip| !frontend(ip))
            .map(|ip| format!("ClusterIP {ip}"))
            .chain(
                endpoints
                    .iter()
                    .filter(|(ip, port)| !backend(ip, port))
                    .map(|(ip, port)| format!("endpoint {ip}:{port}")),
            )
            .chain(
                gone.iter()
                    .filter(|ip| frontend(ip))
                    .map(|ip| format!("removed ClusterIP {ip} still present")),
            )
            .chain(
                gone_endpoints
                    .iter()
                    .filter(|(ip, port)| backend(ip, port))
                    .map(|(ip, port)| format!("removed endpoint {ip}:{port} still present")),
            )
            .collect::<Vec<_>>();
        if missing.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(not_ready(
        dir,
        &format!(
            "its {} rules do not match the lab's Services after {timeout:?}: {}",
            mode.flag(),
            missing.join(", ")
        ),
    ))
}

/// Whether /proc/net/ip_vs lists the real server `ip:port` with a weight above zero.
/// kube-proxy's graceful termination leaves a removed backend listed at weight 0 while
/// its connections drain, and IPVS sends nothing to it: listed is not serving.
fn ipvs_serves(table: &str, ip: Ipv4Addr, port: u16) -> bool {
    let address = format!("{:08X}:{port:04X}", u32::from(ip));
    table.lines().any(|line| {
        // "  -> AC120002:1900      Masq    1      0          0"
        let mut fields = line.split_whitespace();
        fields.next() == Some("->")
            && fields.next() == Some(address.as_str())
            && fields.nth(1).and_then(|w| w.parse::<u32>().ok()) > Some(0)
    })
}

/// kube-proxy's ipvs mode: the addresses bound to `kube-ipvs0`, and the ClusterIP,port
/// pairs its KUBE-IPVS-FILTER chain lets through; that chain rejects new connections to a
/// bound address the second set lacks. kube-proxy syncs its sets after the virtual and real
/// servers, one after the other, so a ClusterIP is served once it is in both (a probe in
/// between, under emulation, was refused).
const IPVS_BOUND_SET: &str = "KUBE-IPVS-IPS";
const IPVS_CLUSTER_IP_SET: &str = "KUBE-CLUSTER-IP";

/// The members of ipset `name` in an ipvs listing ([`rules`]), one per line.
fn listed_members<'a>(listing: &'a str, name: &str) -> impl Iterator<Item = &'a str> {
    listing
        .split(&format!("\n== {name}\n"))
        .nth(1)
        .and_then(|s| s.split("\n== ").next())
        .unwrap_or("")
        .lines()
        .filter_map(|l| l.split_whitespace().next())
}

/// Whether the ipvs listing ([`rules`]) serves ClusterIP `ip`: a virtual server, the
/// address in [`IPVS_BOUND_SET`], and an `ip,proto:port` of it in [`IPVS_CLUSTER_IP_SET`].
fn ipvs_frontend(listing: &str, ip: Ipv4Addr) -> bool {
    let table = listing.split("\n== ").next().unwrap_or("");
    let ip_text = ip.to_string();
    let allowed = format!("{ip_text},");
    table.contains(&format!(" {:08X}:", u32::from(ip)))
        && listed_members(listing, IPVS_BOUND_SET).any(|m| m == ip_text)
        && listed_members(listing, IPVS_CLUSTER_IP_SET).any(|m| m.starts_with(&allowed))
}

/// kube-proxy's rules as text, listed in the node namespace (ipvs: the kernel's table of
/// virtual servers, /proc/net/ip_vs, as seen from there, then the members of its sets
/// [`IPVS_BOUND_SET`] and [`IPVS_CLUSTER_IP_SET`], each after a `== NAME` line).
fn rules(node: &str, mode: ProxyMode) -> Result<String, LabError> {
    if mode == ProxyMode::Ipvs {
        let mut text = netns::in_netns(node, || {
            std::fs::read_to_string("/proc/thread-self/net/ip_vs").unwrap_or_default()
        })?;
        for set in [IPVS_BOUND_SET, IPVS_CLUSTER_IP_SET] {
            // Before kube-proxy's first sync the sets do not exist: nothing is served yet.
            let listed = netns::listing(node, "ipset", &["list", set])?;
            let members = match listed.success {
                true => listed.stdout,
                false => String::new(),
            };
            text.push_str(&format!("\n== {set}\n{members}"));
        }
        return Ok(text);
    }
    let (program, args): (&str, &[&str]) = match mode {
        ProxyMode::Nftables => ("nft", &["list", "table", "ip", "kube-proxy"]),
        _ => ("iptables-save", &["-t", "nat"]),
    };
    let out = netns::listing(node, program, args)?;
    // Before its first sync kube-proxy's nftables table does not exist yet.
    Ok(match out.success {
        true => out.stdout,
        false => String::new(),
    })
}

fn check_alive(dir: &LabDir, state: &LabState) -> Result<(), LabError> {
    match &state.proxy {
        Some(proxy) if !netns::alive(proxy.pid) => Err(not_ready(dir, "it exited")),
        _ => Ok(()),
    }
}

fn not_ready(dir: &LabDir, reason: &str) -> LabError {
    netns::not_ready("kube-proxy", reason, &dir.proxy_log())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipvs_cluster_ip_is_served_once_bound() {
        let table = "TCP  0A600005:1F90 rr\n  -> 0A0A0003:1F90      Masq    1      0          0\n";
        let ip = Ipv4Addr::new(10, 96, 0, 5);
        let listing = |bound: &str, allowed: &str| {
            format!("{table}\n== {IPVS_BOUND_SET}\nName: KUBE-IPVS-IPS\nMembers:\n{bound}\n== {IPVS_CLUSTER_IP_SET}\nName: KUBE-CLUSTER-IP\nMembers:\n{allowed}")
        };
        assert!(!ipvs_frontend(&listing("", ""), ip));
        assert!(
            !ipvs_frontend(&listing("10.96.0.5\n", ""), ip),
            "bound, not yet allowed: KUBE-IPVS-FILTER rejects it"
        );
        assert!(ipvs_frontend(
            &listing("10.96.0.5\n", "10.96.0.5,tcp:8080\n"),
            ip
        ));
        assert!(
            !ipvs_frontend(
                &listing("10.96.0.10\n", "10.96.0.10,tcp:80\n"),
                Ipv4Addr::new(10, 96, 0, 10)
            ),
            "no virtual server"
        );
    }

    #[test]
    fn an_ipvs_real_server_at_weight_zero_is_not_serving() {
        let table = "IP Virtual Server version 1.2.1 (size=4096)
Prot LocalAddress:Port Scheduler Flags
  -> RemoteAddress:Port Forward Weight ActiveConn InActConn
TCP  0A600005:1F90 rr
  -> 0A0A0003:1F90      Masq    1      0          0
  -> 0A0A0004:1F90      Masq    0      0          2
";
        assert!(ipvs_serves(table, Ipv4Addr::new(10, 10, 0, 3), 8080));
        assert!(!ipvs_serves(table, Ipv4Addr::new(10, 10, 0, 4), 8080));
        assert!(!ipvs_serves(table, Ipv4Addr::new(10, 10, 0, 3), 80));
        assert!(!ipvs_serves(table, Ipv4Addr::new(10, 96, 0, 5), 8080));
    }
}
