//! Holds the eBPF dataplane like the agent does, for the kill -9 test: enters network
//! namespace ARG1, loads or adopts the dataplane pinned under ARG2, reconciles it with the
//! Desired JSON in ARG3, prints `ready <program ids>`, then sleeps until killed.

use std::io::Write;
use weir::dataplane::Scope;

use weir::dataplane::{
    ebpf::{EbpfConfig, EbpfDataplane},
    Dataplane,
};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, netns, pin_root, desired] = args.as_slice() else {
        anyhow::bail!("usage: weir-ebpf-holder NETNS PIN_ROOT DESIRED_JSON");
    };
    weir_tests::pods::enter(netns);
    let desired = serde_json::from_slice(&std::fs::read(desired)?)?;
    let mut dp = EbpfDataplane::new(EbpfConfig::with_pin_root(pin_root))?;
    let report = dp.converge(&desired, Scope::Kernel)?;
    anyhow::ensure!(report.failures.is_empty(), "{:?}", report.failures);
    let [from_pod, to_pod] = dp.program_ids()?;
    let mut out = std::io::stdout();
    writeln!(out, "ready {from_pod} {to_pod}")?;
    out.flush()?;
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
