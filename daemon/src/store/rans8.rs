//! Lossless coding of 8-bit weights: interleaved rANS over bytes (order 0), the coder
//! `tests/bench/rans8.py` measures, whose encoder runs on the CPU (here, on the host copy) and
//! whose decoder runs on the device after the copy. This is that file's format bit for bit:
//! [`encode`] gives the arrays `rans8.encode` gives (the tests hold its outputs), [`decode`] is
//! its reference decoder (`decode_numpy`), which also checks what it is handed.
//!
//! One table of frequencies per coded buffer, quantized to [`SCALE_BITS`] bits (they sum to
//! 4096; every byte that occurs gets at least 1); a 32-bit state kept in [2^16, 2^32) by 16-bit
//! words. `K` lanes: lane `j` codes bytes `j, j + K, j + 2K, …` (`T = ceil(n / K)` steps, the
//! last row padded with the most frequent byte). Per lane: its decoder's initial state, and its
//! words in the order its decoder reads them (step 0 first), contiguous from `offsets[j]`. The
//! encoder walks the steps from last to first, so each lane's words come out in reverse.
//!
//! The encoder takes the lanes in blocks (at most [`BLOCK_LANES`] a block), each block on one
//! thread: a step reads a contiguous run of a row, and the division by a byte's frequency is a
//! multiplication by a reciprocal precomputed per byte, exact for every 32-bit state. A block
//! keeps its words in the order they come out, with a bit a lane a step saying which lanes
//! emitted one; once every block's counts are known (the offsets), each block puts its words in
//! their place among all the lanes', on the threads again. At its peak an encode holds, besides
//! the data, about twice the coded words and n / 8 bytes of those bits. Offsets are 32-bit: a
//! buffer codes to at most 2^32 - 1 words (8 GiB), beyond which [`encode`] refuses it (code the
//! data in pieces).

use std::num::NonZeroUsize;

/// Bits of the quantized probabilities: the frequencies sum to `1 << SCALE_BITS`.
pub const SCALE_BITS: u32 = 12;
/// The lower bound of a normalized state (`L` in `rans8.py`): a state is kept in
/// [`STATE_MIN`, 2^32). Every lane starts encoding, and ends decoding, at it.
pub const STATE_MIN: u32 = 1 << 16;
/// The most lanes one thread codes together.
pub const BLOCK_LANES: usize = 1024;

/// What the frequencies sum to.
const TOTAL: u32 = 1 << SCALE_BITS;
/// The fewest lanes of a block (but for the last) when the lanes are spread thinner over threads.
const MIN_BLOCK_LANES: usize = 64;

/// `n` bytes coded in `lanes` interleaved rANS streams (the fields of `rans8.py`'s `Coded`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Coded {
    /// The bytes coded.
    pub n: u64,
    /// The streams: lane `j` codes bytes `j, j + lanes, j + 2·lanes, …`.
    pub lanes: u32,
    /// Each byte's frequency, summing to 4096.
    pub freq: [u16; 256],
    /// Each lane's decoder's initial state (`lanes` of them).
    pub states: Vec<u32>,
    /// Where each lane's words start in `words` (`lanes + 1` of them: the last is its length).
    pub offsets: Vec<u32>,
    /// Each lane's words in the order its decoder reads them.
    pub words: Vec<u16>,
}

impl Coded {
    /// The bytes it takes on the wire: table, states, offsets and words.
    pub fn nbytes(&self) -> u64 {
        let bytes = 2 * self.freq.len()
            + 4 * self.states.len()
            + 4 * self.offsets.len()
            + 2 * self.words.len();
        bytes as u64
    }
}

/// Bytes of the decoder's table at the head of a coded blob (`u32[4096]`).
pub const TABLE_BYTES: u64 = 4 * TOTAL as u64;
/// The steps a lane takes in [`lanes_for`]'s choice: each lane costs 8 bytes (its state and
/// offset), so 1.6 % of the bytes it codes; the device decodes a step of every lane at once.
pub const STEPS_PER_LANE: u64 = 512;
/// The most lanes [`lanes_for`] gives.
pub const MAX_LANES: u32 = 1 << 18;

/// The lanes to code `n` bytes in: a lane per [`STEPS_PER_LANE`] bytes, at least 1 and at most
/// [`MAX_LANES`].
pub fn lanes_for(n: u64) -> u32 {
    u32::try_from((n / STEPS_PER_LANE).clamp(1, u64::from(MAX_LANES))).unwrap_or(MAX_LANES)
}

impl Coded {
    /// The bytes of its blob ([`Coded::write_blob`]).
    pub fn blob_nbytes(&self) -> u64 {
        TABLE_BYTES
            + 4 * (self.states.len() + self.offsets.len()) as u64
            + 2 * self.words.len() as u64
    }

    /// Writes its blob into `out` (of [`Coded::blob_nbytes`]), as the store holds a coded
    /// tensor (the proto's `CODING_RANS8`), little endian: the decoder's table (`u32[4096]`),
    /// the states, the offsets, the words.
    pub fn write_blob(&self, out: &mut [u8]) {
        assert_eq!(out.len() as u64, self.blob_nbytes(), "a blob's room");
        let (head, rest) = out.split_at_mut(TABLE_BYTES as usize);
        for (dst, v) in head.chunks_exact_mut(4).zip(table(&self.freq)) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        let (states, rest) = rest.split_at_mut(4 * self.states.len());
        for (dst, v) in states.chunks_exact_mut(4).zip(&self.states) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        let (offsets, words) = rest.split_at_mut(4 * self.offsets.len());
        for (dst, v) in offsets.chunks_exact_mut(4).zip(&self.offsets) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        for (dst, v) in words.chunks_exact_mut(2).zip(&self.words) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
    }

    /// The [`Coded`] a blob of `n` bytes in `lanes` lanes holds, its table checked against the
    /// frequencies it gives (what a decoder needs to trust it; [`decode`] checks the rest).
    pub fn from_blob(blob: &[u8], n: u64, lanes: u32) -> Result<Coded, RansError> {
        let fixed = TABLE_BYTES + 8 * u64::from(lanes) + 4;
        let len = blob.len() as u64;
        if lanes == 0 {
            return Err(RansError::NoLanes);
        }
        if len < fixed || !(len - fixed).is_multiple_of(2) {
            return Err(RansError::BlobLength { len, lanes });
        }
        let u32s = |b: &[u8]| -> Vec<u32> {
            (b.chunks_exact(4))
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect()
        };
        let (head, rest) = blob.split_at(TABLE_BYTES as usize);
        let entries = u32s(head);
        let mut freq = [0u16; 256];
        for e in &entries {
            freq[(e & 0xFF) as usize] += 1;
        }
        if table(&freq) != entries {
            return Err(RansError::BadTable);
        }
        let (states, rest) = rest.split_at(4 * lanes as usize);
        let (offsets, words) = rest.split_at(4 * (lanes as usize + 1));
        Ok(Coded {
            n,
            lanes,
            freq,
            states: u32s(states),
            offsets: u32s(offsets),
            words: (words.chunks_exact(2))
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect(),
        })
    }
}

