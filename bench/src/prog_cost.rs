//! Per-path cost of the eBPF dataplane's classifiers, measured in the kernel with
//! BPF_PROG_TEST_RUN on the programs the agent loaded and pinned, while its maps hold the
//! bench world: for each path a packet can take (an established flow at each hook, a
//! reply at each hook, a new flow allowed, a new flow denied, an anti-spoofing drop, an
//! ICMP error about a tracked flow, IPv6 with extension headers), nanoseconds per run;
//! and for each program the instructions the verifier processed and its size as
//! translated and as JIT-compiled (bpf_prog_info). No global setting such as
//! bpf_stats_enabled is touched.
//!
//! Each path's frame must take that path: the program's verdict is checked, and so is the
//! counter the path increments in WEIR_COUNTERS (a frame that falls to another path
//! fails its row instead of measuring the wrong thing).
use std::ffi::CString;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::bpf_maps::bpf;
use super::netns::Netns;
use super::report::Row;
use super::topology::HOST_INTERFACES;
use super::world::{CLIENT_IP, LATENCY_PORT, SERVER_IP, TOGGLE_PORT};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;

/// WEIR_COUNTERS indices (weir-common's COUNTER_*), which the bench does not link.
const COUNTER_DEFAULT_DENY: u32 = 0;
const COUNTER_REPLY: u32 = 1;
const COUNTER_ICMP_ERROR: u32 = 4;
const COUNTER_SPOOFED: u32 = 6;
const COUNTER_CT_OVERFLOW: u32 = 9;

/// sizeof(struct __sk_buff) in the Linux 6.x UAPI; `ifindex` is at byte 40.
const SK_BUFF_SIZE: usize = 192;
/// sizeof(struct bpf_prog_info) in the Linux 6.x UAPI, and its fields used here.
const PROG_INFO_SIZE: usize = 232;
const INFO_JITED_LEN: usize = 16;
const INFO_XLATED_LEN: usize = 20;
const INFO_VERIFIED_INSNS: usize = 216;

/// The pinned programs, as the agent names them (weir-common's program_names).
const FROM_POD: &str = "weir_from_pod";
const TO_POD: &str = "weir_to_pod";
const DEFERRED_TO_NODE: &str = "weir_deferred_to_node";

/// Runs per round on a path that stays the same path however often it is taken, and
/// rounds per path (the median round is reported).
const RUNS: u32 = 100_000;
const ROUNDS: usize = 3;
/// A new flow's runs take a token of the endpoint's budget of new WEIR_CT entries each
/// (2,000 deep, 100 a second by default): the rounds stay well within it, so that every
/// run takes the WEIR_CT path and none the overflow table's.
const NEW_FLOW_RUNS: u32 = 300;
/// The budget refills in 20 s at the default rate; the bench's own CRR traffic may have
/// emptied it just before.
const BUDGET_REFILL: Duration = Duration::from_secs(21);

/// Where a path's frame is run: the program and the host-side interface it is run as.
#[derive(Clone, Copy)]
enum Hook {
    /// `weir_from_pod` on the client's interface.
    FromClient,
    /// `weir_to_pod` on the client's interface.
    ToClient,
    FromServer,
    ToServer,
}

impl Hook {
    fn program(self) -> &'static str {
        match self {
            Hook::FromClient | Hook::FromServer => FROM_POD,
            Hook::ToClient | Hook::ToServer => TO_POD,
        }
    }

    fn interface(self) -> &'static str {
        match self {
            Hook::FromClient | Hook::ToClient => HOST_INTERFACES[0],
            Hook::FromServer | Hook::ToServer => HOST_INTERFACES[1],
        }
    }
}

/// What must show that a run took the path.
#[derive(Clone, Copy)]
enum Check {
    /// This counter grew by at least one per run.
    Counts(u32),
    /// A new flow: its entry went to WEIR_CT, not the overflow table.
    NoOverflow,
}

struct PathCase {
    name: &'static str,
    hook: Hook,
    frame: Vec<u8>,
    verdict: u32,
    check: Check,
    runs: u32,
}

