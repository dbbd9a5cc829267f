//! Per-packet cost of the pinned classifiers, measured with BPF_PROG_TEST_RUN (no global
//! setting such as bpf_stats_enabled is touched): enters network namespace NETNS, runs
//! PIN_ROOT's `weir_from_pod` (as if on interface FROM_IF, the sender's) and `weir_to_pod`
//! (on TO_IF, the receiver's) REPEAT times on one UDP frame SRC:40000 → DST:DPORT, and
//! prints the kernel's mean time per run.
//!
//! `weir-prog-cost NETNS PIN_ROOT FROM_IF TO_IF SRC DST DPORT REPEAT`
//!
//! The first run of each program makes its CT entry; the rest measure a packet of a
//! tracked flow (from the pod: established; to the pod: the same tuple, judged by CT or
//! policy as the programs decide).

use std::ffi::CString;
use std::net::{IpAddr, SocketAddr};

use anyhow::{bail, Context};
use weir_tests::raw;

const BPF_OBJ_GET: i64 = 7;
const BPF_PROG_TEST_RUN: i64 = 10;
/// sizeof(struct __sk_buff) in Linux 6.x UAPI; `ifindex` is at byte 40.
const SK_BUFF_SIZE: usize = 192;

fn bpf(cmd: i64, attr: &mut [u8]) -> std::io::Result<i64> {
    // SAFETY: attr is a valid, writable bpf_attr buffer of the given size.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rc)
}

fn obj_get(path: &str) -> anyhow::Result<u32> {
    let c = CString::new(path)?;
    let mut attr = [0u8; 16];
    attr[0..8].copy_from_slice(&(c.as_ptr() as u64).to_ne_bytes());
    let fd = bpf(BPF_OBJ_GET, &mut attr).with_context(|| format!("BPF_OBJ_GET {path}"))?;
    Ok(fd as u32)
}

/// Mean nanoseconds per run and the program's return code.
fn test_run(fd: u32, frame: &[u8], ifindex: u32, repeat: u32) -> anyhow::Result<(u32, u32)> {
    let mut ctx = [0u8; SK_BUFF_SIZE];
    ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    let mut out = vec![0u8; frame.len() + 256];
    let mut attr = [0u8; 80];
    attr[0..4].copy_from_slice(&fd.to_ne_bytes());
    attr[8..12].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    attr[12..16].copy_from_slice(&(out.len() as u32).to_ne_bytes());
    attr[16..24].copy_from_slice(&(frame.as_ptr() as u64).to_ne_bytes());
    attr[24..32].copy_from_slice(&(out.as_mut_ptr() as u64).to_ne_bytes());
    attr[32..36].copy_from_slice(&repeat.to_ne_bytes());
    attr[40..44].copy_from_slice(&(SK_BUFF_SIZE as u32).to_ne_bytes());
    attr[48..56].copy_from_slice(&(ctx.as_ptr() as u64).to_ne_bytes());
    bpf(BPF_PROG_TEST_RUN, &mut attr).context("BPF_PROG_TEST_RUN")?;
    let retval = u32::from_ne_bytes(attr[4..8].try_into()?);
    let duration = u32::from_ne_bytes(attr[36..40].try_into()?);
    Ok((duration, retval))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, netns, pin_root, from_if, to_if, src, dst, dport, repeat] = args.as_slice() else {
        bail!("usage: weir-prog-cost NETNS PIN_ROOT FROM_IF TO_IF SRC DST DPORT REPEAT");
    };
    let (src, dst): (IpAddr, IpAddr) = (src.parse()?, dst.parse()?);
    let (dport, repeat): (u16, u32) = (dport.parse()?, repeat.parse()?);
    weir_tests::pods::enter(netns);
    let index = |name: &str| -> anyhow::Result<u32> {
        let c = CString::new(name)?;
        // SAFETY: a valid NUL-terminated string.
        match unsafe { libc::if_nametoindex(c.as_ptr()) } {
            0 => bail!("no interface {name} in {netns}"),
            i => Ok(i),
        }
    };
    let seg = raw::udp(
        SocketAddr::new(src, 40000),
        SocketAddr::new(dst, dport),
        b"cost",
    );
    let frame = raw::ethernet(
        [2; 6],
        [4; 6],
        &[],
        &raw::ip(src, dst, raw::IPPROTO_UDP, &seg),
    );
    for (name, ifname) in [("weir_from_pod", from_if), ("weir_to_pod", to_if)] {
        let ifindex = index(ifname)?;
        let fd = obj_get(&format!("{pin_root}/progs/{name}"))?;
        test_run(fd, &frame, ifindex, 1)?;
        let (ns, retval) = test_run(fd, &frame, ifindex, repeat)?;
        println!("{name}: {ns} ns/run over {repeat} runs (return code {retval})");
    }
    Ok(())
}
