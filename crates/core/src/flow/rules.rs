//! When flow control holds a request, and against which thresholds a request is placed.
//!
//! Taking turns in the queue alone does not protect the requests that matter most: when the
//! others keep every pod at its saturation threshold, each of them still waits for a pod to
//! drain. So requests are placed against three sets of thresholds ([`FlowRules`]):
//! sheddable requests, and those of a tenant over an equal share of what is in flight while
//! a quieter tenant has requests in flight too, must leave [`HEADROOM`] of each pod's KV
//! free (thresholds that much lower); a tenant under its share may go that much past the
//! thresholds; the rest use the configured ones.

use std::borrow::Cow;
use std::hash::{Hash, Hasher};

use rand::Rng;

use crate::fleet::{Fleet, ModelClass, PrefixMatches, Snapshot};
use crate::request::RouteRequest;
use crate::scheduler::{self, Outlook, PickError, Picked, SchedulerConfig};

use super::{Priority, Shadows, TenantShares, is_sheddable};

/// The headroom between the thresholds of requests that must leave room and of the rest,
/// and between those of the rest and of a tenant under its share: a tenth of each pod's KV.
pub const HEADROOM: f64 = 0.1;

/// When placing a request may be declined for want of room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Never: the request goes to the least bad pod (flow control off, or no model).
    Never,
    /// When no pod has the KV it needs (placed, it would make a pod preempt).
    WithoutKv,
    /// Also when every pod is saturated (a sheddable request: refused rather than queued
    /// in a pod).
    WhenSaturated,
}

impl Hold {
    /// What a newly arrived request is held or refused on: a request without a model (GET
    /// /v1/models) takes no KV and is never held; a sheddable one is refused, queue or not,
    /// rather than placed without room or on saturated pods; any other waits for KV when
    /// the gateway `queues`.
    pub fn on_arrival(names_model: bool, priority: Priority, queues: bool) -> Hold {
        match (names_model, is_sheddable(priority), queues) {
            (false, _, _) => Hold::Never,
            (true, true, _) => Hold::WhenSaturated,
            (true, false, true) => Hold::WithoutKv,
            (true, false, false) => Hold::Never,
        }
    }

    /// What a request of `tenant` is held on, given what each tenant has in flight: a
    /// quiet tenant's request ([`TenantShares::quiet`]: at most half an equal share, beside
    /// a busier tenant) that would wait for KV goes to the best pod at once instead, where
    /// the pod queues it if it must. The gateway's queue is there for the busier tenants'
    /// excess, and their requests leave room for the quiet ones
    /// ([`FlowRules::for_request`]); a quiet request waiting for a scrape to show that room
    /// is what kept `noisy-tenant`'s quiet tenant slower beside the busy one (its largest
    /// requests waited 0.4–0.7 s at the gateway, p99). Tenants of equal weight are never
    /// that far under an equal share, so flow control holds for them as before.
    pub fn for_tenant(self, tenant: &str, shares: &TenantShares) -> Hold {
        match self {
            Hold::WithoutKv if shares.quiet(tenant) => Hold::Never,
            hold => hold,
        }
    }

    /// Whether a pick whose filters found `outlook` is declined
    /// ([`crate::scheduler::pick_unless`]).
    pub fn declines(self, outlook: &Outlook) -> bool {
        match self {
            Hold::Never => false,
            Hold::WithoutKv => outlook.lacks_room(),
            Hold::WhenSaturated => outlook.lacks_room() || outlook.relaxed.saturation,
        }
    }