/// The paths, in the order they are run: the established and reply paths ride on the
/// entries that the first run of the established ones makes (the flow client → server's
/// latency port, which the world allows at both ends), as do the ICMP error's.
fn paths() -> Vec<PathCase> {
    let (client, server) = (CLIENT_IP, SERVER_IP);
    let flow = (client, 41000, server, LATENCY_PORT);
    let tcp4 = |(s, sp, d, dp): (Ipv4Addr, u16, Ipv4Addr, u16), flags| {
        ethernet(ETH_P_IP, &ipv4(s, d, IPPROTO_TCP, &tcp(sp, dp, flags)))
    };
    let reverse = |(s, sp, d, dp): (Ipv4Addr, u16, Ipv4Addr, u16)| (d, dp, s, sp);
    // What the server's stack would send back about a packet of `flow`: port unreachable,
    // quoting the packet's IP header and first 8 bytes.
    let quoted = ipv4(
        client,
        server,
        IPPROTO_TCP,
        &tcp(41000, LATENCY_PORT, TCP_ACK),
    );
    let icmp_error = ethernet(
        ETH_P_IP,
        &ipv4(server, client, IPPROTO_ICMP, &icmp(3, 3, &quoted[..28])),
    );
    let v6_peer: Ipv6Addr = "2001:db8::1".parse().expect("an IPv6 address");
    let v6_pod: Ipv6Addr = "2001:db8:1::3".parse().expect("an IPv6 address");
    let v6 = ethernet(
        ETH_P_IPV6,
        &ipv6_with_extensions(v6_peer, v6_pod, &tcp(41002, LATENCY_PORT, TCP_SYN)),
    );
    vec![
        PathCase {
            name: "established, from the pod (client's egress)",
            hook: Hook::FromClient,
            frame: tcp4(flow, TCP_ACK),
            verdict: TC_ACT_OK,
            check: Check::Counts(COUNTER_REPLY),
            runs: RUNS,
        },
        PathCase {
            name: "established, to the pod (server's ingress)",
            hook: Hook::ToServer,
            frame: tcp4(flow, TCP_ACK),
            verdict: TC_ACT_OK,
            check: Check::Counts(COUNTER_REPLY),
            runs: RUNS,
        },
        PathCase {
            name: "reply, from the pod (server's egress)",
            hook: Hook::FromServer,
            frame: tcp4(reverse(flow), TCP_ACK),
            verdict: TC_ACT_OK,
            check: Check::Counts(COUNTER_REPLY),
            runs: RUNS,
        },
        PathCase {
            name: "reply, to the pod (client's ingress)",
            hook: Hook::ToClient,
            frame: tcp4(reverse(flow), TCP_ACK),
            verdict: TC_ACT_OK,
            check: Check::Counts(COUNTER_REPLY),
            runs: RUNS,
        },
        PathCase {
            name: "ICMP error about a tracked flow, to the pod",
            hook: Hook::ToClient,
            frame: icmp_error,
            verdict: TC_ACT_OK,
            check: Check::Counts(COUNTER_ICMP_ERROR),
            runs: RUNS,
        },
        PathCase {
            name: "new denied (SYN to a closed port), to the pod",
            hook: Hook::ToServer,
            frame: tcp4((client, 41001, server, TOGGLE_PORT), TCP_SYN),
            verdict: TC_ACT_SHOT,
            check: Check::Counts(COUNTER_DEFAULT_DENY),
            runs: RUNS,
        },
        PathCase {
            name: "anti-spoofing drop (another pod's source), from the pod",
            hook: Hook::FromClient,
            frame: tcp4((server, 41003, client, LATENCY_PORT), TCP_SYN),
            verdict: TC_ACT_SHOT,
            check: Check::Counts(COUNTER_SPOOFED),
            runs: RUNS,
        },
        PathCase {
            name: "IPv6 with 3 extension headers (denied), to the pod",
            hook: Hook::ToServer,
            frame: v6,
            verdict: TC_ACT_SHOT,
            check: Check::Counts(COUNTER_DEFAULT_DENY),
            runs: RUNS,
        },
        // Every run of a SYN is judged as a new connection (the programs drop the entry
        // its previous run made and judge it again), and makes its entry.
        PathCase {
            name: "new allowed (SYN, judged and tracked), to the pod",
            hook: Hook::ToServer,
            frame: tcp4((client, 41004, server, LATENCY_PORT), TCP_SYN),
            verdict: TC_ACT_OK,
            check: Check::NoOverflow,
            runs: NEW_FLOW_RUNS,
        },
    ]
}

