//! GASNet Core: attach with a segment, the handler table, Active Message requests and replies
//! (Short, Medium, Long; 0–16 32-bit arguments), polling and blocking until a condition holds.
//!
//! Handler rules as GASNet has them: a request handler may reply at most once (a second reply
//! is an error) and cannot block or make requests — it only gets a [`Token`]; a reply handler
//! cannot communicate at all. Handler indices 1–127 are the library's own; clients use
//! 128–255 ([`HANDLER_USER_MIN`]).

use super::am::{self, AmHeader, Category, MAX_ARGS};
use super::conduit::{Conduit, RmaDone};
use super::GasnetError;

pub const HANDLER_USER_MIN: u8 = 128;

/// What a handler is given.
pub struct Msg<'a> {
    pub src: u32,
    pub category: Category,
    pub args: &'a [u32],
    /// Medium: the payload. Long: the bytes as written into this node's segment.
    pub payload: &'a [u8],
    /// Long: where in this node's segment the payload was written.
    pub offset: u64,
}

/// The right to reply (request handlers) and access to this node's segment.
pub struct Token<'a> {
    pub(crate) src: u32,
    pub(crate) request: bool,
    pub(crate) reply: Option<Encoded>,
    /// A buffer the reply is encoded into (the Core's, lent: no allocation per reply).
    pub(crate) spare: Vec<u8>,
    pub(crate) segment: &'a mut [u8],
    pub(crate) limits: Limits,
    /// The conduit's landing area (see [`Conduit::landing`]), which only the Extended API's
    /// get replies may address.
    pub(crate) landing: Option<(u64, usize)>,
}

/// Whether `len` bytes at `offset` of an area of `area_len` bytes fit.
pub(crate) fn fits(area_len: usize, offset: u64, len: u64) -> bool {
    offset
        .checked_add(len)
        .is_some_and(|e| e <= area_len as u64)
}

/// Whether a Long of `len` bytes at `offset` reaches into the landing area (`landing`), which
/// applications' AMs may not name.
fn into_landing(landing: Option<(u64, usize)>, offset: u64, len: usize) -> bool {
    landing.is_some_and(|(base, _)| offset.saturating_add(len as u64) > base)
}

/// How large an AM may be: the whole encoding (Short, Medium), a Long's payload.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_am: usize,
    pub max_long: usize,
}

/// An encoded AM. A Long keeps its payload apart, so the conduit may move it on its own.
pub(crate) struct Encoded {
    pub bytes: Vec<u8>,
    pub long_payload: Option<LongPayload>,
}

/// Where a Long reply's payload is: a copy, or bytes of this node's segment (sent from in
/// place, so a reply of megabytes is not copied on the way out).
pub(crate) enum LongPayload {
    Owned(Vec<u8>),
    Segment { offset: usize, len: usize },
}

