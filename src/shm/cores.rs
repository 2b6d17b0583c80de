//! Which core the daemon and its clients run on.
//!
//! A soft NIC shares the machine's cores with the ranks it serves. When the daemon and a rank
//! waiting for it run on one core, every handoff between them is a context switch (~1.3 µs here,
//! two per operation); on two cores a blocking put took 16 µs that way instead of 10.5. When the
//! daemon shares a core with a rank that computes, its yields hand the core over until the next
//! scheduler tick (4 ms). So a daemon may be pinned to a core (`nic_cpu`), publishes it in every
//! control block, and then yields only to clients that announce they wait on that core. A
//! client that waits from that core moves off it while the other cores hold every client of
//! the daemon's process ([`keep_off`]; a GASNet wait outlasting its first spin regardless,
//! [`off_core`]), and a GASNet rank blocked on one operation then spins instead of yielding.

/// The CPU the calling thread runs on (glibc answers from the rseq area: no system call).
pub fn current_cpu() -> Option<u32> {
    // SAFETY: no arguments, no memory; -1 on failure.
    let c = unsafe { libc::sched_getcpu() };
    u32::try_from(c).ok()
}

/// The CPUs the calling thread may run on, in ascending order.
pub fn allowed() -> std::io::Result<Vec<u32>> {
    let set = rustix::process::sched_getaffinity(None)?;
    Ok((0..rustix::process::CpuSet::MAX_CPU as u32)
        .filter(|&c| set.is_set(c as usize))
        .collect())
}

/// Which of the `allowed` CPUs `index` names (negative counts from the end, Python-style).
pub fn pick(allowed: &[u32], index: i64) -> Option<u32> {
    let n = allowed.len() as i64;
    let i = if index < 0 { n + index } else { index };
    (0..n).contains(&i).then(|| allowed[i as usize])
}

/// Pins the calling thread to the allowed CPU that `index` names; returns that CPU. `None`
/// (and no change) when fewer than two CPUs are allowed: a core of its own is then impossible.
pub fn pin(index: i64) -> std::io::Result<Option<u32>> {
    let cpus = allowed()?;
    if cpus.len() < 2 {
        return Ok(None);
    }
    let Some(cpu) = pick(&cpus, index) else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("nic_cpu {index}: only {} CPUs are allowed", cpus.len()),
        ));
    };
    set_allowed(&[cpu])?;
    Ok(Some(cpu))
}

/// The CPUs of `cpus` but `cpu`.
fn others(cpus: &[u32], cpu: u32) -> impl Iterator<Item = u32> + '_ {
    cpus.iter().copied().filter(move |&c| c != cpu)
}

/// How many CPUs the calling thread may use besides `nic` (asked once per thread: leaving
/// the NIC's core, see [`keep_off`], does not change the count).
pub fn other_cpus(nic: u32) -> usize {
    thread_local! {
        static OTHERS: std::cell::OnceCell<usize> = const { std::cell::OnceCell::new() };
    }
    OTHERS.with(|o| *o.get_or_init(|| allowed().map_or(0, |c| others(&c, nic).count())))
}

/// Restricts the calling thread, allowed `cpus`, to those other than `cpu`; `false` when there
/// are none (or the kernel refuses), the thread then stays where it is.
pub fn leave(cpus: &[u32], cpu: u32) -> bool {
    let rest: Vec<u32> = others(cpus, cpu).collect();
    !rest.is_empty() && set_allowed(&rest).is_ok()
}

/// Where a thread stands towards the NIC's core.
#[derive(Default)]
struct Left {
    /// The CPUs it was allowed before it left the NIC's core (`Some` while it keeps off).
    before: Option<Vec<u32>>,
    /// It left for good (a GASNet wait): crowding does not bring it back.
    for_good: bool,
    /// It could not leave (nowhere else to go, or refused): it stops trying.
    stuck: bool,
    /// The number of clients at which it found the other cores too few to hold them all:
    /// asking again (a syscall and an allocation on every yield on the NIC's core, ~2% of a
    /// waiting rank's time) waits until that number (or whether it mostly waits) changes.
    crowded_at: Option<(u32, bool)>,
    /// How much of its time it spends waiting, from its yields.
    duty: Duty,
}