/// Why bytes cannot be coded, or a [`Coded`] cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RansError {
    #[error("lanes must be at least 1")]
    NoLanes,
    #[error("nothing to code: data is empty")]
    Empty,
    #[error(
        "the data codes to {words} words, more than the {} that 32-bit offsets address: code \
         it in smaller pieces",
        u32::MAX
    )]
    TooManyWords { words: u64 },
    #[error("n must be at least 1: a coded buffer holds at least one byte")]
    NoBytes,
    #[error("n = {n} bytes cannot be allocated here")]
    TooLarge { n: u64 },
    #[error("freq sums to {sum}, not {TOTAL}")]
    FreqSum { sum: u32 },
    #[error("states holds {len} entries, not lanes = {lanes}")]
    StatesLength { len: usize, lanes: u32 },
    #[error("offsets holds {len} entries, not lanes + 1 = {}", u64::from(*lanes) + 1)]
    OffsetsLength { len: usize, lanes: u32 },
    #[error("offsets[0] is {first}, not 0")]
    OffsetsStart { first: u32 },
    #[error(
        "offsets decrease at lane {lane}: offsets[{lane}] = {start} > offsets[{}] = {end}",
        lane + 1
    )]
    OffsetsDecrease { lane: usize, start: u32, end: u32 },
    #[error("offsets end at {end}, not at the length of words ({words})")]
    OffsetsEnd { end: u32, words: usize },
    #[error("states[{lane}] = {state} is below {STATE_MIN}: a state is kept in [2^16, 2^32)")]
    StateBelow { lane: usize, state: u32 },
    #[error(
        "lane {lane} reads past its words (they end at offsets[{}] = {end}) at step {step}",
        lane + 1
    )]
    PastWords { lane: usize, step: usize, end: u32 },
    #[error("lane {lane} read {read} words, not the {expected} its offsets give")]
    WordsLeft {
        lane: usize,
        read: usize,
        expected: usize,
    },
    #[error(
        "a blob of {len} bytes cannot hold {lanes} lanes: the table, the states and offsets \
         and whole words take 16384 + 8 * lanes + 4 + 2 * words bytes"
    )]
    BlobLength { len: u64, lanes: u32 },
    #[error("the blob's table is not the table of the frequencies it gives")]
    BadTable,
    #[error("lane {lane} ends in state {state}, not {STATE_MIN}: the coded data is corrupt")]
    FinalState { lane: usize, state: u32 },
}

/// `counts` scaled to frequencies summing to 4096, each byte that occurs at least 1 (all zeros
/// when nothing was counted): each rounded down, the shortfall added to the most frequent byte,
/// an excess taken 1 at a time from the most frequent bytes (in turn) that stay at least 1.
/// Ties between counts go to the lower byte, as numpy's stable sort has it.
pub fn frequencies(counts: &[u64; 256]) -> [u16; 256] {
    let mut freq = [0u16; 256];
    let counted: u128 = counts.iter().map(|&c| u128::from(c)).sum();
    if counted == 0 {
        return freq;
    }
    let mut sum = 0u32;
    for (f, &c) in freq.iter_mut().zip(counts) {
        if c > 0 {
            // At most TOTAL: c ≤ counted.
            let scaled = (u128::from(c) * u128::from(TOTAL) / counted).max(1);
            *f = scaled as u16;
            sum += u32::from(*f);
        }
    }
    // The bytes that occur, most frequent first (a stable sort: ties keep the byte order).
    let mut order: Vec<usize> = (0..256).filter(|&s| counts[s] > 0).collect();
    order.sort_by(|&a, &b| counts[b].cmp(&counts[a]));
    if let Some(&top) = order.first()
        && sum < TOTAL
    {
        freq[top] += (TOTAL - sum) as u16;
        sum = TOTAL;
    }
    // This ends: the excess is at most the bytes rounded up to 1 (fewer than 256), and the
    // bytes above 1 hold more than that.
    let mut at = 0;
    while sum > TOTAL {
        let s = order[at % order.len()];
        if freq[s] > 1 {
            freq[s] -= 1;
            sum -= 1;
        }
        at += 1;
    }
    freq
}

/// `data` coded in `lanes` interleaved rANS streams: the arrays `rans8.encode(data, lanes)`
/// gives. Refuses empty data, no lanes, and data whose words 32-bit offsets cannot address.
pub fn encode(data: &[u8], lanes: u32) -> Result<Coded, RansError> {
    encode_in_blocks(data, lanes, None)
}

/// [`encode`] with blocks of `block` lanes (the tests' choice), or of the size the lanes and
/// threads call for.
fn encode_in_blocks(data: &[u8], lanes: u32, block: Option<usize>) -> Result<Coded, RansError> {
    if lanes == 0 {
        return Err(RansError::NoLanes);
    }
    if data.is_empty() {
        return Err(RansError::Empty);
    }
    let counts = histogram(data);
    let freq = frequencies(&counts);
    // The first most frequent byte (numpy's argmax): the padding of the last row.
    let pad = (0..256).fold(0, |best, s| if counts[s] > counts[best] { s } else { best }) as u8;
    let symbols = encoder_symbols(&freq);
    let lanes_n = lanes as usize;
    let plan = Plan::new(lanes_n, data.len().div_ceil(lanes_n), block);
    let job = EncodeJob {
        data,
        lanes: lanes_n,
        steps: plan.steps,
        symbols: &symbols,
        pad,
        words_per_byte: words_per_byte(&counts, &freq),
    };
    let blocks = spread(plan.blocks().collect(), |(lo, hi)| job.run(lo, hi));

    let words_n: u64 = blocks.iter().map(|b| b.emitted.len() as u64).sum();
    if words_n > u64::from(u32::MAX) {
        return Err(RansError::TooManyWords { words: words_n });
    }
    let mut offsets = Vec::with_capacity(lanes_n + 1);
    let mut end = 0u64;
    offsets.push(0);
    for &count in blocks.iter().flat_map(|b| &b.counts) {
        end += count;
        offsets.push(end as u32); // at most words_n, checked above
    }
    let states: Vec<u32> = blocks.iter().flat_map(|b| &b.states).copied().collect();
    // Zeroed by the allocator (pages untouched): the threads place the blocks' words in it.
    let mut words = vec![0u16; words_n as usize];
    let mut places = Vec::with_capacity(blocks.len());
    let mut rest = &mut words[..];
    for block in blocks {
        let (mine, others) = rest.split_at_mut(block.emitted.len());
        places.push((block, mine));
        rest = others;
    }
    spread(places, |(block, words)| block.place(words));
    Ok(Coded {
        n: data.len() as u64,
        lanes,
        freq,
        states,
        offsets,
        words,
    })
}

/// How often each byte occurs in `data`, counted on the threads there are.
fn histogram(data: &[u8]) -> [u64; 256] {
    const PIECE: usize = 1 << 24;
    let pieces: Vec<&[u8]> = data.chunks(PIECE).collect();
    let partial = spread(pieces, |piece| {
        // Four tables, so that runs of one byte do not wait on their own increments.
        let mut tables = [[0u64; 256]; 4];
        let mut quads = piece.chunks_exact(4);
        for q in &mut quads {
            tables[0][q[0] as usize] += 1;
            tables[1][q[1] as usize] += 1;
            tables[2][q[2] as usize] += 1;
            tables[3][q[3] as usize] += 1;
        }
        for &b in quads.remainder() {
            tables[0][b as usize] += 1;
        }
        tables
    });
    let mut counts = [0u64; 256];
    for tables in &partial {
        for table in tables {
            for (c, t) in counts.iter_mut().zip(table) {
                *c += t;
            }
        }
    }
    counts
}

