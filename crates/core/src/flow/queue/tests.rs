use super::*;

/// A waiting request in these tests: a name, the pods it wants, and whether it starves
/// (holds back its tenant).
#[derive(Debug, Clone, PartialEq)]
struct Waiting {
    name: &'static str,
    model: &'static str,
    starving: bool,
}

fn holds(w: &Waiting) -> Holds {
    if w.name.starts_with("protected") {
        Holds::Band
    } else if w.starving {
        Holds::OwnTenant
    } else {
        Holds::Nothing
    }
}

fn waiting(name: &'static str) -> Waiting {
    Waiting {
        name,
        model: "m",
        starving: false,
    }
}

fn names(queue: &FlowQueue<Waiting>) -> Vec<&'static str> {
    queue.order().map(|(_, _, w)| w.name).collect()
}

/// Routes every request whose name is in `room`, once each.
fn dispatch_fitting(queue: &mut FlowQueue<Waiting>, room: &[&str]) -> Vec<&'static str> {
    queue
        .dispatch(
            usize::MAX,
            |w| w.model,
            holds,
            |w| room.contains(&w.name).then_some(()),
        )
        .into_iter()
        .map(|(w, ())| w.name)
        .collect()
}

#[test]
fn higher_bands_are_served_first_and_each_band_by_arrival() {
    let mut queue = FlowQueue::new();
    queue.push(0, "t", waiting("low-1"));
    queue.push(10, "t", waiting("high-1"));
    queue.push(0, "t", waiting("low-2"));
    queue.push(10, "t", waiting("high-2"));
    assert_eq!(names(&queue), ["high-1", "high-2", "low-1", "low-2"]);
    assert_eq!(queue.highest_priority(), Some(10));
    assert_eq!(queue.band_lengths().collect::<Vec<_>>(), [(10, 2), (0, 2)]);
}

#[test]
fn tenants_of_a_band_take_turns_so_a_burst_does_not_starve_the_others() {
    let mut queue = FlowQueue::new();
    for name in ["a1", "a2", "a3", "a4"] {
        queue.push(0, "a", waiting(name));
    }
    queue.push(0, "b", waiting("b1"));
    queue.push(0, "b", waiting("b2"));
    assert_eq!(names(&queue), ["a1", "b1", "a2", "b2", "a3", "a4"]);
}

#[test]
fn serving_a_tenant_passes_the_turn_to_the_next_one() {
    let mut queue = FlowQueue::new();
    for name in ["a1", "a2", "a3"] {
        queue.push(0, "a", waiting(name));
    }
    queue.push(0, "b", waiting("b1"));
    queue.push(0, "b", waiting("b2"));
    // Room for one: the first in turn goes, and the other tenant is first next time.
    assert_eq!(dispatch_fitting(&mut queue, &["a1"]), ["a1"]);
    assert_eq!(names(&queue), ["b1", "a2", "b2", "a3"]);
    assert_eq!(dispatch_fitting(&mut queue, &["b1"]), ["b1"]);
    assert_eq!(names(&queue), ["a2", "b2", "a3"]);
}

#[test]
fn a_tenant_that_comes_back_joins_the_end_of_the_turn() {
    let mut queue = FlowQueue::new();
    queue.push(0, "a", waiting("a1"));
    queue.push(0, "b", waiting("b1"));
    assert_eq!(dispatch_fitting(&mut queue, &["a1"]), ["a1"]);
    queue.push(0, "c", waiting("c1"));
    queue.push(0, "a", waiting("a2"));
    assert_eq!(names(&queue), ["b1", "c1", "a2"]);
}

