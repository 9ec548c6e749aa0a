//! Child processes the laboratory starts (simulated pods, kvroute), killed and reaped when
//! dropped so that nothing outlives a run.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};

/// A child process, killed and reaped when dropped.
pub(crate) struct Process(pub(crate) Child);

impl Process {
    /// Its process id.
    pub(crate) fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Sends it `signal`.
    pub(crate) fn signal(&self, signal: Signal) -> std::io::Result<()> {
        kill_process(Pid::from_child(&self.0), signal).map_err(std::io::Error::from)
    }

    /// Its exit status, if it has exited.
    pub(crate) fn exited(&mut self) -> Option<ExitStatus> {
        self.0.try_wait().ok().flatten()
    }

    /// Waits up to `limit` for it to exit.
    pub(crate) async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            // Another process: no event to await across the boundary, so poll.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