impl Token<'_> {
    /// The node that sent the message being handled.
    pub fn src(&self) -> u32 {
        self.src
    }

    /// This node's segment (Long payloads have already landed in it).
    pub fn segment(&mut self) -> &mut [u8] {
        self.segment
    }

    fn reply(
        &mut self,
        handler: u8,
        category: Category,
        args: &[u32],
        payload: &[u8],
        offset: u64,
    ) -> Result<(), GasnetError> {
        self.may_reply()?;
        if category == Category::Long && into_landing(self.landing, offset, payload.len()) {
            return Err(GasnetError::OutOfSegment(offset, payload.len() as u64));
        }
        let mut bytes = std::mem::take(&mut self.spare);
        encode_into(
            handler,
            category,
            true,
            args,
            payload,
            offset,
            self.limits,
            &mut bytes,
        )?;
        let long_payload =
            (category == Category::Long).then(|| LongPayload::Owned(payload.to_vec()));
        self.reply = Some(Encoded {
            bytes,
            long_payload,
        });
        Ok(())
    }

    /// GASNet's rules: replies only from request handlers, once each.
    fn may_reply(&self) -> Result<(), GasnetError> {
        if !self.request {
            return Err(GasnetError::HandlerRule(
                "a reply handler cannot communicate",
            ));
        }
        if self.reply.is_some() {
            return Err(GasnetError::HandlerRule(
                "a request handler may reply only once",
            ));
        }
        Ok(())
    }

    /// AMReplyShort.
    pub fn reply_short(&mut self, handler: u8, args: &[u32]) -> Result<(), GasnetError> {
        self.reply(handler, Category::Short, args, &[], 0)
    }

    /// AMReplyMedium.
    pub fn reply_medium(
        &mut self,
        handler: u8,
        payload: &[u8],
        args: &[u32],
    ) -> Result<(), GasnetError> {
        self.reply(handler, Category::Medium, args, payload, 0)
    }

    /// AMReplyLong: `payload` lands in the requester's segment at `dest_offset`.
    pub fn reply_long(
        &mut self,
        handler: u8,
        payload: &[u8],
        dest_offset: u64,
        args: &[u32],
    ) -> Result<(), GasnetError> {
        self.reply(handler, Category::Long, args, payload, dest_offset)
    }

    /// Whether `len` bytes at `dest` fit the requester's segment or landing area (the same
    /// size on every node): where a get reply may land.
    pub(crate) fn reply_fits(&self, dest: u64, len: u64) -> bool {
        fits(self.segment.len(), dest, len)
            || self
                .landing
                .is_some_and(|(base, n)| dest.checked_sub(base).is_some_and(|at| fits(n, at, len)))
    }

    /// AMReplyLong whose payload is `len` bytes of this node's segment at `src_offset`, sent
    /// from in place (the Extended API's get replies), to the requester's segment or landing
    /// area at `dest_offset`.
    pub(crate) fn reply_long_from_segment(
        &mut self,
        handler: u8,
        src_offset: usize,
        len: usize,
        dest_offset: u64,
        args: &[u32],
    ) -> Result<(), GasnetError> {
        self.may_reply()?;
        let end = src_offset
            .checked_add(len)
            .filter(|&e| e <= self.segment.len());
        let Some(end) = end else {
            return Err(GasnetError::OutOfSegment(src_offset as u64, len as u64));
        };
        // Checked and encoded like any Long reply; the payload stays where it is.
        let payload = &self.segment[src_offset..end];
        let mut bytes = std::mem::take(&mut self.spare);
        encode_into(
            handler,
            Category::Long,
            true,
            args,
            payload,
            dest_offset,
            self.limits,
            &mut bytes,
        )?;
        self.reply = Some(Encoded {
            bytes,
            long_payload: Some(LongPayload::Segment {
                offset: src_offset,
                len,
            }),
        });
        Ok(())
    }
}

pub type Handler = Box<dyn FnMut(&mut Token<'_>, Msg<'_>)>;

/// Encodes an AM into `out` (cleared first); a Long's payload is left out (the caller sends
/// it beside the header).
#[allow(clippy::too_many_arguments)]
pub(crate) fn encode_into(
    handler: u8,
    category: Category,
    reply: bool,
    args: &[u32],
    payload: &[u8],
    offset: u64,
    limits: Limits,
    out: &mut Vec<u8>,
) -> Result<(), GasnetError> {
    out.clear();
    if args.len() > MAX_ARGS {
        return Err(GasnetError::TooManyArgs(args.len()));
    }
    let long = category == Category::Long;
    let too_large = match long {
        true => payload.len() > limits.max_long,
        false => am::encoded_len(args.len(), payload.len()) > limits.max_am,
    };
    if too_large {
        return Err(GasnetError::TooLarge(payload.len()));
    }
    // A Long's payload travels beside the encoding (the conduit places it).
    let payload = if long { &[][..] } else { payload };
    let mut a = [0u32; MAX_ARGS];
    a[..args.len()].copy_from_slice(args);
    let h = AmHeader {
        handler,
        category,
        reply,
        nargs: args.len() as u8,
        args: a,
        offset,
        in_place: false,
    };
    out.reserve(am::encoded_len(args.len(), payload.len()));
    am::encode(&h, payload, out);
    Ok(())
}

/// The Core layer: a conduit, a handler table, this node's segment.
pub struct Core {
    pub(crate) conduit: Box<dyn Conduit>,
    handlers: Vec<Option<Handler>>,
    /// Direct operations the conduit finished, for the Extended layer to account.
    pub(crate) rma_done: Vec<RmaDone>,
    /// Messages that arrived but were not handled yet (delivered by `poll`): source, what the
    /// conduit needs to answer it, the AM.
    inbox: Vec<(u32, u64, Vec<u8>)>,
    /// Where a Long handler's view of its payload is copied (reused).
    long_scratch: Vec<u8>,
    /// Where requests and replies are encoded (reused: no allocation per message).
    spare: Vec<u8>,
    /// Handlers that never look at a Long's payload (it is in the segment): no copy for them.
    unviewed: Vec<bool>,
    pub(crate) dropped: u64,
    /// Active Messages sent (requests and replies).
    pub(crate) sent: u64,
    /// Polls that found something (messages or finished operations): waits back off on it.
    fruitful_polls: u64,
}