    /// Picks the pod for `request` unless this hold declines the pick
    /// ([`scheduler::pick_unless`]; [`scheduler::pick`] where it never declines, which
    /// reads the fleet once where no pod passes the soft filters). `shadows` are those of
    /// the dispatch pass the pick belongs to, on `fleet` (empty for a request on arrival):
    /// a request they cover is declined without a pick, and the pick's own shadow joins
    /// them.
    pub fn pick<R: Rng + ?Sized>(
        self,
        request: &RouteRequest<'_>,
        prefix: Option<&PrefixMatches>,
        fleet: &Fleet,
        config: &SchedulerConfig,
        rng: &mut R,
        shadows: &mut Shadows,
    ) -> Result<Picked, PickError> {
        if self == Hold::Never {
            let decision = scheduler::pick(request, prefix, fleet, config, rng)?;
            shadows.clear();
            return Ok(Picked::Decided(decision));
        }
        if let Some(outlook) = shadows.covering(request, prefix, config) {
            // The tie-break the pick would have drawn, so that later picks draw alike.
            rng.next_u64();
            return Ok(Picked::Declined(outlook));
        }
        let picked = scheduler::pick_unless(request, prefix, fleet, config, rng, |outlook| {
            self.declines(outlook)
        })?;
        match &picked {
            Picked::Declined(outlook) => shadows.cast(request, config, outlook),
            // It will be placed.
            Picked::Decided(_) => shadows.clear(),
        }
        Ok(picked)
    }
}

/// The three scheduler configurations requests are placed by.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowRules {
    normal: SchedulerConfig,
    /// [`HEADROOM`] of each pool kept free, the KV-use threshold that much lower, the queue
    /// threshold halved.
    leaving_room: SchedulerConfig,
    /// The KV-use threshold [`HEADROOM`] higher (at most 1), the queue threshold doubled.
    /// The request still needs the KV it takes (the headroom filter is unchanged).
    using_headroom: SchedulerConfig,
}

impl FlowRules {
    pub fn new(config: &SchedulerConfig) -> Self {
        let mut leaving_room = config.clone();
        leaving_room.keep_free = HEADROOM;
        leaving_room.saturation.kv_usage = (config.saturation.kv_usage - HEADROOM).max(HEADROOM);
        leaving_room.saturation.queue_depth = (config.saturation.queue_depth / 2).max(1);
        let mut using_headroom = config.clone();
        using_headroom.saturation.kv_usage = (config.saturation.kv_usage + HEADROOM).min(1.0);
        using_headroom.saturation.queue_depth = config.saturation.queue_depth.saturating_mul(2);
        FlowRules {
            normal: config.clone(),
            leaving_room,
            using_headroom,
        }
    }

    /// The configuration a request of `priority` and `tenant` is placed by, given what each
    /// tenant has in flight. A tenant over its share leaves, besides [`HEADROOM`], room for
    /// the quieter tenants' larger requests ([`TenantShares::quiet_reserve`]).
    pub fn for_request(
        &self,
        priority: Priority,
        tenant: &str,
        shares: &TenantShares,
    ) -> Cow<'_, SchedulerConfig> {
        if is_sheddable(priority) {
            return Cow::Borrowed(&self.leaving_room);
        }
        if shares.over_share(tenant) {
            let reserve = shares.quiet_reserve();
            if reserve == 0 {
                return Cow::Borrowed(&self.leaving_room);
            }
            let mut config = self.leaving_room.clone();
            config.keep_free_tokens = reserve;
            return Cow::Owned(config);
        }
        Cow::Borrowed(if shares.under_share(tenant) {
            &self.using_headroom
        } else {
            &self.normal
        })
    }

    /// What a request of `priority` and `tenant` that `hold` would hold is held on, and
    /// the configuration it is placed by: [`Hold::for_tenant`] and
    /// [`FlowRules::for_request`], read from one look at what each tenant has in flight
    /// (the gateway's shares sit behind a lock every placement would otherwise take twice).
    pub fn placement(
        &self,
        hold: Hold,
        priority: Priority,
        tenant: &str,
        shares: &TenantShares,
    ) -> (Hold, Cow<'_, SchedulerConfig>) {
        (
            hold.for_tenant(tenant, shares),
            self.for_request(priority, tenant, shares),
        )
    }

    /// The configured thresholds.
    pub fn normal(&self) -> &SchedulerConfig {
        &self.normal
    }
}

