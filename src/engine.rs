//! What each engine writes into the specs it makes, as rows: how gpushare recognises,
//! at create time, which engine made a container (its record's `engine`), a pod's
//! sandbox ("pause") container, a container of a CRI pod, the Kubernetes names of a
//! container, and the namespace containerd's CRI put it in. Installing an engine is
//! `ops::install`'s; recognising one is this table's, and nothing else names the
//! annotations or bundle paths below (docs/kubernetes.md, docs/state.md).
//!
//! Invariant: a row only ever tells what an engine wrote; what a container's author can
//! write too (every annotation through runc, `ctr`, Docker or Podman) is trusted for
//! nothing but a label or for taking gpushare away (a sandbox marker), except the CRI
//! namespace, which is read only for a bundle under containerd's CRI task directory.

/// One engine as the specs it makes show it. The rows are tried in order; the first
/// whose `made` matches names the engine.
#[derive(Debug)]
pub(crate) struct Engine {
    /// The name a container record and `status` give the engine.
    pub name: &'static str,
    /// What marks a container it made.
    pub made: Made,
    /// The annotation that marks a container of one of its pods, whatever its value,
    /// and the value that makes it the pod's sandbox ("pause") container.
    pub pod_marker: Option<(&'static str, &'static str)>,
    /// The annotations naming a container's namespace, pod and container.
    pub names: Option<[&'static str; 3]>,
    /// Where it says which Kubernetes namespace a container is in, for a bundle under
    /// its own task directory.
    pub namespace: Option<Namespace>,
}

/// What marks a container an engine made.
#[derive(Debug)]
pub(crate) enum Made {
    /// This annotation, whatever its value.
    Annotation(&'static str),
    /// This annotation with this value.
    AnnotationIs(&'static str, &'static str),
    /// Its bundle's path holds this text.
    BundleHas(&'static str),
    /// Nothing in a spec tells it (only its pod marker is known).
    Unknown,
}

/// Where containerd's CRI says a container's namespace: `annotation`, trusted only for a
/// bundle at `<state>/<task_dir>/<containerd_namespace>/<id>`, which only containerd's
/// clients (root) choose.
#[derive(Debug)]
pub(crate) struct Namespace {
    pub annotation: &'static str,
    pub task_dir: &'static str,
    pub containerd_namespace: &'static str,
}

/// The engines, most specific first.
pub(crate) const ENGINES: &[Engine] = &[
    // containerd's CRI (1.6 to 2.x): its keys win over any a pod passes through.
    Engine {
        name: "kubernetes",
        made: Made::Annotation("io.kubernetes.cri.container-type"),
        pod_marker: Some(("io.kubernetes.cri.container-type", "sandbox")),
        names: Some([
            "io.kubernetes.cri.sandbox-namespace",
            "io.kubernetes.cri.sandbox-name",
            "io.kubernetes.cri.container-name",
        ]),
        namespace: Some(Namespace {
            annotation: "io.kubernetes.cri.sandbox-namespace",
            task_dir: "io.containerd.runtime.v2.task",
            containerd_namespace: "k8s.io",
        }),
    },
    // CRI-O: copies of the kubelet's labels.
    Engine {
        name: "kubernetes",
        made: Made::AnnotationIs("io.container.manager", "cri-o"),
        pod_marker: Some(("io.kubernetes.cri-o.ContainerType", "sandbox")),
        names: Some([
            "io.kubernetes.pod.namespace",
            "io.kubernetes.pod.name",
            "io.kubernetes.container.name",
        ]),
        namespace: None,
    },
    // dockershim / cri-dockerd's label, should an engine ever copy it into annotations
    // (Kata reads it too).
    Engine {
        name: "kubernetes",
        made: Made::Unknown,
        pod_marker: Some(("io.kubernetes.docker.type", "podsandbox")),
        names: None,
        namespace: None,
    },
    // Podman's infra container carries no marker in its spec (the flag lives in libpod's
    // database).
    Engine {
        name: "podman",
        made: Made::AnnotationIs("io.container.manager", "libpod"),
        pod_marker: None,
        names: None,
        namespace: None,
    },
    Engine {
        name: "docker",
        made: Made::BundleHas("/moby/"),
        pod_marker: None,
        names: None,
        namespace: None,
    },
    Engine {
        name: "containerd",
        made: Made::BundleHas("io.containerd.runtime.v2.task"),
        pod_marker: None,
        names: None,
        namespace: None,
    },
];

/// The engine of a container no row recognises.
pub(crate) const UNKNOWN_ENGINE: &str = "runc";

/// Which engine made a container, from its annotations and its bundle's path.
pub(crate) fn made_by<'a>(
    annotation: impl Fn(&str) -> Option<&'a str>,
    bundle: &str,
) -> &'static str {
    ENGINES
        .iter()
        .find(|e| match e.made {
            Made::Annotation(key) => annotation(key).is_some(),
            Made::AnnotationIs(key, value) => annotation(key) == Some(value),
            Made::BundleHas(part) => bundle.contains(part),
            Made::Unknown => false,
        })
        .map_or(UNKNOWN_ENGINE, |e| e.name)
}

/// The annotations that mark a pod's sandbox ("pause") container, engine by engine, and
/// the value each must have.
pub(crate) fn sandbox_markers() -> impl Iterator<Item = (&'static str, &'static str)> {
    ENGINES.iter().filter_map(|e| e.pod_marker)
}

/// The marker annotation, if the container is a pod's sandbox: one map lookup per engine
/// that has pods, so that every path checks it first. The values are compared exactly, as
/// the engines write them. A marker only ever takes gpushare away from a container (a
/// tenant who sets one on a workload container opts out of its own share), never grants
/// anything.
pub(crate) fn sandbox_marker<'a>(
    annotation: impl Fn(&str) -> Option<&'a str>,
) -> Option<(&'static str, &'static str)> {
    sandbox_markers().find(|(key, value)| annotation(key) == Some(*value))
}

