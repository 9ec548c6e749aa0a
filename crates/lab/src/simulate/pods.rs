//! The simulated pods, and the helper thread that advances some of them when they are all
//! read at once.
//!
//! A scrape reads every pod at the same virtual instant, so each pod is first advanced
//! there: its steps since its last wake-up, a few each (pods are woken only where a
//! request may finish). At a thousand pods that catch-up is most of a simulation's engine
//! time. Engines are independent and keep their events until the loop takes them, so
//! pods can be advanced on two cores at once with the same results: a catch-up puts the
//! pods up in chunks that this thread and the helper take one at a time until none is
//! left, so a helper still busy with a chore takes fewer (none, if the loop is done
//! first) and the loop never waits for pods queued behind that chore. (A fixed half for
//! the helper, as before, left the loop waiting for it a tenth of its time on a busy
//! simulation, and the helper idle on a light one.) The helper lives as long as the
//! simulation: a thread started per scrape cost about 0.2 ms, a third of what it saved.
//! Between catch-ups it does the chores the loop hands it ([`Pods::hand_over`]), such as
//! building the fleet a scrape will publish, while the loop goes on.

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

/// Pods per chunk of a catch-up: small enough that the two threads finish within a chunk's
/// time of each other, large enough that taking one costs nothing beside advancing it.
const CHUNK: usize = 16;

/// The pods by index, in chunks of [`CHUNK`] (the last may be shorter), each lent whole
/// to whichever thread advances it in a catch-up.
pub struct Pods {
    chunks: Vec<Vec<Pod>>,
    len: usize,
    helper: Option<Helper>,
}

/// One catch-up's pods, taken a chunk at a time by either thread: where to advance them,
/// whether to read them.
struct CatchUp {
    /// Chunks not taken yet, with their index, last first.
    left: Mutex<Vec<(usize, Vec<Pod>)>>,
    now: SimTime,
    read: bool,
}

/// Chunks advanced, with their index and readings.
type Advanced = Vec<(usize, Vec<Pod>, Vec<PodMetrics>)>;

impl CatchUp {
    /// Advances chunks until none is left; returns them.
    fn take_all(&self) -> Advanced {
        let mut advanced = Vec::new();
        loop {
            let next = lock(&self.left).pop();
            let Some((index, mut pods)) = next else {
                return advanced;
            };
            let mut readings = Vec::new();
            advance(&mut pods, self.now, self.read, &mut readings);
            advanced.push((index, pods, readings));
        }
    }
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
    /// A share in a catch-up, and where to send the chunks it advanced (if any).
    CatchUp(Arc<CatchUp>, mpsc::Sender<Advanced>),
    Chore(Chore),
}

