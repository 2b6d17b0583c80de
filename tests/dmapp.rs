//! DMAPP (seed 001) through real daemons on two simulated hosts, section by section: §2.2.1
//! init and attributes, §2.2.2 point-to-point RMA, §2.2.3 PE-strided RMA, §2.2.4 AMOs, §2.2.5
//! synchronization, §2.2.6 the symmetric heap, §2.2.7 dynamic registration, §3.2 the FMA/BTE
//! switch; every DMAPP_RC_* error; the same under 10% loss.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use softnic::dmapp::{Dmapp, Rc, RmaAttrs, Routing, SegDesc, SyncId, Type, SEG_DESC_LEN};

const TYPES: [Type; 4] = [Type::Dqw, Type::Qw, Type::Dw, Type::Byte];
/// Transfer sizes in bytes, around the default offload threshold and past 1 MiB.
const BYTES: [usize; 7] = [1, 8, 4095, 4096, 4097, 65536, (1 << 20) + 3];

fn dm() -> Dmapp {
    Dmapp::init(None).expect("dmapp_init").0
}

/// `n` bytes of a pattern, in a buffer aligned for every type (a `u128` vector's bytes).
fn aligned(n: usize, seed: u64) -> (Vec<u128>, usize) {
    let mut v = vec![0u128; n.div_ceil(16)];
    let p = pattern(n, seed);
    bytes_mut(&mut v)[..n].copy_from_slice(&p);
    (v, n)
}

fn bytes_mut(v: &mut [u128]) -> &mut [u8] {
    // SAFETY: plain integers reinterpreted as bytes, same length in bytes.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 16) }
}

fn bytes(v: &[u128]) -> &[u8] {
    // SAFETY: as above, shared.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 16) }
}

#[derive(Clone, Copy, Debug)]
enum Form {
    Blocking,
    Nb,
    Nbi,
}
const FORMS: [Form; 3] = [Form::Blocking, Form::Nb, Form::Nbi];

/// Completes whatever form `f` left pending.
fn sync(d: &mut Dmapp, f: Form, id: Option<SyncId>, what: &str) {
    let r = match f {
        Form::Blocking => {
            assert!(id.is_none());
            Ok(0)
        }
        Form::Nb => d.syncid_wait(id.unwrap()),
        Form::Nbi => d.gsync_wait().map(|_| 0),
    };
    if let Err(e) = r {
        panic!("{what} {f:?}: {e}");
    }
}

// ---------------------------------------------------------------- §2.2.1

fn attrs_body() {
    for bad in [4, 2049] {
        let a = RmaAttrs {
            max_outstanding_nb: bad,
            ..Default::default()
        };
        assert_eq!(Dmapp::init(Some(a)).err().unwrap().rc, Rc::InvalidParam);
    }
    let zero = RmaAttrs {
        max_concurrency: 0,
        ..Default::default()
    };
    assert_eq!(Dmapp::init(Some(zero)).err().unwrap().rc, Rc::InvalidParam);
    let (mut d, actual) = Dmapp::init(None).unwrap();
    assert_eq!(
        actual,
        RmaAttrs {
            max_outstanding_nb: 512,
            offload_threshold: 4096,
            put_relaxed_ordering: Routing::Deterministic,
            get_relaxed_ordering: Routing::Adaptive,
            max_concurrency: 1,
        }
    );
    let ji = d.get_jobinfo();
    assert_eq!(ji.npes, 2);
    assert!(ji.pe < 2);
    // XT_SYMMETRIC_HEAP_SIZE=3M, rounded up to 2 MiB granules.
    assert_eq!(ji.sheap_seg.len, 4 << 20);
    assert_eq!(ji.data_seg.len, softnic::dmapp::DEFAULT_DATA);
    // Static attributes are init only; dynamic ones change.
    let mut a = d.get_rma_attrs();
    a.max_outstanding_nb = 100;
    assert_eq!(d.set_rma_attrs(a).unwrap_err().rc, Rc::InvalidParam);
    let a = RmaAttrs {
        offload_threshold: 64,
        put_relaxed_ordering: Routing::InOrder,
        ..d.get_rma_attrs()
    };
    assert_eq!(d.set_rma_attrs(a).unwrap(), a);
    assert_eq!(d.get_rma_attrs().offload_threshold, 64);
    d.finalize().unwrap();
}

#[test]
fn s221_init_defaults_and_attribute_rules() {
    if in_job() {
        return attrs_body();
    }
    launch_ok_env(
        "s221_init_defaults_and_attribute_rules",
        2,
        2,
        &[],
        &[("XT_SYMMETRIC_HEAP_SIZE", "3M")],
    );
}

#[test]
fn init_without_a_daemon_is_a_resource_error() {
    if in_job() {
        return;
    }
    // This test process is not in a job: no daemon to attach to.
    let e = Dmapp::init(None).err().unwrap();
    assert_eq!(e.rc, Rc::ResourceError, "{e}");
}

// ---------------------------------------------------------------- §2.2.2 contiguous

