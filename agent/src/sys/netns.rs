//! Network namespaces: moving the calling thread into one.

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// Moves the calling thread (only it) into the network namespace `ns` is open on (a file
/// under /proc/PID/ns or a bind mount of one).
pub fn enter_net(ns: impl AsFd) -> io::Result<()> {
    // SAFETY: setns on an open descriptor only changes the calling thread's namespace.
    if unsafe { libc::setns(ns.as_fd().as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
