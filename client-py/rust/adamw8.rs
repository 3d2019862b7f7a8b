//! An AdamW step with 8-bit block-wise quantized moments, on the CPU, over tensors handed by
//! address: the optimizer of trainers that keep their weights and the moments in host memory
//! and step each layer there while the GPU computes. Per parameter: the parameter itself (an
//! fp32 master, 4 bytes, or the bf16 working weight updated in place, 2 bytes), `m` as int8 and
//! `sqrt(v)` as uint8 (1 byte each), one fp32 scale of each per block of [`BLOCK`] parameters. The Python API, and a torch implementation of the same
//! formula that this kernel matches bit for bit, are in `weightstream.torch.adamw8`.
//!
//! # The formula
//! Every operation below is one IEEE-754 binary32 operation (one rounding to nearest-even), in
//! this order; there is no fused multiply-add anywhere (Rust never contracts `a * b + c`).
//! The constants are computed once per call in binary64 from the caller's values, then rounded
//! to binary32 (`f32(x)`), as torch rounds a Python scalar applied to a float32 tensor:
//!
//! ```text
//! decay     = f32(1 - lr * weight_decay)
//! b1, b2    = f32(beta1), f32(beta2)
//! c1, c2    = f32(1 - beta1), f32(1 - beta2)
//! step_size = f32(lr / (1 - beta1 ** step))            (** is the C library's pow)
//! inv_bc2   = f32(1 / sqrt(1 - beta2 ** step))
//! eps, gs   = f32(eps), f32(grad_scale)
//! ```
//!
//! The tensor is cut into blocks of 256 elements (the last one may be shorter); block `b`
//! holds `qm[i]` (int8), `qv[i]` (uint8), `sm[b]` (the absolute maximum of its `m`) and `sv[b]`
//! (the maximum of its `sqrt(v)`). The codes are 8-bit floating-point numbers scaled to the
//! block's maximum, of 4 exponent bits and `M` mantissa bits, whose relative precision does not
//! fall with the magnitude (a linear code keeps 1 or 2 significant bits of a moment 1/100 of its
//! block's largest, and rounds it back to the same code step after step):
//!
//! ```text
//! F_M(c) = c * 2^-(14+M)                    for c < 2^M (evenly spaced below 2^-14)
//!        = 2^(e-15) * (1 + f / 2^M)         else, e = c >> M, f = c mod 2^M
//! TOP_M  = F_M(2^(4+M) - 1) = 2 - 2^-M
//! E_M(y) = the c whose F_M(c) is nearest to min(y, TOP_M) (ties: the even c), 0 for NaN
//! ```
//!
//! `m` has `M = 3` and a sign (`qm = ±c`, in [-127, 127]; 6% precision, down to 4e-6 of the
//! block's maximum), `sqrt(v)` has `M = 4` (`qv = c`, in [0, 255]; 3%, down to 2e-6). For each
//! element `i` of block `b`:
//!
//! ```text
//! g  = f32(grad[i]) * gs                     (bf16 to f32 is exact)
//! m  = ±F_3(|qm[i]|) * (sm[b] / 1.875)       (qm[i]'s sign; sm[b] / 1.875 and sv[b] / 1.9375:
//! r  = F_4(qv[i]) * (sv[b] / 1.9375)          once per block; F is exact)
//! v  = r * r
//! m  = m * b1 + g * c1
//! v  = v * b2 + (g * g) * c2
//! r  = sqrt(v)
//! p  = f32(p[i]) * decay                     (a bf16 parameter: exact)
//! p  = p - (m / (r * inv_bc2 + eps)) * step_size
//! ```
//!
//! then, over the block, `sm' = max |m|` and `sv' = max r`; `km = 1.875 / sm'` and
//! `kv = 1.9375 / sv'` (once per block; 0 where the maximum is 0 or not finite), and
//!
//! ```text
//! qm[i] = sign(m) * E_3(|m| * km)
//! qv[i] = max(E_4(r * kv), 1 if qm[i] != 0 else 0)
//! w[i]  = bf16(p)                            (round to nearest-even, as torch's .to(bfloat16))
//! ```
//!
//! `p` is stored back (a bf16 parameter: `bf16(p)`, rounded as `w`; then there is no `w`),
//! `sm[b] = sm'`, `sv[b] = sv'` (NaN where not finite, below). This is
//! AdamW as `torch.optim.AdamW` computes it (decoupled weight decay first, bias corrections,
//! `eps` added after the corrected `sqrt(v)`), with the moments read from and written to their
//! 8-bit form, and the correction of `v` applied as a product with its reciprocal (`inv_bc2`)
//! rather than a division. The floor of `qv` keeps a nonzero `m` from meeting a zero `sqrt(v)`
//! (an update of `m / eps`).
//!
//! # NaN and infinity
//! A non-finite gradient is not skipped (a trainer that scales its loss checks for overflow
//! and skips the step, as `torch.amp.GradScaler` does). A block whose new `m` (or `r`) holds a
//! NaN or an infinity stores `sm' = NaN` (or `sv' = NaN`) and codes 0 (`qv`: 0 or its floor):
//! every later step then reads NaN moments for that block, and its parameters become NaN, as a
//! NaN gradient makes them in fp32 AdamW. A NaN parameter gives a NaN `w` (of unspecified
//! bits). A block whose maximum is a subnormal float32 below about 5.5e-39 has an infinite
//! `km` (`kv`): its nonzero elements get the largest code, its zeros 0. `g * g` overflows
//! (to a non-finite block) for gradients above about 1.8e19.
//!
//! # Memory and threads
//! The call reads and writes each element once (16 bytes for an fp32 parameter, a bf16
//! gradient and `w`; 8 for a bf16 parameter and gradient): it
//! runs on rayon's global pool (`RAYON_NUM_THREADS` sets its size), with the GIL released, in
//! chunks of at most [`GRAIN_BLOCKS`] blocks; the code of each chunk is compiled for AVX-512
//! and AVX2 besides the baseline and picked at run time (the results are the same bits: all
//! three are the same IEEE operations). rayon's threads do not survive `fork()`: a forked
//! child must not call the step (DataLoader workers do not).
#![allow(unsafe_code)]

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Elements per block: each block has its own pair of scales.
pub(crate) const BLOCK: usize = 256;
/// Blocks a rayon task steps on its own (16384 elements, about 256 KiB of traffic).
const GRAIN_BLOCKS: usize = 64;

