//! One `ipset restore` run and the parser for its failure message. `ipset restore` stops
//! at the first failing line and reports it as `Error in line N: <reason>`; every line
//! before N has been applied.

use crate::exec;

/// Where and why an `ipset restore` run stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreFailure {
    /// 1-based line of the script that failed; `None` when ipset did not say.
    pub line: Option<usize>,
    pub message: String,
}

#[derive(Debug, thiserror::Error)]
pub enum IpsetRestoreError {
    #[error(transparent)]
    Exec(#[from] exec::ExecError),
    #[error("ipset restore stopped at line {}: {}", .0.line.map_or("?".to_string(), |l| l.to_string()), .0.message)]
    Stopped(RestoreFailure),
}

/// Parses ipset's stderr. Only the first `Error in line` report counts (ipset stops
/// there); any other non-empty text becomes the message with no line.
pub fn parse_restore_error(stderr: &str) -> RestoreFailure {
    const MARKER: &str = "Error in line ";
    for line in stderr.lines() {
        let Some(at) = line.find(MARKER) else {
            continue;
        };
        let rest = &line[at + MARKER.len()..];
        let digits_end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let Ok(number) = rest[..digits_end].parse::<usize>() else {
            continue;
        };
        let message = rest[digits_end..].trim_start_matches(':').trim();
        return RestoreFailure {
            line: Some(number),
            message: message.to_string(),
        };
    }
    RestoreFailure {
        line: None,
        message: stderr.trim().to_string(),
    }
}

/// Feeds `script` to `ipset restore`, with `-exist` when asked (create/add/destroy
/// become no-ops when already true; flush of a missing set still fails).
pub fn run(script: &str, exist: bool) -> Result<(), IpsetRestoreError> {
    let args: &[&str] = if exist {
        &["restore", "-exist"]
    } else {
        &["restore"]
    };
    let out = exec::run("ipset", args, Some(script))?;
    if out.success {
        Ok(())
    } else {
        Err(IpsetRestoreError::Stopped(parse_restore_error(&out.stderr)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_captured_in_use_error() {
        let f = parse_restore_error(include_str!("testdata/ipset-restore-in-use.txt"));
        assert_eq!(f.line, Some(3));
        assert_eq!(
            f.message,
            "Set cannot be destroyed: it is in use by a kernel component"
        );
    }

    #[test]
    fn parses_captured_missing_set_error() {
        let f = parse_restore_error(include_str!("testdata/ipset-restore-missing.txt"));
        assert_eq!(f.line, Some(1));
        assert_eq!(f.message, "The set with the given name does not exist");
    }

    #[test]
    fn keeps_unstructured_errors_as_message() {
        let f = parse_restore_error("ipset: command not found\n");
        assert_eq!(f.line, None);
        assert_eq!(f.message, "ipset: command not found");
        let f = parse_restore_error("x Error in line : odd\nipset v7: Error in line 12: y\n");
        assert_eq!(f.line, Some(12));
        assert_eq!(f.message, "y");
        assert_eq!(parse_restore_error("").line, None);
    }
}
