//! Pods in the API server's protobuf encoding (`application/vnd.kubernetes.protobuf`),
//! decoded into messages that hold only the fields enforcement reads: the protobuf
//! counterpart of [`LeanPod`](crate::source::lean_pod::LeanPod). Every other field of a Pod
//! (managedFields, other settings of a container, conditions) is skipped by prost by its
//! wire type, without being allocated.
//!
//! The tags are those of `k8s.io/api/core/v1/generated.proto` and
//! `k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto` (proto2: every scalar is
//! optional). A field the engine starts to read must be added here and to `lean_pod.rs`:
//! the tests decode Pods a real kube-apiserver encoded in both encodings
//! (`testdata/pods.*`) and compare the engine's view of each with the full JSON Pod's.
//!
//! On the wire: a whole object or list is `k8s\0` and a `runtime.Unknown` around the
//! message; a watch stream is frames of a 4-byte big-endian length and a `WatchEvent`
//! (without that envelope), whose object is enveloped.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, PodIP, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use prost::Message;
use tokio::io::AsyncReadExt;

/// What prefixes a whole object or list in the protobuf encoding.
const MAGIC: &[u8] = b"k8s\0";

/// A protobuf body the agent cannot read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("a protobuf object without the `k8s\\0` prefix")]
    NoPrefix,
    #[error("undecodable protobuf {what}: {source}")]
    Decode {
        what: &'static str,
        #[source]
        source: prost::DecodeError,
    },
    #[error("a protobuf {what} without its object")]
    Missing { what: &'static str },
    #[error("malformed protobuf: {0}")]
    Malformed(&'static str),
    #[error("reading a protobuf body: {0}")]
    Read(#[source] std::io::Error),
}

fn decode<M: Message + Default>(what: &'static str, bytes: &[u8]) -> Result<M, WireError> {
    M::decode(bytes).map_err(|source| WireError::Decode { what, source })
}

/// The message inside a whole object's envelope.
fn unwrap_envelope(bytes: &[u8]) -> Result<Vec<u8>, WireError> {
    let inner = bytes.strip_prefix(MAGIC).ok_or(WireError::NoPrefix)?;
    let unknown: Unknown = decode("envelope", inner)?;
    unknown.raw.ok_or(WireError::Missing { what: "envelope" })
}

#[derive(Clone, PartialEq, Message)]
struct Unknown {
    #[prost(bytes = "vec", optional, tag = "2")]
    raw: Option<Vec<u8>>,
}

#[derive(Clone, PartialEq, Message)]
struct ListMeta {
    #[prost(string, optional, tag = "2")]
    resource_version: Option<String>,
    #[prost(string, optional, tag = "3")]
    continue_: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
pub struct PodMessage {
    #[prost(message, optional, tag = "1")]
    metadata: Option<Metadata>,
    #[prost(message, optional, tag = "2")]
    spec: Option<Spec>,
    #[prost(message, optional, tag = "3")]
    status: Option<Status>,
}

#[derive(Clone, PartialEq, Message)]
struct Metadata {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(string, optional, tag = "3")]
    namespace: Option<String>,
    #[prost(string, optional, tag = "5")]
    uid: Option<String>,
    /// The watcher resumes from it; the state digest covers it.
    #[prost(string, optional, tag = "6")]
    resource_version: Option<String>,
    #[prost(btree_map = "string, string", tag = "11")]
    labels: BTreeMap<String, String>,
}

/// A bookmark's object: only its resourceVersion and annotations (a streaming list's end
/// is the annotation `k8s.io/initial-events-end`), which no Pod needs kept.
#[derive(Clone, PartialEq, Message)]
struct BookmarkMessage {
    #[prost(message, optional, tag = "1")]
    metadata: Option<BookmarkMetadata>,
}

#[derive(Clone, PartialEq, Message)]
struct BookmarkMetadata {
    #[prost(string, optional, tag = "6")]
    resource_version: Option<String>,
    #[prost(btree_map = "string, string", tag = "12")]
    annotations: BTreeMap<String, String>,
}

#[derive(Clone, PartialEq, Message)]
struct Spec {
    #[prost(message, repeated, tag = "2")]
    containers: Vec<ContainerMessage>,
    #[prost(string, optional, tag = "10")]
    node_name: Option<String>,
    #[prost(bool, optional, tag = "11")]
    host_network: Option<bool>,
}

#[derive(Clone, PartialEq, Message)]
struct ContainerMessage {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(message, repeated, tag = "6")]
    ports: Vec<PortMessage>,
}

#[derive(Clone, PartialEq, Message)]
struct PortMessage {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(int32, optional, tag = "2")]
    host_port: Option<i32>,
    #[prost(int32, optional, tag = "3")]
    container_port: Option<i32>,
    #[prost(string, optional, tag = "4")]
    protocol: Option<String>,
    #[prost(string, optional, tag = "5")]
    host_ip: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
struct Status {
    #[prost(string, optional, tag = "1")]
    phase: Option<String>,
    #[prost(string, optional, tag = "6")]
    pod_ip: Option<String>,
    #[prost(message, repeated, tag = "12")]
    pod_ips: Vec<PodIpMessage>,
}

#[derive(Clone, PartialEq, Message)]
struct PodIpMessage {
    #[prost(string, optional, tag = "1")]
    ip: Option<String>,
}

/// `meta.v1.Status`, as an error or a watch's ERROR event carries it.
#[derive(Clone, PartialEq, Message)]
struct StatusMessage {
    #[prost(string, optional, tag = "2")]
    status: Option<String>,
    #[prost(string, optional, tag = "3")]
    message: Option<String>,
    #[prost(string, optional, tag = "4")]
    reason: Option<String>,
    #[prost(int32, optional, tag = "6")]
    code: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct WatchEventMessage {
    #[prost(string, optional, tag = "1")]
    r#type: Option<String>,
    #[prost(message, optional, tag = "2")]
    object: Option<RawExtension>,
}

#[derive(Clone, PartialEq, Message)]
struct RawExtension {
    #[prost(bytes = "vec", optional, tag = "1")]
    raw: Option<Vec<u8>>,
}

/// A string as JSON would have it: Go's protobuf encoder writes an empty string where
/// JSON leaves the field out (`omitempty`), and an empty `podIP` is no address at all.
fn present(s: Option<String>) -> Option<String> {
    s.filter(|s| !s.is_empty())
}

impl PodMessage {
    fn into_pod(self) -> Pod {
        let metadata = self.metadata.unwrap_or_default();
        let labels = (!metadata.labels.is_empty()).then_some(metadata.labels);
        Pod {
            metadata: ObjectMeta {
                name: present(metadata.name),
                namespace: present(metadata.namespace),
                uid: present(metadata.uid),
                resource_version: present(metadata.resource_version),
                labels,
                ..ObjectMeta::default()
            },
            spec: self.spec.map(|s| PodSpec {
                node_name: present(s.node_name),
                host_network: s.host_network.filter(|&b| b),
                containers: s
                    .containers
                    .into_iter()
                    .map(|c| Container {
                        name: c.name.unwrap_or_default(),
                        // JSON leaves `ports` out when there are none; so does this.
                        ports: (!c.ports.is_empty()).then(|| {
                            c.ports
                                .into_iter()
                                .map(|p| ContainerPort {
                                    name: present(p.name),
                                    host_port: p.host_port.filter(|&p| p != 0),
                                    container_port: p.container_port.unwrap_or_default(),
                                    protocol: present(p.protocol),
                                    host_ip: present(p.host_ip),
                                })
                                .collect()
                        }),
                        ..Container::default()
                    })
                    .collect(),
                ..PodSpec::default()
            }),
            status: self.status.map(|s| PodStatus {
                phase: present(s.phase),
                pod_ip: present(s.pod_ip),
                pod_ips: (!s.pod_ips.is_empty()).then(|| {
                    s.pod_ips
                        .into_iter()
                        .map(|i| PodIP {
                            ip: i.ip.unwrap_or_default(),
                        })
                        .collect()
                }),
                ..PodStatus::default()
            }),
        }
    }
}

impl StatusMessage {
    fn into_status(self) -> kube::core::Status {
        kube::core::Status {
            status: match self.status.as_deref() {
                Some("Success") => Some(kube::core::response::StatusSummary::Success),
                Some("Failure") => Some(kube::core::response::StatusSummary::Failure),
                _ => None,
            },
            code: self
                .code
                .and_then(|c| u16::try_from(c).ok())
                .unwrap_or_default(),
            message: self.message.unwrap_or_default(),
            reason: self.reason.unwrap_or_default(),
            metadata: None,
            details: None,
        }
    }
}

/// A listed Pod, still in its lean message: made a [`Pod`] only when handed on, so that a
/// page of thousands is never held as full `Pod`s at once.
// Protobuf, the common case, unboxed; JSON, the fallback, boxed.
#[allow(clippy::large_enum_variant)]
pub enum LeanItem {
    Protobuf(PodMessage),
    /// Boxed: a `LeanPod` keeps a whole `ObjectMeta`, twice a message's size.
    Json(Box<crate::source::lean_pod::LeanPod>),
}

impl LeanItem {
    pub fn into_pod(self) -> Pod {
        match self {
            LeanItem::Protobuf(m) => m.into_pod(),
            LeanItem::Json(p) => p.into_pod(),
        }
    }
}

/// How a page of a Pod list ends: where the list stands, and the page after it.
#[derive(Debug, Default, PartialEq)]
pub struct PageEnd {
    pub resource_version: Option<String>,
    pub continue_token: Option<String>,
}

/// The largest single object accepted, in a list or a watch frame; etcd stores no object
/// above 1.5 MiB.
pub const MAX_OBJECT: usize = 16 << 20;

/// Reads a PodList response's body as it arrives, handing each Pod to `each` as soon as
/// its bytes are in, so that the agent never holds the whole body: a kube-apiserver
/// serving from its watch cache sends every Pod of the cluster in one response (42 MB at
/// 50,000 pods), whatever the page size asked for.
///
/// The body is `k8s\0`, then a `runtime.Unknown` whose field 2 (`raw`) is the PodList:
/// field 1 its `ListMeta`, field 2 each item. Fields of either that the agent does not read
/// are skipped by their wire type. A body cut short, even between two Pods, is an error,
/// never a shorter list.
pub async fn read_pod_list<R>(body: R, mut each: impl FnMut(LeanItem)) -> Result<PageEnd, WireError>
where
    R: tokio::io::AsyncBufRead + Unpin,
{
    let mut wire = Wire { body, read: 0 };
    let mut magic = [0; MAGIC.len()];
    wire.body
        .read_exact(&mut magic)
        .await
        .map_err(WireError::Read)?;
    if magic != MAGIC {
        return Err(WireError::NoPrefix);
    }
    let mut end = None;
    // The envelope runs to the end of the body.
    while let Some((field, wire_type)) = wire.key_or_end().await? {
        if field != 2 || wire_type != LEN {
            wire.skip(wire_type).await?;
            continue;
        }
        let list_end = wire.length().await?.saturating_add(wire.read);
        let mut metadata = ListMeta::default();
        while wire.read < list_end {
            let (field, wire_type) = wire.key().await?;
            match (field, wire_type) {
                (1, LEN) => metadata = decode("PodList metadata", &wire.message().await?)?,
                (2, LEN) => each(LeanItem::Protobuf(decode("Pod", &wire.message().await?)?)),
                _ => wire.skip(wire_type).await?,
            }
        }
        if wire.read != list_end {
            return Err(WireError::Malformed("a PodList longer than its length"));
        }
        end = Some(PageEnd {
            resource_version: present(metadata.resource_version),
            continue_token: present(metadata.continue_),
        });
    }
    end.ok_or(WireError::Missing { what: "envelope" })
}

/// The protobuf wire type of a length-delimited field.
const LEN: u8 = 2;

/// A key's field number and wire type.
fn split_key(key: u64) -> (u64, u8) {
    (key >> 3, (key & 7) as u8)
}

/// A protobuf body being read, and how many bytes of it have been.
struct Wire<R> {
    body: R,
    read: u64,
}

impl<R: tokio::io::AsyncBufRead + Unpin> Wire<R> {
    async fn byte(&mut self) -> Result<Option<u8>, WireError> {
        let mut byte = [0];
        match self.body.read(&mut byte).await.map_err(WireError::Read)? {
            0 => Ok(None),
            _ => {
                self.read += 1;
                Ok(Some(byte[0]))
            }
        }
    }

    async fn next_byte(&mut self) -> Result<u8, WireError> {
        self.byte()
            .await?
            .ok_or_else(|| WireError::Read(std::io::ErrorKind::UnexpectedEof.into()))
    }

    /// A varint whose first byte is read already.
    async fn varint_from(&mut self, first: u8) -> Result<u64, WireError> {
        let mut byte = first;
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
            byte = self.next_byte().await?;
        }
        Err(WireError::Malformed("a varint longer than ten bytes"))
    }

    async fn varint(&mut self) -> Result<u64, WireError> {
        let first = self.next_byte().await?;
        self.varint_from(first).await
    }

    /// A field's number and wire type.
    async fn key(&mut self) -> Result<(u64, u8), WireError> {
        Ok(split_key(self.varint().await?))
    }

    /// A field's number and wire type, or `None` at the end of the body.
    async fn key_or_end(&mut self) -> Result<Option<(u64, u8)>, WireError> {
        let Some(first) = self.byte().await? else {
            return Ok(None);
        };
        Ok(Some(split_key(self.varint_from(first).await?)))
    }

    async fn length(&mut self) -> Result<u64, WireError> {
        self.varint().await
    }

    /// A length-delimited field's bytes.
    async fn message(&mut self) -> Result<Vec<u8>, WireError> {
        let len = self.length().await?;
        if len > MAX_OBJECT as u64 {
            return Err(WireError::Malformed("an object above 16 MiB"));
        }
        let mut bytes = vec![0; len as usize];
        self.body
            .read_exact(&mut bytes)
            .await
            .map_err(WireError::Read)?;
        self.read += len;
        Ok(bytes)
    }

    /// Skips a field the agent does not read.
    async fn skip(&mut self, wire_type: u8) -> Result<(), WireError> {
        let len = match wire_type {
            0 => {
                self.varint().await?;
                return Ok(());
            }
            1 => 8,
            LEN => self.length().await?,
            5 => 4,
            _ => return Err(WireError::Malformed("an unknown wire type")),
        };
        let skipped = tokio::io::copy(&mut (&mut self.body).take(len), &mut tokio::io::sink())
            .await
            .map_err(WireError::Read)?;
        self.read += skipped;
        if skipped != len {
            return Err(WireError::Read(std::io::ErrorKind::UnexpectedEof.into()));
        }
        Ok(())
    }
}

/// An error response's body (a `Status`).
pub fn status(body: &[u8]) -> Result<kube::core::Status, WireError> {
    let status: StatusMessage = decode("Status", &unwrap_envelope(body)?)?;
    Ok(status.into_status())
}

/// One event of a Pod watch, as either encoding carries it.
#[derive(Debug)]
pub enum PodEvent {
    Added(Pod),
    Modified(Pod),
    Deleted(Pod),
    Bookmark {
        resource_version: String,
        /// The end of a streaming list's initial events.
        initial_events_end: bool,
    },
    Error(kube::core::Status),
}

/// One frame of a protobuf watch stream (without its length).
pub fn watch_event(frame: &[u8]) -> Result<PodEvent, WireError> {
    let event: WatchEventMessage = decode("WatchEvent", frame)?;
    let raw = event
        .object
        .and_then(|o| o.raw)
        .ok_or(WireError::Missing { what: "WatchEvent" })?;
    let object = unwrap_envelope(&raw)?;
    let pod = |bytes: &[u8]| decode::<PodMessage>("Pod", bytes).map(PodMessage::into_pod);
    Ok(match event.r#type.as_deref().unwrap_or_default() {
        "ADDED" => PodEvent::Added(pod(&object)?),
        "MODIFIED" => PodEvent::Modified(pod(&object)?),
        "DELETED" => PodEvent::Deleted(pod(&object)?),
        "BOOKMARK" => {
            let mark: BookmarkMessage = decode("bookmark", &object)?;
            let metadata = mark.metadata.unwrap_or_default();
            PodEvent::Bookmark {
                resource_version: metadata.resource_version.unwrap_or_default(),
                initial_events_end: metadata
                    .annotations
                    .get("k8s.io/initial-events-end")
                    .is_some_and(|v| v == "true"),
            }
        }
        // ERROR, and any type a newer server might add, which the watch cannot go on from.
        _ => PodEvent::Error(decode::<StatusMessage>("Status", &object)?.into_status()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::model::PodInfo;

    fn testdata(name: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/source/kube/testdata")
            .join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// What the engine reads of a Pod, and the version the watcher resumes from.
    fn seen(pod: &Pod) -> (Option<PodInfo>, Option<String>) {
        let (ns, name) = (
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.name.as_deref().unwrap_or_default(),
        );
        (
            PodInfo::from_pod(ns, name, pod).ok(),
            pod.metadata.resource_version.clone(),
        )
    }

    /// A list's body read as it arrives, in pieces of `piece` bytes.
    async fn read_list(body: &[u8], piece: usize) -> Result<(Vec<Pod>, PageEnd), WireError> {
        let pieces: Vec<std::io::Result<bytes::Bytes>> = body
            .chunks(piece)
            .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
            .collect();
        let reader = tokio_util::io::StreamReader::new(futures::stream::iter(pieces));
        let mut pods = Vec::new();
        let end = read_pod_list(reader, |p| pods.push(p.into_pod())).await?;
        Ok((pods, end))
    }

    #[tokio::test]
    async fn a_protobuf_list_reads_as_the_full_json_one() {
        let body = testdata("pods.list.pb");
        let (pods, page) = read_list(&body, 4096).await.unwrap();
        // However the body arrives: each Pod and the list's end span pieces.
        for piece in [1, 2, 3, 7, 64, 1000] {
            let (again, end) = read_list(&body, piece).await.unwrap();
            assert_eq!(again, pods, "in pieces of {piece}");
            assert_eq!(end, page, "in pieces of {piece}");
        }
        let full: kube::core::ObjectList<Pod> =
            serde_json::from_slice(&testdata("pods.list.json")).unwrap();
        assert_eq!(pods.len(), 4);
        assert_eq!(pods.len(), full.items.len());
        for (lean, full) in pods.iter().zip(&full.items) {
            assert_eq!(seen(lean), seen(full), "{:?}", full.metadata.name);
        }
        // The data holds what the comparison must cover: every pod valid, one with both
        // families, one on the host's network, one with an SCTP port, one without address.
        let infos: Vec<PodInfo> = pods.iter().map(|p| seen(p).0.unwrap()).collect();
        assert!(infos.iter().any(|i| i.ipv4.is_some() && i.ipv6.is_some()));
        assert!(infos.iter().any(|i| i.host_network));
        assert!(infos.iter().any(|i| i.ports.len() == 4));
        assert!(infos.iter().any(|i| i.ipv4.is_none() && i.ipv6.is_none()));
        assert_eq!(page.resource_version, full.metadata.resource_version);
        assert_eq!(page.continue_token.as_deref().unwrap_or(""), "");
    }

    #[test]
    fn a_protobuf_watch_reads_as_the_full_json_one() {
        let mut frames = testdata("pods.watch.pb");
        let mut events = Vec::new();
        let mut rest = &frames[..];
        while !rest.is_empty() {
            let len = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
            events.push(watch_event(&rest[4..4 + len]).unwrap());
            rest = &rest[4 + len..];
        }
        let json = String::from_utf8(testdata("pods.watch.json")).unwrap();
        let full: Vec<kube::core::WatchEvent<Pod>> = json
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(events.len(), full.len());
        assert_eq!(events.len(), 8, "4 pods, the bookmark, 2 changes, a delete");
        use kube::core::WatchEvent as W;
        for (lean, full) in events.iter().zip(&full) {
            match (lean, full) {
                (PodEvent::Added(a), W::Added(b))
                | (PodEvent::Modified(a), W::Modified(b))
                | (PodEvent::Deleted(a), W::Deleted(b)) => assert_eq!(seen(a), seen(b)),
                (
                    PodEvent::Bookmark {
                        resource_version,
                        initial_events_end,
                    },
                    W::Bookmark(b),
                ) => {
                    assert_eq!(resource_version, &b.metadata.resource_version);
                    assert!(initial_events_end);
                }
                (lean, full) => panic!("{lean:?} against {full:?}"),
            }
        }
        // A frame cut short is an error, not a pod with fields missing.
        frames.truncate(4 + 100);
        let len = u32::from_be_bytes(frames[..4].try_into().unwrap()) as usize;
        assert!(len > 100);
        assert!(watch_event(&frames[4..]).is_err());
    }

    #[test]
    fn an_error_response_reads_as_its_status() {
        let status = status(&testdata("status.404.pb")).unwrap();
        assert_eq!(status.code, 404);
        assert_eq!(status.reason, "NotFound");
        assert!(status.message.contains("nobody"), "{}", status.message);
        assert!(status.is_failure());
    }

    #[tokio::test]
    async fn a_body_without_the_prefix_is_refused() {
        assert!(matches!(
            read_list(b"{}\n\n", 10).await,
            Err(WireError::NoPrefix)
        ));
    }

    /// A list cut anywhere before the end of its PodList is an error, never fewer Pods:
    /// the agent would otherwise take the missing Pods as deleted.
    #[tokio::test]
    async fn a_list_cut_short_is_an_error_wherever_it_is_cut() {
        let body = testdata("pods.list.pb");
        let whole = read_list(&body, 4096).await.unwrap();
        // What may be cut and still read: the envelope's last fields after the whole
        // PodList, its empty contentEncoding and contentType (two bytes each), cut at
        // either's start.
        let mut read_whole = 0;
        for cut in 0..body.len() {
            if let Ok(read) = read_list(&body[..cut], 512).await {
                assert!(read == whole, "a body cut at {cut} read as fewer Pods");
                read_whole += 1;
            }
        }
        assert_eq!(read_whole, 2, "cuts in the envelope's trailer");
    }
}
