//! Static discovery: a fixed list of endpoints from `--endpoints` or the config file.

use std::net::SocketAddr;

/// A fixed list of endpoints, sorted and without duplicates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticDiscovery {
    endpoints: Vec<SocketAddr>,
}

impl StaticDiscovery {
    pub fn new(mut endpoints: Vec<SocketAddr>) -> Self {
        endpoints.sort();
        endpoints.dedup();
        StaticDiscovery { endpoints }
    }

    pub fn endpoints(&self) -> &[SocketAddr] {
        &self.endpoints
    }

    pub fn into_endpoints(self) -> Vec<SocketAddr> {
        self.endpoints
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_endpoints_are_listed_once() {
        let a: SocketAddr = "10.0.0.1:8000".parse().expect("addr");
        let b: SocketAddr = "10.0.0.2:8000".parse().expect("addr");
        let discovery = StaticDiscovery::new(vec![b, a, b]);
        assert_eq!(discovery.endpoints(), &[a, b]);
    }
}
