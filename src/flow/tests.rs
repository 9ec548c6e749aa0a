use std::collections::HashMap;
use std::time::Duration;

use super::*;

fn settings() -> FlowSettings {
    FlowSettings {
        objectives: HashMap::from([("critical".to_owned(), 100), ("batch".to_owned(), -10)]),
        ..FlowSettings::default()
    }
}

#[test]
fn an_objective_maps_to_its_configured_priority() {
    let class = settings()
        .classify(Some("critical"), Some("team-a"))
        .expect("class");
    assert_eq!(
        class,
        RequestClass {
            priority: 100,
            tenant: "team-a".into()
        }
    );
    let batch = settings().classify(Some(" batch "), None).expect("class");
    assert_eq!(batch.priority, -10);
}

#[test]
fn an_unknown_or_missing_objective_has_priority_zero_and_the_default_tenant() {
    for objective in [None, Some("no-such-objective"), Some("")] {
        let class = settings().classify(objective, Some("")).expect("class");
        assert_eq!(class, RequestClass::default(), "{objective:?}");
    }
}

#[test]
fn a_fairness_id_over_the_bound_is_refused_and_one_at_the_bound_is_kept() {
    let at_bound = "t".repeat(MAX_FAIRNESS_ID_BYTES);
    let class = settings().classify(None, Some(&at_bound)).expect("class");
    assert_eq!(class.tenant, at_bound);
    let over = "t".repeat(MAX_FAIRNESS_ID_BYTES + 1);
    assert_eq!(
        settings().classify(None, Some(&over)),
        Err(ClassError::FairnessIdTooLong(MAX_FAIRNESS_ID_BYTES + 1))
    );
}

#[test]
fn objective_flags_parse_and_malformed_ones_say_why() {
    assert_eq!(
        parse_objective("critical=100"),
        Ok(("critical".into(), 100))
    );
    assert_eq!(parse_objective(" batch = -10 "), Ok(("batch".into(), -10)));
    let missing = parse_objective("critical").expect_err("no =");
    assert!(missing.contains("NAME=PRIORITY"), "{missing}");
    let not_a_number = parse_objective("critical=high").expect_err("not a number");
    assert!(not_a_number.contains("whole number"), "{not_a_number}");
    assert!(parse_objective("=5").is_err());
    assert!(parse_objective("x=99999999999").is_err(), "beyond i32");
}

#[test]
fn the_queue_is_off_with_a_zero_wait_or_size() {
    assert!(FlowSettings::default().queues());
    let no_wait = FlowSettings {
        max_wait: Duration::ZERO,
        ..FlowSettings::default()
    };
    assert!(!no_wait.queues());
    let no_room = FlowSettings {
        max_waiting: 0,
        ..FlowSettings::default()
    };
    assert!(!no_room.queues());
}

#[test]
fn drop_reasons_are_spelled_as_the_reference_picker_spells_them() {
    let spelled: Vec<&str> = DropReason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(
        spelled,
        [
            "rejected-saturated",
            "rejected-ttl-expired",
            "rejected-no-endpoints",
            "rejected-shutting-down"
        ]
    );
}