/// Two yields closer than this belong to one wait (the time between them was waited).
const SAME_WAIT_NS: u64 = 50_000;
/// The window a thread's waiting share is measured over.
const DUTY_WINDOW_NS: u64 = 5_000_000;

/// A thread's busy share of its time, per window of `window_ns`: the time from one event (a
/// turn, a yield) to the next counts as busy when the caller says so.
pub struct Load {
    window_ns: u64,
    window_start: u64,
    last_turn: u64,
    busy_ns: u64,
}

impl Load {
    pub fn new(now: u64, window_ns: u64) -> Load {
        Load {
            window_ns,
            window_start: now,
            last_turn: now,
            busy_ns: 0,
        }
    }

    /// Nanoseconds since the last event.
    pub fn since_last(&self, now: u64) -> u64 {
        now.saturating_sub(self.last_turn)
    }

    /// An event at `now` (the time since the last one was busy if `last_busy`); at a
    /// window's end, its busy share in per mille.
    pub fn turn(&mut self, now: u64, last_busy: bool) -> Option<u32> {
        if last_busy {
            self.busy_ns += self.since_last(now);
        }
        self.last_turn = now;
        let span = now.saturating_sub(self.window_start);
        if span < self.window_ns {
            return None;
        }
        let share = (self.busy_ns * 1000 / span) as u32;
        self.window_start = now;
        self.busy_ns = 0;
        Some(share)
    }
}

/// A thread's share of time spent waiting, measured from its yields (every wait that lasts
/// past its first spins yields, back to back): the time between two yields of one wait counts
/// as waited, any longer gap as work.
#[derive(Default)]
struct Duty {
    /// From the first yield: that instant (the clock the load counts from) and the load.
    clock: Option<(std::time::Instant, Load)>,
    /// Over the last full window it waited more than it worked.
    mostly_waiting: bool,
}

impl Duty {
    /// Counts a yield at `now`; whether the thread mostly waits.
    fn on_yield(&mut self, now: std::time::Instant) -> bool {
        let (since, load) = self
            .clock
            .get_or_insert_with(|| (now, Load::new(0, DUTY_WINDOW_NS)));
        let ns = now.saturating_duration_since(*since).as_nanos() as u64;
        let same_wait = load.since_last(ns) < SAME_WAIT_NS;
        if let Some(share) = load.turn(ns, same_wait) {
            self.mostly_waiting = share > 500;
        }
        self.mostly_waiting
    }
}

thread_local! {
    static LEFT: std::cell::RefCell<Left> = std::cell::RefCell::new(Left::default());
}

/// Whether [`keep_off`] decides yet: not before the job's ranks are all attached (their
/// number is what it weighs), see [`start_placing`].
static PLACING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Lets [`keep_off`] decide from now on: called once the job's ranks are all attached.
pub fn start_placing() {
    PLACING.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// The CPUs the calling thread may run on, not counting a move off the NIC's core (what a
/// measurement that pins itself chooses among).
pub fn allowed_before_leaving() -> std::io::Result<Vec<u32>> {
    match LEFT.with_borrow(|l| l.before.clone()) {
        Some(cpus) => Ok(cpus),
        None => allowed(),
    }
}

/// What [`keep_off`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// The thread left the NIC's core just now.
    Moved,
    /// Nothing changed (or it went back to every CPU it had).
    Stayed,
}

/// Moves the calling thread off `nic` if it runs there, or (`anywhere`) keeps it from going
/// there if it may (`room`: whether the other CPUs hold the clients); remembers how to come
/// back.
fn leave_nic(l: &mut Left, nic: u32, anywhere: bool, room: impl Fn(usize) -> bool) -> Placed {
    if l.before.is_some() || l.stuck || (!anywhere && current_cpu() != Some(nic)) {
        return Placed::Stayed;
    }
    let Ok(cpus) = allowed() else {
        return Placed::Stayed;
    };
    let n = others(&cpus, nic).count();
    if n == 0 || !cpus.contains(&nic) || !room(n) {
        return Placed::Stayed;
    }
    let moved = leave(&cpus, nic);
    l.stuck = !moved;
    tracing::debug!(nic, moved, "a client keeps off the NIC's core");
    if moved {
        l.before = Some(cpus);
        Placed::Moved
    } else {
        Placed::Stayed
    }
}

