//! Reservation metrics of a replica: `dramesh_reservations{state}` is the number held in each
//! state at the scrape; `dramesh_reservation_events_total{event}` counts reservations seen
//! entering `expired` or `conflicted` since the previous scrape (a reservation that entered and
//! left a state between two scrapes is not counted). Mesh and store metrics are
//! [`dramesh_mesh::observe::Observer`]'s.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::sync::lock;
use dramesh_api::native::{ReservationState, ReservationStatus};
use dramesh_telemetry::{Metrics, ReservationLabel as Counted};

/// Reservation states as of the previous scrape.
#[derive(Default)]
pub(crate) struct ReservationCounter {
    previous: Mutex<HashMap<String, ReservationState>>,
}

impl ReservationCounter {
    /// Sets the reservation gauges from the replica's list (ended ones included) and counts
    /// reservations that entered `expired` or `conflicted` since the previous call.
    pub(crate) fn observe(&self, m: &Metrics, list: &[ReservationStatus]) {
        let mut previous = lock(&self.previous);
        *previous = count_reservations(m, &previous, list);
    }
}

/// Reservation gauges and entry events (see the module docs); returns the states to compare
/// the next list with.
fn count_reservations(
    m: &Metrics,
    previous: &HashMap<String, ReservationState>,
    list: &[ReservationStatus],
) -> HashMap<String, ReservationState> {
    let (mut live, mut expired, mut conflicted) = (0, 0, 0);
    let mut seen = HashMap::with_capacity(list.len());
    for r in list {
        let counted = match r.status {
            ReservationState::Live => {
                live += 1;
                None
            }
            ReservationState::Expired => {
                expired += 1;
                Some(Counted::Expired)
            }
            ReservationState::Conflicted => {
                conflicted += 1;
                Some(Counted::Conflicted)
            }
            ReservationState::Satisfied | ReservationState::Released => None,
        };
        if let Some(event) = counted
            && previous.get(&r.id) != Some(&r.status)
        {
            m.reservation_events(event, 1);
        }
        seen.insert(r.id.clone(), r.status);
    }
    m.set_reservations(live, expired, conflicted);
    seen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_counted_by_state_and_entries() {
        let m = Metrics::new();
        let r = |id: &str, status| ReservationStatus {
            id: id.into(),
            status,
            ..ReservationStatus::default()
        };
        let gauges =
            |m: &Metrics| ["live", "expired", "conflicted"].map(|s| m.reservations.with([s]).get());
        let events = |m: &Metrics| {
            ["expired", "conflicted"].map(|e| m.reservation_events_total.with([e]).get())
        };
        let first = vec![
            r("a", ReservationState::Live),
            r("b", ReservationState::Conflicted),
            r("c", ReservationState::Released),
        ];
        let prev = count_reservations(&m, &HashMap::new(), &first);
        assert_eq!(gauges(&m), [1.0, 0.0, 1.0]);
        assert_eq!(events(&m), [0, 1]);
        let second = vec![
            r("a", ReservationState::Expired),
            r("b", ReservationState::Conflicted),
        ];
        count_reservations(&m, &prev, &second);
        assert_eq!(gauges(&m), [0.0, 1.0, 1.0]);
        assert_eq!(events(&m), [1, 1], "b stayed conflicted: counted once");
    }
}
