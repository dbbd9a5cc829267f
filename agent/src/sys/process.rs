//! This process and its children: stop signals, killing a process group, the locked
//! memory limit.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Makes SIGINT and SIGTERM set the flag [`stop_flag`] returns instead of ending the
/// process.
pub fn catch_stop_signals() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_stop_signal as *const () as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGTERM,
            on_stop_signal as *const () as libc::sighandler_t,
        );
    }
}

/// Set once SIGINT or SIGTERM arrived after [`catch_stop_signals`].
pub fn stop_flag() -> &'static AtomicBool {
    &STOP
}

/// Sends SIGKILL to every process of the process group `pgid` (a child started as its
/// own group's leader); errors (the group is gone) are ignored.
pub fn kill_group(pgid: u32) {
    // 0 would be this process's own group.
    if pgid == 0 {
        return;
    }
    // SAFETY: kill only sends a signal.
    unsafe { libc::kill(-(pgid as libc::pid_t), libc::SIGKILL) };
}

/// Lifts RLIMIT_MEMLOCK to unlimited (needs CAP_SYS_RESOURCE).
pub fn unlimit_memlock() -> io::Result<()> {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
