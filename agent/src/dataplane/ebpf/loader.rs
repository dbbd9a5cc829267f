//! Loading the embedded object once and pinning it; every later start adopts the pins,
//! so maps keep their contents and programs keep their ids across agent restarts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use aya::{
    maps::{HashMap, LpmTrie, Map, MapData, PerCpuArray},
    programs::{Program, SchedClassifier},
    Ebpf, EbpfLoader,
};
use weir_common::{
    map_names, program_names, Counter, EndpointInfo, IdentityKey, PolicyKey, ServiceKey,
};

use super::{config::EbpfConfig, pins::PinLayout, records::RecordsMap};
use crate::dataplane::DataplaneError;

/// The kernel programs, built by agent/build.rs from ebpf/weir-ebpf.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/weir-ebpf.o"));

pub struct Programs {
    pub from_pod: SchedClassifier,
    pub to_pod: SchedClassifier,
}

pub struct Maps {
    pub identity: LpmTrie<MapData, IdentityKey, u32>,
    pub endpoint: HashMap<MapData, u32, EndpointInfo>,
    pub local: HashMap<MapData, IdentityKey, u32>,
    pub service: HashMap<MapData, ServiceKey, u32>,
    pub endpoint_by_id: HashMap<MapData, u32, EndpointInfo>,
    pub policy: LpmTrie<MapData, PolicyKey, u32>,
    /// POLICY's max_entries (`None`: unreadable), which its writes are planned against.
    pub policy_capacity: Option<u32>,
    /// IDENTITY's max_entries (`None`: unreadable), likewise.
    pub identity_capacity: Option<u32>,
    /// SERVICE's max_entries (`None`: unreadable), which its frontends are planned against.
    pub service_capacity: Option<u32>,
    pub counters: PerCpuArray<MapData, Counter>,
    pub records: RecordsMap,
}

/// Lifts RLIMIT_MEMLOCK before maps are created: kernels before 5.11 charge BPF maps and
/// programs to it, and its usual 64 KiB or 8 MiB holds none of ours (5.11 and later
/// charge the memory cgroup instead). Without CAP_SYS_RESOURCE this fails; then a kernel
/// that charges the limit refuses the maps, and that refusal is the error reported.
pub fn raise_memlock_limit() -> Result<(), std::io::Error> {
    crate::sys::process::unlimit_memlock().inspect_err(|e| {
        tracing::debug!(
            "cannot lift RLIMIT_MEMLOCK ({e}); kernels before 5.11 may refuse the maps"
        );
    })
}

/// Why the object could not be loaded: the error with its sources (aya's own message
/// leaves out the kernel's errno), and the memlock limit when it could not be lifted.
pub fn load_error(e: &aya::EbpfError, memlock: &Result<(), std::io::Error>) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    if let Err(why) = memlock {
        text.push_str(&format!(
            " (RLIMIT_MEMLOCK could not be lifted: {why}; kernels before 5.11 charge BPF maps \
             to it, so the agent needs CAP_SYS_RESOURCE there)"
        ));
    }
    text
}

/// The programs loaded and pinned on a thread of their own while the agent lists the
/// cluster: the verifier's second or so at a node's first start overlaps the lists instead
/// of following them. Only on a pin root that holds no program and no map yet, so nothing
/// an earlier run pinned is adopted, migrated or replaced out of turn; loading, pinning and
/// creating maps enforce nothing until a convergence attaches the programs (and the cleanup
/// of the other dataplane's leftovers removes them if the node chooses iptables).
pub struct Preload(std::thread::JoinHandle<Result<(), DataplaneError>>);

impl Preload {
    /// Starts loading when the pin root is empty; None when it holds anything.
    pub fn start(config: &EbpfConfig) -> Option<Preload> {
        let layout = PinLayout::new(&config.pin_root);
        let empty = |dir: PathBuf| {
            std::fs::read_dir(dir).map_or(true, |mut entries| entries.next().is_none())
        };
        if !(empty(layout.progs()) && empty(layout.maps())) {
            return None;
        }
        let config = config.clone();
        let handle = std::thread::Builder::new()
            .name("ebpf-preload".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let loaded = ensure_loaded(&layout, &config).map(drop);
                tracing::info!(
                    ms = started.elapsed().as_millis() as u64,
                    ok = loaded.is_ok(),
                    "eBPF programs loaded while the cluster is listed"
                );
                loaded
            })
            .ok()?;
        Some(Preload(handle))
    }

    /// Waits for it: whether the programs are pinned now, by this process. A failure is
    /// logged; the caller then loads them itself and reports its own error.
    pub fn finish(self) -> bool {
        match self.0.join() {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "loading the eBPF programs early failed; loading them again");
                false
            }
            Err(_) => false,
        }
    }
}

