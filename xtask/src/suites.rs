//! `cargo xtask conformance --suite e2e|npapi --dataplane ebpf|iptables`: the field's own
//! NetworkPolicy suites against weir as its DaemonSet on a real kubelet cluster
//! (`weir-lab cluster`), one dataplane per run:
//! - `e2e`: Kubernetes' `test/e2e/network/netpol` at the release in
//!   deploy/kubernetes-version, as a test binary that links only that package and the e2e
//!   framework (half the packages of the release's e2e.test), every `Feature:NetworkPolicy`
//!   and `NetworkPolicy API` spec;
//! - `npapi`: network-policy-api's conformance (the version in deploy/cluster-versions), the
//!   ClusterNetworkPolicy profile with all features.
//!
//! Each run builds what is not cached, brings the cluster up with weir on the chosen
//! dataplane, runs the suite with its output unchanged (its summary lines are the suite's
//! own), writes `docs/results/DATE/conformance-SUITE-DATAPLANE.json` and tears the cluster
//! down, also when something fails.
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::cluster::{self, Versions};
use crate::cmd::{exec, is_root, output, workspace_root};
use crate::components;

mod rolling;

/// The specs the e2e framework runs only when focused (it skips `[Feature:...]` otherwise).
const E2E_FOCUS: &str = "Feature:NetworkPolicy|NetworkPolicy API";
/// How long a whole suite may take: about 20 minutes when every e2e spec passes, about
/// 3.5 minutes more per failing one (it retries its probes).
const SUITE_TIMEOUT: Duration = Duration::from_secs(4 * 3600);

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    /// Kubernetes' NetworkPolicy e2e (test/e2e/network/netpol).
    E2e,
    /// network-policy-api's conformance, ClusterNetworkPolicy profile, all features.
    Npapi,
    /// Not a suite of the field's: across nodes, node 1 on `--dataplane` and the others on
    /// the other one, every pod probing every other while each node's dataplane is switched
    /// in turn; no denied connect may get through, no allowed one fail.
    RollingSwitch,
    /// cyclonus's generated cases (the release in deploy/cluster-versions), as cyclonus
    /// runs them by default; `--focus TAGS` is its `--include`.
    Cyclonus,
}

