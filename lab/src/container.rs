//! `weir-lab up --agent-image LAYOUT[:TAG]`: the lab's agent runs from weir's image under
//! runc, as the DaemonSet's pod would. The OCI runtime spec is derived from
//! deploy/daemonset.yaml itself: the container's command and args over the image's
//! entrypoint and cmd, its env (fieldRefs resolved as the kubelet does), securityContext
//! (privileged, or capabilities added and dropped), hostNetwork (the lab's node namespace
//! is joined, and the host's UTS namespace shared), its hostPath volumes and their mounts
//! (propagation and read-only as written) and its memory limit. A change to the manifest
//! that breaks the agent breaks the lab.
//!
//! The lab adds only what a cluster gives the pod some other way: its state directory (the
//! status file, the objects file, the kubeconfig that stands in for the ServiceAccount
//! token) at the same path, and the agent's lab flags after the manifest's args.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Container;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::{netns, LabError};
use weir::exec;

/// The container deploy/daemonset.yaml runs the agent in.
const CONTAINER: &str = "weir";
/// The capabilities containerd grants a container that is not privileged (before adds and
/// drops), as the DaemonSet would get them on a node.
const DEFAULT_CAPABILITIES: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];
/// Linux's capabilities by number (include/uapi/linux/capability.h).
const CAPABILITY_NAMES: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];
const RUNC_TIMEOUT: Duration = Duration::from_secs(60);
/// umoci's runtime spec for the image, kept as unpacked.
const UMOCI_CONFIG: &str = "config.umoci.json";

/// The lab's record of its agent container.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentContainer {
    /// `LAYOUT:TAG` as given.
    pub image: String,
    /// The manifest the spec is derived from.
    pub daemonset: PathBuf,
    /// The unpacked image (`rootfs/` and runc's `config.json`).
    pub bundle: PathBuf,
    /// runc's state directory (`runc --root`) and the container's id.
    pub runc_root: PathBuf,
    pub id: String,
}

/// What the lab runs the agent with, beside the manifest.
pub struct Launch<'a> {
    pub node_netns: &'a str,
    /// The Node the agent runs as (server mode). None in file mode, whose pods are on no
    /// node: an env var from spec.nodeName is then left out, so that the agent takes every
    /// pod as its own, as the lab's agent always does in file mode.
    pub node_name: Option<&'a str>,
    /// Flags after the manifest's args.
    pub args: Vec<String>,
    /// Set after the manifest's env (later wins).
    pub env: Vec<(String, String)>,
    /// Host paths bound at the same path, read-write.
    pub binds: Vec<PathBuf>,
}

/// The manifest the lab reads: deploy/daemonset.yaml of the source tree this weir-lab was
/// built from, unless `WEIR_LAB_DAEMONSET` names another.
pub fn default_daemonset() -> PathBuf {
    std::env::var_os("WEIR_LAB_DAEMONSET")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemonset.yaml"))
}

/// Unpacks `image` (an OCI layout, `PATH[:TAG]`; the tag may be left out when the layout
/// holds one image) into `dir/agent-bundle` with umoci.
pub fn prepare(
    dir: &Path,
    image: &str,
    daemonset: &Path,
    id: &str,
) -> Result<AgentContainer, LabError> {
    let (layout, tag) = layout_and_tag(image)?;
    // Both are needed before anything is built: umoci now, runc at every start.
    run("runc", &["--version"], RUNC_TIMEOUT)?;
    let bundle = dir.join("agent-bundle");
    let _ = std::fs::remove_dir_all(&bundle);
    run(
        "umoci",
        &[
            "unpack",
            "--image",
            &format!("{}:{tag}", layout.display()),
            &bundle.to_string_lossy(),
        ],
        Duration::from_secs(120),
    )?;
    // Every start derives its spec from umoci's, untouched.
    std::fs::rename(bundle.join("config.json"), bundle.join(UMOCI_CONFIG)).map_err(|e| {
        LabError::io(
            format!("keeping umoci's config.json in {}", bundle.display()),
            e,
        )
    })?;
    // Read now, so a manifest the lab cannot run is refused before anything starts.
    load_container(daemonset)?;
    Ok(AgentContainer {
        image: image.to_string(),
        daemonset: daemonset.to_path_buf(),
        bundle,
        runc_root: dir.join("runc"),
        id: format!("{id}-agent"),
    })
}

