//! am_hello: GASNet Active Messages. Every node sends an AMRequestShort to every other node
//! carrying its node number; the handler at the target answers with an AMReplyShort carrying
//! the target's number; each node waits for all its replies. Node 0 prints
//! `am_hello ok N nodes (conduit C)`.
//!
//! ```sh
//! cargo build --release --examples
//! target/release/softnic run -n 4 --conduit portals -- target/release/examples/am_hello
//! ```

use std::cell::RefCell;
use std::rc::Rc;

use anyhow::{bail, Context};
use softnic::gasnet::{Gasnet, Handler, Msg, Token};

const HELLO: u8 = 201;
const ANSWER: u8 = 202;

fn main() -> anyhow::Result<()> {
    let heard: Rc<RefCell<Vec<(u32, u32)>>> = Rc::default();
    let answers: Rc<RefCell<Vec<u32>>> = Rc::default();
    let h = heard.clone();
    let hello: Handler = Box::new(move |t: &mut Token<'_>, m: Msg<'_>| {
        h.borrow_mut().push((m.src, m.args[0]));
        let _ = t.reply_short(ANSWER, &[m.args[0]]);
    });
    let a = answers.clone();
    let answer: Handler = Box::new(move |_t: &mut Token<'_>, m: Msg<'_>| {
        a.borrow_mut().push(m.src);
    });
    let mut g = Gasnet::init(vec![(HELLO, hello), (ANSWER, answer)])
        .context("attaching GASNet (is this under `softnic run`?)")?;
    let (me, n) = (g.mynode(), g.nodes());
    for peer in (0..n).filter(|&p| p != me) {
        g.am_request_short(peer, HELLO, &[me])?;
    }
    let a = answers.clone();
    g.block_until(|| a.borrow().len() + 1 >= n as usize)?;
    g.barrier()?;
    let mut from: Vec<u32> = answers.borrow().clone();
    from.sort();
    let expected: Vec<u32> = (0..n).filter(|&p| p != me).collect();
    if from != expected {
        bail!("node {me}: answers from {from:?}, expected {expected:?}");
    }
    if heard.borrow().iter().any(|&(src, arg)| src != arg) {
        bail!(
            "node {me}: a hello's argument did not name its sender: {:?}",
            heard.borrow()
        );
    }
    if me == 0 {
        println!("am_hello ok {n} nodes (conduit {})", g.conduit_name());
    }
    Ok(())
}
