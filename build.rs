//! Records the git commit the binaries are built from (`--version`); "unknown" outside
//! a git checkout.
//!
//! Cargo reruns this when HEAD moves: the HEAD file of the checkout's git dir and the
//! ref of the branch it names, in its common dir (asked from git, so that a worktree, whose `.git` is a
//! file, works too). A path that does not exist would make cargo rebuild every time, so
//! only existing ones are named; outside a checkout, only this file.
fn git(args: &[&str]) -> Option<String> {
    std::process::Command::new("git")
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=GPUSHARE_GIT_COMMIT={commit}");
    println!("cargo:rerun-if-changed=build.rs");
    let dir = git(&["rev-parse", "--absolute-git-dir"]);
    let common = git(&["rev-parse", "--git-common-dir"]).map(|c| {
        let p = std::path::PathBuf::from(&c);
        if p.is_absolute() {
            p
        } else {
            std::env::current_dir().unwrap_or_default().join(p)
        }
    });
    // The branch HEAD names, not every branch: another branch's commits change nothing here.
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    let watched = [
        dir.map(|d| std::path::PathBuf::from(d).join("HEAD")),
        common.as_ref().zip(branch).map(|(c, b)| c.join(b)),
        common.map(|c| c.join("packed-refs")),
    ];
    for path in watched.into_iter().flatten().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}
