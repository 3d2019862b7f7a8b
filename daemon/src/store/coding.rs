//! Lossless coding of a model's host copy (`Coding`): after a load or a commit has filled an
//! arena, the tensors worth coding are coded ([`rans8`]) into a new arena of the coded size,
//! and the filled one goes. A group then holds a coded tensor's blob where it held its bytes:
//! fewer bytes over the link, decoded by the client on the device after the copy.
//!
//! Coded: a tensor of a one-byte dtype (8-bit data, quantized or not: its scales and padding
//! are coded with it, as one buffer) of at least [`MIN_CODED_BYTES`], where its blob saves at
//! least 1/[`MIN_SAVING`] of its bytes. The rest is copied as it is. The coding is
//! deterministic (the blob is a function of the bytes and [`rans8::lanes_for`]), so a model's
//! id is its uncoded content's with the coding added ([`coded_id`]).
//!
//! Memory: one tensor's blob is on the heap at a time. A load's arena is coded in place and cut
//! to the coded size: the load's peak is its uncoded arena. An upload's region (sealed, its
//! uploader's) is coded into a new arena whose pages are reserved, in memory and from the host
//! quota, as they are written: at the peak the uncoded bytes and the coded ones.

use super::rans8::{self, Coded};
use super::reserve::Reservation;
use super::safetensors::DType;
use super::{Store, StoreError, StoredTensor, TENSOR_ALIGN};
use crate::mem::align_up;
use crate::mem::shm::{Pages, ShmSegment};

/// How a model's tensors are held in its host copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Coding {
    /// As their dtype and quantization say.
    #[default]
    None,
    /// Interleaved rANS over bytes ([`rans8`]), where it saves.
    Rans8,
}

impl Coding {
    /// Its name in ids and logs.
    pub fn name(self) -> &'static str {
        match self {
            Coding::None => "none",
            Coding::Rans8 => "rans8",
        }
    }
}

/// A coded tensor: its `StoredTensor::nbytes` are the blob's; these, what it decodes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodedLayout {
    pub coding: Coding,
    /// Its coder's lanes.
    pub lanes: u32,
    /// Its bytes once decoded (data, padding and scales of a quantized tensor).
    pub decoded_nbytes: u64,
}

/// The fewest bytes a tensor codes at: below, the table (16 KiB) and a launch cost more than
/// the link time the coding spares.
pub const MIN_CODED_BYTES: u64 = 1 << 20;
/// A tensor is coded where its blob saves at least 1/`MIN_SAVING` of its bytes.
pub const MIN_SAVING: u64 = 32;

/// Whether a tensor is of the kind the coder is made for: one-byte elements.
fn codable(t: &StoredTensor) -> bool {
    matches!(
        t.dtype,
        DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2
    ) && t.coded.is_none()
        && t.nbytes >= MIN_CODED_BYTES
}

/// The id of the model whose uncoded content has id `id`, coded as `coding` says.
pub fn coded_id(id: &str, coding: Coding) -> String {
    match coding {
        Coding::None => id.to_string(),
        Coding::Rans8 => {
            let digest = blake3::hash(format!("{id}\0{}", coding.name()).as_bytes());
            let prefix = id.split('-').next().unwrap_or("m");
            format!("{prefix}-{}", &digest.to_hex()[..32])
        }
    }
}