impl Core {
    pub fn new(conduit: Box<dyn Conduit>) -> Core {
        Core {
            conduit,
            handlers: (0..256).map(|_| None).collect(),
            rma_done: Vec::new(),
            long_scratch: Vec::new(),
            spare: Vec::new(),
            unviewed: vec![false; 256],
            inbox: Vec::new(),
            dropped: 0,
            sent: 0,
            fruitful_polls: 0,
        }
    }

    pub fn register(&mut self, index: u8, h: Handler) -> Result<(), GasnetError> {
        if index == 0 {
            return Err(GasnetError::BadHandler(index));
        }
        self.handlers[index as usize] = Some(h);
        self.unviewed[index as usize] = false;
        Ok(())
    }

    /// Registers a handler that is given a Long's payload as an empty slice: it only needs to
    /// know the payload is in place (`Msg::offset`), which saves copying every byte of it (the
    /// Extended API's put acknowledgement).
    pub(crate) fn register_unviewed(&mut self, index: u8, h: Handler) -> Result<(), GasnetError> {
        self.register(index, h)?;
        self.unviewed[index as usize] = true;
        Ok(())
    }

    pub fn max_am(&self) -> usize {
        self.conduit.max_am()
    }

    pub(crate) fn limits(&self) -> Limits {
        Limits {
            max_am: self.max_am(),
            max_long: self.conduit.max_long(),
        }
    }

    /// AMMaxMedium: the payload room of one AM after `nargs` arguments.
    pub fn max_payload(&self, nargs: usize) -> usize {
        self.max_am().saturating_sub(am::encoded_len(nargs, 0))
    }

    pub fn request(
        &mut self,
        dest: u32,
        handler: u8,
        category: Category,
        args: &[u32],
        payload: &[u8],
        offset: u64,
    ) -> Result<(), GasnetError> {
        // Indices name the target's table, which only the target can check (an unregistered
        // one is counted and dropped there); 0 is never valid.
        if handler == 0 {
            return Err(GasnetError::BadHandler(handler));
        }
        if category == Category::Long && into_landing(self.conduit.landing(), offset, payload.len())
        {
            return Err(GasnetError::OutOfSegment(offset, payload.len() as u64));
        }
        let limits = self.limits();
        let mut bytes = std::mem::take(&mut self.spare);
        encode_into(
            handler, category, false, args, payload, offset, limits, &mut bytes,
        )?;
        self.sent += 1;
        let long = (category == Category::Long).then_some(payload);
        let r = self.send_request(dest, &bytes, long);
        self.spare = bytes;
        r
    }

    /// Hands an encoded request to the conduit. No room (credit, send buffers): runs
    /// handlers — replies give credit back, and peers waiting on us need our replies — then
    /// tries again.
    fn send_request(
        &mut self,
        dest: u32,
        bytes: &[u8],
        long: Option<&[u8]>,
    ) -> Result<(), GasnetError> {
        let mut b = super::backoff::Backoff::default();
        while !self.conduit.request(dest, bytes, long)? {
            if self.poll()? {
                b.progressed();
            } else {
                b.idle(self.conduit.as_mut())?;
            }
        }
        Ok(())
    }

    /// Where a Long's `len` bytes at `offset` land here: the segment, or the conduit's
    /// landing area; `None` outside both.
    fn long_area(&mut self, offset: u64, len: usize) -> Option<&mut [u8]> {
        if fits(self.conduit.segment().len(), offset, len as u64) {
            return Some(&mut self.conduit.segment()[offset as usize..offset as usize + len]);
        }
        let (base, n) = self.conduit.landing()?;
        let at = offset.checked_sub(base)?;
        if !fits(n, at, len as u64) {
            return None;
        }
        Some(&mut self.conduit.landing_bytes()[at as usize..at as usize + len])
    }