/// The words per byte the coded data will take, about (its entropy under `freq` over 16
/// bits): what a block reserves for them.
fn words_per_byte(counts: &[u64; 256], freq: &[u16; 256]) -> f64 {
    let n: u64 = counts.iter().sum();
    let bits: f64 = (counts.iter().zip(freq))
        .filter(|&(&c, _)| c > 0)
        .map(|(&c, &f)| c as f64 * (f64::from(SCALE_BITS) - f64::from(f.max(1)).log2()))
        .sum();
    bits / 16.0 / n.max(1) as f64
}

/// One byte's encoding step, precomputed: `x` (renormalized) becomes
/// `(x / f) << 12 | x % f` plus the byte's start, computed as `x + start + q·(4096 - f)` with
/// `q = x / f` by a reciprocal (`(((x·mul) >> 32) + x) >> shift`, exact for every 32-bit `x`:
/// `mul + 2^32 = ceil(2^(32 + shift) / f)` with `2^shift ≥ f`).
#[derive(Debug, Clone, Copy, Default)]
struct EncoderSymbol {
    /// A state at or above it emits a word first: `f << (32 - SCALE_BITS)` (2^32 for f = 4096).
    bound: u64,
    mul: u64,
    shift: u32,
    start: u64,
    complement: u64,
}

impl EncoderSymbol {
    /// The step of a byte of frequency `freq` (1..=4096) whose range starts at `start`.
    fn new(start: u32, freq: u32) -> EncoderSymbol {
        let shift = u32::BITS - (freq - 1).leading_zeros(); // ceil(log2 freq)
        let reciprocal = (1u64 << (32 + shift)).div_ceil(u64::from(freq));
        EncoderSymbol {
            bound: u64::from(freq) << (32 - SCALE_BITS),
            mul: reciprocal - (1 << 32),
            shift,
            start: u64::from(start),
            complement: u64::from(TOTAL - freq),
        }
    }

    /// `x / freq`, for `x` < 2^32.
    #[inline(always)]
    fn quotient(&self, x: u64) -> u64 {
        (((x * self.mul) >> 32) + x) >> self.shift
    }
}

/// Each byte's step (bytes that never occur keep a default, never used).
fn encoder_symbols(freq: &[u16; 256]) -> [EncoderSymbol; 256] {
    let mut symbols = [EncoderSymbol::default(); 256];
    let mut start = 0u32;
    for (symbol, &f) in symbols.iter_mut().zip(freq) {
        if f > 0 {
            *symbol = EncoderSymbol::new(start, u32::from(f));
        }
        start += u32::from(f);
    }
    symbols
}

/// The lanes cut into blocks, one block a job for a thread.
struct Plan {
    lanes: usize,
    steps: usize,
    block: usize,
}

impl Plan {
    /// Blocks of `block` lanes, or of [`BLOCK_LANES`], fewer where that leaves threads idle
    /// (at least [`MIN_BLOCK_LANES`]).
    fn new(lanes: usize, steps: usize, block: Option<usize>) -> Plan {
        let block = block.unwrap_or_else(|| {
            let threads = thread_count(lanes.div_ceil(MIN_BLOCK_LANES));
            lanes.div_ceil(threads).clamp(MIN_BLOCK_LANES, BLOCK_LANES)
        });
        Plan {
            lanes,
            steps,
            block: block.max(1),
        }
    }

    /// Each block's lanes, `lo..hi`.
    fn blocks(&self) -> impl Iterator<Item = (usize, usize)> + use<> {
        let (lanes, block) = (self.lanes, self.block);
        (0..lanes.div_ceil(block)).map(move |b| (b * block, ((b + 1) * block).min(lanes)))
    }
}

/// What every block of an encode shares.
struct EncodeJob<'a> {
    data: &'a [u8],
    lanes: usize,
    steps: usize,
    symbols: &'a [EncoderSymbol; 256],
    pad: u8,
    words_per_byte: f64,
}

/// A block's lanes coded: their initial states (for the decoder), their word counts, and their
/// words as they came out (steps from last to first, a step's in lane order), with a mask a
/// step of the lanes that emitted one.
struct EncodedBlock {
    states: Vec<u32>,
    counts: Vec<u64>,
    emitted: Vec<u16>,
    /// A bit a lane a step (the block's lanes in order), the steps in the order they were coded
    /// ([`Bits`]).
    masks: Vec<u64>,
}

/// Bits appended in order, 64 a word, the first in its lowest bit.
struct Bits {
    words: Vec<u64>,
    /// The bits not yet in a word, and how many.
    last: u64,
    filled: u32,
}

impl Bits {
    fn with_capacity(bits: usize) -> Bits {
        let words = Vec::with_capacity(bits.div_ceil(64));
        Bits {
            words,
            last: 0,
            filled: 0,
        }
    }

    /// Appends the low `len` bits of `bits` (`len` in 1..=64, the bits above them clear).
    fn put(&mut self, bits: u64, len: u32) {
        self.last |= bits << self.filled;
        let filled = self.filled + len;
        if filled >= 64 {
            self.words.push(self.last);
            self.last = if self.filled == 0 {
                0
            } else {
                bits >> (64 - self.filled)
            };
            self.filled = filled - 64;
        } else {
            self.filled = filled;
        }
    }

    fn finish(mut self) -> Vec<u64> {
        if self.filled > 0 {
            self.words.push(self.last);
        }
        self.words
    }
}

impl EncodedBlock {
    /// Puts the block's words in `words` (its part of the coding's, as long as `emitted`): lane
    /// after lane, each lane's in the order its decoder reads them. Each lane's words end where
    /// the next lane's start; walking the masks in the order the words came out, each lane
    /// fills its place from its end.
    fn place(self, words: &mut [u16]) {
        let mut ends: Vec<usize> = (self.counts.iter())
            .scan(0usize, |end, &c| {
                *end += c as usize;
                Some(*end)
            })
            .collect();
        let b = self.counts.len();
        let mut next = self.emitted.iter();
        // Where the step of the bit at hand starts among the bits.
        let mut step = 0;
        for (i, &bits) in self.masks.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                let at = 64 * i + bits.trailing_zeros() as usize;
                while at - step >= b {
                    step += b;
                }
                let lane = at - step;
                ends[lane] -= 1;
                if let Some(&w) = next.next() {
                    words[ends[lane]] = w;
                }
                bits &= bits - 1;
            }
        }
    }
}