/// What a request for `model` competes for in the waiting room: a digest of its base model
/// (an adapter runs on its base model's pods), the key of [`super::FlowQueue::dispatch`].
pub fn pods_key(model: &str, snapshot: &Snapshot, config: &SchedulerConfig) -> u64 {
    let base = match config.adapters.get(model) {
        Some(base) => base.as_str(),
        None => match snapshot.models.class(model) {
            Some(ModelClass::Adapter { base }) => base.as_str(),
            _ => model,
        },
    };
    // SipHash with fixed keys: the same digest in every process.
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    base.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn sheddable_requests_and_a_busy_tenant_leave_headroom_and_a_quiet_one_may_use_it() {
        let rules = FlowRules::new(&SchedulerConfig::default());
        let mut shares = TenantShares::default();
        let (busy, quiet): (Arc<str>, Arc<str>) = (Arc::from("busy"), Arc::from("quiet"));
        assert_eq!(&*rules.for_request(0, "busy", &shares), rules.normal());
        let stricter = rules.for_request(-1, "busy", &shares);
        assert!((stricter.keep_free - HEADROOM).abs() < 1e-12);
        assert!((stricter.saturation.kv_usage - 0.7).abs() < 1e-9);
        assert_eq!(stricter.saturation.queue_depth, 2);
        for _ in 0..9 {
            shares.started(&busy, 100);
        }
        shares.started(&quiet, 100);
        let busy_now = rules.for_request(0, "busy", &shares);
        assert_eq!(busy_now.keep_free, HEADROOM);
        // Besides, room for the quiet tenant's requests (the one it sent needed 100).
        assert_eq!(busy_now.keep_free_tokens, 100);
        assert_eq!(rules.for_request(-1, "busy", &shares).keep_free_tokens, 0);
        let looser = rules.for_request(0, "quiet", &shares);
        assert!((looser.saturation.kv_usage - 0.9).abs() < 1e-9);
        assert_eq!(looser.saturation.queue_depth, 10);
        assert_eq!(looser.keep_free, 0.0);
    }

    #[test]
    fn a_quiet_tenants_request_is_not_held_for_kv_and_a_sheddable_one_still_is_refused() {
        let mut shares = TenantShares::default();
        let busy: Arc<str> = Arc::from("busy");
        for _ in 0..9 {
            shares.started(&busy, 100);
        }
        let waits = Hold::on_arrival(true, 0, true);
        assert_eq!(waits, Hold::WithoutKv);
        assert_eq!(waits.for_tenant("quiet", &shares), Hold::Never);
        assert_eq!(waits.for_tenant("busy", &shares), Hold::WithoutKv);
        // A sheddable request is refused on saturation whoever sends it.
        let sheddable = Hold::on_arrival(true, -1, true);
        assert_eq!(sheddable.for_tenant("quiet", &shares), Hold::WhenSaturated);
        // Alone, no tenant is quiet.
        assert_eq!(
            waits.for_tenant("busy", &TenantShares::default()),
            Hold::WithoutKv
        );
    }

    #[test]
    fn sheddable_requests_are_refused_already_when_every_pod_is_saturated() {
        let mut decision = Outlook {
            relaxed: crate::scheduler::Relaxed {
                saturation: true,
                kv_headroom: false,
            },
            could_fit: true,
            tokens_needed: 10,
            shadow: None,
        };
        assert!(!Hold::Never.declines(&decision));
        assert!(!Hold::WithoutKv.declines(&decision));
        assert!(Hold::WhenSaturated.declines(&decision));
        decision.relaxed.kv_headroom = true;
        assert!(Hold::WithoutKv.declines(&decision));
        decision.could_fit = false;
        assert!(!Hold::WithoutKv.declines(&decision), "waiting cannot help");
    }

    #[test]
    fn on_arrival_a_request_without_a_model_is_never_held_and_a_sheddable_one_always_may_be() {
        assert_eq!(Hold::on_arrival(false, -5, true), Hold::Never);
        assert_eq!(Hold::on_arrival(true, -5, false), Hold::WhenSaturated);
        assert_eq!(Hold::on_arrival(true, 0, true), Hold::WithoutKv);
        assert_eq!(Hold::on_arrival(true, 0, false), Hold::Never);
    }
}