/// Writes the runtime spec and returns the `runc run` command that runs the agent in the
/// foreground (runc forwards SIGTERM to it, and exits with it).
pub fn command(c: &AgentContainer, launch: &Launch) -> Result<Command, LabError> {
    let agent = load_container(&c.daemonset)?;
    let config_path = c.bundle.join("config.json");
    let mut spec: Value = read_json(&c.bundle.join(UMOCI_CONFIG))?;
    let image_config = image_config(&c.image)?;
    apply(&mut spec, &agent, &image_config, launch, &c.daemonset)?;
    std::fs::write(
        &config_path,
        serde_json::to_vec_pretty(&spec).expect("JSON"),
    )
    .map_err(|e| LabError::io(format!("writing {}", config_path.display()), e))?;
    // A container of this id left by a killed runc would make `run` fail.
    let _ = exec::run_with_timeout(
        "runc",
        &[
            "--root",
            &c.runc_root.to_string_lossy(),
            "delete",
            "--force",
            &c.id,
        ],
        None,
        RUNC_TIMEOUT,
    );
    let mut command = Command::new("runc");
    command
        .arg("--root")
        .arg(&c.runc_root)
        .args(["run", "--bundle"])
        .arg(&c.bundle)
        .arg(&c.id);
    Ok(command)
}

/// Sends `signal` to the agent in its container (runc's own pid would only reach runc,
/// which cannot pass SIGKILL or SIGSTOP on).
pub fn signal(c: &AgentContainer, signal: i32) -> Result<(), LabError> {
    run(
        "runc",
        &[
            "--root",
            &c.runc_root.to_string_lossy(),
            "kill",
            &c.id,
            &signal.to_string(),
        ],
        RUNC_TIMEOUT,
    )
}

/// Removes the container whatever its state (a runc killed with SIGKILL leaves it).
pub fn remove(c: &AgentContainer) {
    let root = c.runc_root.to_string_lossy();
    let _ = exec::run_with_timeout(
        "runc",
        &["--root", &root, "kill", "--all", &c.id, "KILL"],
        None,
        RUNC_TIMEOUT,
    );
    let _ = exec::run_with_timeout(
        "runc",
        &["--root", &root, "delete", "--force", &c.id],
        None,
        RUNC_TIMEOUT,
    );
}

fn load_container(daemonset: &Path) -> Result<Agent, LabError> {
    let name = daemonset.display().to_string();
    let text = std::fs::read_to_string(daemonset)
        .map_err(|e| LabError::io(format!("reading {name}"), e))?;
    let ds: DaemonSet =
        serde_yaml::from_str(&text).map_err(|e| LabError::invalid(&name, e.to_string()))?;
    let spec = ds
        .spec
        .template
        .spec
        .ok_or_else(|| LabError::invalid(&name, "spec.template.spec is missing"))?;
    if spec.host_network != Some(true) {
        return Err(LabError::invalid(
            &name,
            "spec.template.spec.hostNetwork is not true: the agent must run in the node's network namespace",
        ));
    }
    let volumes = spec.volumes.unwrap_or_default();
    let container = spec
        .containers
        .into_iter()
        .find(|c| c.name == CONTAINER)
        .ok_or_else(|| LabError::invalid(&name, format!("no container named {CONTAINER}")))?;
    // Volumes travel with the container from here: only hostPath ones can be run.
    let mut host_paths = BTreeMap::new();
    for v in volumes {
        match v.host_path {
            Some(h) => {
                host_paths.insert(v.name, (h.path, h.type_.unwrap_or_default()));
            }
            None => {
                return Err(LabError::invalid(
                    &name,
                    format!(
                        "volume {}: only hostPath volumes can be run in the lab",
                        v.name
                    ),
                ))
            }
        }
    }
    for m in container.volume_mounts.iter().flatten() {
        if !host_paths.contains_key(&m.name) {
            return Err(LabError::invalid(
                &name,
                format!(
                    "container {CONTAINER}: volumeMount {} names no volume",
                    m.name
                ),
            ));
        }
    }
    Ok(Agent {
        container,
        host_paths,
    })
}

