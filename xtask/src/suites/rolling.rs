//! `cargo xtask conformance --suite rolling-switch [--dataplane D] [--nodes N]`: weir's
//! DaemonSet on a kubelet cluster whose node 1 runs dataplane D and every other node the
//! other one; on each node a `client` and an `other` pod, each serving TCP 8080 and probing
//! every other pod continuously (agnhost `connect`, a real connection, from a loop inside
//! the pod). The policies: default-deny ingress, ingress allowed from the clients, and the
//! others' egress allowed only to the others; so a client's probes are allowed, an other's
//! are denied (to a client by its own node's egress, to an other by the destination's
//! ingress). Once every verdict holds, the probes count; then each node's
//! `weir.io/dataplane` label is flipped in turn, waiting for that node's weir to report the
//! new dataplane converged, with some probing between flips. Counted: denied probes that
//! connected (leaks) and allowed probes that did not (outages); both must be zero.
//! Writes `docs/results/DATE/rolling-switch-D.json`.
use std::collections::BTreeMap;
use std::time::SystemTime;

use super::*;

const NS: &str = "weir-rolling";
/// agnhost connect's timeout: a SYN lost in a gap shorter than TCP's first retransmit
/// (1 s) is recovered within it, as any client would; a longer gap is an outage.
const PROBE_TIMEOUT_SECONDS: u32 = 2;
/// Probing before the first flip, after each node reports its new dataplane, and so after
/// the last.
const DWELL: Duration = Duration::from_secs(20);
/// How long the policies may take to hold on every pair once the probes start.
const SETTLE: Duration = Duration::from_secs(180);

