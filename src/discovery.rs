//! Where the endpoint set comes from. Static discovery (the default) takes the list
//! from the command line or the config file; Kubernetes discovery will feed the same
//! store from watches.

use std::net::SocketAddr;

use crate::state::PodStore;

/// A fixed list of endpoints.
#[derive(Debug, Clone)]
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

    /// Puts the endpoints into the store.
    pub fn apply(&self, store: &PodStore) {
        store.set_endpoints(&self.endpoints);
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
