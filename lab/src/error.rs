//! The lab's one error type: every failure names what it concerned.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("{object}: {reason}")]
    Invalid { object: String, reason: String },
    #[error("no lab in {0} (run `weir-lab up` first)")]
    NotUp(PathBuf),
    #[error("a lab is already up in {0} (run `weir-lab down` first)")]
    AlreadyUp(PathBuf),
    #[error("address pool {0} is exhausted")]
    AddressesExhausted(String),
    #[error("agent: {0}")]
    Agent(String),
    /// The agent's binary is not where `--weir-bin` (or the default beside `weir-lab`) says.
    #[error(
        "the weir binary {0} does not exist (build it with `cargo build -p weir`, or name it with --weir-bin or WEIR_BIN)"
    )]
    WeirBinaryMissing(PathBuf),
    /// A network namespace could not be made, entered, listed or deleted.
    #[error(transparent)]
    Netns(#[from] weir_netns::Error),
    /// The agent's /status could not be read.
    #[error("the lab's agent: {0}")]
    AgentStatus(#[from] weir::daemon::report::FetchError),
}

impl LabError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        LabError::Io {
            context: context.into(),
            source,
        }
    }

    pub fn invalid(object: impl Into<String>, reason: impl Into<String>) -> Self {
        LabError::Invalid {
            object: object.into(),
            reason: reason.into(),
        }
    }
}
