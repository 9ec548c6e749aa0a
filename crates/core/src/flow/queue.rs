//! The waiting room's order: [`FlowQueue`].
//!
//! [`FlowQueue::dispatch`] walks the waiting requests in order and routes each that fits.
//! One that does not fit stays; requests behind it still go if they fit (a short request
//! is not held up by a long one that needs a pod to drain), with limits that keep the order
//! meaningful:
//! - a request that does not fit holds back the requests of *lower* bands that want the
//!   same pods (the same [`FlowQueue::dispatch`] key: the base model): a lower band never
//!   takes room a higher one is waiting for;
//! - the caller may say a request that does not fit also holds back requests of its band
//!   behind it that want the same pods ([`Holds`]): those of its own tenant (a request that
//!   has waited long, so that its tenant's smaller ones do not pass it forever), or those of
//!   every tenant (a tenant under its share, whose large request would otherwise wait while
//!   a busier tenant's smaller ones take each bit of room that appears).

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque, btree_map};
use std::sync::Arc;

use super::Priority;

/// What a request that does not fit holds back in its band (the requests behind it that
/// want the same pods). Lower bands are always held back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holds {
    Nothing,
    /// Its own tenant's requests.
    OwnTenant,
    /// Every tenant's requests.
    Band,
}

/// A waiting request's place in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EntryId(u64);

/// Requests waiting for room, by band, tenant and arrival.
#[derive(Debug)]
pub struct FlowQueue<T> {
    /// Highest priority first.
    bands: BTreeMap<Reverse<Priority>, Band<T>>,
    /// Where each waiting entry is.
    index: HashMap<EntryId, (Priority, Arc<str>)>,
    next_id: u64,
}

/// The requests of one priority.
#[derive(Debug)]
struct Band<T> {
    /// Each tenant's waiting requests, by arrival (ids grow with arrival).
    tenants: HashMap<Arc<str>, BTreeMap<EntryId, T>>,
    /// Tenants with waiting requests, the one to serve next first.
    turn: VecDeque<Arc<str>>,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Band {
            tenants: HashMap::new(),
            turn: VecDeque::new(),
        }
    }
}

impl<T> Default for FlowQueue<T> {
    fn default() -> Self {
        FlowQueue {
            bands: BTreeMap::new(),
            index: HashMap::new(),
            next_id: 0,
        }
    }
}

impl<T> FlowQueue<T> {
    pub fn new() -> Self {
        FlowQueue::default()
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Whether the request `id` still waits.
    pub fn contains(&self, id: EntryId) -> bool {
        self.index.contains_key(&id)
    }

    /// The highest priority waiting, if any.
    pub fn highest_priority(&self) -> Option<Priority> {
        self.bands.keys().next().map(|Reverse(p)| *p)
    }

    /// Requests waiting per priority, highest first.
    pub fn band_lengths(&self) -> impl Iterator<Item = (Priority, usize)> + '_ {
        self.bands.iter().map(|(Reverse(priority), band)| {
            (*priority, band.tenants.values().map(BTreeMap::len).sum())
        })
    }

    /// Adds a request at the end of its tenant's queue in its band. A tenant with nothing
    /// waiting joins the end of the band's turn.
    pub fn push(&mut self, priority: Priority, tenant: &str, item: T) -> EntryId {
        let id = EntryId(self.next_id);
        self.next_id += 1;
        let band = self.bands.entry(Reverse(priority)).or_default();
        let tenant: Arc<str> = match band.tenants.get_key_value(tenant) {
            Some((name, _)) => Arc::clone(name),
            None => {
                let name: Arc<str> = Arc::from(tenant);
                band.turn.push_back(Arc::clone(&name));
                name
            }
        };
        band.tenants
            .entry(Arc::clone(&tenant))
            .or_default()
            .insert(id, item);
        self.index.insert(id, (priority, tenant));
        id
    }

    /// The waiting request `id`, if it still waits.
    pub fn get(&self, id: EntryId) -> Option<&T> {
        let (priority, tenant) = self.index.get(&id)?;
        self.bands
            .get(&Reverse(*priority))?
            .tenants
            .get(tenant)?
            .get(&id)
    }

    /// Takes a request out without serving it (its client left, its wait ran out). The
    /// turn does not move.
    pub fn remove(&mut self, id: EntryId) -> Option<T> {
        self.take_out(id, false)
    }

    /// Takes a request out to serve it: its tenant's turn passes to the next tenant.
    fn serve(&mut self, id: EntryId) -> Option<T> {
        self.take_out(id, true)
    }

