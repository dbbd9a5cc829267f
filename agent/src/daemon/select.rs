//! Which dataplane this node runs: the node label `weir.io/dataplane` (or the flag when
//! the node has no label) asks for one; the kernel decides whether eBPF can be had.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::dataplane::DataplaneKind;

/// The node label that selects the dataplane.
pub const DATAPLANE_LABEL: &str = "weir.io/dataplane";

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DataplaneChoice {
    Ebpf,
    Iptables,
    /// eBPF when the kernel supports it, iptables otherwise.
    #[default]
    Auto,
    /// For benchmarks: watches, compiles and reports status, programs no kernel state
    /// (and removes none). Never taken from the node label: a label cannot turn a node's
    /// enforcement off.
    None,
}

impl fmt::Display for DataplaneChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DataplaneChoice::Ebpf => "ebpf",
            DataplaneChoice::Iptables => "iptables",
            DataplaneChoice::Auto => "auto",
            DataplaneChoice::None => "none",
        })
    }
}

/// A node's dataplane label value that is not a choice.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("label {DATAPLANE_LABEL}={0:?} is not one of ebpf, iptables, auto")]
pub struct LabelValueError(pub String);

impl FromStr for DataplaneChoice {
    type Err = LabelValueError;
    fn from_str(s: &str) -> Result<Self, LabelValueError> {
        match s {
            "ebpf" => Ok(DataplaneChoice::Ebpf),
            "iptables" => Ok(DataplaneChoice::Iptables),
            "auto" => Ok(DataplaneChoice::Auto),
            other => Err(LabelValueError(other.to_string())),
        }
    }
}

/// The choice a node's labels make, `None` when the label is absent.
pub fn choice_from_labels(
    labels: Option<&weir_policy::model::Labels>,
) -> Option<Result<DataplaneChoice, LabelValueError>> {
    labels
        .and_then(|l| l.get(DATAPLANE_LABEL))
        .map(|v| v.parse())
}

/// The dataplane that runs, and why it is not the one asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Effective {
    pub kind: DataplaneKind,
    /// Why `kind` is not the one asked for, when it is not.
    pub fallback: Option<Fallback>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fallback {
    /// One of a few values, for the metric's label.
    pub cause: FallbackCause,
    /// In words, for the status, the node annotation and the log.
    pub reason: String,
}

impl Effective {
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback.as_ref().map(|f| f.reason.as_str())
    }
}

/// Why the eBPF dataplane was not used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FallbackCause {
    /// The kernel probe said no (no BTF, too old, no clsact, not root).
    EbpfUnavailable,
    /// The probe passed but loading or attaching the programs failed (the verifier).
    EbpfStartFailed,
}

impl FallbackCause {
    pub const ALL: [FallbackCause; 2] = [
        FallbackCause::EbpfUnavailable,
        FallbackCause::EbpfStartFailed,
    ];

    pub fn label(self) -> &'static str {
        match self {
            FallbackCause::EbpfUnavailable => "ebpf_unavailable",
            FallbackCause::EbpfStartFailed => "ebpf_start_failed",
        }
    }
}

/// Why the eBPF dataplane cannot run on this node.
#[derive(Debug, thiserror::Error)]
pub enum EbpfUnavailable {
    /// The kernel lacks what the programs need, or the verifier refuses them.
    #[error(transparent)]
    Kernel(#[from] crate::dataplane::ebpf::ProbeError),
    /// Another agent's rules use the packet mark bits the programs use.
    #[error(transparent)]
    MarkBits(#[from] crate::netfilter::marks::MarkBitsTaken),
}

/// Resolves a choice against the kernel. An explicit `ebpf` on a kernel that cannot run
/// the programs falls back to iptables as well: enforcing something beats enforcing nothing.
pub fn resolve(
    choice: DataplaneChoice,
    probe_ebpf: impl FnOnce() -> Result<(), EbpfUnavailable>,
) -> Effective {
    match choice {
        DataplaneChoice::None => Effective {
            kind: DataplaneKind::None,
            fallback: None,
        },
        DataplaneChoice::Iptables => Effective {
            kind: DataplaneKind::Iptables,
            fallback: None,
        },
        DataplaneChoice::Ebpf | DataplaneChoice::Auto => match probe_ebpf() {
            Ok(()) => Effective {
                kind: DataplaneKind::Ebpf,
                fallback: None,
            },
            Err(why) => Effective {
                kind: DataplaneKind::Iptables,
                fallback: Some(Fallback {
                    cause: FallbackCause::EbpfUnavailable,
                    reason: format!("{choice}: eBPF unavailable: {why}"),
                }),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_prefers_ebpf_and_falls_back_with_the_reason() {
        assert_eq!(
            resolve(DataplaneChoice::Auto, || Ok(())).kind,
            DataplaneKind::Ebpf
        );
        let lacks = |map_type| Err(crate::dataplane::ebpf::ProbeError::NoMapType(map_type).into());
        let e = resolve(DataplaneChoice::Auto, || lacks("RINGBUF"));
        assert_eq!(e.kind, DataplaneKind::Iptables);
        assert!(e
            .fallback_reason()
            .unwrap()
            .contains("eBPF unavailable: BPF map type RINGBUF is not supported"));
        let e = resolve(DataplaneChoice::Ebpf, || lacks("LPM_TRIE"));
        assert_eq!(e.kind, DataplaneKind::Iptables);
        let e = resolve(DataplaneChoice::Iptables, || {
            panic!("iptables needs no probe")
        });
        assert_eq!(
            e,
            Effective {
                kind: DataplaneKind::Iptables,
                fallback: None,
            }
        );
        let e = resolve(DataplaneChoice::None, || panic!("none needs no probe"));
        assert_eq!(e.kind, DataplaneKind::None);
        assert!(e.fallback.is_none());
    }

    #[test]
    fn labels_parse_and_bad_values_are_named() {
        let l = weir_policy::model::Labels::default();
        assert!(choice_from_labels(Some(&l)).is_none());
        let l = l.with(DATAPLANE_LABEL, "iptables");
        assert_eq!(
            choice_from_labels(Some(&l)),
            Some(Ok(DataplaneChoice::Iptables))
        );
        let l = l.with(DATAPLANE_LABEL, "nft");
        let err = choice_from_labels(Some(&l))
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"nft\"") && err.contains(DATAPLANE_LABEL));
        // The benchmarks' dataplane is a flag only: a label cannot switch enforcement off.
        let l = l.with(DATAPLANE_LABEL, "none");
        assert!(choice_from_labels(Some(&l)).unwrap().is_err());
    }
}