fn contiguous_body() {
    let mut d = dm();
    let ji = d.get_jobinfo();
    let (me, np) = (ji.pe, ji.npes);
    let (peer, from) = ((me + 1) % np, (me + np - 1) % np);
    let heap = ji.sheap_seg;
    let slot = d.sheap_malloc((1 << 20) + 64).unwrap();
    let src_heap = d.sheap_malloc((1 << 20) + 64).unwrap();
    d.barrier().unwrap();
    let mut round = 0u64;
    for ty in TYPES {
        for &b in &BYTES {
            let n = (b / ty.size()).max(1);
            let nb = n * ty.size();
            let form = FORMS[round as usize % 3];
            let seed = round * 10 + me as u64;
            // From a plain buffer (the registration cache) or from the symmetric heap.
            let (src_vec, _) = aligned(nb, seed);
            let from_heap = round % 2 == 1;
            if from_heap {
                d.local_slice(src_heap, nb)
                    .unwrap()
                    .copy_from_slice(&bytes(&src_vec)[..nb]);
            }
            let hm = d.sheap_region();
            let at = (src_heap - hm.as_ptr() as u64) as usize;
            let src: &[u8] = if from_heap {
                &hm.bytes()[at..at + nb]
            } else {
                &bytes(&src_vec)[..nb]
            };
            let id = match form {
                Form::Blocking => d.put(slot, &heap, peer, src, n as u64, ty).map(|_| None),
                Form::Nb => d.put_nb(slot, &heap, peer, src, n as u64, ty).map(Some),
                Form::Nbi => d
                    .put_nbi(slot, &heap, peer, src, n as u64, ty)
                    .map(|_| None),
            }
            .unwrap_or_else(|e| panic!("{ty:?} {nb} B {form:?}: {e}"));
            sync(&mut d, form, id, &format!("{:?}", line!()));
            d.barrier().unwrap();
            let (want, _) = aligned(nb, round * 10 + from as u64);
            assert!(
                d.local_slice(slot, nb).unwrap() == &bytes(&want)[..nb],
                "{ty:?} {nb} B {form:?}: received put differs"
            );
            // Get it back from the peer (which holds what this PE put) into a plain buffer.
            let (mut back, _) = aligned(nb, 999);
            let tgt = &mut bytes_mut(&mut back)[..nb];
            let id = match form {
                Form::Blocking => d.get(tgt, slot, &heap, peer, n as u64, ty).map(|_| None),
                Form::Nb => d.get_nb(tgt, slot, &heap, peer, n as u64, ty).map(Some),
                Form::Nbi => d
                    .get_nbi(tgt, slot, &heap, peer, n as u64, ty)
                    .map(|_| None),
            }
            .unwrap();
            sync(&mut d, form, id, &format!("{:?}", line!()));
            let (mine, _) = aligned(nb, seed);
            assert!(
                bytes(&back)[..nb] == bytes(&mine)[..nb],
                "{ty:?} {nb} B {form:?}: get differs"
            );
            d.barrier().unwrap();
            round += 1;
        }
    }
    let c = d.counters();
    assert!(c.fma_ops > 0 && c.bte_ops > 0, "{c:?}");
    assert!(c.reg_cache.hits > 0, "plain buffers are found again: {c:?}");
    d.finalize().unwrap();
}

#[test]
fn s222_contiguous_every_type_form_and_size() {
    if in_job() {
        return contiguous_body();
    }
    launch_ok("s222_contiguous_every_type_form_and_size", 2, 2, &[]);
}

// ---------------------------------------------------------------- §2.2.2 strided, indexed