/// The hyper-parameters of one step, as the caller gives them (binary64).
#[derive(Clone, Copy, Debug)]
pub(crate) struct HyperParams {
    pub step: i64,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub grad_scale: f64,
}

/// The binary32 constants of one step (see the module's formula).
#[derive(Clone, Copy, Debug)]
struct Constants {
    decay: f32,
    b1: f32,
    c1: f32,
    b2: f32,
    c2: f32,
    step_size: f32,
    inv_bc2: f32,
    eps: f32,
    gs: f32,
}

impl HyperParams {
    /// The constants, or why the values are out of range (naming the argument and its limit).
    fn constants(&self) -> Result<Constants, String> {
        let HyperParams {
            step,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            grad_scale,
        } = *self;
        if step < 1 {
            return Err(format!(
                "step must be >= 1 (1 for the first step), got {step}"
            ));
        }
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(format!("lr must be finite and >= 0, got {lr}"));
        }
        for (name, beta) in [("beta1", beta1), ("beta2", beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(format!("{name} must be in [0, 1), got {beta}"));
            }
        }
        if !(eps.is_finite() && eps > 0.0) {
            return Err(format!(
                "eps must be finite and > 0 (8-bit sqrt(v) rounds small values to 0), got {eps}"
            ));
        }
        if !(weight_decay.is_finite() && weight_decay >= 0.0) {
            return Err(format!(
                "weight_decay must be finite and >= 0, got {weight_decay}"
            ));
        }
        if !(grad_scale.is_finite() && grad_scale >= 0.0) {
            return Err(format!(
                "grad_scale must be finite and >= 0, got {grad_scale}"
            ));
        }
        let t = step as f64;
        let c = Constants {
            decay: (1.0 - lr * weight_decay) as f32,
            b1: beta1 as f32,
            c1: (1.0 - beta1) as f32,
            b2: beta2 as f32,
            c2: (1.0 - beta2) as f32,
            step_size: (lr / (1.0 - beta1.powf(t))) as f32,
            inv_bc2: (1.0 / (1.0 - beta2.powf(t)).sqrt()) as f32,
            eps: eps as f32,
            gs: grad_scale as f32,
        };
        for (name, value) in [
            ("1 - lr * weight_decay", c.decay),
            ("lr / (1 - beta1 ** step)", c.step_size),
            ("1 / sqrt(1 - beta2 ** step)", c.inv_bc2),
            ("eps", c.eps),
            ("grad_scale", c.gs),
        ] {
            if !value.is_finite() {
                return Err(format!("{name} overflows float32 (its limit is 3.4e38)"));
            }
        }
        Ok(c)
    }
}

