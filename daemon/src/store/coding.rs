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
//! Memory: the coded tensors' arrays live on the heap until the new arena is made (about the
//! coded size), and the filled arena until the new one is written: at the peak the uncoded
//! bytes, the coded ones and the new arena's (the last reserved from the host quota as
//! "coded model").

use super::rans8::{self, Coded};
use super::safetensors::DType;
use super::{Store, StoreError, StoredTensor, TENSOR_ALIGN};
use crate::mem::align_up;
use crate::mem::shm::ShmSegment;

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
    /// `tensors` of `segment` coded as `coding` says: a new segment of the coded size, and
    /// where each tensor is there (`segment` dropped); `segment` and `tensors` as they are where
    /// nothing is worth coding. The new segment is reserved from `uid`'s host quota while both
    /// exist.
    pub(super) fn code(
        &self,
        uid: u32,
        segment: ShmSegment,
        tensors: Vec<StoredTensor>,
        coding: Coding,
    ) -> Result<(ShmSegment, Vec<StoredTensor>), StoreError> {
        if coding == Coding::None {
            return Ok((segment, tensors));
        }
        let src = segment.bytes();
        let mut coded: Vec<Option<Coded>> = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let bytes = &src[t.offset as usize..(t.offset + t.nbytes) as usize];
            // A tensor the coder refuses (one whose words 32-bit offsets cannot address: more
            // than 8 GiB coded) stays as it is.
            let c = codable(t).then(|| rans8::encode(bytes, rans8::lanes_for(t.nbytes)));
            let c = c.and_then(|c| {
                c.inspect_err(|e| tracing::warn!(tensor = %t.name, "not coded: {e}"))
                    .ok()
            });
            coded.push(c.filter(|c| c.blob_nbytes() <= t.nbytes - t.nbytes / MIN_SAVING));
        }
        if coded.iter().all(Option::is_none) {
            return Ok((segment, tensors));
        }
        let mut placed = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for (t, c) in tensors.iter().zip(&coded) {
            offset = align_up(offset, TENSOR_ALIGN);
            let mut p = t.clone();
            p.offset = offset;
            if let Some(c) = c {
                p.nbytes = c.blob_nbytes();
                p.coded = Some(CodedLayout {
                    coding,
                    lanes: c.lanes,
                    decoded_nbytes: t.nbytes,
                });
            }
            offset += p.nbytes;
            placed.push(p);
        }
        let size = align_up(offset, TENSOR_ALIGN);
        let reserved = self.reserve(uid, size, false, "coded model")?;
        let mut out = (self.shm)
            .create("model", size)
            .map_err(|source| StoreError::Arena {
                bytes: size,
                source,
            })?;
        let arena = out.bytes_mut().expect("a new segment is writable");
        for ((t, p), c) in tensors.iter().zip(&placed).zip(coded) {
            let dst = &mut arena[p.offset as usize..(p.offset + p.nbytes) as usize];
            match c {
                Some(c) => c.write_blob(dst),
                None => {
                    dst.copy_from_slice(&src[t.offset as usize..(t.offset + t.nbytes) as usize])
                }
            }
        }
        // The new arena counts itself once its model is inserted; until then the caller's
        // reservation of the uncoded bytes covers it (the coded arena is never larger).
        drop((reserved, segment));
        Ok((out, placed))
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::unix::fs::FileExt;

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

    #[test]
    fn a_coded_id_is_another_model_of_the_same_kind() {
        assert_eq!(coded_id("u-abc", Coding::None), "u-abc");
        let coded = coded_id("u-abc", Coding::Rans8);
        assert!(coded.starts_with("u-") && coded.len() == 34, "{coded}");
        assert_ne!(coded, coded_id("u-abd", Coding::Rans8));
    }
}