fn strided_body() {
    let mut d = dm();
    let ji = d.get_jobinfo();
    let (me, np) = (ji.pe, ji.npes);
    let (peer, from) = ((me + 1) % np, (me + np - 1) % np);
    let heap = ji.sheap_seg;
    let area = 1000 * 17 * 16 + 64;
    let slot = d.sheap_malloc(area).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    d.barrier().unwrap();
    let mut round = 0u64;
    for ty in TYPES {
        let size = ty.size();
        for stride in [1usize, 2, 17] {
            for n in [1usize, 64, 1000] {
                let form = FORMS[round as usize % 3];
                d.local_slice(slot, area).unwrap().fill(0);
                d.barrier().unwrap();
                // iput: packed source (sst 1) to the peer at target stride `stride`.
                let (src, _) = aligned(n * size, round * 10 + me as u64);
                let src = &bytes(&src)[..n * size];
                let id = match form {
                    Form::Blocking => d
                        .iput(slot, &heap, peer, src, stride as i64, 1, n as u64, ty)
                        .map(|_| None),
                    Form::Nb => d
                        .iput_nb(slot, &heap, peer, src, stride as i64, 1, n as u64, ty)
                        .map(Some),
                    Form::Nbi => d
                        .iput_nbi(slot, &heap, peer, src, stride as i64, 1, n as u64, ty)
                        .map(|_| None),
                }
                .unwrap_or_else(|e| panic!("iput {ty:?} stride {stride} n {n}: {e}"));
                sync(&mut d, form, id, &format!("{:?}", line!()));
                d.barrier().unwrap();
                let (want, _) = aligned(n * size, round * 10 + from as u64);
                let got = d.local_slice(slot, area).unwrap();
                for k in 0..n {
                    let at = k * stride * size;
                    assert_eq!(
                        &got[at..at + size],
                        &bytes(&want)[k * size..(k + 1) * size],
                        "iput {ty:?} stride {stride} n {n} element {k}"
                    );
                    if stride > 1 {
                        let gap = &got[at + size..at + stride * size];
                        assert!(gap.iter().all(|b| *b == 0), "iput wrote between elements");
                    }
                }
                // iget: from the peer at source stride `stride` into target stride 2.
                let mut back = vec![0u128; (2 * n * size).div_ceil(16)];
                let tgt = bytes_mut(&mut back);
                let id = match form {
                    Form::Blocking => d
                        .iget(tgt, slot, &heap, peer, 2, stride as i64, n as u64, ty)
                        .map(|_| None),
                    Form::Nb => d
                        .iget_nb(tgt, slot, &heap, peer, 2, stride as i64, n as u64, ty)
                        .map(Some),
                    Form::Nbi => d
                        .iget_nbi(tgt, slot, &heap, peer, 2, stride as i64, n as u64, ty)
                        .map(|_| None),
                }
                .unwrap();
                sync(&mut d, form, id, &format!("{:?}", line!()));
                let mine = aligned(n * size, round * 10 + me as u64).0;
                for k in 0..n {
                    assert_eq!(
                        &bytes(&back)[2 * k * size..(2 * k + 1) * size],
                        &bytes(&mine)[k * size..(k + 1) * size],
                        "iget {ty:?} stride {stride} n {n} element {k}"
                    );
                }
                d.barrier().unwrap();
                round += 1;
            }
        }
        // Indexed: a random permutation of 300 element slots.
        let n = 300usize;
        let mut idx: Vec<i64> = (0..n as i64).collect();
        idx.shuffle(&mut rng);
        let form = FORMS[round as usize % 3];
        d.local_slice(slot, area).unwrap().fill(0);
        d.barrier().unwrap();
        let (src, _) = aligned(n * size, 500 + me as u64);
        let src = &bytes(&src)[..n * size];
        let id = match form {
            Form::Blocking => d
                .ixput(slot, &heap, peer, src, &idx, n as u64, ty)
                .map(|_| None),
            Form::Nb => d
                .ixput_nb(slot, &heap, peer, src, &idx, n as u64, ty)
                .map(Some),
            Form::Nbi => d
                .ixput_nbi(slot, &heap, peer, src, &idx, n as u64, ty)
                .map(|_| None),
        }
        .unwrap();
        sync(&mut d, form, id, &format!("{:?}", line!()));
        d.barrier().unwrap();
        let (want, _) = aligned(n * size, 500 + from as u64);
        let got = d.local_slice(slot, area).unwrap();
        for (k, &i) in idx.iter().enumerate() {
            let at = i as usize * size;
            assert_eq!(
                &got[at..at + size],
                &bytes(&want)[k * size..(k + 1) * size],
                "ixput {ty:?} element {k}"
            );
        }
        let mut back = vec![0u128; (n * size).div_ceil(16)];
        let tgt = &mut bytes_mut(&mut back)[..n * size];
        if ty == Type::Byte {
            let e = d
                .ixget(tgt, slot, &heap, peer, &idx, n as u64, ty)
                .unwrap_err();
            assert_eq!(e.rc, Rc::NotSupported);
        } else {
            let id = match form {
                Form::Blocking => d
                    .ixget(tgt, slot, &heap, peer, &idx, n as u64, ty)
                    .map(|_| None),
                Form::Nb => d
                    .ixget_nb(tgt, slot, &heap, peer, &idx, n as u64, ty)
                    .map(Some),
                Form::Nbi => d
                    .ixget_nbi(tgt, slot, &heap, peer, &idx, n as u64, ty)
                    .map(|_| None),
            }
            .unwrap();
            sync(&mut d, form, id, &format!("{:?}", line!()));
            let mine = aligned(n * size, 500 + me as u64).0;
            assert_eq!(
                &bytes(&back)[..n * size],
                &bytes(&mine)[..n * size],
                "ixget {ty:?}"
            );
        }
        d.barrier().unwrap();
        round += 1;
    }
    // Strided and indexed transfers always go FMA.
    assert_eq!(d.counters().bte_ops, 0);
    // Stride 0 and a short index list are refused.
    let one = [0u8; 16];
    assert_eq!(
        d.iput(slot, &heap, peer, &one, 0, 1, 1, Type::Qw)
            .unwrap_err()
            .rc,
        Rc::InvalidParam
    );
    assert_eq!(
        d.ixput(slot, &heap, peer, &one, &[0], 2, Type::Qw)
            .unwrap_err()
            .rc,
        Rc::InvalidParam
    );
    // An index that leaves the segment.
    assert_eq!(
        d.ixput(slot, &heap, peer, &one, &[1 << 40], 1, Type::Qw)
            .unwrap_err()
            .rc,
        Rc::TransactionError
    );
    let _ = rng.gen::<u8>();
    d.finalize().unwrap();
}

#[test]
fn s222_strided_and_indexed_every_type_and_form() {
    if in_job() {
        return strided_body();
    }
    launch_ok("s222_strided_and_indexed_every_type_and_form", 2, 2, &[]);
}

// ---------------------------------------------------------------- §2.2.3

