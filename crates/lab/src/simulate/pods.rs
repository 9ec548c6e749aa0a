//! The simulated pods, and the helper thread that advances half of them when they are all
//! read at once.
//!
//! A scrape reads every pod at the same virtual instant, so each pod is first advanced
//! there: its steps since its last wake-up, a few each (pods are woken only where a
//! request may finish). At a thousand pods that catch-up is most of a simulation's engine
//! time. Engines are independent and keep their events until the loop takes them, so the
//! second half can be advanced on another core while this thread advances the first,
//! with the same results. The helper lives as long as the simulation: a thread started
//! per scrape cost about 0.2 ms, a third of what it saved. Between catch-ups it does the
//! chores the loop hands it ([`Pods::hand_over`]), such as building the fleet a scrape
//! will publish, while the loop goes on.

use std::ops::{Index, IndexMut};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc};
use std::thread::Scope;
use std::time::{Duration, Instant};

use kvroute_core::fleet::PodMetrics;
use kvroute_sim::engine::Engine;

use super::observe::pod_metrics;

type SimTime = Duration;

/// Fleets from this size are advanced with a helper thread where the simulation has a
/// core for one: below it, handing the pods over costs more than it saves.
pub const HELPER_FROM_PODS: usize = 128;

pub struct Pod {
    pub engine: Engine,
    /// Request slot by engine request id (the engine numbers its requests from 0).
    pub slots: Vec<u32>,
    /// When the queue wakes this pod next.
    pub due: Option<SimTime>,
}

impl Pod {
    pub fn new(engine: Engine) -> Pod {
        Pod {
            engine,
            slots: Vec::new(),
            due: None,
        }
    }
}

/// The pods by index, held in two parts: the second is lent to the helper during a
/// catch-up (when there is a helper; otherwise it is empty).
pub struct Pods {
    first: Vec<Pod>,
    second: Vec<Pod>,
    helper: Option<Helper>,
}

/// A catch-up lent to the helper: its pods, where to advance them, whether to read them.
struct Job {
    pods: Vec<Pod>,
    now: SimTime,
    read: bool,
}

/// Other work for the helper, done between catch-ups while the loop goes on: it hands
/// back what it makes by its own means (a channel it captured; see [`Errand`]).
pub type Chore = Box<dyn FnOnce() + Send>;

/// Work whose result the loop will need, handed to the helper: when the loop needs it
/// before the helper has started it (the helper does its chores in order, and may be busy
/// with another), the loop takes it back and does it itself, so it never waits for work
/// queued behind the helper's other chores.
pub struct Errand<R> {
    work: Arc<Mutex<Option<Work<R>>>>,
    done: mpsc::Receiver<R>,
}

type Work<R> = Box<dyn FnOnce() -> R + Send>;

impl<R> std::fmt::Debug for Errand<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let waiting = lock(&self.work).is_some();
        f.debug_struct("Errand").field("waiting", &waiting).finish()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<R: Send + 'static> Errand<R> {
    /// `work`, handed over by `hand_over` ([`Pods::hand_over`], or doing it at once).
    pub fn new(
        work: impl FnOnce() -> R + Send + 'static,
        hand_over: &mut dyn FnMut(Chore),
    ) -> Errand<R> {
        let work: Arc<Mutex<Option<Work<R>>>> = Arc::new(Mutex::new(Some(Box::new(work))));
        let (made, done) = mpsc::sync_channel(1);
        let theirs = Arc::clone(&work);
        hand_over(Box::new(move || {
            let work = lock(&theirs).take();
            if let Some(work) = work {
                // Not received if the simulation ended first.
                let _ = made.send(work());
            }
        }));
        Errand { work, done }
    }

    /// The result: made here if the helper has not started the work, else the helper's
    /// once it is done.
    pub fn result(self) -> anyhow::Result<R> {
        let work = lock(&self.work).take();
        match work {
            Some(work) => Ok(work()),
            None => receive(&self.done)
                .ok_or_else(|| anyhow::anyhow!("the simulation's helper thread failed")),
        }
    }
}

