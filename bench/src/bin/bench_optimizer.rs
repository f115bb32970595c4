//! Optimizer apply throughput against a plain `a = b + s*c` pass over the same
//! amount of memory, measured in the same run, interleaved call by call.
//!
//! ```sh
//! cargo run --release -p oar-bench --bin bench_optimizer
//! cargo run --release -p oar-bench --bin bench_optimizer -- --n 16777216 --reps 9
//! ```
//!
//! Options: `--n N` elements per block (default 64M = 67108864 float32, 256 MiB
//! per array), `--reps R` timed repetitions (default 7, at least 5; one extra
//! untimed warm-up round runs first).
//!
//! Byte accounting, "bytes read + bytes written" per element (4 B per f32):
//!
//! | pass                        | arrays                      | B/elem |
//! |-----------------------------|-----------------------------|--------|
//! | reference `a = b + s*c`     | b r, c r, a w               | 12     |
//! | `Sgd`                       | g r, p rw                   | 12     |
//! | `Momentum`                  | g r, p rw, v rw             | 20     |
//! | `AdaGrad`                   | g r, p rw, h rw             | 20     |
//! | `Adam`                      | g r, p rw, m rw, v rw       | 28     |
//!
//! GB/s is that count over the wall time of one call (1 GB = 1e9 B). The
//! write-allocate read that a plain store to `a` costs on x86 is not counted
//! (the reference moves 16 B/elem on the bus but is credited 12); the
//! optimizers write only lines they have just read, so their count is their
//! traffic. The ratio printed is an optimizer's median GB/s over the
//! reference's median GB/s; targets: SGD >= 0.8, Adam >= 0.5 (momentum and
//! AdaGrad informational). "paired" is the median of the per-round ratios
//! against the reference call made just before, which is steadier under load.
//!
//! Every array is written before timing, so page faults
//! stay outside the timed region. The number of running `rustc` processes and
//! the load average are printed before and after, because the figures are only
//! meaningful on an otherwise idle machine.

use oar_bench::pserver as common;

use std::hint::black_box;
use std::time::Instant;

use oar_pserver::{AdaGrad, Adam, Momentum, Optimizer, OptimizerState, Sgd};

/// The plain pass the optimizers are compared with.
#[inline(never)]
fn reference(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    for ((a, &b), &c) in a.iter_mut().zip(b).zip(c) {
        *a = b + s * c;
    }
}

/// Deterministic values in `[-1, -0.5] U [0.5, 1]`: no zeros, no denormals in
/// the optimizers' squares.
fn fill(x: &mut [f32], seed: u64) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for v in x {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let u = (s >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
        let mag = 0.5 + 0.5 * u;
        *v = if s & 1 == 0 { mag } else { -mag };
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

fn time<F: FnOnce()>(f: F) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

struct Case {
    opt: Box<dyn Optimizer>,
    bytes_per_elem: f64,
    target: Option<f64>,
    state: OptimizerState,
    t1: Vec<f64>,
    paired1: Vec<f64>,
}

fn usage() -> ! {
    eprintln!("usage: bench_optimizer [--n N] [--reps R (>= 5)]");
    std::process::exit(2)
}

fn main() {
    let (mut n, mut reps) = (64usize << 20, 7usize);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = || args.next().and_then(|v| v.parse::<usize>().ok()).unwrap_or_else(|| usage());
        match a.as_str() {
            "--n" => n = num(),
            "--reps" => reps = num(),
            _ => usage(),
        }
    }
    if reps < 5 || n < 2 {
        usage();
    }
    let (mut a, mut b, mut c) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
    fill(&mut a, 1);
    fill(&mut b, 2);
    fill(&mut c, 3);
    fill(&mut p, 4);
    fill(&mut g, 5);
    let s = 0.5f32;

    let opts: Vec<(Box<dyn Optimizer>, f64, Option<f64>)> = vec![
        (Box::new(Sgd { lr: 1e-3 }), 12.0, Some(0.8)),
        (Box::new(Momentum { lr: 1e-3, momentum: 0.9 }), 20.0, None),
        (Box::new(AdaGrad { lr: 1e-3, eps: 1e-10 }), 20.0, None),
        (Box::new(Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8 }), 28.0, Some(0.5)),
    ];
    let mut cases: Vec<Case> = opts
        .into_iter()
        .map(|(opt, bytes_per_elem, target)| {
            // Fresh state, then written over with a small positive value (valid
            // for every slot: v, h and Adam's m and v) so its pages are faulted
            // in before timing (a zeroed Vec is mapped lazily).
            let mut state = opt.new_state(n);
            state.slots.iter_mut().for_each(|x| *x = 1e-3);
            Case { opt, bytes_per_elem, target, state, t1: vec![], paired1: vec![] }
        })
        .collect();

    println!("bench_optimizer: N = {n} float32 ({} MiB per array), {reps} reps + 1 warm-up", (n * 4) >> 20);
    println!("before: {}", common::machine_load());

    let mut r1 = Vec::new();
    for rep in 0..=reps {
        let warm = rep == 0;
        for cs in cases.iter_mut() {
            let tr = time(|| reference(black_box(&mut a), black_box(&b), black_box(&c), black_box(s)));
            black_box(&a);
            let to = time(|| cs.opt.apply(black_box(&mut p), black_box(&g), black_box(&mut cs.state)));
            black_box(&p);
            if !warm {
                r1.push(tr);
                cs.t1.push(to);
                cs.paired1.push((cs.bytes_per_elem / to) / (12.0 / tr));
            }
        }
    }
    println!("after:  {}", common::machine_load());
    // Sanity: the arrays still hold finite numbers.
    let finite = p.iter().chain(&a).all(|x| x.is_finite())
        && cases.iter().all(|cs| cs.state.slots.iter().all(|x| x.is_finite()));
    println!("values finite: {finite}");

    let gbs = |bytes_per_elem: f64, t: f64| bytes_per_elem * n as f64 / t / 1e9;
    let ref1 = gbs(12.0, median(&r1));
    println!();
    println!("1 thread                   B/elem  median GB/s  ratio  paired  target");
    println!("{:<26} {:>6}  {:>11.2}  {:>5.2}  {:>6}", "reference a = b + s*c", 12, ref1, 1.0, "");
    for cs in &cases {
        let v = gbs(cs.bytes_per_elem, median(&cs.t1));
        let ratio = v / ref1;
        let verdict = match cs.target {
            Some(t) if ratio >= t => format!(">= {t:.1} PASS"),
            Some(t) => format!(">= {t:.1} MISS"),
            None => "(info)".into(),
        };
        println!(
            "{:<26} {:>6}  {:>11.2}  {:>5.2}  {:>6.2}  {verdict}",
            cs.opt.name(),
            cs.bytes_per_elem,
            v,
            ratio,
            median(&cs.paired1)
        );
    }
}
