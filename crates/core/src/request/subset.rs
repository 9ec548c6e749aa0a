//! The gateway's subset hint (the endpoint picker protocol's
//! `x-gateway-destination-endpoint-subset`, in the `envoy.lb.subset_hint` metadata
//! namespace): the endpoints a request may go to. The protocol writes its entries as
//! `<ip:port>`, and such an entry admits exactly that endpoint. The reference picker
//! compares hosts only; a bare `<ip>` entry is therefore read the same way here, admitting
//! every port of that host. Anything else names no endpoint and is skipped: a hint that
//! names nothing usable admits nothing (the request gets 503, as the protocol requires
//! for an empty list).
//!
//! Membership is a hash lookup, so filtering N pods by a hint of M entries costs
//! O(N + M).

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointSubset {
    endpoints: HashSet<SocketAddr>,
    hosts: HashSet<IpAddr>,
}

impl EndpointSubset {
    /// The subset named by `entries` (`IP:PORT` or `IP`, surrounding blanks ignored).
    pub fn parse<'a>(entries: impl IntoIterator<Item = &'a str>) -> Self {
        let mut subset = EndpointSubset::default();
        for entry in entries.into_iter().map(str::trim) {
            if let Ok(endpoint) = entry.parse::<SocketAddr>() {
                subset.endpoints.insert(endpoint);
            } else if let Ok(host) = entry.parse::<IpAddr>() {
                subset.hosts.insert(host);
            }
        }
        subset
    }

    /// Whether the hint admits `endpoint`.
    pub fn contains(&self, endpoint: SocketAddr) -> bool {
        self.endpoints.contains(&endpoint) || self.hosts.contains(&endpoint.ip())
    }

    /// Whether the hint admits nothing at all.
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty() && self.hosts.is_empty()
    }
}

impl FromIterator<SocketAddr> for EndpointSubset {
    fn from_iter<I: IntoIterator<Item = SocketAddr>>(endpoints: I) -> Self {
        EndpointSubset {
            endpoints: endpoints.into_iter().collect(),
            hosts: HashSet::new(),
        }
    }
}

#[cfg(test)]
mod tests;
