//! PMI-1, the process-manager interface of MPICH's Hydra (`mpiexec.hydra`) and of Slurm's
//! `srun --mpi=pmi2` (which answers PMI-1 clients too): a line protocol of `cmd=NAME key=value`
//! words over a stream the manager hands the process (`PMI_FD`, or `PMI_PORT` with `PMI_ID`).
//!
//! [`PmiClient`] lets a rank bootstrap under such a manager (rank, size, a key-value space with
//! a barrier); [`PmiServer`] is the manager side `softnic run` offers its own ranks, so an
//! unmodified PMI-1 program bootstraps under it too. Both sides treat what they read as hostile:
//! lines are bounded, every field is checked, and anything malformed is a typed error (client)
//! or an error reply and a dropped connection (server) — never a panic or a hang.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// The longest line either side accepts (key and value limits below, plus the words around).
pub const MAX_LINE: usize = 2048;
/// The limits this server announces (`cmd=maxes`), as Hydra's.
pub const KVSNAME_MAX: usize = 256;
pub const KEYLEN_MAX: usize = 64;
pub const VALLEN_MAX: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum PmiError {
    #[error("PMI: {0} is not set or invalid (a PMI-1 process manager sets PMI_FD, or PMI_PORT and PMI_ID)")]
    Env(&'static str),
    #[error("PMI: cannot reach the process manager at {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("PMI: the process manager closed the connection")]
    Closed,
    #[error("PMI: {0}")]
    Io(#[from] std::io::Error),
    #[error("PMI: malformed line from the process manager: {0:?}")]
    Malformed(String),
    #[error("PMI: expected cmd={expected}, the process manager said {got:?}")]
    Unexpected { expected: &'static str, got: String },
    #[error("PMI: {what} failed (rc={rc}{})", msg.as_ref().map_or(String::new(), |m| format!(", {m}")))]
    Failed {
        what: &'static str,
        rc: i64,
        msg: Option<String>,
    },
    #[error("PMI: key {0:?} not found")]
    NoKey(String),
    #[error("PMI: {0:?} is not a valid key or value (no spaces, '=' or newlines; keys ≤ {KEYLEN_MAX}, values ≤ {VALLEN_MAX} bytes)")]
    BadWord(String),
}

/// One parsed line: `cmd=NAME` and its other `key=value` words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    pub cmd: String,
    pub words: Vec<(String, String)>,
}

impl Line {
    /// Parses `cmd=NAME k=v ...` (words separated by spaces; a value may be empty).
    pub fn parse(s: &str) -> Option<Line> {
        let mut it = s.split(' ').filter(|w| !w.is_empty());
        let cmd = it.next()?.strip_prefix("cmd=")?;
        if cmd.is_empty() {
            return None;
        }
        let mut words = Vec::new();
        for w in it {
            let (k, v) = w.split_once('=')?;
            if k.is_empty() {
                return None;
            }
            words.push((k.to_string(), v.to_string()));
        }
        Some(Line {
            cmd: cmd.to_string(),
            words,
        })
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.words
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn num<T: std::str::FromStr>(&self, key: &str) -> Option<T> {
        self.get(key)?.parse().ok()
    }
}

/// Whether `w` can travel as a key or value (PMI-1 has no quoting).
fn word_ok(w: &str, max: usize) -> bool {
    w.len() <= max
        && !w
            .bytes()
            .any(|b| b == b' ' || b == b'=' || b == b'\n' || b == 0)
}

/// Reads one line of at most [`MAX_LINE`] bytes; `None` at end of stream.
fn read_line(r: &mut impl BufRead) -> std::io::Result<Option<String>> {
    let mut buf = Vec::new();
    let n = r
        .by_ref()
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("line longer than {MAX_LINE} bytes or cut short"),
        ));
    }
    buf.pop();
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "line is not UTF-8"))
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Read for Stream {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(b),
            Stream::Tcp(s) => s.read(b),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(b),
            Stream::Tcp(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A rank's connection to its PMI-1 process manager.
pub struct PmiClient {
    r: BufReader<Stream>,
    pub rank: u32,
    pub size: u32,
    pub kvsname: String,
    finalized: bool,
}

impl std::fmt::Debug for PmiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PmiClient(rank {} of {})", self.rank, self.size)
    }
}

