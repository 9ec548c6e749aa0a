//! Each tenant's share of the requests in flight, which [`super::FlowRules`] reads.
//!
//! On `noisy-tenant` (a tenant at 1.5× the fleet's capacity beside a quiet one) the quiet
//! tenant's p90 TTFT went from 0.13 s alone to 0.5–0.7 s with turns in the queue alone, and
//! letting only the quiet tenant past the thresholds was not enough: its larger requests
//! need free KV that the noisy tenant's requests had taken. Both rules together: 0.21–0.38 s.

use std::collections::HashMap;
use std::sync::Arc;

/// Requests in flight per tenant.
#[derive(Debug, Default)]
pub struct TenantShares {
    inflight: HashMap<Arc<str>, u32>,
}

impl TenantShares {
    /// Whether `tenant` holds at least one request more than an equal share of what is in
    /// flight among the tenants with requests in flight (itself included). A tenant alone
    /// is never over its share, nor are tenants with equal shares.
    pub fn over_share(&self, tenant: &str) -> bool {
        // own >= total / tenants + 1, in integers.
        self.standing(tenant)
            .is_some_and(|(own, total, tenants)| own * tenants >= total + tenants)
    }

    /// Whether `tenant` holds less than an equal share of what is in flight among the
    /// tenants with requests in flight (itself included), less one request. A tenant alone
    /// is never under its share, nor are tenants with equal shares.
    pub fn under_share(&self, tenant: &str) -> bool {
        // own + 1 <= total / tenants, in integers.
        self.standing(tenant)
            .is_some_and(|(own, total, tenants)| (own + 1) * tenants <= total)
    }

    /// `tenant`'s requests in flight, everyone's, and how many tenants count (those with
    /// requests in flight, and `tenant`); `None` while no other tenant has any.
    fn standing(&self, tenant: &str) -> Option<(u64, u64, u64)> {
        let own = self.inflight.get(tenant).copied().unwrap_or(0);
        let others = self.inflight.len() - usize::from(own > 0);
        if others == 0 {
            return None;
        }
        let total: u32 = self.inflight.values().sum();
        Some((u64::from(own), u64::from(total), others as u64 + 1))
    }

    /// A request of `tenant` was routed.
    pub fn started(&mut self, tenant: &Arc<str>) {
        *self.inflight.entry(Arc::clone(tenant)).or_insert(0) += 1;
    }

    /// A request of `tenant` ended.
    pub fn ended(&mut self, tenant: &str) {
        if let Some(count) = self.inflight.get_mut(tenant) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.inflight.remove(tenant);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_alone_is_never_under_its_share() {
        let mut shares = TenantShares::default();
        let a: Arc<str> = Arc::from("a");
        for _ in 0..10 {
            assert!(!shares.under_share("a"));
            shares.started(&a);
        }
    }

    #[test]
    fn a_quiet_tenant_beside_a_busy_one_is_under_its_share() {
        let mut shares = TenantShares::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        for _ in 0..9 {
            shares.started(&a);
        }
        shares.started(&b);
        assert!(shares.under_share("b"));
        assert!(!shares.under_share("a"));
        assert!(shares.over_share("a"));
        assert!(!shares.over_share("b"));
        // A newcomer with nothing in flight is under its share.
        assert!(shares.under_share("c"));
        // Equal shares favour no one.
        for _ in 0..8 {
            shares.started(&b);
        }
        assert!(!shares.under_share("a") && !shares.under_share("b"));
        assert!(!shares.over_share("a") && !shares.over_share("b"));
        for _ in 0..9 {
            shares.ended("b");
        }
        assert!(
            shares.under_share("b"),
            "b has nothing in flight beside a busy a"
        );
        assert!(!shares.under_share("a"), "a is alone");
    }
}
