//! The reader of the pinned EVENTS ring buffer: the agent's verdict tap ([`tap`]), and
//! `weir monitor --bpf-root` where no agent runs ([`run`]). The records name pods and
//! rules. Allow verdicts are asked of the programs only while someone wants them, and
//! turned off again after.

use std::{
    io::Write,
    os::fd::AsFd,
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use aya::maps::{Array, Map, MapData, RingBuf};
use weir_common::{map_names, VerdictEvent, SETTING_EMIT_ALLOW_EVENTS};

use super::{
    events,
    pins::PinLayout,
    records::{self, Records, RecordsMap},
};
use crate::dataplane::DataplaneError;
use crate::verdicts::{record::OutputFormat, VerdictRecord, VerdictTap, VerdictTx};

pub struct Monitor {
    ring: RingBuf<MapData>,
    settings: Array<MapData, u32>,
    records_map: RecordsMap,
    records: Option<Records>,
    /// When the records were last read, on the programs' clock (CLOCK_MONOTONIC ns).
    records_read_ns: u64,
    records_read: Instant,
    allow: bool,
}

fn open(layout: &PinLayout, name: &str) -> Result<Map, DataplaneError> {
    let path = layout.map(name);
    let data = MapData::from_pin(&path).map_err(|e| {
        DataplaneError::map(
            format!(
                "open {} (is the eBPF dataplane loaded under this pin root?)",
                path.display()
            ),
            e,
        )
    })?;
    Map::from_map_data(data).map_err(|e| DataplaneError::map(format!("map {name}"), e))
}

fn typed<T: TryFrom<Map, Error = aya::maps::MapError>>(
    layout: &PinLayout,
    name: &str,
) -> Result<T, DataplaneError> {
    open(layout, name)?
        .try_into()
        .map_err(|e| DataplaneError::map(format!("map {name}"), e))
}

impl Monitor {
    pub fn open(pin_root: &Path, allow: bool) -> Result<Monitor, DataplaneError> {
        let layout = PinLayout::new(pin_root);
        let ring = typed(&layout, map_names::EVENTS)?;
        let settings: Array<MapData, u32> = typed(&layout, map_names::SETTINGS)?;
        let records_map: RecordsMap = typed(&layout, map_names::RECORDS)?;
        let records = records::load(&records_map);
        let mut monitor = Monitor {
            ring,
            settings,
            records_map,
            records,
            records_read_ns: crate::kernel::monotonic_ns(),
            records_read: Instant::now(),
            // Written either way: a reader killed while it wanted allows left the pinned
            // setting on.
            allow: !allow,
        };
        monitor.set_allow(allow)?;
        Ok(monitor)
    }

    /// Asks the programs for allow events too (`true`), or no longer.
    pub fn set_allow(&mut self, allow: bool) -> Result<(), DataplaneError> {
        if allow != self.allow {
            self.settings
                .set(SETTING_EMIT_ALLOW_EVENTS, u32::from(allow), 0)
                .map_err(|e| DataplaneError::map("switch allow events", e))?;
            self.allow = allow;
        }
        Ok(())
    }

    /// Waits up to `timeout` for events and hands each to `f`.
    pub fn poll(
        &mut self,
        timeout: Duration,
        mut f: impl FnMut(VerdictRecord),
    ) -> Result<(), DataplaneError> {
        if let Err(e) = crate::sys::poll::readable(self.ring.as_fd(), timeout) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(DataplaneError::Io {
                    context: "poll the events ring buffer".into(),
                    source: e,
                });
            }
        }
        let mut raw = Vec::new();
        while let Some(item) = self.ring.next() {
            // The kernel wrote a VerdictEvent; a shorter record is not one.
            if let Some(ev) = crate::sys::bpf::read_pod::<VerdictEvent>(&item) {
                raw.push(ev);
            }
        }
        for ev in raw {
            if self.needs_records(&ev) {
                self.records_read_ns = crate::kernel::monotonic_ns();
                self.records = records::load(&self.records_map);
                self.records_read = Instant::now();
            }
            f(events::decode(&ev, self.records.as_ref()));
        }
        Ok(())
    }

    /// Names unknown to the records we hold: re-read them when the event is newer than
    /// them (its rule may have been added since), at most fifty times a second.
    fn needs_records(&self, ev: &VerdictEvent) -> bool {
        let known = self.records.as_ref().is_some_and(|r| {
            r.endpoint_name(ev.endpoint_id).is_some()
                && (ev.rule_id < weir_common::RULE_ID_FIRST
                    || r.rules
                        .by_id
                        .contains_key(&weir_common::rule_id(ev.rule_id)))
        });
        !known
            && ev.timestamp_ns > self.records_read_ns
            && self.records_read.elapsed() > Duration::from_millis(20)
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        if self.allow {
            let _ = self.settings.set(SETTING_EMIT_ALLOW_EVENTS, 0, 0);
        }
    }
}

/// The agent's verdict tap: reads the ring on its own thread into `tx`, with allow events
/// on while a subscriber wants them.
pub fn tap(pin_root: &Path, tx: Arc<VerdictTx>) -> Result<VerdictTap, DataplaneError> {
    let mut monitor = Monitor::open(pin_root, false)?;
    VerdictTap::spawn("weir-ebpf-tap", move |stop| {
        let mut failing = false;
        while !stop.load(Ordering::Relaxed) {
            let result = monitor
                .set_allow(tx.wants_allows())
                .and_then(|()| monitor.poll(Duration::from_millis(200), |r| tx.offer(r)));
            match result {
                Ok(()) => failing = false,
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "reading the eBPF verdict events failed; retrying");
                    }
                    failing = true;
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    })
    .map_err(|e| DataplaneError::Io {
        context: "start the eBPF verdict reader".into(),
        source: e,
    })
}

/// `weir monitor --bpf-root`: prints events until `stop`, reading the ring itself. Beside a running agent the two readers would split the events: `weir monitor`
/// reads the agent's stream instead.
pub fn run(
    pin_root: &Path,
    format: OutputFormat,
    allow: bool,
    stop: &AtomicBool,
) -> Result<(), DataplaneError> {
    let mut monitor = Monitor::open(pin_root, allow)?;
    // On stderr, so stdout stays pure events; callers wait for it before signalling.
    eprintln!(
        "weir monitor: streaming events from {} (SIGINT or SIGTERM stops)",
        pin_root.display()
    );
    let stdout = std::io::stdout();
    while !stop.load(Ordering::SeqCst) {
        let mut out = stdout.lock();
        let mut broken = false;
        monitor.poll(Duration::from_millis(200), |ev| {
            broken |= writeln!(out, "{}", ev.render(format)).is_err();
        })?;
        if broken || out.flush().is_err() {
            break;
        }
    }
    Ok(())
}
