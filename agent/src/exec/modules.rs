//! Loading kernel modules, and naming the one a failed tool run points at. When a module
//! cannot be loaded the tools say little ("ipset: Cannot open session to kernel", "Unknown
//! device type"), so a failed run that points at a module gets a line naming it and why
//! it is missing.
use std::time::Duration;

use super::ExecError;
use crate::kernel::{module_present, modules_dir};

/// How long `modprobe` may take.
const MODPROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The module a failed run of `program args` points at, read from its stderr.
pub fn missing_module(program: &str, args: &[&str], stderr: &str) -> Option<String> {
    let quoted = |after: &str| -> Option<String> {
        let rest = stderr.split(after).nth(1)?;
        let end = rest.find(['\'', '`', '"'])?;
        Some(rest[..end].to_lowercase())
    };
    // Without ip_set the tool says "Cannot open session to kernel" or, when the netlink
    // family is there but not the module, "Kernel error received: Invalid argument".
    if stderr.contains("Cannot open session to kernel")
        || (program == "ipset" && !module_present("ip_set"))
    {
        return Some("ip_set".into());
    }
    if stderr.contains("Failed to initialize nft: Protocol not supported") {
        return Some("nf_tables".into());
    }
    if stderr.contains("Unknown device type") {
        let kind = args.iter().skip_while(|a| **a != "type").nth(1)?;
        return Some(kind.to_string());
    }
    if stderr.contains("Specified qdisc kind is unknown") {
        let kind = args.iter().find(|a| ["clsact", "ingress"].contains(a))?;
        return Some(format!(
            "sch_{}",
            if *kind == "clsact" { "ingress" } else { kind }
        ));
    }
    if let Some(m) = quoted("Couldn't load match `") {
        return Some(format!("xt_{m}"));
    }
    if let Some(t) = quoted("Couldn't load target `") {
        return Some(format!("xt_{t}"));
    }
    if let Some(table) = quoted("can't initialize iptables table `")
        .or_else(|| quoted("can't initialize ip6tables table `"))
    {
        let family = if program.starts_with("ip6") {
            "ip6"
        } else {
            "ip"
        };
        return Some(format!("{family}table_{table}"));
    }
    None
}

/// Why `module` is not in the kernel: its modules are not installed, modprobe refuses, or
/// it loads now (a race with its first use, or an autoload that was not attempted).
pub fn why_missing(module: &str) -> String {
    let dir = modules_dir();
    if !dir.exists() {
        return format!(
            "kernel module {module} is not loaded, and this kernel's modules are not installed \
             ({} does not exist)",
            dir.display()
        );
    }
    match modprobe(module) {
        Ok(()) => format!(
            "kernel module {module} was not loaded; `modprobe {module}` loaded it just now, so \
             a retry should work"
        ),
        Err(why) => format!("kernel module {module} cannot be loaded: {why}"),
    }
}

/// A kernel module that could not be loaded: the text says why (see [`why_missing`]),
/// the source is the first `modprobe`'s failure.
#[derive(Debug, thiserror::Error)]
#[error("{why}")]
pub struct ModuleError {
    pub module: String,
    why: String,
    #[source]
    source: ModprobeError,
}

/// `modprobe MODULE` failed.
#[derive(Debug, thiserror::Error)]
pub enum ModprobeError {
    #[error("`modprobe {module}`: {stderr}")]
    Refused { module: String, stderr: String },
    #[error(transparent)]
    Run(#[from] ExecError),
}

/// Loads `module` (as kubelet does for br_netfilter); the error says why it cannot be.
pub fn load(module: &str) -> Result<(), ModuleError> {
    modprobe(module).map_err(|source| ModuleError {
        module: module.to_string(),
        why: why_missing(module),
        source,
    })
}

fn modprobe(module: &str) -> Result<(), ModprobeError> {
    let out = super::run_with_timeout("modprobe", &[module], None, MODPROBE_TIMEOUT)?;
    if out.success {
        return Ok(());
    }
    Err(ModprobeError::Refused {
        module: module.to_string(),
        stderr: out.stderr.trim().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::missing_module;

    #[test]
    fn tools_refusals_name_their_module() {
        let cases: &[(&str, &[&str], &str, &str)] = &[
            (
                "ipset",
                &["restore"],
                "ipset v7.17: Cannot open session to kernel.\n",
                "ip_set",
            ),
            (
                "ip",
                &["link", "add", "a", "type", "veth", "peer", "name", "b"],
                "Error: Unknown device type.\n",
                "veth",
            ),
            (
                "tc",
                &["qdisc", "add", "dev", "x", "clsact"],
                "Error: Specified qdisc kind is unknown.\n",
                "sch_ingress",
            ),
            (
                "iptables-restore",
                &["-w"],
                "Warning: Extension set revision 0 not supported, missing kernel module?\n\
                 iptables-restore v1.8.9 (legacy): Couldn't load match `set':No such file or directory\n",
                "xt_set",
            ),
            (
                "ip6tables-restore",
                &[],
                "ip6tables-restore v1.8.9 (legacy): can't initialize ip6tables table `mangle': Table does not exist (do you need to insmod?)\n",
                "ip6table_mangle",
            ),
            (
                "nft",
                &["-f", "-"],
                "Failed to initialize nft: Protocol not supported\n",
                "nf_tables",
            ),
        ];
        for (program, args, stderr, module) in cases {
            assert_eq!(
                missing_module(program, args, stderr).as_deref(),
                Some(*module),
                "{program} {args:?}: {stderr}"
            );
        }
        assert_eq!(
            missing_module("ip", &["link"], "Error: permission denied"),
            None
        );
    }
}
