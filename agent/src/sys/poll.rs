//! Waiting for a descriptor to become readable.

use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::time::Duration;

/// Waits up to `timeout` (at most i32::MAX ms) for `fd` to be readable: `true` when it
/// is, `false` when the time ran out; an interrupted wait is an `Interrupted` error.
pub fn readable(fd: impl AsFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_fd().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: pfd is a valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn readable_once_written_to() {
        let (mut a, b) = UnixStream::pair().unwrap();
        assert!(!readable(&b, Duration::ZERO).unwrap());
        a.write_all(b"x").unwrap();
        assert!(readable(&b, Duration::from_secs(5)).unwrap());
    }
}
