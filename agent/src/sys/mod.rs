//! Raw OS interfaces that no library in use wraps, each behind small safe functions: the
//! agent's `unsafe` and hand-written `libc` calls live here, one file per interface, and
//! every `#[repr(C)]` struct handed to the kernel has its layout checked at compile time.
//! This module depends on nothing else in the agent (`cargo xtask structure` checks it);
//! callers keep their logic and call these.

pub mod bpf;
pub mod clock;
pub mod interfaces;
pub mod mount;
pub mod netlink;
pub mod netns;
pub mod poll;
pub mod process;
