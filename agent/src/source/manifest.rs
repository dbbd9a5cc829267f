//! Kubernetes YAML manifest files → [`Object`]s: reads them and hands the text to
//! [`weir_policy::manifest`], which parses it.

use std::path::{Path, PathBuf};

use weir_policy::manifest::{parse_named, ManifestError};
use weir_policy::model::Object;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Parse(#[from] ManifestError),
}

/// Reads every file, in order.
pub fn load_files(paths: &[PathBuf]) -> Result<Vec<Object>, LoadError> {
    let mut objects = Vec::new();
    for path in paths {
        objects.extend(load_file(path)?);
    }
    Ok(objects)
}

pub fn load_file(path: &Path) -> Result<Vec<Object>, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })?;
    Ok(parse_named(&path.display().to_string(), &text)?)
}
