//! Safe file operations on paths a tenant may reach: gpushare's own files read and written
//! without following a planted name (`io`), and trees removed without following a link
//! or running out of fds (`remove`). Each part's header states its invariants.

mod io;
mod remove;

pub(crate) use io::{read_regular, write_atomic, write_atomic_with};
pub(crate) use remove::{remove_all, remove_contents, remove_contents_but};
