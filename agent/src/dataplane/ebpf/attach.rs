//! Attaching the classifiers to a pod's host-side interface: a pinned TCX link where the
//! kernel has TCX (6.6+), otherwise a clsact filter over netlink (any 5.x kernel) that
//! stays after the agent exits and is found by its program name `weir_*`.
//! Interfaces are found as the route to the pod's address in the current network
//! namespace (`ip -j route get`).

use std::net::IpAddr;

use serde::Deserialize;

use super::hooks::{AttachMode, Attachment, Role};
use super::{loader::Programs, pins::PinLayout};
use crate::dataplane::DataplaneError;
use crate::exec::ExecError;
use aya::programs::{
    links::{FdLink, Link, PinnedLink},
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    LinkOrder, SchedClassifier, TcAttachType,
};

/// Netlink filter priority and handle of both programs (fixed, so a restarted agent can
/// find and replace its filters).
const NL_PRIORITY: u16 = 1;
const NL_HANDLE: TcHandle = TcHandle::new(0, 0x77);

/// `None` when this kernel has TCX links (Linux 6.6); otherwise why not. Probed with a TCX
/// query on `lo`, which attaches nothing: kernels without TCX reject its attach type.
pub fn tcx_missing() -> Option<String> {
    match SchedClassifier::query_tcx("lo", TcAttachType::Ingress) {
        Ok(_) => None,
        Err(e) => Some(format!(
            "TCX links (Linux 6.6 and later; a TCX query on lo fails: {e})"
        )),
    }
}

#[derive(Deserialize)]
struct RouteGet {
    dev: Option<String>,
}

/// Why a pod's interface was not found.
#[derive(Debug, thiserror::Error)]
pub enum LocateError {
    #[error("pod has no address yet")]
    NoAddress,
    /// `ip route get` did not run or refused.
    #[error(transparent)]
    Route(#[from] ExecError),
    #[error("parse `ip -j route get {addr}`: {source}")]
    RouteOutput {
        addr: IpAddr,
        #[source]
        source: serde_json::Error,
    },
    #[error("no route with a device to {0}")]
    NoDevice(IpAddr),
    #[error("interface {0} vanished")]
    Vanished(String),
}

/// The interface that routes `addr` in this network namespace, with its index.
pub fn interface_for(addr: IpAddr) -> Result<(String, u32), LocateError> {
    let out = crate::exec::run_ok("ip", &["-j", "route", "get", &addr.to_string()], None)?;
    let routes: Vec<RouteGet> =
        serde_json::from_str(&out).map_err(|source| LocateError::RouteOutput { addr, source })?;
    let dev = routes
        .into_iter()
        .find_map(|r| r.dev)
        .ok_or(LocateError::NoDevice(addr))?;
    let ifindex = ifindex(&dev).ok_or_else(|| LocateError::Vanished(dev.clone()))?;
    Ok((dev, ifindex))
}

pub fn ifindex(name: &str) -> Option<u32> {
    crate::sys::interfaces::index(name)
}

/// The name of interface `ifindex`, if it exists.
pub fn ifname(ifindex: u32) -> Option<String> {
    crate::sys::interfaces::name(ifindex)
}

/// Interfaces that have a pinned TCX link under the pin root.
pub fn pinned_link_ifindexes(layout: &PinLayout) -> std::collections::BTreeSet<u32> {
    std::fs::read_dir(layout.links())
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name();
            let (ifindex, _) = name.to_str()?.split_once('-')?;
            ifindex.parse().ok()
        })
        .collect()
}

fn hooks(
    progs: &mut Programs,
    role: Role,
) -> Vec<(&mut SchedClassifier, TcAttachType, &'static str)> {
    match role {
        Role::Pod => vec![
            (&mut progs.from_pod, TcAttachType::Ingress, "ingress"),
            (&mut progs.to_pod, TcAttachType::Egress, "egress"),
        ],
        Role::Leaving => vec![(&mut progs.to_pod, TcAttachType::Egress, "egress")],
    }
}

fn hook_types(role: Role) -> &'static [(TcAttachType, &'static str)] {
    match role {
        Role::Pod => &[
            (TcAttachType::Ingress, "ingress"),
            (TcAttachType::Egress, "egress"),
        ],
        Role::Leaving => &[(TcAttachType::Egress, "egress")],
    }
}

