//! Where the service's background tasks run.
//!
//! Every task a replica, a proxy or the client SDK starts goes through [`spawn`], and the
//! tasks openraft and quinn start go through `RaftRuntime` (feature `raft`) and
//! [`quic_runtime`], which delegate to it. In a normal process that is `tokio::spawn`. The fault suite's
//! simulation calls [`spawn_on_local_sets`] first: from then on every task is a local task
//! of the innermost `tokio::task::LocalSet` being driven. The simulation runs each host's
//! software on a `LocalSet` of its own and can stop driving it: the whole host then stands
//! still, timers and arriving datagrams included, while the clocks go on, as a process
//! under SIGSTOP does (`ops::faults::sim`, the `pause-leader` fault).

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
#[cfg(feature = "raft")]
use std::time::Duration;

#[cfg(feature = "raft")]
use openraft::async_runtime::watch;
#[cfg(feature = "raft")]
use openraft::{AsyncRuntime, OptionalSend, OptionalSync};
#[cfg(feature = "raft")]
use openraft_rt_tokio::TokioInstant;

static LOCAL: AtomicBool = AtomicBool::new(false);

/// From now on, [`spawn`] (and so every task of replicas, proxies and clients in this
/// process) spawns local tasks on the `LocalSet` being driven. For a process whose every
/// runtime is single-threaded and runs its software inside a `LocalSet` (the simulation);
/// a task spawned outside one panics.
pub fn spawn_on_local_sets() {
    LOCAL.store(true, Ordering::SeqCst);
}

/// True after [`spawn_on_local_sets`].
pub fn spawns_locally() -> bool {
    LOCAL.load(Ordering::Relaxed)
}

/// Completes on SIGINT or SIGTERM: what a server process (replica, proxy, directory)
/// waits for before it shuts down cleanly.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("signal handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Spawns a task: `tokio::spawn`, or a local task after [`spawn_on_local_sets`].
#[track_caller]
pub fn spawn<F>(future: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    if spawns_locally() {
        tokio::task::spawn_local(future)
    } else {
        tokio::spawn(future)
    }
}

/// openraft's runtime: tokio's, with its tasks spawned by [`spawn`]. openraft 0.10's
/// runtime also names its channels and mutex; they are openraft-rt-tokio's, except the
/// watch channel ([`RaftWatch`]), which hands out tokio's own receivers so that
/// `Raft::metrics()` stays a `tokio::sync::watch::Receiver`.
#[cfg(feature = "raft")]
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RaftRuntime;

#[cfg(feature = "raft")]
impl AsyncRuntime for RaftRuntime {
    type JoinError = tokio::task::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = tokio::task::JoinHandle<T>;
    type Sleep = tokio::time::Sleep;
    type Instant = TokioInstant;
    type TimeoutError = tokio::time::error::Elapsed;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = tokio::time::Timeout<T>;
    type ThreadLocalRng = rand010::rngs::SmallRng;
    type Mpsc = openraft_rt_tokio::TokioMpsc;
    type Watch = RaftWatch;
    type Oneshot = openraft_rt_tokio::TokioOneshot;
    type Mutex<T: OptionalSend + 'static> = openraft_rt_tokio::TokioMutex<T>;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        tokio::time::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        tokio::time::sleep_until(tokio_instant(deadline))
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        tokio::time::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        tokio::time::timeout_at(tokio_instant(deadline), future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        join_error.is_panic()
    }

    /// Seeded from the thread's generator (OS entropy), as 0.9's `thread_rng` was; after
    /// [`spawn_on_local_sets`] (the simulation) seeded with a constant instead, so every
    /// draw is the same in every run: openraft 0.10 draws the first tick's phase from it
    /// (`Tick::sample_first_wait`, new in 0.10), which made a seed's replay diverge (the
    /// simulation fixes the election timeouts itself, with a range 1 ms wide).
    fn thread_rng() -> Self::ThreadLocalRng {
        use rand010::SeedableRng;
        if spawns_locally() {
            rand010::rngs::SmallRng::seed_from_u64(0x6c6f_636b)
        } else {
            rand010::rngs::SmallRng::from_rng(&mut rand010::rng())
        }
    }