/// The DaemonSet's agent container and the host paths of its volumes (name → path, type).
struct Agent {
    container: Container,
    host_paths: BTreeMap<String, (String, String)>,
}

/// The image's entrypoint and cmd (from its config blob), which `command` and `args` replace
/// as in Kubernetes.
struct ImageConfig {
    entrypoint: Vec<String>,
    cmd: Vec<String>,
}

fn image_config(image: &str) -> Result<ImageConfig, LabError> {
    let (layout, tag) = layout_and_tag(image)?;
    let index = read_json(&layout.join("index.json"))?;
    let manifest_digest = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag.as_str())
        .and_then(|m| m["digest"].as_str())
        .ok_or_else(|| LabError::invalid(image, format!("no image tagged {tag}")))?;
    let manifest = read_json(&blob(&layout, manifest_digest))?;
    let config_digest = manifest["config"]["digest"]
        .as_str()
        .ok_or_else(|| LabError::invalid(image, "its manifest names no config"))?;
    let config = read_json(&blob(&layout, config_digest))?;
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect()
    };
    Ok(ImageConfig {
        entrypoint: strings(&config["config"]["Entrypoint"]),
        cmd: strings(&config["config"]["Cmd"]),
    })
}

fn blob(layout: &Path, digest: &str) -> PathBuf {
    let (algorithm, hex) = digest.split_once(':').unwrap_or(("sha256", digest));
    layout.join("blobs").join(algorithm).join(hex)
}

/// `PATH[:TAG]`; without a tag, the layout must hold exactly one tagged image.
fn layout_and_tag(image: &str) -> Result<(PathBuf, String), LabError> {
    if let Some((path, tag)) = image.rsplit_once(':') {
        if !tag.contains('/') && Path::new(path).join("index.json").exists() {
            return Ok((PathBuf::from(path), tag.to_string()));
        }
    }
    let layout = PathBuf::from(image);
    let index = read_json(&layout.join("index.json")).map_err(|_| {
        LabError::invalid(
            "--agent-image",
            format!("{image} is not an OCI layout (PATH[:TAG], as `cargo xtask image` writes target/image/oci)"),
        )
    })?;
    let tags: Vec<&str> = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["annotations"]["org.opencontainers.image.ref.name"].as_str())
        .collect();
    match tags[..] {
        [tag] => Ok((layout, tag.to_string())),
        _ => Err(LabError::invalid(
            "--agent-image",
            format!(
                "{image} holds {} tagged images ({}): name one as PATH:TAG",
                tags.len(),
                tags.join(", ")
            ),
        )),
    }
}

