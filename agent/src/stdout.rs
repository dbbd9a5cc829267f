//! What the CLI commands print. A reader that went away (`weir reset --output json | head
//! -1`) is not an error: the command ends quietly, as Unix tools do, instead of panicking
//! in `println!` (Rust ignores SIGPIPE; the agent needs that for the pipes to its tools).

use std::io::Write;

/// `--output` of the commands that print a table for people or JSON for tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

/// Writes `text` to stdout; a closed pipe is not an error.
pub fn print(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// [`print`] with a newline.
pub fn println(text: &str) -> std::io::Result<()> {
    print(&format!("{text}\n"))
}
