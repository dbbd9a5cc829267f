//! The ipset/iptables dataplane.
pub mod backend;