fn ixpe_body() {
    let mut d = dm();
    let ji = d.get_jobinfo();
    let (me, np) = (ji.pe, ji.npes);
    let heap = ji.sheap_seg;
    let per = 40usize; // QWs per PE
    let slot = d.sheap_malloc(per * 8 * np as usize).unwrap();
    let all: Vec<u32> = (0..np).collect();
    d.barrier().unwrap();
    for (round, form) in FORMS.into_iter().enumerate() {
        // put_ixpe: PE `round % np` sends the same data to every PE, itself included.
        let root = round as u32 % np;
        let data = pattern(per * 8, 70 + round as u64);
        let (mut src, _) = aligned(per * 8 * np as usize, 0);
        bytes_mut(&mut src)[..per * 8].copy_from_slice(&data);
        if me == root {
            let s = &bytes(&src)[..per * 8];
            let id = match form {
                Form::Blocking => d
                    .put_ixpe(slot, &heap, &all, s, per as u64, Type::Qw)
                    .map(|_| None),
                Form::Nb => d
                    .put_ixpe_nb(slot, &heap, &all, s, per as u64, Type::Qw)
                    .map(Some),
                Form::Nbi => d
                    .put_ixpe_nbi(slot, &heap, &all, s, per as u64, Type::Qw)
                    .map(|_| None),
            }
            .unwrap();
            sync(&mut d, form, id, &format!("{:?}", line!()));
        }
        d.barrier().unwrap();
        assert_eq!(
            d.local_slice(slot, per * 8).unwrap(),
            &data[..],
            "put_ixpe {form:?}"
        );
        d.barrier().unwrap();
        // scatter_ixpe: list entry i (PEs in reverse) gets slice i.
        let rev: Vec<u32> = (0..np).rev().collect();
        let whole = pattern(per * 8 * np as usize, 80 + round as u64);
        bytes_mut(&mut src)[..whole.len()].copy_from_slice(&whole);
        if me == root {
            let s = &bytes(&src)[..whole.len()];
            let id = match form {
                Form::Blocking => d
                    .scatter_ixpe(slot, &heap, &rev, s, per as u64, Type::Qw)
                    .map(|_| None),
                Form::Nb => d
                    .scatter_ixpe_nb(slot, &heap, &rev, s, per as u64, Type::Qw)
                    .map(Some),
                Form::Nbi => d
                    .scatter_ixpe_nbi(slot, &heap, &rev, s, per as u64, Type::Qw)
                    .map(|_| None),
            }
            .unwrap();
            sync(&mut d, form, id, &format!("{:?}", line!()));
        }
        d.barrier().unwrap();
        let i = (np - 1 - me) as usize;
        assert_eq!(
            d.local_slice(slot, per * 8).unwrap(),
            &whole[i * per * 8..(i + 1) * per * 8],
            "scatter_ixpe {form:?}"
        );
        d.barrier().unwrap();
        // gather_ixpe: each PE's own slot, in list (reverse) order.
        let mut got = vec![0u128; per * 8 * np as usize / 16 + 1];
        let tgt = &mut bytes_mut(&mut got)[..per * 8 * np as usize];
        let id = match form {
            Form::Blocking => d
                .gather_ixpe(tgt, slot, &heap, &rev, per as u64, Type::Qw)
                .map(|_| None),
            Form::Nb => d
                .gather_ixpe_nb(tgt, slot, &heap, &rev, per as u64, Type::Qw)
                .map(Some),
            Form::Nbi => d
                .gather_ixpe_nbi(tgt, slot, &heap, &rev, per as u64, Type::Qw)
                .map(|_| None),
        }
        .unwrap();
        sync(&mut d, form, id, &format!("{:?}", line!()));
        for (k, &pe) in rev.iter().enumerate() {
            let j = (np - 1 - pe) as usize;
            assert_eq!(
                &bytes(&got)[k * per * 8..(k + 1) * per * 8],
                &whole[j * per * 8..(j + 1) * per * 8],
                "gather_ixpe {form:?} entry {k}"
            );
        }
        d.barrier().unwrap();
    }
    // A non-symmetric target is refused.
    let mut v = vec![0u64; 64];
    let desc = d.mem_register(v.as_mut_ptr() as u64, 512).unwrap();
    let e = d
        .put_ixpe(desc.addr, &desc, &all, &[0; 8], 1, Type::Qw)
        .unwrap_err();
    assert_eq!(e.rc, Rc::InvalidParam);
    assert_eq!(
        d.put_ixpe(slot, &heap, &[np], &[0; 8], 1, Type::Qw)
            .unwrap_err()
            .rc,
        Rc::InvalidParam,
        "PE beyond the job"
    );
    d.mem_unregister(&desc).unwrap();
    d.finalize().unwrap();
}

#[test]
fn s223_pe_strided_with_the_caller_in_the_list() {
    if in_job() {
        return ixpe_body();
    }
    launch_ok("s223_pe_strided_with_the_caller_in_the_list", 4, 2, &[]);
}

// ---------------------------------------------------------------- §2.2.4