/// The rows of `scenario` for the agent whose pins are under `bpf_root`, measured in
/// `node` (the bench node's namespace, where the pods' host-side interfaces are).
pub fn rows(node: &Netns, bpf_root: &Path, scenario: &str) -> Vec<Row> {
    const DP: &str = "ebpf";
    let mut rows = Vec::new();
    for program in [FROM_POD, TO_POD, DEFERRED_TO_NODE] {
        match prog_info(&bpf_root.join("progs").join(program)) {
            Ok(info) => rows.extend([
                Row::number(
                    scenario,
                    DP,
                    &format!("{program}: instructions the verifier processed"),
                    f64::from(info.verified_insns),
                    "insns",
                ),
                Row::number(
                    scenario,
                    DP,
                    &format!("{program}: instructions as loaded (xlated)"),
                    f64::from(info.xlated_insns),
                    "insns",
                ),
                Row::number(
                    scenario,
                    DP,
                    &format!("{program}: JIT image"),
                    f64::from(info.jited_bytes),
                    "bytes",
                ),
            ]),
            Err(e) => rows.push(Row::failed(
                scenario,
                DP,
                &format!("{program}: instructions"),
                format!("{e:#}"),
            )),
        }
    }
    let counters = bpf_root.join("maps").join("WEIR_COUNTERS");
    for case in paths() {
        let figure = format!("{}: {}", case.name, case.hook.program());
        let measured = node.run(|| measure(bpf_root, &counters, &case));
        rows.push(match measured {
            Ok(ns) => Row::number(scenario, DP, &figure, ns, "ns/run"),
            Err(e) => Row::failed(scenario, DP, &figure, format!("{e:#}")),
        });
    }
    rows
}

/// The median of ROUNDS rounds' mean nanoseconds per run of `case`, after one run that
/// makes any state the path relies on. Runs on a thread in the node's namespace.
fn measure(bpf_root: &Path, counters: &Path, case: &PathCase) -> Result<f64> {
    let prog = obj_get(&bpf_root.join("progs").join(case.hook.program()))?;
    let counters = obj_get(counters)?;
    let ifindex = if_index(case.hook.interface())?;
    let run = |runs| -> Result<u32> {
        let (ns, verdict) = test_run(&prog, &case.frame, ifindex, runs)?;
        if verdict != case.verdict {
            bail!(
                "the program returned {verdict}, not {}: the frame did not take this path",
                case.verdict
            );
        }
        Ok(ns)
    };
    run(1)?;
    let mut retried = false;
    loop {
        let mut rounds = Vec::new();
        let overflow_before = counter(&counters, COUNTER_CT_OVERFLOW)?;
        for _ in 0..ROUNDS {
            let before = match case.check {
                Check::Counts(index) => counter(&counters, index)?,
                Check::NoOverflow => 0,
            };
            rounds.push(f64::from(run(case.runs)?));
            if let Check::Counts(index) = case.check {
                let grew = counter(&counters, index)? - before;
                if grew < u64::from(case.runs) {
                    bail!(
                        "counter {index} grew by {grew} over {} runs: the frame did not take this path",
                        case.runs
                    );
                }
            }
        }
        if let Check::NoOverflow = case.check {
            if counter(&counters, COUNTER_CT_OVERFLOW)? != overflow_before {
                if retried {
                    bail!("the endpoint's budget of new CT entries ran out during the runs, after waiting {BUDGET_REFILL:?} for it");
                }
                // Spent by the traffic just before: wait for the budget to refill.
                retried = true;
                std::thread::sleep(BUDGET_REFILL);
                continue;
            }
        }
        rounds.sort_by(f64::total_cmp);
        return Ok(rounds[rounds.len() / 2]);
    }
}

