//! Server mode (`weir-lab up --api server`): the lab's objects written to its own
//! kube-apiserver (see [`super::control_plane`]) instead of only to `objects.yaml`, and the
//! agent running in cluster mode as the DaemonSet would, with the DaemonSet's RBAC.
//!
//! Writes are server-side applies by the field manager `weir-lab` (so a label removed
//! from a manifest is removed on the server, as with `kubectl apply --server-side`). What
//! a kubelet, scheduler or controller-manager would do, the lab does: `spec.nodeName`,
//! Pod status through the status subresource, a placeholder image for containers that
//! name none, deletion with grace period 0 and namespace finalization.

use std::collections::BTreeMap;

use futures::{stream, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{HostIP, Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::Client;
use serde_json::json;

use super::objects::ObjectSet;
use weir::source::digest::StateDigest;
use weir_policy::cluster_policy::ClusterNetworkPolicy;
use weir_policy::model::{Kind, Object, ObjectRef};

const MANAGER: &str = "weir-lab";
/// Containers need an image on a real server; nothing pulls it here.
const PLACEHOLDER_IMAGE: &str = "registry.k8s.io/pause:3.10";

/// deploy/'s ServiceAccount, ClusterRole and ClusterRoleBinding: the agent's identity is
/// bound by exactly what the DaemonSet ships.
const RBAC: &[&str] = &[
    include_str!("../../deploy/serviceaccount.yaml"),
    include_str!("../../deploy/clusterrole.yaml"),
    include_str!("../../deploy/clusterrolebinding.yaml"),
];

fn apply_params() -> PatchParams {
    PatchParams::apply(MANAGER).force()
}

/// Applies deploy/'s RBAC objects.
pub async fn install_rbac(client: &Client) -> Result<(), String> {
    for text in RBAC {
        let object: DynamicObject =
            serde_yaml::from_str(text).map_err(|e| format!("deploy/ RBAC manifest: {e}"))?;
        let types = object
            .types
            .clone()
            .ok_or("deploy/ RBAC manifest without apiVersion/kind")?;
        let (group, version) = match types.api_version.split_once('/') {
            Some((g, v)) => (g.to_string(), v.to_string()),
            None => (String::new(), types.api_version.clone()),
        };
        let resource = ApiResource {
            group,
            version,
            api_version: types.api_version.clone(),
            kind: types.kind.clone(),
            plural: format!("{}s", types.kind.to_lowercase()),
        };
        let name = object.metadata.name.clone().unwrap_or_default();
        let api: Api<DynamicObject> = match &object.metadata.namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
            None => Api::all_with(client.clone(), &resource),
        };
        api.patch(&name, &apply_params(), &Patch::Apply(&object))
            .await
            .map_err(|e| format!("applying {} {name}: {e}", types.kind))?;
    }
    Ok(())
}

/// Whether the server's authorizer lets `user` (in `groups`) list pods, the agent's first
/// request; asked as a SubjectAccessReview, so the answer is not itself a request of the
/// agent's identity (the audit log holds only the agent's own).
pub async fn can_list_pods(client: &Client, user: &str, groups: &[&str]) -> Result<(), String> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.to_string()),
            groups: Some(groups.iter().map(|g| g.to_string()).collect()),
            resource_attributes: Some(ResourceAttributes {
                verb: Some("list".into()),
                resource: Some("pods".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&Default::default(), &review)
        .await
        .map_err(|e| e.to_string())?;
    match answer.status {
        Some(s) if s.allowed => Ok(()),
        other => Err(format!("not allowed: {other:?}")),
    }
}

/// Write requests [`sync`] keeps in flight within a class of objects.
const WRITES_IN_FLIGHT: usize = 16;

/// What [`sync`] wrote: each object's new resourceVersion (None: deleted), and the
/// monotonic clock (ns) just before its first write request (None: nothing to write).
pub struct Synced {
    pub written: Vec<(ObjectRef, Option<String>)>,
    pub first_write_ns: Option<u64>,
}

/// Makes the server hold exactly `after`: applies what is new or changed since `before`,
/// deletes what is gone. Namespaces and the Node first, namespaces last when deleting.
/// With `schedule_on`, every Pod is put on that node (the lab's pods all live on its one
/// node); without, Pods keep their `spec.nodeName`.
pub async fn sync(
    client: &Client,
    before: &ObjectSet,
    after: &ObjectSet,
    schedule_on: Option<&str>,
) -> Result<Synced, String> {
    let mut written = Vec::new();
    let order = |o: &&Object| match o.kind() {
        Kind::Namespace => 0,
        Kind::Node => 1,
        _ => 2,
    };
    let mut changed: Vec<&Object> = after
        .objects
        .iter()
        .filter(|(key, o)| before.objects.get(*key) != Some(*o))
        .map(|(_, o)| o)
        .collect();
    changed.sort_by_key(order);
    let mut gone: Vec<&ObjectRef> = before
        .objects
        .keys()
        .filter(|key| !after.objects.contains_key(*key))
        .collect();
    // Namespaces last: their objects go first.
    gone.sort_by_key(|k| k.kind == Kind::Namespace);
    let first_write_ns = (!changed.is_empty() || !gone.is_empty()).then(weir::kernel::monotonic_ns);
    // Each class in turn (namespaces and the Node before what lives in them), its objects
    // WRITES_IN_FLIGHT at a time: a world of 20,000 pods took 9 minutes one request at a
    // time.
    for class in changed.chunk_by(|a, b| order(a) == order(b)) {
        let versions: Vec<Option<String>> = stream::iter(class)
            .map(|object| async move {
                apply(client, object, schedule_on)
                    .await
                    .map_err(|e| format!("{}: {e}", object.key()))
            })
            .buffered(WRITES_IN_FLIGHT)
            .try_collect()
            .await?;
        written.extend(class.iter().map(|o| o.key()).zip(versions));
    }
    for class in gone.chunk_by(|a, b| (a.kind == Kind::Namespace) == (b.kind == Kind::Namespace)) {
        stream::iter(class)
            .map(|key| async move { delete(client, key).await.map_err(|e| format!("{key}: {e}")) })
            .buffered(WRITES_IN_FLIGHT)
            .try_collect::<Vec<()>>()
            .await?;
        written.extend(class.iter().map(|key| ((*key).clone(), None)));
    }
    Ok(Synced {
        written,
        first_write_ns,
    })
}

/// Server-side applies one object; returns its new resourceVersion.
async fn apply(
    client: &Client,
    object: &Object,
    schedule_on: Option<&str>,
) -> Result<Option<String>, kube::Error> {
    let pp = apply_params();
    let written = match object {
        Object::Namespace(ns) => {
            let api: Api<Namespace> = Api::all(client.clone());
            api.patch(name(ns.metadata.name.as_ref()), &pp, &Patch::Apply(ns))
                .await?
                .metadata
        }
        Object::Node(node) => {
            let api: Api<Node> = Api::all(client.clone());
            let written = api
                .patch(name(node.metadata.name.as_ref()), &pp, &Patch::Apply(node))
                .await?
                .metadata;
            // A manifest's status (addresses), as its kubelet would report it.
            match &node.status {
                Some(status) => {
                    let status = json!({ "apiVersion": "v1", "kind": "Node", "status": status });
                    api.patch_status(
                        name(node.metadata.name.as_ref()),
                        &pp,
                        &Patch::Apply(&status),
                    )
                    .await?
                    .metadata
                }
                None => written,
            }
        }
        Object::NetworkPolicy(np) => {
            let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), namespace(object));
            api.patch(name(np.metadata.name.as_ref()), &pp, &Patch::Apply(np))
                .await?
                .metadata
        }
        Object::ClusterNetworkPolicy(cnp) => {
            let api: Api<ClusterNetworkPolicy> = Api::all(client.clone());
            api.patch(name(cnp.metadata.name.as_ref()), &pp, &Patch::Apply(cnp))
                .await?
                .metadata
        }
        Object::Service(svc) => {
            let api: Api<Service> = Api::namespaced(client.clone(), namespace(object));
            api.patch(name(svc.metadata.name.as_ref()), &pp, &Patch::Apply(svc))
                .await?
                .metadata
        }
        Object::Pod(pod) => {
            let api: Api<Pod> = Api::namespaced(client.clone(), namespace(object));
            let mut spec_only = pod.clone();
            let status = spec_only.status.take();
            let spec = spec_only.spec.get_or_insert_with(Default::default);
            if let Some(node) = schedule_on {
                spec.node_name = Some(node.to_string());
            }
            for c in &mut spec.containers {
                c.image.get_or_insert_with(|| PLACEHOLDER_IMAGE.to_string());
            }
            let pod_name = name(pod.metadata.name.as_ref());
            api.patch(pod_name, &pp, &Patch::Apply(&spec_only)).await?;
            // Scheduled on the lab's node: its address, as a kubelet reports it (kube-router
            // takes a pod as its node's own by it).
            let mut status = status;
            if schedule_on.is_some() {
                let status = status.get_or_insert_with(Default::default);
                status.host_ip = Some(super::world::NODE_IP.to_string());
                status.host_ips = Some(vec![HostIP {
                    ip: super::world::NODE_IP.to_string(),
                }]);
            }
            let status = json!({ "apiVersion": "v1", "kind": "Pod", "status": status });
            api.patch_status(pod_name, &pp, &Patch::Apply(&status))
                .await?
                .metadata
        }
    };
    Ok(written.resource_version)
}