/// A gradient element: converted to binary32 exactly.
trait Grad: Copy + Send + Sync {
    fn to_f32(self) -> f32;
}

impl Grad for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

/// A parameter element: read as binary32 exactly ([`Grad::to_f32`]), written back from the
/// step's binary32 result (rounded to nearest-even where the type is narrower).
trait Param: Grad {
    fn from_f32(x: f32) -> Self;
}

impl Param for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
}

/// The bits of a bfloat16 (the high half of a binary32).
#[derive(Clone, Copy)]
#[repr(transparent)]
struct Bf16(u16);

impl Grad for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

impl Param for Bf16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Bf16 {
        Bf16(bf16_bits(x))
    }
}

/// `x` as bfloat16 bits, rounded to nearest-even (a NaN gives a quiet NaN).
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    if x.is_nan() { 0x7fc0 } else { rounded as u16 }
}

/// Mantissa bits of the codes of `m` (with a sign) and of `sqrt(v)`; both have 4 exponent bits.
const M_BITS: u32 = 3;
const V_BITS: u32 = 4;

/// The largest value of the codes with `bits` mantissa bits, `2 - 2^-bits` (the block's
/// maximum maps to it).
const fn top(bits: u32) -> f32 {
    2.0 - 1.0 / (1u32 << bits) as f32
}

/// The smallest normal value of the codes, 2^-14, and its bits.
const MIN_NORMAL_BITS: u32 = (127 - 14) << 23;

/// The value of code `c` (below `2^(4 + bits)`): `c * 2^-(14 + bits)` below `2^bits` (evenly
/// spaced up to the smallest normal), else `2^(e - 15) * (1 + f / 2^bits)` with `e = c >> bits`
/// and `f` the low `bits` bits: in binary32 the exponent and mantissa of `c - 2^bits`, shifted
/// into place, above 2^-14's bits. Exact.
#[inline(always)]
fn decode<const BITS: u32>(c: u32) -> f32 {
    let spacing = f32::from_bits((127 - 14 - BITS) << 23);
    let subnormal = c as f32 * spacing;
    let normal =
        f32::from_bits((c.wrapping_sub(1 << BITS) << (23 - BITS)).wrapping_add(MIN_NORMAL_BITS));
    if c < (1 << BITS) { subnormal } else { normal }
}

/// The code of the value nearest to `min(y, top(BITS))` (ties to the even code) for `y >= 0`;
/// 0 for a NaN (`max` with 0 maps it to 0).
///
/// Normal values round their binary32 mantissa to `BITS` bits, half to even, on the bits (a
/// carry moves to the next binade, as it should). Below 2^-14, `y * 2^(14 + BITS)` (exact) is
/// rounded to an integer by adding and subtracting 1.5 * 2^23, which leaves the integer in the
/// sum's low mantissa bits: no float-to-integer conversion (a saturating `as` does not
/// vectorise).
#[inline(always)]
fn encode<const BITS: u32>(y: f32) -> u32 {
    const MAGIC: f32 = 12_582_912.0;
    let y = y.max(0.0).min(top(BITS));
    let scale = f32::from_bits((127 + 14 + BITS) << 23);
    let subnormal = (y * scale + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits());
    let shift = 23 - BITS;
    let b = y.to_bits();
    let rounded = b + ((1 << (shift - 1)) - 1) + ((b >> shift) & 1);
    let normal = (rounded.wrapping_sub(MIN_NORMAL_BITS) >> shift) + (1 << BITS);
    if y < f32::from_bits(MIN_NORMAL_BITS) {
        subnormal
    } else {
        normal
    }
}

