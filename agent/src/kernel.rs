//! The running kernel's loadable modules and features, as /sys, /proc and /lib/modules
//! show them. Distribution kernels build much of what weir uses as modules (Debian's 5.10
//! and 6.1: ip_set, xt_set, nf_tables, veth, bridge, br_netfilter, sch_ingress, cls_bpf),
//! loaded on first use; loading one, and naming one a tool's failure points at, is
//! [`crate::exec::modules`]'s.
use std::path::PathBuf;

/// Whether `module` is in the running kernel, loaded or built in (/sys/module has an entry
/// for every loaded module, and for built-in ones with parameters, such as ip_set).
pub fn module_present(module: &str) -> bool {
    std::path::Path::new("/sys/module").join(module).exists()
}

/// Whether IPVS is in the kernel (kube-proxy's ipvs mode loads it): `/proc/net/ip_vs`
/// exists in every network namespace once it is.
pub fn has_ipvs() -> bool {
    std::path::Path::new("/proc/net/ip_vs").exists()
}

/// The running kernel's release, as `uname -r` prints it.
pub fn release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The (major, minor) of a kernel release such as `5.10.0-46-amd64`; None when it does
/// not start with two numbers.
pub fn major_minor(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// `/lib/modules/<release>` of the running kernel.
pub fn modules_dir() -> PathBuf {
    PathBuf::from("/lib/modules").join(release())
}

/// CLOCK_MONOTONIC in nanoseconds: comparable across processes of one boot, and with the
/// eBPF programs' `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    crate::sys::clock::monotonic_ns()
}

#[cfg(test)]
mod tests {
    use super::major_minor;

    #[test]
    fn releases_give_their_major_and_minor() {
        assert_eq!(major_minor("5.10.0-46-amd64"), Some((5, 10)));
        assert_eq!(major_minor("6.18.0"), Some((6, 18)));
        assert_eq!(major_minor("6.1"), Some((6, 1)));
        assert_eq!(major_minor(""), None);
        assert_eq!(major_minor("x"), None);
    }
}