/// A hand to give the helper chores from beyond [`Pods`] (a router's own work, such as
/// kvroute's prefix records): a second end of the helper's queue, so its chores take their
/// turn among those of [`Pods::hand_over`]. Without a helper (or once it is gone), a chore
/// is done at once on the caller's thread.
#[derive(Clone, Default)]
pub struct Chores(Option<mpsc::Sender<Task>>);

impl std::fmt::Debug for Chores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Chores").field(&self.0.is_some()).finish()
    }
}

impl Chores {
    /// Whether a helper takes the chores (otherwise they are done at once).
    pub fn is_helper(&self) -> bool {
        self.0.is_some()
    }

    /// Has the helper do `chore` after what it was given before; without one, does it now.
    pub fn hand_over(&self, chore: Chore) {
        match &self.0 {
            Some(tasks) => {
                send_chore(tasks, chore);
            }
            None => chore(),
        }
    }
}

/// Queues `chore` for the helper; when the helper is gone (it only stops on a panic), does
/// it here and says so (false).
fn send_chore(tasks: &mpsc::Sender<Task>, chore: Chore) -> bool {
    match tasks.send(Task::Chore(chore)) {
        Ok(()) => true,
        Err(mpsc::SendError(task)) => {
            if let Task::Chore(chore) = task {
                chore();
            }
            false
        }
    }
}

/// What the helper is sent, in the order it does them.
enum Task {
    CatchUp(Job),
    Chore(Chore),
}

/// The helper thread's ends of its two channels.
struct Helper {
    tasks: mpsc::Sender<Task>,
    done: mpsc::Receiver<(Vec<Pod>, Vec<PodMetrics>)>,
}

/// How long a thread waiting on the other spins before it sleeps: a sleeping thread
/// takes a few hundred microseconds to wake on this machine's virtual cores, about what
/// half a thousand pods take to advance, and scrapes come every few milliseconds.
const SPIN: Duration = Duration::from_millis(20);

/// The next message on `channel`, spinning for up to [`SPIN`] before sleeping; `None`
/// once the other end is gone.
fn receive<T>(channel: &mpsc::Receiver<T>) -> Option<T> {
    let start = Instant::now();
    for spins in 0u32.. {
        match channel.try_recv() {
            Ok(message) => return Some(message),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            // The clock is read now and then: reading it was most of a spin.
            Err(mpsc::TryRecvError::Empty) if spins % 256 != 0 || start.elapsed() < SPIN => {
                std::hint::spin_loop();
            }
            Err(mpsc::TryRecvError::Empty) => break,
        }
    }
    channel.recv().ok()
}

/// Advances `pods` to `now`; with `read`, appends each one's metrics to `readings`.
fn advance(pods: &mut [Pod], now: SimTime, read: bool, readings: &mut Vec<PodMetrics>) {
    for pod in pods {
        pod.engine.advance(now);
        if read {
            readings.push(pod_metrics(&pod.engine));
        }
    }
}

impl Pods {
    /// The pods, all advanced on this thread.
    pub fn new(pods: Vec<Pod>) -> Pods {
        Pods {
            first: pods,
            second: Vec::new(),
            helper: None,
        }
    }