fn env_num<T: std::str::FromStr>(name: &'static str) -> Result<T, PmiError> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .ok_or(PmiError::Env(name))
}

impl PmiClient {
    /// Whether this process was started by a PMI-1 process manager.
    pub fn available() -> bool {
        std::env::var_os("PMI_FD").is_some() || std::env::var_os("PMI_PORT").is_some()
    }

    /// Connects as the environment says (`PMI_FD`, else `PMI_PORT` + `PMI_ID`) and runs the
    /// init exchange; learns rank, size and the key-value space's name.
    pub fn connect() -> Result<PmiClient, PmiError> {
        let timeout = Some(Duration::from_secs(120));
        let (stream, id_rank) = if std::env::var_os("PMI_FD").is_some() {
            let fd: i32 = env_num("PMI_FD")?;
            // SAFETY: only asks the kernel whether descriptor `fd` is open; nothing is
            // borrowed past the call.
            let open = fd >= 0
                && rustix::io::fcntl_getfd(unsafe { rustix::fd::BorrowedFd::borrow_raw(fd) })
                    .is_ok();
            if !open {
                return Err(PmiError::Env("PMI_FD"));
            }
            // SAFETY: the process manager handed this open descriptor to us alone; it is
            // checked open above and owned from here on.
            let s = UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) });
            (Stream::Unix(s), None)
        } else {
            let addr = std::env::var("PMI_PORT").map_err(|_| PmiError::Env("PMI_PORT"))?;
            let id: u32 = env_num("PMI_ID")?;
            let s = TcpStream::connect(&addr).map_err(|source| PmiError::Connect {
                addr: addr.clone(),
                source,
            })?;
            s.set_read_timeout(timeout)?;
            (Stream::Tcp(s), Some(id))
        };
        let mut c = PmiClient {
            r: BufReader::new(stream),
            rank: 0,
            size: 0,
            kvsname: String::new(),
            finalized: false,
        };
        match id_rank {
            Some(id) => {
                // PMI_PORT: the manager tells size and rank after the id.
                c.send(&format!("cmd=initack pmiid={id}"))?;
                c.expect("initack")?;
                for _ in 0..3 {
                    let l = c.expect("set")?;
                    if let Some(v) = l.num("size") {
                        c.size = v;
                    }
                    if let Some(v) = l.num("rank") {
                        c.rank = v;
                    }
                }
            }
            None => {
                c.rank = env_num("PMI_RANK")?;
                c.size = env_num("PMI_SIZE")?;
            }
        }
        if c.size == 0 || c.rank >= c.size {
            return Err(PmiError::Malformed(format!(
                "rank {} of size {}",
                c.rank, c.size
            )));
        }
        c.send("cmd=init pmi_version=1 pmi_subversion=1")?;
        let l = c.expect("response_to_init")?;
        c.check(&l, "init")?;
        c.send("cmd=get_my_kvsname")?;
        let l = c.expect("my_kvsname")?;
        c.kvsname = l
            .get("kvsname")
            .filter(|n| word_ok(n, KVSNAME_MAX) && !n.is_empty())
            .ok_or_else(|| PmiError::Malformed(format!("{l:?}")))?
            .to_string();
        Ok(c)
    }

    /// Sends one request in one write: some managers (Slurm's pmi2 plugin) take each read as
    /// a whole request.
    fn send(&mut self, line: &str) -> Result<(), PmiError> {
        let msg = format!("{line}\n");
        self.r.get_mut().write_all(msg.as_bytes())?;
        Ok(())
    }

    fn expect(&mut self, cmd: &'static str) -> Result<Line, PmiError> {
        let raw = read_line(&mut self.r)?.ok_or(PmiError::Closed)?;
        let l = Line::parse(&raw).ok_or_else(|| PmiError::Malformed(raw.clone()))?;
        if l.cmd != cmd {
            return Err(PmiError::Unexpected {
                expected: cmd,
                got: raw,
            });
        }
        Ok(l)
    }

    fn check(&self, l: &Line, what: &'static str) -> Result<(), PmiError> {
        match l.get("rc") {
            None | Some("0") => Ok(()),
            Some(rc) => Err(PmiError::Failed {
                what,
                rc: rc.parse().unwrap_or(-1),
                msg: l.get("msg").map(str::to_string),
            }),
        }
    }

    /// `PMI_KVS_Put` into this job's space (visible to others after [`PmiClient::barrier`]).
    pub fn put(&mut self, key: &str, value: &str) -> Result<(), PmiError> {
        for w in [(key, KEYLEN_MAX), (value, VALLEN_MAX)] {
            if !word_ok(w.0, w.1) || key.is_empty() {
                return Err(PmiError::BadWord(w.0.to_string()));
            }
        }
        let line = format!("cmd=put kvsname={} key={key} value={value}", self.kvsname);
        self.send(&line)?;
        let l = self.expect("put_result")?;
        self.check(&l, "put")
    }

    /// `PMI_KVS_Get`.
    pub fn get(&mut self, key: &str) -> Result<String, PmiError> {
        if !word_ok(key, KEYLEN_MAX) || key.is_empty() {
            return Err(PmiError::BadWord(key.to_string()));
        }
        let line = format!("cmd=get kvsname={} key={key}", self.kvsname);
        self.send(&line)?;
        let l = self.expect("get_result")?;
        if l.get("rc") != Some("0") {
            return Err(PmiError::NoKey(key.to_string()));
        }
        Ok(l.get("value").unwrap_or_default().to_string())
    }

    /// `PMI_Barrier` (which also publishes every put before it).
    pub fn barrier(&mut self) -> Result<(), PmiError> {
        self.send("cmd=barrier_in")?;
        self.expect("barrier_out").map(|_| ())
    }

    /// `PMI_Finalize`: the process is done with the manager.
    pub fn finalize(&mut self) -> Result<(), PmiError> {
        if self.finalized {
            return Ok(());
        }
        self.finalized = true;
        self.send("cmd=finalize")?;
        self.expect("finalize_ack").map(|_| ())
    }

    /// `PMI_Abort`: asks the manager to end the whole job with `code`.
    pub fn abort(&mut self, code: i32, msg: &str) -> Result<(), PmiError> {
        let msg: String = msg
            .chars()
            .map(|c| {
                if c == ' ' || c == '=' || c == '\n' {
                    '_'
                } else {
                    c
                }
            })
            .take(VALLEN_MAX)
            .collect();
        self.send(&format!("cmd=abort exitcode={code} error_msg={msg}"))
    }
}

