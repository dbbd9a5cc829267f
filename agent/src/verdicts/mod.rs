//! The verdict stream: every drop and audit verdict of either dataplane, as one JSON line
//! each, naming the 5-tuple, both pods and the deciding policy and rule (or the policies
//! whose default deny dropped it).
//!
//! ```text
//! eBPF ring buffer ─┐                      ┌─▶ the agent's log or a file (--verdict-log)
//!                   ├─▶ VerdictTx ─▶ Daemon ┤
//! iptables NFLOG ───┘  (rate limit)  (names) └─▶ GET /verdicts ─▶ weir monitor
//! ```
//!
//! Each dataplane reads its own kernel source in a [`VerdictTap`] thread and hands what it
//! read to a [`VerdictTx`], which limits each endpoint's rate. The run loop names the pods
//! and policies from the engine ([`name`]) and gives each record to the [`VerdictHub`].

pub mod hub;
pub mod limit;
mod naming;
pub mod record;

pub use hub::{VerdictHub, VerdictSink, VerdictTap, VerdictTx};
pub use naming::{name, PolicyNames};
pub use record::VerdictRecord;
