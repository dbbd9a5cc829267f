//! The hook floor: a program that does nothing (returns TC_ACT_OK) at the hooks where
//! weir's eBPF dataplane attaches its classifiers (a pod's host-side interface, TCX
//! ingress and egress). Measured beside no enforcement and weir, it shows how much of
//! eBPF's per-packet cost is the hook itself rather than weir's lookups.
//!
//! Loaded and attached with the raw `bpf(2)` calls: the program is two instructions, and
//! the bench must not depend on weir's own loader for the floor it measures weir against.
//! The links live as long as [`NoopHooks`]: closing them detaches the program.
use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd};

use anyhow::{bail, Context, Result};

use super::netns::Netns;

const BPF_PROG_LOAD: i64 = 5;
const BPF_LINK_CREATE: i64 = 28;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;

/// `r0 = 0 (TC_ACT_OK); exit`, as `struct bpf_insn`s.
const PROGRAM: [[u8; 8]; 2] = [
    [0xb7, 0, 0, 0, 0, 0, 0, 0], // BPF_ALU64 | BPF_MOV | BPF_K, dst r0, imm 0
    [0x95, 0, 0, 0, 0, 0, 0, 0], // BPF_JMP | BPF_EXIT
];

/// A no-op program attached at TCX ingress and egress of some interfaces.
pub struct NoopHooks {
    _links: Vec<OwnedFd>,
}

fn bpf(cmd: i64, attr: &mut [u8]) -> std::io::Result<OwnedFd> {
    // SAFETY: attr is a valid, writable bpf_attr buffer of the given size; both commands
    // used here return a new file descriptor on success, which we then own.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: rc is a file descriptor the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

impl NoopHooks {
    /// Attaches the no-op program to each of `interfaces` in `node`, on both TCX hooks.
    pub fn attach(node: &Netns, interfaces: &[&str]) -> Result<Self> {
        let program: Vec<u8> = PROGRAM.concat();
        let license = CString::new("GPL")?;
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SCHED_CLS.to_ne_bytes());
        attr[4..8].copy_from_slice(&(PROGRAM.len() as u32).to_ne_bytes());
        attr[8..16].copy_from_slice(&(program.as_ptr() as u64).to_ne_bytes());
        attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
        attr[48..52].copy_from_slice(b"noop");
        let prog = bpf(BPF_PROG_LOAD, &mut attr).context("loading the no-op program")?;
        let prog_fd = std::os::fd::AsRawFd::as_raw_fd(&prog) as u32;
        let links = node.run(|| {
            let mut links = Vec::new();
            for name in interfaces {
                let c = CString::new(*name)?;
                // SAFETY: a valid NUL-terminated string.
                let ifindex = unsafe { libc::if_nametoindex(c.as_ptr()) };
                if ifindex == 0 {
                    bail!("no interface {name} in {}", node.name());
                }
                for (hook, attach_type) in
                    [("ingress", BPF_TCX_INGRESS), ("egress", BPF_TCX_EGRESS)]
                {
                    let mut attr = [0u8; 64];
                    attr[0..4].copy_from_slice(&prog_fd.to_ne_bytes());
                    attr[4..8].copy_from_slice(&ifindex.to_ne_bytes());
                    attr[8..12].copy_from_slice(&attach_type.to_ne_bytes());
                    let link = bpf(BPF_LINK_CREATE, &mut attr).with_context(|| {
                        format!("attaching the no-op program to {name} (TCX {hook}; Linux 6.6+)")
                    })?;
                    links.push(link);
                }
            }
            Ok(links)
        })?;
        Ok(NoopHooks { _links: links })
    }
}