fn fail(
    what: &'static str,
    ifname: &str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> DataplaneError {
    DataplaneError::Attach {
        what,
        ifname: ifname.to_owned(),
        source: Box::new(e),
    }
}

/// Attaches the programs of `role`. A hook that already carries one of ours is left
/// alone (adoption after restart), or with `replace` gets the given program swapped in
/// atomically (upgrade): enforcement never pauses.
pub fn attach(
    progs: &mut Programs,
    layout: &PinLayout,
    ifname: &str,
    ifindex: u32,
    mode: AttachMode,
    role: Role,
    replace: bool,
) -> Result<Attachment, DataplaneError> {
    if mode == AttachMode::Netlink {
        // Fails harmlessly ("Exclusivity flag on") when the qdisc exists.
        let _ = tc::qdisc_add_clsact(ifname);
    }
    for (prog, attach_type, hook) in hooks(progs, role) {
        match mode {
            AttachMode::Tcx => {
                let pin = layout.link(ifindex, hook);
                if pin.exists() {
                    if replace {
                        let pinned = PinnedLink::from_pin(&pin)
                            .map_err(|e| fail("open pinned TCX link", ifname, e))?;
                        let link = SchedClassifierLink::try_from(FdLink::from(pinned))
                            .map_err(|e| fail("TCX link", ifname, e))?;
                        let id = prog
                            .attach_to_link(link)
                            .map_err(|e| fail("TCX program replace", ifname, e))?;
                        // The pin keeps the link; our handle to it may go.
                        drop(prog.take_link(id));
                    }
                    continue;
                }
                let id = prog
                    .attach_with_options(
                        ifname,
                        attach_type,
                        TcAttachOptions::TcxOrder(LinkOrder::default()),
                    )
                    .map_err(|e| fail("TCX attach", ifname, e))?;
                let link = prog
                    .take_link(id)
                    .map_err(|e| fail("TCX link", ifname, e))?;
                let fd: FdLink = link.try_into().map_err(|e| fail("TCX link", ifname, e))?;
                fd.pin(&pin).map_err(|e| fail("pin TCX link", ifname, e))?;
            }
            AttachMode::Netlink => {
                let options = || {
                    TcAttachOptions::Netlink(NlOptions {
                        priority: NL_PRIORITY,
                        handle: NL_HANDLE,
                        classid: None,
                    })
                };
                let id = match prog.attach_with_options(ifname, attach_type, options()) {
                    Ok(id) => id,
                    // Our filter is there already (restart): replace it in place, atomically.
                    Err(_) => {
                        let existing = SchedClassifierLink::attached(
                            ifname,
                            attach_type,
                            NL_PRIORITY,
                            NL_HANDLE,
                            None,
                        )
                        .map_err(|e| fail("find tc filter", ifname, e))?;
                        prog.attach_to_link(existing)
                            .map_err(|e| fail("tc filter replace", ifname, e))?
                    }
                };
                let link = prog.take_link(id).map_err(|e| fail("tc link", ifname, e))?;
                // The filter must outlive this process: dropping the link would detach it.
                std::mem::forget(link);
            }
        }
    }
    Ok(Attachment {
        ifname: ifname.to_string(),
        ifindex,
        mode,
        role,
    })
}

/// Ids of the programs on the interface's TCX hooks (ingress, egress), ours or not.
/// Netlink attachments are not listed (`tc filter show` does that).
pub fn tcx_program_ids(a: &Attachment) -> Result<[Vec<u32>; 2], DataplaneError> {
    let query = |t| {
        SchedClassifier::query_tcx(&a.ifname, t)
            .map(|(_, progs)| progs.iter().map(|p| p.id()).collect())
            .map_err(|e| fail("TCX query", &a.ifname, e))
    };
    Ok([query(TcAttachType::Ingress)?, query(TcAttachType::Egress)?])
}

/// Removes our netlink filters from an interface, if it has any (tolerant: a hook without
/// one is skipped).
pub fn remove_netlink_filters(ifname: &str, ifindex_: u32) {
    if ifindex(ifname) != Some(ifindex_) {
        return;
    }
    for attach_type in [TcAttachType::Ingress, TcAttachType::Egress] {
        if let Ok(link) =
            SchedClassifierLink::attached(ifname, attach_type, NL_PRIORITY, NL_HANDLE, None)
        {
            let _ = link.detach();
        }
    }
}

/// Detaches both programs; an interface that is gone already counts as detached.
pub fn detach(layout: &PinLayout, a: &Attachment) -> Result<(), DataplaneError> {
    for &(attach_type, hook) in hook_types(a.role) {
        match a.mode {
            AttachMode::Tcx => {
                // The pin holds the last reference: removing it detaches the link.
                let pin = layout.link(a.ifindex, hook);
                match std::fs::remove_file(&pin) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(fail("unpin TCX link", &a.ifname, e)),
                }
            }
            AttachMode::Netlink => {
                if ifindex(&a.ifname) != Some(a.ifindex) {
                    continue;
                }
                let link = SchedClassifierLink::attached(
                    &a.ifname,
                    attach_type,
                    NL_PRIORITY,
                    NL_HANDLE,
                    None,
                )
                .map_err(|e| fail("find tc filter", &a.ifname, e))?;
                link.detach()
                    .map_err(|e| fail("tc filter delete", &a.ifname, e))?;
            }
        }
    }
    Ok(())
}
