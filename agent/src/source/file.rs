//! The file source (lab mode): one multi-document YAML file whose first line is
//! `# generation: N`. The file is polled cheaply (metadata only) and re-read when it
//! changes; the objects it holds are diffed against the previous version into events.
//!
//! A document that cannot be read is reported and the object it names keeps its last
//! good version: a typo in one policy never unprotects anything else. Writers should
//! replace the file atomically (write a temporary file, then rename).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use crate::source::event::{Batch, Event, EventSource, SourceError};
use weir_policy::manifest;
use weir_policy::model::ObjectError;
use weir_policy::model::{Kind, ObjectRef, DEFAULT_NAMESPACE};

/// What identifies a version of the file without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    inode: u64,
    len: u64,
    modified: SystemTime,
}

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok(Stamp {
        inode: m.ino(),
        len: m.len(),
        modified: m.modified()?,
    })
}

pub struct FileSource {
    path: PathBuf,
    poll: Duration,
    stamp: Option<Stamp>,
    content: Option<String>,
    /// The objects of the last version, each as its document's canonical YAML text (a
    /// fraction of the parsed document's size).
    known: BTreeMap<ObjectRef, String>,
}

impl FileSource {
    pub fn new(path: PathBuf, poll: Duration) -> Self {
        FileSource {
            path,
            poll,
            stamp: None,
            content: None,
            known: BTreeMap::new(),
        }
    }

    /// Reads the file if it changed since the last call; `None` when it did not (or does
    /// not exist yet).
    fn read_if_changed(&mut self) -> Result<Option<String>, SourceError> {
        let now = match stamp(&self.path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&self.path, e)),
        };
        if self.stamp == Some(now) {
            return Ok(None);
        }
        let content = match std::fs::read_to_string(&self.path) {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&self.path, e)),
        };
        self.stamp = Some(now);
        if self.content.as_deref() == Some(content.as_str()) {
            return Ok(None);
        }
        self.content = Some(content.clone());
        Ok(Some(content))
    }

    /// The events that turn the previous version into `content`.
    pub fn diff(&mut self, content: &str) -> Batch {
        let mut batch = Batch {
            generation: generation(content),
            received: Some(std::time::Instant::now()),
            ..Default::default()
        };
        if batch.generation.is_none() {
            batch.rejected.push(ObjectError {
                object: self.path.display().to_string(),
                reason: "first line must be `# generation: N`".into(),
            });
        }
        let mut seen = BTreeSet::new();
        // After a YAML syntax error the rest of the file is unreadable: delete nothing.
        let mut may_delete = true;
        let mut upserts = Vec::new();
        let file = self.path.display().to_string();
        for (index, doc) in serde_yaml::Deserializer::from_str(content).enumerate() {
            // 1-based, as `weir_policy::manifest` names documents.
            let document = index + 1;
            let value = match serde_yaml::Value::deserialize(doc) {
                Ok(serde_yaml::Value::Null) => continue,
                Ok(v) => v,
                Err(e) => {
                    batch.rejected.push(ObjectError {
                        object: format!("{} document {document}", self.path.display()),
                        reason: format!("YAML: {e}"),
                    });
                    may_delete = false;
                    break;
                }
            };
            let named = object_ref(&value);
            // The canonical text tells a changed document from an unchanged one; the
            // object is read from the parsed document, not from that text again.
            let object = serde_yaml::to_string(&value)
                .map_err(|e| e.to_string())
                .and_then(|text| {
                    let objects =
                        manifest::parse_value(&file, document, value).map_err(|e| e.to_string())?;
                    Ok((objects, text))
                })
                .and_then(|(mut objects, text)| match objects.len() {
                    1 => Ok((objects.remove(0), text)),
                    n => Err(format!("expected one object, found {n}")),
                });
            match object {
                Ok((object, text)) => {
                    let key = object.key();
                    if !seen.insert(key.clone()) {
                        batch.rejected.push(ObjectError {
                            object: key.to_string(),
                            reason: format!(
                                "document {document} repeats an object defined earlier in the file"
                            ),
                        });
                        continue;
                    }
                    if self.known.get(&key) != Some(&text) {
                        self.known.insert(key, text);
                        upserts.push(Event::upsert(object));
                    }
                }
                Err(reason) => {
                    // The object this document meant keeps its last good version.
                    let object = match named {
                        Some(key) => {
                            let name = key.to_string();
                            seen.insert(key);
                            name
                        }
                        None => format!("{} document {document}", self.path.display()),
                    };
                    batch.rejected.push(ObjectError { object, reason });
                }
            }
        }
        // Namespaces and nodes first, so pods and policies meet their context.
        upserts.sort_by_key(|event| kind_order(event.key().kind));
        batch.events.extend(upserts);
        if may_delete {
            let gone: Vec<ObjectRef> = self
                .known
                .keys()
                .filter(|k| !seen.contains(*k))
                .cloned()
                .collect();
            for key in gone {
                self.known.remove(&key);
                batch.events.push(Event::Delete(key));
            }
        }
        batch
    }
}