async fn delete(client: &Client, key: &ObjectRef) -> Result<(), kube::Error> {
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    let ns = key.namespace.as_deref().unwrap_or("default");
    let result = match key.kind {
        Kind::Pod => Api::<Pod>::namespaced(client.clone(), ns)
            .delete(&key.name, &now)
            .await
            .map(drop),
        Kind::NetworkPolicy => Api::<NetworkPolicy>::namespaced(client.clone(), ns)
            .delete(&key.name, &now)
            .await
            .map(drop),
        Kind::Service => Api::<Service>::namespaced(client.clone(), ns)
            .delete(&key.name, &now)
            .await
            .map(drop),
        Kind::Node => Api::<Node>::all(client.clone())
            .delete(&key.name, &now)
            .await
            .map(drop),
        Kind::ClusterNetworkPolicy => Api::<ClusterNetworkPolicy>::all(client.clone())
            .delete(&key.name, &now)
            .await
            .map(drop),
        Kind::Namespace => {
            let api = Api::<Namespace>::all(client.clone());
            api.delete(&key.name, &now).await.map(drop)?;
            // No namespace controller: finalize it, or it stays Terminating for ever.
            let finalize = json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": { "name": key.name },
                "spec": { "finalizers": [] }
            });
            match api
                .replace_subresource("finalize", &key.name, &Default::default(), &finalize)
                .await
            {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                Err(e) => Err(e),
            }
        }
    };
    match result {
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        other => other,
    }
}

