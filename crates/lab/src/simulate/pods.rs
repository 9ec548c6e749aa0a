//! The simulated pods, and the helper thread that advances some of them when they are all
//! read at once.
//!
//! A scrape reads every pod at the same virtual instant, so each pod is first advanced
//! there: its steps since its last wake-up, a few each (pods are woken only where a
//! request may finish). At a thousand pods that catch-up is most of a simulation's engine
//! time. Engines are independent and keep their events until the loop takes them, so
//! pods can be advanced on two cores at once with the same results: a catch-up is a
//! [`Pass`] over the pods that either thread sweeps, taking a few pods at a time until
//! none is left, so a helper still busy with a chore takes fewer (none, if the loop is
//! done first) and the loop never waits for pods queued behind that chore.
//!
//! A scrape's readings are needed only when it is published, a scrape delay later, so a
//! catch-up for one may be *left running* ([`Pods::begin`]): the loop goes on with the
//! events after it and the helper sweeps the pass meanwhile. Each pod sits behind its own
//! lock, and the loop's first touch of a pod the pass has not reached advances that pod
//! there first ([`Pods::at`]), so every pod is read where it stood at the scrape and is
//! never stepped past it before. The loop then advances only the few pods it touches in
//! the delay, where it used to advance its half of the fleet. The helper lives as long as
//! the simulation: a thread started per scrape cost about 0.2 ms, a third of what it
//! saved. Between passes it does the chores the loop hands it ([`Pods::hand_over`]), such
//! as building the fleet a scrape will publish, while the loop goes on.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
}

impl Pod {
    pub fn new(engine: Engine) -> Pod {
        Pod {
            engine,
            slots: Vec::new(),
        }
    }
}

/// Pods a sweep takes at once: small enough that the two threads finish within a few
/// pods' time of each other, large enough that taking them costs nothing beside
/// advancing them.
const CLAIM: usize = 16;

/// The pods, each behind its own lock, and which pass each was last advanced for: what
/// the loop and the helper share.
struct Shared {
    pods: Box<[Mutex<Pod>]>,
    /// Per pod, the number of the last pass that advanced it.
    advanced_for: Box<[AtomicU64]>,
    /// Set when the helper thread ends (it only ends early on a panic): nothing it took
    /// will be finished then.
    helper_gone: AtomicBool,
}

/// One catch-up: every pod advanced to `now`, and with `read` read there, by whichever
/// thread comes to it first.
struct Pass {
    shared: Arc<Shared>,
    /// This pass's number (from 1; [`Shared::advanced_for`] starts at 0).
    number: u64,
    now: SimTime,
    read: bool,
    /// The first pod no sweep has taken yet.
    cursor: AtomicUsize,
    /// Pods not advanced yet, taken or not.
    remaining: AtomicUsize,
    /// The readings so far, by pod.
    readings: Mutex<Vec<Option<Arc<PodMetrics>>>>,
}

impl Pass {
    /// Advances `pod` (pod `i`, locked by the caller) to this pass unless it was;
    /// true if this call did. The reading goes to `found`.
    fn advance(&self, i: usize, pod: &mut Pod, found: &mut Vec<(usize, Arc<PodMetrics>)>) -> bool {
        let advanced_for = &self.shared.advanced_for[i];
        if advanced_for.load(Ordering::Acquire) == self.number {
            return false;
        }
        pod.engine.advance(self.now);
        if self.read {
            found.push((i, Arc::new(pod_metrics(&pod.engine))));
        }
        advanced_for.store(self.number, Ordering::Release);
        true
    }

    /// Files readings and counts `advanced` pods as done (readings first: a thread that
    /// sees none remaining takes them all).
    fn done(&self, found: &mut Vec<(usize, Arc<PodMetrics>)>, advanced: usize) {
        if !found.is_empty() {
            let mut readings = lock(&self.readings);
            for (i, reading) in found.drain(..) {
                readings[i] = Some(reading);
            }
        }
        if advanced > 0 {
            self.remaining.fetch_sub(advanced, Ordering::AcqRel);
        }
    }

