//! eBPF side of [`crate::dataplane::new_pods`]: a pod interface is isolated the moment it
//! appears. A netlink socket subscribed to link events (opened before the dataplane
//! reports ready) feeds a thread that, for each new interface whose name marks it as a
//! pod's, writes a pending ENDPOINT entry (both directions isolated, an endpoint id no
//! POLICY entry names) with BPF_NOEXIST and attaches the programs as netlink clsact
//! filters (about 0.3 ms for both hooks; a TCX link waits for an RCU grace period, about
//! 8 ms per hook here). BPF_NOEXIST makes the race with a converge harmless: a real entry
//! is never overwritten by a pending one, and a converge overwrites a pending entry with
//! the real one and adopts the filter (netlink mode) or attaches its TCX link, which
//! decides first, and removes the filter (TCX mode). Every converge also scans the
//! interfaces, for links that appeared before the watch or while the agent was down
//! (those are open until then: nothing watches), and drops pending entries whose
//! interface is gone.
//!
//! The same watch puts `weir_to_pod` on the egress of any other new interface at once
//! (see [`super::Role::Leaving`]).

use std::{
    io,
    os::fd::OwnedFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::Duration,
};

use aya::maps::{HashMap, MapData, MapError};
use weir_common::{EndpointInfo, EP_EGRESS_ISOLATED, EP_INGRESS_ISOLATED};

use super::{
    attach,
    hooks::{AttachMode, Attachment, Role, PENDING_ENDPOINT_ID},
    loader::Programs,
    pins::PinLayout,
};
use crate::dataplane::new_pods::NewPodIsolation;
use crate::dataplane::DataplaneError;
use crate::sys::netlink::{self, RTMGRP_LINK, RTM_DELLINK, RTM_NEWLINK};

/// No address either: anything it sends is also a spoof.
pub const PENDING: EndpointInfo = EndpointInfo {
    endpoint_id: PENDING_ENDPOINT_ID,
    flags: EP_INGRESS_ISOLATED | EP_EGRESS_ISOLATED,
    ipv4: [0; 16],
    ipv6: [0; 16],
};

const BPF_NOEXIST: u64 = 1;

pub type EndpointMap = HashMap<MapData, u32, EndpointInfo>;

/// What isolating an interface needs; shared by the watch thread and the dataplane.
pub struct Isolator {
    pub layout: PinLayout,
    pub filter: NewPodIsolation,
    pub programs: Arc<Mutex<Programs>>,
    pub endpoint: Mutex<EndpointMap>,
}

impl Isolator {
    /// Isolates interface `ifindex` unless it has an ENDPOINT entry already (a known pod,
    /// or isolated before). Returns whether it did.
    pub fn isolate(&self, ifname: &str, ifindex: u32) -> Result<bool, DataplaneError> {
        if !self.filter.applies_to(ifname) {
            return Ok(false);
        }
        let mut programs = self.programs.lock().unwrap_or_else(|e| e.into_inner());
        let mut endpoint = self.endpoint.lock().unwrap_or_else(|e| e.into_inner());
        match endpoint.insert(ifindex, PENDING, BPF_NOEXIST) {
            Ok(()) => {}
            // Known already (attached by the converge that wrote the entry), or isolated
            // before.
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                return Ok(false)
            }
            Err(e) => return Err(DataplaneError::map("pending ENDPOINT entry", e)),
        }
        // Always a netlink clsact filter, even where the endpoints get TCX links: both
        // hooks take about 0.3 ms, where each TCX link waits for an RCU grace period
        // (about 8 ms here), and the interface is open until both are on. A TCX link
        // attached later decides first (and ends the filter's run); the converge that
        // attaches it removes the filter.
        if let Err(e) = attach::attach(
            &mut programs,
            &self.layout,
            ifname,
            ifindex,
            AttachMode::Netlink,
            Role::Pod,
            false,
        ) {
            // An entry without programs would only mislead: the next scan retries.
            let _ = endpoint.remove(&ifindex);
            return Err(e);
        }
        tracing::info!(
            interface = ifname,
            ifindex,
            "new pod interface isolated until its endpoint is programmed"
        );
        Ok(true)
    }

    /// Puts `weir_to_pod` on the egress of a new interface that is not a pod's (an uplink,
    /// a tunnel, a bridge) at once, as a netlink filter: pods' Service traffic that leaves
    /// through it is judged after DNAT from its first packet, not from the next converge
    /// (which records the interface, attaches its TCX link where the kernel has TCX, and
    /// removes the filter). Returns whether it attached.
    pub fn cover_leaving(&self, ifname: &str, ifindex: u32) -> Result<bool, DataplaneError> {
        if ifname == "lo"
            || self.filter.applies_to(ifname)
            || self.layout.link(ifindex, "egress").exists()
        {
            return Ok(false);
        }
        if self
            .endpoint
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&ifindex, 0)
            .is_ok()
        {
            return Ok(false); // a pod's, placed by a converge
        }
        let mut programs = self.programs.lock().unwrap_or_else(|e| e.into_inner());
        attach::attach(
            &mut programs,
            &self.layout,
            ifname,
            ifindex,
            AttachMode::Netlink,
            Role::Leaving,
            false,
        )?;
        Ok(true)
    }

    /// Forgets a pending interface that was deleted (its TCX link pins go with it).
    pub fn release(&self, ifindex: u32) {
        let mut endpoint = self.endpoint.lock().unwrap_or_else(|e| e.into_inner());
        if endpoint.get(&ifindex, 0).ok() != Some(PENDING) {
            return;
        }
        let _ = endpoint.remove(&ifindex);
        drop(endpoint);
        release_pins(&self.layout, ifindex);
    }

    /// Isolates every matching interface of this namespace that has no entry yet.
    pub fn scan(&self) -> Vec<(String, DataplaneError)> {
        let mut errors = Vec::new();
        for (ifindex, ifname) in interfaces() {
            if let Err(e) = self.isolate(&ifname, ifindex) {
                errors.push((ifname, e));
            }
        }
        errors
    }
}