impl Store {
    /// `tensors` of `segment` coded as `coding` says: the segment of the coded size and where
    /// each tensor is there; `segment` and `tensors` as they are where nothing is worth coding.
    ///
    /// Tensors are written one at a time in their order in `segment`, each where the last one
    /// ended (aligned), so one tensor's blob is on the heap at a time. A segment the daemon
    /// writes and may shrink ([`Shm::create_shrinkable`], a load's) is coded in place: a
    /// tensor's new place never starts past its old one, which has been read by then. Any
    /// other (a sealed upload) is coded into a new shrinkable segment of its size, made at the
    /// first tensor worth coding (none: `segment` is left as it is), whose pages are reserved,
    /// in memory and from `uid`'s host quota (while both exist), as they are written. Either is
    /// then shrunk to the coded size.
    ///
    /// [`Shm::create_shrinkable`]: crate::mem::shm::Shm::create_shrinkable
    pub(super) fn code(
        &self,
        uid: u32,
        mut segment: ShmSegment,
        tensors: Vec<StoredTensor>,
        coding: Coding,
    ) -> Result<(ShmSegment, Vec<StoredTensor>), StoreError> {
        if coding == Coding::None {
            return Ok((segment, tensors));
        }
        let arena_error = |bytes| move |source| StoreError::Arena { bytes, source };
        let in_place = segment.is_shrinkable();
        // Out of place, the new arena is made at the first tensor worth coding (the ones
        // before it copied then): an upload with none is left as it is, never copied.
        let mut out: Option<NewArena<'_>> = None;
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by_key(|&i| tensors[i].offset);
        let mut placed = tensors.clone();
        let mut end = 0u64;
        for (k, &i) in order.iter().enumerate() {
            let t = &tensors[i];
            let from = t.offset as usize..(t.offset + t.nbytes) as usize;
            let at = align_up(end, TENSOR_ALIGN);
            debug_assert!(!in_place || at <= t.offset, "a tensor moves back only");
            let coded = codable(t)
                .then(|| rans8::encode(&segment.bytes()[from.clone()], rans8::lanes_for(t.nbytes)))
                .and_then(|c| {
                    // A tensor the coder refuses (one whose words 32-bit offsets cannot
                    // address: more than 8 GiB coded) stays as it is.
                    c.inspect_err(|e| tracing::warn!(tensor = %t.name, "not coded: {e}"))
                        .ok()
                })
                .filter(|c| c.blob_nbytes() <= t.nbytes - t.nbytes / MIN_SAVING);
            let p = &mut placed[i];
            p.offset = at;
            if let Some(c) = &coded {
                p.nbytes = c.blob_nbytes();
                p.coded = Some(CodedLayout {
                    coding,
                    lanes: c.lanes,
                    decoded_nbytes: t.nbytes,
                });
            }
            end = at + p.nbytes;
            if in_place {
                let arena = writable(&mut segment);
                match coded {
                    Some(c) => c.write_blob(&mut arena[at as usize..end as usize]),
                    None if at != t.offset => arena.copy_within(from, at as usize),
                    None => {}
                }
                // The padding after it, as a new arena's: zeros, not the bytes it moved over.
                arena[end as usize..align_up(end, TENSOR_ALIGN) as usize].fill(0);
                continue;
            }
            let out = match (&mut out, &coded) {
                (Some(out), _) => out,
                (None, None) => continue,
                (None, Some(_)) => {
                    let size = segment.size();
                    let arena = (self.shm)
                        .create_shrinkable("model", size, Pages::AsWritten)
                        .map_err(arena_error(size))?;
                    let out = out.insert(NewArena {
                        store: self,
                        uid,
                        arena,
                        reserved: Vec::new(),
                    });
                    for &j in &order[..k] {
                        out.write(&placed[j], segment.bytes(), &tensors[j], None)?;
                    }
                    out
                }
            };
            out.write(&placed[i], segment.bytes(), t, coded.as_ref())?;
        }
        let size = align_up(end, TENSOR_ALIGN);
        let segment = match out {
            Some(out) => out.arena,
            None if in_place => segment,
            None => return Ok((segment, tensors)),
        };
        // The coded arena counts itself once its model is inserted; until then the caller's
        // reservation of the uncoded bytes covers it (the coded arena is never larger).
        let segment = segment.shrink_to(size).map_err(arena_error(size))?;
        Ok((segment, placed))
    }
}

/// The arena an upload is coded into, and the host bytes reserved for what is written in it.
struct NewArena<'s> {
    store: &'s Store,
    uid: u32,
    arena: ShmSegment,
    reserved: Vec<Reservation<'s>>,
}

impl NewArena<'_> {
    /// Writes tensor `to` (where it goes): `blob`, or else `from`'s bytes of `src` as they
    /// are; its pages and host bytes (to the next tensor's place) reserved first.
    fn write(
        &mut self,
        to: &StoredTensor,
        src: &[u8],
        from: &StoredTensor,
        blob: Option<&Coded>,
    ) -> Result<(), StoreError> {
        let extent = align_up(to.offset + to.nbytes, TENSOR_ALIGN) - to.offset;
        let reservation = (self.store).reserve(self.uid, extent, false, "coded model")?;
        self.reserved.push(reservation);
        (self.arena)
            .reserve_range(to.offset, to.nbytes)
            .map_err(|source| StoreError::Arena {
                bytes: to.nbytes,
                source,
            })?;
        let dst = &mut writable(&mut self.arena)[to.offset as usize..][..to.nbytes as usize];
        match blob {
            Some(c) => c.write_blob(dst),
            None => dst.copy_from_slice(&src[from.offset as usize..][..from.nbytes as usize]),
        }
        Ok(())
    }
}

