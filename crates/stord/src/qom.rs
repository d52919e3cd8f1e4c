//! QOM introspection (`qom-list`, `qom-list-types`, `qom-list-properties`): the object
//! types stord has, placed in QEMU's type tree with QEMU's names, parents and property
//! types, and the paths of the objects and chardevs made (`/objects/ID`,
//! `/chardevs/ID`). Management tools ask these before they add objects; QEMU's tests
//! list chardevs through them.

use crate::iothread;

/// One type.
pub struct QomType {
    pub name: &'static str,
    pub parent: Option<&'static str>,
    pub abstract_: bool,
    /// Interfaces it implements (beyond its parents').
    pub implements: &'static [&'static str],
    /// Its own properties (name, QOM type), beside its parents'.
    pub properties: fn() -> Vec<(&'static str, &'static str)>,
}

const fn ty(
    name: &'static str,
    parent: Option<&'static str>,
    abstract_: bool,
    implements: &'static [&'static str],
    properties: fn() -> Vec<(&'static str, &'static str)>,
) -> QomType {
    QomType {
        name,
        parent,
        abstract_,
        implements,
        properties,
    }
}

fn none() -> Vec<(&'static str, &'static str)> {
    Vec::new()
}

const USER: &[&str] = &["user-creatable"];

/// The iothread's properties: QEMU's, then stord's polling ones ([`iothread::PROPERTIES`]).
fn iothread_props() -> Vec<(&'static str, &'static str)> {
    iothread::PROPERTIES
        .iter()
        .map(|p| {
            let t = match p.kind {
                iothread::Kind::Int => "int",
                iothread::Kind::Bool => "bool",
                iothread::Kind::Str => "string",
            };
            (p.name, t)
        })
        .collect()
}

/// QEMU's throttle-group properties: `limits`, and each limit by itself.
fn throttle_group_props() -> Vec<(&'static str, &'static str)> {
    const INTS: &[&str] = &[
        "x-iops-total",
        "x-iops-total-max",
        "x-iops-total-max-length",
        "x-iops-read",
        "x-iops-read-max",
        "x-iops-read-max-length",
        "x-iops-write",
        "x-iops-write-max",
        "x-iops-write-max-length",
        "x-bps-total",
        "x-bps-total-max",
        "x-bps-total-max-length",
        "x-bps-read",
        "x-bps-read-max",
        "x-bps-read-max-length",
        "x-bps-write",
        "x-bps-write-max",
        "x-bps-write-max-length",
        "x-iops-size",
    ];
    let mut v = vec![("limits", "ThrottleLimits")];
    v.extend(INTS.iter().map(|n| (*n, "int")));
    v
}

/// Every type, parents before children.
pub const TYPES: &[QomType] = &[
    ty("object", None, true, &[], || vec![("type", "string")]),
    ty("interface", None, true, &[], none),
    ty("user-creatable", Some("interface"), true, &[], none),
    ty("container", Some("object"), false, &[], none),
    ty("event-loop-base", Some("object"), true, &[], none),
    ty(
        "iothread",
        Some("event-loop-base"),
        false,
        USER,
        iothread_props,
    ),
    ty(
        "throttle-group",
        Some("object"),
        false,
        USER,
        throttle_group_props,
    ),
    ty("tls-creds", Some("object"), true, &[], || {
        vec![
            ("endpoint", "QCryptoTLSCredsEndpoint"),
            ("dir", "string"),
            ("verify-peer", "bool"),
            ("priority", "string"),
        ]
    }),
    ty("tls-creds-x509", Some("tls-creds"), false, USER, || {
        vec![("sanity-check", "bool"), ("passwordid", "string")]
    }),
    ty("tls-creds-psk", Some("tls-creds"), false, USER, || {
        vec![("username", "string")]
    }),
    ty("authz", Some("object"), true, &[], none),
    ty("authz-simple", Some("authz"), false, USER, || {
        vec![("identity", "string")]
    }),
    ty("metrics", Some("object"), false, USER, || {
        vec![("addr", "SocketAddress")]
    }),
    ty("monitor", Some("object"), true, &[], || {
        vec![("chardev", "string")]
    }),
    ty("monitor-qmp", Some("monitor"), false, USER, || {
        vec![
            ("pretty", "bool"),
            ("close-action", "MonitorQMPCloseAction"),
        ]
    }),
    ty("secret_common", Some("object"), true, &[], || {
        vec![
            ("format", "QCryptoSecretFormat"),
            ("keyid", "string"),
            ("iv", "string"),
        ]
    }),
    ty("secret", Some("secret_common"), false, USER, || {
        vec![("data", "string"), ("file", "string")]
    }),
    ty("chardev", Some("object"), true, &[], none),
    ty("chardev-fd", Some("chardev"), true, &[], none),
    ty("chardev-socket", Some("chardev"), false, &[], none),
    ty("chardev-null", Some("chardev"), false, &[], none),
    ty("chardev-ringbuf", Some("chardev"), false, &[], none),
    ty("chardev-memory", Some("chardev-ringbuf"), false, &[], none),
    ty("chardev-file", Some("chardev-fd"), false, &[], none),
    ty("chardev-stdio", Some("chardev-fd"), false, &[], none),
];

/// The type `name`.
pub fn find(name: &str) -> Option<&'static QomType> {
    TYPES.iter().find(|t| t.name == name)
}

/// Whether `t` is `what` or below it, by parent or interface.
fn is_a(t: &QomType, what: &str) -> bool {
    let mut cur = Some(t);
    while let Some(c) = cur {
        if c.name == what || c.implements.contains(&what) {
            return true;
        }
        cur = c.parent.and_then(find);
    }
    false
}

/// `qom-list-types`: the types that are (or implement) `implements`, abstract ones only
/// if asked.
pub fn list_types(implements: Option<&str>, with_abstract: bool) -> Vec<&'static QomType> {
    TYPES
        .iter()
        .filter(|t| with_abstract || !t.abstract_)
        .filter(|t| implements.is_none_or(|i| is_a(t, i)))
        .collect()
}

/// A type's properties, its ancestors' first (`type` first of all).
pub fn properties(t: &QomType) -> Vec<(&'static str, &'static str)> {
    let mut chain = vec![t];
    while let Some(p) = chain.last().and_then(|c| c.parent).and_then(find) {
        chain.push(p);
    }
    chain.iter().rev().flat_map(|c| (c.properties)()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_object_type_and_chardev_has_its_place_in_the_tree() {
        for o in crate::daemon::OBJECT_TYPES {
            let t = find(o.name).unwrap_or_else(|| panic!("{} not in qom::TYPES", o.name));
            assert!(is_a(t, "user-creatable") && !t.abstract_, "{}", o.name);
        }
        for t in TYPES {
            assert!(t.parent.is_none_or(|p| find(p).is_some()), "{}", t.name);
        }
        let names: Vec<_> = list_types(Some("chardev"), false)
            .iter()
            .map(|t| t.name)
            .collect();
        assert!(names.contains(&"chardev-memory") && !names.contains(&"chardev-fd"));
        let props = properties(find("tls-creds-psk").unwrap());
        assert_eq!(props[0], ("type", "string"));
        assert!(props.contains(&("endpoint", "QCryptoTLSCredsEndpoint")));
        assert!(props.contains(&("username", "string")));
    }
}
