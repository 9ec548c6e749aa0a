use super::*;

fn addr(text: &str) -> SocketAddr {
    text.parse().expect("endpoint")
}

#[test]
fn an_ip_port_entry_admits_exactly_that_endpoint() {
    let subset = EndpointSubset::parse(["10.0.0.1:8000"]);
    assert!(subset.contains(addr("10.0.0.1:8000")));
    assert!(!subset.contains(addr("10.0.0.1:8001")));
    assert!(!subset.contains(addr("10.0.0.2:8000")));
}

#[test]
fn a_bare_ip_entry_admits_every_port_of_that_host() {
    let subset = EndpointSubset::parse([" 10.0.0.1 ", "[fd00::2]:9000"]);
    assert!(subset.contains(addr("10.0.0.1:8000")));
    assert!(subset.contains(addr("10.0.0.1:8001")));
    assert!(subset.contains(addr("[fd00::2]:9000")));
    assert!(!subset.contains(addr("[fd00::2]:9001")));
}

#[test]
fn entries_that_name_no_endpoint_are_skipped_and_leave_an_empty_subset() {
    let subset = EndpointSubset::parse(["pod-a.svc:8000", "", "10.0.0.1:port"]);
    assert!(subset.is_empty());
    assert!(!subset.contains(addr("10.0.0.1:8000")));
}