/// The annotation that marks a container of a CRI pod, if the container has one (any
/// value).
pub(crate) fn pod_container_marker<'a>(
    annotation: impl Fn(&str) -> Option<&'a str>,
) -> Option<&'static str> {
    sandbox_markers()
        .map(|(key, _)| key)
        .find(|key| annotation(key).is_some())
}

/// A container's namespace, pod and container names, each from the first engine that
/// wrote it (containerd's CRI before CRI-O's).
pub(crate) fn pod_names<'a>(annotation: impl Fn(&str) -> Option<&'a str>) -> [Option<&'a str>; 3] {
    let first = |i: usize| {
        ENGINES
            .iter()
            .filter_map(|e| e.names)
            .find_map(|keys| annotation(keys[i]))
    };
    [first(0), first(1), first(2)]
}

/// The Kubernetes namespace containerd's CRI put a container in: its annotation, for a
/// bundle under containerd's CRI task directory (`bundle`: the container's bundle
/// directory), and `None` for any other (a container's author can write the annotation
/// on every other path).
pub(crate) fn cri_namespace<'a>(
    annotation: impl Fn(&str) -> Option<&'a str>,
    bundle: &std::path::Path,
) -> Option<(&'a str, &'static str)> {
    let in_ns = bundle.parent()?;
    ENGINES
        .iter()
        .filter_map(|e| e.namespace.as_ref())
        .find_map(|rule| {
            let ours = bundle.is_absolute()
                && in_ns.file_name()? == rule.containerd_namespace
                && in_ns.parent()?.file_name()? == rule.task_dir;
            ours.then(|| annotation(rule.annotation).map(|ns| (ns, rule.annotation)))
                .flatten()
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Annotations, the bundle's path, and the engine they name.
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str);

    #[test]
    fn the_engine_is_the_first_row_that_matches() {
        let cases: &[Case] = &[
            (
                &[("io.kubernetes.cri.container-type", "container")],
                "",
                "kubernetes",
            ),
            (&[("io.container.manager", "cri-o")], "", "kubernetes"),
            (&[("io.container.manager", "libpod")], "/run/x", "podman"),
            (
                &[],
                "/run/containerd/io.containerd.runtime.v2.task/moby/abc",
                "docker",
            ),
            (
                &[],
                "/run/containerd/io.containerd.runtime.v2.task/default/abc",
                "containerd",
            ),
            (&[("io.container.manager", "other")], "/tmp/bundle", "runc"),
            (&[("io.kubernetes.docker.type", "podsandbox")], "", "runc"),
        ];
        for (annotations, bundle, want) in cases {
            let m = map(annotations);
            let got = made_by(|k| m.get(k).map(String::as_str), bundle);
            assert_eq!(got, *want, "{annotations:?} {bundle}");
        }
    }

    #[test]
    fn sandbox_markers_and_pod_container_markers() {
        let markers: Vec<_> = sandbox_markers().collect();
        assert_eq!(
            markers,
            [
                ("io.kubernetes.cri.container-type", "sandbox"),
                ("io.kubernetes.cri-o.ContainerType", "sandbox"),
                ("io.kubernetes.docker.type", "podsandbox"),
            ]
        );
        for (key, value) in &markers {
            let m = map(&[(key, value)]);
            let ann = |k: &str| m.get(k).map(String::as_str);
            assert_eq!(sandbox_marker(ann), Some((*key, *value)));
            assert_eq!(pod_container_marker(ann), Some(*key));
        }
        for other in ["container", "Sandbox", "sandbox ", ""] {
            let m = map(&[("io.kubernetes.cri.container-type", other)]);
            let ann = |k: &str| m.get(k).map(String::as_str);
            assert_eq!(sandbox_marker(ann), None, "{other:?}");
            assert_eq!(
                pod_container_marker(ann),
                Some("io.kubernetes.cri.container-type")
            );
        }
        assert_eq!(pod_container_marker(|_| None), None);
    }

    #[test]
    fn pod_names_come_from_containerd_s_keys_then_cri_o_s() {
        let both = map(&[
            ("io.kubernetes.cri.sandbox-namespace", "team-a"),
            ("io.kubernetes.pod.namespace", "forged"),
            ("io.kubernetes.pod.name", "p"),
            ("io.kubernetes.container.name", "c"),
        ]);
        assert_eq!(
            pod_names(|k| both.get(k).map(String::as_str)),
            [Some("team-a"), Some("p"), Some("c")]
        );
        assert_eq!(pod_names(|_| None), [None, None, None]);
    }

    #[test]
    fn the_cri_namespace_is_read_only_under_containerd_s_cri_task_directory() {
        let m = map(&[("io.kubernetes.cri.sandbox-namespace", "team-a")]);
        let ann = |k: &str| m.get(k).map(String::as_str);
        let ns = |b: &str| cri_namespace(ann, std::path::Path::new(b));
        assert_eq!(
            ns("/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc"),
            Some(("team-a", "io.kubernetes.cri.sandbox-namespace"))
        );
        for elsewhere in [
            "/run/containerd/io.containerd.runtime.v2.task/moby/abc",
            "/run/containerd/io.containerd.runtime.v2.task/default/abc",
            "io.containerd.runtime.v2.task/k8s.io/abc",
            "/tmp/k8s.io/abc",
        ] {
            assert_eq!(ns(elsewhere), None, "{elsewhere}");
        }
    }
}