/// Each pod: agnhost's netexec on 8080, and once /tmp/targets (`NAME IP` lines) is
/// written, rounds of one agnhost connect to every target in parallel until /tmp/stop
/// exists, each printed as `probe START_EPOCH ROUND TARGET RESULT` (RESULT `OK` or
/// agnhost's error, as TIMEOUT or REFUSED).
fn prober_script() -> String {
    format!(
        r#"/agnhost netexec --http-port=8080 &
until [ -f /tmp/targets ]; do sleep 0.2; done
round=0
until [ -f /tmp/stop ]; do
  round=$((round+1))
  pids=
  while read -r name ip; do
    (
      t=$EPOCHREALTIME
      if out=$(/agnhost connect "$ip:8080" --timeout={PROBE_TIMEOUT_SECONDS}s 2>&1); then r=OK; else r=$(echo ${{out:-NONE}}); fi
      echo "probe $t $round $name $r"
    ) &
    pids="$pids $!"
  done < /tmp/targets
  wait $pids
  sleep 1
done
echo "prober: stopped after $round rounds"
wait
"#
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Client,
    Other,
}

struct Pod {
    name: String,
    node: usize,
    role: Role,
    ip: String,
}

/// What the policies allow: a client's probes, and none of an other's.
fn allowed(from: Role) -> bool {
    from == Role::Client
}

const POLICIES: &str = r#"apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: default-deny-ingress
  namespace: weir-rolling
spec:
  podSelector: {}
  policyTypes: ["Ingress"]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: allow-from-clients
  namespace: weir-rolling
spec:
  podSelector: {}
  policyTypes: ["Ingress"]
  ingress:
  - from:
    - podSelector:
        matchLabels:
          role: client
    ports:
    - port: 8080
      protocol: TCP
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: others-egress-to-others-only
  namespace: weir-rolling
spec:
  podSelector:
    matchLabels:
      role: other
  policyTypes: ["Egress"]
  egress:
  - to:
    - podSelector:
        matchLabels:
          role: other
    ports:
    - port: 8080
      protocol: TCP
"#;

/// One probe as a pod's log line gave it.
#[derive(Debug, Clone)]
struct Probe {
    start: f64,
    round: u64,
    from: String,
    to: String,
    result: String,
}

/// `probe START ROUND TARGET RESULT...` lines of `from`'s log.
fn parse_probes(from: &str, log: &str) -> Vec<Probe> {
    log.lines()
        .filter_map(|l| {
            let mut f = l.trim().splitn(5, ' ');
            if f.next()? != "probe" {
                return None;
            }
            Some(Probe {
                start: f.next()?.parse().ok()?,
                round: f.next()?.parse().ok()?,
                to: f.next()?.to_string(),
                result: f.next().unwrap_or("NONE").to_string(),
                from: from.to_string(),
            })
        })
        .collect()
}

#[derive(Debug, Default, Clone, PartialEq, serde::Serialize)]
struct Counts {
    probes: u64,
    /// Of `probes`, between pods on different nodes.
    cross_node: u64,
    /// Probes the policies allow, and of them those that did not connect (outages).
    allowed: u64,
    allowed_failed: u64,
    /// Probes the policies deny, and of them those that connected (leaks).
    denied: u64,
    denied_connected: u64,
    /// Denied probes that neither connected nor were dropped or refused (agnhost's
    /// `OTHER`, say): no verdict can be read from them.
    unjudged: u64,
}

/// What a probe's result says: connected, held (timed out or refused), or neither.
fn connected(result: &str) -> Option<bool> {
    match result.split([' ', ':']).next() {
        Some("OK") => Some(true),
        Some("TIMEOUT") | Some("REFUSED") => Some(false),
        _ => None,
    }
}

/// Counts the probes that started in `[from, to)`; the wrong ones go to `wrong`.
fn count(
    probes: &[Probe],
    pods: &BTreeMap<String, (usize, Role)>,
    from: f64,
    to: f64,
    wrong: &mut Vec<String>,
) -> Counts {
    let mut c = Counts::default();
    for p in probes.iter().filter(|p| p.start >= from && p.start < to) {
        let (Some(&(src_node, role)), Some(&(dst_node, _))) = (pods.get(&p.from), pods.get(&p.to))
        else {
            continue;
        };
        c.probes += 1;
        if src_node != dst_node {
            c.cross_node += 1;
        }
        let verdict = connected(&p.result);
        let ok = match allowed(role) {
            true => {
                c.allowed += 1;
                let ok = verdict == Some(true);
                c.allowed_failed += u64::from(!ok);
                ok
            }
            false => {
                c.denied += 1;
                c.denied_connected += u64::from(verdict == Some(true));
                c.unjudged += u64::from(verdict.is_none());
                verdict == Some(false)
            }
        };
        if !ok {
            wrong.push(format!(
                "{:.3} round {} {} -> {}: {} ({})",
                p.start,
                p.round,
                p.from,
                p.to,
                p.result,
                if allowed(role) { "allowed" } else { "denied" }
            ));
        }
    }
    c
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A pod running [`prober_script`] on `node`.
fn pod_manifest(name: &str, node: &str, role: Role) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"role": match role { Role::Client => "client", Role::Other => "other" }},
        },
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "agnhost",
                "image": "registry.k8s.io/agnhost:2.56",
                "imagePullPolicy": "Never",
                "command": ["/bin/bash", "-c", prober_script()],
                "ports": [{"containerPort": 8080}],
            }],
        },
    })
}

/// One phase of the run: probing between two instants, and its counts.
#[derive(Debug, serde::Serialize)]
struct Phase {
    phase: String,
    seconds: f64,
    counts: Counts,
}