/// Loads and pins the programs unless pinned programs are already there (adoption).
/// Returns whether it loaded them now.
pub fn ensure_loaded(layout: &PinLayout, config: &EbpfConfig) -> Result<bool, DataplaneError> {
    layout.prepare()?;
    if program_names::ALL.iter().all(|n| layout.prog(n).exists()) {
        return Ok(false);
    }
    load_and_pin(layout, config)?;
    Ok(true)
}

pub fn open_programs(layout: &PinLayout) -> Result<Programs, DataplaneError> {
    open_programs_in(&layout.progs())
}

/// The programs pinned in `dir` (the pin root's, or a migration's staging directory).
pub fn open_programs_in(dir: &Path) -> Result<Programs, DataplaneError> {
    let open = |name: &str| {
        SchedClassifier::from_pin(dir.join(name))
            .map_err(|e| DataplaneError::program(format!("open pinned program {name}"), e))
    };
    Ok(Programs {
        from_pod: open(program_names::FROM_POD)?,
        to_pod: open(program_names::TO_POD)?,
    })
}

/// What the pinned programs are: the object and the settings baked into its rodata.
/// A different fingerprint at start-up (an upgraded agent, new settings) means reload.
pub fn fingerprint(config: &EbpfConfig) -> String {
    let parts: [&[u8]; 5] = [
        OBJECT,
        &config.events_per_sec.to_le_bytes(),
        &[log_level(config)],
        &config.ct_new_per_sec.to_le_bytes(),
        &config.ct_new_burst.to_le_bytes(),
    ];
    let hash = parts
        .iter()
        .flat_map(|p| p.iter())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
        });
    format!("{hash:016x}")
}