/// Makes the server's lab-managed EndpointSlices `after` (by namespace and name): applies
/// the new and changed ones, deletes those gone. kube-proxy reads them; the agent does not.
pub async fn sync_endpoint_slices(
    client: &Client,
    before: &BTreeMap<(String, String), EndpointSlice>,
    after: &BTreeMap<(String, String), EndpointSlice>,
) -> Result<(), String> {
    let pp = apply_params();
    for ((ns, name), slice) in after {
        if before.get(&(ns.clone(), name.clone())) == Some(slice) {
            continue;
        }
        Api::<EndpointSlice>::namespaced(client.clone(), ns)
            .patch(name, &pp, &Patch::Apply(slice))
            .await
            .map_err(|e| format!("endpointslice {ns}/{name}: {e}"))?;
    }
    let now = DeleteParams::default();
    for (ns, name) in before.keys().filter(|k| !after.contains_key(*k)) {
        match Api::<EndpointSlice>::namespaced(client.clone(), ns)
            .delete(name, &now)
            .await
        {
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(format!("endpointslice {ns}/{name}: {e}")),
            Ok(_) => {}
        }
    }
    Ok(())
}

/// Gives the Node an InternalIP in its status, as a kubelet would: kube-proxy waits (30 s)
/// for its Node to have addresses before it starts.
pub async fn set_node_address(client: &Client, node: &str, ip: &str) -> Result<(), String> {
    let status = json!({
        "apiVersion": "v1", "kind": "Node",
        "status": { "addresses": [{ "type": "InternalIP", "address": ip }] }
    });
    Api::<Node>::all(client.clone())
        .patch_status(node, &apply_params(), &Patch::Apply(&status))
        .await
        .map(drop)
        .map_err(|e| format!("node {node} status: {e}"))
}

