//! A small in-test Kubernetes API server: list and watch (chunked JSON lines) for the four
//! resources the agent watches, bookmarks, node PATCH and Event POST. Only what the agent's
//! requests need.
//!
//! Kept only for what the real kube-apiserver (tests/tests/cluster_mode.rs) cannot be made
//! to do on demand: send a BOOKMARK now and end a watch at once (the real server bookmarks
//! about once a minute and ends watches after minutes), and accept a NetworkPolicy that
//! weir refuses (the real server's validation rejects what weir's does, so the refusal path
//! and its Event can only be reached through a server of another version). Restarts,
//! 410 Gone after compaction, relists, RBAC and the Node label are tested on the real
//! server.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub const NAMESPACES: &str = "/api/v1/namespaces";
pub const NODES: &str = "/api/v1/nodes";
pub const PODS: &str = "/api/v1/pods";
pub const POLICIES: &str = "/apis/networking.k8s.io/v1/networkpolicies";
pub const SERVICES: &str = "/api/v1/services";

#[derive(Default)]
struct Collection {
    /// By `namespace/name`.
    items: BTreeMap<String, Value>,
    watches: Vec<mpsc::UnboundedSender<Bytes>>,
    /// Every watch event with its resourceVersion, replayed to watches that start earlier.
    history: Vec<(u64, Bytes)>,
    /// The resourceVersion of every watch request, in order.
    watch_versions: Vec<String>,
    lists: usize,
}

#[derive(Default)]
struct State {
    rv: u64,
    /// Watches from an older resourceVersion get 410 Gone (compacted history).
    oldest_rv: u64,
    collections: HashMap<&'static str, Collection>,
    node_patches: Vec<Value>,
    events: Vec<Value>,
}

type Body = UnsyncBoxBody<Bytes, Infallible>;

fn full(v: &Value) -> Body {
    Full::new(Bytes::from(v.to_string())).boxed_unsync()
}

fn key(object: &Value) -> String {
    let meta = &object["metadata"];
    format!(
        "{}/{}",
        meta["namespace"].as_str().unwrap_or(""),
        meta["name"].as_str().unwrap_or("")
    )
}

/// apiVersion and kind of a collection's objects (bookmarks carry them too).
fn type_of(collection: &str) -> (&'static str, &'static str) {
    match collection {
        NAMESPACES => ("v1", "Namespace"),
        NODES => ("v1", "Node"),
        PODS => ("v1", "Pod"),
        SERVICES => ("v1", "Service"),
        _ => ("networking.k8s.io/v1", "NetworkPolicy"),
    }
}

fn collection_of(path: &str) -> Option<&'static str> {
    [NAMESPACES, NODES, PODS, POLICIES, SERVICES]
        .into_iter()
        .find(|c| *c == path)
}

pub struct MockApi {
    state: Arc<Mutex<State>>,
    addr: SocketAddr,
    server: Option<JoinHandle<()>>,
}