fn amo_body() {
    let mut d = dm();
    let ji = d.get_jobinfo();
    let (me, np) = (ji.pe, ji.npes);
    let heap = ji.sheap_seg;
    let words = d.sheap_malloc(64 * 8 * np as usize + 64).unwrap();
    let result = d.sheap_malloc(64).unwrap();
    d.barrier().unwrap();
    // Every AMO × form on PE 0, each PE on words of its own: the results are exact.
    let w = |i: usize| words + (me as u64 * 64 + i as u64) * 8;
    let mut plain = [0u64; 4];
    for (f, form) in FORMS.into_iter().enumerate() {
        let base = f * 20;
        // Seed: put known values.
        let init: Vec<u64> = (0..20).map(|i| 0xf0f0_0000 + i as u64).collect();
        let b: Vec<u8> = init.iter().flat_map(|v| v.to_le_bytes()).collect();
        d.put(w(base), &heap, 0, &b, 20, Type::Qw).unwrap();
        let mut expect = init.clone();
        let operand = 0x0ff0_1234u64;
        // Non-fetching.
        for (i, op) in ["aadd", "aand", "aor", "axor"].iter().enumerate() {
            let a = w(base + i);
            match (form, *op) {
                (Form::Blocking, "aadd") => d.aadd_qw(a, &heap, 0, operand).unwrap(),
                (Form::Blocking, "aand") => d.aand_qw(a, &heap, 0, operand).unwrap(),
                (Form::Blocking, "aor") => d.aor_qw(a, &heap, 0, operand).unwrap(),
                (Form::Blocking, _) => d.axor_qw(a, &heap, 0, operand).unwrap(),
                (Form::Nb, "aadd") => {
                    let id = d.aadd_qw_nb(a, &heap, 0, operand).unwrap();
                    d.syncid_wait(id).unwrap();
                }
                (Form::Nb, "aand") => {
                    let id = d.aand_qw_nb(a, &heap, 0, operand).unwrap();
                    d.syncid_wait(id).unwrap();
                }
                (Form::Nb, "aor") => {
                    let id = d.aor_qw_nb(a, &heap, 0, operand).unwrap();
                    d.syncid_wait(id).unwrap();
                }
                (Form::Nb, _) => {
                    let id = d.axor_qw_nb(a, &heap, 0, operand).unwrap();
                    d.syncid_wait(id).unwrap();
                }
                (Form::Nbi, "aadd") => d.aadd_qw_nbi(a, &heap, 0, operand).unwrap(),
                (Form::Nbi, "aand") => d.aand_qw_nbi(a, &heap, 0, operand).unwrap(),
                (Form::Nbi, "aor") => d.aor_qw_nbi(a, &heap, 0, operand).unwrap(),
                (Form::Nbi, _) => d.axor_qw_nbi(a, &heap, 0, operand).unwrap(),
            }
            let v = expect[i];
            expect[i] = match *op {
                "aadd" => v.wrapping_add(operand),
                "aand" => v & operand,
                "aor" => v | operand,
                _ => v ^ operand,
            };
        }
        d.gsync_wait().unwrap();
        // Fetching: the old value comes back.
        let fetch_ops = [
            "afadd",
            "afand",
            "afor",
            "afxor",
            "afax",
            "acswap_hit",
            "acswap_miss",
        ];
        for (j, op) in fetch_ops.iter().enumerate() {
            let i = 4 + j;
            let a = w(base + i);
            let old = expect[i];
            let (x, y) = (0x00ff_00ffu64, 0x1111u64);
            let got = match form {
                Form::Blocking => match *op {
                    "afadd" => d.afadd_qw(a, &heap, 0, x),
                    "afand" => d.afand_qw(a, &heap, 0, x),
                    "afor" => d.afor_qw(a, &heap, 0, x),
                    "afxor" => d.afxor_qw(a, &heap, 0, x),
                    "afax" => d.afax_qw(a, &heap, 0, x, y),
                    "acswap_hit" => d.acswap_qw(a, &heap, 0, old, y),
                    _ => d.acswap_qw(a, &heap, 0, old + 1, y),
                }
                .unwrap(),
                Form::Nb => {
                    let id = match *op {
                        "afadd" => d.afadd_qw_nb(a, &heap, 0, x),
                        "afand" => d.afand_qw_nb(a, &heap, 0, x),
                        "afor" => d.afor_qw_nb(a, &heap, 0, x),
                        "afxor" => d.afxor_qw_nb(a, &heap, 0, x),
                        "afax" => d.afax_qw_nb(a, &heap, 0, x, y),
                        "acswap_hit" => d.acswap_qw_nb(a, &heap, 0, old, y),
                        _ => d.acswap_qw_nb(a, &heap, 0, old + 1, y),
                    }
                    .unwrap();
                    d.syncid_wait(id).unwrap()
                }
                Form::Nbi => {
                    // Into the symmetric heap for some, a plain vector's qword for others.
                    let r: &mut u64 = if j % 2 == 0 {
                        let s = d.local_slice(result, 8).unwrap();
                        // SAFETY: 64-aligned heap block, 8 bytes.
                        unsafe { &mut *(s.as_mut_ptr() as *mut u64) }
                    } else {
                        &mut plain[j % 4]
                    };
                    let rp = r as *mut u64;
                    match *op {
                        "afadd" => d.afadd_qw_nbi(r, a, &heap, 0, x),
                        "afand" => d.afand_qw_nbi(r, a, &heap, 0, x),
                        "afor" => d.afor_qw_nbi(r, a, &heap, 0, x),
                        "afxor" => d.afxor_qw_nbi(r, a, &heap, 0, x),
                        "afax" => d.afax_qw_nbi(r, a, &heap, 0, x, y),
                        "acswap_hit" => d.acswap_qw_nbi(r, a, &heap, 0, old, y),
                        _ => d.acswap_qw_nbi(r, a, &heap, 0, old + 1, y),
                    }
                    .unwrap();
                    d.gsync_wait().unwrap();
                    // SAFETY: the qword outlives the call; the NIC wrote it before gsync.
                    unsafe { std::ptr::read_volatile(rp) }
                }
            };
            assert_eq!(got, old, "{op} {form:?} fetched");
            expect[i] = match *op {
                "afadd" => old.wrapping_add(x),
                "afand" => old & x,
                "afor" => old | x,
                "afxor" => old ^ x,
                "afax" => (old & x) ^ y,
                "acswap_hit" => y,
                _ => old,
            };
        }
        let mut back = vec![0u128; 20 * 8 / 16];
        d.get(bytes_mut(&mut back), w(base), &heap, 0, 20, Type::Qw)
            .unwrap();
        let got: Vec<u64> = bytes(&back)
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got[..11], expect[..11], "{form:?}: words after the AMOs");
    }
    d.barrier().unwrap();
    // Every PE × 10,000 aadd_qw_nbi on one word of PE 0: exact.
    let hot = words + 64 * 8 * np as u64;
    for _ in 0..10_000 {
        d.aadd_qw_nbi(hot, &heap, 0, 1).unwrap();
    }
    d.gsync_wait().unwrap();
    d.barrier().unwrap();
    if me == 0 {
        let v = u64::from_le_bytes(d.local_slice(hot, 8).unwrap().try_into().unwrap());
        assert_eq!(v, 10_000 * np as u64);
    }
    d.barrier().unwrap();
    // An ACSWAP lock around a non-atomic read-modify-write.
    let lock = hot + 8;
    let counter = hot + 16;
    for _ in 0..50 {
        while d.acswap_qw(lock, &heap, 0, 0, me as u64 + 1).unwrap() != 0 {}
        let mut b = [0u128; 1];
        d.get(&mut bytes_mut(&mut b)[..8], counter, &heap, 0, 1, Type::Qw)
            .unwrap();
        let v = u64::from_le_bytes(bytes(&b)[..8].try_into().unwrap()) + 1;
        d.put(counter, &heap, 0, &v.to_le_bytes(), 1, Type::Qw)
            .unwrap();
        assert_eq!(
            d.acswap_qw(lock, &heap, 0, me as u64 + 1, 0).unwrap(),
            me as u64 + 1
        );
    }
    d.barrier().unwrap();
    if me == 0 {
        let v = u64::from_le_bytes(d.local_slice(counter, 8).unwrap().try_into().unwrap());
        assert_eq!(v, 50 * np as u64);
    }
    // A misaligned AMO word.
    assert_eq!(
        d.aadd_qw(hot + 4, &heap, 0, 1).unwrap_err().rc,
        Rc::AlignmentError
    );
    d.finalize().unwrap();
}