/// Whether `others` CPUs besides the NIC's hold a thread among `sharing` clients: all of them,
/// or all but one for a thread that mostly waits.
fn room(sharing: u32, others: usize, waiting: bool) -> bool {
    let n = sharing as usize;
    n <= others || (waiting && n <= others + 1)
}

/// For a thread about to wait on the NIC pinned to `nic`, one of `sharing` processes the NIC
/// serves: keeps it off the NIC's core while the other CPUs it may use hold them all (a
/// client sharing the NIC's core pays two context switches per operation), or hold all but
/// one and it mostly waits (ranks that wait more than they work lose little by sharing the
/// other cores: gni put 8 B ping-pong at 2 ranks on 2 cores, both off the NIC's core 3.6–4.2
/// µs, one on it 5.0–5.3). Crowding the other cores more costs more (RandomAccess over VELO
/// at 2 ranks on 2 cores lost half when computing ranks crowded; DMAPP bandwidth at 4 ranks
/// on 2 cores −20% when waiting ones did), so it lets a thread back when they are too few.
pub fn keep_off(nic: u32, sharing: u32) -> Placed {
    if !PLACING.load(std::sync::atomic::Ordering::Relaxed) {
        return Placed::Stayed;
    }
    LEFT.with_borrow_mut(|l| {
        let waiting = l.duty.on_yield(std::time::Instant::now());
        let fits = |others: usize| room(sharing, others, waiting);
        if let (Some(cpus), false) = (&l.before, l.for_good) {
            if !fits(others(cpus, nic).count()) && set_allowed(cpus).is_ok() {
                tracing::debug!(nic, sharing, "a client may use the NIC's core again");
                l.before = None;
            }
            return Placed::Stayed;
        }
        if l.crowded_at == Some((sharing, waiting)) {
            return Placed::Stayed;
        }
        let crowded = std::cell::Cell::new(false);
        let placed = leave_nic(l, nic, false, |others| {
            crowded.set(!fits(others));
            !crowded.get()
        });
        l.crowded_at = crowded.get().then_some((sharing, waiting));
        placed
    })
}

/// For a GASNet wait that outlasts its first spin: whether this thread runs on another core
/// than the NIC's `nic`, keeping off it for good (GASNet's waits measured faster so even
/// where the ranks then crowd the other cores: AM Short 11 against 12–14 µs, two ranks on two
/// cores). Wherever the thread runs at that moment: a rank that was elsewhere at its first
/// long wait, and not kept off, was later put on the NIC's core by the scheduler and stayed
/// (AM Short 12.4–13.0 µs in those jobs, against 10.5 with both ranks off it).
pub fn off_core(nic: u32) -> bool {
    LEFT.with_borrow_mut(|l| {
        if leave_nic(l, nic, true, |_| true) == Placed::Moved || l.before.is_some() {
            l.for_good = true;
        }
    });
    current_cpu().is_some_and(|c| c != nic)
}