impl MockApi {
    pub async fn start() -> MockApi {
        let state = Arc::new(Mutex::new(State {
            rv: 100,
            ..Default::default()
        }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Some(tokio::spawn(serve(listener, state.clone())));
        MockApi {
            state,
            addr,
            server,
        }
    }

    pub fn client(&self) -> kube::Client {
        let url = format!("http://{}", self.addr).parse().unwrap();
        kube::Client::try_from(kube::Config::new(url)).unwrap()
    }

    fn stamp(state: &mut State, mut object: Value) -> Value {
        state.rv += 1;
        object["metadata"]["resourceVersion"] = json!(state.rv.to_string());
        object
    }

    /// Stores the object and tells the watchers (ADDED or MODIFIED).
    pub fn apply(&self, collection: &'static str, object: Value) {
        let mut s = self.state.lock().unwrap();
        let object = Self::stamp(&mut s, object);
        let rv = s.rv;
        let c = s.collections.entry(collection).or_default();
        let kind = if c.items.insert(key(&object), object.clone()).is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        Self::send(c, rv, &json!({ "type": kind, "object": object }));
    }

    pub fn bookmark(&self, collection: &'static str) -> String {
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        let (rv, mark) = (s.rv, s.rv.to_string());
        let c = s.collections.entry(collection).or_default();
        let (api_version, kind) = type_of(collection);
        let object = json!({ "apiVersion": api_version, "kind": kind, "metadata": { "resourceVersion": mark } });
        Self::send(c, rv, &json!({ "type": "BOOKMARK", "object": object }));
        mark
    }

    /// Ends the open watches of a collection (as an API server does at its timeout).
    pub fn end_watches(&self, collection: &'static str) {
        let mut s = self.state.lock().unwrap();
        s.collections.entry(collection).or_default().watches.clear();
    }

    pub fn watch_versions(&self, collection: &'static str) -> Vec<String> {
        let s = self.state.lock().unwrap();
        s.collections
            .get(collection)
            .map(|c| c.watch_versions.clone())
            .unwrap_or_default()
    }

    pub fn lists(&self, collection: &'static str) -> usize {
        let s = self.state.lock().unwrap();
        s.collections.get(collection).map_or(0, |c| c.lists)
    }

    pub fn node_patches(&self) -> Vec<Value> {
        self.state.lock().unwrap().node_patches.clone()
    }

    pub fn events(&self) -> Vec<Value> {
        self.state.lock().unwrap().events.clone()
    }

    /// Waits until `check` holds (bounded: panics after 20 s).
    pub async fn wait_for(&self, what: &str, check: impl Fn(&MockApi) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !check(self) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn send(c: &mut Collection, rv: u64, event: &Value) {
        let line = Bytes::from(format!("{event}\n"));
        c.history.push((rv, line.clone()));
        c.watches.retain(|w| w.send(line.clone()).is_ok());
    }
}

impl Drop for MockApi {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

fn gone() -> Value {
    json!({ "type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "too old resource version", "reason": "Expired", "code": 410 } })
}

async fn serve(listener: TcpListener, state: Arc<Mutex<State>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(handle(req, state).await) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn query(req: &Request<hyper::body::Incoming>) -> HashMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn handle(req: Request<hyper::body::Incoming>, state: Arc<Mutex<State>>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let params = query(&req);
    let method = req.method().clone();
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let mut s = state.lock().unwrap();
    if method == Method::PATCH && path.starts_with(&format!("{NODES}/")) {
        s.node_patches.push(body);
        let node = s
            .collections
            .entry(NODES)
            .or_default()
            .items
            .values()
            .next()
            .cloned()
            .unwrap_or(json!({}));
        return Response::new(full(&node));
    }
    if method == Method::POST && path.starts_with("/apis/events.k8s.io/v1/namespaces/") {
        s.events.push(body.clone());
        let mut r = Response::new(full(&body));
        *r.status_mut() = StatusCode::CREATED;
        return r;
    }
    let Some(name) = collection_of(&path) else {
        let mut r = Response::new(full(&json!({ "kind": "Status", "code": 404 })));
        *r.status_mut() = StatusCode::NOT_FOUND;
        return r;
    };
    let rv = s.rv;
    let oldest = s.oldest_rv;
    let c = s.collections.entry(name).or_default();
    if params.get("watch").map(String::as_str) == Some("true") {
        let from = params.get("resourceVersion").cloned().unwrap_or_default();
        c.watch_versions.push(from.clone());
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        let from = from.parse::<u64>().unwrap_or(0);
        if from < oldest {
            let _ = tx.send(Bytes::from(format!("{}\n", gone())));
        } else {
            for (_, line) in c.history.iter().filter(|(rv, _)| *rv > from) {
                let _ = tx.send(line.clone());
            }
            c.watches.push(tx);
        }
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
        });
        return Response::new(StreamBody::new(stream.boxed()).boxed_unsync());
    }
    c.lists += 1;
    let list = json!({
        "apiVersion": "v1", "kind": "List",
        "metadata": { "resourceVersion": rv.to_string() },
        "items": c.items.values().cloned().collect::<Vec<_>>(),
    });
    Response::new(full(&list))
}