#[test]
fn s224_every_amo_and_form_and_exact_counts() {
    if in_job() {
        return amo_body();
    }
    launch_ok("s224_every_amo_and_form_and_exact_counts", 4, 2, &[]);
}

#[test]
fn s224_amos_with_eight_pes() {
    if in_job() {
        return amo_body();
    }
    launch_ok("s224_amos_with_eight_pes", 8, 2, &[]);
}

// ---------------------------------------------------------------- §2.2.5

fn sync_body() {
    let attrs = RmaAttrs {
        max_outstanding_nb: 5,
        ..Default::default()
    };
    let (mut d, _) = Dmapp::init(Some(attrs)).unwrap();
    let ji = d.get_jobinfo();
    let (me, np) = (ji.pe, ji.npes);
    let peer = (me + 1) % np;
    let heap = ji.sheap_seg;
    let big = 4 << 20;
    let slot = d.sheap_malloc(big).unwrap();
    d.barrier().unwrap();
    // NO_SPACE once max_outstanding_nb sync ids are unretired; retiring one makes room.
    let ids: Vec<SyncId> = (0..5)
        .map(|i| {
            d.put_nb(slot + i * 8, &heap, peer, &[1; 8], 1, Type::Qw)
                .unwrap()
        })
        .collect();
    let e = d
        .put_nb(slot, &heap, peer, &[1; 8], 1, Type::Qw)
        .unwrap_err();
    assert_eq!(e.rc, Rc::NoSpace, "{e}");
    assert_eq!(
        d.afadd_qw_nb(slot, &heap, peer, 1).unwrap_err().rc,
        Rc::NoSpace,
        "AMOs count too"
    );
    // gsync retires no sync id: each is still waited on, exactly once.
    d.gsync_wait().unwrap();
    assert_eq!(
        d.put_nb(slot, &heap, peer, &[1; 8], 1, Type::Qw)
            .unwrap_err()
            .rc,
        Rc::NoSpace
    );
    for id in &ids {
        d.syncid_wait(*id).unwrap();
    }
    assert_eq!(
        d.syncid_wait(ids[0]).unwrap_err().rc,
        Rc::InvalidParam,
        "retired"
    );
    // A pending test is NOT_DONE: a 4 MiB get from another host cannot have finished yet.
    let mut landing = vec![0u8; big];
    let id = d
        .get_nb(&mut landing, slot, &heap, peer, big as u64, Type::Byte)
        .unwrap();
    let first = d.syncid_test(id).unwrap_err();
    assert_eq!(first.rc, Rc::NotDone);
    let t = Instant::now();
    loop {
        match d.syncid_test(id) {
            Ok(_) => break,
            Err(e) if e.is_not_done() => assert!(t.elapsed() < Duration::from_secs(30)),
            Err(e) => panic!("{e}"),
        }
    }
    // BUSY: a registered buffer a get is landing in cannot be unregistered until it is synced;
    // nor can a heap block being read into be freed or resized.
    let mut landing = vec![0u8; big];
    let desc = d.mem_register(landing.as_ptr() as u64, big as u64).unwrap();
    let id = d
        .get_nb(&mut landing, slot, &heap, peer, big as u64, Type::Byte)
        .unwrap();
    assert_eq!(d.mem_unregister(&desc).unwrap_err().rc, Rc::Busy);
    d.syncid_wait(id).unwrap();
    d.mem_unregister(&desc).unwrap();
    let block = d.sheap_malloc(big).unwrap();
    let hm = d.sheap_region();
    let at = (block - hm.as_ptr() as u64) as usize;
    let id = d
        .get_nb(
            &mut hm.bytes()[at..at + big],
            slot,
            &heap,
            peer,
            big as u64,
            Type::Byte,
        )
        .unwrap();
    assert_eq!(d.sheap_free(block).unwrap_err().rc, Rc::Busy);
    assert_eq!(d.sheap_realloc(block, 64).unwrap_err().rc, Rc::Busy);
    d.syncid_wait(id).unwrap();
    d.sheap_free(block).unwrap();
    d.gsync_test().unwrap();
    // A failed implicit operation is reported once, at the next gsync.
    let bogus = SegDesc {
        handle: 4000,
        ..heap
    };
    d.put_nbi(slot, &bogus, peer, &[1; 8], 1, Type::Qw).unwrap();
    d.put_nbi(slot, &heap, peer, &[1; 8], 1, Type::Qw).unwrap();
    assert_eq!(d.gsync_wait().unwrap_err().rc, Rc::PermissionError);
    d.gsync_wait().unwrap();
    // §3.2: contiguous transfers below the offload threshold go FMA, from it BTE.
    let (f0, b0) = (d.counters().fma_ops, d.counters().bte_ops);
    let src = vec![3u8; 8192];
    d.put(slot, &heap, peer, &src[..4095], 4095, Type::Byte)
        .unwrap();
    assert_eq!((d.counters().fma_ops, d.counters().bte_ops), (f0 + 1, b0));
    d.put(slot, &heap, peer, &src[..4096], 4096, Type::Byte)
        .unwrap();
    assert_eq!(
        (d.counters().fma_ops, d.counters().bte_ops),
        (f0 + 1, b0 + 1)
    );
    let a = RmaAttrs {
        offload_threshold: 8192,
        ..d.get_rma_attrs()
    };
    d.set_rma_attrs(a).unwrap();
    d.put(slot, &heap, peer, &src[..4096], 4096, Type::Byte)
        .unwrap();
    let mut back = vec![0u8; 4096];
    d.get(&mut back, slot, &heap, peer, 4096, Type::Byte)
        .unwrap();
    assert_eq!(back, src[..4096]);
    assert_eq!(
        d.counters().fma_ops,
        f0 + 3,
        "the flipped threshold applies to later requests"
    );
    d.finalize().unwrap();
}

