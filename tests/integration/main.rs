//! Integration tests: the real `gpushare-runtime`, `gpushare` and `gpushare-mps-sim`
//! binaries through real runc, as root. Run them with the README's test command.

mod agent;
mod allocated;
mod cdi;
mod core_path;
mod cri;
mod docs;
mod driver_root;
mod engines;
mod entry_paths;
mod faults_found;
mod faults_live;
mod modes;
mod nri;
mod nvml;
mod operator;
mod security;
mod tenant_daemon;
mod tenant_mounts;
mod tenant_state;
mod v3;
mod watch;