fn obj_get(path: &Path) -> Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())?;
    let mut attr = [0u64; 2];
    attr[0] = c.as_ptr() as u64;
    let fd =
        bpf(BPF_OBJ_GET, &mut attr).with_context(|| format!("BPF_OBJ_GET {}", path.display()))?;
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn if_index(name: &str) -> Result<u32> {
    let c = CString::new(name)?;
    // SAFETY: a valid NUL-terminated string.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => bail!("no interface {name} in the bench node"),
        i => Ok(i),
    }
}

/// Mean nanoseconds per run over `repeat` runs of `frame`, as if on interface `ifindex`,
/// and the program's return code.
fn test_run(prog: &OwnedFd, frame: &[u8], ifindex: u32, repeat: u32) -> Result<(u32, u32)> {
    let mut ctx = [0u8; SK_BUFF_SIZE];
    ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    let mut out = vec![0u8; frame.len() + 256];
    // struct bpf_attr's test: prog_fd, retval, data_size_in, data_size_out, data_in,
    // data_out, repeat, duration, ctx_size_in, ctx_size_out, ctx_in, ctx_out.
    let mut attr = [0u64; 10];
    let pair = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
    attr[0] = pair(prog.as_raw_fd() as u32, 0);
    attr[1] = pair(frame.len() as u32, out.len() as u32);
    attr[2] = frame.as_ptr() as u64;
    attr[3] = out.as_mut_ptr() as u64;
    attr[4] = pair(repeat, 0);
    attr[5] = pair(SK_BUFF_SIZE as u32, 0);
    attr[6] = ctx.as_ptr() as u64;
    bpf(BPF_PROG_TEST_RUN, &mut attr).context("BPF_PROG_TEST_RUN")?;
    let retval = (attr[0] >> 32) as u32;
    let duration = (attr[4] >> 32) as u32;
    Ok((duration, retval))
}

/// A WEIR_COUNTERS slot's packets, summed over the CPUs.
fn counter(map: &OwnedFd, index: u32) -> Result<u64> {
    // Per-CPU values: struct Counter { packets: u64, bytes: u64 } per possible CPU.
    let cpus = possible_cpus()?;
    let mut values = vec![0u64; 2 * cpus];
    let mut attr = [0u64; 4];
    attr[0] = map.as_raw_fd() as u64;
    attr[1] = &index as *const u32 as u64;
    attr[2] = values.as_mut_ptr() as u64;
    bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).context("reading WEIR_COUNTERS")?;
    Ok(values.iter().step_by(2).sum())
}

/// How many CPUs the kernel may have (/sys/devices/system/cpu/possible, e.g. `0-3`).
fn possible_cpus() -> Result<usize> {
    const PATH: &str = "/sys/devices/system/cpu/possible";
    let text = std::fs::read_to_string(PATH).with_context(|| format!("reading {PATH}"))?;
    let mut last = 0;
    for part in text.trim().split(',') {
        let end = part.rsplit('-').next().unwrap_or(part);
        last = last.max(
            end.parse::<usize>()
                .with_context(|| format!("{PATH}: {text}"))?,
        );
    }
    Ok(last + 1)
}

struct ProgInfo {
    verified_insns: u32,
    xlated_insns: u32,
    jited_bytes: u32,
}

fn prog_info(path: &Path) -> Result<ProgInfo> {
    let fd = obj_get(path)?;
    let mut info = [0u8; PROG_INFO_SIZE];
    let mut attr = [0u64; 2];
    attr[0] = fd.as_raw_fd() as u64 | ((PROG_INFO_SIZE as u64) << 32);
    attr[1] = info.as_mut_ptr() as u64;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).context("BPF_OBJ_GET_INFO_BY_FD")?;
    let field =
        |at: usize| u32::from_ne_bytes([info[at], info[at + 1], info[at + 2], info[at + 3]]);
    let verified_insns = field(INFO_VERIFIED_INSNS);
    if verified_insns == 0 {
        bail!("the kernel reports no verified instruction count (bpf_prog_info.verified_insns: Linux >= 5.16)");
    }
    Ok(ProgInfo {
        verified_insns,
        xlated_insns: field(INFO_XLATED_LEN) / 8,
        jited_bytes: field(INFO_JITED_LEN),
    })
}