    /// From now on, half the pods are advanced at each catch-up by a thread of `scope`
    /// (which ends when these pods are dropped).
    pub fn start_helper<'scope>(&mut self, scope: &'scope Scope<'scope, '_>) {
        let mut first = std::mem::take(&mut self.first);
        first.append(&mut self.second);
        let second = first.split_off(first.len() / 2);
        let (tasks, inbox) = mpsc::channel::<Task>();
        let (outbox, done) = mpsc::channel();
        scope.spawn(move || {
            while let Some(task) = receive(&inbox) {
                match task {
                    Task::CatchUp(mut job) => {
                        let mut readings = Vec::new();
                        advance(&mut job.pods, job.now, job.read, &mut readings);
                        if outbox.send((job.pods, readings)).is_err() {
                            break;
                        }
                    }
                    Task::Chore(chore) => chore(),
                }
            }
        });
        *self = Pods {
            first,
            second,
            helper: Some(Helper { tasks, done }),
        };
    }

    /// Has the helper do `chore` after what it was given before, while this thread goes
    /// on; without a helper, does it now.
    pub fn hand_over(&mut self, chore: Chore) {
        let Some(helper) = &self.helper else {
            return chore();
        };
        if !send_chore(&helper.tasks, chore) {
            // Carry on alone.
            self.helper = None;
        }
    }

    /// A hand that gives the helper chores in the same queue as [`Pods::hand_over`].
    pub fn chores(&self) -> Chores {
        Chores(self.helper.as_ref().map(|helper| helper.tasks.clone()))
    }

    pub fn len(&self) -> usize {
        self.first.len() + self.second.len()
    }

    /// Whether a helper thread takes chores ([`Pods::hand_over`]).
    pub fn has_helper(&self) -> bool {
        self.helper.is_some()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Pod> {
        self.first.iter().chain(&self.second)
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Pod> {
        self.first.iter_mut().chain(&mut self.second)
    }

    /// Advances every pod to `now`; with `read`, returns each one's metrics at `now`, in
    /// pod order (otherwise nothing).
    pub fn advance_all(&mut self, now: SimTime, read: bool) -> anyhow::Result<Vec<PodMetrics>> {
        let mut readings = Vec::with_capacity(if read { self.len() } else { 0 });
        let Some(helper) = &self.helper else {
            advance(&mut self.first, now, read, &mut readings);
            return Ok(readings);
        };
        let lent = Job {
            pods: std::mem::take(&mut self.second),
            now,
            read,
        };
        if let Err(mpsc::SendError(task)) = helper.tasks.send(Task::CatchUp(lent)) {
            // The helper is gone (it only stops on a panic): carry on alone.
            if let Task::CatchUp(job) = task {
                self.second = job.pods;
            }
            self.helper = None;
            advance(&mut self.first, now, read, &mut readings);
            advance(&mut self.second, now, read, &mut readings);
            return Ok(readings);
        }
        advance(&mut self.first, now, read, &mut readings);
        let (second, theirs) = receive(&helper.done)
            .ok_or_else(|| anyhow::anyhow!("the simulation's helper thread failed"))?;
        self.second = second;
        readings.extend(theirs);
        Ok(readings)
    }
}

impl Index<usize> for Pods {
    type Output = Pod;

    fn index(&self, i: usize) -> &Pod {
        match i.checked_sub(self.first.len()) {
            None => &self.first[i],
            Some(j) => &self.second[j],
        }
    }
}

impl IndexMut<usize> for Pods {
    fn index_mut(&mut self, i: usize) -> &mut Pod {
        match i.checked_sub(self.first.len()) {
            None => &mut self.first[i],
            Some(j) => &mut self.second[j],
        }
    }
}

#[cfg(test)]
mod tests {
    use std::thread::{ThreadId, current};

    use super::*;

    #[test]
    fn an_errand_is_done_by_the_loop_unless_the_helper_has_started_it() {
        std::thread::scope(|scope| {
            let mut pods = Pods::new(Vec::new());
            pods.start_helper(scope);
            let mut hand_over = |chore: Chore| pods.hand_over(chore);
            // The helper busy with another chore: the loop does the errand itself.
            let (release, busy) = mpsc::channel::<()>();
            hand_over(Box::new(move || {
                let _ = busy.recv();
            }));
            let errand = Errand::new(|| current().id(), &mut hand_over);
            assert_eq!(errand.result().expect("done"), current().id());
            release.send(()).expect("the helper waits");
            // Started by the helper: its result.
            let (started, has_started) = mpsc::channel::<()>();
            let errand = Errand::new(
                move || -> ThreadId {
                    let _ = started.send(());
                    current().id()
                },
                &mut hand_over,
            );
            has_started.recv().expect("the helper starts it");
            assert_ne!(errand.result().expect("done"), current().id());
        });
    }
}