fn kind_order(kind: Kind) -> u8 {
    match kind {
        Kind::Namespace => 0,
        Kind::Node => 1,
        Kind::Pod => 2,
        Kind::NetworkPolicy => 3,
        Kind::Service => 4,
        Kind::ClusterNetworkPolicy => 5,
    }
}

fn io(path: &Path, source: std::io::Error) -> SourceError {
    SourceError::Io {
        context: format!("read {}", path.display()),
        source,
    }
}

/// `N` from a first line `# generation: N`.
fn generation(content: &str) -> Option<u64> {
    let first = content.lines().next()?.trim();
    let rest = first
        .strip_prefix('#')?
        .trim()
        .strip_prefix("generation:")?;
    rest.trim().parse().ok()
}

/// The object a document means, as far as it tells, to name it when it cannot be read.
fn object_ref(v: &serde_yaml::Value) -> Option<ObjectRef> {
    let kind = match v.get("kind")?.as_str()? {
        "Namespace" => Kind::Namespace,
        "Pod" => Kind::Pod,
        "NetworkPolicy" => Kind::NetworkPolicy,
        "Node" => Kind::Node,
        "Service" => Kind::Service,
        "ClusterNetworkPolicy" => Kind::ClusterNetworkPolicy,
        _ => return None,
    };
    let meta = v.get("metadata")?;
    let name = meta.get("name")?.as_str()?;
    let namespace = kind.is_namespaced().then(|| {
        meta.get("namespace")
            .and_then(|n| n.as_str())
            .unwrap_or(DEFAULT_NAMESPACE)
    });
    Some(ObjectRef::new(kind, namespace, name))
}

impl EventSource for FileSource {
    async fn next(&mut self) -> Result<Batch, SourceError> {
        loop {
            if let Some(content) = self.read_if_changed()? {
                return Ok(self.diff(&content));
            }
            tokio::time::sleep(self.poll).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: &str = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n";
    const POD_A: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\n  namespace: x\n  labels: {pod: a}\nstatus:\n  podIP: 10.0.0.1\n";
    const POD_A2: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\n  namespace: x\n  labels: {pod: b}\nstatus:\n  podIP: 10.0.0.1\n";
    const POL: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: deny\n  namespace: x\nspec:\n  podSelector: {}\n";

    fn file(generation: u64, docs: &[&str]) -> String {
        format!("# generation: {generation}\n{}", docs.join("---\n"))
    }

    fn summary(batch: &Batch) -> Vec<String> {
        batch
            .events
            .iter()
            .map(|e| match e {
                Event::Upsert(o) => format!("+{}", o.key()),
                Event::Refused(e) => format!("!{}", e.object()),
                Event::Delete(r) => format!("-{r}"),
            })
            .collect()
    }

    #[test]
    fn versions_diff_to_upserts_and_deletes() {
        let mut src = FileSource::new("m.yaml".into(), Duration::from_millis(10));
        let b = src.diff(&file(1, &[POL, POD_A, NS]));
        assert_eq!(b.generation, Some(1));
        assert!(b.rejected.is_empty(), "{:?}", b.rejected);
        assert_eq!(
            summary(&b),
            ["+namespace x", "+pod x/a", "+networkpolicy x/deny"]
        );

        let b = src.diff(&file(2, &[NS, POD_A]));
        assert_eq!(summary(&b), ["-networkpolicy x/deny"]);

        let b = src.diff(&file(3, &[NS, POD_A2]));
        assert_eq!(summary(&b), ["+pod x/a"]);
        assert_eq!(b.generation, Some(3));
    }

    #[test]
    fn an_unreadable_object_keeps_its_last_version_and_is_named() {
        let mut src = FileSource::new("m.yaml".into(), Duration::from_millis(10));
        src.diff(&file(1, &[NS, POD_A]));
        let broken = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\n  namespace: x\nspec: 5\n";
        let b = src.diff(&file(2, &[NS, broken]));
        assert!(summary(&b).is_empty(), "{:?}", summary(&b));
        assert_eq!(b.rejected.len(), 1);
        assert_eq!(b.rejected[0].object, "pod x/a");

        let b = src.diff(&file(3, &[NS, "kind: [unclosed\n"]));
        assert!(
            summary(&b).is_empty(),
            "a YAML error deletes nothing: {:?}",
            summary(&b)
        );
        assert_eq!(b.rejected.len(), 1, "{:?}", b.rejected);

        let b = src.diff("no header\n");
        assert_eq!(b.generation, None);
        assert!(b
            .rejected
            .iter()
            .any(|r| r.reason.contains("# generation: N")));
    }

    #[test]
    fn a_repeated_object_is_refused() {
        let mut src = FileSource::new("m.yaml".into(), Duration::from_millis(10));
        let b = src.diff(&file(1, &[NS, NS]));
        assert_eq!(summary(&b), ["+namespace x"]);
        assert_eq!(b.rejected[0].object, "namespace x");
    }

    #[test]
    fn generation_header_forms() {
        assert_eq!(generation("# generation: 12\n"), Some(12));
        assert_eq!(generation("#generation:7"), Some(7));
        assert_eq!(generation("# generation: x\n"), None);
        assert_eq!(generation("apiVersion: v1\n"), None);
    }
}
