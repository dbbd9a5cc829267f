//! `weir monitor`: streams verdict events from the pinned EVENTS ring buffer. Works from
//! any process (the agent need not be running); the records name pods and rules.
//! With `--allow` it asks the programs for allow verdicts too, and turns that off again
//! when it stops.

use std::{
    io::Write,
    os::fd::AsRawFd,
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use aya::maps::{Array, Map, MapData, RingBuf};
use weir_common::{map_names, VerdictEvent, SETTING_EMIT_ALLOW_EVENTS};

use super::{
    events::{MonitorEvent, OutputFormat},
    pins::PinLayout,
    records::{self, Records, RecordsMap},
};
use crate::dataplane::DataplaneError;

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
        let mut settings: Array<MapData, u32> = typed(&layout, map_names::SETTINGS)?;
        let records_map: RecordsMap = typed(&layout, map_names::RECORDS)?;
        if allow {
            settings
                .set(SETTING_EMIT_ALLOW_EVENTS, 1, 0)
                .map_err(|e| DataplaneError::map("enable allow events", e))?;
        }
        let records = records::load(&records_map);
        Ok(Monitor {
            ring,
            settings,
            records_map,
            records,
            records_read_ns: crate::kernel::monotonic_ns(),
            records_read: Instant::now(),
            allow,
        })
    }

    /// Waits up to `timeout` for events and hands each to `f`.
    pub fn poll(
        &mut self,
        timeout: Duration,
        mut f: impl FnMut(MonitorEvent),
    ) -> Result<(), DataplaneError> {
        let mut pfd = libc::pollfd {
            fd: self.ring.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: pfd is a valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(DataplaneError::Io {
                    context: "poll the events ring buffer".into(),
                    source: e,
                });
            }
        }
        let mut raw = Vec::new();
        while let Some(item) = self.ring.next() {
            if item.len() >= std::mem::size_of::<VerdictEvent>() {
                // SAFETY: the kernel wrote a VerdictEvent (plain old data); read unaligned.
                raw.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<VerdictEvent>()) });
            }
        }
        for ev in raw {
            if self.needs_records(&ev) {
                self.records_read_ns = crate::kernel::monotonic_ns();
                self.records = records::load(&self.records_map);
                self.records_read = Instant::now();
            }
            f(MonitorEvent::decode(&ev, self.records.as_ref()));
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

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// The `weir monitor` command: prints events until SIGINT or SIGTERM.
pub fn run(pin_root: &Path, format: OutputFormat, allow: bool) -> Result<(), DataplaneError> {
    let mut monitor = Monitor::open(pin_root, allow)?;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    // On stderr, so stdout stays pure events; callers wait for it before signalling.
    eprintln!(
        "weir monitor: streaming events from {} (SIGINT or SIGTERM stops)",
        pin_root.display()
    );
    let stdout = std::io::stdout();
    while !STOP.load(Ordering::SeqCst) {
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