pub(super) fn run(o: &Options) -> Result<()> {
    if o.focus.is_some() {
        bail!("--focus does not apply to the rolling switch");
    }
    if o.nodes < 2 {
        bail!("the rolling switch runs across nodes: --nodes 2 or more");
    }
    let started = Instant::now();
    let weir = weir_commit();
    cluster::ensure()?;
    let k8s = components::kubernetes_version()?;
    let versions = cluster::versions()?;
    crate::image::for_tests()?;
    exec(crate::cmd::cargo().args(["build", "--package", "weir-lab"]))?;
    println!(
        "rolling-switch: everything built or cached in {:.0}s",
        started.elapsed().as_secs_f64()
    );

    let first = o.dataplane;
    let start: Vec<Dataplane> = (0..o.nodes)
        .map(|i| if i == 0 { first } else { first.other() })
        .collect();
    let cluster_started = Instant::now();
    let mut cluster = Cluster::up(&cluster_name(o.suite, o.dataplane), o.nodes)?;
    let outcome = cluster.deploy_weir_on(&start).and_then(|()| {
        println!(
            "rolling-switch: cluster up with weir on {} in {:.0}s",
            start
                .iter()
                .zip(&cluster.nodes)
                .map(|(d, n)| format!("{n}: {}", d.name()))
                .collect::<Vec<_>>()
                .join(", "),
            cluster_started.elapsed().as_secs_f64()
        );
        probe_while_switching(&cluster, &start)
    });
    if outcome.as_ref().map_or(true, |r| !r.wrong.is_empty()) {
        cluster.print_weir_logs();
    }
    let down = cluster.down();
    let run = outcome?;
    down?;

    let total = run.phases.iter().fold(Counts::default(), |mut t, p| {
        t.probes += p.counts.probes;
        t.cross_node += p.counts.cross_node;
        t.allowed += p.counts.allowed;
        t.allowed_failed += p.counts.allowed_failed;
        t.denied += p.counts.denied;
        t.denied_connected += p.counts.denied_connected;
        t.unjudged += p.counts.unjudged;
        t
    });
    for p in &run.phases {
        println!(
            "rolling-switch: {:<40} {:>5} probes ({} across nodes): allowed {} ({} failed), denied {} ({} connected, {} unjudged)",
            p.phase,
            p.counts.probes,
            p.counts.cross_node,
            p.counts.allowed,
            p.counts.allowed_failed,
            p.counts.denied,
            p.counts.denied_connected,
            p.counts.unjudged
        );
    }
    for w in run.wrong.iter().take(40) {
        println!("rolling-switch: wrong: {w}");
    }
    println!(
        "rolling-switch: {} probes ({} across nodes), {} denied connected, {} allowed failed, {} unjudged",
        total.probes, total.cross_node, total.denied_connected, total.allowed_failed, total.unjudged
    );

    let date = today()?;
    let data = json!({
        "date": date,
        "source": format!(
            "cargo xtask conformance --suite rolling-switch --dataplane {} --nodes {} at weir {weir}",
            first.name(),
            o.nodes
        ),
        "conditions": format!(
            "weir-lab cluster: {} kubelet nodes in network namespaces on one machine ({} cores, kernel {}), ptp CNI, kube-proxy iptables mode; weir's DaemonSet from deploy/ with its dev image; {} pods (a client and an other per node) each probing every other with agnhost connect (timeout {PROBE_TIMEOUT_SECONDS} s) in rounds 1 s apart",
            o.nodes,
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            output(Command::new("uname").arg("-r")).unwrap_or_default().trim(),
            2 * o.nodes
        ),
        "report": {
            "nodes": o.nodes,
            "start": cluster_dataplanes(&run.nodes, &start),
            "flips": run.flips,
            "phases": run.phases,
            "total": total,
            "max_round_gap_seconds": (run.max_gap * 10.0).round() / 10.0,
            "wrong": run.wrong.iter().take(100).collect::<Vec<_>>(),
            "probe_timeout_seconds": PROBE_TIMEOUT_SECONDS,
            "versions": {
                "kubernetes": k8s,
                "containerd": versions.containerd,
                "agnhost": versions.agnhost[0],
                "weir": weir,
            },
            "seconds": started.elapsed().as_secs_f64().round(),
        },
    });
    let dir = workspace_root().join("docs/results").join(&date);
    fs::create_dir_all(&dir)?;
    let file = dir.join(format!("rolling-switch-{}.json", first.name()));
    fs::write(&file, serde_json::to_string_pretty(&data)? + "\n")
        .with_context(|| format!("write {}", file.display()))?;
    println!("rolling-switch: {}", file.display());
    if total.denied_connected + total.allowed_failed + total.unjudged > 0 {
        bail!(
            "the rolling switch let {} denied probes connect and failed {} allowed ones ({} unjudged)",
            total.denied_connected,
            total.allowed_failed,
            total.unjudged
        );
    }
    if total.allowed == 0 || total.denied == 0 || total.cross_node == 0 {
        bail!("the rolling switch counted no allowed, no denied or no cross-node probe: {total:?}");
    }
    Ok(())
}