/// What one rank's connection is doing, on the server side.
struct Conn {
    stream: UnixStream,
    buf: Vec<u8>,
    rank: u32,
    in_barrier: bool,
    finalized: bool,
    open: bool,
}

/// What the server saw, for the launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PmiEvent {
    /// A rank asked to end the job (`PMI_Abort`).
    Abort { rank: u32, code: i32, msg: String },
    /// A rank sent something this server cannot take; its connection was closed.
    Bad { rank: u32, why: String },
}

/// The PMI-1 manager side `softnic run` offers its ranks: one socket pair per rank (`PMI_FD`),
/// one key-value space, barriers over all ranks.
pub struct PmiServer {
    conns: Vec<Conn>,
    kvs: HashMap<String, String>,
    kvsname: String,
    size: u32,
    events: Vec<PmiEvent>,
}

impl PmiServer {
    /// A server for `size` ranks; returns it and, per rank, the descriptor to hand that rank
    /// as `PMI_FD` (the launcher closes its copy once the rank is started).
    pub fn new(size: u32, kvsname: &str) -> std::io::Result<(PmiServer, Vec<OwnedFd>)> {
        let mut conns = Vec::new();
        let mut theirs = Vec::new();
        for rank in 0..size {
            let (a, b) = UnixStream::pair()?;
            a.set_nonblocking(true)?;
            conns.push(Conn {
                stream: a,
                buf: Vec::new(),
                rank,
                in_barrier: false,
                finalized: false,
                open: true,
            });
            theirs.push(OwnedFd::from(b));
        }
        Ok((
            PmiServer {
                conns,
                kvs: HashMap::new(),
                kvsname: kvsname.to_string(),
                size,
                events: Vec::new(),
            },
            theirs,
        ))
    }