/// From the bits of a block's new maximum (of `|m|` or of `sqrt(v)`): the factor that maps a
/// value to the codes' range, `top / max` (0 where the maximum is 0 or not finite, which gives
/// every code 0), and the maximum to store (NaN where it is not finite).
#[inline(always)]
fn inverse(max_bits: u32, top: f32) -> (f32, f32) {
    let max = f32::from_bits(max_bits);
    if !max.is_finite() {
        (0.0, f32::NAN)
    } else if max > 0.0 {
        (top / max, max)
    } else {
        (0.0, max)
    }
}

/// The tensors of one step, or of a run of whole blocks of it.
struct Step<'a, P, G> {
    p: &'a mut [P],
    g: &'a [G],
    qm: &'a mut [i8],
    qv: &'a mut [u8],
    sm: &'a mut [f32],
    sv: &'a mut [f32],
    w: Option<&'a mut [u16]>,
}

impl<'a, P: Param, G: Grad> Step<'a, P, G> {
    /// The first `blocks` blocks and the rest.
    fn split(self, blocks: usize) -> (Self, Self) {
        let at = blocks * BLOCK;
        let (p0, p1) = self.p.split_at_mut(at);
        let (g0, g1) = self.g.split_at(at);
        let (qm0, qm1) = self.qm.split_at_mut(at);
        let (qv0, qv1) = self.qv.split_at_mut(at);
        let (sm0, sm1) = self.sm.split_at_mut(blocks);
        let (sv0, sv1) = self.sv.split_at_mut(blocks);
        let (w0, w1) = match self.w {
            Some(w) => {
                let (w0, w1) = w.split_at_mut(at);
                (Some(w0), Some(w1))
            }
            None => (None, None),
        };
        let first = Step {
            p: p0,
            g: g0,
            qm: qm0,
            qv: qv0,
            sm: sm0,
            sv: sv0,
            w: w0,
        };
        let rest = Step {
            p: p1,
            g: g1,
            qm: qm1,
            qv: qv1,
            sm: sm1,
            sv: sv1,
            w: w1,
        };
        (first, rest)
    }

    /// Steps every block, splitting the work in halves across rayon's pool.
    fn run(self, c: &Constants, isa: Isa) {
        let blocks = self.sm.len();
        if blocks <= GRAIN_BLOCKS {
            isa.blocks(self, c);
        } else {
            let (first, rest) = self.split(blocks / 2);
            rayon::join(|| first.run(c, isa), || rest.run(c, isa));
        }
    }
}