/// The resourceVersion of everything the agent watches, listed from the server: every
/// Namespace, Pod, NetworkPolicy, Service, Node and ClusterNetworkPolicy (none where its
/// CRD is not installed, as the agent sees it).
pub async fn list_versions(client: &Client) -> Result<BTreeMap<ObjectRef, String>, kube::Error> {
    let mut out = BTreeMap::new();
    let lp = ListParams::default();
    let mut add = |kind: Kind, m: &ObjectMeta| {
        let key = ObjectRef::new(kind, m.namespace.as_deref(), name(m.name.as_ref()));
        out.insert(key, m.resource_version.clone().unwrap_or_default());
    };
    for o in Api::<Namespace>::all(client.clone()).list(&lp).await? {
        add(Kind::Namespace, &o.metadata);
    }
    for o in Api::<Pod>::all(client.clone()).list(&lp).await? {
        add(Kind::Pod, &o.metadata);
    }
    for o in Api::<NetworkPolicy>::all(client.clone()).list(&lp).await? {
        add(Kind::NetworkPolicy, &o.metadata);
    }
    for o in Api::<Service>::all(client.clone()).list(&lp).await? {
        add(Kind::Service, &o.metadata);
    }
    match Api::<ClusterNetworkPolicy>::all(client.clone())
        .list(&lp)
        .await
    {
        Ok(list) => {
            for o in list {
                add(Kind::ClusterNetworkPolicy, &o.metadata);
            }
        }
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(e),
    }
    out.extend(list_versions_of_nodes(client).await?);
    Ok(out)
}

/// Every Node's resourceVersion.
pub async fn list_versions_of_nodes(
    client: &Client,
) -> Result<BTreeMap<ObjectRef, String>, kube::Error> {
    Ok(Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .into_iter()
        .map(|o| {
            let key = ObjectRef::new(Kind::Node, None, name(o.metadata.name.as_ref()));
            (key, o.metadata.resource_version.unwrap_or_default())
        })
        .collect())
}

/// The digest of `versions` (see [`weir::source::digest`]).
pub fn digest(versions: &BTreeMap<ObjectRef, String>) -> String {
    let mut digest = StateDigest::default();
    for (key, rv) in versions {
        digest.toggle(StateDigest::entry(key, rv));
    }
    digest.to_string()
}

/// The digest of what the agent watches, listed from the server.
pub async fn server_digest(client: &Client) -> Result<String, kube::Error> {
    Ok(digest(&list_versions(client).await?))
}

fn name(n: Option<&String>) -> &str {
    n.map(String::as_str).unwrap_or_default()
}

fn namespace(o: &Object) -> &str {
    o.metadata().namespace.as_deref().unwrap_or("default")
}