/// The runtime spec umoci wrote, made into the DaemonSet's pod.
fn apply(
    spec: &mut Value,
    agent: &Agent,
    image: &ImageConfig,
    launch: &Launch,
    daemonset: &Path,
) -> Result<(), LabError> {
    let container = &agent.container;
    let manifest = daemonset.display().to_string();
    let field = |f: &str| format!("{manifest}: container {CONTAINER}: {f}");
    // command/args replace entrypoint/cmd, as the kubelet does.
    let mut args: Vec<String> = container
        .command
        .clone()
        .unwrap_or_else(|| image.entrypoint.clone());
    args.extend(container.args.clone().unwrap_or_else(|| image.cmd.clone()));
    args.extend(launch.args.iter().cloned());
    if args.is_empty() {
        return Err(LabError::invalid(
            &manifest,
            "neither the container nor the image names a command",
        ));
    }
    let mut env: BTreeMap<String, String> = spec["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            e.as_str()?
                .split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    for e in container.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), _) => v.clone(),
            (None, Some(from)) => match from.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                Some("spec.nodeName") => match launch.node_name {
                    Some(node) => node.to_string(),
                    None => continue,
                },
                Some("metadata.name") => format!("weir-{}", launch.node_name.unwrap_or("lab")),
                Some("metadata.namespace") => "kube-system".to_string(),
                other => {
                    return Err(LabError::invalid(
                        field(&format!("env {}", e.name)),
                        format!("valueFrom {other:?} is not one the lab can resolve (spec.nodeName, metadata.name, metadata.namespace)"),
                    ))
                }
            },
            (None, None) => String::new(),
        };
        env.insert(e.name.clone(), value);
    }
    for (k, v) in &launch.env {
        env.insert(k.clone(), v.clone());
    }
    let process = &mut spec["process"];
    process["args"] = json!(args);
    process["env"] = json!(env
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>());
    process["terminal"] = json!(false);
    process["cwd"] = json!("/");
    process["user"] = json!({"uid": 0, "gid": 0});

    let security = container.security_context.clone().unwrap_or_default();
    let privileged = security.privileged == Some(true);
    let caps: Vec<String> = if privileged {
        bounding_set()
    } else {
        let caps = security.capabilities.unwrap_or_default();
        let drop: Vec<String> = caps
            .drop
            .unwrap_or_default()
            .iter()
            .map(|c| cap_name(c))
            .collect();
        let mut set: Vec<String> = match drop.iter().any(|d| d == "CAP_ALL") {
            true => Vec::new(),
            false => DEFAULT_CAPABILITIES
                .iter()
                .map(|c| c.to_string())
                .filter(|c| !drop.contains(c))
                .collect(),
        };
        for add in caps.add.unwrap_or_default() {
            let name = cap_name(&add);
            if !CAPABILITY_NAMES.iter().any(|c| format!("CAP_{c}") == name) {
                return Err(LabError::invalid(
                    field("securityContext.capabilities.add"),
                    format!("{add} is not a capability"),
                ));
            }
            if !set.contains(&name) {
                set.push(name);
            }
        }
        // A capability this host cannot grant would fail the start ("unable to apply
        // caps"), as it would on such a node; the lab runs without it and says so.
        let bounding = bounding_set();
        let (kept, lacking): (Vec<String>, Vec<String>) =
            set.into_iter().partition(|c| bounding.contains(c));
        if !lacking.is_empty() {
            eprintln!(
                "warning: {}: this host's capability bounding set lacks {}; the agent's container runs without",
                field("securityContext.capabilities.add"),
                lacking.join(", ")
            );
        }
        kept
    };
    process["capabilities"] = json!({
        "bounding": caps, "effective": caps, "permitted": caps, "ambient": caps,
    });
    process["noNewPrivileges"] = json!(security.allow_privilege_escalation == Some(false));

    let linux = &mut spec["linux"];
    // hostNetwork: the node's namespace, and the host's UTS namespace, as the kubelet does.
    let namespaces: Vec<Value> = linux["namespaces"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n["type"] != "uts" && n["type"] != "network")
        .chain([json!({"type": "network", "path": format!("/run/netns/{}", launch.node_netns)})])
        .collect();
    linux["namespaces"] = json!(namespaces);
    if privileged {
        linux["maskedPaths"] = json!([]);
        linux["readonlyPaths"] = json!([]);
        linux["resources"]["devices"] = json!([{"allow": true, "access": "rwm"}]);
    }
    if let Some(limit) = container
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
    {
        let bytes = quantity_bytes(&limit.0).ok_or_else(|| {
            LabError::invalid(
                field("resources.limits.memory"),
                format!("{:?} is not a memory quantity", limit.0),
            )
        })?;
        linux["resources"]["memory"] = json!({"limit": bytes});
    }
    // The bpffs mount is Bidirectional: mounts below the root must be able to propagate.
    linux["rootfsPropagation"] = json!("rslave");

    let mut mounts: Vec<Value> = spec["mounts"].as_array().cloned().unwrap_or_default();
    if privileged {
        // A privileged container's /sys is writable.
        for m in &mut mounts {
            if m["destination"] == "/sys" {
                m["options"] = json!(["nosuid", "noexec", "nodev"]);
            }
        }
    }
    for m in container.volume_mounts.iter().flatten() {
        let (path, kind) = &agent.host_paths[&m.name];
        let source = Path::new(path);
        match kind.as_str() {
            "DirectoryOrCreate" => std::fs::create_dir_all(source).map_err(|e| {
                LabError::io(format!("creating hostPath {path} (volume {})", m.name), e)
            })?,
            "FileOrCreate" if !source.exists() => {
                std::fs::File::create(source).map_err(|e| {
                    LabError::io(format!("creating hostPath {path} (volume {})", m.name), e)
                })?;
            }
            _ => {}
        }
        let mut options = vec!["rbind".to_string()];
        if m.read_only == Some(true) {
            options.push("ro".into());
        }
        options.push(
            match m.mount_propagation.as_deref() {
                Some("Bidirectional") => "rshared",
                Some("HostToContainer") => "rslave",
                _ => "rprivate",
            }
            .into(),
        );
        mounts.push(json!({"destination": m.mount_path, "type": "bind", "source": path, "options": options}));
    }
    for bind in &launch.binds {
        mounts.push(json!({"destination": bind, "type": "bind", "source": bind, "options": ["rbind", "rprivate"]}));
    }
    spec["mounts"] = json!(mounts);
    spec["root"] =
        json!({"path": "rootfs", "readonly": security.read_only_root_filesystem == Some(true)});
    if let Some(obj) = spec.as_object_mut() {
        obj.remove("hostname");
    }
    Ok(())
}