    fn take_out(&mut self, id: EntryId, served: bool) -> Option<T> {
        let (priority, tenant) = self.index.remove(&id)?;
        let btree_map::Entry::Occupied(mut slot) = self.bands.entry(Reverse(priority)) else {
            return None;
        };
        let band = slot.get_mut();
        let queue = band.tenants.get_mut(&tenant)?;
        let item = queue.remove(&id);
        let emptied = queue.is_empty();
        if emptied {
            band.tenants.remove(&tenant);
        }
        if emptied || served {
            if let Some(at) = band.turn.iter().position(|t| *t == tenant) {
                band.turn.remove(at);
            }
            if !emptied {
                band.turn.push_back(tenant);
            }
        }
        if band.tenants.is_empty() {
            slot.remove();
        }
        item
    }

    /// The waiting requests in the order they are served: band by band, highest first;
    /// in a band the tenants in turn, each tenant's requests by arrival (the first of each
    /// tenant, then the second of each, ...).
    pub fn order(&self) -> impl Iterator<Item = (EntryId, Priority, &T)> + '_ {
        self.walk()
            .map(|(id, priority, _, item)| (id, priority, item))
    }

    /// [`FlowQueue::order`], with each request's tenant.
    fn walk(&self) -> impl Iterator<Item = (EntryId, Priority, &str, &T)> + '_ {
        self.bands.iter().flat_map(|(Reverse(priority), band)| {
            band.interleaved()
                .map(move |(id, tenant, item)| (id, *priority, tenant, item))
        })
    }

    /// One pass of dispatch: walks the waiting requests in [`FlowQueue::order`] and asks
    /// `place` to route each; `place` returns `Some` when the request found a pod (and has
    /// taken its room), `None` when none has room. Returns the routed requests, taken out
    /// of the queue, in the order they were routed.
    ///
    /// `key` names the pods a request competes for (the base model); `holds` says what a
    /// request that does not fit holds back in its band (see the module docs). The pass
    /// stops after `max_misses` requests found no room: each miss costs a scheduler run,
    /// and the next pass (the next change of capacity) tries again.
    pub fn dispatch<K, R>(
        &mut self,
        max_misses: usize,
        key: impl Fn(&T) -> K,
        holds: impl Fn(&T) -> Holds,
        mut place: impl FnMut(&T) -> Option<R>,
    ) -> Vec<(T, R)>
    where
        K: PartialEq,
    {
        let mut routed = Vec::new();
        // Keys blocked for the rest of the walk (a higher band waits for them), for the
        // rest of this band (in one tenant, or in all: `None`), and to block from the next
        // band on.
        let mut blocked_below: Vec<K> = Vec::new();
        let mut blocked_here: Vec<(Option<&str>, K)> = Vec::new();
        let mut missed_in_band: Vec<K> = Vec::new();
        let mut band = None;
        let mut misses = 0;
        for (id, priority, tenant, item) in self.walk() {
            if band != Some(priority) {
                blocked_below.append(&mut missed_in_band);
                blocked_here.clear();
                band = Some(priority);
            }
            let wants = key(item);
            if blocked_below.contains(&wants)
                || blocked_here
                    .iter()
                    .any(|(t, k)| t.is_none_or(|t| t == tenant) && *k == wants)
            {
                continue;
            }
            match place(item) {
                Some(result) => routed.push((id, result)),
                None => {
                    misses += 1;
                    if misses >= max_misses {
                        break;
                    }
                    match holds(item) {
                        Holds::Nothing => {}
                        Holds::OwnTenant => blocked_here.push((Some(tenant), key(item))),
                        Holds::Band => blocked_here.push((None, key(item))),
                    }
                    missed_in_band.push(wants);
                }
            }
        }
        routed
            .into_iter()
            .filter_map(|(id, result)| self.serve(id).map(|item| (item, result)))
            .collect()
    }
}

impl<T> Band<T> {
    /// The band's requests with their tenants, the tenants in turn.
    fn interleaved(&self) -> impl Iterator<Item = (EntryId, &str, &T)> + '_ {
        let mut cursors: Vec<Option<(&str, btree_map::Iter<'_, EntryId, T>)>> = self
            .turn
            .iter()
            .filter_map(|tenant| {
                self.tenants
                    .get(tenant)
                    .map(|queue| Some((&**tenant, queue.iter())))
            })
            .collect();
        let count = cursors.len();
        let mut live = count;
        let mut at = 0;
        std::iter::from_fn(move || {
            while live > 0 {
                let slot = &mut cursors[at];
                at = (at + 1) % count;
                if let Some((tenant, cursor)) = slot {
                    match cursor.next() {
                        Some((id, item)) => return Some((*id, *tenant, item)),
                        None => {
                            *slot = None;
                            live -= 1;
                        }
                    }
                }
            }
            None
        })
    }
}

#[cfg(test)]
mod tests;
