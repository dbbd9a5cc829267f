//! Finding and detaching weir's TC filters: every filter whose BPF program name starts
//! with `weir_`, on every interface of the current network namespace, read from
//! `tc filter show` output line by line.

use crate::exec;

/// One attached BPF filter, as `tc filter del` needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BpfFilter {
    pub device: String,
    /// `ingress` or `egress` (the clsact hooks).
    pub hook: &'static str,
    pub protocol: String,
    pub pref: String,
    pub handle: String,
    pub program: String,
}

impl BpfFilter {
    pub fn describe(&self) -> String {
        format!(
            "tc filter {} {} pref {} handle {} ({})",
            self.device, self.hook, self.pref, self.handle, self.program
        )
    }

    pub fn delete(&self) -> Result<(), exec::ExecError> {
        exec::run_ok(
            "tc",
            &[
                "filter",
                "del",
                "dev",
                &self.device,
                self.hook,
                "protocol",
                &self.protocol,
                "pref",
                &self.pref,
                "handle",
                &self.handle,
                "bpf",
            ],
            None,
        )
        .map(drop)
    }
}

pub const HOOKS: [&str; 2] = ["ingress", "egress"];

/// Interface names from `ip -o link show` (`3: v0@v1: <...>` gives `v0`).
pub fn parse_link_names(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| line.split_whitespace().nth(1))
        .map(|field| field.trim_end_matches(':'))
        .map(|field| field.split('@').next().unwrap_or(field).to_string())
        .filter(|name| !name.is_empty())
        .collect()
}

/// BPF filters of one hook whose program name starts with `prefix`, from
/// `tc filter show dev <device> <hook>`.
pub fn parse_filters(device: &str, hook: &'static str, text: &str, prefix: &str) -> Vec<BpfFilter> {
    text.lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = |key: &str| {
                words
                    .windows(2)
                    .find(|w| w[0] == key)
                    .map(|w| w[1].to_string())
            };
            if words.first() != Some(&"filter") || !words.contains(&"bpf") {
                return None;
            }
            let handle = after("handle")?;
            // The kernel's program name (`name X`), or the filter's own name (the word
            // after the handle) on kernels that do not report one.
            let program = after("name").or_else(|| after(&handle))?;
            let pref = after("pref")?;
            program.starts_with(prefix).then(|| BpfFilter {
                device: device.to_string(),
                hook,
                protocol: after("protocol").unwrap_or_else(|| "all".into()),
                pref,
                handle,
                program,
            })
        })
        .collect()
}

/// Every weir filter in the current network namespace.
pub fn find(prefix: &str) -> Result<Vec<BpfFilter>, exec::ExecError> {
    let links = exec::run_ok("ip", &["-o", "link", "show"], None)?;
    let mut found = Vec::new();
    for device in parse_link_names(&links) {
        for hook in HOOKS {
            // A device without a clsact qdisc has no such hook: nothing of ours there.
            let out = exec::run("tc", &["filter", "show", "dev", &device, hook], None)?;
            if out.success {
                found.extend(parse_filters(&device, hook, &out.stdout, prefix));
            }
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_captured_tc_filter_show() {
        let text = include_str!("testdata/tc-filter-show.txt");
        let found = parse_filters("v0", "ingress", text, "weir_");
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].pref, "3");
        assert_eq!(found[0].handle, "0x1");
        assert_eq!(found[0].protocol, "all");
        assert_eq!(found[0].program, "weir_from_pod");
        assert_eq!(found[1].pref, "49152");
    }

    #[test]
    fn ignores_other_programs_and_filter_kinds() {
        let text = "filter protocol all pref 1 bpf chain 0 handle 0x1 cilium.o:[x] \
                    direct-action id 7 name cil_from_container tag 00 jited\n\
                    filter protocol ip pref 9 u32 chain 0 handle 800::800 order 2048\n\
                    filter protocol all pref 2 bpf chain 0 handle 0x4 weir_to_pod \
                    direct-action id 8 tag 00 jited\n";
        let found = parse_filters("lxc1", "egress", text, "weir_");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].program, "weir_to_pod");
        assert_eq!(found[0].pref, "2");
    }

    #[test]
    fn parses_link_names_with_peers() {
        let text = "1: lo: <LOOPBACK> mtu 65536\\    link/loopback 00\n\
                    3: v0@v1: <UP> mtu 1500\\    link/ether b6\n";
        assert_eq!(parse_link_names(text), ["lo", "v0"]);
    }
}