/// The instruction set the blocks are compiled for. A value other than `Baseline` is only
/// made (by `supported`) on a CPU that has its features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The variants this CPU runs, the fastest first.
    pub(crate) fn supported() -> Vec<Isa> {
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
            {
                isas.push(Isa::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                isas.push(Isa::Avx2);
            }
        }
        isas.push(Isa::Baseline);
        isas
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "avx512",
        }
    }

    /// The variant called `name`, if this CPU runs it.
    fn named(name: &str) -> Result<Isa, String> {
        let supported = Isa::supported();
        supported
            .iter()
            .copied()
            .find(|isa| isa.name() == name)
            .ok_or_else(|| {
                let names: Vec<_> = supported.iter().map(|isa| isa.name()).collect();
                format!("isa must be one of {names:?} on this CPU, got {name:?}")
            })
    }

    fn blocks<P: Param, G: Grad>(self, s: Step<'_, P, G>, c: &Constants) {
        match self {
            Isa::Baseline => blocks(s, c),
            // SAFETY: only `supported` makes this variant, on a CPU with AVX2.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { blocks_avx2(s, c) },
            // SAFETY: only `supported` makes this variant, on a CPU with AVX-512 F and BW.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { blocks_avx512(s, c) },
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn blocks_avx2<P: Param, G: Grad>(s: Step<'_, P, G>, c: &Constants) {
    blocks(s, c)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn blocks_avx512<P: Param, G: Grad>(s: Step<'_, P, G>, c: &Constants) {
    blocks(s, c)
}

/// Steps each block of `s` in turn (inlined into each instruction-set variant).
#[inline(always)]
fn blocks<P: Param, G: Grad>(s: Step<'_, P, G>, c: &Constants) {
    let Step {
        p,
        g,
        qm,
        qv,
        sm,
        sv,
        mut w,
    } = s;
    for (b, (((p, g), qm), qv)) in p
        .chunks_mut(BLOCK)
        .zip(g.chunks(BLOCK))
        .zip(qm.chunks_mut(BLOCK))
        .zip(qv.chunks_mut(BLOCK))
        .enumerate()
    {
        let w = w
            .as_deref_mut()
            .map(|w| &mut w[b * BLOCK..b * BLOCK + p.len()]);
        block(p, g, qm, qv, &mut sm[b], &mut sv[b], w, c);
    }
}

/// One block (at most [`BLOCK`] elements): the module's formula.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block<P: Param, G: Grad>(
    p: &mut [P],
    g: &[G],
    qm: &mut [i8],
    qv: &mut [u8],
    sm: &mut f32,
    sv: &mut f32,
    w: Option<&mut [u16]>,
    c: &Constants,
) {
    let len = p.len();
    let (g, qm, qv) = (&g[..len], &mut qm[..len], &mut qv[..len]);
    let scale_m = *sm / top(M_BITS);
    let scale_v = *sv / top(V_BITS);
    let mut m_new = [0f32; BLOCK];
    let mut r_new = [0f32; BLOCK];
    let (m_new, r_new) = (&mut m_new[..len], &mut r_new[..len]);
    // The maxima as bits of |x|: ordered as the values for finite ones, above them for
    // infinities and NaNs (a NaN wins, as in torch's amax).
    let mut m_max = 0u32;
    let mut r_max = 0u32;
    for i in 0..len {
        let g = g[i].to_f32() * c.gs;
        let magnitude = decode::<M_BITS>(u32::from(qm[i].unsigned_abs()));
        let m = (if qm[i] < 0 { -magnitude } else { magnitude }) * scale_m;
        let r = decode::<V_BITS>(u32::from(qv[i])) * scale_v;
        let v = r * r;
        let m = m * c.b1 + g * c.c1;
        let v = v * c.b2 + (g * g) * c.c2;
        let r = v.sqrt();
        let decayed = p[i].to_f32() * c.decay;
        p[i] = P::from_f32(decayed - (m / (r * c.inv_bc2 + c.eps)) * c.step_size);
        m_new[i] = m;
        r_new[i] = r;
        m_max = m_max.max(m.to_bits() & 0x7fff_ffff);
        r_max = r_max.max(r.to_bits() & 0x7fff_ffff);
    }
    let (km, sm_new) = inverse(m_max, top(M_BITS));
    for (q, &m) in qm.iter_mut().zip(m_new.iter()) {
        let code = encode::<M_BITS>(m.abs() * km) as i32;
        *q = (if m < 0.0 { -code } else { code }) as i8;
    }
    let (kv, sv_new) = inverse(r_max, top(V_BITS));
    for ((q, &r), &code_m) in qv.iter_mut().zip(r_new.iter()).zip(qm.iter()) {
        let code = encode::<V_BITS>(r * kv) as u8;
        *q = code.max(u8::from(code_m != 0));
    }
    *sm = sm_new;
    *sv = sv_new;
    if let Some(w) = w {
        for (w, &p) in w.iter_mut().zip(p.iter()) {
            *w = bf16_bits(p.to_f32());
        }
    }
}

/// The element type of the parameter or of the gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dtype {
    Bf16,
    F32,
}

impl Dtype {
    fn size(self) -> usize {
        match self {
            Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }

    /// The dtype called `name` ("bf16" or "f32"); the error names the argument `what`.
    fn named(what: &str, name: &str) -> Result<Dtype, String> {
        match name {
            "bf16" => Ok(Dtype::Bf16),
            "f32" => Ok(Dtype::F32),
            other => Err(format!("{what} must be \"bf16\" or \"f32\", got {other:?}")),
        }
    }
}

/// The element types of one step's parameter and gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dtypes {
    pub p: Dtype,
    pub g: Dtype,
}

/// The addresses of one step's tensors (`w` 0 for none).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Addresses {
    pub p: usize,
    pub g: usize,
    pub qm: usize,
    pub qv: usize,
    pub sm: usize,
    pub sv: usize,
    pub w: usize,
}

