//! The image's root filesystem: weir, the tools it runs (ipset, iptables and ip6tables in
//! their legacy and nft variants with save/restore, ip, tc, modprobe, conntrack), the libraries and
//! xtables extensions they load, and the packages' copyright files. Nothing else: no shell,
//! no package manager. The layout is Debian's merged /usr (`/bin` → `usr/bin`, ...).
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::cmd::output;

/// Where weir is in the image (deploy/daemonset.yaml's command runs it from PATH).
pub const WEIR_PATH: &str = "usr/local/bin/weir";

/// What weir runs, as paths in the image. Links among them are kept as links.
const TOOLS: &[&str] = &[
    "usr/sbin/ipset",
    "usr/bin/ip",
    "usr/sbin/tc",
    "usr/sbin/modprobe",
    // A departed pod's connections are forgotten (the iptables dataplane).
    "usr/sbin/conntrack",
    // Protocol names: iptables-save prints `-p gre` where it has them, as weir writes.
    "etc/protocols",
    "usr/sbin/iptables-legacy",
    "usr/sbin/iptables-legacy-save",
    "usr/sbin/iptables-legacy-restore",
    "usr/sbin/ip6tables-legacy",
    "usr/sbin/ip6tables-legacy-save",
    "usr/sbin/ip6tables-legacy-restore",
    "usr/sbin/iptables-nft",
    "usr/sbin/iptables-nft-save",
    "usr/sbin/iptables-nft-restore",
    "usr/sbin/ip6tables-nft",
    "usr/sbin/ip6tables-nft-save",
    "usr/sbin/ip6tables-nft-restore",
];
/// Whole directories: iptables' extensions (loaded by name at run time, so no ELF names
/// them) and iproute2's tables.
const DIRS: &[&str] = &["usr/lib/x86_64-linux-gnu/xtables", "etc/iproute2"];
/// Debian's alternatives pick the nft variant for the plain names; the image does the same
/// with plain links (weir itself calls the -legacy and -nft names).
const PLAIN_NAMES: &[(&str, &str)] = &[
    ("usr/sbin/iptables", "iptables-nft"),
    ("usr/sbin/iptables-save", "iptables-nft-save"),
    ("usr/sbin/iptables-restore", "iptables-nft-restore"),
    ("usr/sbin/ip6tables", "ip6tables-nft"),
    ("usr/sbin/ip6tables-save", "ip6tables-nft-save"),
    ("usr/sbin/ip6tables-restore", "ip6tables-nft-restore"),
];
/// Where the dynamic loader looks (Debian multiarch), as image paths.
const LIB_DIRS: &[&str] = &["usr/lib/x86_64-linux-gnu", "usr/lib64"];
/// Merged /usr: these top-level directories are links into usr/.
const MERGED: &[&str] = &["bin", "sbin", "lib", "lib64"];
/// Mount points and scratch space the runtime and the tools expect.
const EMPTY_DIRS: &[(&str, u32)] = &[
    ("dev", 0o755),
    ("proc", 0o555),
    ("sys", 0o555),
    ("run", 0o755),
    ("tmp", 0o1777),
    ("etc", 0o755),
    ("root", 0o700),
];

#[derive(Debug)]
pub enum Entry {
    File { package: String, from: PathBuf },
    Link { package: String, target: String },
}

impl Entry {
    fn package(&self) -> &str {
        match self {
            Entry::File { package, .. } | Entry::Link { package, .. } => package,
        }
    }
}

/// A library some file needs that no unpacked package has.
#[derive(Debug)]
pub struct Missing {
    pub soname: String,
    pub needed_by: String,
}

pub struct Selection {
    pub entries: BTreeMap<String, Entry>,
    pub missing: Vec<Missing>,
}

impl Selection {
    /// Package → how many of the image's paths came from it.
    pub fn packages(&self) -> BTreeMap<String, usize> {
        let mut count = BTreeMap::new();
        for e in self.entries.values() {
            *count.entry(e.package().to_string()).or_insert(0) += 1;
        }
        count
    }
}

/// The image's files, chosen from the unpacked packages (`packages`: name → directory, in
/// the order they are searched) and weir's binary.
pub fn select(packages: &BTreeMap<String, PathBuf>, weir: &Path) -> Result<Selection> {
    let mut s = Selector {
        packages,
        entries: BTreeMap::new(),
        missing: Vec::new(),
        queue: VecDeque::new(),
    };
    s.entries.insert(
        WEIR_PATH.to_string(),
        Entry::File {
            package: "weir".into(),
            from: weir.to_path_buf(),
        },
    );
    s.elf_needs(WEIR_PATH, weir)?;
    for tool in TOOLS {
        s.queue.push_back(tool.to_string());
    }
    for dir in DIRS {
        s.add_tree(dir)?;
    }
    s.drain()?;
    // Copyright files of every package that gave the image something.
    let used: BTreeSet<String> = s
        .entries
        .values()
        .map(|e| e.package().to_string())
        .collect();
    for package in used.iter().filter(|p| *p != "weir") {
        let copyright = format!("usr/share/doc/{package}/copyright");
        if s.locate(&copyright).is_some() {
            s.queue.push_back(copyright);
        }
    }
    s.drain()?;
    for (link, target) in PLAIN_NAMES {
        s.entries.insert(
            link.to_string(),
            Entry::Link {
                package: "iptables".into(),
                target: target.to_string(),
            },
        );
    }
    Ok(Selection {
        entries: s.entries,
        missing: s.missing,
    })
}