/// Lets the calling thread run on exactly `cpus` (also how a benchmark pins its floor, then
/// restores what [`allowed`] said before).
pub fn set_allowed(cpus: &[u32]) -> std::io::Result<()> {
    let mut set = rustix::process::CpuSet::new();
    for &c in cpus {
        set.set(c as usize);
    }
    Ok(rustix::process::sched_setaffinity(None, &set)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Yields every `every_us` for `waits` in a row, then a gap of `work_us`, repeated over
    /// `ms` milliseconds; what `Duty` concludes at the end.
    fn duty_of(every_us: u64, waits: u32, work_us: u64, ms: u64) -> bool {
        let mut d = Duty::default();
        let t0 = std::time::Instant::now();
        let (mut at, mut last) = (0u64, false);
        while at < ms * 1000 {
            for _ in 0..waits {
                last = d.on_yield(t0 + std::time::Duration::from_micros(at));
                at += every_us;
            }
            at += work_us;
        }
        last
    }

    /// A ping-pong rank yields through most of its time, a computing one seldom and far apart;
    /// nothing is decided before a whole window.
    #[test]
    fn a_thread_mostly_waits_when_its_yields_fill_most_of_its_time() {
        assert!(duty_of(2, 4, 2, 20), "8 µs of every 10 waited");
        assert!(!duty_of(2, 2, 100, 20), "4 µs waited, 100 µs worked");
        assert!(
            !duty_of(200, 1, 0, 20),
            "yields 200 µs apart are not one wait"
        );
        assert!(!duty_of(2, 4, 2, 4), "no whole window yet");
        // A rank that waited, then computes: the next window says so.
        let mut d = Duty::default();
        let t0 = std::time::Instant::now();
        let us = |n: u64| t0 + std::time::Duration::from_micros(n);
        for k in 0..3000 {
            d.on_yield(us(k * 2));
        }
        assert!(d.on_yield(us(6000)));
        for k in 0..100 {
            d.on_yield(us(6000 + k * 200));
        }
        assert!(!d.on_yield(us(26_000)));
    }

    /// Two ranks on two cores: off the NIC's core only while they mostly wait; four never.
    #[test]
    fn waiting_ranks_may_crowd_the_other_cores_by_one() {
        assert!(room(1, 1, false) && room(2, 3, false));
        assert!(!room(2, 1, false) && room(2, 1, true));
        assert!(!room(3, 1, true) && !room(4, 1, true));
        assert!(room(4, 3, true) && !room(5, 3, true));
    }

    #[test]
    fn indices_count_from_either_end_and_stay_inside() {
        let cpus = [0, 1, 4, 5];
        assert_eq!(pick(&cpus, 0), Some(0));
        assert_eq!(pick(&cpus, 2), Some(4));
        assert_eq!(pick(&cpus, -1), Some(5));
        assert_eq!(pick(&cpus, -4), Some(0));
        assert_eq!(pick(&cpus, 4), None);
        assert_eq!(pick(&cpus, -5), None);
        assert_eq!(pick(&[], -1), None);
    }

    /// Runs `f` with the CPUs allowed in a thread of its own (the affinity it changes must not
    /// leak into other tests), if there are two or more.
    fn with_two_cpus(f: impl FnOnce(Vec<u32>) + Send + 'static) {
        std::thread::spawn(|| {
            let cpus = allowed().unwrap();
            if cpus.len() < 2 {
                eprintln!("skipped: one CPU allowed, nowhere to move");
                return;
            }
            f(cpus)
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_that_leaves_a_core_no_longer_runs_there() {
        with_two_cpus(|cpus| {
            let here = pin(0).unwrap().expect("two CPUs");
            assert_eq!(here, cpus[0]);
            assert_eq!(current_cpu(), Some(here), "pinned threads run where pinned");
            // Widen again, then leave the first CPU: the thread must move.
            let mut all = rustix::process::CpuSet::new();
            cpus.iter().for_each(|&c| all.set(c as usize));
            rustix::process::sched_setaffinity(None, &all).unwrap();
            assert!(leave(&cpus, here));
            assert!(!allowed().unwrap().contains(&here));
            assert_ne!(current_cpu(), Some(here));
        });
    }

    #[test]
    fn a_gasnet_wait_keeps_off_the_nic_core_from_wherever_it_runs() {
        with_two_cpus(|cpus| {
            // The NIC's core is the first; the thread runs on the last, still allowed both.
            let nic = cpus[0];
            pin(-1).unwrap().expect("two CPUs");
            set_allowed(&cpus).unwrap();
            assert!(off_core(nic), "it runs elsewhere");
            assert!(
                !allowed().unwrap().contains(&nic),
                "the scheduler may no longer put it on the NIC's core"
            );
            assert_eq!(allowed_before_leaving().unwrap(), cpus);
        });
    }
}
