//! Can this kernel run the programs? Checks the kernel version and map/program types,
//! then has the verifier load the real programs (nothing is attached or kept).

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{is_map_supported, is_program_supported},
    util::KernelVersion,
    EbpfLoader,
};
use weir_common::program_names;

use super::pins::PinLayout;

/// The oldest kernel the programs are built for.
pub const MIN_KERNEL: (u8, u8) = (5, 10);

/// `Ok` when the eBPF dataplane can run here; otherwise why not, for logs and status.
pub fn probe() -> Result<(), String> {
    probe_kernel()?;
    verifier_accepts()
}

/// [`probe`] without loading the programs: the kernel's version, program and map types.
/// What the agent checks before building the dataplane, whose own load of the programs
/// gives the verifier's verdict (loading them twice cost the cold start 0.7 s).
pub fn probe_kernel() -> Result<(), String> {
    let v = KernelVersion::current().map_err(|e| format!("kernel version unknown: {e}"))?;
    if v < KernelVersion::new(MIN_KERNEL.0, MIN_KERNEL.1, 0) {
        return Err(format!(
            "kernel {v} is older than {}.{}",
            MIN_KERNEL.0, MIN_KERNEL.1
        ));
    }
    if !is_program_supported(ProgramType::SchedClassifier).map_err(|e| e.to_string())? {
        return Err("BPF_PROG_TYPE_SCHED_CLS is not supported".into());
    }
    for (t, name) in [
        (MapType::LpmTrie, "LPM_TRIE"),
        (MapType::LruHash, "LRU_HASH"),
        (MapType::PerCpuArray, "PERCPU_ARRAY"),
        (MapType::RingBuf, "RINGBUF"),
    ] {
        if !is_map_supported(t).map_err(|e| format!("probe map {name}: {e}"))? {
            return Err(format!("BPF map type {name} is not supported"));
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
fn verifier_accepts() -> Result<(), String> {
    let memlock = super::loader::raise_memlock_limit();
    let scratch = PinLayout::new(format!("/sys/fs/bpf/weir-probe-{}", std::process::id()));
    scratch.prepare().map_err(|e| e.to_string())?;
    let result = (|| {
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(scratch.maps())
            .load(super::loader::OBJECT)
            .map_err(|e| {
                format!(
                    "load eBPF object: {}",
                    super::loader::load_error(&e, &memlock)
                )
            })?;
        for name in program_names::ALL {
            super::loader::load_program(&mut ebpf, name).map_err(|e| match e {
                None => format!("program {name} missing"),
                Some(e) => format!(
                    "verifier rejected {name}: {}",
                    super::loader::verifier_message(&e)
                ),
            })?;
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&scratch.root);
    result
}