/// `NET_ADMIN` or `CAP_NET_ADMIN` as runc names it; `ALL` as `CAP_ALL`.
fn cap_name(c: &str) -> String {
    let c = c.to_ascii_uppercase();
    match c.starts_with("CAP_") {
        true => c,
        false => format!("CAP_{c}"),
    }
}

/// Every capability in this process's bounding set (what a privileged container gets; a
/// kernel may know fewer than runc).
pub(crate) fn bounding_set() -> Vec<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let bits = status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    CAPABILITY_NAMES
        .iter()
        .enumerate()
        .filter(|(i, _)| bits & (1 << i) != 0)
        .map(|(_, c)| format!("CAP_{c}"))
        .collect()
}

/// `256Mi`, `1G`, `1048576`: bytes.
fn quantity_bytes(q: &str) -> Option<u64> {
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (n, unit) = q.split_at(split);
    let n: u64 = n.parse().ok()?;
    let factor: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => return None,
    };
    n.checked_mul(factor)
}

fn read_json(path: &Path) -> Result<Value, LabError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| LabError::io(format!("reading {}", path.display()), e))?;
    serde_json::from_str(&text)
        .map_err(|e| LabError::invalid(path.display().to_string(), e.to_string()))
}

/// runc and umoci, through the lab's tool runner.
fn run(program: &str, args: &[&str], timeout: Duration) -> Result<(), LabError> {
    netns::tool(program, program, args, timeout).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_quantities() {
        assert_eq!(quantity_bytes("256Mi"), Some(256 << 20));
        assert_eq!(quantity_bytes("1G"), Some(1_000_000_000));
        assert_eq!(quantity_bytes("1048576"), Some(1 << 20));
        assert_eq!(quantity_bytes("1.5Gi"), None);
        assert_eq!(quantity_bytes("lots"), None);
    }

    #[test]
    fn capability_names_as_runc_spells_them() {
        assert_eq!(cap_name("NET_ADMIN"), "CAP_NET_ADMIN");
        assert_eq!(cap_name("cap_bpf"), "CAP_BPF");
        assert_eq!(CAPABILITY_NAMES[39], "BPF");
        assert_eq!(CAPABILITY_NAMES[38], "PERFMON");
    }
}
