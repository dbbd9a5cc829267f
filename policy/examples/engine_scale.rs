//! Measures the policy engine at scale: cold compile of a synthetic cluster (default
//! 100 namespaces × 200 pods = 20,000 pods, 10 policies per namespace = 1,000 policies)
//! and the cost of single events. Run in release:
//! `cargo run --release -p weir-policy --example engine_scale [namespaces] [pods-per-namespace]`

use std::time::Instant;

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, Namespace, Pod, PodIP, PodSpec, PodStatus,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use weir_policy::model::Object;
use weir_policy::Engine;

fn meta(namespace: Option<&str>, name: &str, labels: &[(&str, String)]) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        labels: Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        ),
        ..Default::default()
    }
}

fn pod(ns: usize, j: usize, app_suffix: &str) -> Object {
    let namespace = format!("ns-{ns:03}");
    let labels = [
        ("app", format!("app-{}{app_suffix}", j % 20)),
        ("tier", ["web", "db", "cache"][j % 3].to_owned()),
    ];
    let port = |name: &str, number: i32| ContainerPort {
        name: Some(name.to_owned()),
        container_port: number,
        protocol: Some("TCP".to_owned()),
        ..Default::default()
    };
    Object::Pod(Pod {
        metadata: meta(Some(&namespace), &format!("p-{j}"), &labels),
        spec: Some(PodSpec {
            node_name: Some(format!("node-{}", j % 50)),
            containers: vec![Container {
                name: "c".into(),
                ports: Some(vec![
                    port("http", 8080 + (j % 2) as i32),
                    port("metrics", 9090),
                ]),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            pod_ips: Some(vec![
                PodIP {
                    ip: format!("10.{}.{}.{}", ns / 250, ns % 250, j % 250 + j / 250),
                },
                PodIP {
                    ip: format!("fd00::{ns:x}:{j:x}"),
                },
            ]),
            ..Default::default()
        }),
    })
}

fn policy(ns: usize, k: usize) -> Object {
    let namespace = format!("ns-{ns:03}");
    let spec = match k {
        0 => "podSelector: {}\npolicyTypes: [Ingress]".to_owned(),
        1..=4 => format!("podSelector: {{matchLabels: {{app: app-{k}}}}}\ningress:\n- from: [{{podSelector: {{matchLabels: {{app: app-{}}}}}}}]\n  ports: [{{port: 80}}, {{port: 443, endPort: 450}}]", k + 1),
        5 => format!("podSelector: {{matchLabels: {{tier: web}}}}\ningress:\n- from: [{{namespaceSelector: {{matchLabels: {{team: t{}}}}}}}]\n  ports: [{{port: http}}]", ns % 10),
        6 => "podSelector: {matchLabels: {tier: db}}\ningress:\n- from: [{namespaceSelector: {matchLabels: {env: prod}}, podSelector: {matchLabels: {tier: web}}}]".to_owned(),
        7 => format!("podSelector: {{matchExpressions: [{{key: app, operator: In, values: [app-7, app-8]}}]}}\negress:\n- to: [{{ipBlock: {{cidr: 10.0.0.0/8, except: [10.0.{}.0/24]}}}}]", ns % 250),
        8 => "podSelector: {matchLabels: {tier: cache}}\negress:\n- to: [{namespaceSelector: {matchLabels: {env: prod}}, podSelector: {matchLabels: {tier: db}}}]\n  ports: [{port: http}]".to_owned(),
        _ => "podSelector: {matchExpressions: [{key: tier, operator: NotIn, values: [db]}]}\ningress:\n- from: [{podSelector: {}}]\n  ports: [{port: metrics}]".to_owned(),
    };
    let spec: String = spec.lines().map(|l| format!("  {l}\n")).collect();
    let yaml = format!("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p{k}, namespace: {namespace}}}\nspec:\n{spec}");
    let np: NetworkPolicy = serde_yaml::from_str(&yaml).expect("generated policy parses");
    Object::NetworkPolicy(np)
}

fn namespace(ns: usize, env: &str) -> Object {
    let labels = [("team", format!("t{}", ns % 10)), ("env", env.to_owned())];
    Object::Namespace(Namespace {
        metadata: meta(None, &format!("ns-{ns:03}"), &labels),
        ..Default::default()
    })
}

fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    println!(
        "{what:<58} {:>10.2} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    out
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let namespaces = args.first().copied().unwrap_or(100);
    let pods = args.get(1).copied().unwrap_or(200);
    let mut objects = Vec::new();
    for ns in 0..namespaces {
        objects.push(namespace(ns, if ns % 2 == 0 { "prod" } else { "dev" }));
        objects.extend((0..pods).map(|j| pod(ns, j, "")));
        objects.extend((0..10).map(|k| policy(ns, k)));
    }
    println!(
        "{namespaces} namespaces, {} pods, {} policies",
        namespaces * pods,
        namespaces * 10
    );
    for local in [None, Some("node-0".to_owned())] {
        let label = local.clone().unwrap_or_else(|| "every pod local".into());
        let mut engine = Engine::new(local);
        let objects = objects.clone();
        let (_, errors) = timed(&format!("cold compile ({label})"), || engine.load(objects));
        assert!(errors.is_empty(), "{errors:?}");
        let d = engine.desired();
        let rules: usize = d
            .endpoints
            .values()
            .map(|e| e.ingress.rules.len() + e.egress.rules.len())
            .sum();
        let members: usize = d.sets.values().map(|s| s.members.len()).sum();
        println!(
            "  {} endpoints, {rules} rules, {} sets, {members} members",
            d.endpoints.len(),
            d.sets.len()
        );
        let delta = timed("  pod label change (app-3 -> app-3x)", || {
            engine.upsert(pod(0, 3, "x")).unwrap()
        });
        println!(
            "    delta: {} endpoints changed, {} members added, {} removed",
            delta.endpoints_changed.len(),
            delta.members_added.len(),
            delta.members_removed.len()
        );
        timed("  new pod", || engine.upsert(pod(1, pods + 1, "")).unwrap());
        timed("  policy update", || engine.upsert(policy(2, 5)).unwrap());
        let delta = timed("  namespace label change (env prod -> dev)", || {
            engine.upsert(namespace(0, "dev")).unwrap()
        });
        println!(
            "    delta: {} members added, {} removed",
            delta.members_added.len(),
            delta.members_removed.len()
        );
        timed("  full rebuild", || engine.rebuild());
    }
}