    /// Takes pods from the cursor, a few at a time, and advances them, until none is left.
    fn sweep(&self) {
        let pods = &self.shared.pods;
        let mut found = Vec::with_capacity(if self.read { CLAIM } else { 0 });
        loop {
            let start = self.cursor.fetch_add(CLAIM, Ordering::Relaxed);
            if start >= pods.len() {
                return;
            }
            let mut advanced = 0;
            for (offset, pod) in pods[start..].iter().take(CLAIM).enumerate() {
                if self.advance(start + offset, &mut lock(pod), &mut found) {
                    advanced += 1;
                }
            }
            self.done(&mut found, advanced);
        }
    }

    /// Sweeps what is left, then waits for the pods the other thread took.
    fn complete(&self) -> anyhow::Result<()> {
        self.sweep();
        let start = Instant::now();
        let mut spins = 0u32;
        while self.remaining.load(Ordering::Acquire) > 0 {
            if self.shared.helper_gone.load(Ordering::Acquire) {
                anyhow::bail!("the simulation's helper thread failed");
            }
            spins = spins.wrapping_add(1);
            // A few pods' time at most, unless the other thread was descheduled.
            if spins.is_multiple_of(256) && start.elapsed() > SPIN {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        Ok(())
    }

    /// Completes the pass and takes its readings, in pod order.
    fn readings(&self) -> anyhow::Result<Vec<Arc<PodMetrics>>> {
        self.complete()?;
        let readings = std::mem::take(&mut *lock(&self.readings));
        // Every pod of a completed pass was read; one missing would shift every reading
        // after it onto the wrong pod.
        readings
            .into_iter()
            .enumerate()
            .map(|(i, reading)| reading.ok_or_else(|| anyhow::anyhow!("pod {i} was not read")))
            .collect()
    }
}

/// The readings of a catch-up left running ([`Pods::begin`]): taking them completes it
/// on the calling thread, which may be either.
pub struct Readings(Arc<Pass>);

impl Readings {
    /// Every pod's metrics at the pass's instant, in pod order.
    pub fn take(self) -> anyhow::Result<Vec<Arc<PodMetrics>>> {
        self.0.readings()
    }
}

/// The pods, lent to the helper thread by the lock each sits behind.
pub struct Pods {
    shared: Arc<Shared>,
    helper: Option<Helper>,
    /// The last pass begun: until it is complete, a pod it has not advanced is advanced
    /// at the loop's first touch.
    pass: Option<Arc<Pass>>,
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
    /// The result, once in before it was asked for ([`Errand::is_done`],
    /// [`Errand::do_here`]).
    made: Option<R>,
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
        Errand {
            work,
            done,
            made: None,
        }
    }

    /// Whether the result is in (made here, or sent by the helper), without waiting.
    pub fn is_done(&mut self) -> bool {
        if self.made.is_none()
            && let Ok(made) = self.done.try_recv()
        {
            self.made = Some(made);
        }
        self.made.is_some()
    }

    /// Does the work here and now if the helper has not started it; whether it did. A
    /// thread that would wait for one errand does another meanwhile.
    pub fn do_here(&mut self) -> bool {
        if self.made.is_some() {
            return false;
        }
        let work = lock(&self.work).take();
        let Some(work) = work else {
            return false;
        };
        self.made = Some(work());
        true
    }

    /// The result: made here if the helper has not started the work, else the helper's
    /// once it is done.
    pub fn result(self) -> anyhow::Result<R> {
        if let Some(made) = self.made {
            return Ok(made);
        }
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
    /// A share in a catch-up.
    Sweep(Arc<Pass>),
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

/// Says the helper is gone when its thread ends, however it ends.
struct Farewell(Arc<Shared>);

impl Drop for Farewell {
    fn drop(&mut self) {
        self.0.helper_gone.store(true, Ordering::Release);
    }
}

impl Pods {
    /// The pods, all advanced on this thread.
    pub fn new(pods: Vec<Pod>) -> Pods {
        let advanced_for = pods.iter().map(|_| AtomicU64::new(0)).collect();
        Pods {
            shared: Arc::new(Shared {
                pods: pods.into_iter().map(Mutex::new).collect(),
                advanced_for,
                helper_gone: AtomicBool::new(false),
            }),
            helper: None,
            pass: None,
        }
    }

    /// From now on, a thread of `scope` (which ends when these pods are dropped) takes a
    /// share of each catch-up and the chores handed over.
    pub fn start_helper<'scope>(&mut self, scope: &'scope Scope<'scope, '_>) {
        let (tasks, inbox) = mpsc::channel::<Task>();
        let farewell = Farewell(Arc::clone(&self.shared));
        scope.spawn(move || {
            let _farewell = farewell;
            while let Some(task) = receive(&inbox) {
                match task {
                    Task::Sweep(pass) => pass.sweep(),
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
        self.shared.pods.len()
    }

    /// Whether a helper thread takes chores ([`Pods::hand_over`]).
    pub fn has_helper(&self) -> bool {
        self.helper.is_some()
    }

    /// Pod `i`, locked; advanced first to the pass left running, if that pass has not
    /// reached it. Panics if there is no pod `i`, as indexing does.
    pub fn at(&self, i: usize) -> MutexGuard<'_, Pod> {
        let mut pod = lock(&self.shared.pods[i]);
        if let Some(pass) = &self.pass {
            let mut found = Vec::new();
            if pass.advance(i, &mut pod, &mut found) {
                pass.done(&mut found, 1);
            }
        }
        pod
    }

    /// Every pod, locked in turn. The pass last begun must be complete
    /// ([`Pods::advance_all`] sees to it).
    pub fn iter(&self) -> impl Iterator<Item = MutexGuard<'_, Pod>> {
        debug_assert!(
            self.pass
                .as_ref()
                .is_none_or(|p| p.remaining.load(Ordering::Acquire) == 0),
            "pods read whole while a catch-up runs"
        );
        self.shared.pods.iter().map(lock)
    }

    /// Begins advancing every pod to `now` and reading it there, and leaves it running:
    /// the helper sweeps it, the loop advances the pods it touches first
    /// ([`Pods::at`]), and whoever takes the readings completes it. A pass left before
    /// is completed first.
    pub fn begin(&mut self, now: SimTime) -> anyhow::Result<Readings> {
        Ok(Readings(self.start(now, true)?))
    }

    /// Advances every pod to `now`; with `read`, returns each one's metrics at `now`, in
    /// pod order (otherwise nothing).
    pub fn advance_all(
        &mut self,
        now: SimTime,
        read: bool,
    ) -> anyhow::Result<Vec<Arc<PodMetrics>>> {
        let pass = self.start(now, read)?;
        let readings = pass.readings()?;
        Ok(readings)
    }

    /// Completes the pass left running, if any.
    pub fn complete(&mut self) -> anyhow::Result<()> {
        if let Some(pass) = &self.pass {
            pass.complete()?;
        }
        Ok(())
    }

    /// A new pass to `now`, the helper told to sweep it.
    fn start(&mut self, now: SimTime, read: bool) -> anyhow::Result<Arc<Pass>> {
        self.complete()?;
        let number = self.pass.as_ref().map_or(0, |p| p.number) + 1;
        let len = self.len();
        let pass = Arc::new(Pass {
            shared: Arc::clone(&self.shared),
            number,
            now,
            read,
            cursor: AtomicUsize::new(0),
            remaining: AtomicUsize::new(len),
            readings: Mutex::new(if read {
                (0..len).map(|_| None).collect()
            } else {
                Vec::new()
            }),
        });
        if let Some(helper) = &self.helper
            && helper.tasks.send(Task::Sweep(Arc::clone(&pass))).is_err()
        {
            // The helper is gone (it only stops on a panic): carry on alone.
            self.helper = None;
        }
        self.pass = Some(Arc::clone(&pass));
        Ok(pass)
    }
}

#[cfg(test)]
mod tests {
    use std::thread::{ThreadId, current};

    use kvroute_sim::engine::{EngineConfig, FinishReason, RequestSpec};
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

    fn blocks_read(readings: &[Arc<PodMetrics>]) -> Vec<u64> {
        readings
            .iter()
            .map(|r| r.num_gpu_blocks.expect("stated"))
            .collect()
    }

    #[test]
    fn a_catch_up_reads_every_pod_in_order_whoever_advances_it_and_never_waits_on_a_busy_helper() {
        let n = 5 * CLAIM as u32 + 3;
        let in_order: Vec<u64> = (0..n).map(|i| u64::from(100 + i)).collect();
        std::thread::scope(|scope| {
            let mut pods = numbered_pods(n);
            pods.start_helper(scope);
            // The helper busy with a chore until this thread says: the catch-up must not
            // wait for it, and takes every pod itself.
            let (release, busy) = mpsc::channel::<()>();
            pods.hand_over(Box::new(move || {
                let _ = busy.recv();
            }));
            let readings = pods
                .advance_all(Duration::from_millis(5), true)
                .expect("advanced");
            assert_eq!(blocks_read(&readings), in_order);
            release.send(()).expect("the helper waits");
            // Both threads free: still every pod once, in order.
            for step in 1..20u64 {
                let readings = pods
                    .advance_all(Duration::from_millis(5 + step), true)
                    .expect("advanced");
                assert_eq!(blocks_read(&readings), in_order);
                assert_eq!(pods.len(), n as usize);
                let at = (step as usize * 7) % n as usize;
                assert_eq!(pods.at(at).engine.config().num_gpu_blocks, 100 + at as u32);
            }
            let none = pods
                .advance_all(Duration::from_millis(50), false)
                .expect("advanced");
            assert!(none.is_empty());
            assert_eq!(pods.iter().count(), n as usize);
        });
    }

    /// Pods each running one request, all the same: the same steps at the same times.
    fn busy_pods(n: u32) -> Pods {
        let pods = numbered_pods(n);
        for i in 0..n as usize {
            pods.at(i).engine.add_request(
                Duration::ZERO,
                RequestSpec {
                    prompt: (0..64).collect(),
                    adapter: None,
                    max_output: 400,
                    finish_reason: FinishReason::Length,
                    output_seed: 1,
                },
            );
        }
        pods
    }

    #[test]
    fn a_catch_up_left_running_reads_each_pod_where_it_stood_though_the_loop_moved_some_on() {
        let n = 4 * CLAIM as u32 + 5;
        let scrape = Duration::from_millis(200);
        let later = Duration::from_millis(900);
        // What each pod reads at the scrape, all advanced there at once, and later.
        let kv_when = |at: Duration| -> Vec<f64> {
            let mut pods = busy_pods(n);
            let readings = pods.advance_all(at, true).expect("advanced");
            readings.iter().map(|r| r.kv_usage).collect()
        };
        let kv_at_scrape = kv_when(scrape);
        let kv_later = kv_when(later);
        assert!(
            kv_at_scrape.iter().zip(&kv_later).all(|(a, b)| a < b),
            "the pods' KV grows between the two instants"
        );
        for helper_busy in [true, false] {
            std::thread::scope(|scope| {
                let mut pods = busy_pods(n);
                pods.start_helper(scope);
                let (release, busy) = mpsc::channel::<()>();
                if helper_busy {
                    pods.hand_over(Box::new(move || {
                        let _ = busy.recv();
                    }));
                }
                let readings = pods.begin(scrape).expect("begun");
                // The loop moves some pods on before the readings are taken: each is
                // advanced to the scrape first.
                for i in (0..n as usize).step_by(7) {
                    pods.at(i).engine.advance(later);
                    assert_eq!(pods.at(i).engine.now(), later);
                }
                let taken = readings.take().expect("read");
                drop(release);
                assert_eq!(taken.len(), n as usize);
                let kv: Vec<f64> = taken.iter().map(|r| r.kv_usage).collect();
                assert_eq!(kv, kv_at_scrape, "helper busy: {helper_busy}");
                // The pods the loop did not touch stand at the scrape.
                pods.complete().expect("complete");
                assert_eq!(pods.at(1).engine.now(), scrape);
            });
        }
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
            // Done here ahead of being asked for, once: the result is kept.
            let mut ahead = Errand::new(|| current().id(), &mut hand_over);
            assert!(!ahead.is_done());
            assert!(ahead.do_here());
            assert!(!ahead.do_here());
            assert!(ahead.is_done());
            assert_eq!(ahead.result().expect("done"), current().id());
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
            let mut errand = errand;
            assert!(!errand.do_here(), "the helper has it");
            assert_ne!(errand.result().expect("done"), current().id());
        });
    }
}