#[test]
fn s225_sync_rules_busy_and_the_offload_threshold() {
    if in_job() {
        return sync_body();
    }
    launch_ok("s225_sync_rules_busy_and_the_offload_threshold", 2, 2, &[]);
}

// ---------------------------------------------------------------- §2.2.6, §2.2.7

fn memory_body() {
    let mut d = dm();
    let ji = d.get_jobinfo();
    let (me, np) = (ji.pe, ji.npes);
    let peer = (me + 1) % np;
    let from = (me + np - 1) % np;
    let heap = ji.sheap_seg;
    let base = heap.addr;
    // The same calls give the same offsets on every PE: each sends its offsets to PE 0.
    let table = d.sheap_malloc(64 * np as usize).unwrap();
    let a = d.sheap_malloc(100).unwrap();
    let b = d.sheap_malloc(5000).unwrap();
    d.sheap_free(a).unwrap();
    let c = d.sheap_malloc(64).unwrap();
    let offs: Vec<u8> = [a, b, c]
        .iter()
        .flat_map(|x| (x - base).to_le_bytes())
        .collect();
    d.put(table + me as u64 * 24, &heap, 0, &offs, 3, Type::Qw)
        .unwrap();
    d.barrier().unwrap();
    if me == 0 {
        let t = d.local_slice(table, 24 * np as usize).unwrap().to_vec();
        for pe in 1..np as usize {
            assert_eq!(t[pe * 24..pe * 24 + 24], t[..24], "PE {pe}'s heap offsets");
        }
    }
    // realloc keeps the contents, and the moved block is symmetric too.
    let data = pattern(5000, me as u64);
    d.local_slice(b, 5000).unwrap().copy_from_slice(&data);
    let b2 = d.sheap_realloc(b, 1 << 20).unwrap();
    assert_eq!(d.local_slice(b2, 5000).unwrap(), &data[..]);
    d.barrier().unwrap();
    d.put(b2 + 8192, &heap, peer, &data, 5000, Type::Byte)
        .unwrap();
    d.barrier().unwrap();
    assert_eq!(
        d.local_slice(b2 + 8192, 5000).unwrap(),
        &pattern(5000, from as u64)[..]
    );
    // Heap exhausted: RESOURCE_ERROR; freeing what is no block: INVALID_PARAM.
    assert_eq!(d.sheap_malloc(1 << 40).unwrap_err().rc, Rc::ResourceError);
    assert_eq!(d.sheap_free(b2 + 8).unwrap_err().rc, Rc::InvalidParam);
    // §2.2.7: a plain vector registered and its descriptor sent out of band (here through
    // the peer's heap); the peer puts, gets and adds into it.
    let mut v = vec![0u64; 2048];
    let desc = d
        .mem_register(v.as_mut_ptr() as u64, (v.len() * 8) as u64)
        .unwrap();
    assert_eq!(desc.addr % 4096, 0, "page-rounded");
    let again = d.mem_register(v.as_mut_ptr() as u64, 64).unwrap();
    assert_eq!(again, desc);
    assert!(d.counters().reg_cache.hits >= 1);
    let mailbox = d.sheap_malloc(SEG_DESC_LEN).unwrap();
    d.barrier().unwrap();
    d.put(
        mailbox,
        &heap,
        peer,
        &desc.to_bytes(),
        SEG_DESC_LEN as u64,
        Type::Byte,
    )
    .unwrap();
    d.barrier().unwrap();
    let theirs = SegDesc::from_bytes(d.local_slice(mailbox, SEG_DESC_LEN).unwrap()).unwrap();
    // The descriptor names the registration (page-rounded); the owner sends the vector's own
    // address as well, as a SHMEM layer would send its object's address.
    let vaddr = v.as_ptr() as u64;
    let abox = d.sheap_malloc(8).unwrap();
    d.barrier().unwrap();
    d.put(abox, &heap, peer, &vaddr.to_le_bytes(), 1, Type::Qw)
        .unwrap();
    d.barrier().unwrap();
    let their_v = u64::from_le_bytes(d.local_slice(abox, 8).unwrap().try_into().unwrap());
    let words: Vec<u8> = (0..16u64).flat_map(|i| (1000 + i).to_le_bytes()).collect();
    d.put(their_v + 80, &theirs, peer, &words, 16, Type::Qw)
        .unwrap();
    d.aadd_qw(their_v, &theirs, peer, 7).unwrap();
    assert_eq!(d.afadd_qw(their_v, &theirs, peer, 1).unwrap(), 7);
    let mut back = [0u8; 128];
    d.get(&mut back, their_v + 80, &theirs, peer, 16, Type::Qw)
        .unwrap();
    assert_eq!(&back[..], &words[..]);
    // Outside the registration: TRANSACTION_ERROR; garbage bytes: INVALID_PARAM.
    assert_eq!(
        d.put(theirs.addr + theirs.len, &theirs, peer, &words, 1, Type::Qw)
            .unwrap_err()
            .rc,
        Rc::TransactionError
    );
    assert_eq!(
        SegDesc::from_bytes(&[7u8; SEG_DESC_LEN]).unwrap_err().rc,
        Rc::InvalidParam
    );
    assert_eq!(
        SegDesc::from_bytes(&desc.to_bytes()[..20]).unwrap_err().rc,
        Rc::InvalidParam
    );
    d.barrier().unwrap();
    assert_eq!(v[0], 8, "the peer's AMOs landed in the plain vector");
    assert_eq!(v[10..26], (1000..1016).collect::<Vec<u64>>()[..]);
    // Unregister (twice: it was registered twice), then the peer's access is refused.
    d.mem_unregister(&desc).unwrap();
    d.mem_unregister(&desc).unwrap();
    assert_eq!(d.mem_unregister(&desc).unwrap_err().rc, Rc::NotFound);
    d.barrier().unwrap();
    assert_eq!(
        d.aadd_qw(their_v, &theirs, peer, 1).unwrap_err().rc,
        Rc::PermissionError
    );
    // A forged descriptor naming no registration: PERMISSION_ERROR; a PE beyond the job:
    // INVALID_PARAM; misaligned QW: ALIGNMENT_ERROR. None of it disturbs the next barrier.
    let forged = SegDesc {
        handle: 9999,
        ..theirs
    };
    assert_eq!(
        d.get(&mut back, theirs.addr, &forged, peer, 1, Type::Qw)
            .unwrap_err()
            .rc,
        Rc::PermissionError
    );
    assert_eq!(
        d.put(b2, &heap, np, &words, 1, Type::Qw).unwrap_err().rc,
        Rc::InvalidParam
    );
    assert_eq!(
        d.put(b2 + 2, &heap, peer, &words, 1, Type::Qw)
            .unwrap_err()
            .rc,
        Rc::AlignmentError
    );
    assert_eq!(
        d.get(&mut back, b2, &heap, peer, 0, Type::Qw)
            .unwrap_err()
            .rc,
        Rc::InvalidParam,
        "zero-length get"
    );
    assert_eq!(
        d.put(b2, &heap, peer, &words[..8], 2, Type::Qw)
            .unwrap_err()
            .rc,
        Rc::InvalidParam,
        "nelems beyond the slice"
    );
    d.barrier().unwrap();
    d.finalize().unwrap();
}

