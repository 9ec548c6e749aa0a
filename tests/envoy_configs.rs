//! The shipped Envoy configurations are valid for a real Envoy 1.40.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvroute_lab::envoy::{
    ORIGINAL_DST_CONFIG, OVERRIDE_HOST_CONFIG, rewrite_shipped, with_observer,
};
use support::{envoy_validate_file, project_file};

#[test]
fn the_fail_closed_original_dst_gateway_config_is_valid() {
    envoy_validate_file(&project_file("envoy/gateway-original-dst.yaml"));
}

#[test]
fn the_fail_open_override_host_gateway_config_is_valid() {
    envoy_validate_file(&project_file("envoy/gateway-override-host.yaml"));
}

#[test]
fn the_configs_rewritten_for_local_ports_are_valid_too() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pods = [
        "127.0.0.1:18000".parse().expect("addr"),
        "127.0.0.1:18001".parse().expect("addr"),
    ];
    let kvroute = "127.0.0.1:19002".parse().expect("addr");
    for (name, template) in [
        ("closed.yaml", ORIGINAL_DST_CONFIG),
        ("open.yaml", OVERRIDE_HOST_CONFIG),
    ] {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            rewrite_shipped(template, 18080, 19901, kvroute, &pods),
        )
        .expect("write");
        envoy_validate_file(&path);
    }
}

#[test]
fn the_shipped_configs_with_their_response_observer_turned_on_are_valid() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, template) in [
        ("closed.yaml", ORIGINAL_DST_CONFIG),
        ("open.yaml", OVERRIDE_HOST_CONFIG),
    ] {
        let observed = with_observer(template);
        assert!(
            observed.contains("\n                  - name: kvroute.response_observer\n")
                && observed.contains("observability_mode: true"),
            "{name}: the observer block uncomments into a filter of the chain"
        );
        let path = dir.path().join(name);
        std::fs::write(&path, observed).expect("write");
        envoy_validate_file(&path);
    }
}

/// The README's TLS section shows the transport sockets the TLS tests give Envoy (the
/// kvroute cluster's, the HTTPS pods' cluster's) as they are, so that what an operator
/// copies is what `tests/tls.rs` runs.
#[test]
fn the_readme_shows_the_transport_sockets_the_tls_tests_run() {
    let readme = std::fs::read_to_string(project_file("README.md")).expect("README");
    for socket in [
        kvroute_lab::envoy::KVROUTE_TLS_TRANSPORT_SOCKET,
        kvroute_lab::envoy::PODS_TLS_TRANSPORT_SOCKET,
    ] {
        assert!(
            readme.contains(socket),
            "README's TLS section lacks, or changed:\n{socket}"
        );
    }
}