    /// Not used by openraft itself (its tests and `AsyncRuntime::run` only): a
    /// multi-threaded tokio runtime, as openraft-rt-tokio's.
    fn new(threads: usize) -> Self {
        let _ = threads;
        RaftRuntime
    }

    fn block_on<F, T>(&mut self, future: F) -> T
    where
        F: Future<Output = T>,
    {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
            .block_on(future)
    }
}

/// `deadline` as tokio's instant. openraft-rt-tokio's instant wraps one but does not
/// give it out: both read tokio's clock (paused and advanced alike in tests), so the
/// distance from now is the same on both.
#[cfg(feature = "raft")]
fn tokio_instant(deadline: TokioInstant) -> tokio::time::Instant {
    use openraft::Instant as _;
    tokio::time::Instant::now() + deadline.saturating_duration_since(TokioInstant::now())
}

/// openraft's watch channel on tokio's, with tokio's own sender and receiver types (so
/// the metrics openraft publishes are read with tokio's `borrow` and `changed`).
#[cfg(feature = "raft")]
#[derive(Debug)]
pub struct RaftWatch;

#[cfg(feature = "raft")]
impl watch::Watch for RaftWatch {
    type Sender<T: OptionalSend + OptionalSync> = tokio::sync::watch::Sender<T>;
    type Receiver<T: OptionalSend + OptionalSync> = tokio::sync::watch::Receiver<T>;
    type Ref<'a, T: OptionalSend + 'a> = tokio::sync::watch::Ref<'a, T>;

    fn channel<T: OptionalSend + OptionalSync>(init: T) -> (Self::Sender<T>, Self::Receiver<T>) {
        tokio::sync::watch::channel(init)
    }
}

#[cfg(feature = "raft")]
impl<T: OptionalSend + OptionalSync> watch::WatchSender<RaftWatch, T>
    for tokio::sync::watch::Sender<T>
{
    fn send(&self, value: T) -> Result<(), watch::SendError<T>> {
        tokio::sync::watch::Sender::send(self, value).map_err(|e| watch::SendError(e.0))
    }

    fn send_if_modified<F>(&self, modify: F) -> bool
    where
        F: FnOnce(&mut T) -> bool,
    {
        tokio::sync::watch::Sender::send_if_modified(self, modify)
    }

    fn borrow_watched(&self) -> tokio::sync::watch::Ref<'_, T> {
        self.borrow()
    }

    fn subscribe(&self) -> tokio::sync::watch::Receiver<T> {
        tokio::sync::watch::Sender::subscribe(self)
    }
}

#[cfg(feature = "raft")]
impl<T: OptionalSend + OptionalSync> watch::WatchReceiver<RaftWatch, T>
    for tokio::sync::watch::Receiver<T>
{
    async fn changed(&mut self) -> Result<(), watch::RecvError> {
        tokio::sync::watch::Receiver::changed(self)
            .await
            .map_err(|_| watch::RecvError(()))
    }

    fn borrow_watched(&self) -> tokio::sync::watch::Ref<'_, T> {
        self.borrow()
    }

    fn borrow_and_update(&mut self) -> tokio::sync::watch::Ref<'_, T> {
        tokio::sync::watch::Receiver::borrow_and_update(self)
    }
}

/// quinn's tokio runtime, with its tasks (endpoint and connection drivers) spawned by
/// [`spawn`].
pub fn quic_runtime() -> Option<Arc<dyn quinn::Runtime>> {
    let inner = quinn::default_runtime()?;
    if spawns_locally() {
        Some(Arc::new(QuicRuntime(inner)))
    } else {
        Some(inner)
    }
}

#[derive(Debug)]
struct QuicRuntime(Arc<dyn quinn::Runtime>);

impl quinn::Runtime for QuicRuntime {
    fn new_timer(&self, i: std::time::Instant) -> Pin<Box<dyn quinn::AsyncTimer>> {
        self.0.new_timer(i)
    }

    fn spawn(&self, future: Pin<Box<dyn Future<Output = ()> + Send>>) {
        spawn(future);
    }

    fn wrap_udp_socket(
        &self,
        t: std::net::UdpSocket,
    ) -> std::io::Result<Arc<dyn quinn::AsyncUdpSocket>> {
        self.0.wrap_udp_socket(t)
    }

    fn now(&self) -> std::time::Instant {
        self.0.now()
    }
}