    /// How many polls found something so far.
    pub(crate) fn delivered(&self) -> u64 {
        self.fruitful_polls
    }

    /// AMPoll: runs the handlers of every arrived message. Returns whether any ran.
    pub fn poll(&mut self) -> Result<bool, GasnetError> {
        let mut inbox = std::mem::take(&mut self.inbox);
        let mut done = std::mem::take(&mut self.rma_done);
        self.conduit.poll(
            &mut |src, reply_to, b| inbox.push((src, reply_to, b)),
            &mut |d| done.push(d),
        )?;
        self.rma_done = done;
        let any = !inbox.is_empty() || !self.rma_done.is_empty();
        self.fruitful_polls += any as u64;
        for (src, reply_to, b) in inbox.drain(..) {
            // Every request is answered — with the handler's reply or the implicit one —
            // and so is what cannot be read, so that its sender's credit comes back.
            let (answer, reply) = self.handle(src, &b);
            self.conduit.recycle(b);
            if answer {
                if reply.is_some() {
                    self.sent += 1;
                }
                // A payload from the segment is read in place (its bounds were checked).
                let seg = self.conduit.segment();
                let (base, seg_len) = (seg.as_ptr(), seg.len());
                let r = reply.as_ref().map(|r| {
                    let long = r.long_payload.as_ref().map(|p| match *p {
                        LongPayload::Owned(ref v) => &v[..],
                        LongPayload::Segment { offset, len } => {
                            assert!(offset + len <= seg_len, "checked by the reply");
                            // SAFETY: inside the segment (checked when the reply was made),
                            // which lives as long as the conduit; only read while the conduit
                            // sends it, as any request's payload from the segment is.
                            unsafe { std::slice::from_raw_parts(base.add(offset), len) }
                        }
                    });
                    (&r.bytes[..], long)
                });
                self.conduit.reply(src, reply_to, r)?;
                if let Some(r) = reply {
                    self.spare = r.bytes;
                }
            }
        }
        self.inbox = inbox;
        Ok(any)
    }

    /// Runs the handler of one message; returns whether it must be answered (a request, or
    /// what cannot be read) and the reply it made. Malformed messages, Longs outside the
    /// segment and unregistered handlers are counted and dropped.
    fn handle(&mut self, src: u32, b: &[u8]) -> (bool, Option<Encoded>) {
        let Some((h, payload)) = am::decode(b) else {
            self.dropped += 1;
            return (true, None);
        };
        let answer = !h.reply;
        let offset = h.offset;
        // A Long's length: its payload's, or for one the conduit placed, the length it names.
        let long_len = match h.in_place {
            true => am::in_place_fields(payload).0 as usize,
            false => payload.len(),
        };
        // The payload lands in the segment (or the landing area) before the handler runs; a
        // handler that looks at it gets a copy, reused, since the token lends the handler the
        // whole segment.
        let mut scratch = std::mem::take(&mut self.long_scratch);
        scratch.clear();
        if h.category == Category::Long {
            let viewed = !self.unviewed[h.handler as usize];
            let Some(area) = self.long_area(offset, long_len) else {
                self.long_scratch = scratch;
                self.dropped += 1;
                return (answer, None);
            };
            if !h.in_place {
                area.copy_from_slice(&payload[..long_len]);
            }
            if viewed {
                scratch.extend_from_slice(area);
            }
        }
        let limits = self.limits();
        let Some(mut handler) = self
            .handlers
            .get_mut(h.handler as usize)
            .and_then(|x| x.take())
        else {
            self.long_scratch = scratch;
            self.dropped += 1;
            return (answer, None);
        };
        let landing = self.conduit.landing();
        let spare = std::mem::take(&mut self.spare);
        let mut token = Token {
            src,
            request: !h.reply,
            reply: None,
            spare,
            segment: self.conduit.segment(),
            limits,
            landing,
        };
        let payload = match h.category {
            Category::Long => &scratch[..],
            _ => payload,
        };
        handler(
            &mut token,
            Msg {
                src,
                category: h.category,
                args: &h.args[..h.nargs as usize],
                payload,
                offset,
            },
        );
        let reply = token.reply.take();
        self.spare = std::mem::take(&mut token.spare);
        self.handlers[h.handler as usize] = Some(handler);
        self.long_scratch = scratch;
        (answer, reply)
    }
}