impl EncodeJob<'_> {
    /// Codes lanes `lo..hi`: the steps from last to first, each a run of the row. Each step
    /// writes every lane's low word to `emitted` and moves on past those that emit it (a lane
    /// emits at most one word a step), and sets the emitting lanes' bits in the step's mask
    /// ([`EncodedBlock::place`] then puts each word in its lane's place).
    fn run(&self, lo: usize, hi: usize) -> EncodedBlock {
        let b = hi - lo;
        let mut states = vec![u64::from(STATE_MIN); b];
        let mut counts = vec![0u64; b];
        let mut masks = Bits::with_capacity(self.steps * b);
        let expected = (self.steps * b) as f64 * self.words_per_byte * 1.02;
        let mut emitted = vec![0u16; expected as usize + 2 * b];
        let mut count = 0usize;
        let mut padded = Vec::new();
        for t in (0..self.steps).rev() {
            let start = t * self.lanes + lo;
            let row = match self.data.get(start..start + b) {
                Some(row) => row,
                None => {
                    // The last row, past the data.
                    padded.clear();
                    padded.extend(
                        (start..start + b).map(|i| self.data.get(i).copied().unwrap_or(self.pad)),
                    );
                    &padded[..]
                }
            };
            if emitted.len() < count + b {
                emitted.resize(2 * emitted.len() + b, 0);
            }
            let out = &mut emitted[count..count + b];
            let mut at = 0;
            // 64 lanes at a time, their bits gathered in a register.
            let runs = (row.chunks(64).zip(states.chunks_mut(64))).zip(counts.chunks_mut(64));
            for ((row, states), counts) in runs {
                // Lane j's bit enters at the top and moves down a place a lane after it.
                let mut bits = 0u64;
                for ((&byte, x), c) in row.iter().zip(&mut *states).zip(counts) {
                    let symbol = &self.symbols[usize::from(byte)];
                    let mut v = *x;
                    let emit = v >= symbol.bound;
                    out[at] = v as u16;
                    at += usize::from(emit);
                    bits = (bits >> 1) | (u64::from(emit) << 63);
                    *c += u64::from(emit);
                    v >>= 16 * u32::from(emit);
                    *x = v + symbol.start + symbol.quotient(v) * symbol.complement;
                }
                let len = states.len() as u32;
                masks.put(bits >> (64 - len), len);
            }
            count += at;
        }

        emitted.truncate(count);
        EncodedBlock {
            states: states.into_iter().map(|x| x as u32).collect(),
            counts,
            emitted,
            masks: masks.finish(),
        }
    }
}

/// The bytes `c` codes, decoded on the CPU (as `rans8.py`'s `decode_numpy`: one table entry a
/// slot of the 4096), its lanes in blocks over the threads there are. Refuses, naming what is
/// wrong, arrays of the wrong lengths, offsets that decrease or do not end at the words' end,
/// frequencies that do not sum to 4096, a state below [`STATE_MIN`], a lane that reads past its
/// words or leaves some unread, and a lane that does not end in [`STATE_MIN`] (where its
/// encoder started: corrupt words).
pub fn decode(c: &Coded) -> Result<Vec<u8>, RansError> {
    decode_in_blocks(c, None, 1 << 16)
}

/// [`decode`] with blocks of `block` lanes (the tests' choice), or of the size the lanes and
/// threads call for, their rows cut in `parts` parts at a time (or a row at a time, where
/// there are more blocks).
fn decode_in_blocks(c: &Coded, block: Option<usize>, parts: usize) -> Result<Vec<u8>, RansError> {
    check(c)?;
    let too_large = RansError::TooLarge { n: c.n };
    let n = usize::try_from(c.n).map_err(|_| too_large.clone())?;
    let lanes = c.lanes as usize;
    let plan = Plan::new(lanes, n.div_ceil(lanes), block);
    // Whether n bytes can be had, asked without aborting; then had zeroed from the allocator
    // (untouched pages, which the threads fault in as they write them).
    Vec::<u8>::new()
        .try_reserve_exact(n)
        .map_err(|_| too_large)?;
    let mut out = vec![0u8; n];

    let table = table(&c.freq);
    let mut blocks: Vec<Decoding> = plan.blocks().map(|b| Decoding::new(c, b)).collect();
    if let [block] = &mut blocks[..] {
        block.steps(c, &table, 0, out.chunks_mut(lanes))?;
    } else {
        // Rows at a time (`parts` parts of rows), each cut at the blocks' bounds: each block
        // gets its part of each row.
        let rows = (parts / blocks.len()).max(1);
        for (chunk, some_rows) in out.chunks_mut(rows * lanes).enumerate() {
            let mut parts: Vec<Vec<&mut [u8]>> =
                (blocks.iter()).map(|_| Vec::with_capacity(rows)).collect();
            for row in some_rows.chunks_mut(lanes) {
                let mut rest = row;
                for (part, block) in parts.iter_mut().zip(&blocks) {
                    let (mine, others) = rest.split_at_mut((block.hi - block.lo).min(rest.len()));
                    part.push(mine);
                    rest = others;
                }
            }
            let jobs: Vec<_> = blocks.iter_mut().zip(parts).collect();
            let results = spread(jobs, |(block, part)| {
                block.steps(c, &table, chunk * rows, part.into_iter())
            });
            results.into_iter().collect::<Result<Vec<()>, _>>()?;
        }
    }
    for block in &blocks {
        block.finish(c)?;
    }
    Ok(out)
}

/// The checks of [`decode`] that need no decoding.
fn check(c: &Coded) -> Result<(), RansError> {
    if c.lanes == 0 {
        return Err(RansError::NoLanes);
    }
    if c.n == 0 {
        return Err(RansError::NoBytes);
    }
    let sum: u32 = c.freq.iter().map(|&f| u32::from(f)).sum();
    if sum != TOTAL {
        return Err(RansError::FreqSum { sum });
    }
    let lanes = c.lanes as usize;
    if c.states.len() != lanes {
        let len = c.states.len();
        return Err(RansError::StatesLength {
            len,
            lanes: c.lanes,
        });
    }
    if c.offsets.len() != lanes + 1 {
        let len = c.offsets.len();
        return Err(RansError::OffsetsLength {
            len,
            lanes: c.lanes,
        });
    }
    if let Some(&first) = c.offsets.first()
        && first != 0
    {
        return Err(RansError::OffsetsStart { first });
    }
    if let Some((lane, w)) = (c.offsets.windows(2).enumerate()).find(|(_, w)| w[0] > w[1]) {
        let (start, end) = (w[0], w[1]);
        return Err(RansError::OffsetsDecrease { lane, start, end });
    }
    if let Some(&end) = c.offsets.last()
        && end as usize != c.words.len()
    {
        let words = c.words.len();
        return Err(RansError::OffsetsEnd { end, words });
    }
    if let Some((lane, &state)) = (c.states.iter().enumerate()).find(|&(_, &x)| x < STATE_MIN) {
        return Err(RansError::StateBelow { lane, state });
    }
    Ok(())
}

/// The decoder's table, one entry a slot of the 4096: its byte (bits 0-7), the byte's
/// frequency less 1 (bits 8-19) and the slot's place in the byte's range (bits 20-31), so that
/// a step reads one entry (`rans8.py`'s `table`). `freq` sums to 4096 ([`check`]).
fn table(freq: &[u16; 256]) -> Vec<u32> {
    let entries = (0u32..256).flat_map(|byte| {
        let f = u32::from(freq[byte as usize]);
        (0..f).map(move |place| byte | ((f - 1) << 8) | (place << 20))
    });
    let mut table = vec![0u32; TOTAL as usize];
    for (slot, entry) in table.iter_mut().zip(entries) {
        *slot = entry;
    }
    table
}