#[test]
fn removing_a_request_leaves_the_rest_in_order_and_empties_the_queue() {
    let mut queue = FlowQueue::new();
    let first = queue.push(5, "a", waiting("a1"));
    let second = queue.push(5, "a", waiting("a2"));
    let other = queue.push(0, "b", waiting("b1"));
    assert_eq!(queue.remove(first).map(|w| w.name), Some("a1"));
    assert_eq!(queue.remove(first), None, "a request leaves once");
    assert_eq!(names(&queue), ["a2", "b1"]);
    queue.remove(second);
    queue.remove(other);
    assert!(queue.is_empty());
    assert_eq!(queue.len(), 0);
    assert_eq!(queue.highest_priority(), None);
    assert_eq!(queue.band_lengths().count(), 0, "no empty band is kept");
}

#[test]
fn a_request_that_does_not_fit_lets_smaller_ones_of_its_band_pass() {
    let mut queue = FlowQueue::new();
    queue.push(0, "t", waiting("large"));
    queue.push(0, "t", waiting("small"));
    assert_eq!(dispatch_fitting(&mut queue, &["small"]), ["small"]);
    assert_eq!(names(&queue), ["large"]);
}

#[test]
fn a_starving_request_holds_back_its_band_for_the_same_pods_only() {
    let mut queue = FlowQueue::new();
    queue.push(
        0,
        "t",
        Waiting {
            name: "large",
            model: "m",
            starving: true,
        },
    );
    queue.push(0, "t", waiting("small"));
    queue.push(
        0,
        "t",
        Waiting {
            name: "other-model",
            model: "n",
            starving: false,
        },
    );
    assert_eq!(
        dispatch_fitting(&mut queue, &["small", "other-model"]),
        ["other-model"]
    );
    assert_eq!(names(&queue), ["large", "small"]);
}

#[test]
fn a_starving_request_does_not_hold_back_other_tenants() {
    let mut queue = FlowQueue::new();
    queue.push(
        0,
        "noisy",
        Waiting {
            name: "large",
            model: "m",
            starving: true,
        },
    );
    queue.push(0, "noisy", waiting("noisy-small"));
    queue.push(0, "quiet", waiting("quiet-small"));
    assert_eq!(
        dispatch_fitting(&mut queue, &["noisy-small", "quiet-small"]),
        ["quiet-small"]
    );
    assert_eq!(names(&queue), ["large", "noisy-small"]);
}

#[test]
fn a_request_that_holds_its_band_stops_every_tenant_wanting_its_pods() {
    let mut queue = FlowQueue::new();
    queue.push(0, "quiet", waiting("protected-large"));
    queue.push(0, "noisy", waiting("noisy-small"));
    queue.push(
        0,
        "noisy",
        Waiting {
            name: "noisy-other-model",
            model: "n",
            starving: false,
        },
    );
    assert_eq!(
        dispatch_fitting(&mut queue, &["noisy-small", "noisy-other-model"]),
        ["noisy-other-model"]
    );
    assert_eq!(names(&queue), ["protected-large", "noisy-small"]);
}

#[test]
fn a_lower_band_never_takes_room_a_higher_band_waits_for() {
    let mut queue = FlowQueue::new();
    queue.push(10, "t", waiting("critical"));
    queue.push(0, "t", waiting("standard"));
    queue.push(
        0,
        "t",
        Waiting {
            name: "standard-other-model",
            model: "n",
            starving: false,
        },
    );
    assert_eq!(
        dispatch_fitting(&mut queue, &["standard", "standard-other-model"]),
        ["standard-other-model"]
    );
    assert_eq!(names(&queue), ["critical", "standard"]);
}

#[test]
fn a_pass_stops_after_its_misses() {
    let mut queue = FlowQueue::new();
    for name in ["n1", "n2", "n3", "fits"] {
        queue.push(
            0,
            "t",
            Waiting {
                name,
                // Different pods each, so no miss blocks the next.
                model: name,
                starving: false,
            },
        );
    }
    let mut tried = Vec::new();
    let routed = queue.dispatch(
        2,
        |w| w.model,
        |_| Holds::Nothing,
        |w| {
            tried.push(w.name);
            (w.name == "fits").then_some(())
        },
    );
    assert!(routed.is_empty());
    assert_eq!(tried, ["n1", "n2"]);
    assert_eq!(queue.len(), 4);
}
