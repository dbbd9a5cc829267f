//! The nodes' runc, through `weir-lab cluster runc`: the capabilities a container spec
//! asks for that this host's bounding set lacks are dropped from it before the real runc
//! runs, as the lab's own container mode does. Without it every pod that asks for one
//! fails ("unable to apply caps: operation not permitted"): this environment lacks
//! CAP_SYS_RESOURCE, which deploy/'s DaemonSet asks for. `cluster up` reports what is
//! dropped.
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use super::super::container::bounding_set;
use super::super::LabError;

pub const RUNC: &str = "/usr/sbin/runc";

/// What a container here cannot get of `asked`.
pub fn missing(asked: &[&str]) -> Vec<String> {
    let have = bounding_set();
    asked
        .iter()
        .filter(|c| !have.iter().any(|h| h == *c))
        .map(|c| c.to_string())
        .collect()
}

/// The script containerd runs as runc (BinaryName takes no arguments).
pub fn write_wrapper(dir: &Path, cluster_dir: &Path) -> Result<PathBuf, LabError> {
    let me = std::env::current_exe().map_err(|e| LabError::io("finding weir-lab itself", e))?;
    let path = dir.join("runc");
    let script = format!(
        "#!/bin/sh\nexec {} cluster --dir {} runc \"$@\"\n",
        me.display(),
        cluster_dir.display()
    );
    std::fs::write(&path, script)
        .map_err(|e| LabError::io(format!("writing {}", path.display()), e))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| LabError::io(format!("chmod {}", path.display()), e))?;
    Ok(path)
}

/// The value of `--flag VALUE` or `--flag=VALUE` (or `-f VALUE`) in runc's arguments.
fn flag(args: &[OsString], long: &str, short: &str) -> Option<PathBuf> {
    let args: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    for (i, a) in args.iter().enumerate() {
        if a == long || a == short {
            return args.get(i + 1).map(PathBuf::from);
        }
        if let Some(v) = a.strip_prefix(&format!("{long}=")) {
            return Some(PathBuf::from(v));
        }
    }
    None
}

/// Keeps, in every set of `caps`, only what the host's bounding set has.
fn filter(caps: &mut serde_json::Value, have: &[String]) {
    if let Some(sets) = caps.as_object_mut() {
        for set in sets.values_mut() {
            if let Some(list) = set.as_array_mut() {
                list.retain(|c| c.as_str().is_some_and(|c| have.iter().any(|h| h == c)));
            }
        }
    }
}

fn rewrite(path: &Path, pointer: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut spec: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let have = bounding_set();
    if let Some(caps) = spec.pointer_mut(pointer) {
        filter(caps, &have);
        let text = serde_json::to_string(&spec).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// Rewrites the spec `create`/`run` (the bundle's config.json) or `exec` (`--process`)
/// will read, then becomes the real runc with the same arguments.
pub fn run(args: Vec<OsString>) -> anyhow::Result<()> {
    let has = |word: &str| args.iter().any(|a| a == word);
    if has("create") || has("run") {
        let bundle = flag(&args, "--bundle", "-b").unwrap_or_else(|| PathBuf::from("."));
        rewrite(&bundle.join("config.json"), "/process/capabilities")
            .map_err(|e| anyhow::anyhow!("weir-lab cluster runc: {e}"))?;
    } else if has("exec") {
        if let Some(process) = flag(&args, "--process", "-p") {
            rewrite(&process, "/capabilities")
                .map_err(|e| anyhow::anyhow!("weir-lab cluster runc: {e}"))?;
        }
    }
    let error = std::process::Command::new(RUNC).args(&args).exec();
    Err(anyhow::anyhow!(
        "weir-lab cluster runc: exec {RUNC}: {error}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_found_in_both_spellings() {
        let args: Vec<OsString> = ["--root", "/r", "create", "--bundle", "/b", "id"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(flag(&args, "--bundle", "-b"), Some(PathBuf::from("/b")));
        let args: Vec<OsString> = ["exec", "--process=/p.json", "id"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(
            flag(&args, "--process", "-p"),
            Some(PathBuf::from("/p.json"))
        );
    }

    #[test]
    fn only_capabilities_the_host_has_are_kept() {
        let mut caps = serde_json::json!({
            "bounding": ["CAP_NET_ADMIN", "CAP_SYS_RESOURCE"],
            "effective": ["CAP_SYS_RESOURCE"],
        });
        filter(&mut caps, &["CAP_NET_ADMIN".to_string()]);
        assert_eq!(
            caps,
            serde_json::json!({ "bounding": ["CAP_NET_ADMIN"], "effective": [] })
        );
    }
}