/// A block of lanes being decoded: their states and where each reads its next word.
struct Decoding {
    lo: usize,
    hi: usize,
    states: Vec<u32>,
    at: Vec<usize>,
    /// A step's bytes, before they go to their row.
    bytes: Vec<u8>,
}

impl Decoding {
    /// Lanes `lo..hi` of `c` (checked) at their initial states.
    fn new(c: &Coded, (lo, hi): (usize, usize)) -> Decoding {
        Decoding {
            lo,
            hi,
            states: c.states[lo..hi].to_vec(),
            at: c.offsets[lo..hi].iter().map(|&o| o as usize).collect(),
            bytes: vec![0u8; hi - lo],
        }
    }

    /// Decodes the next steps, from step `first`, into `rows`: each the block's part of a row
    /// (the last may be short: past `n`, a lane decodes its padding and drops it).
    fn steps<'a>(
        &mut self,
        c: &Coded,
        table: &[u32],
        first: usize,
        rows: impl Iterator<Item = &'a mut [u8]>,
    ) -> Result<(), RansError> {
        let ends = &c.offsets[self.lo + 1..=self.hi];
        for (step, row) in (first..).zip(rows) {
            let lanes = (self.states.iter_mut()).zip(&mut self.at).zip(ends);
            for (lane, (((x, at), &end), byte)) in lanes.zip(&mut self.bytes).enumerate() {
                let e = table[(*x & (TOTAL - 1)) as usize];
                *byte = e as u8;
                let v = (((e >> 8) & 0xFFF) + 1) * (*x >> SCALE_BITS) + (e >> 20);
                let need = v < STATE_MIN;
                if need & (*at >= end as usize) {
                    let lane = self.lo + lane;
                    return Err(RansError::PastWords { lane, step, end });
                }
                // Read whether needed or not, and chosen by a mask: a branch on `need` would be
                // mispredicted about as often as a word is read.
                let word = u32::from(c.words.get(*at).copied().unwrap_or(0));
                let take = 0u32.wrapping_sub(u32::from(need));
                *x = (v & !take) | (((v << 16) | word) & take);
                *at += usize::from(need);
            }
            row.copy_from_slice(&self.bytes[..row.len()]);
        }
        Ok(())
    }

    /// After the last step: each lane has read all its words and is back at [`STATE_MIN`].
    fn finish(&self, c: &Coded) -> Result<(), RansError> {
        let ends = &c.offsets[self.lo + 1..=self.hi];
        let starts = &c.offsets[self.lo..self.hi];
        let lanes = (self.states.iter().zip(&self.at)).zip(starts.iter().zip(ends));
        for (i, ((&x, &at), (&start, &end))) in lanes.enumerate() {
            let lane = self.lo + i;
            let (start, end) = (start as usize, end as usize);
            if at != end {
                let (read, expected) = (at - start, end - start);
                return Err(RansError::WordsLeft {
                    lane,
                    read,
                    expected,
                });
            }
            if x != STATE_MIN {
                return Err(RansError::FinalState { lane, state: x });
            }
        }
        Ok(())
    }
}

/// Threads for `items` jobs: the cores there are, at most one a job, at least one.
fn thread_count(items: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, NonZeroUsize::get)
        .min(items)
        .max(1)
}