/// Removes the TCX link pins of an interface (detaching what is still attached).
pub fn release_pins(layout: &PinLayout, ifindex: u32) {
    let _ = attach::detach(
        layout,
        &Attachment {
            ifname: String::new(),
            ifindex,
            mode: AttachMode::Tcx,
            role: Role::Pod,
        },
    );
}

/// All interfaces of the calling thread's network namespace.
pub(super) fn interfaces() -> Vec<(u32, String)> {
    crate::sys::interfaces::all()
}

/// The watch: a thread reading link events until dropped.
pub struct LinkWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for LinkWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn netlink_socket() -> io::Result<OwnedFd> {
    netlink::route_socket(RTMGRP_LINK, Duration::from_millis(200), Some(1 << 20))
}

/// Starts watching this namespace's links (the socket is subscribed before returning).
pub fn watch(isolator: Arc<Isolator>) -> io::Result<LinkWatch> {
    let socket = netlink_socket()?;
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let thread = std::thread::Builder::new()
        .name("weir-new-pods".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            while !s.load(Ordering::SeqCst) {
                let n = match netlink::recv(&socket, &mut buf) {
                    Ok(n) => n,
                    Err(e) => {
                        match e.raw_os_error() {
                            Some(libc::EAGAIN | libc::EINTR) => {}
                            // Events were lost: look at every interface instead.
                            Some(libc::ENOBUFS) => {
                                for (ifname, e) in isolator.scan() {
                                    tracing::warn!(interface = ifname, "not isolated: {e}");
                                }
                            }
                            _ => {
                                tracing::warn!("link watch failed: {e}");
                                std::thread::sleep(Duration::from_millis(200));
                            }
                        }
                        continue;
                    }
                };
                for (kind, ifindex, name) in netlink::link_messages(&buf[..n]) {
                    match (kind, name) {
                        (RTM_NEWLINK, Some(name)) => {
                            if let Err(e) = isolator.isolate(&name, ifindex) {
                                tracing::warn!(
                                    interface = name,
                                    "new pod interface not isolated: {e}"
                                );
                            }
                            match isolator.cover_leaving(&name, ifindex) {
                                Ok(true) => tracing::info!(
                                    interface = name,
                                    "new interface: pods' Service traffic leaving through it is judged after DNAT"
                                ),
                                Ok(false) => {}
                                Err(e) => tracing::warn!(
                                    interface = name,
                                    "new interface not covered (until the next converge): {e}"
                                ),
                            }
                        }
                        (RTM_DELLINK, _) => isolator.release(ifindex),
                        _ => {}
                    }
                }
            }
        })?;
    Ok(LinkWatch {
        stop,
        thread: Some(thread),
    })
}