impl Addresses {
    /// Each tensor's name, address, size in bytes and alignment, for `n` elements.
    fn ranges(&self, n: usize, dtypes: Dtypes) -> Vec<(&'static str, usize, usize, usize)> {
        let blocks = n.div_ceil(BLOCK);
        let (p, g) = (dtypes.p.size(), dtypes.g.size());
        let mut ranges = vec![
            ("p", self.p, n * p, p),
            ("g", self.g, n * g, g),
            ("qm", self.qm, n, 1),
            ("qv", self.qv, n, 1),
            ("sm", self.sm, blocks * 4, 4),
            ("sv", self.sv, blocks * 4, 4),
        ];
        if self.w != 0 {
            ranges.push(("w", self.w, n * 2, 2));
        }
        ranges
    }

    /// Checks what can be checked of addresses: non-null, aligned for their element type,
    /// ending within the address space, and pairwise disjoint (the step writes through
    /// them); no `w` for a bf16 parameter (it is its own bf16 copy). `n` elements, at most
    /// `isize::MAX / 4`.
    pub(crate) fn check(&self, n: usize, dtypes: Dtypes) -> Result<(), String> {
        if n == 0 {
            return Err("n must be >= 1".into());
        }
        if dtypes.p == Dtype::Bf16 && self.w != 0 {
            return Err(
                "w must be 0 for a bf16 p: the parameter is the working weight, updated in place"
                    .into(),
            );
        }
        if n > isize::MAX as usize / 4 {
            return Err(format!("n must be <= {}, got {n}", isize::MAX as usize / 4));
        }
        let ranges = self.ranges(n, dtypes);
        for &(name, ptr, len, align) in &ranges {
            if ptr == 0 {
                return Err(format!("{name}: the address is null"));
            }
            if ptr % align != 0 {
                return Err(format!(
                    "{name}: the address {ptr:#x} is not aligned to its element ({align} bytes)"
                ));
            }
            if ptr
                .checked_add(len)
                .is_none_or(|end| end > isize::MAX as usize)
            {
                return Err(format!(
                    "{name}: ({ptr:#x}, {len} bytes) is not a valid range"
                ));
            }
        }
        for (i, &(a, a_ptr, a_len, _)) in ranges.iter().enumerate() {
            for &(b, b_ptr, b_len, _) in &ranges[i + 1..] {
                if a_ptr < b_ptr + b_len && b_ptr < a_ptr + a_len {
                    return Err(format!("{a} and {b} overlap in memory"));
                }
            }
        }
        Ok(())
    }
}

/// Steps the `n` elements at `a` (see the module's formula).
///
/// # Safety
/// `a` must pass [`Addresses::check`] for `n` and `dtypes`, and each of its ranges must be
/// memory of its element type that stays allocated, is not read or written by anything else
/// during the call, and (all but `g`) is writable: `p`, `n` float32 or bfloat16; `g`, `n`
/// bfloat16 or float32; `qm`, `n` int8; `qv`, `n` uint8; `sm` and `sv`, `ceil(n / 256)`
/// float32; `w` (if not 0), `n` bfloat16.
pub(crate) unsafe fn step_raw(a: &Addresses, n: usize, dtypes: Dtypes, hp: &HyperParams, isa: Isa) {
    let c = hp.constants().expect("constants checked by the caller");
    // SAFETY (each call): the caller's contract, with the element types `dtypes` names;
    // `Bf16` is a transparent u16.
    unsafe {
        match (dtypes.p, dtypes.g) {
            (Dtype::F32, Dtype::Bf16) => step_typed::<f32, Bf16>(a, n, &c, isa),
            (Dtype::F32, Dtype::F32) => step_typed::<f32, f32>(a, n, &c, isa),
            (Dtype::Bf16, Dtype::Bf16) => step_typed::<Bf16, Bf16>(a, n, &c, isa),
            (Dtype::Bf16, Dtype::F32) => step_typed::<Bf16, f32>(a, n, &c, isa),
        }
    }
}