/// `work` on each item, the items dealt in turn to [`thread_count`] threads (here when that is
/// one); the results in the items' order.
fn spread<T: Send, R: Send>(items: Vec<T>, work: impl Fn(T) -> R + Sync) -> Vec<R> {
    let threads = thread_count(items.len());
    if threads == 1 {
        return items.into_iter().map(work).collect();
    }
    let count = items.len();
    let mut dealt: Vec<Vec<(usize, T)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, item) in items.into_iter().enumerate() {
        dealt[i % threads].push((i, item));
    }
    let done: Vec<Vec<(usize, R)>> = std::thread::scope(|s| {
        let work = &work;
        let handles: Vec<_> = (dealt.into_iter())
            .map(|mine| s.spawn(move || mine.into_iter().map(|(i, t)| (i, work(t))).collect()))
            .collect();
        (handles.into_iter())
            .map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    let mut results: Vec<Option<R>> = (0..count).map(|_| None).collect();
    for (i, r) in done.into_iter().flatten() {
        results[i] = Some(r);
    }
    results.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FNV-1a (64 bits) over values, one a unit: the golden tests' checksum.
    fn fnv(values: impl IntoIterator<Item = u64>) -> u64 {
        values.into_iter().fold(0xCBF2_9CE4_8422_2325, |h, v| {
            (h ^ v).wrapping_mul(0x0000_0100_0000_01B3)
        })
    }

    /// A deterministic skew: the product of two bytes of a multiplicative hash, over 256 (small
    /// bytes common).
    fn skew(n: usize) -> Vec<u8> {
        (0..n as u64)
            .map(|i| {
                let h = (i * 2_654_435_761) % (1 << 32);
                ((((h >> 8) % 256) * ((h >> 16) % 256)) >> 8) as u8
            })
            .collect()
    }

    /// `skew` upside down: 255 the most frequent byte.
    fn flipped(n: usize) -> Vec<u8> {
        skew(n).into_iter().map(|b| 255 - b).collect()
    }

    /// Bytes near uniform over 0..251.
    fn formula(n: usize) -> Vec<u8> {
        (0..n as u64)
            .map(|i| (((i * 2_654_435_761) >> 7) % 251) as u8)
            .collect()
    }

    /// splitmix64: random bytes without a dependency.
    struct Mix(u64);

    impl Mix {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }

    fn uniform(n: usize, seed: u64) -> Vec<u8> {
        let mut mix = Mix(seed);
        (0..n).map(|_| mix.next() as u8).collect()
    }

    /// Bytes shaped like e4m3 weights: a random sign, an exponent of 12 half the time, 11 a
    /// quarter, and so on down to 0, a uniform 3-bit mantissa (about 6 bits of entropy a byte).
    fn fp8_like(n: usize, seed: u64) -> Vec<u8> {
        let mut mix = Mix(seed);
        (0..n)
            .map(|_| {
                let r = mix.next();
                let exponent = 12 - (r >> 32).trailing_zeros().min(12) as u8;
                (r as u8 & 0x80) | (exponent << 3) | (r as u8 & 7)
            })
            .collect()
    }

    fn round_trip(data: &[u8], lanes: u32) -> Coded {
        let c = encode(data, lanes).expect("encodes");
        assert_eq!(c.n, data.len() as u64);
        assert_eq!(c.states.len(), lanes as usize);
        assert_eq!(c.offsets.len(), lanes as usize + 1);
        assert_eq!(c.freq.iter().map(|&f| u32::from(f)).sum::<u32>(), TOTAL);
        let back = decode(&c).expect("decodes");
        assert!(
            back == data,
            "{} bytes in {lanes} lanes: decoded differently",
            data.len()
        );
        c
    }

    #[test]
    fn round_trips() {
        round_trip(&uniform(100_000, 1), 64);
        round_trip(&fp8_like(200_000, 2), 256);
        round_trip(&skew(50_000), 100);
        round_trip(&formula(7_777), 33);
        // n not a multiple of the lanes, n below the lanes, n = 1, one lane.
        round_trip(&fp8_like(1001, 3), 10);
        round_trip(&fp8_like(5, 4), 64);
        round_trip(&[42], 1);
        round_trip(&[42], 8);
        round_trip(&fp8_like(5000, 5), 1);
        round_trip(&uniform(3000, 6), 1);
    }

    #[test]
    fn one_byte_repeated_codes_to_no_words() {
        let c = round_trip(&[0x3C; 10_000], 16);
        assert_eq!(c.freq[0x3C], 4096);
        assert!(c.words.is_empty());
        assert_eq!(c.states, vec![STATE_MIN; 16]);
    }

    #[test]
    fn skewed_4_mib_in_65536_lanes() {
        let data = fp8_like(4 << 20, 7);
        let c = round_trip(&data, 65536);
        // A skewed buffer codes smaller than it is.
        assert!(
            c.nbytes() < data.len() as u64 * 7 / 8,
            "{} bytes",
            c.nbytes()
        );
    }

    #[test]
    fn blocks_do_not_change_the_coding() {
        for (data, lanes) in [(fp8_like(6001, 8), 2500), (skew(20_000), 130)] {
            let whole = encode(&data, lanes).expect("encodes");
            for block in [1, 7, 64, 1000, 4096] {
                let c = encode_in_blocks(&data, lanes, Some(block)).expect("encodes");
                assert!(c == whole, "{lanes} lanes in blocks of {block}");
                // Decoded in blocks, a row at a time or several.
                for parts in [1, 100, 1 << 16] {
                    let back = decode_in_blocks(&c, Some(block), parts).expect("decodes");
                    assert!(
                        back == data,
                        "{lanes} lanes in blocks of {block}, {parts} parts"
                    );
                }
            }
        }
    }

    #[test]
    fn the_reciprocal_divides_exactly() {
        let mut mix = Mix(8);
        for f in 1..=TOTAL {
            let symbol = EncoderSymbol::new(0, f);
            let f = u64::from(f);
            let edges = [0, 1, f - 1, f, f + 1, (1 << 32) - 1, (1 << 32) - f, f << 20];
            let random = (0..64).map(|_| mix.next() >> 32);
            for x in edges.into_iter().chain(random).filter(|&x| x < 1 << 32) {
                assert_eq!(symbol.quotient(x), x / f, "{x} / {f}");
            }
        }
    }

    /// Python's `rans8.frequencies` on a few counts: an excess shared by two tied bytes, a
    /// shortfall, a three-way tie, and an excess that only one byte can give (the others stay
    /// at 1). The FNV of freq, and its larger entries. From:
    ///
    /// ```text
    /// cd /work/main && .venv/bin/python - <<'EOF'
    /// import numpy as np
    /// from tests.bench import rans8
    /// def fnv(a):
    ///     h = 0xCBF29CE484222325
    ///     for v in a.tolist():
    ///         h = ((h ^ v) * 0x100000001B3) % 2**64
    ///     return hex(h)
    /// for counts in ([1] * 200 + [100000] * 2 + [0] * 54, [3, 5, 0, 7, 7, 11] + [0] * 250,
    ///                [0, 10, 10, 10] + [1] * 252, [1] * 9 + [10**6] + [1] * 246):
    ///     f = rans8.frequencies(np.array(counts, np.int64))
    ///     print("frequencies", fnv(f), [(s, int(v)) for s, v in enumerate(f) if v > 14])
    /// EOF
    /// ```
    #[test]
    fn frequencies_match_python() {
        let count = |parts: &[(u64, usize)]| {
            let all: Vec<u64> = (parts.iter())
                .flat_map(|&(c, times)| std::iter::repeat_n(c, times))
                .collect();
            <[u64; 256]>::try_from(all).expect("256 counts")
        };
        let cases: [(_, u64, &[(usize, u16)]); 4] = [
            (
                count(&[(1, 200), (100_000, 2), (0, 54)]),
                0xbf1f6c32d43b26e5,
                &[(200, 1948), (201, 1948)],
            ),
            (
                count(&[(3, 1), (5, 1), (0, 1), (7, 2), (11, 1), (0, 250)]),
                0x7e865a1992ccf835,
                &[(0, 372), (1, 620), (3, 868), (4, 868), (5, 1368)],
            ),
            (
                count(&[(0, 1), (10, 3), (1, 252)]),
                0x882bc4ec8e5a97d,
                &[(1, 278), (2, 145), (3, 145)],
            ),
            (
                count(&[(1, 9), (1_000_000, 1), (1, 246)]),
                0x885076baa8ba925,
                &[(9, 3841)],
            ),
        ];
        for (counts, hash, large) in cases {
            let freq = frequencies(&counts);
            let got: Vec<(usize, u16)> = (freq.iter().enumerate())
                .filter(|&(_, &f)| f > 14)
                .map(|(s, &f)| (s, f))
                .collect();
            assert_eq!(got, large);
            assert_eq!(fnv(freq.iter().map(|&f| u64::from(f))), hash, "{freq:?}");
        }
        assert_eq!(frequencies(&[0; 256]), [0; 256]);
    }

    /// Either every value, or the FNV of them.
    enum Listed {
        All(&'static [u32]),
        Fnv(u64),
    }

    impl Listed {
        fn check(&self, got: &[u32], what: &str) {
            match self {
                Listed::All(want) => assert_eq!(got, *want, "{what}"),
                Listed::Fnv(want) => {
                    assert_eq!(
                        fnv(got.iter().map(|&v| u64::from(v))),
                        *want,
                        "{what}: {got:?}"
                    )
                }
            }
        }
    }

    /// `rans8.encode` of a generated buffer, as Python gave it.
    struct Golden {
        data: fn(usize) -> Vec<u8>,
        n: usize,
        lanes: u32,
        freq_fnv: u64,
        states: Listed,
        offsets: Listed,
        words: usize,
        words_fnv: u64,
        /// The first and last words (none when there are none).
        ends: &'static [u16],
        nbytes: u64,
    }

    /// Python's `rans8.encode` on `skew`, `formula` and `flipped` bytes (the same functions in
    /// Python): the FNV of freq, the states and offsets (their FNV where there are more than 64
    /// lanes), the words' count, FNV, first and last, and `nbytes`. From:
    ///
    /// ```text
    /// cd /work/main && .venv/bin/python - <<'EOF'
    /// import numpy as np
    /// from tests.bench import rans8
    ///
    /// def fnv(a):
    ///     h = 0xCBF29CE484222325
    ///     for v in a.tolist():
    ///         h = ((h ^ v) * 0x100000001B3) % 2**64
    ///     return hex(h)
    ///
    /// def skew(n):
    ///     h = [(i * 2654435761) % 2**32 for i in range(n)]
    ///     return np.array([((x >> 8) % 256) * ((x >> 16) % 256) >> 8 for x in h], np.uint8)
    ///
    /// def formula(n):
    ///     return np.array([((i * 2654435761) >> 7) % 251 for i in range(n)], np.uint8)
    ///
    /// def flipped(n):
    ///     return 255 - skew(n)
    ///
    /// for gen, n, k in [("skew", 1000, 8), ("skew", 37, 16), ("formula", 300, 3),
    ///                   ("skew", 100000, 64), ("skew", 5, 1), ("skew", 4099, 1024),
    ///                   ("flipped", 1001, 10)]:
    ///     c = rans8.encode(eval(gen)(n), k)
    ///     w = c.words.astype(np.int64)
    ///     full = k <= 64
    ///     states = c.states.tolist() if full else fnv(c.states.astype(np.int64))
    ///     offsets = c.offsets.tolist() if full else fnv(c.offsets.astype(np.int64))
    ///     ends = [int(w[0]), int(w[-1])] if len(w) else []
    ///     print(f"{gen} {n} {k} freq {fnv(c.freq)} states {states} offsets {offsets} "
    ///           f"words {len(w)} {fnv(w)} {ends} nbytes {c.nbytes()}")
    /// EOF
    /// ```
    const GOLDEN: [Golden; 7] = [
        Golden {
            data: skew,
            n: 1000,
            lanes: 8,
            freq_fnv: 0x37e67df54f6daa69,
            states: Listed::All(&[
                73897, 2886653331, 43412606, 107625018, 1458067, 4612693, 3046418883, 87981,
            ]),
            offsets: Listed::All(&[0, 56, 111, 168, 224, 280, 336, 392, 448]),
            words: 448,
            words_fnv: 0x269bb40c80755c6d,
            ends: &[36465, 997],
            nbytes: 1476,
        },
        Golden {
            data: skew,
            n: 37,
            lanes: 16,
            freq_fnv: 0x5480bca8161694fd,
            states: Listed::All(&[
                1537310722, 837657961, 3380431949, 1537866270, 837558101, 1533723139, 1533696340,
                763401992, 1533628025, 1533700546, 1533674979, 763397125, 763374769, 1533671103,
                763355403, 1533719153,
            ]),
            offsets: Listed::All(&[0; 17]),
            words: 0,
            words_fnv: 0xcbf29ce484222325,
            ends: &[],
            nbytes: 644,
        },
        Golden {
            data: formula,
            n: 300,
            lanes: 3,
            freq_fnv: 0x2322c759ab73c8d3,
            states: Listed::All(&[137146489, 1462909526, 60396720]),
            offsets: Listed::All(&[0, 48, 96, 144]),
            words: 144,
            words_fnv: 0x52f7e8c055902f98,
            ends: &[32015, 48988],
            nbytes: 828,
        },
        Golden {
            data: skew,
            n: 100_000,
            lanes: 64,
            freq_fnv: 0x7bf047bc17b22cb1,
            states: Listed::All(&[
                5595335, 67010, 203942, 92790, 3829664, 148099, 248482301, 116696, 44953227,
                3402302, 3038144123, 260470072, 199894, 149290, 32793130, 4231979734, 2353809,
                1168317, 25886139, 604106903, 146348001, 2473512, 134096, 565178347, 488740090,
                23411724, 559450, 106326, 343638561, 8001863, 8353466, 54689286, 61651111, 640446,
                3054732328, 1998752787, 570709, 42635627, 24482193, 2350770608, 90446, 1500851456,
                116103, 203151100, 105883, 1511594710, 83443662, 2641552407, 12127086, 7858227,
                11894516, 3678620, 190578, 501090, 247442789, 449640135, 37749996, 1688277, 441175,
                2152977131, 8314966, 131557641, 243946, 171714,
            ]),
            offsets: Listed::All(&[
                0, 723, 1445, 2166, 2887, 3609, 4332, 5053, 5774, 6495, 7217, 7939, 8660, 9381,
                10103, 10825, 11546, 12267, 12988, 13710, 14431, 15152, 15873, 16595, 17317, 18038,
                18759, 19480, 20203, 20925, 21645, 22366, 23087, 23809, 24531, 25251, 25971, 26693,
                27415, 28136, 28856, 29577, 30299, 31021, 31742, 32463, 33183, 33905, 34626, 35347,
                36068, 36790, 37512, 38233, 38954, 39675, 40397, 41118, 41839, 42560, 43281, 44003,
                44724, 45445, 46166,
            ]),
            words: 46166,
            words_fnv: 0xb971fdc50858956f,
            ends: &[3791, 61872],
            nbytes: 93360,
        },
        Golden {
            data: skew,
            n: 5,
            lanes: 1,
            freq_fnv: 0x340ed25141907033,
            states: Listed::All(&[206975580]),
            offsets: Listed::All(&[0, 0]),
            words: 0,
            words_fnv: 0xcbf29ce484222325,
            ends: &[],
            nbytes: 524,
        },
        Golden {
            data: skew,
            n: 4099,
            lanes: 1024,
            freq_fnv: 0x66d63bd89ad83a0f,
            states: Listed::Fnv(0xd3819f0f2de10281),
            offsets: Listed::Fnv(0x46673a8a6ce53dd6),
            words: 1686,
            words_fnv: 0xc22920311bfa5150,
            ends: &[44886, 22971],
            nbytes: 12080,
        },
        // The most frequent byte 255: the padding of the last row is not 0.
        Golden {
            data: flipped,
            n: 1001,
            lanes: 10,
            freq_fnv: 0xa68e1804e4e7e831,
            states: Listed::All(&[
                1564587, 2871708266, 5038978, 6104518, 344175, 2825601, 198217, 4589656, 10985868,
                2029058,
            ]),
            offsets: Listed::All(&[0, 44, 88, 134, 178, 223, 269, 316, 360, 405, 451]),
            words: 451,
            words_fnv: 0xb6c6e031d86da093,
            ends: &[18509, 41801],
            nbytes: 1498,
        },
    ];

    #[test]
    fn encode_matches_python() {
        for g in &GOLDEN {
            let data = (g.data)(g.n);
            // The default blocks, and blocks of 5 and 64 lanes (several blocks, a short last).
            for block in [None, Some(5), Some(64)] {
                let what = format!("{} bytes in {} lanes, blocks {block:?}", g.n, g.lanes);
                let c = encode_in_blocks(&data, g.lanes, block).expect("encodes");
                let freq = fnv(c.freq.iter().map(|&f| u64::from(f)));
                assert_eq!(freq, g.freq_fnv, "{what}: freq {:?}", c.freq);
                g.states.check(&c.states, &format!("{what}: states"));
                g.offsets.check(&c.offsets, &format!("{what}: offsets"));
                assert_eq!(c.words.len(), g.words, "{what}: words");
                let ends: Vec<u16> = (c.words.first().into_iter())
                    .chain(c.words.last())
                    .copied()
                    .collect();
                assert_eq!(ends, g.ends, "{what}: first and last words");
                let words = fnv(c.words.iter().map(|&w| u64::from(w)));
                assert_eq!(words, g.words_fnv, "{what}: words");
                assert_eq!(c.nbytes(), g.nbytes, "{what}: nbytes");
                assert!(decode(&c).expect("decodes") == data, "{what}: decoded");
            }
        }
    }

    #[test]
    fn encode_refuses_no_lanes_and_no_data() {
        let no_lanes = encode(&[1, 2, 3], 0).expect_err("no lanes");
        assert_eq!(no_lanes.to_string(), "lanes must be at least 1");
        let empty = encode(&[], 4).expect_err("no data");
        assert_eq!(empty.to_string(), "nothing to code: data is empty");
    }

    /// A valid coding to break: 2000 skewed bytes in 8 lanes (every lane has words).
    fn valid() -> Coded {
        let c = encode(&skew(2000), 8).expect("encodes");
        assert!(c.offsets.windows(2).all(|w| w[0] < w[1]));
        c
    }

    fn refusal(c: &Coded) -> String {
        decode(c).expect_err("refused").to_string()
    }

    #[test]
    fn decode_refuses_malformed_codings() {
        let mut c = valid();
        c.lanes = 0;
        assert_eq!(refusal(&c), "lanes must be at least 1");

        let mut c = valid();
        c.n = 0;
        assert_eq!(
            refusal(&c),
            "n must be at least 1: a coded buffer holds at least one byte"
        );

        let mut c = valid();
        c.n = u64::MAX;
        assert_eq!(
            refusal(&c),
            format!("n = {} bytes cannot be allocated here", u64::MAX)
        );

        let mut c = valid();
        c.freq[0] += 1;
        assert_eq!(refusal(&c), "freq sums to 4097, not 4096");

        let mut c = valid();
        c.freq[0] = 0;
        c.freq[1] = 0;
        assert!(refusal(&c).starts_with("freq sums to "));

        let mut c = valid();
        c.states.pop();
        assert_eq!(refusal(&c), "states holds 7 entries, not lanes = 8");

        let mut c = valid();
        c.offsets.push(c.words.len() as u32);
        assert_eq!(refusal(&c), "offsets holds 10 entries, not lanes + 1 = 9");

        let mut c = valid();
        c.lanes = u32::MAX;
        assert_eq!(
            refusal(&c),
            format!("states holds 8 entries, not lanes = {}", u32::MAX)
        );

        let mut c = valid();
        c.offsets[0] = 1;
        assert_eq!(refusal(&c), "offsets[0] is 1, not 0");

        let mut c = valid();
        c.offsets.swap(3, 4);
        let (a, b) = (c.offsets[3], c.offsets[4]);
        let want = format!("offsets decrease at lane 3: offsets[3] = {a} > offsets[4] = {b}");
        assert_eq!(refusal(&c), want);

        let mut c = valid();
        let words = c.words.len();
        c.words.pop();
        let want = format!(
            "offsets end at {words}, not at the length of words ({})",
            words - 1
        );
        assert_eq!(refusal(&c), want);

        let mut c = valid();
        c.words.push(0);
        let want = format!(
            "offsets end at {words}, not at the length of words ({})",
            words + 1
        );
        assert_eq!(refusal(&c), want);

        let mut c = valid();
        c.states[5] = 65535;
        let want = "states[5] = 65535 is below 65536: a state is kept in [2^16, 2^32)";
        assert_eq!(refusal(&c), want);
    }

    #[test]
    fn decode_refuses_lanes_that_misread_their_words() {
        // Lane 0 a word short: it reads past its end.
        let mut c = valid();
        c.offsets[1] -= 1;
        let end = c.offsets[1];
        let message = refusal(&c);
        let want = format!("lane 0 reads past its words (they end at offsets[1] = {end}) at step");
        assert!(message.starts_with(&want), "{message}");

        // The last lane a word long: it leaves one unread.
        let mut c = valid();
        let (start, end) = (c.offsets[7], c.offsets[8]);
        c.words.push(1234);
        c.offsets[8] += 1;
        let read = end - start;
        let want = format!(
            "lane 7 read {read} words, not the {} its offsets give",
            read + 1
        );
        assert_eq!(refusal(&c), want);

        // One lane, one byte that takes every slot, no words: a state other than 2^16 decodes
        // to another (a state set that is not the encoder's).
        let mut c = encode(&[9], 1).expect("encodes");
        assert!(c.words.is_empty());
        c.states[0] = STATE_MIN + 1;
        let want = "lane 0 ends in state 65537, not 65536: the coded data is corrupt";
        assert_eq!(refusal(&c), want);

        // Words scrambled: refused somehow, never a panic.
        let mut c = valid();
        c.words.reverse();
        assert!(decode(&c).is_err());
        let mut c = valid();
        c.states.reverse();
        assert!(decode(&c).is_err());
    }

    /// Valid codings with one thing changed at random: refused or decoded, never a panic (the
    /// tests run with overflow checks).
    #[test]
    fn decode_never_panics() {
        let mut mix = Mix(10);
        let base = encode(&fp8_like(3000, 11), 37).expect("encodes");
        for _ in 0..2000 {
            let mut c = base.clone();
            let r = mix.next();
            let pick = |len: usize| (r >> 8) as usize % len.max(1);
            let (word, state, offset) = (
                pick(c.words.len()),
                pick(c.states.len()),
                pick(c.offsets.len()),
            );
            match r % 8 {
                0 => c.words[word] ^= (r >> 40) as u16 | 1,
                1 => c.states[state] = (r >> 32) as u32,
                2 => c.states[state] = STATE_MIN + (r >> 48) as u32,
                3 => c.offsets[offset] = (r >> 40) as u32 % 3000,
                4 => {
                    // One slot moved from a byte to another: still 4096.
                    let (from, to) = (pick(256), (r >> 32) as usize % 256);
                    if c.freq[from] > 0 {
                        c.freq[from] -= 1;
                        c.freq[to] += 1;
                    }
                }
                5 => c.n = (r >> 32) % 5000,
                6 => c.lanes = (r >> 32) as u32 % 64,
                _ => c.words.truncate(pick(c.words.len())),
            }
            let _ = decode(&c);
        }
    }

    #[test]
    fn nbytes_counts_every_array() {
        let c = encode(&skew(1000), 8).expect("encodes");
        let want = 512 + 4 * 8 + 4 * 9 + 2 * c.words.len() as u64;
        assert_eq!(c.nbytes(), want);
    }

    /// Encodes 256 MiB of fp8-like bytes in 65536 lanes and decodes them, printing MB/s.
    #[test]
    #[ignore = "a benchmark: run with --ignored --nocapture in release"]
    fn speed() {
        let data = fp8_like(256 << 20, 9);
        let threads = thread_count(usize::MAX);
        let mb = data.len() as f64 / 1e6;
        let begin = std::time::Instant::now();
        let c = encode(&data, 65536).expect("encodes");
        let encode_s = begin.elapsed().as_secs_f64();
        let begin = std::time::Instant::now();
        let back = decode(&c).expect("decodes");
        let decode_s = begin.elapsed().as_secs_f64();
        assert!(back == data);
        println!(
            "rans8, {mb:.0} MB in 65536 lanes on {threads} threads: coded to {:.1}%, encode \
             {:.0} MB/s, decode {:.0} MB/s",
            100.0 * c.nbytes() as f64 / data.len() as f64,
            mb / encode_s,
            mb / decode_s,
        );
    }
}
