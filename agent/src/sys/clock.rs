//! The monotonic clock the eBPF programs read too.

/// CLOCK_MONOTONIC in nanoseconds: comparable across processes of one boot, and with the
/// eBPF programs' `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
