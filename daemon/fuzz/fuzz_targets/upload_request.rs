//! Any bytes as a BeginUpload request, decoded by prost and handed to the service's validation
//! layer: it accepts or names the field, never panics; what it accepts has sizes that add up.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use weightstream_client::proto;
use weightstream_daemon::config::Limits;
use weightstream_daemon::server::validate::{Check, check_name, check_upload_tensors};

fuzz_target!(|data: &[u8]| {
    let Ok(req) = proto::BeginUploadRequest::decode(data) else {
        return;
    };
    let check = Check::new(&Limits::default());
    let _ = check_name(&check, "name", &req.name);
    match check_upload_tensors(&check, &req.tensors) {
        Ok(tensors) => {
            assert_eq!(tensors.len(), req.tensors.len());
            for ((_, dtype, shape, nbytes), t) in tensors.iter().zip(&req.tensors) {
                let elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
                assert_eq!(elems.and_then(|e| e.checked_mul(dtype.size())), Some(*nbytes));
                assert!(t.nbytes == 0 || t.nbytes == *nbytes);
            }
        }
        Err(status) => assert!(!status.message().is_empty()),
    }
});
