//! Each tenant's share of the requests in flight, which [`super::FlowRules`] reads.
//!
//! On `noisy-tenant` (a tenant at 1.5× the fleet's capacity beside a quiet one) the quiet
//! tenant's p90 TTFT went from 0.13 s alone to 0.5–0.7 s with turns in the queue alone, and
//! letting only the quiet tenant past the thresholds was not enough: its larger requests
//! need free KV that the noisy tenant's requests had taken. Both rules together: 0.21–0.38 s.
//! The room left must also hold the quiet tenant's larger requests, not only a tenth of each
//! pool: [`TenantShares::quiet_reserve`].

use std::collections::HashMap;
use std::sync::Arc;

/// Requests in flight per tenant, and the KV that the latest requests of tenants under
/// their share needed.
#[derive(Debug, Default)]
pub struct TenantShares {
    inflight: HashMap<Arc<str>, u32>,
    quiet: QuietDemand,
}

/// How many of the latest requests of tenants under their share [`TenantShares`] keeps
/// the KV demand of.
const QUIET_REQUESTS: usize = 64;

/// A ring of the KV tokens the latest requests of tenants under their share needed.
#[derive(Debug, Default)]
struct QuietDemand {
    tokens: Vec<u64>,
    next: usize,
}

impl QuietDemand {
    fn push(&mut self, tokens: u64) {
        if self.tokens.len() < QUIET_REQUESTS {
            self.tokens.push(tokens);
        } else {
            self.tokens[self.next] = tokens;
        }
        self.next = (self.next + 1) % QUIET_REQUESTS;
    }

    /// The largest of what was kept; 0 when nothing was.
    fn largest(&self) -> u64 {
        self.tokens.iter().copied().max().unwrap_or(0)
    }
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

    /// Whether `tenant` holds at most half an equal share of what is in flight among the
    /// tenants with requests in flight (itself included), beside at least one other tenant.
    pub fn quiet(&self, tenant: &str) -> bool {
        // own <= total / tenants / 2, in integers.
        self.standing(tenant)
            .is_some_and(|(own, total, tenants)| own * 2 * tenants <= total)
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

    /// A request of `tenant` was routed; it needs `kv_tokens` of KV (its prompt and
    /// expected output), kept when the tenant is under its share.
    pub fn started(&mut self, tenant: &Arc<str>, kv_tokens: u64) {
        if self.under_share(tenant) {
            self.quiet.push(kv_tokens);
        }
        *self.inflight.entry(Arc::clone(tenant)).or_insert(0) += 1;
    }

    /// The KV a busier tenant's request must leave free on its pod for the quieter
    /// tenants, in tokens: the most that one of the latest [`QUIET_REQUESTS`] requests of
    /// tenants under their share needed (0 before any). A tenth of each pool (flow
    /// control's headroom) held 2,000–3,000 tokens on `noisy-tenant`'s pods, while a fifth
    /// of its quiet tenant's requests needed more: those waited at the gateway for the busy
    /// tenant's requests to end. Over eight trace seeds the quiet tenant's p90 TTFT beside
    /// the busy one was 1.60× its value alone with the tenth alone, 1.42× with room for
    /// the 90th percentile of its requests besides, 1.16× with room for the largest; the
    /// busy tenant pays with more of its requests shed (22 % instead of 13 %).
    pub fn quiet_reserve(&self) -> u64 {
        self.quiet.largest()
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
            shares.started(&a, 100);
        }
    }

    #[test]
    fn a_quiet_tenant_beside_a_busy_one_is_under_its_share() {
        let mut shares = TenantShares::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        for _ in 0..9 {
            shares.started(&a, 100);
        }
        shares.started(&b, 100);
        assert!(shares.under_share("b"));
        assert!(!shares.under_share("a"));
        assert!(shares.over_share("a"));
        assert!(!shares.over_share("b"));
        // A newcomer with nothing in flight is under its share.
        assert!(shares.under_share("c"));
        // Equal shares favour no one.
        for _ in 0..8 {
            shares.started(&b, 100);
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

    #[test]
    fn a_tenant_with_at_most_half_an_equal_share_is_quiet() {
        let mut shares = TenantShares::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        for _ in 0..9 {
            shares.started(&a, 100);
        }
        assert!(!shares.quiet("a"), "alone, a is not quiet");
        assert!(shares.quiet("b"), "nothing in flight beside a busy a");
        shares.started(&b, 100);
        // b: 1 of 10, half an equal share is 2.5.
        assert!(shares.quiet("b") && !shares.quiet("a"));
        shares.started(&b, 100);
        shares.started(&b, 100);
        // b: 3 of 12, half an equal share is 3.
        assert!(shares.quiet("b"));
        shares.started(&b, 100);
        // b: 4 of 13: under its share, no longer quiet.
        assert!(!shares.quiet("b") && shares.under_share("b"));
    }

    #[test]
    fn the_reserve_is_the_largest_of_what_quiet_tenants_latest_requests_needed() {
        let mut shares = TenantShares::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        assert_eq!(shares.quiet_reserve(), 0, "nothing known yet");
        // Alone, a is never under its share: nothing is kept.
        shares.started(&a, 50_000);
        assert_eq!(shares.quiet_reserve(), 0);
        for _ in 0..8 {
            shares.started(&a, 50_000);
        }
        // b, under its share beside a busy a, sends 1..=10 thousand tokens (and ends each).
        for k in 1..=10u64 {
            shares.started(&b, k * 1000);
            shares.ended("b");
        }
        assert_eq!(shares.quiet_reserve(), 10_000);
        // What a's requests need is never kept: a is over its share.
        shares.started(&a, 90_000);
        assert_eq!(shares.quiet_reserve(), 10_000);
        // Only the latest 64 count: 64 small ones push the large ones out.
        for _ in 0..QUIET_REQUESTS {
            shares.started(&b, 500);
            shares.ended("b");
        }
        assert_eq!(shares.quiet_reserve(), 500);
    }
}
