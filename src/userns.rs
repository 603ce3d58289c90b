//! User namespace id maps: a container id → its host id, through the spec's
//! `linux.uidMappings`/`gidMappings` or a live namespace's `/proc/<pid>/uid_map`/`gid_map`.
//!
//! Invariants: a map is at most [`MAX_MAPS`] ranges (the kernel's limit), each `inside
//! outside count` with `count` ≥ 1 and no overflow; anything else is refused, never read
//! in part. `/proc` files are read as bounded regular files (`fsops::read_regular`), never
//! through a link. An id outside every range has no host id: callers refuse it.

use std::path::Path;

/// The most ranges a kernel id map holds (`user_namespaces(7)`: 340 since Linux 4.15).
pub(crate) const MAX_MAPS: usize = 340;
/// Longest `/proc/<pid>/uid_map` accepted: 340 lines of three 10-digit numbers.
const MAX_MAP_BYTES: u64 = 16 << 10;

/// One range of an id map: `size` ids from `container` inside, `host` outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IdRange {
    pub container: u32,
    pub host: u32,
    pub size: u32,
}

/// The host id of container id `id` under `map`, if a range holds it.
pub(crate) fn to_host(map: &[IdRange], id: u32) -> Option<u32> {
    map.iter()
        .find(|r| id >= r.container && id - r.container < r.size)
        .and_then(|r| r.host.checked_add(id - r.container))
}

/// Whether some range of `map` has host id `host` (some container id is that host user).
pub(crate) fn maps_host(map: &[IdRange], host: u32) -> bool {
    map.iter()
        .any(|r| host >= r.host && u64::from(host - r.host) < u64::from(r.size))
}

/// Whether `map` is the initial namespace's (`0 0 4294967295`): every id is itself.
pub(crate) fn is_identity(map: &[IdRange]) -> bool {
    matches!(
        map,
        [IdRange {
            container: 0,
            host: 0,
            size: u32::MAX
        }]
    )
}

/// Parses the kernel's `uid_map`/`gid_map` text.
pub(crate) fn parse(text: &str) -> Option<Vec<IdRange>> {
    let mut map = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut n = line.split_whitespace().map(|f| f.parse::<u32>().ok());
        let (Some(Some(container)), Some(Some(host)), Some(Some(size)), None) =
            (n.next(), n.next(), n.next(), n.next())
        else {
            return None;
        };
        if size == 0
            || container.checked_add(size - 1).is_none()
            || host.checked_add(size - 1).is_none()
            || map.len() == MAX_MAPS
        {
            return None;
        }
        map.push(IdRange {
            container,
            host,
            size,
        });
    }
    Some(map)
}

/// The pid of `/proc/<pid>/ns/user`, the one form of a joined user namespace whose maps
/// can be read.
pub(crate) fn proc_pid(ns_path: &Path) -> Option<u32> {
    let rest = ns_path.to_str()?.strip_prefix("/proc/")?;
    let (pid, tail) = rest.split_once('/')?;
    if tail != "ns/user" || pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok().filter(|p| *p > 0)
}

/// The uid and gid maps of process `pid`'s user namespace.
pub(crate) fn read_proc(pid: u32) -> Result<(Vec<IdRange>, Vec<IdRange>), String> {
    let read = |name: &str| {
        let path = format!("/proc/{pid}/{name}");
        let bytes = crate::fsops::read_regular(Path::new(&path), MAX_MAP_BYTES)
            .map_err(|e| format!("cannot read {path}: {e}"))?;
        std::str::from_utf8(&bytes)
            .ok()
            .and_then(parse)
            .ok_or_else(|| format!("{path} is not an id map"))
    };
    Ok((read("uid_map")?, read("gid_map")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_parse_and_map_as_the_kernel_writes_them() {
        let m = parse("         0     200000      65536\n").expect("map");
        assert_eq!(
            m,
            [IdRange {
                container: 0,
                host: 200000,
                size: 65536
            }]
        );
        assert_eq!(to_host(&m, 1000), Some(201000));
        assert_eq!(to_host(&m, 65536), None);
        assert!(maps_host(&m, 201000) && !maps_host(&m, 1000));
        let init = parse("         0          0 4294967295\n").expect("init");
        assert!(is_identity(&init) && !is_identity(&m));
        assert!(maps_host(&init, 1000));
        for bad in [
            "0 1",
            "0 1 0",
            "x 1 1",
            "0 1 2 3",
            "4294967295 0 2",
            "-1 0 1",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
        assert_eq!(parse(&"0 0 1\n".repeat(MAX_MAPS + 1)), None);
        assert_eq!(parse(""), Some(vec![]));
    }

    #[test]
    fn only_proc_pid_ns_user_names_a_readable_namespace() {
        assert_eq!(proc_pid(Path::new("/proc/4242/ns/user")), Some(4242));
        for bad in [
            "/proc/self/ns/user",
            "/proc/0/ns/user",
            "/proc/12/ns/ipc",
            "/run/userns/pod",
            "/proc/12/../1/ns/user",
            "/proc//ns/user",
        ] {
            assert_eq!(proc_pid(Path::new(bad)), None, "{bad}");
        }
    }
}