    /// Serves whatever the ranks sent, waiting at most `max` for something to arrive.
    pub fn serve(&mut self, max: Duration) {
        use rustix::event::{poll, PollFd, PollFlags};
        let ready: Vec<usize> = {
            let mut fds: Vec<PollFd> = self
                .conns
                .iter()
                .filter(|c| c.open)
                .map(|c| PollFd::new(&c.stream, PollFlags::IN))
                .collect();
            if fds.is_empty() {
                std::thread::sleep(max);
                return;
            }
            let ms = max.as_millis().min(i32::MAX as u128) as i32;
            if poll(&mut fds, ms).unwrap_or(0) == 0 {
                return;
            }
            let open: Vec<usize> = (0..self.conns.len())
                .filter(|&i| self.conns[i].open)
                .collect();
            fds.iter()
                .zip(open)
                .filter(|(f, _)| !f.revents().is_empty())
                .map(|(_, i)| i)
                .collect()
        };
        for i in ready {
            self.read_from(i);
        }
    }

    /// Events since the last call (aborts, bad input).
    pub fn take_events(&mut self) -> Vec<PmiEvent> {
        std::mem::take(&mut self.events)
    }

    fn read_from(&mut self, i: usize) {
        let mut chunk = [0u8; 4096];
        loop {
            let c = &mut self.conns[i];
            match c.stream.read(&mut chunk) {
                Ok(0) => {
                    c.open = false;
                    break;
                }
                Ok(n) => c.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    c.open = false;
                    break;
                }
            }
        }
        while let Some(pos) = self.conns[i].buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.conns[i].buf.drain(..=pos).collect();
            let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            self.handle(i, &text);
            if !self.conns[i].open {
                return;
            }
        }
        if self.conns[i].buf.len() > MAX_LINE {
            self.bad(i, format!("a line longer than {MAX_LINE} bytes"));
        }
    }

    fn reply(&mut self, i: usize, line: &str) {
        let c = &mut self.conns[i];
        c.stream.set_nonblocking(false).ok();
        let ok = c.stream.write_all(format!("{line}\n").as_bytes()).is_ok();
        c.stream.set_nonblocking(true).ok();
        if !ok {
            c.open = false;
        }
    }

    fn bad(&mut self, i: usize, why: String) {
        let rank = self.conns[i].rank;
        self.events.push(PmiEvent::Bad { rank, why });
        self.conns[i].open = false;
        let _ = self.conns[i].stream.shutdown(std::net::Shutdown::Both);
    }

    fn handle(&mut self, i: usize, text: &str) {
        let Some(l) = Line::parse(text) else {
            return self.bad(i, format!("malformed PMI line {text:?}"));
        };
        let rank = self.conns[i].rank;
        match l.cmd.as_str() {
            "init" => {
                let v = l.get("pmi_version").unwrap_or("1");
                let rc = if v == "1" { 0 } else { -1 };
                self.reply(
                    i,
                    &format!("cmd=response_to_init pmi_version=1 pmi_subversion=1 rc={rc}"),
                );
            }
            "get_maxes" => self.reply(
                i,
                &format!(
                    "cmd=maxes kvsname_max={KVSNAME_MAX} keylen_max={KEYLEN_MAX} vallen_max={VALLEN_MAX}"
                ),
            ),
            "get_appnum" => self.reply(i, "cmd=appnum appnum=0"),
            "get_universe_size" => {
                let n = self.size;
                self.reply(i, &format!("cmd=universe_size size={n}"))
            }
            "get_my_kvsname" => {
                let k = self.kvsname.clone();
                self.reply(i, &format!("cmd=my_kvsname kvsname={k}"))
            }
            "put" => {
                let (Some(k), Some(v)) = (l.get("key"), l.get("value")) else {
                    return self.reply(i, "cmd=put_result rc=-1 msg=key_or_value_missing");
                };
                if k.is_empty() || !word_ok(k, KEYLEN_MAX) || !word_ok(v, VALLEN_MAX) {
                    return self.reply(i, "cmd=put_result rc=-1 msg=key_or_value_too_long");
                }
                if self.kvs.len() >= 64 * 1024 && !self.kvs.contains_key(k) {
                    return self.reply(i, "cmd=put_result rc=-1 msg=key_space_full");
                }
                self.kvs.insert(k.to_string(), v.to_string());
                self.reply(i, "cmd=put_result rc=0 msg=success")
            }
            "get" => {
                let found = l.get("key").and_then(|k| self.kvs.get(k)).cloned();
                match found {
                    Some(v) => self.reply(i, &format!("cmd=get_result rc=0 msg=success value={v}")),
                    None => self.reply(i, "cmd=get_result rc=-1 msg=key_not_found"),
                }
            }
            "barrier_in" => {
                self.conns[i].in_barrier = true;
                let waiting = |c: &Conn| c.in_barrier || c.finalized || !c.open;
                if self.conns.iter().all(waiting) {
                    for j in 0..self.conns.len() {
                        if self.conns[j].in_barrier {
                            self.conns[j].in_barrier = false;
                            self.reply(j, "cmd=barrier_out");
                        }
                    }
                }
            }
            "finalize" => {
                self.conns[i].finalized = true;
                self.reply(i, "cmd=finalize_ack");
            }
            "abort" => {
                let code = l.num("exitcode").unwrap_or(1);
                let msg = l.get("error_msg").unwrap_or_default().replace('_', " ");
                self.events.push(PmiEvent::Abort { rank, code, msg });
            }
            other => {
                let why = format!("unknown PMI command {other:?}");
                self.bad(i, why)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lines_parse_and_refuse() {
        let l = Line::parse("cmd=put kvsname=k0 key=a value=").unwrap();
        assert_eq!(l.cmd, "put");
        assert_eq!(l.get("value"), Some(""));
        assert_eq!(l.get("kvsname"), Some("k0"));
        for bad in ["", "put key=a", "cmd=", "cmd=put key", "cmd=put =v"] {
            assert_eq!(Line::parse(bad), None, "{bad:?}");
        }
    }

    fn talk(s: &mut UnixStream, line: &str) -> String {
        s.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        read_line(&mut r).unwrap().unwrap()
    }

    #[test]
    fn server_serves_init_kvs_barrier_and_refuses_garbage() {
        let (mut srv, fds) = PmiServer::new(2, "kvs_7").unwrap();
        let mut ranks: Vec<UnixStream> = fds.into_iter().map(UnixStream::from).collect();
        let t = std::thread::spawn(move || {
            let mut events = Vec::new();
            for _ in 0..500 {
                srv.serve(Duration::from_millis(10));
                events.extend(srv.take_events());
                if events.len() >= 2 {
                    break;
                }
            }
            events
        });
        let r = talk(&mut ranks[0], "cmd=init pmi_version=1 pmi_subversion=1");
        assert!(
            r.starts_with("cmd=response_to_init") && r.contains("rc=0"),
            "{r}"
        );
        assert_eq!(
            talk(&mut ranks[1], "cmd=get_my_kvsname"),
            "cmd=my_kvsname kvsname=kvs_7"
        );
        let r = talk(&mut ranks[0], "cmd=put kvsname=kvs_7 key=host-0 value=3");
        assert!(r.contains("rc=0"), "{r}");
        let long = "x".repeat(VALLEN_MAX + 1);
        let r = talk(
            &mut ranks[0],
            &format!("cmd=put kvsname=kvs_7 key=k value={long}"),
        );
        assert!(r.contains("rc=-1"), "{r}");
        // Both must enter before either leaves the barrier.
        ranks[0].write_all(b"cmd=barrier_in\n").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(talk(&mut ranks[1], "cmd=barrier_in"), "cmd=barrier_out");
        let mut r0 = BufReader::new(ranks[0].try_clone().unwrap());
        assert_eq!(read_line(&mut r0).unwrap().unwrap(), "cmd=barrier_out");
        let r = talk(&mut ranks[1], "cmd=get kvsname=kvs_7 key=host-0");
        assert!(r.contains("rc=0") && r.ends_with("value=3"), "{r}");
        let r = talk(&mut ranks[1], "cmd=get kvsname=kvs_7 key=nope");
        assert!(r.contains("rc=-1"), "{r}");
        ranks[1]
            .write_all(b"cmd=abort exitcode=7 error_msg=gave_up\n")
            .unwrap();
        ranks[0].write_all(b"garbage\n").unwrap();
        let events = t.join().unwrap();
        assert!(events.contains(&PmiEvent::Abort {
            rank: 1,
            code: 7,
            msg: "gave up".into()
        }));
        assert!(events
            .iter()
            .any(|e| matches!(e, PmiEvent::Bad { rank: 0, .. })));
    }

    proptest! {
        #[test]
        fn parse_never_panics(s in ".{0,300}") {
            let _ = Line::parse(&s);
        }
    }
}
