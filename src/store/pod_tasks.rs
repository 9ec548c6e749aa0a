//! One background task per endpoint (a poller, an event subscriber), started and stopped
//! as the store's endpoint set changes, and all stopped when the set is dropped.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use tokio::task::JoinHandle;

/// The tasks of one kind, by endpoint.
#[derive(Debug, Default)]
pub struct PodTasks {
    tasks: Mutex<HashMap<SocketAddr, JoinHandle<()>>>,
}

impl PodTasks {
    pub fn new() -> Self {
        PodTasks::default()
    }

    /// Makes the tasks match `endpoints`: the task of an endpoint no longer listed is
    /// aborted (and `gone` told), and `start` runs for each endpoint without one (`None`:
    /// that endpoint gets none).
    pub fn reconcile(
        &self,
        endpoints: &[SocketAddr],
        mut start: impl FnMut(SocketAddr) -> Option<JoinHandle<()>>,
        mut gone: impl FnMut(SocketAddr),
    ) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        tasks.retain(|endpoint, task| {
            let keep = endpoints.contains(endpoint);
            if !keep {
                task.abort();
                gone(*endpoint);
            }
            keep
        });
        for &endpoint in endpoints {
            if tasks.contains_key(&endpoint) {
                continue;
            }
            if let Some(task) = start(endpoint) {
                tasks.insert(endpoint, task);
            }
        }
    }
}

impl Drop for PodTasks {
    fn drop(&mut self) {
        let tasks = self.tasks.get_mut().unwrap_or_else(|p| p.into_inner());
        for task in tasks.values() {
            task.abort();
        }
    }
}