struct Selector<'a> {
    packages: &'a BTreeMap<String, PathBuf>,
    entries: BTreeMap<String, Entry>,
    missing: Vec<Missing>,
    queue: VecDeque<String>,
}

impl Selector<'_> {
    /// The package and file on disk of an image path (a package may ship it under /bin
    /// rather than /usr/bin).
    fn locate(&self, image_path: &str) -> Option<(String, PathBuf)> {
        let unmerged = MERGED.iter().find_map(|top| {
            image_path
                .strip_prefix("usr/")
                .filter(|rest| rest.starts_with(&format!("{top}/")))
        });
        for (package, dir) in self.packages {
            for candidate in std::iter::once(image_path).chain(unmerged) {
                let path = dir.join(candidate);
                // A directory on the way that is a link (an absolute one would lead out of
                // the package, to the build host's files) does not count.
                let inside = path
                    .parent()
                    .and_then(|p| fs::canonicalize(p).ok())
                    .zip(fs::canonicalize(dir).ok())
                    .is_some_and(|(parent, dir)| parent.starts_with(dir));
                if inside && path.symlink_metadata().is_ok() {
                    return Some((package.clone(), path));
                }
            }
        }
        None
    }

    fn drain(&mut self) -> Result<()> {
        while let Some(path) = self.queue.pop_front() {
            if self.entries.contains_key(&path) {
                continue;
            }
            let Some((package, from)) = self.locate(&path) else {
                bail!("{path} is in none of the locked packages (deploy/image/packages.lock)");
            };
            let meta = from.symlink_metadata()?;
            if meta.file_type().is_symlink() {
                let target = fs::read_link(&from)?.to_string_lossy().into_owned();
                let resolved = resolve(&path, &target);
                self.entries.insert(path, Entry::Link { package, target });
                self.queue.push_back(resolved);
            } else if meta.is_dir() {
                self.add_tree(&path)?;
            } else {
                self.entries.insert(
                    path.clone(),
                    Entry::File {
                        package,
                        from: from.clone(),
                    },
                );
                self.elf_needs(&path, &from)?;
            }
        }
        Ok(())
    }

    /// Every file under an image directory, from whichever package has it.
    fn add_tree(&mut self, dir: &str) -> Result<()> {
        let Some((_, from)) = self.locate(dir) else {
            bail!("{dir} is in none of the locked packages (deploy/image/packages.lock)");
        };
        for entry in fs::read_dir(&from).with_context(|| format!("reading {}", from.display()))? {
            let name = entry?.file_name();
            self.queue
                .push_back(format!("{dir}/{}", name.to_string_lossy()));
        }
        Ok(())
    }

    /// Queues the loader and the libraries an ELF file names; a library in no package is
    /// recorded as missing.
    fn elf_needs(&mut self, path: &str, file: &Path) -> Result<()> {
        if !is_elf(file)? {
            return Ok(());
        }
        let text = output(Command::new("readelf").args(["-d", "-l", "-W"]).arg(file))
            .with_context(|| format!("readelf -d -l {}", file.display()))?;
        let (interp, needed) = parse_readelf(&text);
        if let Some(interp) = interp {
            self.queue.push_back(resolve("", &interp));
        }
        for soname in needed {
            let found = LIB_DIRS
                .iter()
                .map(|d| format!("{d}/{soname}"))
                .find(|p| self.locate(p).is_some());
            match found {
                Some(p) => self.queue.push_back(p),
                None => {
                    if !self.missing.iter().any(|m| m.soname == soname) {
                        self.missing.push(Missing {
                            soname,
                            needed_by: path.to_string(),
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

fn is_elf(file: &Path) -> Result<bool> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    let mut f = fs::File::open(file).with_context(|| format!("opening {}", file.display()))?;
    Ok(f.read_exact(&mut magic).is_ok() && magic == *b"\x7fELF")
}

/// (the program interpreter, the NEEDED libraries) from `readelf -d -l -W`.
fn parse_readelf(text: &str) -> (Option<String>, Vec<String>) {
    let bracketed = |line: &str, after: &str| {
        let rest = &line[line.find(after)? + after.len()..];
        Some(rest.trim().trim_end_matches(']').trim().to_string())
    };
    let interp = text
        .lines()
        .find_map(|l| bracketed(l, "Requesting program interpreter:"));
    let needed = text
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| bracketed(l, "Shared library: ["))
        .collect();
    (interp, needed)
}

/// The image path a link at `link` pointing to `target` resolves to (lexically; merged
/// /usr applied).
fn resolve(link: &str, target: &str) -> String {
    let base = match target.starts_with('/') {
        true => PathBuf::new(),
        false => Path::new(link)
            .parent()
            .unwrap_or(Path::new(""))
            .to_path_buf(),
    };
    let mut parts: Vec<String> = Vec::new();
    for c in base.join(target.trim_start_matches('/')).components() {
        match c {
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::ParentDir => {
                parts.pop();
            }
            _ => {}
        }
    }
    if parts.len() > 1 && MERGED.contains(&parts[0].as_str()) {
        parts.insert(0, "usr".into());
    }
    parts.join("/")
}

/// Writes the selection into `root` (emptied first), every timestamp set to `epoch`.
pub fn write(selection: &Selection, root: &Path, epoch: u64) -> Result<()> {
    let _ = fs::remove_dir_all(root);
    fs::create_dir_all(root)?;
    for (dir, mode) in EMPTY_DIRS {
        let path = root.join(dir);
        fs::create_dir_all(&path)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(*mode))?;
    }
    for top in MERGED {
        fs::create_dir_all(root.join("usr").join(top))?;
        symlink(format!("usr/{top}"), root.join(top))?;
    }
    for (path, entry) in &selection.entries {
        let to = root.join(path);
        fs::create_dir_all(to.parent().unwrap())?;
        match entry {
            Entry::File { from, .. } => {
                fs::copy(from, &to)
                    .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
            }
            Entry::Link { target, .. } => symlink(target, &to)?,
        }
    }
    // Reproducible timestamps (tar records them): every path, links themselves too.
    let status = Command::new("find")
        .arg(root)
        .args([
            "-exec",
            "touch",
            "-h",
            "-d",
            &format!("@{epoch}"),
            "{}",
            "+",
        ])
        .status()
        .context("running find -exec touch")?;
    if !status.success() {
        bail!("setting timestamps in {} failed", root.display());
    }
    Ok(())
}

/// Runs each tool in the root (chroot) the way weir will: a missing library or a broken
/// link fails here, not on a node.
pub fn check(root: &Path) -> Result<()> {
    let checks: &[&[&str]] = &[
        &["/usr/local/bin/weir", "--version"],
        &["ipset", "version"],
        &["iptables-legacy", "--version"],
        &["ip6tables-legacy-restore", "--version"],
        &["iptables-nft-save", "--version"],
        &["ip6tables-nft", "--version"],
        &["iptables", "--version"],
        &["ip", "-V"],
        &["tc", "-V"],
        &["modprobe", "--version"],
    ];
    let mut failed = Vec::new();
    for argv in checks {
        let out = Command::new("chroot")
            .arg(root)
            .args(*argv)
            .env_clear()
            .env("PATH", super::PATH)
            .output()
            .context("running chroot")?;
        if !out.status.success() {
            failed.push(format!(
                "`{}` in the image: {} {}",
                argv.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    if !failed.is_empty() {
        bail!("the image's tools do not run:\n{}", failed.join("\n"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_resolve_lexically_into_merged_usr() {
        assert_eq!(resolve("usr/sbin/modprobe", "/bin/kmod"), "usr/bin/kmod");
        assert_eq!(
            resolve("usr/sbin/iptables-nft", "xtables-nft-multi"),
            "usr/sbin/xtables-nft-multi"
        );
        assert_eq!(
            resolve(
                "usr/lib64/ld-linux-x86-64.so.2",
                "../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
            ),
            "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
        );
        assert_eq!(
            resolve("", "/lib64/ld-linux-x86-64.so.2"),
            "usr/lib64/ld-linux-x86-64.so.2"
        );
    }

    #[test]
    fn readelf_gives_the_interpreter_and_libraries() {
        let text = "\
      [Requesting program interpreter: /lib64/ld-linux-x86-64.so.2]
 0x0000000000000001 (NEEDED)             Shared library: [libmnl.so.0]
 0x0000000000000001 (NEEDED)             Shared library: [libc.so.6]
 0x000000000000000c (INIT)               0x3000
";
        let (interp, needed) = parse_readelf(text);
        assert_eq!(interp.as_deref(), Some("/lib64/ld-linux-x86-64.so.2"));
        assert_eq!(needed, ["libmnl.so.0", "libc.so.6"]);
    }
}