/// The configured max_entries of the maps whose size the configuration sets.
pub fn max_entries(config: &EbpfConfig) -> [(&'static str, u32); 12] {
    [
        (map_names::IDENTITY, config.identity_entries),
        (map_names::SERVICE, config.service_entries),
        (map_names::ENDPOINT, config.endpoint_entries),
        (map_names::ENDPOINT_BY_ID, config.endpoint_entries),
        (map_names::POLICY, config.policy_entries),
        (map_names::CT, config.ct_entries),
        (map_names::CT_OVERFLOW, config.ct_overflow_entries),
        (map_names::FRAG, config.frag_entries),
        // Two addresses (IPv4, IPv6) per endpoint.
        (map_names::LOCAL, config.endpoint_entries.saturating_mul(2)),
        // Indexed by endpoint id, which is at most the number of endpoints.
        (
            map_names::CT_BUDGET,
            config.endpoint_entries.saturating_add(1),
        ),
        (map_names::COUNTERS, config.counter_entries),
        (map_names::EVENTS, config.events_bytes),
    ]
}

/// Loads the object and (re)pins its programs; maps are reused by name.
pub fn load_and_pin(layout: &PinLayout, config: &EbpfConfig) -> Result<(), DataplaneError> {
    load_and_pin_into(layout, config, &[], &layout.progs())
}

/// Loads the object with the maps named in `map_pins` at those pins (created there when
/// absent) and the others reused by name under the pin root; pins the programs in `progs`.
pub fn load_and_pin_into(
    layout: &PinLayout,
    config: &EbpfConfig,
    map_pins: &[(String, PathBuf)],
    progs: &Path,
) -> Result<(), DataplaneError> {
    let memlock = raise_memlock_limit();
    let level = log_level(config);
    let mut loader = EbpfLoader::new();
    loader.default_map_pin_directory(layout.maps());
    for (name, size) in max_entries(config) {
        loader.map_max_entries(name, size);
    }
    for (name, path) in map_pins {
        loader.map_pin_path(name.as_str(), path.as_path());
    }
    loader
        .override_global("EVENT_RATE_PER_SEC", &config.events_per_sec, true)
        .override_global("CT_NEW_PER_SEC", &config.ct_new_per_sec, true)
        .override_global("CT_NEW_BURST", &config.ct_new_burst, true)
        .override_global("AYA_LOG_LEVEL", &level, true);
    let mut ebpf = loader.load(OBJECT).map_err(|source| DataplaneError::Load {
        detail: load_error(&source, &memlock),
        source: Box::new(source),
    })?;
    for name in program_names::ALL {
        let prog = load_program(&mut ebpf, name).map_err(|e| match e {
            None => DataplaneError::MissingProgram(name),
            Some(e) => DataplaneError::program(format!("verifier rejected {name}"), e),
        })?;
        let path = progs.join(name);
        let _ = std::fs::remove_file(&path);
        prog.pin(&path).map_err(|source| DataplaneError::Pin {
            context: format!("pin {name} at {}", path.display()),
            source: Box::new(source),
        })?;
    }
    Ok(())
}

/// Loads program `name` of `ebpf` (the verifier's verdict) as its type is loaded: the TC
/// classifiers and the socket filter the iptables `bpf` match runs. `Err(None)`: the object
/// has no such program of those types; `Err(Some)`: the kernel refused it.
pub(crate) fn load_program<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut Program, Option<aya::programs::ProgramError>> {
    let prog = ebpf.program_mut(name).ok_or(None)?;
    let loaded = match prog {
        Program::SchedClassifier(p) => load_retrying(name, || p.load()),
        Program::SocketFilter(p) => load_retrying(name, || p.load()),
        _ => return Err(None),
    };
    loaded.map_err(Some)?;
    Ok(prog)
}

/// aya-log's level numbers: 0 is off, 4 is debug.
fn log_level(config: &EbpfConfig) -> u8 {
    if config.kernel_debug_log {
        4
    } else {
        0
    }
}

/// Forwards the programs' aya-log records to the `log` facade (and so to tracing) from a
/// thread that lives as long as the process.
pub fn forward_kernel_logs(programs: &Programs) -> Result<(), DataplaneError> {
    let id = programs
        .from_pod
        .info()
        .map_err(|e| DataplaneError::program("program info", e))?
        .id();
    let mut logger = aya_log::EbpfLogger::init_from_id(id)
        .map_err(|e| DataplaneError::KernelLog(Box::new(e)))?;
    std::thread::Builder::new()
        .name("weir-bpf-log".into())
        .spawn(move || loop {
            let _ = crate::sys::poll::readable(&logger, Duration::from_secs(1));
            logger.flush();
        })
        .map_err(|source| DataplaneError::Io {
            context: "start the kernel log reader".into(),
            source,
        })?;
    Ok(())
}

/// How many times a load the verifier gave up on with EAGAIN is tried (libbpf's number).
const LOAD_ATTEMPTS: u32 = 5;

/// Loads `prog`, again when the verifier was interrupted: it stops with EAGAIN when a
/// signal is pending (the kernel's `do_check`), which a process running children can get
/// during a long verification (CI saw it once, on the host's 6.18, on aya's logged second
/// attempt). Any other refusal is returned at once.
pub(crate) fn load_retrying(
    name: &str,
    mut load: impl FnMut() -> Result<(), aya::programs::ProgramError>,
) -> Result<(), aya::programs::ProgramError> {
    let mut attempt = 1;
    loop {
        match load() {
            Err(aya::programs::ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && attempt < LOAD_ATTEMPTS =>
            {
                tracing::info!(
                    program = name,
                    attempt,
                    "the verifier was interrupted (EAGAIN): loading again"
                );
                attempt += 1;
            }
            other => return other,
        }
    }
}

pub(crate) fn verifier_message(e: &aya::programs::ProgramError) -> String {
    match e {
        aya::programs::ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            format!("{io_error}\n{verifier_log}")
        }
        other => other.to_string(),
    }
}

fn open_map(path: &Path, name: &str) -> Result<Map, DataplaneError> {
    let data = MapData::from_pin(path)
        .map_err(|e| DataplaneError::map(format!("open pinned map {}", path.display()), e))?;
    Map::from_map_data(data).map_err(|e| DataplaneError::map(format!("map {name}"), e))
}

macro_rules! typed {
    ($path:expr, $name:expr) => {
        open_map(&$path($name), $name)?
            .try_into()
            .map_err(|e: aya::maps::MapError| DataplaneError::map(format!("map {}", $name), e))?
    };
}

/// The max_entries of the map pinned at `pin`, if it can be read.
fn pinned_max_entries(pin: &std::path::Path) -> Option<u32> {
    MapData::from_pin(pin)
        .ok()
        .and_then(|m| m.info().ok())
        .map(|i| i.max_entries())
}

impl Maps {
    /// Opens the maps, each at the pin `path` gives for its name.
    pub fn open(path: impl Fn(&str) -> PathBuf) -> Result<Maps, DataplaneError> {
        Ok(Maps {
            identity: typed!(path, map_names::IDENTITY),
            endpoint: typed!(path, map_names::ENDPOINT),
            local: typed!(path, map_names::LOCAL),
            service: typed!(path, map_names::SERVICE),
            endpoint_by_id: typed!(path, map_names::ENDPOINT_BY_ID),
            policy: typed!(path, map_names::POLICY),
            policy_capacity: pinned_max_entries(&path(map_names::POLICY)),
            identity_capacity: pinned_max_entries(&path(map_names::IDENTITY)),
            service_capacity: pinned_max_entries(&path(map_names::SERVICE)),
            counters: typed!(path, map_names::COUNTERS),
            records: typed!(path, map_names::RECORDS),
        })
    }
}

/// max_entries of a pinned map (for map pressure).
pub fn capacity(layout: &PinLayout, name: &str) -> Option<u32> {
    MapData::from_pin(layout.map(name))
        .ok()?
        .info()
        .ok()
        .map(|i| i.max_entries())
}