/// The helper thread's end of its queue.
struct Helper {
    tasks: mpsc::Sender<Task>,
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
        let len = pods.len();
        let mut chunks = Vec::with_capacity(len.div_ceil(CHUNK));
        let mut pods = pods.into_iter();
        loop {
            let chunk: Vec<Pod> = pods.by_ref().take(CHUNK).collect();
            if chunk.is_empty() {
                break;
            }
            chunks.push(chunk);
        }
        Pods {
            chunks,
            len,
            helper: None,
        }
    }

    /// From now on, a thread of `scope` (which ends when these pods are dropped) takes a
    /// share of each catch-up and the chores handed over.
    pub fn start_helper<'scope>(&mut self, scope: &'scope Scope<'scope, '_>) {
        let (tasks, inbox) = mpsc::channel::<Task>();
        scope.spawn(move || {
            while let Some(task) = receive(&inbox) {
                match task {
                    Task::CatchUp(catch_up, done) => {
                        let advanced = catch_up.take_all();
                        // Nothing to hand back when the loop took every chunk: it does
                        // not wait for this share then (nor receive it).
                        if !advanced.is_empty() {
                            let _ = done.send(advanced);
                        }
                    }
                    Task::Chore(chore) => chore(),
                }
            }
        });
        self.helper = Some(Helper { tasks });
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
        self.len
    }

    /// Whether a helper thread takes chores ([`Pods::hand_over`]).
    pub fn has_helper(&self) -> bool {
        self.helper.is_some()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Pod> {
        self.chunks.iter().flatten()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Pod> {
        self.chunks.iter_mut().flatten()
    }

    /// Advances every pod to `now`; with `read`, returns each one's metrics at `now`, in
    /// pod order (otherwise nothing).
    pub fn advance_all(&mut self, now: SimTime, read: bool) -> anyhow::Result<Vec<PodMetrics>> {
        let mut readings = Vec::with_capacity(if read { self.len } else { 0 });
        let Some(helper) = &self.helper else {
            for chunk in &mut self.chunks {
                advance(chunk, now, read, &mut readings);
            }
            return Ok(readings);
        };
        let total = self.chunks.len();
        let catch_up = Arc::new(CatchUp {
            left: Mutex::new(
                std::mem::take(&mut self.chunks)
                    .into_iter()
                    .enumerate()
                    .rev()
                    .collect(),
            ),
            now,
            read,
        });
        let (done, theirs) = mpsc::channel();
        if helper
            .tasks
            .send(Task::CatchUp(Arc::clone(&catch_up), done))
            .is_err()
        {
            // The helper is gone (it only stops on a panic): carry on alone.
            self.helper = None;
        }
        let mut advanced = catch_up.take_all();
        if advanced.len() < total {
            let helpers = receive(&theirs)
                .ok_or_else(|| anyhow::anyhow!("the simulation's helper thread failed"))?;
            advanced.extend(helpers);
        }
        advanced.sort_unstable_by_key(|(index, _, _)| *index);
        self.chunks.reserve(total);
        for (_, chunk, theirs) in advanced {
            self.chunks.push(chunk);
            readings.extend(theirs);
        }
        Ok(readings)
    }
}

impl Index<usize> for Pods {
    type Output = Pod;

    fn index(&self, i: usize) -> &Pod {
        &self.chunks[i / CHUNK][i % CHUNK]
    }
}

impl IndexMut<usize> for Pods {
    fn index_mut(&mut self, i: usize) -> &mut Pod {
        &mut self.chunks[i / CHUNK][i % CHUNK]
    }
}

#[cfg(test)]
mod tests {
    use std::thread::{ThreadId, current};

    use kvroute_sim::engine::EngineConfig;
    use kvroute_sim::profile::Profile;

    use super::*;

    /// `n` idle pods, pod `i` with `100 + i` KV blocks (its readings say which it is).
    fn numbered_pods(n: u32) -> Pods {
        let profile = Profile::by_name("h100-llama3-8b").expect("profile");
        Pods::new(
            (0..n)
                .map(|i| {
                    let cfg = EngineConfig {
                        num_gpu_blocks: 100 + i,
                        ..EngineConfig::default()
                    };
                    Pod::new(Engine::new(cfg, profile.clone()))
                })
                .collect(),
        )
    }

    fn blocks_read(readings: &[PodMetrics]) -> Vec<u64> {
        readings
            .iter()
            .map(|r| r.num_gpu_blocks.expect("stated"))
            .collect()
    }

    #[test]
    fn a_catch_up_reads_every_pod_in_order_whoever_advances_it_and_never_waits_on_a_busy_helper() {
        let n = 5 * CHUNK as u32 + 3;
        let in_order: Vec<u64> = (0..n).map(|i| u64::from(100 + i)).collect();
        std::thread::scope(|scope| {
            let mut pods = numbered_pods(n);
            pods.start_helper(scope);
            // The helper busy with a chore until this thread says: the catch-up must not
            // wait for it, and takes every chunk itself.
            let (release, busy) = mpsc::channel::<()>();
            pods.hand_over(Box::new(move || {
                let _ = busy.recv();
            }));
            let readings = pods
                .advance_all(Duration::from_millis(5), true)
                .expect("advanced");
            assert_eq!(blocks_read(&readings), in_order);
            release.send(()).expect("the helper waits");
            // Both threads free: still every pod once, in order, and the pods are back in
            // place for indexing.
            for step in 1..20u64 {
                let readings = pods
                    .advance_all(Duration::from_millis(5 + step), true)
                    .expect("advanced");
                assert_eq!(blocks_read(&readings), in_order);
                assert_eq!(pods.len(), n as usize);
                let at = (step as usize * 7) % n as usize;
                assert_eq!(pods[at].engine.config().num_gpu_blocks, 100 + at as u32);
            }
            let none = pods
                .advance_all(Duration::from_millis(50), false)
                .expect("advanced");
            assert!(none.is_empty());
            assert_eq!(pods.iter().count(), n as usize);
        });
    }

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
