//! The real [`Backends`]: the two dataplanes of this crate and the shared tolerant reset,
//! in the current network namespace.

use std::path::PathBuf;
use std::time::Duration;

use super::enforcer::{Backends, Cleanup, CleanupReport};
use super::select::EbpfUnavailable;
use crate::dataplane::ebpf::{self, AttachMode, EbpfConfig, EbpfDataplane};
use crate::dataplane::iptables::{IptablesConfig, IptablesDataplane};
use crate::dataplane::new_pods::NewPodIsolation;
use crate::dataplane::{Dataplane, DataplaneError, DataplaneKind};
use crate::netfilter::backend::Backend;
use crate::reset::{self, AzureNpm, ResetOptions, ResetReport};

pub struct NodeBackends {
    bpf_root: PathBuf,
    new_pods: NewPodIsolation,
    pod_netns_dir: PathBuf,
    /// None: TCX where the kernel has it.
    attach_mode: Option<AttachMode>,
    /// None: detected.
    iptables_backend: Option<Backend>,
    /// Entries of the IDENTITY trie (`--ebpf-identity-entries`).
    identity_entries: u32,
    /// Entries of the SERVICE hash (`--ebpf-service-entries`).
    service_entries: u32,
    /// The eBPF programs loading while the cluster is listed ([`NodeBackends::preload_ebpf`]).
    preload: std::sync::Mutex<Option<ebpf::Preload>>,
}

impl NodeBackends {
    pub fn new(bpf_root: PathBuf) -> Self {
        NodeBackends {
            bpf_root,
            new_pods: NewPodIsolation::default(),
            pod_netns_dir: crate::dataplane::pod_ports::DEFAULT_POD_NETNS_DIR.into(),
            attach_mode: None,
            iptables_backend: None,
            identity_entries: ebpf::DEFAULT_IDENTITY_ENTRIES,
            service_entries: ebpf::DEFAULT_SERVICE_ENTRIES,
            preload: std::sync::Mutex::new(None),
        }
    }

    /// Starts loading the eBPF programs now, on a node's first start (an empty pin root),
    /// so that the verifier runs while the cluster is listed; the eBPF dataplane built
    /// later takes them. See [`ebpf::Preload`].
    pub fn preload_ebpf(&self) {
        let preload = ebpf::Preload::start(&self.ebpf_config());
        *self.preload.lock().unwrap_or_else(|e| e.into_inner()) = preload;
    }

    fn ebpf_config(&self) -> EbpfConfig {
        EbpfConfig {
            pin_root: self.bpf_root.clone(),
            new_pods: self.new_pods.clone(),
            pod_netns_dir: self.pod_netns_dir.clone(),
            attach_mode: self.attach_mode,
            iptables_backend: self.iptables_backend,
            identity_entries: self.identity_entries,
            service_entries: self.service_entries,
            ..Default::default()
        }
    }

    /// `--ebpf-attach` and `--iptables-backend`: None chooses by the kernel and the node.
    pub fn with_variants(
        mut self,
        attach_mode: Option<AttachMode>,
        iptables_backend: Option<Backend>,
    ) -> Self {
        self.attach_mode = attach_mode;
        self.iptables_backend = iptables_backend;
        self
    }

    /// `--ebpf-identity-entries`.
    pub fn with_identity_entries(mut self, entries: u32) -> Self {
        self.identity_entries = entries;
        self
    }

    /// `--ebpf-service-entries`.
    pub fn with_service_entries(mut self, entries: u32) -> Self {
        self.service_entries = entries;
        self
    }

    /// Where pods' network namespaces are (bridge ports are found through them).
    pub fn with_pod_netns_dir(mut self, dir: PathBuf) -> Self {
        self.pod_netns_dir = dir;
        self
    }

    /// How pod interfaces are isolated before their endpoint is programmed.
    pub fn with_new_pods(mut self, new_pods: NewPodIsolation) -> Self {
        self.new_pods = new_pods;
        self
    }
}

impl From<ResetReport> for CleanupReport {
    fn from(r: ResetReport) -> Self {
        CleanupReport {
            removed: r.removed_iptables.len()
                + r.destroyed_sets.len()
                + r.detached_filters.len()
                + r.removed_pins.len(),
            undeletable: r.undeletable_sets.clone(),
            errors: r.errors,
            duration: Duration::from_secs_f64(r.duration_ms.max(0.0) / 1000.0),
        }
    }
}

impl NodeBackends {
    /// The node's other rules leave the eBPF dataplane's packet mark bits alone (see
    /// [`crate::netfilter::marks`]); weir's chains and Azure NPM's, which the start-up
    /// cleanup removes, do not count.
    fn ebpf_mark_bits_free(&self) -> Result<(), crate::netfilter::marks::MarkBitsTaken> {
        let backend = self
            .iptables_backend
            .unwrap_or_else(crate::netfilter::backend::detect);
        crate::netfilter::marks::check_ebpf_bits(backend, &|chain| {
            crate::netfilter::is_weirs_chain(chain)
                || chain.starts_with(reset::owners::NPM_CHAIN_PREFIX)
        })
    }
}

impl Backends for NodeBackends {
    fn probe_ebpf(&self) -> Result<(), EbpfUnavailable> {
        ebpf::probe()?;
        Ok(self.ebpf_mark_bits_free()?)
    }

    fn probe_ebpf_before_build(&self) -> Result<(), EbpfUnavailable> {
        ebpf::probe_kernel()?;
        Ok(self.ebpf_mark_bits_free()?)
    }

    fn build(&self, kind: DataplaneKind) -> Result<Box<dyn Dataplane>, DataplaneError> {
        Ok(match kind {
            DataplaneKind::Ebpf => {
                let preload = self
                    .preload
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                Box::new(EbpfDataplane::with_preload(self.ebpf_config(), preload)?)
            }
            DataplaneKind::Iptables => Box::new(IptablesDataplane::new(IptablesConfig {
                new_pods: self.new_pods.clone(),
                pod_netns_dir: self.pod_netns_dir.clone(),
                backend: self.iptables_backend,
            })?),
            DataplaneKind::None => Box::<crate::dataplane::none::NoneDataplane>::default(),
        })
    }

    /// Removes one dataplane's state and/or Azure NPM's. NPM's chains and sets go even
    /// while weir's iptables dataplane enforces: reset then leaves weir's own alone.
    fn cleanup(&self, what: &Cleanup) -> CleanupReport {
        let options = ResetOptions {
            iptables: what.dataplane == Some(DataplaneKind::Iptables),
            ebpf: what.dataplane == Some(DataplaneKind::Ebpf),
            bpf_root: self.bpf_root.clone(),
            azure_npm: if what.azure_npm {
                AzureNpm::IfPresent
            } else {
                AzureNpm::Leave
            },
            dry_run: false,
        };
        reset::reset(&options).into()
    }

    fn retry_sets(&self, names: &[String]) -> CleanupReport {
        let started = std::time::Instant::now();
        let outcome = reset::retry_undeletable(names);
        CleanupReport {
            removed: outcome.destroyed.len(),
            undeletable: outcome.undeletable,
            errors: outcome.errors,
            duration: started.elapsed(),
        }
    }
}