#[test]
fn s226_s227_symmetric_heap_registration_and_descriptors() {
    if in_job() {
        return memory_body();
    }
    launch_ok(
        "s226_s227_symmetric_heap_registration_and_descriptors",
        2,
        2,
        &[],
    );
}

// ---------------------------------------------------------------- faults

const LOSS: &[&str] = &["--fault-drop", "0.1", "--fault-seed", "11"];

#[test]
fn contiguous_at_ten_percent_loss() {
    if in_job() {
        return contiguous_body();
    }
    launch_ok("contiguous_at_ten_percent_loss", 2, 2, LOSS);
}

#[test]
fn strided_at_ten_percent_loss() {
    if in_job() {
        return strided_body();
    }
    launch_ok("strided_at_ten_percent_loss", 2, 2, LOSS);
}

#[test]
fn amos_at_ten_percent_loss() {
    if in_job() {
        return amo_body();
    }
    launch_ok("amos_at_ten_percent_loss", 4, 2, LOSS);
}

#[test]
fn a_killed_pe_is_a_transaction_error() {
    if in_job() {
        let mut d = dm();
        let heap = d.get_jobinfo().sheap_seg;
        let w = d.sheap_malloc(64).unwrap();
        d.barrier().unwrap();
        if d.get_jobinfo().pe == 1 {
            // The victim waits to be SIGKILLed.
            loop {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let t = Instant::now();
        loop {
            match d.afadd_qw(w, &heap, 1, 1) {
                Ok(_) => assert!(
                    t.elapsed() < Duration::from_secs(60),
                    "PE 1 never went away"
                ),
                Err(e) => {
                    assert_eq!(e.rc, Rc::TransactionError, "{e}");
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // The survivor goes on with its own memory.
        d.aadd_qw(w, &heap, 0, 1).unwrap();
        return;
    }
    let daemons = Daemons::start(2);
    let (job, key) = (5151, 77);
    let mut ranks: Vec<_> = (0..2)
        .map(|r| daemons.spawn_rank("a_killed_pe_is_a_transaction_error", r, 2, job, key))
        .collect();
    std::thread::sleep(Duration::from_millis(1000));
    let mut victim = ranks.pop().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&victim),
        rustix::process::Signal::Kill,
    )
    .unwrap();
    victim.wait().unwrap();
    assert!(
        ranks[0].wait().unwrap().success(),
        "the surviving PE failed"
    );
}