// Frames: only what the programs read must be right (they check no checksum); the IPv4
// header's is filled in anyway.
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_TCP: u8 = 6;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

fn ethernet(ethertype: u16, packet: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + packet.len());
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x04]);
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02]);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(packet);
    f
}

fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, l4: &[u8]) -> Vec<u8> {
    let mut h = vec![0x45, 0];
    h.extend_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
    h.extend_from_slice(&[0, 1, 0x40, 0, 64, protocol, 0, 0]);
    h.extend_from_slice(&src.octets());
    h.extend_from_slice(&dst.octets());
    let mut sum: u32 = h
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    h.extend_from_slice(l4);
    h
}

/// An IPv6 packet whose TCP segment follows a hop-by-hop options, a routing (type 0, no
/// segments left) and a destination options header, as the programs walk them.
fn ipv6_with_extensions(src: Ipv6Addr, dst: Ipv6Addr, tcp: &[u8]) -> Vec<u8> {
    const HOP_BY_HOP: u8 = 0;
    const ROUTING: u8 = 43;
    const DEST_OPTIONS: u8 = 60;
    let pad_n = [1, 4, 0, 0, 0, 0];
    let mut ext = vec![ROUTING, 0];
    ext.extend_from_slice(&pad_n);
    ext.extend_from_slice(&[DEST_OPTIONS, 0, 0, 0, 0, 0, 0, 0]);
    ext.extend_from_slice(&[IPPROTO_TCP, 0]);
    ext.extend_from_slice(&pad_n);
    let mut p = vec![0x60, 0, 0, 0];
    p.extend_from_slice(&((ext.len() + tcp.len()) as u16).to_be_bytes());
    p.extend_from_slice(&[HOP_BY_HOP, 64]);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&ext);
    p.extend_from_slice(tcp);
    p
}

fn tcp(sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut s = Vec::with_capacity(20);
    s.extend_from_slice(&sport.to_be_bytes());
    s.extend_from_slice(&dport.to_be_bytes());
    s.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 1, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
    s
}

fn icmp(ty: u8, code: u8, body: &[u8]) -> Vec<u8> {
    let mut m = vec![ty, code, 0, 0, 0, 0, 0, 0];
    m.extend_from_slice(body);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_what_the_programs_parse() {
        let cases = paths();
        assert!(cases.iter().all(|c| c.frame.len() >= 54));
        // IPv4: total length and a valid header checksum.
        let ip = ipv4(CLIENT_IP, SERVER_IP, IPPROTO_TCP, &tcp(1, 2, TCP_SYN));
        assert_eq!(u16::from_be_bytes([ip[2], ip[3]]), 40);
        let sum: u32 = ip[..20]
            .chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
            .sum();
        assert_eq!((sum & 0xffff) + (sum >> 16), 0xffff);
        // IPv6: the chain ends at TCP, whose ports follow the 24 bytes of headers.
        let v6 = ipv6_with_extensions(Ipv6Addr::LOCALHOST, Ipv6Addr::LOCALHOST, &tcp(7, 9, 0));
        assert_eq!(v6[6], 0);
        assert_eq!(v6[40], 43);
        assert_eq!(v6[48], 60);
        assert_eq!(v6[56], IPPROTO_TCP);
        assert_eq!(&v6[64..68], &[0, 7, 0, 9]);
        assert_eq!(u16::from_be_bytes([v6[4], v6[5]]) as usize, v6.len() - 40);
    }

    #[test]
    fn possible_cpus_are_counted() {
        assert!(possible_cpus().unwrap() >= 1);
    }
}