impl Suite {
    fn name(self) -> &'static str {
        match self {
            Suite::E2e => "e2e",
            Suite::Npapi => "npapi",
            Suite::RollingSwitch => "rolling-switch",
            Suite::Cyclonus => "cyclonus",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Dataplane {
    Ebpf,
    Iptables,
}

impl Dataplane {
    fn name(self) -> &'static str {
        match self {
            Dataplane::Ebpf => "ebpf",
            Dataplane::Iptables => "iptables",
        }
    }

    fn other(self) -> Dataplane {
        match self {
            Dataplane::Ebpf => Dataplane::Iptables,
            Dataplane::Iptables => Dataplane::Ebpf,
        }
    }
}

/// The cluster's `--name`: one per suite and dataplane, apart from `weir-lab cluster`'s
/// default and the real-cluster test's, so runs of different cells go side by side and
/// never take over someone's cluster.
fn cluster_name(suite: Suite, dataplane: Dataplane) -> String {
    let suite = match suite {
        Suite::E2e => "e2e",
        Suite::Npapi => "np",
        Suite::RollingSwitch => "rs",
        Suite::Cyclonus => "cy",
    };
    let dataplane = match dataplane {
        Dataplane::Ebpf => "ebpf",
        Dataplane::Iptables => "ipt",
    };
    format!("w{suite}{dataplane}")
}

pub struct Options {
    pub suite: Suite,
    pub dataplane: Dataplane,
    pub nodes: usize,
    /// e2e: a ginkgo focus instead of every NetworkPolicy spec; npapi: a `-run` pattern
    /// for the conformance tests (subtests of `TestConformanceProfiles`).
    pub focus: Option<String>,
}

pub fn run(o: &Options) -> Result<()> {
    if !is_root() {
        bail!("the suites run a kubelet cluster (namespaces, mounts, cgroups): run it as root");
    }
    if o.suite == Suite::RollingSwitch {
        return rolling::run(o);
    }
    let started = Instant::now();
    // The weir this run tests: the commit as the image is built, not as the run ends.
    let weir = weir_commit();
    cluster::ensure()?;
    let k8s = components::kubernetes_version()?;
    let versions = cluster::versions()?;
    let sctp = kernel_sctp();
    let suite_bin = match o.suite {
        Suite::E2e => ensure_e2e(&k8s)?,
        Suite::Npapi => ensure_npapi(&versions.network_policy_api, sctp.is_ok())?,
        Suite::Cyclonus => ensure_cyclonus(&versions.cyclonus)?,
        Suite::RollingSwitch => bail!("the rolling switch has no suite binary"),
    };
    crate::image::for_tests()?;
    exec(crate::cmd::cargo().args(["build", "--package", "weir-lab"]))?;
    let built = started.elapsed();
    println!(
        "conformance: everything built or cached in {:.0}s",
        built.as_secs_f64()
    );

    let cluster_started = Instant::now();
    let mut cluster = Cluster::up(&cluster_name(o.suite, o.dataplane), o.nodes)?;
    cluster.deploy_weir(o.dataplane)?;
    let cluster_seconds = cluster_started.elapsed().as_secs_f64();
    println!(
        "conformance: cluster up with weir on {} in {cluster_seconds:.0}s",
        o.dataplane.name()
    );

    let run_started = Instant::now();
    let outcome = match o.suite {
        Suite::E2e => run_e2e(&cluster, &suite_bin, o.focus.as_deref(), &sctp),
        Suite::Npapi => run_npapi(
            &cluster,
            &suite_bin,
            &versions.network_policy_api,
            &weir,
            o.focus.as_deref(),
            &sctp,
        ),
        Suite::Cyclonus => run_cyclonus(&cluster, &suite_bin, o.focus.as_deref(), &sctp),
        Suite::RollingSwitch => Err(anyhow::anyhow!("the rolling switch is no suite run")),
    };
    let suite_seconds = run_started.elapsed().as_secs_f64();
    // Whatever the suite said, the weir pods' logs go with a failure.
    if outcome.as_ref().map_or(true, |r| !r.failed.is_empty()) {
        cluster.print_weir_logs();
    }
    let down = cluster.down();
    let result = outcome?;
    down?;

    let file = write_results(o, &k8s, &versions, &weir, &result, suite_seconds)?;
    println!(
        "conformance: {} on {}: {} passed, {} failed, {} skipped of {} {}; suite {suite_seconds:.0}s, \
         cluster {cluster_seconds:.0}s, builds {:.0}s; {}",
        o.suite.name(),
        o.dataplane.name(),
        result.passed.len(),
        result.failed.len(),
        result.skipped.len(),
        result.total,
        match o.suite {
            Suite::E2e => "specs",
            Suite::Npapi | Suite::RollingSwitch => "tests",
            Suite::Cyclonus => "cases",
        },
        built.as_secs_f64(),
        file.display()
    );
    if !result.failed.is_empty() || result.passed.is_empty() {
        bail!(
            "{} of {} run failed on {}",
            result.failed.len(),
            result.passed.len() + result.failed.len(),
            o.dataplane.name()
        );
    }
    Ok(())
}

/// The short subset: one e2e spec that denies and one that allows (TCP; their SCTP twins'
/// texts say "using SCTP") ...
const CI_E2E_FOCUS: &str =
    "NetworkPolicy between server and client should support (a 'default-deny-ingress' policy|allow-all policy)";
/// ... and one ClusterNetworkPolicy conformance test.
const CI_NPAPI_TEST: &str = "CNPAdminTierIngressTCP$";

/// The short subset for CI (`cargo xtask conformance --ci-subset`): on a 2-node cluster per
/// dataplane, eBPF then iptables, one denying and one allowing spec of the e2e suite and one
/// ClusterNetworkPolicy conformance test; fails on any failure. Writes no result file.
/// With `build_only`, only what it runs is built (`cargo xtask test` does that beside its
/// integration tests, then runs the subset at its end).
pub fn ci_subset(build_only: bool) -> Result<()> {
    if !is_root() {
        bail!("the suites run a kubelet cluster (namespaces, mounts, cgroups): run it as root");
    }
    let started = Instant::now();
    let weir = weir_commit();
    cluster::ensure()?;
    let k8s = components::kubernetes_version()?;
    let versions = cluster::versions()?;
    let sctp = kernel_sctp();
    let e2e = ensure_e2e(&k8s)?;
    let npapi = ensure_npapi(&versions.network_policy_api, sctp.is_ok())?;
    if build_only {
        println!(
            "conformance: the subset's components and suites built or cached in {:.0}s",
            started.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    crate::image::for_tests()?;
    exec(crate::cmd::cargo().args(["build", "--package", "weir-lab"]))?;
    println!(
        "conformance: everything built or cached in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    let mut failures = Vec::new();
    for dataplane in [Dataplane::Ebpf, Dataplane::Iptables] {
        let cell = Instant::now();
        let name = match dataplane {
            Dataplane::Ebpf => "wciebpf",
            Dataplane::Iptables => "wciipt",
        };
        let mut cluster = Cluster::up(name, 2)?;
        cluster.deploy_weir(dataplane)?;
        let mut results = vec![("e2e", run_e2e(&cluster, &e2e, Some(CI_E2E_FOCUS), &sctp))];
        results.push((
            "npapi",
            run_npapi(
                &cluster,
                &npapi,
                &versions.network_policy_api,
                &weir,
                Some(CI_NPAPI_TEST),
                &sctp,
            ),
        ));
        let mut failed = false;
        for (suite, r) in &results {
            match r {
                Ok(r) if r.failed.is_empty() && !r.passed.is_empty() => println!(
                    "conformance: subset {suite} on {}: {} passed",
                    dataplane.name(),
                    r.passed.len()
                ),
                Ok(r) => {
                    failed = true;
                    failures.push(format!(
                        "{suite} on {}: failed {:?}",
                        dataplane.name(),
                        r.failed
                    ));
                }
                Err(e) => {
                    failed = true;
                    failures.push(format!("{suite} on {}: {e:#}", dataplane.name()));
                }
            }
        }
        if failed {
            cluster.print_weir_logs();
        }
        cluster.down()?;
        println!(
            "conformance: subset on {} in {:.0}s",
            dataplane.name(),
            cell.elapsed().as_secs_f64()
        );
    }
    println!(
        "conformance: subset in {:.0}s in all",
        started.elapsed().as_secs_f64()
    );
    if !failures.is_empty() {
        bail!("the conformance subset failed: {}", failures.join("; "));
    }
    Ok(())
}

/// What a suite run came to.
#[derive(Debug, Default)]
struct SuiteResult {
    passed: Vec<String>,
    failed: Vec<String>,
    /// Specs not run, each with why.
    skipped: Vec<String>,
    /// Specs the suite has (run or not).
    total: usize,
    /// The suite's own summary lines, as it printed them.
    summary: Vec<String>,
    /// What was left out, and why (the kernel's lack of SCTP, say).
    skip_reasons: Vec<String>,
    /// The filters the suite ran with.
    args: Vec<String>,
    /// Of the tests' own subtests (network-policy-api's), how many passed and failed.
    subtests_passed: usize,
    subtests_failed: usize,
}

// ---------------------------------------------------------------------------------------
// The e2e suite

/// The cached directory of the netpol e2e test binary of release `k8s`.
fn e2e_dir(k8s: &str) -> PathBuf {
    components::root().join(format!("netpol-e2e-{k8s}"))
}

/// The test program: the netpol package's specs, run by the e2e framework with its flags
/// as the release's e2e.test registers them.
const E2E_MAIN: &str = r#"// Kubernetes' NetworkPolicy e2e specs (test/e2e/network/netpol) and nothing else, run by
// the e2e framework as the release's e2e.test runs them. Written by `cargo xtask conformance`.
package netpole2e

import (
	"flag"
	"os"
	"testing"

	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	"k8s.io/component-base/logs"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"

	_ "k8s.io/component-base/logs/testinit"
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
	_ "k8s.io/kubernetes/test/e2e/network/netpol"
)

func TestMain(m *testing.M) {
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	framework.AfterReadingAllFlags(&framework.TestContext)
	os.Exit(m.Run())
}

func TestNetpol(t *testing.T) {
	logs.InitLogs()
	defer logs.FlushLogs()
	klog.EnableContextualLogging(true)
	gomega.RegisterFailHandler(framework.Fail)
	suiteConfig, reporterConfig := framework.CreateGinkgoConfig()
	ginkgo.RunSpecs(t, "Kubernetes NetworkPolicy e2e", suiteConfig, reporterConfig)
}
"#;

/// The netpol e2e test binary, built when not cached.
fn ensure_e2e(k8s: &str) -> Result<PathBuf> {
    let dir = e2e_dir(k8s);
    let bin = dir.join("e2e.test");
    if dir.join(".complete").exists() && bin.is_file() {
        return Ok(bin);
    }
    println!("conformance: building the NetworkPolicy e2e test binary of {k8s} (a fresh machine pays this once)");
    let started = Instant::now();
    let go = components::go()?;
    let module = dir.join("build");
    fs::create_dir_all(&module).with_context(|| format!("create {}", module.display()))?;
    let info = cluster::download(&go, &format!("k8s.io/kubernetes@{k8s}"))?;
    let gomod = info["GoMod"].as_str().context("no GoMod file named")?;
    let upstream = fs::read_to_string(gomod).with_context(|| format!("read {gomod}"))?;
    let gomod = components::build_module(k8s, &upstream)?.replace(
        "module weir.local/components",
        "module weir.local/netpole2e",
    );
    fs::write(module.join("go.mod"), gomod)?;
    fs::write(module.join("netpol_test.go"), E2E_MAIN)?;
    exec(cluster::go_cmd(&go, &module).args(["mod", "tidy"]))?;
    exec(
        cluster::go_cmd(&go, &module)
            .args(["test", "-c", "-trimpath", "-o"])
            .arg(&bin)
            .arg("."),
    )?;
    if !bin.is_file() {
        bail!("go test -c finished but {} is missing", bin.display());
    }
    fs::write(dir.join(".complete"), k8s)?;
    println!(
        "conformance: built the NetworkPolicy e2e test binary in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(bin)
}

/// Whether this kernel has SCTP: `Err(reason)` when a socket of it cannot be made.
fn kernel_sctp() -> std::result::Result<(), String> {
    // SAFETY: socket has no preconditions; the descriptor is closed right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, libc::IPPROTO_SCTP) };
    if fd >= 0 {
        // SAFETY: fd was just returned by socket.
        unsafe { libc::close(fd) };
        return Ok(());
    }
    Err(format!(
        "this kernel has no SCTP (socket(AF_INET, SOCK_STREAM, IPPROTO_SCTP): {})",
        std::io::Error::last_os_error()
    ))
}

fn run_e2e(
    cluster: &Cluster,
    bin: &Path,
    focus: Option<&str>,
    sctp: &std::result::Result<(), String>,
) -> Result<SuiteResult> {
    let report = cluster.dir.join("e2e-report.json");
    let _ = fs::remove_file(&report);
    let mut skip = Vec::new();
    let mut skip_reasons = Vec::new();
    if let Err(reason) = sctp {
        println!("conformance: skipping the specs tagged Feature:SCTPConnectivity: {reason}");
        skip.push("SCTPConnectivity");
        skip_reasons.push(format!("Feature:SCTPConnectivity: {reason}"));
    }
    let mut args = vec![
        format!("--ginkgo.focus={}", focus.unwrap_or(E2E_FOCUS)),
        "--ginkgo.no-color".to_string(),
        format!("--ginkgo.timeout={}s", SUITE_TIMEOUT.as_secs()),
    ];
    if !skip.is_empty() {
        args.push(format!("--ginkgo.skip={}", skip.join("|")));
    }
    let mut command = cluster.in_control_plane(bin);
    command
        .arg(format!("--kubeconfig={}", cluster.kubeconfig().display()))
        .arg("--provider=skeleton")
        .arg(format!("--ginkgo.json-report={}", report.display()))
        .args(&args)
        .current_dir(&cluster.dir);
    let (status, summary) = stream(&mut command, SUITE_TIMEOUT, |l| {
        l.starts_with("Ran ") || l.contains(" Passed | ")
    })?;
    let text = fs::read_to_string(&report).with_context(|| {
        format!(
            "the e2e binary ({status}) wrote no report at {}",
            report.display()
        )
    })?;
    let mut result = parse_ginkgo_report(&text)?;
    result.summary = summary;
    result.skip_reasons = skip_reasons;
    result.args = args;
    if result.failed.is_empty() && !status.success() {
        bail!("the e2e binary failed ({status}) with no failed spec in its report");
    }
    Ok(result)
}

/// Passed, failed and skipped specs of a ginkgo JSON report (one suite).
fn parse_ginkgo_report(text: &str) -> Result<SuiteResult> {
    let reports: Value = serde_json::from_str(text).context("parsing ginkgo's JSON report")?;
    let mut r = SuiteResult::default();
    for suite in reports
        .as_array()
        .context("a ginkgo report is a list of suites")?
    {
        for spec in suite["SpecReports"].as_array().into_iter().flatten() {
            // Suite-level nodes (BeforeSuite, ReportAfterSuite) are not specs.
            if spec["LeafNodeType"] != "It" {
                continue;
            }
            let name = [
                spec["ContainerHierarchyTexts"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(" "),
                spec["LeafNodeText"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            ]
            .join(" ");
            r.total += 1;
            match spec["State"].as_str().unwrap_or_default() {
                "passed" => r.passed.push(name),
                "skipped" | "pending" => r.skipped.push(name),
                _ => r.failed.push(name),
            }
        }
    }
    Ok(r)
}

// ---------------------------------------------------------------------------------------
// network-policy-api's conformance suite

/// The cached directory of network-policy-api `version`'s conformance test binary; a
/// separate one for a kernel without SCTP, whose base manifests lack the SCTP servers.
fn npapi_dir(version: &str, sctp: bool) -> PathBuf {
    components::root().join(format!(
        "network-policy-api-conformance-{version}{}",
        if sctp { "" } else { "-no-sctp" }
    ))
}

/// The conformance test binary of network-policy-api `version` (its `conformance`
/// package), built when not cached. Without SCTP in the kernel, its base manifests are
/// built in without their SCTP servers (`agnhost porter` on an SCTP port), which would
/// never become ready and hold every test back.
fn ensure_npapi(version: &str, sctp: bool) -> Result<PathBuf> {
    let dir = npapi_dir(version, sctp);
    let bin = dir.join("conformance.test");
    if dir.join(".complete").exists() && bin.is_file() {
        return Ok(bin);
    }
    println!(
        "conformance: building network-policy-api {version}'s conformance suite (a fresh machine pays this once)"
    );
    let started = Instant::now();
    let go = components::go()?;
    let info = cluster::download(&go, &format!("sigs.k8s.io/network-policy-api@{version}"))?;
    let module = PathBuf::from(info["Dir"].as_str().context("no module Dir named")?);
    let src = dir.join("src");
    let _ = fs::remove_dir_all(&src);
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    // A writable copy: the module cache is read-only, and the manifests are embedded.
    exec(Command::new("cp").arg("-r").arg(&module).arg(&src))?;
    exec(Command::new("chmod").args(["-R", "u+w"]).arg(&src))?;
    if !sctp {
        let manifests = src.join("conformance/base/manifests.yaml");
        let text = fs::read_to_string(&manifests)
            .with_context(|| format!("read {}", manifests.display()))?;
        fs::write(&manifests, without_sctp_servers(&text))?;
    }
    exec(
        cluster::go_cmd(&go, &src)
            .args(["test", "-c", "-trimpath", "-o"])
            .arg(&bin)
            .arg("./conformance"),
    )?;
    if !bin.is_file() {
        bail!("go test -c finished but {} is missing", bin.display());
    }
    fs::write(dir.join(".complete"), version)?;
    println!(
        "conformance: built network-policy-api {version}'s conformance suite in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(bin)
}

/// `manifests` without the containers that serve SCTP (an env `SERVE_SCTP_PORT_...`).
fn without_sctp_servers(manifests: &str) -> String {
    let lines: Vec<&str> = manifests.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut out = Vec::with_capacity(lines.len());
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        out.push(line);
        i += 1;
        if line.trim() != "containers:" {
            continue;
        }
        // The list's items: `- ` lines at one indentation, each up to the next such line
        // or a line indented less.
        let Some(first) = lines[i..].iter().find(|l| !l.trim().is_empty()) else {
            continue;
        };
        let item = indent(first);
        if !first.trim_start().starts_with("- ") || item < indent(line) {
            continue;
        }
        while i < lines.len() && lines[i].trim_start().starts_with("- ") && indent(lines[i]) == item
        {
            let start = i;
            i += 1;
            while i < lines.len() && (lines[i].trim().is_empty() || indent(lines[i]) > item) {
                i += 1;
            }
            if !lines[start..i]
                .iter()
                .any(|l| l.contains("SERVE_SCTP_PORT"))
            {
                out.extend_from_slice(&lines[start..i]);
            }
        }
    }
    let mut text = out.join("\n");
    text.push('\n');
    text
}

/// The suite's tests that need SCTP: those that probe it (`PokeServer(..., "sctp", ...)`
/// somewhere in their file; the `...SCTP` tests, and some that mix it with TCP and UDP),
/// by `ShortName`, from its sources.
fn npapi_sctp_tests(version: &str) -> Result<Vec<String>> {
    let dir = npapi_dir(version, false).join("src/conformance/tests");
    let dir = match dir.is_dir() {
        true => dir,
        false => npapi_dir(version, true).join("src/conformance/tests"),
    };
    let mut names = Vec::new();
    for entry in fs::read_dir(&dir).with_context(|| format!("read {}", dir.display()))? {
        let text = fs::read_to_string(entry?.path())?;
        names.extend(sctp_tests_of(&text));
    }
    names.sort();
    Ok(names)
}

/// The `ShortName`s of a test file's tests whose bodies probe SCTP.
fn sctp_tests_of(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut current: Option<String> = None;
    let mut probes = false;
    for line in source.lines().chain(std::iter::once("ShortName: \"\"")) {
        if let Some(name) = line.trim().strip_prefix("ShortName:") {
            if let (Some(done), true) = (current.take(), probes) {
                names.push(done);
            }
            let name = name.trim().trim_end_matches(',').trim_matches('"');
            current = (!name.is_empty()).then(|| name.to_string());
            probes = false;
        } else if line.contains("\"sctp\"") {
            probes = true;
        }
    }
    names
}

fn run_npapi(
    cluster: &Cluster,
    bin: &Path,
    version: &str,
    weir: &str,
    focus: Option<&str>,
    sctp: &std::result::Result<(), String>,
) -> Result<SuiteResult> {
    // The suite refuses to run unless the installed CRD is its own release's; the
    // experimental channel, for the features beyond the standard profile (named ports,
    // egress node peers).
    let crd = components::crd_path(version, "experimental");
    cluster.kubectl(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        &crd.display().to_string(),
    ])?;
    cluster.kubectl(&[
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/clusternetworkpolicies.policy.networking.k8s.io",
    ])?;
    let report = cluster.dir.join("npapi-report.yaml");
    let mut skip_reasons = Vec::new();
    let mut skipped = Vec::new();
    let mut args = vec![
        format!(
            "-test.run=TestConformanceProfiles{}",
            focus.map(|f| format!("/{f}")).unwrap_or_default()
        ),
        "-test.v".to_string(),
        format!("-test.timeout={}s", SUITE_TIMEOUT.as_secs()),
        "--conformance-profiles=ClusterNetworkPolicy".to_string(),
        "--all-features".to_string(),
    ];
    if let Err(reason) = sctp {
        skipped = npapi_sctp_tests(version)?;
        println!(
            "conformance: skipping {} (and the suite's SCTP servers): {reason}",
            skipped.join(", ")
        );
        skip_reasons.push(format!("{}: {reason}", skipped.join(", ")));
        args.push(format!(
            "-test.skip=TestConformanceProfiles/({})$",
            skipped.join("|")
        ));
    }
    let mut command = cluster.in_control_plane(bin);
    command
        .env("KUBECONFIG", cluster.kubeconfig())
        .args(&args)
        .args([
            "--organization=weir",
            "--project=weir",
            "--url=https://github.com/weir",
            &format!("--version={weir}"),
            "--contact=weir",
            "--additional-info=cargo xtask conformance --suite npapi",
        ])
        .arg(format!("--report-output={}", report.display()))
        .current_dir(&cluster.dir);
    let (status, lines) = stream(&mut command, SUITE_TIMEOUT, |l| {
        l.starts_with("--- ") || l == "PASS" || l == "FAIL" || l.starts_with("ok ")
    })?;
    let mut result = parse_go_test(&lines);
    result.skipped.extend(
        skipped
            .iter()
            .map(|t| format!("TestConformanceProfiles/{t}")),
    );
    result.total += skipped.len();
    result.summary = lines
        .iter()
        .filter(|l| !l.starts_with("--- PASS") && !l.starts_with("--- SKIP"))
        .filter(|l| l.matches('/').count() <= 1)
        .cloned()
        .collect();
    result.skip_reasons = skip_reasons;
    result.args = args;
    if result.passed.is_empty() && result.failed.is_empty() {
        bail!("network-policy-api's suite ({status}) ran no test");
    }
    if result.failed.is_empty() && !status.success() {
        bail!("network-policy-api's suite failed ({status}) with no failed test");
    }
    Ok(result)
}

/// The tests below TestConformanceProfiles (the suite's conformance tests, not their
/// subtests) by `--- PASS|FAIL|SKIP: NAME (TIME)`, and the subtests' counts.
fn parse_go_test(lines: &[String]) -> SuiteResult {
    let mut r = SuiteResult::default();
    for line in lines {
        let Some((state, rest)) = line
            .trim()
            .strip_prefix("--- ")
            .and_then(|l| l.split_once(": "))
        else {
            continue;
        };
        let name = rest.rsplit_once(" (").map_or(rest, |(n, _)| n).to_string();
        match name.matches('/').count() {
            1 => {}
            n if n > 1 => {
                match state {
                    "PASS" => r.subtests_passed += 1,
                    "FAIL" => r.subtests_failed += 1,
                    _ => {}
                }
                continue;
            }
            _ => continue,
        }
        r.total += 1;
        match state {
            "PASS" => r.passed.push(name),
            "SKIP" => r.skipped.push(name),
            _ => r.failed.push(name),
        }
    }
    r
}

// ---------------------------------------------------------------------------------------
// cyclonus

/// The cyclonus binary of release `version`, built when not cached.
fn ensure_cyclonus(version: &str) -> Result<PathBuf> {
    let dir = components::root().join(format!("cyclonus-{version}"));
    let bin = dir.join("cyclonus");
    if dir.join(".complete").exists() && bin.is_file() {
        return Ok(bin);
    }
    println!("conformance: building cyclonus {version} (a fresh machine pays this once)");
    let started = Instant::now();
    let go = components::go()?;
    let info = cluster::download(&go, &format!("github.com/mattfenwick/cyclonus@{version}"))?;
    let module = PathBuf::from(info["Dir"].as_str().context("no module Dir named")?);
    let src = dir.join("src");
    let _ = fs::remove_dir_all(&src);
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    // A writable copy: the module cache is read-only, and go may complete go.sum.
    exec(Command::new("cp").arg("-r").arg(&module).arg(&src))?;
    exec(Command::new("chmod").args(["-R", "u+w"]).arg(&src))?;
    exec(
        cluster::go_cmd(&go, &src)
            .args(["build", "-trimpath", "-o"])
            .arg(&bin)
            .arg("./cmd/cyclonus"),
    )?;
    if !bin.is_file() {
        bail!("go build finished but {} is missing", bin.display());
    }
    fs::write(dir.join(".complete"), version)?;
    println!(
        "conformance: built cyclonus {version} in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(bin)
}

/// cyclonus's own default `--exclude` (v0.5.6's `DefaultExcludeTags`): passing
/// `--exclude` replaces it, so it is named again beside `sctp`.
const CYCLONUS_DEFAULT_EXCLUDE: &str =
    "multi-peer,upstream-e2e,example,end-port,namespaces-by-default-label";

/// The descriptions of the cases `cyclonus generate ARGS` would run, from a dry run
/// against its mock cluster (no cluster needed).
fn cyclonus_cases(bin: &Path, args: &[String]) -> Result<Vec<String>> {
    let out = run_timeout(
        Command::new(bin).args(args).args(["--mock", "--dry-run"]),
        Duration::from_secs(120),
    )?;
    if !out.status.success() {
        bail!(
            "cyclonus --mock --dry-run failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(dry_run_cases(&String::from_utf8_lossy(&out.stdout)))
}

/// `test #N: DESCRIPTION` lines of a cyclonus dry run.
fn dry_run_cases(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("test #")?.split_once(": "))
        .map(|(_, d)| d.to_string())
        .collect()
}

fn run_cyclonus(
    cluster: &Cluster,
    bin: &Path,
    focus: Option<&str>,
    sctp: &std::result::Result<(), String>,
) -> Result<SuiteResult> {
    let junit = cluster.dir.join("cyclonus-junit.xml");
    let _ = fs::remove_file(&junit);
    // No cluster DNS here, so not by Service name; and not by Service IP either: cyclonus
    // v0.5.6 never sets the Service IP of a pod it creates or relabels during a case
    // (`Resources::CreatePod`, `Pod::SetLabels`), so its probes to that pod go to an
    // empty host, the prober itself, and "connect" on every port.
    // A pod's probe of its own IP never leaves its network namespace, so no implementation
    // can judge it (Kubernetes' e2e leaves it out too).
    let mut args = vec![
        "generate".to_string(),
        "--destination-type=pod-ip".to_string(),
        "--ignore-loopback=true".to_string(),
    ];
    if let Some(tags) = focus {
        args.push(format!("--include={tags}"));
    }
    let mut exclude = CYCLONUS_DEFAULT_EXCLUDE.to_string();
    let mut skipped = Vec::new();
    let mut skip_reasons = Vec::new();
    match sctp {
        Ok(()) => args.push("--server-protocol=TCP,UDP,SCTP".to_string()),
        Err(reason) => {
            let mut with_sctp = args.clone();
            with_sctp.push(format!("--exclude={exclude}"));
            exclude += ",sctp";
            let mut without = args.clone();
            without.push(format!("--exclude={exclude}"));
            let running = cyclonus_cases(bin, &without)?;
            skipped = cyclonus_cases(bin, &with_sctp)?
                .into_iter()
                .filter(|c| !running.contains(c))
                .collect();
            println!(
                "conformance: skipping cyclonus's {} SCTP cases (tag sctp) and its SCTP servers: {reason}",
                skipped.len()
            );
            skip_reasons.push(format!(
                "cyclonus tag sctp ({} cases): {reason}",
                skipped.len()
            ));
            args.push("--server-protocol=TCP,UDP".to_string());
        }
    }
    args.push(format!("--exclude={exclude}"));
    args.push("--cleanup-namespaces".to_string());
    let mut command = cluster.in_control_plane(bin);
    command
        .env("KUBECONFIG", cluster.kubeconfig())
        .args(&args)
        .arg(format!("--junit-results-file={}", junit.display()))
        .current_dir(&cluster.dir);
    // cyclonus's pass/fail tables (by feature and by tag) mark each row with ✅ or ❌.
    let (status, summary) = stream(&mut command, SUITE_TIMEOUT, |l| {
        l.contains('\u{2705}') || l.contains('\u{274c}')
    })?;
    let text = fs::read_to_string(&junit).with_context(|| {
        format!(
            "cyclonus ({status}) wrote no JUnit results at {}",
            junit.display()
        )
    })?;
    let mut result = parse_cyclonus_junit(&text);
    if !status.success() {
        bail!("cyclonus failed ({status})");
    }
    if result.passed.is_empty() && result.failed.is_empty() {
        bail!("cyclonus ran no case");
    }
    result.total += skipped.len();
    result.skipped = skipped;
    result.summary = summary;
    result.skip_reasons = skip_reasons;
    result.args = args;
    Ok(result)
}

/// Passed and failed cases of cyclonus's JUnit file (a `<testcase name=...>` each, with a
/// `<failure>` inside when it failed).
fn parse_cyclonus_junit(xml: &str) -> SuiteResult {
    let mut r = SuiteResult::default();
    for case in xml.split("<testcase").skip(1) {
        let case = case.split("</testcase>").next().unwrap_or(case);
        let name = case
            // ` name=`: `classname=` comes first and ends the same.
            .split_once(" name=\"")
            .and_then(|(_, rest)| rest.split_once('"'))
            .map_or("", |(n, _)| n)
            .replace("&#34;", "\"")
            .replace("&quot;", "\"")
            .replace("&#39;", "'")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&");
        r.total += 1;
        match case.contains("<failure") {
            true => r.failed.push(name),
            false => r.passed.push(name),
        }
    }
    r
}

// ---------------------------------------------------------------------------------------
// The cluster

/// A `weir-lab cluster` of this run; torn down when dropped, unless already down.
struct Cluster {
    name: String,
    /// weir's image digest, of the archive imported into every node.
    digest: String,
    /// This run's copy of that archive, removed with the cluster.
    archive: PathBuf,
    dir: PathBuf,
    lab: PathBuf,
    nodes: Vec<String>,
    down: bool,
}

impl Cluster {
    fn up(name: &str, nodes: usize) -> Result<Cluster> {
        let lab = workspace_root().join("target/debug/weir-lab");
        let dir = PathBuf::from(format!("/var/tmp/weir-suite-{name}"));
        if dir.join("cluster.json").exists() {
            bail!(
                "a suite's cluster is up in {} (another run of this suite and dataplane, or one \
                 that was killed): `{} cluster --dir {} down` removes it",
                dir.display(),
                lab.display(),
                dir.display()
            );
        }
        // A copy of this run's, so that another run building the image meanwhile changes
        // neither the archive imported nor the digest deployed.
        let (built, digest) = weir_image()?;
        let archive = workspace_root().join(format!("target/suites/{name}.oci.tar"));
        fs::create_dir_all(archive.parent().expect("a file in a directory"))?;
        fs::copy(&built, &archive)
            .with_context(|| format!("copy {} to {}", built.display(), archive.display()))?;
        let (_, digest_after) = weir_image()?;
        if digest_after != digest {
            bail!("weir's image changed while it was copied (another run building it?): run again");
        }
        let mut cluster = Cluster {
            name: name.to_string(),
            digest,
            archive: archive.clone(),
            dir,
            lab,
            nodes: Vec::new(),
            down: false,
        };
        let up = cluster.lab(
            &[
                "up",
                "--nodes",
                &nodes.to_string(),
                "--name",
                name,
                "--image",
                &archive.display().to_string(),
            ],
            Duration::from_secs(600),
        )?;
        let up: Value = serde_json::from_str(&up).context("weir-lab cluster up's JSON")?;
        cluster.nodes = up["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n["name"].as_str().map(str::to_string))
            .collect();
        if cluster.nodes.len() != nodes {
            bail!(
                "weir-lab cluster up made {} nodes: {up}",
                cluster.nodes.len()
            );
        }
        Ok(cluster)
    }

    fn kubeconfig(&self) -> PathBuf {
        self.dir.join("control-plane/kubeconfig-admin")
    }

    /// `program` in the control plane's network namespace, where the API server is.
    fn in_control_plane(&self, program: &Path) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}-cp", self.name))
            .arg("--")
            .arg(program);
        c
    }

    fn lab(&self, args: &[&str], timeout: Duration) -> Result<String> {
        let mut c = Command::new(&self.lab);
        c.arg("cluster").arg("--dir").arg(&self.dir).args(args);
        let out = run_timeout(&mut c, timeout)?;
        if !out.status.success() {
            bail!(
                "weir-lab cluster {} failed ({}):\n{}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn kubectl(&self, args: &[&str]) -> Result<String> {
        let mut all = vec!["kubectl", "--timeout-secs", "240", "--"];
        all.extend_from_slice(args);
        self.lab(&all, Duration::from_secs(300))
    }

    /// deploy/ as it ships, its image pointed at the one imported into every node, every
    /// node labelled with `dataplane`; returns once each node's weir reports that dataplane
    /// converged.
    fn deploy_weir(&self, dataplane: Dataplane) -> Result<()> {
        let every: Vec<Dataplane> = self.nodes.iter().map(|_| dataplane).collect();
        self.deploy_weir_on(&every)
    }

    /// As [`Cluster::deploy_weir`], node I (in `nodes`' order) labelled with
    /// `dataplanes[I]`.
    fn deploy_weir_on(&self, dataplanes: &[Dataplane]) -> Result<()> {
        if dataplanes.len() != self.nodes.len() {
            bail!(
                "{} dataplanes for {} nodes",
                dataplanes.len(),
                self.nodes.len()
            );
        }
        for (n, dataplane) in self.nodes.iter().zip(dataplanes) {
            self.label_dataplane(n, *dataplane)?;
        }
        let digest = &self.digest;
        let overlay = self.dir.join("overlay");
        fs::create_dir_all(&overlay)?;
        let deploy = workspace_root().join("deploy").canonicalize()?;
        // kustomize takes only relative paths to a base.
        let up_to_root = "../".repeat(overlay.components().count() - 1);
        fs::write(
            overlay.join("kustomization.yaml"),
            format!(
                "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- {up_to_root}{}\nimages:\n- name: registry.example/weir\n  newName: docker.io/library/weir\n  digest: {digest}\n",
                deploy.display().to_string().trim_start_matches('/')
            ),
        )?;
        self.kubectl(&["apply", "-k", &overlay.display().to_string()])?;
        self.kubectl(&[
            "rollout",
            "status",
            "-n",
            "kube-system",
            "daemonset/weir",
            "--timeout=180s",
        ])?;
        for (n, dataplane) in self.nodes.iter().zip(dataplanes) {
            self.wait_converged(n, *dataplane)?;
        }
        Ok(())
    }

    fn label_dataplane(&self, node: &str, dataplane: Dataplane) -> Result<()> {
        self.kubectl(&[
            "label",
            "node",
            node,
            "--overwrite",
            &format!("weir.io/dataplane={}", dataplane.name()),
        ])?;
        Ok(())
    }

    /// Returns once `node`'s weir reports `dataplane` converged (`weir status` in its pod).
    fn wait_converged(&self, node: &str, dataplane: Dataplane) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            match self.converged(node, dataplane) {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    return Err(e.context(format!(
                        "weir on {node} did not report {} converged within 180 s",
                        dataplane.name()
                    )))
                }
                Err(_) => std::thread::sleep(Duration::from_secs(2)),
            }
        }
    }

    fn weir_pods(&self) -> Result<Vec<String>> {
        let out = self.kubectl(&[
            "get",
            "pods",
            "-n",
            "kube-system",
            "-l",
            "app.kubernetes.io/name=weir",
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ])?;
        Ok(out.split_whitespace().map(str::to_string).collect())
    }

    /// The weir pod that `node`'s kubelet runs.
    fn weir_pod_on(&self, node: &str) -> Result<String> {
        let out = self.kubectl(&[
            "get",
            "pods",
            "-n",
            "kube-system",
            "-l",
            "app.kubernetes.io/name=weir",
            "--field-selector",
            &format!("spec.nodeName={node}"),
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ])?;
        match out.split_whitespace().collect::<Vec<_>>()[..] {
            [one] => Ok(one.to_string()),
            ref pods => bail!("{} weir pods on {node}: {pods:?}", pods.len()),
        }
    }

    fn converged(&self, node: &str, dataplane: Dataplane) -> Result<()> {
        let p = self.weir_pod_on(node)?;
        let out = self.kubectl(&[
            "exec",
            "-n",
            "kube-system",
            &p,
            "--",
            "/usr/local/bin/weir",
            "status",
            "--output",
            "json",
        ])?;
        let status: Value = serde_json::from_str(&out).context("weir status --output json")?;
        if status["dataplane"] != dataplane.name() || status["converged"] != true {
            bail!("{p} on {node}: {status}");
        }
        Ok(())
    }

    /// Each weir pod's log, for a failed run (the suite prints only its own side).
    fn print_weir_logs(&self) {
        let Ok(pods) = self.weir_pods() else { return };
        for p in pods {
            match self.kubectl(&["logs", "-n", "kube-system", &p, "--tail=200"]) {
                Ok(log) => println!("conformance: --- the log of {p} (last 200 lines)\n{log}"),
                Err(e) => println!("conformance: --- no log of {p}: {e:#}"),
            }
        }
    }

    fn down(&mut self) -> Result<()> {
        self.down = true;
        let _ = fs::remove_file(&self.archive);
        let out = self.lab(&["down"], Duration::from_secs(300))?;
        let report: Value = serde_json::from_str(&out).context("weir-lab cluster down's JSON")?;
        if report["left"] != json!([]) {
            bail!("weir-lab cluster down left something: {report}");
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !self.down {
            if let Err(e) = self.down() {
                eprintln!("conformance: tearing the cluster down after a failure: {e:#}");
            }
        }
    }
}

/// The archive and digest of weir's dev image (`cargo xtask image --dev`).
fn weir_image() -> Result<(PathBuf, String)> {
    let dir = workspace_root().join("target/image-dev");
    let digest = fs::read_to_string(dir.join("digest"))
        .with_context(|| format!("read {}/digest", dir.display()))?;
    let archive = fs::read_dir(&dir)
        .with_context(|| format!("read {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".oci.tar"))
        .with_context(|| format!("no .oci.tar in {}", dir.display()))?;
    Ok((archive, digest.trim().to_string()))
}

// ---------------------------------------------------------------------------------------
// Processes

/// Runs `cmd` to completion with its output captured; kills it after `timeout`.
fn run_timeout(cmd: &mut Command, timeout: Duration) -> Result<Output> {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {shown}"))?;
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut b);
        b
    });
    let err = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut b);
        b
    });
    let status = wait_timeout(&mut child, timeout, &shown)?;
    Ok(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

fn wait_timeout(
    child: &mut std::process::Child,
    timeout: Duration,
    shown: &str,
) -> Result<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{shown} did not finish within {timeout:?}: killed");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Runs `cmd` with its stdout passed through line by line, unchanged; returns its status
/// and the lines `keep` picked. Killed after `timeout`.
fn stream(
    cmd: &mut Command,
    timeout: Duration,
    keep: fn(&str) -> bool,
) -> Result<(std::process::ExitStatus, Vec<String>)> {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {shown}"))?;
    let stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut kept = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            println!("{line}");
            if keep(line.trim()) {
                kept.push(line.trim().to_string());
            }
        }
        kept
    });
    let status = wait_timeout(&mut child, timeout, &shown)?;
    Ok((status, reader.join().unwrap_or_default()))
}

// ---------------------------------------------------------------------------------------
// Results

fn today() -> Result<String> {
    Ok(output(Command::new("date").args(["-u", "+%F"]))
        .context("date -u +%F")?
        .trim()
        .to_string())
}

/// `HEAD`'s short commit, with ` (with uncommitted changes)` when the tree differs.
fn weir_commit() -> String {
    let commit = output(
        Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .current_dir(workspace_root()),
    )
    .unwrap_or_default();
    let dirty = output(
        Command::new("git")
            .args(["status", "--porcelain", "--untracked-files=no"])
            .current_dir(workspace_root()),
    )
    .is_some_and(|s| !s.trim().is_empty());
    format!(
        "{}{}",
        commit.trim(),
        if dirty {
            " (with uncommitted changes)"
        } else {
            ""
        }
    )
}

fn write_results(
    o: &Options,
    k8s: &str,
    v: &Versions,
    weir: &str,
    r: &SuiteResult,
    seconds: f64,
) -> Result<PathBuf> {
    let date = today()?;
    let suite_version = match o.suite {
        Suite::E2e => format!("k8s.io/kubernetes/test/e2e/network/netpol {k8s}"),
        Suite::Npapi => format!("sigs.k8s.io/network-policy-api {}", v.network_policy_api),
        Suite::Cyclonus => format!("github.com/mattfenwick/cyclonus {}", v.cyclonus),
        Suite::RollingSwitch => "weir's rolling dataplane switch".to_string(),
    };
    let data = json!({
        "date": date,
        "source": format!(
            "cargo xtask conformance --suite {} --dataplane {} --nodes {}{} at weir {weir}",
            o.suite.name(),
            o.dataplane.name(),
            o.nodes,
            o.focus.as_ref().map(|f| format!(" --focus '{f}'")).unwrap_or_default(),
        ),
        "conditions": format!(
            "weir-lab cluster: {} kubelet node(s) in network namespaces on one machine ({} cores, kernel {}), ptp CNI, kube-proxy iptables mode; weir's DaemonSet from deploy/ with its dev image",
            o.nodes,
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            output(Command::new("uname").arg("-r")).unwrap_or_default().trim()
        ),
        "report": {
            "suite": o.suite.name(),
            "suite_version": suite_version,
            "dataplane": o.dataplane.name(),
            "nodes": o.nodes,
            "versions": {
                "kubernetes": k8s,
                "containerd": v.containerd,
                "agnhost": v.agnhost[0],
                "weir": weir,
            },
            "args": r.args,
            "skip_reasons": r.skip_reasons,
            "summary": r.summary,
            "total": r.total,
            "passed": r.passed,
            "failed": r.failed,
            "skipped": r.skipped,
            "subtests_passed": r.subtests_passed,
            "subtests_failed": r.subtests_failed,
            "seconds": seconds.round(),
        },
    });
    // A focused run is no measurement of the suite: kept out of docs/results/.
    let dir = match o.focus {
        Some(_) => workspace_root().join("target/suites").join(&date),
        None => workspace_root().join("docs/results").join(&date),
    };
    fs::create_dir_all(&dir)?;
    let file = dir.join(format!(
        "conformance-{}-{}.json",
        o.suite.name(),
        o.dataplane.name()
    ));
    fs::write(&file, serde_json::to_string_pretty(&data)? + "\n")
        .with_context(|| format!("write {}", file.display()))?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ginkgo_report_gives_specs_by_state() {
        let report = r#"[{"SpecReports":[
            {"LeafNodeType":"SynchronizedBeforeSuite","State":"passed"},
            {"LeafNodeType":"It","ContainerHierarchyTexts":["Netpol","NetworkPolicy between server and client"],
             "LeafNodeText":"should support a 'default-deny-ingress' policy [Feature:NetworkPolicy]","LeafNodeLabels":["Feature:NetworkPolicy"],"State":"passed"},
            {"LeafNodeType":"It","ContainerHierarchyTexts":["Netpol"],"LeafNodeText":"b","State":"failed"},
            {"LeafNodeType":"It","ContainerHierarchyTexts":["Netpol"],"LeafNodeText":"c","State":"timedout"},
            {"LeafNodeType":"It","ContainerHierarchyTexts":["Netpol"],"LeafNodeText":"d","State":"skipped"}
        ]}]"#;
        let r = parse_ginkgo_report(report).unwrap();
        assert_eq!(r.total, 4);
        assert_eq!(
            r.passed,
            vec!["Netpol NetworkPolicy between server and client should support a 'default-deny-ingress' policy [Feature:NetworkPolicy]"]
        );
        assert_eq!(r.failed, vec!["Netpol b", "Netpol c"]);
        assert_eq!(r.skipped, vec!["Netpol d"]);
        assert!(parse_ginkgo_report("{}").is_err());
    }

    #[test]
    fn go_test_lines_give_tests_and_subtest_counts() {
        let lines: Vec<String> = [
            "--- FAIL: TestConformanceProfiles (120.00s)",
            "--- PASS: TestConformanceProfiles/CNPAdminTierEgress (10.00s)",
            "--- PASS: TestConformanceProfiles/CNPAdminTierEgress/Should_support_a_deny (1.00s)",
            "--- FAIL: TestConformanceProfiles/CNPAdminTierIngress (30.00s)",
            "--- FAIL: TestConformanceProfiles/CNPAdminTierIngress/a/b (3.00s)",
            "--- SKIP: TestConformanceProfiles/CNPNamedPorts (0.00s)",
            "FAIL",
        ]
        .map(String::from)
        .to_vec();
        let r = parse_go_test(&lines);
        assert_eq!(r.passed, vec!["TestConformanceProfiles/CNPAdminTierEgress"]);
        assert_eq!(
            r.failed,
            vec!["TestConformanceProfiles/CNPAdminTierIngress"]
        );
        assert_eq!(r.skipped, vec!["TestConformanceProfiles/CNPNamedPorts"]);
        assert_eq!((r.total, r.subtests_passed, r.subtests_failed), (3, 1, 1));
    }

    #[test]
    fn tests_that_probe_sctp_are_found_by_name() {
        let source = "var A = suite.ConformanceTest{\n\tShortName: \"CNPA\",\n\tTest: func() {\n\t\tPokeServer(t, \"tcp\")\n\t\tPokeServer(t, \"sctp\",\n\t\t\tip)\n\t},\n}\nvar B = suite.ConformanceTest{\n\tShortName:   \"CNPB\",\n\tTest: func() { PokeServer(t, \"udp\") },\n}\nvar C = suite.ConformanceTest{\n\tShortName: \"CNPCSCTP\",\n\tTest: func() { PokeServer(t, \"sctp\") },\n}\n";
        assert_eq!(sctp_tests_of(source), vec!["CNPA", "CNPCSCTP"]);
    }

    #[test]
    fn cyclonus_cases_come_from_its_dry_run_and_its_junit_file() {
        let dry = "testing 2 cases\n\ntest #1: ingress: empty peers\n - tags: any-peer\ntest #2: set pod selector to [\"a: b\"]\n";
        assert_eq!(
            dry_run_cases(dry),
            vec!["ingress: empty peers", "set pod selector to [\"a: b\"]"]
        );
        let xml = r#"<testsuite tests="0" failures="1" time="" name="cyclonus">
    <properties></properties>
    <testcase classname="" name="ingress: empty peers" time=""></testcase>
    <testcase classname="" name="set pod selector to [&#34;a&#34;]" time="">
        <failure message="" type=""></failure>
    </testcase>
</testsuite>"#;
        let r = parse_cyclonus_junit(xml);
        assert_eq!(r.passed, vec!["ingress: empty peers"]);
        assert_eq!(r.failed, vec!["set pod selector to [\"a\"]"]);
        assert_eq!(r.total, 2);
    }

    #[test]
    fn sctp_servers_are_taken_out_of_the_manifests() {
        let manifests = "kind: StatefulSet\nspec:\n  template:\n    spec:\n      containers:\n        - name: a-client\n          image: agnhost\n        - name: a-80\n          command: [\"/agnhost\"]\n          ports:\n            - containerPort: 80\n        - name: a-9003\n          command: [\"porter\"]\n          env:\n          - name: SERVE_SCTP_PORT_9003\n            value: \"foo\"\n        - name: a-9005\n          env:\n          - name: SERVE_SCTP_PORT_9005\n---\nkind: Namespace\n";
        let made = without_sctp_servers(manifests);
        assert!(!made.contains("SCTP"), "{made}");
        assert!(made.contains("- name: a-client\n          image: agnhost\n        - name: a-80\n"));
        assert!(
            made.contains("            - containerPort: 80\n---\nkind: Namespace\n"),
            "{made}"
        );
    }
}
