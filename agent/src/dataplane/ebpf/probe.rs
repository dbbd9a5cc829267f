//! Can this kernel run the programs? Checks the kernel version and map/program types,
//! then has the verifier load the real programs (nothing is attached or kept).

use aya::{
    maps::MapType,
    programs::{ProgramError, ProgramType},
    sys::{is_map_supported, is_program_supported, SyscallError},
    util::KernelVersion,
    EbpfLoader,
};
use weir_common::program_names;

use super::pins::PinLayout;
use crate::dataplane::DataplaneError;

/// The oldest kernel the programs are built for.
pub const MIN_KERNEL: (u8, u8) = (5, 10);

/// Why this kernel cannot run the programs.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// aya's version reader returns an error type that cannot be named: its text is kept.
    #[error("kernel version unknown: {0}")]
    KernelVersion(String),
    #[error("kernel {have} is older than {}.{}", MIN_KERNEL.0, MIN_KERNEL.1)]
    TooOld { have: KernelVersion },
    /// The probe for the classifier program type itself failed.
    #[error(transparent)]
    ProgramTypeProbe(Box<ProgramError>),
    #[error("BPF_PROG_TYPE_SCHED_CLS is not supported")]
    NoSchedCls,
    #[error("probe map {name}: {source}")]
    MapTypeProbe {
        name: &'static str,
        #[source]
        source: Box<SyscallError>,
    },
    #[error("BPF map type {0} is not supported")]
    NoMapType(&'static str),
    /// The scratch pin directory the verifier check loads into.
    #[error(transparent)]
    Scratch(Box<DataplaneError>),
    /// `detail` adds the source chain and the RLIMIT_MEMLOCK hint where it applies.
    #[error("load eBPF object: {detail}")]
    Load {
        detail: String,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error("program {0} missing")]
    MissingProgram(&'static str),
    #[error("verifier rejected {name}: {message}")]
    Verifier {
        name: &'static str,
        message: String,
        #[source]
        source: Box<ProgramError>,
    },
}

/// `Ok` when the eBPF dataplane can run here; otherwise why not, for logs and status.
pub fn probe() -> Result<(), ProbeError> {
    probe_kernel()?;
    verifier_accepts()
}

/// [`probe`] without loading the programs: the kernel's version, program and map types.
/// What the agent checks before building the dataplane, whose own load of the programs
/// gives the verifier's verdict (loading them twice cost the cold start 0.7 s).
pub fn probe_kernel() -> Result<(), ProbeError> {
    let v = KernelVersion::current().map_err(|e| ProbeError::KernelVersion(e.to_string()))?;
    if v < KernelVersion::new(MIN_KERNEL.0, MIN_KERNEL.1, 0) {
        return Err(ProbeError::TooOld { have: v });
    }
    if !is_program_supported(ProgramType::SchedClassifier)
        .map_err(|e| ProbeError::ProgramTypeProbe(Box::new(e)))?
    {
        return Err(ProbeError::NoSchedCls);
    }
    for (t, name) in [
        (MapType::LpmTrie, "LPM_TRIE"),
        (MapType::LruHash, "LRU_HASH"),
        (MapType::PerCpuArray, "PERCPU_ARRAY"),
        (MapType::RingBuf, "RINGBUF"),
    ] {
        if !is_map_supported(t).map_err(|e| ProbeError::MapTypeProbe {
            name,
            source: Box::new(e),
        })? {
            return Err(ProbeError::NoMapType(name));
        }
    }
    Ok(())
}

/// What the running kernel lacks that the dataplanes would use, each with the fallback
/// taken; for `weir version`.
pub fn kernel_lacks() -> Vec<String> {
    let mut lacks = Vec::new();
    if let Some(why) = super::attach::tcx_missing() {
        lacks.push(format!(
            "{why}: clsact filters over netlink are attached instead"
        ));
    }
    if let Err(why) = probe() {
        lacks.push(format!(
            "what the eBPF dataplane needs ({why}): the agent falls back to iptables"
        ));
    }
    lacks
}

/// Loads both programs with their maps pinned in a scratch directory that is removed
/// afterwards, so the real pin root is never touched.
fn verifier_accepts() -> Result<(), ProbeError> {
    let memlock = super::loader::raise_memlock_limit();
    let scratch = PinLayout::new(format!("/sys/fs/bpf/weir-probe-{}", std::process::id()));
    scratch
        .prepare()
        .map_err(|e| ProbeError::Scratch(Box::new(e)))?;
    let result = (|| {
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(scratch.maps())
            .load(super::loader::OBJECT)
            .map_err(|e| ProbeError::Load {
                detail: super::loader::load_error(&e, &memlock),
                source: Box::new(e),
            })?;
        for name in program_names::ALL {
            super::loader::load_program(&mut ebpf, name).map_err(|e| match e {
                None => ProbeError::MissingProgram(name),
                Some(e) => ProbeError::Verifier {
                    name,
                    message: super::loader::verifier_message(&e),
                    source: Box::new(e),
                },
            })?;
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&scratch.root);
    result
}
