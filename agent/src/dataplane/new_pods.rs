//! New pods are isolated from their first packet. A pod's host-side interface appears (CNI
//! ADD) before the agent learns the pod's address from the API server; until its endpoint
//! is programmed, traffic from and to an interface whose name marks it as a pod interface
//! is dropped in both directions, on both dataplanes:
//!
//! - eBPF: a netlink watch of new links attaches the programs with an ENDPOINT entry that
//!   isolates both directions and has no rules (traffic with the node's own addresses
//!   still passes, as for every isolated pod); the endpoint's real entry replaces it.
//! - iptables: at the end of `WEIR-FILTER`, traffic in from or out to such an interface
//!   whose pod address is not one of the programmed endpoints' is dropped.
//!
//! hostNetwork pods have no pod interface and are never affected. Interfaces are
//! recognised by name prefix (Calico `cali`, Cilium and the lab `lxc`, AWS VPC CNI `eni`,
//! Azure CNI `azv`); bridge CNIs (flannel, kindnet: `veth`) must name theirs, since Docker's
//! interfaces share that prefix. Bootstrap pods that must talk before the agent can learn
//! them are exempted by interface name.

use serde::{Deserialize, Serialize};

/// Host-side interface name prefixes of pod interfaces, by default.
pub const DEFAULT_POD_INTERFACE_PREFIXES: [&str; 4] = ["lxc", "cali", "eni", "azv"];

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewPodIsolation {
    /// Interface name prefixes that mark a pod interface; empty: isolation is off.
    pub prefixes: Vec<String>,
    /// Interfaces never isolated: exact names, or prefixes written `NAME*`.
    pub exempt: Vec<String>,
}

impl Default for NewPodIsolation {
    fn default() -> Self {
        NewPodIsolation {
            prefixes: DEFAULT_POD_INTERFACE_PREFIXES
                .iter()
                .map(|p| p.to_string())
                .collect(),
            exempt: Vec::new(),
        }
    }
}

/// An interface name of the new-pod isolation that iptables could not express.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NewPodsConfigError {
    #[error("pod interface prefix {0:?}: 1 to 15 characters of an interface name")]
    Prefix(String),
    #[error("exempt interface {0:?}: an interface name, or a prefix followed by `*`")]
    Exempt(String),
}

impl NewPodIsolation {
    pub fn off() -> Self {
        NewPodIsolation {
            prefixes: Vec::new(),
            exempt: Vec::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.prefixes.is_empty()
    }

    /// Whether an interface of this name is isolated until its endpoint is programmed.
    pub fn applies_to(&self, ifname: &str) -> bool {
        self.prefixes
            .iter()
            .any(|p| !p.is_empty() && ifname.starts_with(p.as_str()))
            && !self.exempt.iter().any(|e| exempt_matches(e, ifname))
    }

    /// Rejects what iptables could not express (and names longer than an interface's).
    pub fn validate(&self) -> Result<(), NewPodsConfigError> {
        for p in &self.prefixes {
            if p.is_empty() || p.len() > 15 || !valid_ifname_chars(p) {
                return Err(NewPodsConfigError::Prefix(p.clone()));
            }
        }
        for e in &self.exempt {
            let stem = e.strip_suffix('*').unwrap_or(e);
            if stem.is_empty() || stem.len() > 15 || !valid_ifname_chars(stem) {
                return Err(NewPodsConfigError::Exempt(e.clone()));
            }
        }
        Ok(())
    }

    /// iptables `-i`/`-o` arguments for the exempt interfaces (`NAME*` becomes `NAME+`).
    pub fn exempt_iptables(&self) -> Vec<String> {
        self.exempt
            .iter()
            .map(|e| match e.strip_suffix('*') {
                Some(stem) => format!("{stem}+"),
                None => e.clone(),
            })
            .collect()
    }
}

fn valid_ifname_chars(s: &str) -> bool {
    s.chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@'))
}

fn exempt_matches(pattern: &str, ifname: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(stem) => ifname.starts_with(stem),
        None => ifname == pattern,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_and_exemptions() {
        let iso = NewPodIsolation {
            prefixes: vec!["lxc".into(), "cali".into()],
            exempt: vec!["cali12*".into(), "lxcdns".into()],
        };
        assert!(iso.validate().is_ok());
        assert!(iso.applies_to("lxc0123"));
        assert!(iso.applies_to("cali9"));
        assert!(!iso.applies_to("cali1234"));
        assert!(!iso.applies_to("lxcdns"));
        assert!(iso.applies_to("lxcdns2"));
        assert!(!iso.applies_to("eth0"));
        assert_eq!(iso.exempt_iptables(), ["cali12+", "lxcdns"]);
        assert!(!NewPodIsolation::off().applies_to("lxc1"));
        assert!(NewPodIsolation {
            prefixes: vec!["a b".into()],
            exempt: vec![]
        }
        .validate()
        .is_err());
    }
}