/// The bytes of a segment this module made or was handed writable.
fn writable(segment: &mut ShmSegment) -> &mut [u8] {
    segment
        .bytes_mut()
        .expect("a segment coded into is writable")
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;

    use super::*;
    use crate::mem::shm::{Access, UploadPages};
    use crate::quota::HostQuota;
    use crate::store::quantize::Quantization;
    use crate::store::test_support::{me, sources, store_with};
    use crate::store::{Model, Owner, Retention, Selection, TensorDecl};

    const ME: Owner = Owner { conn: 1, uid: 7 };

    /// `n` bytes of a xorshift stream.
    fn noise(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    /// `n` bytes most of which are near 0x38 (as e4m3 codes of small weights are): a
    /// two-sided geometric spread of the stream.
    fn skewed(n: usize, seed: u64) -> Vec<u8> {
        noise(n, seed)
            .into_iter()
            .map(|b| {
                0x38u8.wrapping_add((b.trailing_zeros() as u8) * if b & 1 == 1 { 1 } else { 3 })
            })
            .collect()
    }

    /// The bytes tensor `name` of `model` decodes to (its own where it is not coded).
    fn decoded(model: &Model, name: &str) -> Vec<u8> {
        let i = model.tensor_index(name).unwrap();
        let t = &model.tensors[i];
        let slice = model.slice(i);
        match &t.coded {
            None => slice.bytes().to_vec(),
            Some(c) => {
                let coded =
                    rans8::Coded::from_blob(slice.bytes(), c.decoded_nbytes, c.lanes).unwrap();
                rans8::decode(&coded).unwrap()
            }
        }
    }

    /// Commits an upload of `tensors` (name, dtype, bytes) coded as `coding` says.
    fn commit(store: &Store, id: &str, tensors: &[(&str, DType, &[u8])], coding: Coding) -> Stored {
        let decls = (tensors.iter())
            .map(|(name, dtype, bytes)| {
                let n = bytes.len() as u64 / dtype.size();
                TensorDecl::plain(name, *dtype, vec![n], bytes.len() as u64)
            })
            .collect();
        let ticket = (store)
            .begin_upload(ME, id.into(), "m", decls, UploadPages::Reserved)
            .unwrap();
        let client = File::from(ticket.memfd.share(Access::ReadWrite).unwrap());
        for (t, (_, _, bytes)) in ticket.tensors.iter().zip(tensors) {
            client.write_all_at(bytes, t.offset).unwrap();
        }
        drop(client);
        (store)
            .commit_upload_coded(ME, id, Retention::Cached, coding)
            .unwrap()
    }

    use crate::store::Stored;

    /// A committed upload coded: its 8-bit tensors of 1 MiB or more that code to fewer bytes
    /// are held coded (and decode to their bytes exactly), the others as they were; the
    /// arena is the coded size, the upload's region gone; the same content committed coded
    /// again is the same model, and not coded is another one.
    #[test]
    fn an_upload_is_coded_where_it_saves_and_decodes_to_its_bytes() {
        let store = store_with(HostQuota::default());
        let fp8 = skewed(3 << 20, 1);
        let random = noise(2 << 20, 2);
        let small = skewed((1 << 20) - 1, 3);
        let wide = skewed(2 << 20, 4);
        let tensors: [(&str, DType, &[u8]); 4] = [
            ("fp8", DType::F8E4M3, &fp8),
            ("random", DType::U8, &random),
            ("small", DType::I8, &small),
            ("wide", DType::BF16, &wide),
        ];
        let stored = commit(&store, "up-1", &tensors, Coding::Rans8);
        let model = &stored.model;
        let coded: Vec<&str> = (model.tensors.iter())
            .filter(|t| t.coded.is_some())
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(coded, ["fp8"]);
        let t = &model.tensors[0];
        let layout = t.coded.as_ref().unwrap();
        assert_eq!((layout.coding, layout.lanes), (Coding::Rans8, 6144));
        assert_eq!(layout.decoded_nbytes, 3 << 20);
        assert!(t.nbytes < (3 << 20) * 3 / 4, "{} coded bytes", t.nbytes);
        for (name, _, bytes) in tensors {
            assert!(decoded(model, name) == bytes, "{name}");
        }
        let uncoded: u64 = tensors.iter().map(|t| t.2.len() as u64).sum();
        assert_eq!(
            model.total_bytes,
            uncoded - (3 << 20) + t.nbytes,
            "the arena holds the coded bytes"
        );
        assert_eq!(store.shm.total(), 1, "only the coded arena is left");
        assert!(stored.phases.code > std::time::Duration::ZERO);

        let again = commit(&store, "up-2", &tensors, Coding::Rans8);
        assert!(again.existed && again.model.id == model.id);
        assert!(again.phases.code.is_zero(), "found before it is coded");
        let plain = commit(&store, "up-3", &tensors, Coding::None);
        assert!(!plain.existed && plain.model.id != model.id);
        assert!(plain.model.tensors.iter().all(|t| t.coded.is_none()));
        assert_eq!(model.id, coded_id(&plain.model.id, Coding::Rans8));
    }

    /// A load quantized and coded: the quantized weight (data, padding and scales) is coded
    /// and decodes to the bytes the same load without coding holds; the coding is part of
    /// the model's id, and the same load again finds the coded model.
    #[test]
    fn a_quantized_load_is_coded_after_quantizing() {
        let dir = tempfile::tempdir().unwrap();
        let (rows, cols) = (1024usize, 1024usize);
        // Weights of a bell shape: sums of four uniform draws, in bf16.
        let draws = noise(4 * rows * cols, 5);
        let weight: Vec<u8> = (draws.chunks_exact(4))
            .flat_map(|d| {
                let x = d.iter().map(|&b| f32::from(b) - 127.5).sum::<f32>() / 4096.0;
                let bits = (x.to_bits() >> 16) as u16;
                bits.to_le_bytes()
            })
            .collect();
        let view = ::safetensors::tensor::TensorView::new(
            ::safetensors::Dtype::BF16,
            vec![rows, cols],
            &weight,
        )
        .unwrap();
        let path = dir.path().join("m.safetensors");
        ::safetensors::serialize_to_file([("l.weight", view)], None, &path).unwrap();
        let store = store_with(HostQuota::default());
        let load = |coding| {
            let how = (Quantization::Fp8E4m3Block64, coding);
            let files = sources(std::slice::from_ref(&path));
            (store)
                .load_coded(&files, "", how, &Selection::All, me(7), &mut |_, _, _| {})
                .unwrap()
        };
        let coded = load(Coding::Rans8);
        let plain = load(Coding::None);
        assert!(!coded.existed && !plain.existed);
        let (c, p) = (&coded.model.tensors[0], &plain.model.tensors[0]);
        assert_eq!(c.quantized, p.quantized);
        assert_eq!(c.coded.as_ref().unwrap().decoded_nbytes, p.nbytes);
        assert!(c.nbytes < p.nbytes);
        assert!(decoded(&coded.model, "l.weight") == plain.model.slice(0).bytes());
        assert_eq!(coded.model.id, coded_id(&plain.model.id, Coding::Rans8));
        assert!(load(Coding::Rans8).existed);
    }

    /// A segment of `tensors` (name, dtype, bytes) laid out as a load lays them out, made by
    /// `make`; and where each is.
    fn laid_out(
        tensors: &[(&str, DType, &[u8])],
        make: impl FnOnce(u64) -> ShmSegment,
    ) -> (ShmSegment, Vec<StoredTensor>) {
        let mut placed = Vec::new();
        let mut end = 0;
        for (name, dtype, bytes) in tensors {
            let offset = align_up(end, TENSOR_ALIGN);
            end = offset + bytes.len() as u64;
            placed.push(StoredTensor {
                name: name.to_string(),
                dtype: *dtype,
                shape: vec![bytes.len() as u64 / dtype.size()],
                offset,
                nbytes: bytes.len() as u64,
                quantized: None,
                label: None,
                coded: None,
            });
        }
        let mut segment = make(align_up(end, TENSOR_ALIGN));
        let arena = segment.bytes_mut().unwrap();
        for (t, (_, _, bytes)) in placed.iter().zip(tensors) {
            arena[t.offset as usize..][..bytes.len()].copy_from_slice(bytes);
        }
        (segment, placed)
    }

    /// A load's arena (shrinkable) is coded in place: the same memfd, cut to the coded size and
    /// sealed against resizing, each tensor moved back to where the one before it now ends;
    /// the bytes and places are those of the same tensors coded out of a sealed segment into a
    /// new one, and decode to the tensors' bytes.
    #[test]
    fn a_loads_arena_is_coded_in_place_and_cut_to_size() {
        let store = store_with(HostQuota::default());
        let (plain, fp8) = (noise(2 << 20, 12), skewed(3 << 20, 11));
        let (int8, tail) = (skewed(5 << 20, 13), noise(1 << 20, 14));
        let tensors: [(&str, DType, &[u8]); 4] = [
            ("plain", DType::BF16, &plain),
            ("fp8", DType::F8E4M3, &fp8),
            ("int8", DType::I8, &int8),
            ("tail", DType::BF16, &tail),
        ];
        let shm = Arc::clone(&store.shm);
        let (segment, laid) = laid_out(&tensors, |size| {
            shm.create_shrinkable("model", size, Pages::Reserved)
                .unwrap()
        });
        let inode = |s: &ShmSegment| rustix::fs::fstat(s.memfd().fd()).unwrap().st_ino;
        let before = inode(&segment);
        let (coded, placed) = store.code(7, segment, laid.clone(), Coding::Rans8).unwrap();
        assert_eq!(inode(&coded), before, "coded in place");
        let coded_names: Vec<&str> = (placed.iter())
            .filter(|t| t.coded.is_some())
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(coded_names, ["fp8", "int8"]);
        let ends: Vec<u64> = placed.iter().map(|t| t.offset + t.nbytes).collect();
        let offsets: Vec<u64> = placed.iter().map(|t| t.offset).collect();
        assert_eq!(offsets[0], 0);
        for k in 1..4 {
            assert_eq!(offsets[k], align_up(ends[k - 1], TENSOR_ALIGN), "{k}");
        }
        assert!(offsets[3] < laid[3].offset, "moved back");
        assert_eq!(coded.size(), align_up(ends[3], TENSOR_ALIGN));
        let seals = coded.memfd().seals().unwrap();
        assert!(seals.contains(rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW));
        assert_eq!(store.shm.total(), 1);

        let (sealed, laid) = laid_out(&tensors, |size| shm.create("model", size).unwrap());
        let (copy, copy_placed) = store.code(7, sealed, laid, Coding::Rans8).unwrap();
        assert_ne!(inode(&copy), before);
        assert_eq!(copy_placed, placed);
        assert!(copy.bytes() == coded.bytes(), "the same bytes either way");
        for (t, (name, _, bytes)) in placed.iter().zip(tensors) {
            let held = &coded.bytes()[t.offset as usize..(t.offset + t.nbytes) as usize];
            let back = match &t.coded {
                None => held.to_vec(),
                Some(c) => {
                    let c = rans8::Coded::from_blob(held, c.decoded_nbytes, c.lanes).unwrap();
                    rans8::decode(&c).unwrap()
                }
            };
            assert!(back == bytes, "{name}");
        }
    }

    /// A sealed segment (an upload's) of which nothing is worth coding is left as it is: the
    /// same memfd, no other made.
    #[test]
    fn an_upload_with_nothing_worth_coding_is_not_copied() {
        let store = store_with(HostQuota::default());
        let (random, wide) = (noise(2 << 20, 31), skewed(2 << 20, 32));
        let tensors: [(&str, DType, &[u8]); 2] =
            [("random", DType::U8, &random), ("wide", DType::BF16, &wide)];
        let shm = Arc::clone(&store.shm);
        let (sealed, laid) = laid_out(&tensors, |size| shm.create("model", size).unwrap());
        let inode = rustix::fs::fstat(sealed.memfd().fd()).unwrap().st_ino;
        let (same, placed) = store.code(7, sealed, laid.clone(), Coding::Rans8).unwrap();
        assert_eq!(rustix::fs::fstat(same.memfd().fd()).unwrap().st_ino, inode);
        assert_eq!(placed, laid);
        assert_eq!(store.shm.total(), 1);
    }

    /// An upload is coded into an arena counted against the quota as it is written: a uid whose
    /// quota holds the upload and its coded bytes, not two uploads, commits it coded.
    #[test]
    fn a_coded_upload_counts_the_coded_bytes_against_the_quota() {
        let fp8 = skewed(8 << 20, 21);
        let quota = HostQuota {
            per_uid_bytes: (8 << 20) + (4 << 20),
            ..HostQuota::default()
        };
        let store = store_with(quota);
        let stored = commit(
            &store,
            "up-q",
            &[("fp8", DType::F8E4M3, &fp8)],
            Coding::Rans8,
        );
        let t = &stored.model.tensors[0];
        assert!(
            t.coded.is_some() && t.nbytes < 3 << 20,
            "{} coded bytes",
            t.nbytes
        );
    }

    #[test]
    fn a_coded_id_is_another_model_of_the_same_kind() {
        assert_eq!(coded_id("u-abc", Coding::None), "u-abc");
        let coded = coded_id("u-abc", Coding::Rans8);
        assert!(coded.starts_with("u-") && coded.len() == 34, "{coded}");
        assert_ne!(coded, coded_id("u-abd", Coding::Rans8));
    }
}