fn cluster_dataplanes(nodes: &[String], dataplanes: &[Dataplane]) -> Value {
    nodes
        .iter()
        .zip(dataplanes)
        .map(|(n, d)| (n.clone(), Value::from(d.name())))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

struct Run {
    nodes: Vec<String>,
    flips: Vec<Value>,
    phases: Vec<Phase>,
    wrong: Vec<String>,
    /// The longest time between two rounds of one pod within the counted window: a prober
    /// that stalled would hide an outage.
    max_gap: f64,
}

fn probe_while_switching(cluster: &Cluster, start: &[Dataplane]) -> Result<Run> {
    let mut manifests = vec![json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS},
    })];
    let mut pods = Vec::new();
    for (i, node) in cluster.nodes.iter().enumerate() {
        for role in [Role::Client, Role::Other] {
            let name = format!(
                "{}-{}",
                match role {
                    Role::Client => "client",
                    Role::Other => "other",
                },
                i + 1
            );
            manifests.push(pod_manifest(&name, node, role));
            pods.push(Pod {
                name,
                node: i,
                role,
                ip: String::new(),
            });
        }
    }
    let file = cluster.dir.join("rolling-pods.json");
    fs::write(
        &file,
        serde_json::to_string(&json!({"apiVersion": "v1", "kind": "List", "items": manifests}))?,
    )?;
    cluster.kubectl(&["apply", "-f", &file.display().to_string()])?;
    let policies = cluster.dir.join("rolling-policies.yaml");
    fs::write(&policies, POLICIES)?;
    cluster.kubectl(&["apply", "-f", &policies.display().to_string()])?;
    cluster.kubectl(&[
        "wait",
        "-n",
        NS,
        "--for=condition=Ready",
        "pod",
        "--all",
        "--timeout=180s",
    ])?;
    for p in &mut pods {
        p.ip = cluster
            .kubectl(&[
                "get",
                "pod",
                "-n",
                NS,
                &p.name,
                "-o",
                "jsonpath={.status.podIP}",
            ])?
            .trim()
            .to_string();
        if p.ip.is_empty() {
            bail!("pod {} has no IP", p.name);
        }
    }
    let roles: BTreeMap<String, (usize, Role)> = pods
        .iter()
        .map(|p| (p.name.clone(), (p.node, p.role)))
        .collect();
    for p in &pods {
        let mut args = vec![
            "exec".to_string(),
            "-n".into(),
            NS.into(),
            p.name.clone(),
            "--".into(),
            "/bin/bash".into(),
            "-c".into(),
            r#"printf '%s %s\n' "$@" > /tmp/targets.new && mv /tmp/targets.new /tmp/targets"#
                .into(),
            "targets".into(),
        ];
        for q in pods.iter().filter(|q| q.name != p.name) {
            args.push(q.name.clone());
            args.push(q.ip.clone());
        }
        cluster.kubectl(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
    }
    let collect = || -> Result<Vec<Probe>> {
        let mut all = Vec::new();
        for p in &pods {
            let log = cluster.kubectl(&["logs", "-n", NS, &p.name])?;
            all.extend(parse_probes(&p.name, &log));
        }
        Ok(all)
    };

    // The policies hold on every pair before anything counts.
    let settle_deadline = Instant::now() + SETTLE;
    let t0 = loop {
        let since = now();
        std::thread::sleep(Duration::from_secs(u64::from(
            2 * PROBE_TIMEOUT_SECONDS + 3,
        )));
        let probes = collect()?;
        let mut wrong = Vec::new();
        let c = count(&probes, &roles, since, f64::MAX, &mut wrong);
        let every_pod_a_round = pods.iter().all(|p| {
            probes
                .iter()
                .filter(|q| q.from == p.name && q.start >= since)
                .count()
                >= pods.len() - 1
        });
        if wrong.is_empty() && every_pod_a_round {
            println!(
                "rolling-switch: every verdict holds ({} probes in a window); counting from now",
                c.probes
            );
            break since;
        }
        if Instant::now() > settle_deadline {
            bail!(
                "the policies did not hold on every pair within {SETTLE:?}: {}",
                wrong.join("; ")
            );
        }
    };

    std::thread::sleep(DWELL);
    let mut marks = vec![("before the first flip (mixed dataplanes)".to_string(), t0)];
    let mut flips = Vec::new();
    for (i, node) in cluster.nodes.iter().enumerate() {
        let to = start[i].other();
        let at = now();
        marks.push((
            format!("flip {node}: {} -> {}", start[i].name(), to.name()),
            at,
        ));
        cluster.label_dataplane(node, to)?;
        cluster.wait_converged(node, to)?;
        let seconds = now() - at;
        println!(
            "rolling-switch: {node} reports {} converged {seconds:.1}s after its label changed",
            to.name()
        );
        flips.push(json!({
            "node": node,
            "from": start[i].name(),
            "to": to.name(),
            "seconds_to_converged": (seconds * 10.0).round() / 10.0,
        }));
        std::thread::sleep(DWELL);
    }
    let end = now();
    for p in &pods {
        cluster.kubectl(&["exec", "-n", NS, &p.name, "--", "touch", "/tmp/stop"])?;
    }
    // The last rounds started before `end` finish within a probe's timeout.
    std::thread::sleep(Duration::from_secs(u64::from(PROBE_TIMEOUT_SECONDS + 2)));
    let probes = collect()?;

    let mut wrong = Vec::new();
    let mut phases = Vec::new();
    for (k, (phase, from)) in marks.iter().enumerate() {
        let to = marks.get(k + 1).map_or(end, |m| m.1);
        phases.push(Phase {
            phase: phase.clone(),
            seconds: ((to - from) * 10.0).round() / 10.0,
            counts: count(&probes, &roles, *from, to, &mut wrong),
        });
    }
    let mut max_gap: f64 = 0.0;
    for p in &pods {
        let mut starts: Vec<f64> = probes
            .iter()
            .filter(|q| q.from == p.name && q.start >= t0 && q.start < end)
            .map(|q| q.start)
            .collect();
        if starts.is_empty() {
            bail!("{} made no probe while counted", p.name);
        }
        starts.sort_by(f64::total_cmp);
        starts.insert(0, t0);
        starts.push(end);
        for w in starts.windows(2) {
            max_gap = max_gap.max(w[1] - w[0]);
        }
    }
    Ok(Run {
        nodes: cluster.nodes.clone(),
        flips,
        phases,
        wrong,
        max_gap,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_lines_are_parsed_and_judged_by_the_source_role() {
        let log = "netexec started\nprobe 100.5 1 other-2 OK\nprobe 101.0 1 client-2 TIMEOUT\n\
                   probe 102.0 2 client-1 OTHER: connect: no route to host\nprobe x 1 a OK\n";
        let a = parse_probes(
            "client-1",
            "probe 100.0 1 other-1 OK\nprobe 100.1 1 other-2 REFUSED\n",
        );
        let b = parse_probes("other-1", log);
        assert_eq!(a.len(), 2);
        assert_eq!(b.len(), 3);
        assert_eq!(b[2].result, "OTHER: connect: no route to host");
        let roles: BTreeMap<String, (usize, Role)> = [
            ("client-1", 0, Role::Client),
            ("other-1", 0, Role::Other),
            ("client-2", 1, Role::Client),
            ("other-2", 1, Role::Other),
        ]
        .into_iter()
        .map(|(n, i, r)| (n.to_string(), (i, r)))
        .collect();
        let all: Vec<Probe> = a.into_iter().chain(b).collect();
        let mut wrong = Vec::new();
        let c = count(&all, &roles, 0.0, f64::MAX, &mut wrong);
        assert_eq!(
            c,
            Counts {
                probes: 5,
                cross_node: 3,
                allowed: 2,
                allowed_failed: 1,
                denied: 3,
                denied_connected: 1,
                unjudged: 1,
            }
        );
        assert_eq!(wrong.len(), 3, "{wrong:?}");
        // Outside the window, nothing counts.
        assert_eq!(count(&all, &roles, 200.0, 300.0, &mut wrong).probes, 0);
    }
}