/// [`step_raw`] with the parameter's and gradient's element types `P` and `G`.
///
/// # Safety
/// As [`step_raw`], `p` holding `n` elements of `P` and `g` of `G`.
unsafe fn step_typed<P: Param, G: Grad>(a: &Addresses, n: usize, c: &Constants, isa: Isa) {
    let blocks = n.div_ceil(BLOCK);
    // SAFETY (every slice below): the range is non-null, aligned, within isize and disjoint
    // from the others (checked by `Addresses::check`), valid for its element type and not
    // otherwise accessed for the duration of the call (this function's contract); every bit
    // pattern is a valid value of these integer and float types (and of `Bf16`, a u16).
    let w = (a.w != 0).then(|| unsafe { std::slice::from_raw_parts_mut(a.w as *mut u16, n) });
    let (p, g, qm, qv, sm, sv) = unsafe {
        (
            std::slice::from_raw_parts_mut(a.p as *mut P, n),
            std::slice::from_raw_parts(a.g as *const G, n),
            std::slice::from_raw_parts_mut(a.qm as *mut i8, n),
            std::slice::from_raw_parts_mut(a.qv as *mut u8, n),
            std::slice::from_raw_parts_mut(a.sm as *mut f32, blocks),
            std::slice::from_raw_parts_mut(a.sv as *mut f32, blocks),
        )
    };
    Step {
        p,
        g,
        qm,
        qv,
        sm,
        sv,
        w,
    }
    .run(c, isa);
}

/// One 8-bit AdamW step over the tensors at these addresses (the `data_ptr()` of contiguous
/// CPU tensors; `w_ptr` 0 for no bf16 copy), in place: the private half of
/// `weightstream.torch.adamw8.native_step`, which checks the tensors and holds them for the
/// call. `p_dtype`: `"f32"` (a master) or `"bf16"` (the working weight itself, updated in
/// place; `w_ptr` must then be 0). `isa` (for tests) picks the compiled variant, by default the
/// first of `adamw8bit_isas()`. Raises `ValueError` for a null, misaligned or overlapping
/// address, `n < 1`, an unknown `p_dtype`, `g_dtype` or `isa`, a `w_ptr` with a bf16 `p`, or a
/// hyper-parameter out of range.
#[pyfunction]
#[pyo3(signature = (p_ptr, g_ptr, g_dtype, qm_ptr, qv_ptr, sm_ptr, sv_ptr, w_ptr, n, step, lr, beta1, beta2, eps, weight_decay, grad_scale, p_dtype="f32", isa=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw8bit_step(
    py: Python<'_>,
    p_ptr: usize,
    g_ptr: usize,
    g_dtype: &str,
    qm_ptr: usize,
    qv_ptr: usize,
    sm_ptr: usize,
    sv_ptr: usize,
    w_ptr: usize,
    n: usize,
    step: i64,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    grad_scale: f64,
    p_dtype: &str,
    isa: Option<&str>,
) -> PyResult<()> {
    let isa = match isa {
        Some(name) => Isa::named(name).map_err(PyValueError::new_err)?,
        None => Isa::supported()[0],
    };
    let dtypes = Dtypes {
        p: Dtype::named("p_dtype", p_dtype).map_err(PyValueError::new_err)?,
        g: Dtype::named("g_dtype", g_dtype).map_err(PyValueError::new_err)?,
    };
    let hp = HyperParams {
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        grad_scale,
    };
    hp.constants().map_err(PyValueError::new_err)?;
    let a = Addresses {
        p: p_ptr,
        g: g_ptr,
        qm: qm_ptr,
        qv: qv_ptr,
        sm: sm_ptr,
        sv: sv_ptr,
        w: w_ptr,
    };
    a.check(n, dtypes).map_err(PyValueError::new_err)?;
    // SAFETY: checked above; the addresses are the data of contiguous CPU tensors of these
    // sizes and types that `native_step` holds until this returns, and the GIL it gives up
    // is not what keeps them alive (its caller's references do). Python code that passes other
    // addresses breaks this contract, as with `raw::host_bytes`.
    py.detach(|| unsafe { step_raw(&a, n, dtypes, &hp, isa) });
    Ok(())
}

/// The kernel's compiled variants that this CPU runs, the one `adamw8bit_step` uses first:
/// some of `"avx512"` (F and BW), `"avx2"`, and `"baseline"` (the target's own, always).
#[pyfunction]
pub(crate) fn adamw8bit_isas() -> Vec<&'static str> {
    Isa::supported().into_iter().map(Isa::name).collect()
}
